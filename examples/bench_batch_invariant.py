"""The cost of batch-invariant mode (`EngineConfig(batch_invariant=True)`): R1 on SmolLM2, the default engine
against the batch-invariant one in the same process, calls alternated.

    python examples/bench_batch_invariant.py [--batch-sizes 1,64] [--rounds 2] [--new-tokens 128]

Per B: tokens/s of each engine (sampling at temperature 1 with the sampled token's logprob, 128 new
tokens), the ratio invariant / default, and whether the target request (prompt 0) got the same raw
logprob bits alone and inside the batch under each engine. Table, then one JSON line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402
from rollout import Engine, SamplingParams, load_tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    tok = load_tokenizer(None)
    prompts = [tok.encode(bc.r1_prompt(i)) for i in range(max(sizes))]
    n = args.new_tokens
    kw = dict(max_num_seqs=64, max_model_len=256, max_num_batched_tokens=512)
    engines = {"default": Engine.from_pretrained(None, **kw), "invariant": Engine.from_pretrained(None, batch_invariant=True, **kw)}
    print("stats:", {k: (e.stats().cpu_amx, e.stats().attention_impl) for k, e in engines.items()})
    rows, result = [], {}
    for b in sizes:
        sp = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, min_tokens=n, logprobs=0) for i in range(b)]
        times: dict[str, list[float]] = {k: [] for k in engines}
        bits: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name, engine in engines.items():  # warm-up (compiles) and the target's bits alone vs in the batch
            engine.block_manager.invalidate_prefix_cache()
            alone = engine.generate(prompts[:1], sp[:1])[0].outputs[0].logprobs.values
            engine.block_manager.invalidate_prefix_cache()
            crowd = engine.generate(prompts[:b], sp)[0].outputs[0].logprobs.values
            bits[name] = (np.asarray(alone, np.float32), np.asarray(crowd, np.float32))
        for _ in range(args.rounds):
            for name, engine in engines.items():
                engine.block_manager.invalidate_prefix_cache()
                t = time.perf_counter()
                engine.generate(prompts[:b], sp)
                times[name].append(time.perf_counter() - t)
        tok_s = {k: b * n / float(np.median(v)) for k, v in times.items()}
        same = {k: bool(np.array_equal(a.view(np.uint32), c.view(np.uint32))) for k, (a, c) in bits.items()}
        result[b] = dict(tok_s=tok_s, ratio=tok_s["invariant"] / tok_s["default"], bitwise_same_alone_vs_batch=same)
        rows.append([b, f"{tok_s['default']:.1f}", f"{tok_s['invariant']:.1f}", f"{result[b]['ratio']:.3f}x",
                     same["default"], same["invariant"]])
    bc.print_table(["B", "default tok/s", "invariant tok/s", "invariant / default", "default: same bits",
                    "invariant: same bits"], rows)
    print(bc.json_line(dict(bench="batch_invariant", new_tokens=n, rounds=args.rounds,
                            runs={str(b): r for b, r in result.items()}), args.json_out))


if __name__ == "__main__":
    main()
