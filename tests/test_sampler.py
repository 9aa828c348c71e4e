"""Tests for runner/sampler.py as a whole: modes, per-row determinism, exact distributions (chi-square),
rejection sampling, logprobs, suppression. Its building blocks (sampler_blocks.py, sampler_filters.py)
are tested against numpy and full-sort references in tests/test_sampler_blocks.py, which imports the
helpers below."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from runner import sampler as sm
from runner.sampler import sample
from runner.sampling_rows import choose_mode
from runner.step_padding import SamplingInputs

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


def test_the_engine_steps_take_choose_mode() -> None:
    """`SamplingPlan.mode` (what a step runs) is `choose_mode` with each row's logprobs mode: a
    greedy row's top-k does not make a batch that samples only without filters "filtered"."""
    from types import SimpleNamespace

    from runner.sampling_rows import SAMPLER_MODES
    from runner.step_plan import SamplingPlan

    rows = dict(temperature=np.array([1.0, 0.0], np.float32), top_k=np.array([0, 50], np.int32),
                top_p=np.ones(2, np.float32), min_p=np.zeros(2, np.float32))
    for processed, want in (([False, False], "random"), ([False, True], "filtered")):
        plan = SamplingPlan(SimpleNamespace(**rows, processed=np.array(processed)), np.zeros((2, 8), np.int32))
        assert SAMPLER_MODES[plan.mode] == want == choose_mode(**rows, processed=np.array(processed))
    # a sampling record describes the processed distribution: the greedy row's top-k then counts
    plan = SamplingPlan(SimpleNamespace(**rows, processed=np.zeros(2, bool)), np.zeros((2, 8), np.int32),
                        sampling_record=True)
    assert SAMPLER_MODES[plan.mode] == "filtered"


def test_unknown_mode_raises(small_logits: np.ndarray) -> None:
    with pytest.raises(ValueError):
        sample(jnp.asarray(small_logits)[None], make_inputs(1), mode="nucleus")


