"""vLLM's logits processors and logprob options on the tiny random Llama of test_engine, against an
independent numpy reference over the full forward: presence / frequency / repetition penalties,
logit_bias, allowed_token_ids, bad_words (greedy tokens, raw and processed logprobs, seeded sampling),
in one-step, multi-step and asynchronous decoding and beside requests without them; `logprobs=-1`,
ranks, decoded tokens, the `*_logits` modes; `min_tokens` with more than 8 ending ids; bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rollout.engine import Engine
from rollout.sampling_params import SamplingParams
from test_engine import EOS, ENGINE_KW, VOCAB, ByteTokenizer, Reference, make_model, rand_prompt

PROMPT = rand_prompt(np.random.default_rng(71), 10)
OTHER = rand_prompt(np.random.default_rng(72), 14)
NEW = 14


def reference_adjust(logits: np.ndarray, prompt: list[int], output: list[int], sp: SamplingParams,
                     bad_words: list[list[int]]) -> np.ndarray:
    """vLLM's processors on one row of logits (float64), written out from its definitions."""
    x = logits.astype(np.float64).copy()
    if sp.allowed_token_ids is not None:
        keep = np.zeros(len(x), bool)
        keep[list(sp.allowed_token_ids)] = True
        x[~keep] = -np.inf
    for word in bad_words:
        if len(word) == 1 or (len(output) >= len(word) - 1 and output[len(output) - len(word) + 1:] == word[:-1]):
            x[word[-1]] = -np.inf
    for token, bias in (sp.logit_bias or {}).items():
        x[token] += bias
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(x)).astype(np.float64)
    seen = (counts > 0) | np.isin(np.arange(len(x)), prompt)
    rp = sp.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / rp, x * rp), x)
    return x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x[np.isfinite(x)])
    return x - (m + np.log(np.sum(np.exp(x[np.isfinite(x)] - m))))


@pytest.fixture(scope="module")
def model():
    return make_model(3)


@pytest.fixture(scope="module")
def reference(model) -> Reference:
    return Reference(model)


@pytest.fixture(scope="module", params=["one_step", "multi_step", "async"])
def engine(request, model) -> Engine:
    kw = dict(one_step=dict(num_scheduler_steps=1, async_scheduling=False),
              multi_step=dict(num_scheduler_steps=4, async_scheduling=False),
              **{"async": dict(num_scheduler_steps=4, async_scheduling=True)})[request.param]
    return Engine.from_model(model, ByteTokenizer(), max_logprobs=-1, **ENGINE_KW, **kw)


def _bad_word(reference: Reference) -> tuple[str, list[list[int]]]:
    """A two-token bad word that greedy decoding of PROMPT would produce, as text and as ids."""
    greedy = reference.greedy(PROMPT, NEW)
    j = next(j for j in range(2, NEW - 1) if all(32 <= t < 127 for t in greedy[j:j + 2]))
    word = greedy[j:j + 2]
    return "".join(map(chr, word)), [word]


PROCESSOR_CASES = {
    "penalties": dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6),
    "repetition_only": dict(repetition_penalty=0.7),
    "bias": dict(logit_bias={5: 3.0, 40: -100.0, 77: 2.5}),
    "allowed": dict(allowed_token_ids=[3, 9, 40, 41, 77, 100]),
}


@pytest.mark.parametrize("case", [*PROCESSOR_CASES, "bad_words"])
def test_greedy_and_logprobs_match_the_reference(engine: Engine, reference: Reference, case: str) -> None:
    kw, words = (dict(PROCESSOR_CASES[case]), []) if case != "bad_words" else ({}, None)
    if case == "bad_words":
        text, words = _bad_word(reference)
        kw = dict(bad_words=[text])
    raw_sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=3, **kw)
    processed_sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=3,
                                  logprobs_mode="processed", **kw)
    raw_out, processed_out = (o.outputs[0] for o in engine.generate([PROMPT, PROMPT], [raw_sp, processed_sp]))
    assert raw_out.token_ids == processed_out.token_ids
    if case != "allowed":  # (a plain greedy run is the control: the processors changed something)
        assert raw_out.token_ids != reference.greedy(PROMPT, NEW)
    output: list[int] = []
    for i, token in enumerate(raw_out.token_ids):
        logits, logp = reference.logits(PROMPT + output)
        adjusted = reference_adjust(logits[-1], PROMPT, output, raw_sp, words)
        assert token == int(np.argmax(adjusted)), f"token {i}"
        processed = log_softmax(adjusted)
        np.testing.assert_allclose(raw_out.logprobs[i].logprob, logp[-1, token], atol=1e-4)
        np.testing.assert_allclose(processed_out.logprobs[i].logprob, processed[token], atol=1e-4)
        top = sorted(processed_out.logprobs[i].top, key=lambda t: -processed[t])
        assert list(processed_out.logprobs[i].top) == top and len(top) == 3
        assert processed_out.logprobs[i].rank == 1  # greedy: the processed argmax
        assert raw_out.logprobs[i].rank == 1 + int(np.sum(logp[-1] > logp[-1, token]))
        output.append(token)


def test_seeded_sampling_follows_the_processed_distribution(engine: Engine, reference: Reference) -> None:
    sp = SamplingParams(temperature=0.8, seed=5, max_tokens=NEW, ignore_eos=True, logprobs=0, logprobs_mode="processed",
                        presence_penalty=1.0, repetition_penalty=1.3, logit_bias={7: 2.0})
    outs = engine.generate([PROMPT] * 3, [sp, SamplingParams(temperature=0.8, seed=5, max_tokens=NEW, ignore_eos=True),
                                          sp])
    first, plain, again = (o.outputs[0] for o in outs)
    assert first.token_ids == again.token_ids  # seeded: reproducible
    assert plain.token_ids != first.token_ids
    output: list[int] = []
    for i, token in enumerate(first.token_ids):
        logits, _ = reference.logits(PROMPT + output)
        processed = log_softmax(reference_adjust(logits[-1], PROMPT, output, sp, []) / sp.temperature)
        np.testing.assert_allclose(first.logprobs[i].logprob, processed[token], atol=1e-4)
        output.append(token)


def test_requests_without_processors_are_unchanged_beside_them(engine: Engine) -> None:
    plain = SamplingParams(temperature=0.7, seed=11, max_tokens=NEW, logprobs=2)
    (alone,) = engine.generate([OTHER], plain)
    mixed = engine.generate([OTHER, PROMPT, PROMPT], [plain, SamplingParams(
        temperature=0.0, max_tokens=NEW, **PROCESSOR_CASES["penalties"]), SamplingParams(
        temperature=0.9, max_tokens=NEW, **PROCESSOR_CASES["allowed"])])
    assert mixed[0].outputs[0].token_ids == alone.outputs[0].token_ids
    np.testing.assert_allclose(mixed[0].outputs[0].logprobs.values, alone.outputs[0].logprobs.values, atol=1e-5)
    assert set(mixed[2].outputs[0].token_ids) <= set(PROCESSOR_CASES["allowed"]["allowed_token_ids"])


def test_ngram_verification_rows_see_the_drafts_before_them(model) -> None:
    """Speculation with penalties: verification row k of a sequence samples after its first k drafts, so
    its frequency counts include them; tokens and processed logprobs equal plain decoding's."""
    from rollout import NgramConfig

    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0, logprobs_mode="processed",
                        allowed_token_ids=[65, 66, 67], frequency_penalty=2.0)  # alternates: n-gram drafts match
    prompt = PROMPT + [65, 66, 67] * 3
    plain = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW).generate([prompt], sp)[0].outputs[0]
    for seeded in (sp, dataclasses.replace(sp, temperature=0.8, seed=3)):
        want = (plain if seeded is sp else
                Engine.from_model(model, ByteTokenizer(), **ENGINE_KW).generate([prompt], seeded)[0].outputs[0])
        engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW,
                                   speculative=NgramConfig(k=3, auto_disable=False))
        got = engine.generate([prompt], seeded)[0].outputs[0]
        assert engine.stats().speculative.accepted_tokens > 0
        assert got.token_ids == want.token_ids
        np.testing.assert_allclose(got.logprobs.values, want.logprobs.values, atol=1e-5)


def test_whole_vocabulary_logprobs_ranks_and_logits_modes(engine: Engine, reference: Reference) -> None:
    outs = engine.generate([PROMPT] * 3, [
        SamplingParams(temperature=1.0, seed=2, max_tokens=4, logprobs=-1, prompt_logprobs=-1),
        SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, logprobs_mode="raw_logits"),
        SamplingParams(temperature=0.5, top_k=5, seed=3, max_tokens=4, logprobs=2, logprobs_mode="processed_logits")])
    full, raw_logits, processed_logits = (o.outputs[0] for o in outs)
    assert len(outs[0].prompt_logprobs[1].top) == VOCAB
    for i in range(4):
        logits, logp = reference.logits(PROMPT + full.token_ids[:i])
        entry = full.logprobs[i]
        assert len(entry.top) == VOCAB and entry.decoded_token == chr(entry.token_id)
        np.testing.assert_allclose([entry.top[t] for t in range(VOCAB)], logp[-1], atol=1e-4)
        assert entry.rank == 1 + int(np.sum(logp[-1] > logp[-1, entry.token_id]))
        as_dict = entry.as_dict()
        assert as_dict[entry.token_id].rank == entry.rank and len(as_dict) == VOCAB

        logits, _ = reference.logits(PROMPT + raw_logits.token_ids[:i])
        token = raw_logits.token_ids[i]
        np.testing.assert_allclose(raw_logits.logprobs[i].logprob, logits[-1, token], atol=1e-4)
        np.testing.assert_allclose(sorted(raw_logits.logprobs[i].top.values(), reverse=True),
                                   np.sort(logits[-1])[::-1][:2], atol=1e-4)

        logits, _ = reference.logits(PROMPT + processed_logits.token_ids[:i])
        token = processed_logits.token_ids[i]
        np.testing.assert_allclose(processed_logits.logprobs[i].logprob, logits[-1, token] / 0.5, atol=1e-4)
        assert processed_logits.logprobs[i].rank <= 5


def test_min_tokens_holds_back_more_than_eight_ending_ids(engine: Engine, reference: Reference) -> None:
    greedy = reference.greedy(PROMPT, 10)
    stops = list(dict.fromkeys(greedy))[:6] + [t for t in range(100, VOCAB) if t not in greedy][:6]
    (out,) = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6,
                                                      stop_token_ids=stops))
    want: list[int] = []
    while len(want) < 10 and not (want and want[-1] in stops):
        logits, _ = reference.logits(PROMPT + want)
        row = logits[-1].copy()
        if len(want) < 6:
            row[stops + [EOS]] = -np.inf
        want.append(int(np.argmax(row)))
    assert out.outputs[0].token_ids == want and not set(want[:6]) & set(stops)


@pytest.mark.parametrize("kw, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(logit_bias=[(1, 2.0)]), "logit_bias"),
    (dict(logit_bias={3: 101.0}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1.5]), "allowed_token_ids"), (dict(bad_words="word"), "bad_words"),
    (dict(logprobs=-2), "logprobs"), (dict(logprobs_mode="logits"), "logprobs_mode"),
    (dict(sampling_record=True, logit_bias={1: 1.0}), "sampling_record"),
])
def test_bad_processor_settings_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_engine_refuses_what_it_cannot_take_and_stays_usable(model) -> None:
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)  # max_logprobs=20
    for sp, message in ((SamplingParams(logprobs=-1), "max_logprobs=-1"),
                        (SamplingParams(allowed_token_ids=[VOCAB]), "allowed_token_ids"),
                        (SamplingParams(logit_bias={VOCAB + 3: 1.0}), "logit_bias")):
        with pytest.raises(ValueError, match=message):
            engine.generate([PROMPT], sp)
    (out,) = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, logit_bias={3: 100.0}))
    assert out.outputs[0].token_ids == [3, 3, 3, 3]
