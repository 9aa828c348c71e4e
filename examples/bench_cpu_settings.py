"""Which CPU settings matter for the engine on XLA's CPU backend (issue 3): one R1-style B=64 run per setting.

Each setting runs in its own subprocess (environment variables such as LD_PRELOAD and XLA_FLAGS
must be set before the process starts), back to back on the same machine:

- `default`: nothing set;
- `row_kernel_off`: `EngineConfig(cpu_row_kernel=False)` (XLA's dot for steps of <= 8 rows too);
- `amx_off`: `cpu_amx=False` (no AMX tiles: the row kernel, or XLA's dot past its 64 rows);
- `amx_from_9`: `cpu_amx_from_rows=9` (layer matmuls of 9-24 rows on AMX tiles, as before the
  2026-12-05, rather than the row kernel; differs from `default` only at B = 9..24);
- `attention_jax`: `attention_backend="jax"` (the pure-JAX paged attention instead of the C++ kernel);
- `tcmalloc`: `LD_PRELOAD` of gperftools' tcmalloc (Debian `libtcmalloc-minimal4`; skipped when absent);
- `pinned`: the process bound to cores 0..N-1 with `taskset` (on a 2-core machine this only stops
  migration to nothing else: XLA already uses every core);
- `eigen_single_thread`: `--xla_cpu_multi_thread_eigen=false` (XLA's own ops on one thread);
- `bfloat16`: the model's parameters and activations in bfloat16 instead of float32.

Workload: R1 prompts 0..B-1, `--tokens` new tokens each (greedy, EOS masked until then), one
untimed warm-up call of the same shape, then one timed call; tokens/s of the whole generate call.
`--repeats R` runs the settings in turn R times and reports medians. Ends with one JSON line.
Run: `python examples/bench_cpu_settings.py [--batch 64 --tokens 32 --repeats 1 --settings default,...]`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(batch: int, tokens: int, dtype: str, engine_kw: dict[str, object]) -> None:
    """Runs inside the subprocess: load, warm up, time one generate call, print one JSON line."""
    sys.path.insert(0, ROOT)
    from rollout import Engine, SamplingParams

    engine = Engine.from_pretrained(None, dtype=dtype, max_num_seqs=64, max_model_len=512, max_num_batched_tokens=512,
                                    **engine_kw)
    prompts = [engine.tokenizer.encode(f"Question {i}: Write a short paragraph about the number {i} and why it is "
                                       "interesting. Answer:") for i in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens)
    engine.generate(prompts, sp)
    engine.core.block_manager.invalidate_prefix_cache()
    start = time.perf_counter()
    outs = engine.generate(prompts, sp)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps(dict(tok_s=generated / seconds, seconds=seconds, tokens=generated)), flush=True)


def find_tcmalloc() -> str | None:
    hits = sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4") + glob.glob("/usr/lib/libtcmalloc_minimal.so.4"))
    return hits[0] if hits else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--settings", default=None, help="comma-separated subset of the settings (default: all)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds over the settings (alternated); medians reported")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engine-kw", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.batch, args.tokens, args.child, json.loads(args.engine_kw))
        return

    cores = os.cpu_count() or 1
    base_env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "XLA_FLAGS")}
    base_env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, os.path.abspath(__file__), "--batch", str(args.batch), "--tokens", str(args.tokens)]
    tcmalloc = find_tcmalloc()
    # (name, environment, command prefix, dtype, EngineConfig fields)
    settings: list[tuple[str, dict[str, str], list[str], str, dict[str, object]]] = [
        ("default", {}, [], "float32", {}),
        ("row_kernel_off", {}, [], "float32", {"cpu_row_kernel": False}),  # XLA's dot for <= 8 rows too
        ("amx_off", {}, [], "float32", {"cpu_amx": False}),  # the AVX-512 row kernel / XLA's dot for >= 9 rows
        ("amx_from_9", {}, [], "float32", {"cpu_amx_from_rows": 9}),  # layers' 9-24 rows on AMX, not the row kernel
        ("attention_jax", {}, [], "float32", {"attention_backend": "jax"}),  # runner.ragged_attention's while loops
        ("tcmalloc", {"LD_PRELOAD": tcmalloc} if tcmalloc else {}, [], "float32", {}),
        ("pinned", {}, ["taskset", "-c", f"0-{cores - 1}"] if shutil.which("taskset") else [], "float32", {}),
        ("eigen_single_thread", {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}, [], "float32", {}),
        ("bfloat16", {}, [], "bfloat16", {}),
    ]
    if args.settings:
        wanted = args.settings.split(",")
        unknown = set(wanted) - {name for name, *_ in settings}
        if unknown or "default" not in wanted:
            ap.error(f"--settings: unknown {sorted(unknown)} or 'default' missing (ratios are to it)")
        settings = [s for s in settings if s[0] in wanted]
    runs: dict[str, list[float]] = {name: [] for name, *_ in settings}
    print(f"R1-style greedy, B={args.batch}, {args.tokens} new tokens; {cores} cores; one subprocess per setting"
          f" and round ({args.repeats} rounds)")
    for round_ in range(args.repeats):
        for name, env, prefix, dtype, engine_kw in settings:
            if (name == "tcmalloc" and not tcmalloc) or (name == "pinned" and not prefix):
                print(f"  {name:<22} skipped (not available on this machine)")
                continue
            proc = subprocess.run(prefix + cmd + ["--child", dtype, "--engine-kw", json.dumps(engine_kw)],
                                  env={**base_env, **env}, capture_output=True, text=True, cwd=ROOT)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"  {name:<22} FAILED (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(line[len("RESULT "):])
            runs[name].append(r["tok_s"])
            print(f"  round {round_}  {name:<22} {r['tok_s']:8.1f} tok/s  ({r['seconds']:.2f}s)", flush=True)
    results = {name: (float(statistics.median(v)) if v else None) for name, v in runs.items()}
    print("median over rounds:")
    for name, tok_s in results.items():
        if tok_s is not None and results["default"]:
            print(f"  {name:<22} {tok_s:8.1f} tok/s  {tok_s / results['default']:.2f}x default")
    default = results.get("default")
    print(json.dumps(dict(benchmark="cpu_settings", batch=args.batch, tokens=args.tokens, repeats=args.repeats,
                          tok_s=results, runs=runs,
                          ratio_to_default={k: (v / default if v and default else None) for k, v in results.items()})))


if __name__ == "__main__":
    main()
