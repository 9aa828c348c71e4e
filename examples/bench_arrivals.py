"""Workload R6 (docs/benchmarks.md): steady arrivals, the agentic multi-turn RL case, over `AsyncEngine`.

64 trajectories, 4 turns each. A turn generates exactly 48 tokens (temperature 1.0, seed = trajectory
index, `min_tokens = max_tokens = 48`), streamed; then the environment appends a fixed 24-token observation
after a delay drawn from an exponential distribution (mean 50 ms, `numpy.random.default_rng(trajectory)`),
and the next turn's prompt is the whole history so far (the prefix cache serves the old part). Turn 1's
prompt is R2's prompt i. Prints the wall time of all 64 trajectories, generated tok/s, the time to first
token of turns 2-4 (p50, p99) and the p99 gap between consecutive outputs of a running stream.

    python examples/bench_arrivals.py                    # this tree
    python examples/bench_arrivals.py --compare HEAD~1   # also the code of another commit, same run

With `--compare REF` each side runs in its own process (REF from a temporary git worktree), rounds
alternated. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc

OBSERVATION = " Observation: the tool returned 3 rows; the first is 17, the second 4 and the third 9. Next:"


async def trajectories(engine: object, prompts: list[list[int]], observation: list[int], *, turns: int, tokens: int,
                       delay: float) -> dict[str, list[float] | float]:
    """Run every trajectory concurrently; the wall time, each later turn's time to first token, every gap."""
    from rollout import AsyncEngine, SamplingParams

    aengine = AsyncEngine(engine)
    ttft: list[float] = []
    gaps: list[float] = []

    async def one(i: int) -> None:
        rng = np.random.default_rng(i)
        history = list(prompts[i])
        sp = SamplingParams(temperature=1.0, seed=i, min_tokens=tokens, max_tokens=tokens, output_kind="delta")
        for turn in range(turns):
            submitted = time.perf_counter()
            last = None
            async for out in aengine.generate_stream(history, sp):
                new = out.outputs[0].token_ids
                if not new:
                    continue
                now = time.perf_counter()
                if last is None:
                    if turn > 0:
                        ttft.append(now - submitted)
                else:
                    gaps.append(now - last)
                last = now
                history += new
            if turn < turns - 1:
                await asyncio.sleep(rng.exponential(delay))
                history += observation

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    wall = time.perf_counter() - t0
    await aengine.close()
    return dict(wall=wall, ttft=ttft, gaps=gaps)


def worker(args: argparse.Namespace) -> dict[str, object]:
    """Runs in its own process with the engine of `args.code_root`: a warm-up run, then the timed one."""
    bc.use_code(args.code_root)
    from rollout import Engine

    engine = Engine.from_pretrained(None, max_num_seqs=args.trajectories, max_model_len=1024)
    engine.warmup()
    tok = engine.tokenizer
    prompts = [tok.encode(bc.r2_prompt(i)) for i in range(args.trajectories)]
    observation = tok.encode(OBSERVATION, add_special_tokens=False)[:24]
    asyncio.run(trajectories(engine, prompts, observation, turns=2, tokens=8, delay=args.delay))  # warm-up
    engine.reset_prefix_cache()
    stats0 = engine.stats()
    r = asyncio.run(trajectories(engine, prompts, observation, turns=args.turns, tokens=args.tokens,
                                 delay=args.delay))
    stats = engine.stats()
    generated = args.trajectories * args.turns * args.tokens
    return dict(wall_s=r["wall"], tok_s=generated / r["wall"], ttft_p50=float(np.percentile(r["ttft"], 50)),
                ttft_p99=float(np.percentile(r["ttft"], 99)), gap_p50=float(np.percentile(r["gaps"], 50)),
                gap_p99=float(np.percentile(r["gaps"], 99)), gap_max=float(np.max(r["gaps"])),
                prefill_steps=stats.num_prefill_steps - stats0.num_prefill_steps,
                decode_calls=stats.num_decode_steps - stats0.num_decode_steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--delay", type=float, default=0.05, help="mean environment delay, seconds")
    p.add_argument("--rounds", type=int, default=1, help="alternated rounds per side")
    p.add_argument("--compare", metavar="REF", default=None, help="a git revision measured in the same run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--code-root", default=bc.ROOT, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(bc.json_line(worker(args)))
        return
    argv = ["--trajectories", str(args.trajectories), "--turns", str(args.turns), "--tokens", str(args.tokens),
            "--delay", str(args.delay)]
    runs: dict[str, list[dict[str, object]]] = {"this": [], "ref": []}
    with bc.code_at(args.compare) as ref_root:
        for _ in range(args.rounds):
            if ref_root:
                runs["ref"].append(bc.run_worker(__file__, ref_root, argv))
            runs["this"].append(bc.run_worker(__file__, bc.ROOT, argv))
    med = {side: {k: statistics.median(float(r[k]) for r in rs) for k in rs[0]} for side, rs in runs.items() if rs}
    print(f"R6: {args.trajectories} trajectories x {args.turns} turns of {args.tokens} tokens, observations after "
          f"~{args.delay * 1e3:.0f} ms; {os.cpu_count()} cores; medians of {args.rounds} round(s)")
    rows = [["this tree" if side == "this" else args.compare, f"{m['wall_s']:.1f}", f"{m['tok_s']:.0f}",
             f"{m['ttft_p50']:.2f}", f"{m['ttft_p99']:.2f}", f"{m['gap_p99']:.2f}", f"{m['gap_max']:.2f}",
             f"{m['prefill_steps']:.0f}", f"{m['decode_calls']:.0f}"] for side, m in med.items()]
    bc.print_table(["code", "wall s", "tok/s", "TTFT p50 s", "TTFT p99 s", "gap p99 s", "gap max s", "prefill steps",
                    "decode calls"], rows)
    this = med["this"]
    result = dict(bench="arrivals", commit=bc.commit_of(), trajectories=args.trajectories, turns=args.turns,
                  tokens=args.tokens, **this)
    if "ref" in med:
        ref = med["ref"]
        result |= dict(compare=args.compare, ref=ref, wall_ratio=ref["wall_s"] / this["wall_s"],
                       gap_p99_ratio=ref["gap_p99"] / this["gap_p99"], ttft_p50_ratio=ref["ttft_p50"] / this["ttft_p50"])
        print(f"ratios {args.compare} / this tree: wall {result['wall_ratio']:.2f}, gap p99 {result['gap_p99_ratio']:.2f}, "
              f"TTFT p50 {result['ttft_p50_ratio']:.2f}")
    result["peak_rss_mib"] = bc.peak_rss_bytes() / 2**20
    print(bc.json_line(result))


if __name__ == "__main__":
    main()
