"""vLLM's request semantics on the tiny random Llama of test_engine: what `text` leaves out when a stop
id, EOS or a stop string ends a sample (`include_stop_str_in_output`), and bad input rejected with a
message naming the field before anything is queued."""

from __future__ import annotations

import numpy as np
import pytest

from rollout.engine import Engine
from rollout.sampling_params import SamplingParams
from test_engine import EOS, ENGINE_KW, ByteTokenizer, Reference, make_model, rand_prompt

PROMPT = rand_prompt(np.random.default_rng(500), 12)


@pytest.fixture(scope="module")
def model():
    return make_model(0)


@pytest.fixture(scope="module")
def engine(model) -> Engine:
    return Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)


def test_a_stop_id_leaves_its_text_out(engine: Engine, model) -> None:
    greedy = Reference(model).greedy(PROMPT, 12)
    j = next(j for j in range(3, 12) if greedy[j] not in greedy[:j] and greedy[j] != EOS)  # its first occurrence
    stop = greedy[j]
    sp = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop])
    (out,) = engine.generate([PROMPT], sp)
    c = out.outputs[0]
    assert c.token_ids == greedy[:j + 1] and c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == ByteTokenizer().decode(greedy[:j])
    (kept,) = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop],
                                                       include_stop_str_in_output=True))
    assert kept.outputs[0].text == ByteTokenizer().decode(greedy[:j + 1])


def test_eos_text_left_out_without_skipping_special_tokens() -> None:
    eos_engine = Engine.from_model(make_model(eos_logit=20.0), ByteTokenizer(), **ENGINE_KW)  # argmax is EOS
    sp = SamplingParams(temperature=0.0, max_tokens=5, min_tokens=2, skip_special_tokens=False)
    (out,) = eos_engine.generate([PROMPT], sp)
    c = out.outputs[0]
    assert c.token_ids[-1] == EOS and len(c.token_ids) == 3 and c.finish_reason == "stop"
    assert chr(EOS) not in c.text and c.text == ByteTokenizer().decode(c.token_ids[:-1], skip_special_tokens=False)


def test_a_stop_string_is_kept_when_asked(engine: Engine, model) -> None:
    greedy = Reference(model).greedy(PROMPT, 12)
    text = ByteTokenizer().decode(greedy)
    stop = text[4:6]
    first = text.find(stop)
    for include, want in ((False, text[:first]), (True, text[:first + len(stop)])):
        sp = SamplingParams(temperature=0.0, max_tokens=12, stop=[stop], include_stop_str_in_output=include)
        (out,) = engine.generate([PROMPT], sp)
        assert out.outputs[0].text == want and out.outputs[0].stop_reason == stop


@pytest.mark.parametrize("prompts, params, match", [
    ([1.5, 2.0], None, "token ids must be integers"),
    ([["1", "2"]], None, "token ids must be integers"),
    ([[3, True]], None, "token ids must be integers"),  # a bool is an int to Python, not a token id
    ([[3, -1]], None, "outside the vocabulary"),
    ([[3, 10**6]], None, "outside the vocabulary"),
    (None, None, "prompts must be"),
    ([[3, 4]], {"temperature": 0.0}, "got a dict"),
])
def test_bad_input_names_the_field(engine: Engine, prompts: object, params: object, match: str) -> None:
    state = (len(engine.core.requests), len(engine.core.scheduler.waiting))
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, params)
    assert (len(engine.core.requests), len(engine.core.scheduler.waiting)) == state


def test_bad_sampling_fields() -> None:
    with pytest.raises(ValueError, match="stop must be a string or a list of strings"):
        SamplingParams(stop=123)
    with pytest.raises(TypeError, match="stop_token_ids must be a list"):
        SamplingParams(stop_token_ids=5)
    with pytest.raises(TypeError, match="stop_token_ids must be a list"):
        SamplingParams(stop_token_ids="12")


def test_max_tokens_none_runs_to_the_context_end_and_detokenize_false_keeps_ids(engine: Engine, model) -> None:
    """vLLM's `max_tokens=None` (as many as max_model_len leaves) and `detokenize=False` (ids only)."""
    prompt = rand_prompt(np.random.default_rng(3), 100)
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    c = out.outputs[0]
    assert len(c.token_ids) == ENGINE_KW["max_model_len"] - 100 and c.finish_reason == "length"
    assert c.token_ids == Reference(model).greedy(prompt, len(c.token_ids))
    (raw,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False,
                                                      logprobs=0))
    assert raw.outputs[0].text == "" and raw.outputs[0].token_ids == c.token_ids[:6]
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
