"""The engine core's request API (`add_request`, `step`, `abort`, `has_unfinished_requests`) and
weight updates between steps, on the tiny random Llama of test_engine, against its full forward."""

from __future__ import annotations

import numpy as np
import pytest

from rollout.engine import Engine
from rollout.outputs import RequestOutput
from rollout.sampling_params import SamplingParams
from test_engine import ENGINE_KW, ByteTokenizer, Reference, make_model, rand_prompt
from test_engine_sync import perturb

PROMPTS = [rand_prompt(np.random.default_rng(300 + i), n) for i, n in enumerate([4, 19, 33, 7])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def model():
    return make_model(0)


@pytest.fixture(scope="module")
def ref(model) -> Reference:
    return Reference(model)


@pytest.fixture
def engine(model) -> Engine:
    return Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)


def run_to_end(engine: Engine) -> dict[str, list[RequestOutput]]:
    """Step until nothing is left; every output per request id, in order."""
    seen: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def test_add_request_and_step_equal_generate(engine: Engine, ref: Reference) -> None:
    sampled = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=12, logprobs=0)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS] + [engine.add_request(PROMPTS[1], sampled, "mine")]
    assert ids[-1] == "mine" and len(set(ids)) == len(ids) and all(isinstance(i, str) for i in ids)
    seen = run_to_end(engine)
    assert set(seen) == set(ids) and not engine.core.requests
    for rid, prompt in zip(ids, PROMPTS):
        outs = seen[rid]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]  # cumulative: one per step
        assert outs[-1].outputs[0].token_ids == ref.greedy(prompt, 20)
        assert all(len(a.outputs[0].token_ids) <= len(b.outputs[0].token_ids) for a, b in zip(outs, outs[1:]))
    (again,) = engine.generate([PROMPTS[1]], sampled)
    got = seen["mine"][-1]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in again.outputs]
    # a different batch around it: equal to float rounding (the engine is not batch-invariant)
    assert [c.cumulative_logprob for c in got.outputs] == pytest.approx([c.cumulative_logprob for c in again.outputs],
                                                                         abs=1e-4)


def test_delta_outputs_add_up_to_the_final_one(engine: Engine) -> None:
    sp = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=20, logprobs=2, stop=["zz", "q"])
    engine.add_request(PROMPTS[2], SamplingParams(**{**_fields(sp), "output_kind": "delta"}), "delta")
    engine.add_request(PROMPTS[2], SamplingParams(**{**_fields(sp), "output_kind": "final_only"}), "final")
    seen = run_to_end(engine)
    assert len(seen["final"]) == 1 and seen["final"][0].finished
    deltas = seen["delta"]
    assert deltas[-1].finished and not any(o.finished for o in deltas[:-1])
    for final in seen["final"][0].outputs:
        parts = [c for o in deltas for c in o.outputs if c.index == final.index]
        assert sum((c.token_ids for c in parts), []) == final.token_ids
        assert "".join(c.text for c in parts) == final.text
        assert [lp for c in parts for lp in c.logprobs] == final.logprobs
        assert parts[-1].finish_reason == final.finish_reason and all(c.finish_reason is None for c in parts[:-1])


def _fields(sp: SamplingParams) -> dict:
    return {k: getattr(sp, k) for k in sp.__dataclass_fields__}


def test_abort_frees_blocks_and_returns_what_was_produced(engine: Engine, ref: Reference) -> None:
    free = engine.core.block_manager.num_free_blocks
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    victim = engine.add_request(PROMPTS[2], long, "victim")
    keeper = engine.add_request(PROMPTS[0], GREEDY, "keeper")
    outs = engine.step() + engine.step()  # a prefill step, then a multi-step decode call
    assert all(not o.finished for o in outs)
    (aborted,) = engine.abort(victim)
    assert aborted.finished and aborted.request_id == "victim"
    (c,) = aborted.outputs
    assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 100
    assert c.token_ids == ref.greedy(PROMPTS[2], len(c.token_ids))
    assert engine.abort([victim, "never-added"]) == []  # already gone, unknown: ignored
    seen = run_to_end(engine)
    assert seen[keeper][-1].outputs[0].token_ids == ref.greedy(PROMPTS[0], 20) and victim not in seen
    assert engine.core.block_manager.num_free_blocks == free and not engine.core.requests


def test_bad_requests_change_nothing(engine: Engine) -> None:
    engine.add_request(PROMPTS[0], GREEDY, "taken")
    state = (len(engine.core.requests), len(engine.core.scheduler.waiting), engine.stats().num_sequences)
    for prompt, params, rid in [(PROMPTS[1], GREEDY, "taken"), (PROMPTS[1], GREEDY, ""), (PROMPTS[1], GREEDY, 5),
                                ([], GREEDY, None), ([1, 2, 999], GREEDY, None), (PROMPTS[1], "greedy", None)]:
        with pytest.raises(ValueError):
            engine.add_request(prompt, params, rid)
        assert (len(engine.core.requests), len(engine.core.scheduler.waiting), engine.stats().num_sequences) == state
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="streaming")
    assert run_to_end(engine)["taken"][-1].finished


def test_generate_keeps_other_callers_outputs(engine: Engine, ref: Reference) -> None:
    other = engine.add_request(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                          output_kind="final_only"))
    (mine,) = engine.generate([PROMPTS[1]], GREEDY)
    assert mine.outputs[0].token_ids == ref.greedy(PROMPTS[1], 20)
    seen = run_to_end(engine) if engine.has_unfinished_requests() else {}
    later = engine.step() if not seen else []
    outs = seen.get(other, []) + [o for o in later if o.request_id == other]
    assert len(outs) == 1 and outs[0].outputs[0].token_ids == ref.greedy(PROMPTS[3], 6)


@pytest.mark.parametrize("recompute", [False, True])
def test_sync_between_steps_stamps_versions(engine: Engine, model, recompute: bool) -> None:
    """Weights change while requests run: tokens before the switch are the old model's, each token
    records the version that sampled it; recomputing the running KV makes the rest the new model's."""
    new = perturb(model, 5)
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0)
    rids = [engine.add_request(p, sp) for p in PROMPTS[:2]]
    engine.step()
    engine.step()  # prefill, then one multi-step decode call
    from test_weight_sync import to_hf

    engine.sync_weights(to_hf(new), "hf", version=9, recompute_running=recompute)
    final = {rid: outs[-1] for rid, outs in run_to_end(engine).items()}
    old_ref, new_ref = Reference(model), Reference(new)
    for rid, prompt in zip(rids, PROMPTS):
        c = final[rid].outputs[0]
        versions = c.policy_versions
        assert len(versions) == len(c.token_ids) and versions[0] is None and versions[-1] == 9
        n_old = versions.index(9)
        assert 0 < n_old < 30 and set(versions[n_old:]) == {9} and c.policy_version == 9
        assert c.token_ids[:n_old] == old_ref.greedy(prompt, n_old)
        if recompute:
            assert c.token_ids[n_old:] == new_ref.greedy(prompt + c.token_ids[:n_old], 30 - n_old)
    batch = engine.rollout(PROMPTS[:1], sp)
    assert (batch.completion_policy_versions[0, :30] == 9).all()


def test_random_add_abort_resume_sync_interleavings_lose_nothing(model, ref: Reference) -> None:
    """A seeded property test: 1,000 random adds, aborts, resumes, steps and syncs; no request is lost,
    no KV block leaks, and every request that ran to its end (resumed or not) equals the reference."""
    engine = Engine.from_model(model, ByteTokenizer(), **{**ENGINE_KW, "kv_cache_blocks": 24})
    free = engine.core.block_manager.num_free_blocks
    rng = np.random.default_rng(0)
    from test_weight_sync import to_hf

    same_weights = to_hf(model)
    added: dict[str, list[int]] = {}
    finished: dict[str, RequestOutput] = {}
    num_resumed = 0
    for op in range(1000):
        r = rng.random()
        if r < 0.25:
            prompt = rand_prompt(rng, int(rng.integers(1, 50)))
            sp = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 40)), ignore_eos=True)
            added[engine.add_request(prompt, sp)] = prompt
        elif r < 0.33 and engine.core.requests:
            for out in engine.abort(str(rng.choice(list(engine.core.requests)))):
                finished[out.request_id] = out
        elif r < 0.38 and (aborted := [k for k, o in finished.items() if o.outputs[0].finish_reason == "abort"]):
            rid = str(rng.choice(aborted))
            engine.resume(rid)
            del finished[rid]
            num_resumed += 1
        elif r < 0.41:
            engine.sync_weights(same_weights, "hf")  # the same values: outputs must not change
        else:
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
    for out in engine.abort(list(engine.core.requests)):
        finished[out.request_id] = out
    assert set(finished) == set(added) and not engine.has_unfinished_requests() and num_resumed > 20
    assert engine.core.block_manager.num_free_blocks == free
    for rid, out in finished.items():
        c = out.outputs[0]
        assert c.token_ids == ref.greedy(added[rid], len(c.token_ids)), rid


def test_a_next_turn_reuses_the_finished_turns_kv(engine: Engine, ref: Reference) -> None:
    """Multi-turn, token in / token out: the next turn's prompt extends the previous turn's prompt and
    completion (plus an observation); the full blocks of both come from the prefix cache, and the
    continuation equals the reference. An aborted request's computed blocks are kept the same way."""
    first = rand_prompt(np.random.default_rng(7), 20)
    (turn1,) = engine.generate([first], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    history = first + turn1.outputs[0].token_ids  # 50 tokens: 3 full blocks of 16 were computed
    observation = rand_prompt(np.random.default_rng(8), 5)
    before = engine.stats().prefix_cache_hit_tokens
    (turn2,) = engine.generate([history + observation], SamplingParams(temperature=0.0, max_tokens=10,
                                                                       ignore_eos=True))
    assert engine.stats().prefix_cache_hit_tokens - before == 48
    assert turn2.outputs[0].token_ids == ref.greedy(history + observation, 10)
    rid = engine.add_request(first, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    while len(engine.core.requests[rid].seqs[0].output_ids) < 20:
        engine.step()
    (partial,) = engine.abort(rid)
    resumed = first + partial.outputs[0].token_ids
    before = engine.stats().prefix_cache_hit_tokens
    (rest,) = engine.generate([resumed], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert engine.stats().prefix_cache_hit_tokens - before == 16 * ((len(resumed) - 1) // 16)
    assert rest.outputs[0].token_ids == ref.greedy(resumed, 8)


def test_resume_continues_under_the_new_weights_from_the_prefix_cache(engine: Engine, model, ref: Reference) -> None:
    """Partial rollouts: an aborted request is resumed after a weight update; its computed blocks come
    from the prefix cache, the old tokens (and their versions) are kept, and the continuation is the new
    model's greedy continuation."""
    from test_weight_sync import to_hf

    prompt = rand_prompt(np.random.default_rng(9), 21)
    sp = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=0)
    rid = engine.add_request(prompt, sp, "long")
    while len(engine.core.requests[rid].seqs[0].output_ids) < 20:
        engine.step()
    (partial,) = engine.abort(rid)
    done = partial.outputs[0].token_ids
    assert partial.outputs[0].finish_reason == "abort" and done == ref.greedy(prompt, len(done))
    new = perturb(model, 6)
    engine.sync_weights(to_hf(new), "hf", version=3)
    before = engine.stats().prefix_cache_hit_tokens
    assert engine.resume("long") == "long"
    (final,) = run_to_end(engine)["long"][-1:]
    assert engine.stats().prefix_cache_hit_tokens == before  # the sync dropped the cache: all recomputed
    c = final.outputs[0]
    assert len(c.token_ids) == 60 and c.token_ids[:len(done)] == done and c.finish_reason == "length"
    assert c.policy_versions == [None] * len(done) + [3] * (60 - len(done))
    assert c.token_ids[len(done):] == Reference(new).greedy(prompt + done, 60 - len(done))
    _, logp = Reference(new).logits(prompt + c.token_ids)
    resumed_lp = [t.logprob for t in c.logprobs[len(done):]]
    want = [logp[len(prompt) + i - 1, t] for i, t in enumerate(c.token_ids) if i >= len(done)]
    np.testing.assert_allclose(resumed_lp, want, atol=2e-4)
    # without a sync in between the prefix cache serves the computed blocks
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), "again")
    while len(engine.core.requests[rid].seqs[0].output_ids) < 20:
        engine.step()
    (partial,) = engine.abort(rid)
    n = len(partial.outputs[0].token_ids)
    before = engine.stats().prefix_cache_hit_tokens
    engine.resume("again")
    (final,) = run_to_end(engine)["again"][-1:]
    assert engine.stats().prefix_cache_hit_tokens - before == 16 * ((len(prompt) + n - 1) // 16)
    assert final.outputs[0].token_ids == Reference(new).greedy(prompt, 40)


def test_resume_after_length_equals_one_longer_run(engine: Engine) -> None:
    """Randomness is keyed by (seed, sample, position): a seeded sample cut by max_tokens and resumed
    for more tokens equals one run with the larger max_tokens. Bad resumes raise and change nothing."""
    free = engine.core.block_manager.num_free_blocks
    sp = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=24, ignore_eos=True, logprobs=0)
    (whole,) = engine.generate([PROMPTS[2]], sp)
    rid = engine.add_request(PROMPTS[2], SamplingParams(**{**_fields(sp), "max_tokens": 10}))
    run_to_end(engine)
    with pytest.raises(ValueError, match="no sample to continue"):
        engine.resume(rid)  # each used its max_tokens: say how many more
    with pytest.raises(ValueError, match="no ended request"):
        engine.resume("never-added")
    engine.resume(rid, SamplingParams(**{**_fields(sp), "max_tokens": 14}))
    with pytest.raises(ValueError, match="has not ended"):
        engine.resume(rid)
    (final,) = run_to_end(engine)[rid][-1:]
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in whole.outputs]
    for got, want in zip(final.outputs, whole.outputs):
        np.testing.assert_allclose([t.logprob for t in got.logprobs], [t.logprob for t in want.logprobs], atol=1e-4)
    assert engine.core.block_manager.num_free_blocks == free  # cached blocks count as free


def test_multi_turn_trajectories_mask_environment_tokens(engine: Engine, ref: Reference) -> None:
    """Token in, token out over three turns: each turn's prompt is the trajectory's ids; the packed
    batch has the policy's logprobs on its own tokens and environment tokens out of the loss."""
    from rollout.trajectory import Trajectory

    rng = np.random.default_rng(12)
    trajectories = [Trajectory(rand_prompt(rng, n)) for n in (9, 26)]
    sp = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=0)
    hits = engine.stats().prefix_cache_hit_tokens
    for turn in range(3):
        outs = engine.generate([t.token_ids for t in trajectories], sp)
        for t, out in zip(trajectories, outs):
            assert out.outputs[0].token_ids == ref.greedy(t.token_ids, 7)
            t.add_completion(out.outputs[0])
            if turn < 2:
                t.add_environment(rand_prompt(rng, 5))
    assert engine.stats().prefix_cache_hit_tokens > hits
    batch = engine.trajectory_batch(trajectories)
    for b, t in enumerate(trajectories):
        p, n = len(t.prompt_ids), len(t.completion_ids)
        assert n == 3 * 7 + 2 * 5 and t.num_turns == 3
        want_mask = np.array([True] * 7 + [False] * 5 + [True] * 7 + [False] * 5 + [True] * 7)
        np.testing.assert_array_equal(batch.completion_mask[b, :n], want_mask)
        np.testing.assert_array_equal(batch.loss_mask[b, p - 1:p - 1 + n], want_mask)
        assert batch.loss_mask[b].sum() == 21 and list(batch.input_ids[b, :p + n]) == t.token_ids
        _, logp = ref.logits(t.token_ids)
        for i in np.flatnonzero(want_mask):
            assert batch.logprobs[b, p - 1 + i] == pytest.approx(logp[p - 1 + i, t.completion_ids[i]], abs=2e-4)
        assert (batch.logprobs[b, p - 1:p - 1 + n][~want_mask] == 0).all()
        assert (batch.completion_policy_versions[b, :n][~want_mask] == -1).all()


@pytest.mark.parametrize("action", ["abort", "recompute"])
def test_max_policy_lag_bounds_staleness(model, ref: Reference, action: str) -> None:
    """A sample that began more than `max_policy_lag` versions ago is aborted (partial output returned) or
    recomputed under the new weights; younger ones run on; everything is counted."""
    from test_weight_sync import to_hf

    engine = Engine.from_model(model, ByteTokenizer(), **{**ENGINE_KW, "max_policy_lag": 1,
                                                          "policy_lag_action": action})
    same = to_hf(model)
    sp = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    old = engine.add_request(PROMPTS[0], sp)
    engine.step()
    engine.step()
    engine.sync_weights(same, "hf")  # version 1: `old` began under version None (0): lag 1, kept
    young = engine.add_request(PROMPTS[1], sp)
    engine.step()
    engine.step()
    engine.sync_weights(same, "hf")  # version 2: `old` lag 2 > 1; `young` began at 1: lag 1, kept
    stats = engine.stats()
    final = {rid: outs[-1] for rid, outs in run_to_end(engine).items()}
    if action == "abort":
        assert stats.num_lag_aborts == 1 and final[old].outputs[0].finish_reason == "abort"
        assert 0 < len(final[old].outputs[0].token_ids) < 60
    else:
        assert stats.num_lag_recomputes == 1 and final[old].outputs[0].finish_reason == "length"
    assert final[young].outputs[0].finish_reason == "length"
    for rid, prompt in ((old, PROMPTS[0]), (young, PROMPTS[1])):
        c = final[rid].outputs[0]
        assert c.token_ids == ref.greedy(prompt, len(c.token_ids))  # the same weights throughout
    assert not engine.has_unfinished_requests()
