"""One layer's decode attention with and without the cascade over shared pages, calls alternated.

SmolLM2 shapes (3 KV heads x 3 query heads each, head_dim 64, 16-token pages). Each case runs
`runner.attention.ragged_paged_attention` as the engine does without the cascade
(`num_common_pages=None`, the baseline) and with it (the pages every sequence shares: R2's
~300-token preamble is 18 pages), alternating the two calls so the machine's drift hits both.
Prints a table and one JSON line (per-case milliseconds and the baseline / cascade ratio).

    python examples/bench_attention.py [--repeats 60]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench_common import cpu_settings, json_line, print_table
from runner.attention import ragged_paged_attention

KV_HEADS, GROUP, HEAD_DIM, PAGE = 3, 3, 64, 16
TOTAL_PAGES, TABLE_WIDTH = 2048, 32


@dataclasses.dataclass(frozen=True)
class Case:
    """One decode step: `batch` sequences of about `context` tokens sharing their first `shared_pages`."""

    name: str
    batch: int
    context: int
    shared_pages: int


CASES = (
    Case("R2-like: shared 300-token preamble", 64, 330, 18),
    Case("R1-like: nothing shared", 64, 150, 0),
    Case("8 samples of one prompt", 8, 330, 18),
    Case("B=1 (its whole context is 'shared')", 1, 330, 20),
)


def run_case(case: Case, repeats: int) -> dict[str, float]:
    """Median milliseconds of the baseline and the cascade, calls alternated."""
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.standard_normal((2, KV_HEADS, TOTAL_PAGES, PAGE, HEAD_DIM), dtype=np.float32))
    tables = rng.permutation(TOTAL_PAGES)[:case.batch * TABLE_WIDTH].reshape(case.batch, TABLE_WIDTH).astype(np.int32)
    tables[:, :case.shared_pages] = tables[0, :case.shared_pages]
    kv_lens = jnp.asarray(case.context - rng.integers(0, 10, case.batch), jnp.int32)
    queries = jnp.asarray(rng.standard_normal((case.batch, KV_HEADS * GROUP, HEAD_DIM), dtype=np.float32))
    cu_q_lens = jnp.arange(case.batch + 1, dtype=jnp.int32)

    @jax.jit
    def attend(q: jax.Array, cache: jax.Array, common: jax.Array | None) -> jax.Array:
        return ragged_paged_attention(q, cache, kv_lens, jnp.asarray(tables), cu_q_lens,
                                      jnp.asarray([case.batch], jnp.int32), sm_scale=HEAD_DIM ** -0.5,
                                      max_q_len=1, num_common_pages=common)

    variants = {"baseline": None, "cascade": jnp.asarray([case.shared_pages], jnp.int32)}
    outs = {k: attend(queries, kv, c).block_until_ready() for k, c in variants.items()}
    max_diff = float(jnp.max(jnp.abs(outs["baseline"] - outs["cascade"])))
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for k, c in variants.items():
            t0 = time.perf_counter()
            attend(queries, kv, c).block_until_ready()
            times[k].append(time.perf_counter() - t0)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {"baseline_ms": ms["baseline"], "cascade_ms": ms["cascade"],
            "ratio": ms["baseline"] / ms["cascade"], "max_abs_diff": max_diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=60, help="timed calls of each variant per case")
    args = parser.parse_args()
    print(f"CPU settings: {cpu_settings()}")
    results = {}
    for case in CASES:
        results[case.name] = {**dataclasses.asdict(case), **run_case(case, args.repeats)}
    print_table(["case", "B", "context", "shared pages", "baseline ms", "cascade ms", "baseline / cascade", "max |diff|"],
                [[r["name"], r["batch"], r["context"], r["shared_pages"], f"{r['baseline_ms']:.2f}",
                  f"{r['cascade_ms']:.2f}", f"{r['ratio']:.2f}x", f"{r['max_abs_diff']:.1e}"] for r in results.values()])
    print(json_line({"bench": "attention", "repeats": args.repeats, "cases": list(results.values())}))


if __name__ == "__main__":
    main()
