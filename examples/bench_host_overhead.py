"""Host overhead of the engine, and the engine's code at two commits compared on the same workload.

Workload: B prompts decoding exactly `--tokens` new tokens (EOS ignored), greedy and sampling with the
sampled token's logprob, on either the tiny random Llama of tests/test_engine.py (`--model tiny`: 2
layers, hidden 32, so the device work is near zero and the host decides throughput) or the embedded
SmolLM2-135M-Instruct (`--model smollm2`, R1's prompts of docs/benchmarks.md; `--model r2`: workload R2,
8 prompts x n = 8 and 64 distinct prompts of ~330 tokens, 64 new tokens with `--tokens 64`). Per run:
tokens/s of the whole `generate` call (median of `--repeats` after one untimed call of the same shape),
device calls, host ms per call (wall time during which no device call was in flight, i.e. between a
call's results arriving and the next launch: scheduling, input building, output processing) and that
time as a fraction of the wall time (the device-idle fraction; a lower bound: the device also idles
while `launch` pads inputs), programs compiled by the engine, peak RSS. With async scheduling a decode
call is launched before its predecessor's tokens are processed, so their host work hides. No
roofline fraction: with the tiny model the host, not memory bandwidth, is the limit.

`--compare sync` runs this tree a second time with `EngineConfig(async_scheduling=False)`;
`--compare REF` also runs the code of git revision REF (a temporary `git worktree`) on the same
workload, rounds alternated (REF, this tree, REF, ...), each side in its own process, and prints this
tree's tokens/s over REF's. Ends with one JSON line.

    python examples/bench_host_overhead.py --model tiny --batch-sizes 1,64,256,512 --compare HEAD~1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args: argparse.Namespace) -> None:
    """Measure the code under `args.code_root` (imported from there) and print one JSON line."""
    sys.path[:0] = [args.code_root, os.path.join(args.code_root, "tests")]
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np

    from rollout.engine import Engine
    from rollout.sampling_params import SamplingParams

    extra = {"async_scheduling": False} if args.sync_scheduling else {}

    if args.model == "tiny":
        from test_engine import ByteTokenizer, make_model

        model, tok = make_model(0), ByteTokenizer()
        rng = np.random.default_rng(0)
        prompts_all = [[int(t) for t in rng.integers(2, 128, 16)] for _ in range(max(args.batch_sizes))]
        make = lambda b: Engine.from_model(model, tok, max_num_seqs=b, max_model_len=args.tokens + 32,  # noqa: E731
                                           max_num_batched_tokens=max(512, 16 * b), block_size=16, **extra)
    else:
        from rollout.tokenizer import load_tokenizer

        tok = load_tokenizer(None)
        prompts_all = [tok.encode(f"Question {i}: Write a short paragraph about the number {i} and why it is "
                                  f"interesting. Answer:") for i in range(max(args.batch_sizes))]
        if args.model == "r2":  # R2's ~330-token prompts
            sys.path.insert(0, os.path.join(ROOT, "examples"))
            import bench_common as bc

            prompts_all = [tok.encode(bc.r2_prompt(i)) for i in range(64)]
        base = Engine.from_pretrained(None, max_num_seqs=max(args.batch_sizes), max_model_len=args.tokens + 448,
                                      max_num_batched_tokens=512, **extra)
        make = lambda b: base  # noqa: E731
    results = []
    for b in args.batch_sizes:
        engine = make(b)
        runner = engine.runner
        calls: list[list[float]] = []  # per device call: [launched, collected]
        if hasattr(runner, "launch"):  # launch / collect (run is collect(launch(...)))
            inner = (runner.launch, runner.collect)

            def timed_launch(batch: object, inner: tuple = inner, calls: list = calls, **kwargs: object) -> object:
                pending = inner[0](batch, **kwargs)
                calls.append([time.perf_counter(), 0.0])
                return pending

            def timed_collect(pending: object, inner: tuple = inner, calls: list = calls) -> object:
                out = inner[1](pending)
                open_calls = [c for c in calls if c[1] == 0.0]
                open_calls[0][1] = time.perf_counter()  # calls are collected in launch order
                return out

            runner.launch, runner.collect = timed_launch, timed_collect
        else:  # an older revision: one blocking run per step
            inner = (runner.run,)

            def timed_run(batch: object, inner: tuple = inner, calls: list = calls) -> object:
                start = time.perf_counter()
                out = inner[0](batch)
                calls.append([start, time.perf_counter()])
                return out

            runner.run = timed_run
        prompts = prompts_all[:b]
        modes = {"greedy": SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True),
                 "sample+logprob": SamplingParams(temperature=1.0, seed=0, max_tokens=args.tokens, ignore_eos=True,
                                                  logprobs=0)}
        if args.model == "r2":  # R2: 8 prompts x n = 8, and 64 distinct prompts (docs/benchmarks.md)
            r2 = SamplingParams(n=8, temperature=1.0, seed=0, max_tokens=args.tokens, ignore_eos=True, logprobs=0)
            modes = {"r2 8 x n=8": (prompts_all[:8], r2), "r2 64 distinct": (prompts_all, dataclasses.replace(r2, n=1))}
        for mode, sp in modes.items():
            if isinstance(sp, tuple):
                prompts, sp = sp
            engine.generate(prompts, sp)  # compiles this shape's programs
            walls, hosts, steps = [], [], []
            for _ in range(args.repeats):
                engine.reset_prefix_cache()
                calls.clear()
                start = time.perf_counter()
                outs = engine.generate(prompts, sp)
                wall = time.perf_counter() - start
                assert all(len(c.token_ids) == args.tokens for o in outs for c in o.outputs)
                walls.append(wall)
                hosts.append(wall - _union(calls))
                steps.append(len(calls))
            i = walls.index(statistics.median(walls))
            generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
            results.append(dict(batch=b, mode=mode, tok_s=generated / walls[i], steps=steps[i],
                                host_ms_per_step=1e3 * hosts[i] / max(steps[i], 1), idle_fraction=hosts[i] / walls[i],
                                compiled_programs=engine.stats().num_compilations,
                                peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
        if len(inner) == 2:
            runner.launch, runner.collect = inner
        else:
            runner.run = inner[0]
    print(json.dumps(results))


def _union(intervals: list[list[float]]) -> float:
    """Seconds covered by the [launched, collected] intervals of the device calls (device busy, an upper bound)."""
    total, end = 0.0, -1.0
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def run_side(code_root: str, args: argparse.Namespace, *, sync_scheduling: bool = False) -> list[dict]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--code-root", code_root, "--model", args.model,
           "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--tokens", str(args.tokens),
           "--repeats", str(args.repeats)] + (["--sync-scheduling"] if sync_scheduling else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("tiny", "smollm2", "r2"), default="tiny",
                   help="r2: SmolLM2 on workload R2 (8 prompts x n=8, 64 distinct; --batch-sizes 64)")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 256, 512])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="alternated rounds per side with --compare")
    p.add_argument("--compare", metavar="REF", default=None,
                   help="a git revision to measure against, or 'sync': this tree with async scheduling off")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sync-scheduling", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--code-root", default=ROOT, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    sides: dict[str, list[list[dict]]] = {"this": []}
    with tempfile.TemporaryDirectory() as tmp:
        ref_root = None
        if args.compare == "sync":  # this tree with async scheduling off
            sides["ref"] = []
        elif args.compare:
            ref_root = os.path.join(tmp, "ref")
            subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", ref_root, args.compare], check=True,
                           capture_output=True)
            sides["ref"] = []
        try:
            for _ in range(args.rounds):
                if ref_root or args.compare == "sync":
                    sides["ref"].append(run_side(ref_root or ROOT, args, sync_scheduling=not ref_root))
                sides["this"].append(run_side(ROOT, args))
        finally:
            if ref_root:
                subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", ref_root], capture_output=True)
    rows, summary = [], []
    for i, r in enumerate(sides["this"][0]):
        this_tok = statistics.median(run[i]["tok_s"] for run in sides["this"])
        ref_tok = statistics.median(run[i]["tok_s"] for run in sides["ref"]) if "ref" in sides else None
        entry = dict(r, tok_s=this_tok, ref_tok_s=ref_tok, ratio=this_tok / ref_tok if ref_tok else None)
        summary.append(entry)
        rows.append((r["batch"], r["mode"], f"{this_tok:.0f}", "-" if ref_tok is None else f"{ref_tok:.0f}",
                     "-" if ref_tok is None else f"{this_tok / ref_tok:.3f}x", r["steps"],
                     f"{r['host_ms_per_step']:.2f}", f"{r['idle_fraction']:.2f}"))
    headers = ("B", "mode", "tok/s", f"tok/s {args.compare or '-'}", "ratio", "steps", "host ms/step", "idle")
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    for line in (headers, *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    print(json.dumps(dict(benchmark="host_overhead", model=args.model, commit=commit, compare=args.compare,
                          tokens=args.tokens, results=summary)))


if __name__ == "__main__":
    main()
