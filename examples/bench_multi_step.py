"""Multi-step decode (`num_scheduler_steps`) vs one decode step per device call, workload R1.

Two engines over the embedded SmolLM2-135M-Instruct (float32) live in one process: one with
`num_scheduler_steps=1` and one with `--steps` (default 8). For each batch size they
run R1 (prompts i = 0..B-1, 128 new tokens, EOS masked until then, greedy or sampling at
temperature 1 with seed 0) alternately, `--repeats` times each after `engine.warmup()` and one
untimed call; tokens/s = generated tokens / wall seconds of the whole generate call, median over
the repeats. Alternating the two engines call by call keeps this shared machine's drift out of the
ratio. Checks that both produce the same tokens. Ends with one JSON line.

Run: `python examples/bench_multi_step.py` (B = 1, 8, 64, greedy and sampling), `--batch-sizes 1`,
`--steps 4`, `--repeats 5`, `--quick` (B = 1, 32 tokens, 1 repeat), `--json-out out.json`.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import bench_common as bc  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="num_scheduler_steps of the multi-step engine")
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--modes", default="greedy,sampling")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.batch_sizes, args.modes, args.repeats, args.tokens = "1", "greedy", 1, 32
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]

    import jax

    from rollout import Engine, SamplingParams
    from rollout.tokenizer import load_tokenizer
    from weight_sync.compiles import num_compilations

    tok = load_tokenizer(None)
    prompts = [tok.encode(bc.r1_prompt(i)) for i in range(max(batch_sizes))]
    max_model_len = -(-(max(len(p) for p in prompts) + args.tokens) // 64) * 64
    kw = dict(max_num_seqs=max(batch_sizes), max_model_len=max_model_len, max_num_batched_tokens=512)
    engines = {1: Engine.from_pretrained(None, **kw, num_scheduler_steps=1), args.steps: Engine.from_pretrained(None, **kw, num_scheduler_steps=args.steps)}
    for steps, engine in engines.items():
        t0 = time.perf_counter()
        n = engine.warmup()
        print(f"num_scheduler_steps={steps}: warmup compiled {n} programs in {time.perf_counter() - t0:.1f}s", flush=True)

    rows, runs = [], []
    compiles_before = num_compilations()
    for b in batch_sizes:
        for mode in modes:
            sp = SamplingParams(temperature=0.0 if mode == "greedy" else 1.0, seed=0, max_tokens=args.tokens,
                                min_tokens=args.tokens)
            times: dict[int, list[float]] = {s: [] for s in engines}
            outputs: dict[int, Any] = {}
            for rep in range(args.repeats + 1):  # the first round is the untimed warm-up
                for steps, engine in engines.items():
                    engine.reset_prefix_cache()
                    t0 = time.perf_counter()
                    outputs[steps] = engine.generate(prompts[:b], sp)
                    if rep:
                        times[steps].append(time.perf_counter() - t0)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs[1])
            tok_s = {s: tokens / statistics.median(t) for s, t in times.items()}
            same = all(a.outputs[0].token_ids == c.outputs[0].token_ids
                       for a, c in zip(outputs[1], outputs[args.steps]))
            ratio = tok_s[args.steps] / tok_s[1]
            rows.append([b, mode, f"{tok_s[1]:.1f}", f"{tok_s[args.steps]:.1f}", f"{ratio:.2f}x", "yes" if same else "NO"])
            runs.append(dict(batch=b, mode=mode, tokens=tokens, tok_s_single=tok_s[1], tok_s_multi=tok_s[args.steps],
                             ratio=ratio, identical=same, seconds_single=times[1], seconds_multi=times[args.steps]))
            print(f"  B={b} {mode}: {tok_s[1]:.1f} -> {tok_s[args.steps]:.1f} tok/s ({ratio:.2f}x)", flush=True)

    print()
    bc.print_table(["B", "mode", "1 step/call tok/s", f"{args.steps} steps/call tok/s", "ratio", "identical"], rows)
    compiles = num_compilations() - compiles_before  # untimed warm-up rounds included
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; programs compiled after warmup(): {compiles}; "
          f"peak RSS {bc.mib(bc.peak_rss_bytes())}")
    print(bc.json_line(dict(bench="multi_step", steps=args.steps, repeats=args.repeats, new_tokens=args.tokens,
                            runs=runs, num_compilations=compiles, peak_rss=bc.peak_rss_bytes()), args.json_out))


if __name__ == "__main__":
    main()
