"""Tests for the sampler's building blocks (runner/sampler_blocks.py, runner/sampler_filters.py) against
numpy and full-sort references: `argmax_last`, the random mode's draw over 128-wide blocks, the kept-set
and candidate shortcuts of the filters, and draws that must survive last-bit rounding or NaN logits.
Whole-sampler behaviour (modes, determinism, distributions, logprobs) is in tests/test_sampler.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from runner import sampler_blocks as blk
from runner import sampler_filters as flt
from runner.sampler import sample
from test_sampler import check_goodness_of_fit, make_inputs, np_log_softmax, ref_processed


@pytest.mark.parametrize("vocab", [1000, 1024, 129])
def test_argmax_last_matches_numpy_first_maximum(vocab: int) -> None:
    """The blocked argmax keeps numpy's rules: first index of the maximum, NaN first, all -inf -> 0."""
    rng = np.random.default_rng(vocab)
    x = rng.integers(-3, 3, size=(4, 6, vocab)).astype(np.float32)  # many exact ties, across blocks too
    x[0, 0] = -np.inf
    x[0, 1, [5, 700 % vocab]] = np.nan
    x[0, 2, -1] = 10.0  # the maximum in the padded last block
    x[0, 3, :] = 2.0
    got = np.asarray(blk.argmax_last(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    big = rng.normal(size=(64, vocab)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(blk.argmax_last(jnp.asarray(big))), big.argmax(-1))
    assert int(blk.argmax_last(jnp.asarray(big[3]))) == int(big[3].argmax())  # one row, no batch axis


def test_first_argmax_keeps_argmax_rules() -> None:
    """The two-reduction argmax of the draw's winning block: first index of the maximum, the first NaN
    where there is one, index 0 for a row of -inf; jitted as the sampler runs it."""
    rng = np.random.default_rng(7)
    x = rng.integers(-3, 3, size=(300, 128)).astype(np.float32)
    x[0] = -np.inf
    x[1, [5, 90]] = np.nan
    x[2, -1] = 10.0
    x[3] = 2.0
    x[4, [3, 64]] = -np.nan  # a NaN with its sign bit set
    got = np.asarray(jax.jit(blk.first_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    noisy = rng.normal(size=(64, 128)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(blk.first_argmax)(jnp.asarray(noisy))), noisy.argmax(-1))


@pytest.mark.parametrize("vocab", [1000, 129, 100])
def test_argmax_last_with_suppressed_ids_matches_numpy(vocab: int) -> None:
    """Suppressed ids (several in one block, at the maximum, out of range, -1, repeated) are -inf;
    the rest keeps numpy's first-maximum rule."""
    rng = np.random.default_rng(vocab)
    x = rng.integers(-3, 3, size=(6, vocab)).astype(np.float32)
    x[:, 7] = 9.0  # every row's maximum ...
    x[:, vocab - 1] = 9.0
    x[3, :] = 1.0  # a row that is all ties
    suppress = np.full((6, 4), -1, np.int32)
    suppress[0] = [7, 8, 9, -1]  # ... suppressed in row 0 (its block keeps the tie at vocab - 1)
    suppress[1] = [7, vocab - 1, vocab + 5, 7]  # both maxima, an out-of-range id, a repeat
    suppress[3] = [0, 1, 2, 130 % vocab]
    want = x.copy()
    for r, ids in enumerate(suppress):
        want[r, [i for i in ids if 0 <= i < vocab]] = -np.inf
    got = np.asarray(blk.argmax_last(jnp.asarray(x), jnp.asarray(suppress)))
    np.testing.assert_array_equal(got, want.argmax(-1))
    out = sample(jnp.asarray(x), make_inputs(6, temperature=0.0, suppress_ids=suppress, processed=True),
                 mode="greedy", num_top_logprobs=0)
    np.testing.assert_array_equal(np.asarray(out.token_ids), want.argmax(-1))
    lp = np.asarray(jax.nn.log_softmax(jnp.asarray(want), axis=-1))  # processed: the suppressed distribution
    np.testing.assert_allclose(np.asarray(out.logprobs), lp[np.arange(6), want.argmax(-1)], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("vocab", [1000, 1024])
def test_random_mode_on_blocks_matches_the_materialised_distribution(vocab: int) -> None:
    """"random" mode reads the logits only through per-block reductions; with suppressed ids (the row
    maximum, several in one block, out of range, repeated), greedy rows and both logprob kinds mixed,
    its tokens equal those of the materialised path ("filtered" without filters), greedy rows are the
    suppressed argmax, and the logprobs equal numpy's log-softmax of the raw or processed logits."""
    rows = 48
    rng = np.random.default_rng(vocab)
    logits = (rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
    logits[:, 130] = 40.0  # would dominate every row if it were not suppressed (below)
    suppress = np.full((rows, 4), -1, np.int32)
    suppress[:, 0] = 130
    suppress[::3, 1:] = [131, 255, vocab + 3]
    suppress[1::3, 1:] = [vocab - 1, 130, 0]
    temperature = np.tile(np.array([0.0, 0.7, 1.0, 1.3], np.float32), rows // 4)
    processed = np.arange(rows) % 3 != 0
    inputs = make_inputs(rows, temperature=temperature, seeds=np.arange(rows), suppress_ids=suppress,
                         processed=processed)
    out = sample(jnp.asarray(logits), inputs, mode="random")
    materialised = sample(jnp.asarray(logits), inputs, mode="filtered")
    tokens = np.asarray(out.token_ids)
    np.testing.assert_array_equal(tokens, np.asarray(materialised.token_ids))

    suppressed = logits.astype(np.float64).copy()
    for r, ids in enumerate(suppress):
        suppressed[r, [i for i in ids if 0 <= i < vocab]] = -np.inf
    assert np.all(np.isfinite(suppressed[np.arange(rows), tokens]))
    greedy = temperature == 0
    np.testing.assert_array_equal(tokens[greedy], suppressed[greedy].argmax(-1))
    with np.errstate(invalid="ignore"):
        proc = np_log_softmax(suppressed / np.where(greedy, 1.0, temperature)[:, None])
    want = np.where(processed, proc[np.arange(rows), tokens], np_log_softmax(logits)[np.arange(rows), tokens])
    np.testing.assert_allclose(np.asarray(out.logprobs), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(materialised.logprobs), rtol=1e-5, atol=1e-5)


def test_random_mode_logprobs_at_low_temperature_are_consistent() -> None:
    """At T = 1e-3 on logits near 20 (x / T ~ 2e4, where float32's ulp is ~2e-3) the processed logprob
    is taken from the same scaled values as the row maximum and the sums: never above 0, and equal to
    float64's and to the materialised path's within the float32 rounding of x / T."""
    rows, vocab, temperature = 64, 1000, 1e-3
    rng = np.random.default_rng(5)
    logits = (20 + 3 * rng.normal(size=(rows, vocab))).astype(np.float32)
    logits[::2, 17] = logits[::2].max(axis=1)  # ties at the maximum, across blocks
    inputs = make_inputs(rows, temperature=temperature, seeds=np.arange(rows), processed=True)
    out = sample(jnp.asarray(logits), inputs, mode="random")
    tokens, lp = np.asarray(out.token_ids), np.asarray(out.logprobs)
    assert np.all(lp <= 0)
    ref = np_log_softmax(logits.astype(np.float64) / temperature)[np.arange(rows), tokens]
    np.testing.assert_allclose(lp, ref, atol=4 * np.abs(logits / temperature).max() * 2.0**-24)
    filtered = np.asarray(sample(jnp.asarray(logits), inputs, mode="filtered").logprobs)
    np.testing.assert_allclose(lp, filtered, atol=4 * np.abs(logits / temperature).max() * 2.0**-24)


def test_random_mode_without_suppress_columns_equals_unused_ones() -> None:
    """No suppress-id columns at all (M = 0) gives what columns of -1 give, greedy rows included."""
    rows = 6
    logits = jnp.asarray(np.random.default_rng(9).normal(size=(rows, 300)).astype(np.float32))
    kw = dict(temperature=np.array([0.0, 1.0] * 3), seeds=np.arange(rows))
    none = sample(logits, make_inputs(rows, suppress_ids=np.zeros((rows, 0), np.int32), **kw), mode="random")
    unused = sample(logits, make_inputs(rows, **kw), mode="random")
    np.testing.assert_array_equal(np.asarray(none.token_ids), np.asarray(unused.token_ids))
    np.testing.assert_array_equal(np.asarray(none.logprobs), np.asarray(unused.logprobs))


def test_random_mode_on_blocks_matches_exact_distribution() -> None:
    """Chi-square of "random" mode over a three-block vocabulary with its two likeliest ids suppressed."""
    vocab, draws = 300, 20_000
    row = (np.random.default_rng(7).normal(size=vocab) * 2).astype(np.float32)
    banned = tuple(int(i) for i in np.argsort(-row)[:2])
    suppress = np.tile(np.array(banned + (-1,), np.int32), (draws, 1))
    inputs = make_inputs(draws, temperature=0.8, seeds=77, suppress_ids=suppress)
    tokens = np.asarray(sample(jnp.broadcast_to(jnp.asarray(row), (draws, vocab)), inputs, mode="random").token_ids)
    check_goodness_of_fit(tokens, ref_processed(row, temperature=0.8, suppress=banned))


@pytest.mark.parametrize(
    "settings",
    [dict(top_k=20), dict(top_p=0.5), dict(min_p=0.05, temperature=0.8), dict(top_p=0.8)],
    ids=["top_k", "top_p", "min_p", "top_p_fallback"],
)
def test_candidate_shortcut_matches_full_sort(settings: dict[str, float]) -> None:
    """Large vocab, 64 candidates: the top-C path (or its fallback) equals the full-sort path."""
    vocab, draws, candidates = 1024, 3000, 64
    row = (np.random.default_rng(4).normal(size=vocab) * 2.5).astype(np.float32)
    expected = ref_processed(row, **settings)
    kept = int((expected > 0).sum())
    logits = jnp.broadcast_to(jnp.asarray(row), (draws, vocab))
    inputs = make_inputs(draws, seeds=99, **settings)

    # The shortcut is exact exactly when the kept set ends before the last candidate.
    small = jax.tree.map(lambda x: x[:4], inputs)
    _, exact = flt.candidate_filter_mask(logits[:4] / small.temperature[:, None], small, jnp.ones(4, bool), candidates)
    assert bool(jnp.all(exact)) == (kept < candidates)

    fast = sample(logits, inputs, mode="filtered", num_candidates=candidates)
    full = sample(logits, inputs, mode="filtered", num_candidates=vocab)
    np.testing.assert_array_equal(np.asarray(fast.token_ids), np.asarray(full.token_ids))
    np.testing.assert_allclose(np.asarray(fast.logprobs), np.asarray(full.logprobs), atol=1e-5)
    check_goodness_of_fit(np.asarray(fast.token_ids), expected)


def test_draw_survives_last_bit_rounding_of_the_logits() -> None:
    """The same row's logits from differently shaped steps (GEMV vs GEMM) differ in the last bits; the
    draw must almost never notice. An inverse-CDF draw over a 49k vocabulary changed 5 of these 256
    here (every CDF boundary shifts); Gumbel-max changes one only at a near-tie of the two best noisy
    logits. The nudge is the size measured between SmolLM2's one-row and batched steps (~1e-5)."""
    rng = np.random.default_rng(5)
    rows, vocab = 256, 49152
    logits = (rng.standard_normal((rows, vocab)) * 2.5).astype(np.float32)
    nudged = logits + (rng.standard_normal((rows, vocab)) * 1e-5).astype(np.float32)
    inputs = make_inputs(rows, seeds=np.arange(rows), positions=3)
    for mode in ("random", "filtered"):
        a = np.asarray(sample(jnp.asarray(logits), inputs, mode=mode).token_ids)
        b = np.asarray(sample(jnp.asarray(nudged), inputs, mode=mode).token_ids)
        assert np.sum(a != b) <= 1, (mode, np.sum(a != b))


def test_draw_over_a_full_vocabulary_matches_the_distribution() -> None:
    """The per-id noise over SmolLM2's 49152 ids: chi-square of 20k draws from a Zipf-like row (top
    30 ids one by one, the other ~48% of the mass in 10 equal-mass groups)."""
    rng = np.random.default_rng(3)
    vocab, draws, chunk = 49152, 20_000, 4000
    logits = (-1.1 * np.log(np.arange(1, vocab + 1)) + 0.3 * rng.standard_normal(vocab)).astype(np.float32)
    logits = logits[rng.permutation(vocab)]
    p = np.exp(logits.astype(np.float64) - logits.max())
    p /= p.sum()
    tokens = np.concatenate([
        np.asarray(sample(jnp.broadcast_to(jnp.asarray(logits), (chunk, vocab)),
                          make_inputs(chunk, seeds=np.arange(s, s + chunk), positions=5), mode="random").token_ids)
        for s in range(0, draws, chunk)])
    order = np.argsort(-p)
    rank = np.empty(vocab, np.int64)
    rank[order] = np.arange(vocab)
    cum = np.cumsum(p[order])
    tail_edges = np.searchsorted(cum, cum[29] + (1 - cum[29]) * np.linspace(0.1, 0.9, 9))
    group = np.where(rank < 30, rank, 30 + np.searchsorted(tail_edges, rank, side="right"))
    observed = np.bincount(group[tokens], minlength=40)
    expected = np.bincount(group, weights=p, minlength=40) * draws
    assert stats.chisquare(observed, expected).pvalue > 1e-3


@pytest.mark.parametrize("vocab", [300, 4096])
def test_kept_set_draw_equals_the_masked_draw(vocab: int) -> None:
    """Without top-k, "filtered" rows draw by rejection against the kept set (no sort); the token must
    be the Gumbel-max over the kept set itself: the draw over logits masked by the full-sort filter."""
    rng = np.random.default_rng(vocab)
    rows = 96
    logits = (rng.normal(size=(rows, vocab)) * rng.uniform(0.5, 4.0, (rows, 1))).astype(np.float32)
    logits[::7, 5] = logits[::7, 9] = logits[::7].max(axis=1)  # ties at the top
    top_p = np.where(rng.uniform(size=rows) < 0.8, rng.choice([0.1, 0.5, 0.9, 0.95, 0.99], rows), 1.0)
    min_p = np.where(rng.uniform(size=rows) < 0.3, rng.choice([0.01, 0.1, 0.5], rows), 0.0)
    inputs = make_inputs(rows, temperature=rng.uniform(0.3, 1.5, rows).astype(np.float32), top_p=top_p.astype(np.float32),
                         min_p=min_p.astype(np.float32), seeds=np.arange(rows), positions=11)
    scaled = jnp.asarray(logits) / inputs.temperature[:, None]
    mask = flt.sorted_filter_mask(scaled, inputs)
    want = np.asarray(blk.draw(jnp.where(mask, scaled, -jnp.inf), inputs))
    got = np.asarray(sample(jnp.asarray(logits), inputs, mode="filtered").token_ids)
    np.testing.assert_array_equal(got, want)
    assert np.all(np.asarray(mask)[np.arange(rows), got])


def test_filtered_draw_stops_on_nan_logits() -> None:
    """A row with a NaN logit (a diverged model) must not hang the kept-set draw (its NaN maximum leaves
    no candidate, while the ids ranked before the fallback id 0 are not empty); other rows are unaffected."""
    logits = np.random.default_rng(4).normal(size=(3, 300)).astype(np.float32)
    bad = logits.copy()
    bad[1, 7] = np.nan
    inputs = make_inputs(3, top_p=0.5, min_p=0.2, seeds=np.arange(3))
    good = np.asarray(sample(jnp.asarray(logits), inputs, mode="filtered").token_ids)
    got = np.asarray(sample(jnp.asarray(bad), inputs, mode="filtered").token_ids)
    np.testing.assert_array_equal(got[[0, 2]], good[[0, 2]])


def test_top_candidates_from_the_best_blocks_match_a_stable_sort() -> None:
    """The top-C logits taken from the C blocks with the largest maxima equal a stable descending sort's
    first C (values and ids): ties inside and across blocks, rows with fewer than C finite logits, a
    vocabulary that is not a whole number of blocks."""
    rng = np.random.default_rng(7)
    rows, vocab, c = 12, 40_000 + 77, flt.SMALL_TOP_K
    assert 4 * c <= -(-vocab // blk.BLOCK)  # the block path, not lax.top_k over whole rows
    logits = np.round(rng.normal(size=(rows, vocab)) * 4) / 4  # many exact ties
    logits[1] = -np.inf
    logits[1, [5, 9000, vocab - 1]] = 1.0  # three finite logits: padding ids fill the rest
    logits[2, ::128] = 10.0  # every block's maximum ties
    logits[3, -3:] = 20.0  # the best ids sit in the padded last block
    desc, ids = flt.top_candidates(jnp.asarray(logits, jnp.float32), c)
    desc, ids = np.asarray(desc), np.asarray(ids)
    order = np.argsort(-logits, axis=1, kind="stable")[:, :c]
    np.testing.assert_array_equal(desc, np.take_along_axis(logits, order, axis=1).astype(np.float32))
    full_rows = [r for r in range(rows) if r != 1]
    np.testing.assert_array_equal(ids[full_rows], order[full_rows])
    np.testing.assert_array_equal(ids[1, :3], [5, 9000, vocab - 1])


@pytest.mark.parametrize("largest_top_k", [flt.SMALL_TOP_K, 200])
def test_small_top_k_mask_matches_full_sort(largest_top_k: int) -> None:
    """Rows whose top-k is at most `SMALL_TOP_K` rank only their best blocks; mixed with top-p, min-p,
    suppressed ids and ties, the mask and the drawn tokens equal the full-sort path's and the draw over the
    masked rows. With one row at top_k = 200 the batch takes the top-512 path instead: same result."""
    rng = np.random.default_rng(largest_top_k)
    rows, vocab = 32, 40_000 + 77
    logits = (np.round(rng.normal(size=(rows, vocab)) * rng.uniform(1, 6, (rows, 1)) * 4) / 4).astype(np.float32)
    top_k = rng.choice([1, 2, 7, 50, flt.SMALL_TOP_K], rows)
    top_k[0] = largest_top_k
    top_p = np.where(rng.uniform(size=rows) < 0.5, rng.choice([0.3, 0.9, 0.99], rows), 1.0).astype(np.float32)
    min_p = np.where(rng.uniform(size=rows) < 0.3, 0.05, 0.0).astype(np.float32)
    suppress = np.where(rng.uniform(size=(rows, 2)) < 0.5, np.argmax(logits, axis=1)[:, None], -1)
    inputs = make_inputs(rows, temperature=rng.uniform(0.5, 1.5, rows).astype(np.float32), top_k=top_k, top_p=top_p,
                         min_p=min_p, seeds=np.arange(rows), suppress_ids=suppress)
    scaled = blk.suppress(jnp.asarray(logits), inputs.suppress_ids) / inputs.temperature[:, None]
    fast = np.asarray(flt.filter_mask(scaled, inputs, jnp.zeros(rows, bool), flt.NUM_CANDIDATES))
    full = np.asarray(flt.sorted_filter_mask(scaled, inputs))
    np.testing.assert_array_equal(fast, full)
    assert np.all(fast.sum(axis=1) <= top_k)
    got = sample(jnp.asarray(logits), inputs, mode="filtered", num_top_logprobs=3)
    want = sample(jnp.asarray(logits), inputs, mode="filtered", num_top_logprobs=3, num_candidates=vocab)
    np.testing.assert_array_equal(np.asarray(got.token_ids), np.asarray(want.token_ids))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)
    # The draw from the best logits alone is the Gumbel-max over the masked row.
    masked_draw = np.asarray(blk.draw(jnp.where(full, scaled, -jnp.inf), inputs))
    np.testing.assert_array_equal(np.asarray(got.token_ids), masked_draw)
