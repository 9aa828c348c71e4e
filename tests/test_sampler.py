"""Tests for runner/sampler.py, sampler_blocks.py and sampler_filters.py: modes, per-row determinism, exact
distributions, logprobs, suppression."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from runner import sampler as sm
from runner import sampler_blocks as blk
from runner import sampler_filters as flt
from runner.sampler import choose_mode, sample
from runner.step_inputs import SamplingInputs

V_SMALL = 24


def make_inputs(
    num_rows: int,
    *,
    temperature: float | np.ndarray = 1.0,
    top_k: int | np.ndarray = 0,
    top_p: float | np.ndarray = 1.0,
    min_p: float | np.ndarray = 0.0,
    seeds: int | np.ndarray = 0,
    sample_index: int | np.ndarray = 0,
    positions: int | np.ndarray | None = None,
    suppress_ids: np.ndarray | None = None,
    processed: bool | np.ndarray = True,
) -> SamplingInputs:
    """Broadcast scalar settings to a batch of `num_rows` rows."""

    def full(value: float | int | bool | np.ndarray, dtype: type) -> jax.Array:
        return jnp.asarray(np.broadcast_to(np.asarray(value, dtype), (num_rows,)).copy())

    if positions is None:
        positions = np.arange(num_rows)
    if suppress_ids is None:
        suppress_ids = np.full((num_rows, 1), -1)
    return SamplingInputs(
        temperature=full(temperature, np.float32),
        top_k=full(top_k, np.int32),
        top_p=full(top_p, np.float32),
        min_p=full(min_p, np.float32),
        seeds=full(seeds, np.uint32),
        sample_index=full(sample_index, np.int32),
        positions=full(positions, np.int32),
        suppress_ids=jnp.asarray(np.asarray(suppress_ids, np.int32)),
        processed=full(processed, np.bool_),
    )


def ref_processed(
    logits: np.ndarray,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    suppress: tuple[int, ...] = (),
) -> np.ndarray:
    """Exact processed distribution in float64 (suppress, temperature, top-k, top-p, min-p)."""
    vocab = logits.shape[0]
    lg = logits.astype(np.float64).copy()
    lg[list(suppress)] = -np.inf
    lg = lg / (temperature if temperature >= sm.GREEDY_EPS else 1.0)
    order = np.argsort(-lg, kind="stable")
    desc = lg[order]
    rank = np.arange(vocab)
    keep = np.isfinite(desc)
    if 0 < top_k < vocab:
        keep &= rank < top_k
    ratio = np.where(keep, np.exp(desc - desc[0]), 0.0)
    probs = ratio / ratio.sum()
    before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
    if top_p < 1.0:
        keep &= (before < top_p) | (rank == 0)
    if min_p > 0.0:
        keep &= np.exp(desc - desc[0]) >= min_p
    mask = np.zeros(vocab, bool)
    mask[order] = keep
    out = np.where(mask, np.exp(lg - lg.max()), 0.0)
    return out / out.sum()


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def small_logits() -> np.ndarray:
    return (np.random.default_rng(1).normal(size=V_SMALL) * 1.5).astype(np.float32)


def test_greedy_mode_is_argmax() -> None:
    logits = np.random.default_rng(0).normal(size=(8, 100)).astype(np.float32)
    out = sample(jnp.asarray(logits), make_inputs(8, temperature=0.0), mode="greedy", num_top_logprobs=0)
    np.testing.assert_array_equal(np.asarray(out.token_ids), logits.argmax(-1))
    assert out.top_ids.shape == (8, 0) and out.top_logprobs.shape == (8, 0)


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


@pytest.mark.parametrize("mode", ["random", "filtered"])
def test_sampled_logprob_is_skipped_when_no_row_wants_it(mode: str) -> None:
    """`want_logprob` changes no token and no wanted logprob. All False: "filtered" skips the
    log-sum-exp (zeros); "random" gets processed logprobs for free and skips the raw one."""
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(4, 300)).astype(np.float32))
    base = make_inputs(4, temperature=1.0, seeds=5, processed=np.arange(4) % 2 == 0)
    full = sample(logits, base, mode=mode, num_top_logprobs=0)
    none = sample(logits, dataclasses.replace(base, want_logprob=jnp.zeros(4, bool)), mode=mode, num_top_logprobs=0)
    some = sample(logits, dataclasses.replace(base, want_logprob=jnp.arange(4) == 1), mode=mode, num_top_logprobs=0)
    np.testing.assert_array_equal(np.asarray(none.token_ids), np.asarray(full.token_ids))
    np.testing.assert_array_equal(np.asarray(some.token_ids), np.asarray(full.token_ids))
    assert np.all(np.asarray(full.logprobs) < 0)
    skipped = np.asarray(none.logprobs) if mode == "filtered" else np.asarray(none.logprobs)[1::2]  # raw rows
    assert not np.any(skipped)
    assert np.asarray(some.logprobs)[1] == np.asarray(full.logprobs)[1]


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


def test_greedy_mode_is_argmax_over_a_large_vocabulary() -> None:
    logits = np.random.default_rng(2).normal(size=(8, 49152)).astype(np.float32)
    out = sample(jnp.asarray(logits), make_inputs(8, temperature=0.0), mode="greedy", num_top_logprobs=0)
    np.testing.assert_array_equal(np.asarray(out.token_ids), logits.argmax(-1))


@pytest.mark.parametrize("mode", ["random", "filtered"])
def test_temperature_zero_rows_are_argmax_in_mixed_batch(mode: str) -> None:
    rows = 64
    logits = np.random.default_rng(0).normal(size=(rows, 50)).astype(np.float32)
    temperature = np.where(np.arange(rows) % 2 == 0, 0.0, 1.5).astype(np.float32)
    inputs = make_inputs(rows, temperature=temperature, top_k=10, top_p=0.9)
    tokens = np.asarray(sample(jnp.asarray(logits), inputs, mode=mode).token_ids)
    greedy = temperature == 0
    np.testing.assert_array_equal(tokens[greedy], logits[greedy].argmax(-1))
    assert np.any(tokens[~greedy] != logits[~greedy].argmax(-1))  # the others actually sample


def test_row_token_independent_of_batch_composition_and_order() -> None:
    rng = np.random.default_rng(2)
    rows, vocab = 12, 40
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    settings = dict(
        temperature=rng.uniform(0.5, 1.5, rows).astype(np.float32),
        top_k=rng.integers(0, 20, rows),
        top_p=rng.uniform(0.5, 1.0, rows).astype(np.float32),
        min_p=rng.uniform(0.0, 0.1, rows).astype(np.float32),
        seeds=rng.integers(0, 2**32, rows, dtype=np.uint64).astype(np.uint32),
        sample_index=rng.integers(0, 4, rows),
        positions=rng.integers(0, 1000, rows),
    )
    base = np.asarray(sample(jnp.asarray(logits), make_inputs(rows, **settings), mode="filtered").token_ids)

    # Reversed order plus 5 unrelated rows in front.
    extra = 5
    perm = np.arange(rows)[::-1]
    big_logits = np.concatenate([rng.normal(size=(extra, vocab)).astype(np.float32), logits[perm]])
    big = {
        k: np.concatenate([rng.permutation(np.asarray(v))[:extra], np.asarray(v)[perm]]) for k, v in settings.items()
    }
    tokens = np.asarray(sample(jnp.asarray(big_logits), make_inputs(rows + extra, **big), mode="filtered").token_ids)
    np.testing.assert_array_equal(tokens[extra:], base[perm])

    # Rows without filters get the same token in "random" and "filtered" batches.
    plain = dict(settings, top_k=0, top_p=1.0, min_p=0.0)
    a = sample(jnp.asarray(logits), make_inputs(rows, **plain), mode="random").token_ids
    b = sample(jnp.asarray(logits), make_inputs(rows, **plain), mode="filtered").token_ids
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_different_seeds_and_sample_indices_differ() -> None:
    rows, vocab = 256, 32
    logits = jnp.zeros((rows, vocab), jnp.float32)  # uniform
    by_seed = np.asarray(sample(logits, make_inputs(rows, seeds=np.arange(rows), positions=7), mode="random").token_ids)
    by_index = np.asarray(
        sample(logits, make_inputs(rows, sample_index=np.arange(rows), positions=7), mode="random").token_ids
    )
    for tokens in (by_seed, by_index):
        counts = np.bincount(tokens, minlength=vocab)
        assert len(np.unique(tokens)) > 20
        assert stats.chisquare(counts).pvalue > 1e-3
    assert np.mean(by_seed != by_index) > 0.8


CASES = {
    "temperature_0.7": dict(temperature=0.7),
    "top_k_5": dict(top_k=5),
    "top_p_0.8": dict(top_p=0.8),
    "min_p_0.1": dict(min_p=0.1),
    "combined": dict(temperature=1.3, top_k=12, top_p=0.9, min_p=0.05),
}


def check_goodness_of_fit(tokens: np.ndarray, expected_probs: np.ndarray) -> None:
    """Zero-probability tokens never appear; chi-square over the rest (small bins merged)."""
    counts = np.bincount(tokens, minlength=expected_probs.shape[0])
    assert counts[expected_probs == 0].sum() == 0
    n = tokens.shape[0]
    expected = expected_probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (expected_probs > 0)].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert stats.chisquare(obs, exp).pvalue > 1e-3


@pytest.mark.parametrize("case", list(CASES))
def test_chi_square_against_exact_distribution(case: str, small_logits: np.ndarray) -> None:
    settings = CASES[case]
    draws = 20_000
    logits = jnp.broadcast_to(jnp.asarray(small_logits), (draws, V_SMALL))
    inputs = make_inputs(draws, seeds=1234, positions=np.arange(draws), **settings)
    mode = choose_mode(
        np.asarray(inputs.temperature), np.asarray(inputs.top_k), np.asarray(inputs.top_p), np.asarray(inputs.min_p)
    )
    assert mode == ("random" if case == "temperature_0.7" else "filtered")
    tokens = np.asarray(sample(logits, inputs, mode=mode).token_ids)
    expected = ref_processed(small_logits, **settings)
    if case != "temperature_0.7":
        assert (expected == 0).any()  # the case really filters something
    check_goodness_of_fit(tokens, expected)


REJECTION_CASES = {
    "t1_likely_draft": (dict(temperature=1.0), "likely"),
    "t0.7_unlikely_draft": (dict(temperature=0.7), "unlikely"),
    "top_p0.8_likely_draft": (dict(top_p=0.8), "likely"),
    "top_p0.8_filtered_draft": (dict(top_p=0.8), "filtered"),
    "combined_likely_draft": (dict(temperature=1.3, top_k=12, top_p=0.9, min_p=0.05), "likely"),
}


@pytest.mark.parametrize("case", list(REJECTION_CASES))
def test_rejection_sampling_matches_exact_distribution(case: str, small_logits: np.ndarray) -> None:
    """Speculative rejection sampling (accept d w.p. p(d), else draw from p without d) is lossless:
    the empirical distribution of the emitted token is the processed distribution."""
    settings, which = REJECTION_CASES[case]
    expected = ref_processed(small_logits, **settings)
    order = np.argsort(-expected, kind="stable")
    draft = {"likely": order[0], "unlikely": order[int((expected > 0).sum()) - 1],
             "filtered": int(np.flatnonzero(expected == 0)[0]) if (expected == 0).any() else -1}[which]
    assert draft >= 0
    draws = 20_000
    logits = jnp.broadcast_to(jnp.asarray(small_logits), (draws, V_SMALL))
    inputs = make_inputs(draws, seeds=4321, positions=np.arange(draws), **settings)
    inputs = dataclasses.replace(inputs, draft_ids=jnp.full((draws,), draft, jnp.int32))
    mode = choose_mode(np.asarray(inputs.temperature), np.asarray(inputs.top_k), np.asarray(inputs.top_p),
                       np.asarray(inputs.min_p))
    out = sample(logits, inputs, mode=mode)
    tokens = np.asarray(out.token_ids)
    check_goodness_of_fit(tokens, expected)
    if which == "filtered":
        assert not np.any(tokens == draft)
    # the emitted token's (processed) logprob is the target's, as without speculation
    np.testing.assert_allclose(np.asarray(out.logprobs), np.log(expected[tokens]), atol=1e-5)


def test_rejection_without_drafts_is_the_plain_draw(small_logits: np.ndarray) -> None:
    """Rows with no draft (-1), and greedy rows, give exactly the plain tokens."""
    rows = 512
    logits = jnp.broadcast_to(jnp.asarray(small_logits), (rows, V_SMALL))
    temps = np.where(np.arange(rows) % 4 == 0, 0.0, 0.9)
    inputs = make_inputs(rows, seeds=np.arange(rows), temperature=temps, top_p=0.95)
    drafts = np.where(np.arange(rows) % 2 == 0, -1, 3).astype(np.int32)  # greedy rows get drafts too
    plain = np.asarray(sample(logits, inputs, mode="filtered").token_ids)
    rej = np.asarray(sample(logits, dataclasses.replace(inputs, draft_ids=jnp.asarray(drafts)), mode="filtered").token_ids)
    no_draft_or_greedy = (drafts < 0) | (temps == 0)
    np.testing.assert_array_equal(rej[no_draft_or_greedy], plain[no_draft_or_greedy])


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


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("num_top", [0, 5])
def test_logprobs_raw_and_processed(case: str, num_top: int, small_logits: np.ndarray) -> None:
    settings = CASES[case]
    rows = 16
    logits = np.stack([small_logits + i * 0.01 * np.arange(V_SMALL) for i in range(rows)]).astype(np.float32)
    processed = np.arange(rows) % 2 == 0
    inputs = make_inputs(rows, processed=processed, seeds=np.arange(rows), **settings)
    out = sample(jnp.asarray(logits), inputs, mode="filtered", num_top_logprobs=num_top)
    tokens = np.asarray(out.token_ids)
    raw = np_log_softmax(logits)
    with np.errstate(divide="ignore"):
        proc = np.log(np.stack([ref_processed(row, **settings) for row in logits]))
    chosen = np.where(processed[:, None], proc, raw)
    np.testing.assert_allclose(np.asarray(out.logprobs), chosen[np.arange(rows), tokens], atol=1e-5)
    assert np.all(np.isfinite(np.asarray(out.logprobs)))
    assert out.top_ids.shape == (rows, num_top) and out.top_logprobs.shape == (rows, num_top)
    if num_top:
        top_ids, top_lp = np.asarray(out.top_ids), np.asarray(out.top_logprobs)
        assert np.all(np.diff(top_lp, axis=1) <= 0)  # sorted descending
        np.testing.assert_allclose(top_lp, np.take_along_axis(chosen, top_ids, 1), atol=1e-5)
        ref_top = np.sort(chosen, axis=1)[:, ::-1][:, :num_top]
        np.testing.assert_allclose(top_lp, ref_top, atol=1e-5)


def test_greedy_processed_logprobs_are_filtered_at_temperature_one(small_logits: np.ndarray) -> None:
    rows = 4
    logits = jnp.broadcast_to(jnp.asarray(small_logits), (rows, V_SMALL))
    inputs = make_inputs(rows, temperature=0.0, top_k=4, top_p=0.9)
    out = sample(logits, inputs, mode="filtered", num_top_logprobs=V_SMALL)
    with np.errstate(divide="ignore"):
        ref = np.log(ref_processed(small_logits, temperature=1.0, top_k=4, top_p=0.9))
    got = np.full(V_SMALL, np.nan)
    got[np.asarray(out.top_ids[0])] = np.asarray(out.top_logprobs[0])
    np.testing.assert_allclose(got, ref, atol=1e-5)
    assert int(out.token_ids[0]) == int(small_logits.argmax())


@pytest.mark.parametrize("mode", ["greedy", "random", "filtered"])
def test_suppressed_ids_never_sampled(mode: str, small_logits: np.ndarray) -> None:
    draws = 5000
    order = np.argsort(-small_logits)
    banned = order[:3]  # the three most likely tokens
    suppress = np.tile(np.append(banned, -1), (draws, 1))
    logits = jnp.broadcast_to(jnp.asarray(small_logits), (draws, V_SMALL))
    temperature = 0.0 if mode == "greedy" else 1.0
    top_k = 4 if mode == "filtered" else 0
    inputs = make_inputs(draws, temperature=temperature, top_k=top_k, suppress_ids=suppress, processed=True)
    out = sample(logits, inputs, mode=mode, num_top_logprobs=V_SMALL)
    tokens = np.asarray(out.token_ids)
    assert not np.isin(tokens, banned).any()
    if mode == "greedy":
        assert np.all(tokens == order[3])
    else:
        check_goodness_of_fit(tokens, ref_processed(small_logits, top_k=top_k, suppress=tuple(banned)))
    top_ids, top_lp = np.asarray(out.top_ids[0]), np.asarray(out.top_logprobs[0])
    assert np.all(np.isneginf(top_lp[np.isin(top_ids, banned)]))

    # Raw logprobs ignore suppression.
    raw_inputs = make_inputs(draws, temperature=temperature, top_k=top_k, suppress_ids=suppress, processed=False)
    raw_out = sample(logits, raw_inputs, mode=mode, num_top_logprobs=3)
    np.testing.assert_array_equal(np.asarray(raw_out.top_ids[0]), banned)
    np.testing.assert_allclose(np.asarray(raw_out.top_logprobs[0]), np_log_softmax(small_logits)[banned], atol=1e-5)


def test_top_k_and_top_p_ties_are_deterministic() -> None:
    logits = np.array([1.0, 2.0, 2.0, 2.0, 0.0, 2.0], np.float32)
    rows = 2000
    batch = jnp.broadcast_to(jnp.asarray(logits), (rows, 6))
    tokens = np.asarray(sample(batch, make_inputs(rows, top_k=2), mode="filtered").token_ids)
    assert set(np.unique(tokens)) == {1, 2}  # ties ranked by token id
    # top_p = 0.5 over four tied tokens of mass ~0.24 each: keep ids 1, 2, 3.
    tokens = np.asarray(sample(batch, make_inputs(rows, top_p=0.5), mode="filtered").token_ids)
    assert set(np.unique(tokens)) == {1, 2, 3}


def test_top_k_off_values() -> None:
    logits = jnp.broadcast_to(jnp.arange(8, dtype=jnp.float32) * 0.1, (4, 8))
    for k in (0, -1, 8, 100):
        out = sample(logits, make_inputs(4, top_k=k), mode="filtered", num_top_logprobs=8)
        assert np.all(np.isfinite(np.asarray(out.top_logprobs)))


def test_choose_mode() -> None:
    z, o = np.zeros(3, np.float32), np.ones(3, np.float32)
    k0 = np.zeros(3, np.int32)
    assert choose_mode(z, k0, o, z) == "greedy"
    assert choose_mode(np.array([0.0, 1.0, 0.0]), k0, o, z) == "random"
    assert choose_mode(np.array([0.0, 1.0, 0.0]), np.array([0, 5, 0]), o, z) == "filtered"
    assert choose_mode(o, np.full(3, -1), o, z) == "random"
    assert choose_mode(o, np.full(3, 100), o, z, vocab_size=100) == "random"
    assert choose_mode(o, k0, np.array([1.0, 0.9, 1.0]), z) == "filtered"
    assert choose_mode(o, k0, o, np.array([0.0, 0.0, 0.1])) == "filtered"
    # Filters on greedy rows only matter when those rows want processed logprobs.
    assert choose_mode(z, np.full(3, 5), o, z) == "filtered"
    assert choose_mode(z, np.full(3, 5), o, z, processed=np.zeros(3, bool)) == "greedy"


def test_unknown_mode_raises(small_logits: np.ndarray) -> None:
    with pytest.raises(ValueError):
        sample(jnp.asarray(small_logits)[None], make_inputs(1), mode="nucleus")


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
