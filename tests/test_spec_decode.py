"""N-gram speculative decoding: outputs equal plain decoding token for token (exact replay).

Reuses the tiny Llama, `ByteTokenizer` and budgets of `tests/test_engine.py`, so the compiled step
programs are shared with it process-wide. Exactness tests use `auto_disable=False` so that every
decode step drafts. Logprobs are compared with a float32-ulp tolerance: a verification step runs
another compiled program (other matmul / attention shapes) than a plain decode step, so the same
logprob may differ in its last float32 bits (measured: ~2.4e-6 on logprobs of magnitude <= ~7, 2.7e-5
on -52.5; plain decoding alone is bitwise reproducible across batch sizes).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollout import Engine, NgramConfig, SamplingParams
from rollout.scheduler import ScheduledBatch
from rollout.speculator import EMA, PROBE_STEPS, Speculator
from weight_sync.compiles import num_compilations
from runner.spec_decode.ngram import propose_batch, propose_ngram
from runner.step_padding import pad_plan, verify_shape
from test_engine import ENGINE_KW, MAX_LEN, ByteTokenizer, make_model, rand_prompt

SPEC = NgramConfig(k=4, prompt_lookup_min=1, prompt_lookup_max=3, auto_disable=False)


def close(a: float, b: float) -> bool:
    """Equal up to float32 last-bit differences between compiled programs (see module docstring)."""
    return a == b or abs(a - b) <= 1e-5 + 1e-6 * abs(a)  # a == b: -inf (filtered by top_p)


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def plain(model) -> Engine:
    return Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)


@pytest.fixture(scope="module")
def spec(model) -> Engine:
    return Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=SPEC)


def repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    """Short random phrases repeated a few times: n-gram lookup finds them, so drafts get accepted."""
    rng = np.random.default_rng(seed)
    return [rand_prompt(rng, int(rng.integers(3, 8))) * int(rng.integers(3, 6)) for _ in range(count)]


def assert_same(expected, got, logprobs: bool = False) -> None:
    assert len(expected) == len(got)
    for e_req, g_req in zip(expected, got):
        assert len(e_req.outputs) == len(g_req.outputs)
        for e, g in zip(e_req.outputs, g_req.outputs):
            assert g.token_ids == e.token_ids
            assert (g.finish_reason, g.stop_reason) == (e.finish_reason, e.stop_reason)
            if logprobs:
                assert len(g.logprobs) == len(e.logprobs)
                for a, b in zip(e.logprobs, g.logprobs):
                    assert a.token_id == b.token_id
                    assert close(a.logprob, b.logprob)
                    assert a.top.keys() == b.top.keys()
                    assert all(close(a.top[t], b.top[t]) for t in a.top)


# ---- propose_ngram ----------------------------------------------------------------------------

def ids(*xs: int) -> np.ndarray:
    return np.array(xs, np.int32)


def test_ngram_latest_match_wins() -> None:
    # the tail "1 2" occurs twice earlier; the later occurrence (followed by 7 8) wins
    assert propose_ngram(ids(1, 2, 5, 6, 1, 2, 7, 8, 1, 2), k=2, min_n=1, max_n=3).tolist() == [7, 8]


def test_ngram_longest_n_first() -> None:
    # n=3 "4 1 2" matches only the early occurrence (-> 9); n=2 "1 2" would match the later one (-> 7)
    h = ids(4, 1, 2, 9, 9, 1, 2, 7, 4, 1, 2)
    assert propose_ngram(h, k=1, min_n=1, max_n=3).tolist() == [9]
    assert propose_ngram(h, k=1, min_n=1, max_n=2).tolist() == [7]
    # min_n bounds how short a match may be: only a unigram matches here
    h2 = ids(3, 5, 6, 4, 3)
    assert propose_ngram(h2, k=2, min_n=1, max_n=3).tolist() == [5, 6]
    assert propose_ngram(h2, k=2, min_n=2, max_n=3).tolist() == []


def test_ngram_no_match_is_empty() -> None:
    assert propose_ngram(ids(1, 2, 3, 4), k=4, min_n=1, max_n=3).tolist() == []
    assert propose_ngram(ids(5), k=4, min_n=1, max_n=3).tolist() == []
    assert propose_ngram(ids(), k=4, min_n=1, max_n=3).tolist() == []


def test_ngram_k_caps_and_history_end() -> None:
    h = ids(1, 2, 3, 4, 5, 6, 1)
    assert propose_ngram(h, k=3, min_n=1, max_n=3).tolist() == [2, 3, 4]
    assert propose_ngram(h, k=10, min_n=1, max_n=3).tolist() == [2, 3, 4, 5, 6, 1]  # up to the end
    # a repeated token: the latest earlier match is the one just before the tail
    assert propose_ngram(ids(7, 7, 7, 7), k=4, min_n=1, max_n=3).tolist() == [7]
    # per-sequence limits (room left before max_tokens / max_model_len); <= 0 means no draft
    cfg = NgramConfig(k=3)
    out = propose_batch([h, h, h], [2, 0, -1], cfg)
    assert [d.tolist() for d in out] == [[2, 3], [], []]


def test_ngram_config_validation(model) -> None:
    with pytest.raises(ValueError):
        NgramConfig(k=0)
    with pytest.raises(ValueError):
        NgramConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    for bad in (dict(k=2.5), dict(prompt_lookup_max=3.5)):  # would fail only later, inside generate()
        with pytest.raises(ValueError, match="must be integers"):
            NgramConfig(**bad)
    with pytest.raises(ValueError):
        Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=NgramConfig(k=8))


# ---- exactness ----------------------------------------------------------------------------------

CASES = {
    "greedy": dict(temperature=0.0),
    "t1.0": dict(temperature=1.0),
    "t0.7_top_p0.9": dict(temperature=0.7, top_p=0.9),
    "logprobs_raw": dict(temperature=1.0, logprobs=2),
    "logprobs_processed": dict(temperature=0.7, top_p=0.9, logprobs=2, logprobs_mode="processed"),
}


def test_steps_without_drafts_run_as_multi_step_calls(plain: Engine, model) -> None:
    """Decode steps that do not draft (auto-disable judged plain decoding faster) become multi-step
    calls of up to `num_scheduler_steps` steps; outputs and logprobs stay those of plain decoding."""
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=SPEC, num_scheduler_steps=4)
    decisions = iter(range(10**6))
    engine.core.speculator._worth_it = lambda num_seqs: next(decisions) % 3 == 0  # draft one step in three
    prompts = repetitive_prompts(7, 8)
    params = [SamplingParams(seed=i, max_tokens=30, ignore_eos=True, temperature=1.0 if i % 2 else 0.0, logprobs=1)
              for i in range(8)]
    assert_same(plain.generate(prompts, params), engine.generate(prompts, params), logprobs=True)
    stats = engine.stats()
    assert stats.speculative.num_draft_steps > 0 and stats.speculative.num_disabled_steps > 0
    assert stats.decode_tokens > stats.num_decode_steps * len(prompts)  # some calls ran several steps


@pytest.mark.parametrize("case", list(CASES))
def test_spec_equals_plain(plain: Engine, spec: Engine, case: str) -> None:
    before = spec.stats().speculative
    for batch_size in (1, 8, 32):
        prompts = repetitive_prompts(100 + batch_size, batch_size)
        params = [SamplingParams(seed=i, max_tokens=24, ignore_eos=True, **CASES[case]) for i in range(batch_size)]
        assert_same(plain.generate(prompts, params), spec.generate(prompts, params), logprobs="logprobs" in case)
    after = spec.stats().speculative
    assert after.num_draft_steps > before.num_draft_steps
    assert after.accepted_tokens > before.accepted_tokens  # repetitive prompts: drafts get accepted
    assert after.num_disabled_steps == 0  # auto_disable=False


def test_spec_n_samples_equal_plain(plain: Engine, spec: Engine) -> None:
    prompts = repetitive_prompts(7, 3)
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20, logprobs=1, ignore_eos=True)
    assert_same(plain.generate(prompts, sp), spec.generate(prompts, sp), logprobs=True)


def test_spec_with_preemption_equals_plain(model, plain: Engine) -> None:
    small = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, kv_cache_blocks=MAX_LEN // 16, speculative=SPEC)
    prompts = repetitive_prompts(11, 6)
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=48, logprobs=2, ignore_eos=True)
    assert_same(plain.generate(prompts, sp), small.generate(prompts, sp), logprobs=True)
    stats = small.stats()
    assert stats.num_preemptions > 0
    assert stats.speculative.accepted_tokens > 0


# ---- stop rules ---------------------------------------------------------------------------------

def test_max_tokens_and_max_model_len(plain: Engine, spec: Engine) -> None:
    prompts = repetitive_prompts(21, 4)
    for max_tokens in (1, 2, 3, 5, 6, 13):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = spec.generate(prompts, sp)
        assert_same(plain.generate(prompts, sp), outs)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    # a prompt close to max_model_len: drafts must stop at the end of the context
    long = [(repetitive_prompts(22, 1)[0] * 40)[:MAX_LEN - 9]]
    sp = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    outs = spec.generate(long, sp)
    assert_same(plain.generate(long, sp), outs)
    assert len(outs[0].outputs[0].token_ids) == 9 and outs[0].outputs[0].finish_reason == "length"


def test_stop_token_ids_and_min_tokens(plain: Engine, spec: Engine) -> None:
    prompts = repetitive_prompts(31, 4)
    free = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for i, out in enumerate(free):
        toks = out.outputs[0].token_ids
        stop = toks[len(toks) // 3]  # a token the greedy output does produce
        first = toks.index(stop)
        for min_tokens in (0, first + 1, first + 3):  # + 1 / + 3: the first occurrence is masked
            sp = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=min_tokens, stop_token_ids=[stop],
                                ignore_eos=True)
            expected, got = plain.generate([prompts[i]], sp), spec.generate([prompts[i]], sp)
            assert_same(expected, got)
            c = got[0].outputs[0]
            assert len(c.token_ids) >= min_tokens
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == stop and stop not in c.token_ids[min_tokens:-1]


def test_min_tokens_masks_eos() -> None:
    """A model whose argmax is always EOS: min_tokens holds it off in every verification row."""
    eos_model = make_model(eos_logit=20.0)
    a = Engine.from_model(eos_model, ByteTokenizer(), **ENGINE_KW)
    b = Engine.from_model(eos_model, ByteTokenizer(), **ENGINE_KW, speculative=SPEC)
    prompts = repetitive_prompts(41, 3)
    for sp in (SamplingParams(temperature=0.0, min_tokens=12, max_tokens=30),
               SamplingParams(temperature=1.0, seed=2, min_tokens=7, max_tokens=30, logprobs=1)):
        outs = b.generate(prompts, sp)
        assert_same(a.generate(prompts, sp), outs, logprobs=sp.logprobs is not None)
        for o in outs:
            c = o.outputs[0]
            assert c.finish_reason == "stop" and len(c.token_ids) == sp.min_tokens + 1 and c.token_ids[-1] == 1
    assert b.stats().speculative.num_draft_steps > 0


# ---- weight sync, compilation, auto-disable ---------------------------------------------------------

def test_sync_weights_then_spec_equals_plain(model) -> None:
    a = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)
    b = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=SPEC)
    prompts = repetitive_prompts(51, 4)
    sp = SamplingParams(temperature=1.0, seed=9, max_tokens=32, logprobs=1, ignore_eos=True)
    old = b.generate(prompts, sp)

    other = make_model()
    rng = np.random.default_rng(1)
    state = nnx.state(other, nnx.Param)
    nnx.update(other, jax.tree.map(lambda x: x + jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype), state))
    new_params = nnx.state(other, nnx.Param)
    a.sync_weights(new_params)
    b.sync_weights(new_params)

    new = b.generate(prompts, sp)
    assert_same(a.generate(prompts, sp), new, logprobs=True)
    assert [o.outputs[0].token_ids for o in new] != [o.outputs[0].token_ids for o in old]  # the policy changed
    assert all(o.outputs[0].policy_version == 1 for o in new)
    by_version = b.stats().speculative.acceptance_by_version
    assert set(by_version) == {None, 1} and by_version[1][0] > 0


def test_no_compilation_after_warmup(model) -> None:
    e = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=SPEC)
    e.warmup()
    rng = np.random.default_rng(61)
    calls = [
        (repetitive_prompts(62, 1), SamplingParams(temperature=0.0, max_tokens=12)),
        (repetitive_prompts(63, 8), SamplingParams(temperature=1.0, top_p=0.9, seed=1, max_tokens=12)),
        (repetitive_prompts(64, 3), SamplingParams(temperature=1.0, logprobs=2, max_tokens=12)),
        (repetitive_prompts(65, 2), SamplingParams(temperature=0.0, logprobs=1, logprobs_mode="processed",
                                                   max_tokens=12)),
        (repetitive_prompts(66, 13), SamplingParams(min_tokens=3, stop_token_ids=[5], max_tokens=12)),
        ([rand_prompt(rng, 110)], SamplingParams(temperature=0.0, max_tokens=30)),  # chunked, up to max_model_len
    ]
    before = num_compilations()
    for prompts, sp in calls:
        e.generate(prompts, sp)
    assert num_compilations() - before == 0
    assert e.stats().speculative.accepted_tokens > 0


def test_warmup_compiles_every_verification_row_count(model) -> None:
    """A verification step's rows follow the draft lengths: every count up to max_num_seqs * (k + 1)
    must land in a bucket warmup() compiled (a 6-token step once padded to an uncompiled 8)."""
    e = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=SPEC)
    e.warmup()
    runner, k = e.runner, SPEC.k
    pages = runner.buckets.page_buckets[-1]
    before = num_compilations()
    for rows in range(1, ENGINE_KW["max_num_seqs"] * (k + 1) + 1):
        # other splits than warmup's (sequences of k + 1 tokens): 2-token sequences where they fit
        split = 1 if -(-rows // 2) <= ENGINE_KW["max_num_seqs"] else k
        runner.run(runner.dummy_steps.verify(rows, pages, split, 0))
    assert num_compilations() - before == 0


def test_verification_rows_are_trimmed_only_without_vmap(model) -> None:
    """`trim_rows` (attend only the rows real sequences use, a `lax.switch`) is off where the program
    maps over replicas (several, or a mesh): under vmap a switch runs every branch."""
    runner = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=SPEC).runner
    step = runner.dummy_steps.verify(SPEC.k + 1, runner.buckets.page_buckets[-1], SPEC.k, 0)
    args = (runner.buckets, runner.kv_spec.block_size, 1, runner.kv_spec.blocks_per_replica)
    assert pad_plan(step, verify_shape, *args)[0].md.trim_rows
    assert not pad_plan(step, verify_shape, *args, on_mesh=True)[0].md.trim_rows


def test_auto_disable_on_unhelpful_drafts(model) -> None:
    """Random prompts: drafts are rarely accepted and verification costs more, so drafting turns off."""
    e = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, 
                          speculative=dataclasses.replace(SPEC, auto_disable=True))
    rng = np.random.default_rng(71)
    prompts = [rand_prompt(rng, 20) for _ in range(8)]
    e.generate(prompts, SamplingParams(temperature=1.0, seed=0, max_tokens=64, ignore_eos=True))
    s = e.stats().speculative
    assert s.num_draft_steps > 0  # it did try
    assert s.num_disabled_steps > 0, s


def decisions(s: Speculator, seqs: list[SimpleNamespace], count: int) -> list[bool]:
    return [s._worth_it(seqs) for _ in range(count)]


class FakeSeq:
    """What the speculator reads of a `Sequence` (hashed by identity and weakly referenced, as one)."""

    def __init__(self, **fields: object) -> None:
        self.__dict__.update(fields)


def fake_seqs(n: int) -> list[FakeSeq]:
    return [FakeSeq(params=SimpleNamespace(max_tokens=100), num_output_tokens=0, num_tokens=10) for _ in range(n)]


def test_worth_it_decision() -> None:
    """`_worth_it` with recorded timings: throughputs decide, from each sequence's own acceptance; the
    losing path is re-measured every 16 decode steps, less often while the same path keeps winning."""
    s = Speculator(NgramConfig(k=4, auto_disable=True), max_model_len=128, max_num_batched_tokens=64)
    seqs = fake_seqs(8)
    assert s._worth_it(seqs)  # nothing measured: draft
    s.record_step(8, True, 0.020)
    assert decisions(s, seqs, 16) == [True] * 15 + [False]  # plain not measured yet: the 16th step measures it
    s.record_step(8, False, 0.010)
    # not verified yet, so optimistic (5 tokens): 5 tokens / 20 ms beats 1 token / 10 ms
    assert decisions(s, seqs, 16) == [True] * 15 + [False]  # (the 16th re-measures plain decoding)
    for _ in range(30):  # nothing accepted: 1 token / 20 ms loses
        for q in seqs:
            s.record_acceptance(q, 4, 0, 1, None)
    # the winner changed (first call): re-measure drafting 16 steps later
    assert decisions(s, seqs, 32) == [False] * 16 + [True] + [False] * 15
    assert decisions(s, seqs, 32) == [False] * 16 + [True] + [False] * 15  # (a probe that flips nothing doubles)
    assert decisions(s, seqs, 64).count(True) == 1  # the interval doubled: one probe in 32 steps
    fresh = fake_seqs(8)  # a new call's sequences are judged on their own, not by the last ones' tails
    assert s.expected_tokens_per_step(fresh) == 5.0 and s._worth_it(fresh)
    for _ in range(30):  # half accepted: 1 + 0.5 * 4 = 3 tokens / 20 ms beats 1 / 10 ms
        for q in seqs:
            s.record_acceptance(q, 4, 2, 3, None)
    assert decisions(s, seqs, 15).count(True) >= 14
    assert s._worth_it(fake_seqs(1))  # batch sizes are judged separately: nothing measured for 1 sequence
    for _ in range(30):  # plain decoding got faster: 1 token / 5 ms beats 3 tokens / 20 ms
        s.record_step(8, False, 0.005)
    assert decisions(s, seqs, 15).count(False) >= 14
    # a multi-step plain call counts all its steps towards the next re-measurement of drafting
    batch = ScheduledBatch("decode_loop", seqs, [8] * 8)
    s.draft_fn = lambda seqs, limits: [np.array([1], np.int32)] * len(seqs)
    probes = [s.propose(batch)[0].num_new_tokens[0] == 1 for _ in range(40)]
    assert 2 <= probes.count(True) <= 12, probes
    off = Speculator(NgramConfig(auto_disable=False), 128, 64)
    off.record_step(8, True, 1.0)
    off.record_step(8, False, 0.001)
    assert decisions(off, seqs, 32) == [True] * 32  # auto_disable=False: always draft



def test_estimates_start_optimistic_and_forget_stale_values() -> None:
    """A sequence's first verification moves its estimate from 1 + k instead of replacing it, and a
    sequence switched off by an unlucky streak drifts back to the population's mean while it skips
    drafting (its estimate is not refreshed then), so drafting resumes within a few steps."""
    s = Speculator(NgramConfig(k=3, auto_disable=True), max_model_len=128, max_num_batched_tokens=64)
    s.draft_fn = lambda seqs, limits: [np.array([1], np.int32)] * len(seqs)
    s.record_step(1, True, 0.016)  # verification 16 ms, plain 10 ms: drafting pays above 1.6 tokens per step
    s.record_step(1, False, 0.010)
    [seq] = fake_seqs(1)
    s.record_acceptance(seq, 3, 0, 1, None)
    assert s._estimate(seq) == pytest.approx((1 - EMA) * 4 + EMA * 1)
    for _ in range(40):
        s.record_acceptance(seq, 3, 2, 3, None)
    for _ in range(6):  # unlucky: 3 -> 1.52 tokens per step, below break-even
        s.record_acceptance(seq, 3, 0, 1, None)
    assert s.expected_tokens_per_step([seq]) < 1.6
    drafted = [s.propose(ScheduledBatch("decode_loop", [seq], [1]))[1] is not None for _ in range(4)]
    assert drafted[0] is False and True in drafted, drafted
    bad = Speculator(NgramConfig(k=3, auto_disable=True), max_model_len=128, max_num_batched_tokens=64)
    bad.draft_fn = s.draft_fn
    bad.record_step(1, True, 0.016)
    bad.record_step(1, False, 0.010)
    for _ in range(40):  # every sequence's drafts fail: the population's mean stays low, drafting stays off
        bad.record_acceptance(seq, 3, 0, 1, None)
    assert [bad.propose(ScheduledBatch("decode_loop", [seq], [1]))[1] for _ in range(8)] == [None] * 8

def test_plain_step_is_lone_only_when_these_sequences_dip() -> None:
    """A disabled step while drafting still pays for the population (these sequences dipped) decodes one
    untimed plain step, so the next can draft again, and a re-measurement of plain decoding runs
    `PROBE_STEPS`; when plain decoding wins for the population too, a disabled step keeps the
    scheduler's multi-step count and its time counts."""
    s = Speculator(NgramConfig(k=3, auto_disable=True), max_model_len=128, max_num_batched_tokens=64)
    s.draft_fn = lambda seqs, limits: [np.array([1], np.int32)] * len(seqs)
    s.record_step(1, True, 0.016)  # verification 16 ms, plain 10 ms: drafting pays above 1.6 tokens per step
    s.record_step(1, False, 0.010)
    [good], [dip] = fake_seqs(1), fake_seqs(1)
    for _ in range(40):
        s.record_acceptance(good, 3, 2, 3, None)
    for _ in range(10):  # this sequence's estimate falls to ~1.2; the population's mean stays ~2.2
        s.record_acceptance(dip, 3, 0, 1, None)
    run, drafts = s.propose(ScheduledBatch("decode_loop", [dip], [8]))
    assert drafts is None and run.num_new_tokens == [1]
    s.record_step(1, False, 5.0)  # the lone step's time (host overhead and all) is not plain decoding's
    assert s._seconds[(False, 1)] == pytest.approx(0.010)
    s._steps_since_probe = s._probe_every - 1  # the next decision re-measures plain decoding: a short call
    run, drafts = s.propose(ScheduledBatch("decode_loop", [good], [8]))
    assert drafts is None and run.num_new_tokens == [PROBE_STEPS]
    s.record_step(1, False, 0.010 * PROBE_STEPS, num_steps=PROBE_STEPS)
    for _ in range(60):  # now every sequence's drafts fail: plain decoding wins for the population
        s.record_acceptance(good, 3, 0, 1, None)
    run, drafts = s.propose(ScheduledBatch("decode_loop", [dip], [8]))
    assert drafts is None and run.num_new_tokens == [8]
    s.record_step(1, False, 0.080, num_steps=8)
    assert s._seconds[(False, 1)] == pytest.approx(0.010)  # (the same 10 ms per step, now measured)


# ---- rejection-sampling verification -------------------------------------------------------------

REJECTION = dataclasses.replace(SPEC, verification="rejection")


@pytest.fixture(scope="module")
def rejection(model) -> Engine:
    return Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=REJECTION)


def test_rejection_mode_greedy_equals_plain(plain: Engine, rejection: Engine) -> None:
    prompts = repetitive_prompts(41, 8)
    sp = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)
    assert_same(plain.generate(prompts, sp), rejection.generate(prompts, sp), logprobs=True)
    assert rejection.stats().speculative.accepted_tokens > 0


def test_rejection_mode_samples_the_target_distribution(plain: Engine, rejection: Engine) -> None:
    """Many samples of one repetitive prompt: at every position the rejection-sampled tokens and
    plain decoding's tokens come from the same distribution (chi-square homogeneity test), drafts
    do get accepted, and every emitted logprob is the target's (checked against plain decoding's
    logprob of the same token after the same prefix). The prompt ends with the model's own greedy
    continuation, which falls into a cycle: n-gram drafts then propose tokens the model likes, so
    hundreds get accepted whatever the seed (after a random prompt alone, a handful, by luck)."""
    start = repetitive_prompts(43, 1)[0]
    cycle = plain.generate([start], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    prompt = start + list(cycle.outputs[0].token_ids)
    sp = SamplingParams(n=400, temperature=1.0, top_p=0.95, seed=9, max_tokens=4, logprobs=0, ignore_eos=True)
    before = rejection.stats().speculative.accepted_tokens
    got = rejection.generate([prompt], sp)[0].outputs
    want = plain.generate([prompt], sp)[0].outputs
    assert rejection.stats().speculative.accepted_tokens >= before + 50
    assert_same_distributions(got, want, range(1, 4))
    assert_target_logprobs(plain, prompt, got[:5])


def assert_same_distributions(got: list, want: list, positions: range, min_compared: int = 6) -> None:
    """At each position, the tokens of samples `got` and `want` come from one distribution (chi-square
    homogeneity; tokens seen fewer than 10 times pooled)."""
    from scipy import stats as scipy_stats

    compared = 0
    for pos in positions:
        a = np.array([c.token_ids[pos] for c in got])
        b = np.array([c.token_ids[pos] for c in want])
        values = np.union1d(a, b)
        table = np.array([[np.sum(x == v) for v in values] for x in (a, b)])
        common = table.sum(0) >= 10
        table = np.concatenate([table[:, common], table[:, ~common].sum(1, keepdims=True)], axis=1)
        table = table[:, table.sum(0) > 0]
        if table.shape[1] > 1:
            assert scipy_stats.chi2_contingency(table).pvalue > 1e-3, (pos, table)
            compared += table.shape[1]
    assert compared >= min_compared, "the prompt's continuations are too deterministic to test anything"


def assert_target_logprobs(plain: Engine, prompt: list[int], outputs: list) -> None:
    """A plain engine scoring each completion (prompt logprobs) gives the logprobs reported with it."""
    for c in outputs:
        forced = plain.generate([prompt + c.token_ids[:-1]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        scored = forced.prompt_logprobs[len(prompt):]  # logprob of c.token_ids[i] after prompt + c.token_ids[:i]
        assert len(scored) == len(c.token_ids) - 1
        for i, lp in enumerate(scored):
            assert lp.token_id == c.token_ids[i] and close(lp.logprob, c.logprobs[i].logprob)
