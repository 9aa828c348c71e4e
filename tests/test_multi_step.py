"""Multi-step decode (`num_scheduler_steps > 1`): several decode steps per device call must give
exactly what one step per call gives (tokens, logprobs, stop rules), on the tiny engine model."""

from __future__ import annotations

import numpy as np
import pytest

from rollout import Eagle3Config, Engine, NgramConfig, SamplingParams
from rollout.engine_config import DEFAULT_SCHEDULER_STEPS, EngineConfig
from weight_sync.compiles import num_compilations
from test_engine import EOS, ENGINE_KW, MAX_LEN, ByteTokenizer, make_model, rand_prompt

STEPS = 4


@pytest.fixture(scope="module")
def model():
    return make_model(eos_logit=0.8)  # EOS sometimes sampled: sequences stop mid-chunk


@pytest.fixture(scope="module")
def single(model) -> Engine:
    return Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, num_scheduler_steps=1)


@pytest.fixture(scope="module")
def multi(model) -> Engine:
    return Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, num_scheduler_steps=STEPS)


def _requests(stop_ids: list[int] = (), stop: list[str] = ()) -> tuple[list[list[int]], list[SamplingParams]]:
    """12 requests (more than max_num_seqs = 8: some queue) with mixed lengths, stops and modes."""
    rng = np.random.default_rng(7)
    prompts = [rand_prompt(rng, n) for n in [3, 17, 40, 9, 25, 5, 60, 12, 33, 8, 21, 100]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=13, logprobs=2),
        SamplingParams(temperature=1.0, seed=3, max_tokens=30, logprobs=0),
        SamplingParams(temperature=0.7, top_p=0.9, seed=4, max_tokens=7, logprobs_mode="processed", logprobs=1),
        SamplingParams(temperature=1.0, seed=5, max_tokens=40, min_tokens=20, logprobs=0),  # EOS masked for 20
        SamplingParams(temperature=1.0, top_k=5, seed=6, max_tokens=25, stop_token_ids=list(stop_ids), ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=1.0, seed=8, n=3, max_tokens=18, logprobs=3),
        SamplingParams(temperature=1.0, seed=9, max_tokens=50, stop=list(stop), ignore_eos=True),
        SamplingParams(temperature=1.0, seed=10, max_tokens=33, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=2, logprobs=0),
        SamplingParams(temperature=1.0, min_p=0.1, seed=11, max_tokens=21, logprobs=0),
        SamplingParams(temperature=1.0, seed=12, max_tokens=40, logprobs=0),  # 100 + 40 > MAX_LEN: "length"
    ]
    return prompts, params


def _assert_same(a, b) -> None:
    for ra, rb in zip(a, b, strict=True):
        for ca, cb in zip(ra.outputs, rb.outputs, strict=True):
            assert ca.token_ids == cb.token_ids
            assert (ca.finish_reason, ca.stop_reason, ca.text) == (cb.finish_reason, cb.stop_reason, cb.text)
            if ca.logprobs is not None:
                np.testing.assert_allclose([t.logprob for t in ca.logprobs], [t.logprob for t in cb.logprobs],
                                           atol=1e-5, rtol=0)
                for ta, tb in zip(ca.logprobs, cb.logprobs):
                    assert list(ta.top) == list(tb.top)  # the same alternatives, in the same order
                    np.testing.assert_allclose(list(ta.top.values()), list(tb.top.values()), atol=1e-5, rtol=0)


def test_multi_step_equals_single_steps(single: Engine, multi: Engine) -> None:
    prompts, params = _requests()
    probe = single.generate([prompts[4], prompts[7]], [params[4], params[7]])  # what stops will cut
    stop_id = probe[0].outputs[0].token_ids[9]
    stop_text = probe[1].outputs[0].text[13:15]
    prompts, params = _requests(stop_ids=[stop_id], stop=[stop_text])
    expected, got = single.generate(prompts, params), multi.generate(prompts, params)
    _assert_same(expected, got)
    assert got[4].outputs[0].stop_reason == stop_id and len(got[4].outputs[0].token_ids) <= 10
    assert got[7].outputs[0].stop_reason == stop_text and len(got[7].outputs[0].token_ids) <= 15
    assert any(c.token_ids and c.token_ids[-1] == EOS and c.finish_reason == "stop" for r in got for c in r.outputs)
    assert len(got[3].outputs[0].token_ids) >= 20  # min_tokens held across chunks
    assert len(got[11].outputs[0].token_ids) == MAX_LEN - 100
    # fewer host round trips than tokens: each decode call ran several steps
    assert multi.stats().num_decode_steps * 2 < single.stats().num_decode_steps


def test_multi_step_with_preemption(model, single: Engine) -> None:
    """A KV cache for one max-length sequence: multi-step batches are preempted and recomputed."""
    tight = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, num_scheduler_steps=STEPS,
                              kv_cache_blocks=MAX_LEN // 16)
    prompts = [rand_prompt(np.random.default_rng(i), 30) for i in range(6)]
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=60, ignore_eos=True, logprobs=0)
    _assert_same(single.generate(prompts, params), tight.generate(prompts, params))
    assert tight.stats().num_preemptions > 0


def test_multi_step_warmup_compiles_everything(multi: Engine) -> None:
    multi.warmup()
    before = num_compilations()
    prompts, params = _requests()
    multi.generate(prompts, params)
    assert num_compilations() == before


def test_multi_step_config_is_validated(model) -> None:
    assert EngineConfig().num_scheduler_steps == DEFAULT_SCHEDULER_STEPS > 1  # on by default
    assert EngineConfig(speculative=NgramConfig(k=2)).num_scheduler_steps == DEFAULT_SCHEDULER_STEPS
    assert EngineConfig(speculative=Eagle3Config("head", k=2)).num_scheduler_steps == DEFAULT_SCHEDULER_STEPS
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, num_scheduler_steps=0)


def test_async_scheduling_changes_no_token() -> None:
    """Decode calls launched ahead (their input tokens fed on the device) give exactly the tokens,
    logprobs and finish reasons of the synchronous order, with every stop rule in play; a request
    aborted while a call is in flight loses nothing else."""
    from rollout.engine import Engine
    from rollout.sampling_params import SamplingParams
    from test_engine import ENGINE_KW, ByteTokenizer, make_model, rand_prompt

    model = make_model(3, eos_logit=1.5)  # EOS now and then (~4% of tokens)
    rng = np.random.default_rng(5)
    prompts = [rand_prompt(rng, int(n)) for n in rng.integers(3, 40, 12)]
    params = [SamplingParams(temperature=[0.0, 0.9][i % 2], seed=i, max_tokens=int(rng.integers(5, 60)),
                             min_tokens=[0, 3][i % 3 == 0], n=1 + (i % 3 == 0), logprobs=i % 3,
                             ignore_eos=i % 4 == 3) for i in range(12)]
    # a stop id and a stop string taken from where two requests would otherwise go on past them
    probe = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW).generate(
        prompts[1:3], [SamplingParams(temperature=0.9, seed=i, max_tokens=40, ignore_eos=True) for i in (1, 2)])
    params[1] = SamplingParams(temperature=0.9, seed=1, max_tokens=40, ignore_eos=True, logprobs=1,
                               stop_token_ids=[probe[0].outputs[0].token_ids[17]])
    params[2] = SamplingParams(temperature=0.9, seed=2, max_tokens=40, ignore_eos=True,
                               stop=[probe[1].outputs[0].text[20:22]])
    # EOS masked over several calls launched ahead (min_tokens spans their suppress_steps)
    params[4] = SamplingParams(temperature=0.9, seed=4, max_tokens=60, min_tokens=30, logprobs=1)
    outs = {}
    for overlap in (False, True):
        engine = Engine.from_model(model, ByteTokenizer(), **{**ENGINE_KW, "async_scheduling": overlap})
        outs[overlap] = engine.generate(prompts, params)
        assert (engine.stats().num_ahead_calls > 0) == overlap
        assert not engine.has_unfinished_requests()
        assert engine.core.block_manager.num_free_blocks == engine.core.block_manager.num_free(0)
    reasons = set()
    for a, b in zip(outs[False], outs[True]):
        for x, y in zip(a.outputs, b.outputs):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (y.token_ids, y.text, y.finish_reason,
                                                                             y.stop_reason)
            if x.logprobs is not None:
                np.testing.assert_allclose(x.logprobs.values, y.logprobs.values, atol=1e-5)
            reasons.add((x.finish_reason, type(x.stop_reason).__name__))
    assert {("length", "NoneType"), ("stop", "NoneType"), ("stop", "int"), ("stop", "str")} <= reasons, reasons
    assert len(outs[True][4].outputs[0].token_ids) >= 30
    # abort while a call is in flight: the other requests finish exactly as before
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts[:4], params[:4])]
    while engine.stats().num_ahead_calls == 0:
        engine.step()
    assert engine.core._ahead is not None
    engine.abort(rids[0])
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            final[out.request_id] = out
    for rid, want in zip(rids[1:], outs[False][1:4]):
        assert [c.token_ids for c in final[rid].outputs] == [c.token_ids for c in want.outputs]
