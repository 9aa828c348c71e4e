"""Workload R5 (docs/benchmarks.md): long outputs, and host work per token that must not grow with them.

B = 16 of R1's prompts, 1,536 new tokens each (`ignore_eos`), greedy, `max_model_len` 2,048, three calls:
(a) no stop strings; (b) `stop=["<never>"]`, a string that never appears (every token is checked against
it); (c) the same as (b) streamed through `add_request` / `step` with `output_kind="delta"`, every delta's
text appended. Prints tok/s of each, (b)/(a) and (c)/(a), and the host time per generated token (the
calling thread's CPU time, `time.thread_time()`, around each `step()`) over the first and the last 256
tokens of (c), and their ratio (last / first: 1.0 = no growth). (c)'s joined text must equal (b)'s.

    python examples/bench_long_outputs.py                    # this tree
    python examples/bench_long_outputs.py --compare HEAD~1   # also the code of another commit, same run

With `--compare REF` each side runs in its own process (REF from a temporary git worktree), rounds
alternated. `--tokens` and `--batch` shrink the workload for a smoke run. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc


def worker(args: argparse.Namespace) -> dict[str, object]:
    """Runs in its own process with the engine of `args.code_root`: the three calls, once each after a warm-up."""
    bc.use_code(args.code_root)
    from rollout import Engine, SamplingParams

    engine = Engine.from_pretrained(None, max_num_seqs=args.batch, max_model_len=2048, max_num_batched_tokens=512)
    prompts = [engine.tokenizer.encode(bc.r1_prompt(i)) for i in range(args.batch)]
    plain = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    never = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, stop=["<never>"])
    short = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=["<never>"])
    engine.generate(prompts, short)  # compile every program these calls use

    def call(sp: SamplingParams) -> tuple[float, list[str]]:
        engine.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, sp)
        return time.perf_counter() - t0, [o.outputs[0].text for o in outs]

    def streamed() -> tuple[float, list[str], list[tuple[int, float, int]]]:
        """(seconds, each request's joined deltas, per step: (output length before it, thread seconds, tokens))."""
        engine.reset_prefix_cache()
        delta = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, stop=["<never>"],
                               output_kind="delta")
        t0 = time.perf_counter()
        ids = [engine.add_request(p, delta) for p in prompts]
        texts = {rid: [] for rid in ids}
        lengths = dict.fromkeys(ids, 0)
        steps = []
        while engine.has_unfinished_requests():
            before = min(lengths.values())
            c0 = time.thread_time()
            outs = engine.step()
            spent = time.thread_time() - c0
            new = 0
            for out in outs:
                texts[out.request_id].append(out.outputs[0].text)
                new += len(out.outputs[0].token_ids)
                lengths[out.request_id] += len(out.outputs[0].token_ids)
            steps.append((before, spent, new))
        return time.perf_counter() - t0, ["".join(texts[rid]) for rid in ids], steps

    a_s, _ = call(plain)
    b_s, b_text = call(never)
    c_s, c_text, steps = streamed()
    generated = args.batch * args.tokens
    window = min(256, args.tokens // 4)

    def per_token(lo: int, hi: int) -> float:
        """Host seconds per generated token of the steps whose outputs reach [lo, hi)."""
        picked = [(s, n) for start, s, n in steps if n and lo <= start < hi]
        return sum(s for s, _ in picked) / max(1, sum(n for _, n in picked))

    first, last = per_token(0, window), per_token(args.tokens - window, args.tokens)
    return dict(a_tok_s=generated / a_s, b_tok_s=generated / b_s, c_tok_s=generated / c_s,
                host_us_first=first * 1e6, host_us_last=last * 1e6, same_text=c_text == b_text,
                num_steps=len(steps), window=window)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--rounds", type=int, default=1, help="alternated rounds per side")
    p.add_argument("--compare", metavar="REF", default=None, help="a git revision measured in the same run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--code-root", default=bc.ROOT, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(bc.json_line(worker(args)))
        return
    argv = ["--batch", str(args.batch), "--tokens", str(args.tokens)]
    runs: dict[str, list[dict[str, object]]] = {"this": [], "ref": []}
    with bc.code_at(args.compare) as ref_root:
        for _ in range(args.rounds):
            if ref_root:
                runs["ref"].append(bc.run_worker(__file__, ref_root, argv))
            runs["this"].append(bc.run_worker(__file__, bc.ROOT, argv))
    med = {side: {k: statistics.median(float(r[k]) for r in rs) for k in rs[0] if k != "same_text"}
           for side, rs in runs.items() if rs}
    print(f"R5: B={args.batch}, {args.tokens} new tokens, greedy, EOS ignored; {os.cpu_count()} cores; "
          f"medians of {args.rounds} round(s)")
    rows = []
    for side, m in med.items():
        name = "this tree" if side == "this" else args.compare
        rows.append([name, f"{m['a_tok_s']:.0f}", f"{m['b_tok_s']:.0f}", f"{m['c_tok_s']:.0f}",
                     f"{m['b_tok_s'] / m['a_tok_s']:.3f}", f"{m['c_tok_s'] / m['a_tok_s']:.3f}",
                     f"{m['host_us_first']:.0f}", f"{m['host_us_last']:.0f}",
                     f"{m['host_us_last'] / m['host_us_first']:.2f}"])
    bc.print_table(["code", "(a) tok/s", "(b) stop str", "(c) streamed", "(b)/(a)", "(c)/(a)", "host us/tok first",
                    "host us/tok last", "last/first"], rows)
    same = all(r["same_text"] for rs in runs.values() for r in rs)
    print(f"(c)'s joined deltas equal (b)'s text: {same}")
    this = med["this"]
    result = dict(bench="long_outputs", commit=bc.commit_of(), batch=args.batch, tokens=args.tokens,
                  b_over_a=this["b_tok_s"] / this["a_tok_s"], c_over_a=this["c_tok_s"] / this["a_tok_s"],
                  host_last_over_first=this["host_us_last"] / this["host_us_first"], same_text=same, **this)
    if "ref" in med:
        result |= dict(compare=args.compare, ref=med["ref"], ratio_a=this["a_tok_s"] / med["ref"]["a_tok_s"],
                       ratio_b=this["b_tok_s"] / med["ref"]["b_tok_s"], ratio_c=this["c_tok_s"] / med["ref"]["c_tok_s"])
    result["peak_rss_mib"] = bc.peak_rss_bytes() / 2**20
    print(bc.json_line(result))


if __name__ == "__main__":
    main()
