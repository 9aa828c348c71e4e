"""The cost of batch-invariant mode (`EngineConfig(batch_invariant=True)`), measured in one run.

Two engines over the embedded SmolLM2-135M-Instruct (float32) in one process, the default one and the
batch-invariant one, on the same workloads (docs/benchmarks.md): R1 (B prompts, exactly `--tokens` new
tokens: greedy, sampling, sampling with the sampled token's logprob) and R2 (8 long-preamble prompts x 8
samples, 64 tokens, logprobs). Calls alternate between the engines (one untimed call of each shape
first); per run the median tokens/s of each and invariant / default. Also checks the mode's promise on
this workload: prompt 0's tokens and logprobs are bitwise the same alone (B = 1) and at the largest B.
Ends with one JSON line (tokens/s, the ratio, fraction of the decode roofline, compiled programs, peak RSS).

    python examples/bench_batch_invariant.py --batch-sizes 1,64 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import bench_common as bc  # noqa: E402
import numpy as np  # noqa: E402

from rollout.engine import Engine  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from weight_sync.compiles import num_compilations  # noqa: E402

PREAMBLE = " ".join(f"Rule {k}: answer briefly, show each step, and check the arithmetic." for k in range(1, 25))


def runs(batch_sizes: list[int], tokens: int) -> list[tuple[str, list[str], SamplingParams]]:
    """(label, prompts, params) of every run."""
    out = []
    for b in batch_sizes:
        prompts = [bc.r1_prompt(i) for i in range(b)]
        for mode, params in (("greedy", dict(temperature=0.0)), ("sample", dict(temperature=1.0, seed=0)),
                             ("sample+logprob", dict(temperature=1.0, seed=0, logprobs=0))):
            out.append((f"R1 B={b} {mode}", prompts,
                        SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, **params)))
    r2 = [f"Task {i}. {PREAMBLE} {bc.r1_prompt(i)}" for i in range(8)]
    out.append(("R2 8x8 sample+logprob", r2, SamplingParams(n=8, max_tokens=64, min_tokens=64, ignore_eos=True,
                                                            temperature=1.0, seed=0, logprobs=0)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--tokens", type=int, default=128, help="R1's new tokens per sequence")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per engine and run (alternated)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"cpu settings: {bc.cpu_settings()}", flush=True)
    machine = {**bc.measure_bandwidth(), **bc.measure_matmul_flops()}
    compiles_before = num_compilations()
    kw = dict(max_num_seqs=64, max_model_len=1024, max_num_batched_tokens=512)
    engines = {"default": Engine.from_pretrained(None, **kw),
               "invariant": Engine.from_pretrained(None, **kw, batch_invariant=True)}
    print(f"invariant engine: {engines['invariant'].stats().batch_invariant}", flush=True)

    rows, results = [], []
    for label, prompts, params in runs(batch_sizes, args.tokens):
        times: dict[str, list[float]] = {name: [] for name in engines}
        for name, eng in engines.items():  # untimed: the shape's first call
            eng.generate(prompts, params, use_tqdm=False)
        for _ in range(args.repeats):
            for name, eng in engines.items():
                t0 = time.perf_counter()
                outs = eng.generate(prompts, params, use_tqdm=False)
                times[name].append(time.perf_counter() - t0)
        num_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        tok_s = {name: num_tokens / statistics.median(t) for name, t in times.items()}
        seqs = len(prompts) * params.n
        bound = bc.roofline_tokens_per_s(seqs, machine["bandwidth"], machine["flops"])
        ratio = tok_s["invariant"] / tok_s["default"]
        results.append(dict(run=label, seqs=seqs, tok_s_default=tok_s["default"], tok_s_invariant=tok_s["invariant"],
                            ratio=ratio, roofline_fraction_invariant=tok_s["invariant"] / bound))
        rows.append([label, seqs, f"{tok_s['default']:.1f}", f"{tok_s['invariant']:.1f}", f"{ratio:.2f}x",
                     f"{1 / ratio - 1:+.0%}", f"{tok_s['invariant'] / bound:.3f}"])
        print(f"{label}: default {tok_s['default']:.1f} tok/s, invariant {tok_s['invariant']:.1f} tok/s", flush=True)
    print()
    bc.print_table(["run", "seqs", "default tok/s", "invariant tok/s", "invariant/default", "extra time",
                    "invariant/roofline"], rows)

    # the promise, on this workload: prompt 0 alone and among the largest batch
    big = max(batch_sizes)
    params = SamplingParams(max_tokens=args.tokens, min_tokens=args.tokens, ignore_eos=True, temperature=1.0, seed=0,
                            logprobs=0)

    def first(eng: Engine, b: int) -> tuple[list[int], bytes]:
        c = eng.generate([bc.r1_prompt(i) for i in range(b)], params, use_tqdm=False)[0].outputs[0]
        return c.token_ids, np.asarray(c.logprobs.values, np.float32).tobytes()

    same = {name: first(eng, 1) == first(eng, big) for name, eng in engines.items()}
    print(f"prompt 0's tokens and logprobs bitwise the same alone and among {big}: "
          + ", ".join(f"{name} {'yes' if s else 'no'}" for name, s in same.items()))
    ratios = [r["ratio"] for r in results]
    print(f"invariant / default: geometric mean {float(np.exp(np.mean(np.log(ratios)))):.2f}x, "
          f"lowest {min(ratios):.2f}x ({results[int(np.argmin(ratios))]['run']})")
    summary = dict(bench="batch_invariant", runs=results, bitwise_alone_vs_batch=same,
                   ratio_geomean=float(np.exp(np.mean(np.log(ratios)))), ratio_min=min(ratios),
                   compiled_programs=num_compilations() - compiles_before, peak_rss_bytes=bc.peak_rss_bytes(),
                   bandwidth_Bps=machine["bandwidth"], flops=machine["flops"])
    print(bc.json_line(summary, args.json_out))


if __name__ == "__main__":
    main()
