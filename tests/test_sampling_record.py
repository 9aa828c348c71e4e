"""The sampling record (`SamplingParams(sampling_record=True)`): per generated token, the log of the mass the
filters kept of softmax(logits / T) and, where it fits, the kept set's ids.

From the trainer's own full-sequence forward plus the record, the processed logprob the engine reported is
recomputed exactly (`log_softmax(logits / T)[t] - kept_logmass`), the kept ids are exactly the top-k /
top-p / min-p set of that forward, and the renormalised importance ratio on-policy is 1.0; greedy rows,
multi-step decode, async scheduling, n-gram verification and `RolloutBatch` carry it; a batch without a
record compiles nothing new; bad values are refused.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from rollout import Eagle3Config, Engine, NgramConfig, SamplingParams
from runner.spec_decode.eagle3_checkpoint import init_eagle3_head, save_eagle3_head
from test_engine import ENGINE_KW, ByteTokenizer, make_model, rand_prompt


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def kept_set(scaled_logp: np.ndarray, top_k: int, top_p: float, min_p: float) -> list[int]:
    """vLLM's kept set from a row's log-probabilities at temperature T (ties by id, as the engine)."""
    order = sorted(range(len(scaled_logp)), key=lambda i: (-scaled_logp[i], i))
    keep = order[:top_k] if top_k > 0 else order
    p = np.exp(scaled_logp[keep] - np.logaddexp.reduce(scaled_logp[keep]))
    before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
    keep = [t for t, b in zip(keep, before) if b < top_p or top_p >= 1.0]
    top = np.exp(scaled_logp[order[0]])
    return [t for t in keep if np.exp(scaled_logp[t]) >= min_p * top]


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.mark.parametrize("filters", [dict(top_k=5), dict(top_p=0.8), dict(top_k=12, min_p=0.05), {}])
@pytest.mark.parametrize("engine_kw", [dict(num_scheduler_steps=1), dict(num_scheduler_steps=4),
                                       dict(num_scheduler_steps=4, async_scheduling=True)])
def test_record_recovers_the_processed_logprob_from_the_trainer_forward(model, filters: dict, engine_kw: dict) -> None:
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, **engine_kw)
    temperature = 0.7
    sp = SamplingParams(n=2, temperature=temperature, seed=3, max_tokens=10, ignore_eos=True, logprobs=0,
                        logprobs_mode="processed", sampling_record=True, max_kept_ids=16, **filters)
    prompts = [rand_prompt(np.random.default_rng(i), n) for i, n in enumerate((4, 23))]
    outs = engine.generate(prompts, sp)
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            ids = prompt + c.token_ids
            logits = np.asarray(model(jnp.asarray([ids]), jnp.arange(len(ids))[None]))[0]
            steps = range(len(prompt) - 1, len(ids) - 1)
            scaled = np.stack([log_softmax(logits[i] / temperature) for i in steps])  # the trainer's, at T
            lp = scaled[np.arange(len(c.token_ids)), c.token_ids]
            np.testing.assert_allclose(lp - np.asarray(c.kept_logmass), c.logprobs.values, atol=2e-5)
            for row, ids_kept, mass in zip(scaled, c.kept_ids, c.kept_logmass):
                want = kept_set(row, filters.get("top_k", 0), filters.get("top_p", 1.0), filters.get("min_p", 0.0))
                if len(want) <= 16:
                    assert ids_kept == sorted(want, key=lambda t: (-row[t], t))
                    np.testing.assert_allclose(np.logaddexp.reduce(row[ids_kept]), mass, atol=2e-5)
                else:
                    assert ids_kept is None
            # on-policy, the trainer's renormalised ratio pi(t) / pi(kept) over the engine's processed prob is 1
            renormalised = np.array([r[t] - np.logaddexp.reduce(r[k]) for r, t, k in zip(scaled, c.token_ids, c.kept_ids)
                                     if k is not None])
            processed = np.array([v for v, k in zip(c.logprobs.values, c.kept_ids) if k is not None])
            np.testing.assert_allclose(np.exp(renormalised - processed), 1.0, atol=5e-5)


def test_greedy_rows_rollout_batch_and_speculative_verification(model, tmp_path) -> None:
    """A greedy row's record is of its processed distribution (filters at temperature 1); the record
    reaches `RolloutBatch` as arrays; n-gram and EAGLE-3 verification steps (one per call, several per
    call, and the plain multi-step calls of an EAGLE-3 engine) carry it too."""
    prompt = rand_prompt(np.random.default_rng(5), 12) * 3  # repeats: the n-gram drafter proposes
    sp = SamplingParams(temperature=0.0, top_k=3, max_tokens=12, ignore_eos=True, sampling_record=True, max_kept_ids=3)
    head = str(tmp_path / "head")
    save_eagle3_head(init_eagle3_head(model, seed=3), head)
    for kw in ({}, dict(speculative=NgramConfig(k=3)),
               dict(speculative=Eagle3Config(head, k=2, auto_disable=False, num_verify_steps=1)),
               dict(speculative=Eagle3Config(head, k=2, auto_disable=False, num_verify_steps=3)),
               dict(speculative=Eagle3Config(head, k=2, auto_disable=False, min_confidence=0.99))):
        engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, **kw)
        batch = engine.rollout([prompt, prompt[:10]], sp)
        c = engine.generate([prompt], sp)[0].outputs[0]
        ids = prompt + c.token_ids
        logits = np.asarray(model(jnp.asarray([ids]), jnp.arange(len(ids))[None]))[0]
        for i, (mass, kept) in enumerate(zip(c.kept_logmass, c.kept_ids)):
            row = log_softmax(logits[len(prompt) - 1 + i])
            assert kept == sorted(range(len(row)), key=lambda t: (-row[t], t))[:3]
            np.testing.assert_allclose(np.logaddexp.reduce(row[kept]), mass, atol=2e-5)
        n = int(batch.completion_lens[0])
        # another batch (two prompts, not one): its steps may take other kernels by row count, so the last
        # bit may differ; equal bits whatever the batch are what EngineConfig(batch_invariant=True) gives
        np.testing.assert_allclose(batch.completion_kept_logmass[0, :n], c.kept_logmass, rtol=0, atol=1e-6)
        assert batch.completion_kept_ids.shape[2] == 3 and batch.completion_kept_ids_valid[0, :n].all()
        np.testing.assert_array_equal(batch.completion_kept_ids[0, :n], np.asarray(c.kept_ids))


def test_without_a_record_nothing_changes_and_bad_values_are_refused(model) -> None:
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)
    prompt = rand_prompt(np.random.default_rng(1), 9)
    plain = engine.generate([prompt], SamplingParams(temperature=1.0, seed=1, top_p=0.9, max_tokens=8, logprobs=0))
    recorded = engine.generate([prompt], SamplingParams(temperature=1.0, seed=1, top_p=0.9, max_tokens=8, logprobs=0,
                                                        sampling_record=True))
    a, b = plain[0].outputs[0], recorded[0].outputs[0]
    assert a.token_ids == b.token_ids and a.kept_logmass is None and len(b.kept_logmass) == 8
    assert all(k is None for k in b.kept_ids)  # max_kept_ids=0: the mass only
    np.testing.assert_allclose(a.logprobs.values, b.logprobs.values, atol=1e-6)
    with pytest.raises(ValueError, match="max_kept_ids needs sampling_record"):
        SamplingParams(max_kept_ids=4)
    with pytest.raises(ValueError, match="exceeds the engine's max_kept_ids=16"):
        engine.generate([prompt], SamplingParams(sampling_record=True, max_kept_ids=17))
    assert engine.generate([prompt], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # still usable
