"""The OpenAI-compatible server (rollout/serve) on loopback, driven by the real `openai` client: completions
and chat (streaming too) equal the engine's reference outputs, logprob layouts, seeds, bad requests as
400s with the server still serving, and bearer-token weight updates from "another process"."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import openai
import pytest
import uvicorn
from safetensors.numpy import save, save_file

from rollout.engine import Engine
from rollout.serve import build_app
from rollout.serve.client import push_weights
from test_engine import ENGINE_KW, ByteTokenizer, Reference, make_model, rand_prompt
from test_engine_sync import perturb
from test_weight_sync import to_hf

TOKEN = "s3cret"


class ChatByteTokenizer(ByteTokenizer):
    """ByteTokenizer with a tiny chat template: "role: content\\n" per message, then "assistant: "."""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str | list[int]:
        text = "".join(f"{m['role']}: {m.get('content', '')}\n" for m in messages)
        text += "assistant: " if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


@pytest.fixture(scope="module")
def model():
    return make_model(0)


@pytest.fixture(scope="module")
def server(model) -> Iterator[tuple[str, Engine]]:
    engine = Engine.from_model(model, ChatByteTokenizer(), **ENGINE_KW)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(build_app(engine, model_name="tiny", weights_token=TOKEN), host="127.0.0.1", port=port,
                            log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def test_completions_equal_the_reference(server, client: openai.OpenAI, model) -> None:
    ref = Reference(model)
    prompt = rand_prompt(np.random.default_rng(1), 11)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=9, temperature=0.0, logprobs=2,
                                  extra_body={"ignore_eos": True, "return_token_ids": True, "prompt_logprobs": 1})
    (choice,) = r.choices
    want = ref.greedy(prompt, 9)
    assert choice.token_ids == want and choice.text == "".join(chr(t) for t in want) and choice.finish_reason == "length"
    _, logp = ref.logits(prompt + want)
    np.testing.assert_allclose(choice.logprobs.token_logprobs, [logp[len(prompt) - 1 + i, t] for i, t in enumerate(want)],
                               atol=2e-4)
    for top, tok in zip(choice.logprobs.top_logprobs, choice.logprobs.tokens):
        assert tok in top and len(top) == 2  # greedy: the sampled token is the most likely one
    assert choice.logprobs.text_offset == list(range(9))
    assert r.usage.prompt_tokens == 11 and r.usage.completion_tokens == 9 and r.usage.total_tokens == 20
    pl = choice.prompt_logprobs
    assert pl[0] is None and len(pl) == 11
    assert pl[3][str(prompt[3])]["logprob"] == pytest.approx(logp[2, prompt[3]], abs=2e-4)
    # several prompts in one request, n=2 each: choices prompt-major; return_tokens_as_token_ids
    r = client.completions.create(model="tiny", prompt=["Hello", "Hi there"], max_tokens=4, n=2, seed=3, logprobs=0,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(t.startswith("token_id:") for c in r.choices for t in c.logprobs.tokens)
    again = client.completions.create(model="tiny", prompt=["Hello", "Hi there"], max_tokens=4, n=2, seed=3,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # a per-request seed repeats


def test_streaming_adds_up_to_the_whole_completion(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=20, temperature=0.8, seed=7,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20
    chat = dict(model="tiny", messages=[{"role": "user", "content": "Add 2 and 3."}], max_tokens=12, temperature=0.0,
                logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**chat).choices[0]
    assert full.message.role == "assistant" and len(full.logprobs.content) == 12
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token for t in full.logprobs.content)
    parts = list(client.chat.completions.create(stream=True, **chat))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == full.message.content
    assert sum(len(p.choices[0].logprobs.content) for p in parts if p.choices and p.choices[0].logprobs) == 12


def test_bad_requests_get_400_and_the_server_keeps_serving(server, client: openai.OpenAI) -> None:
    url, engine = server
    cases = [dict(model="other", prompt="x"), dict(model="tiny", prompt="x", max_tokens=-1),
             dict(model="tiny", prompt="x" * 200), dict(model="tiny", prompt="x", presence_penalty=2.5),
             dict(model="tiny", prompt=[]), dict(model="tiny", prompt="x", extra_body={"no_such_field": 1})]
    for kw in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**kw)
        assert err.value.status_code == 400 and err.value.body["message"]
    assert "does not exist" in _error(client, model="other", prompt="x")
    assert "max_tokens" in _error(client, model="tiny", prompt="x", max_tokens=-1)
    assert "max_model_len" in _error(client, model="tiny", prompt="x" * 200)
    status, answer = _http("POST", url + "/v1/completions", b'{"model": "tiny", "prompt": ',
                           {"content-type": "application/json"})
    assert status == 400 and "invalid request" in answer["error"]["message"]
    assert _http("GET", url + "/health")[0] == 200
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=3).choices[0].text is not None
    biased = client.completions.create(model="tiny", prompt="ok", max_tokens=3, temperature=0.0,
                                       logit_bias={"65": 100.0}, presence_penalty=0.1)
    assert biased.choices[0].text == "AAA"  # the ByteTokenizer's id 65: processors reach the engine
    assert not engine.core.requests


def _http(method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None
          ) -> tuple[int, dict | None]:
    """A raw HTTP call (stdlib): (status, JSON body or None)."""
    request = urllib.request.Request(url, data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    return status, json.loads(raw) if raw else None


def _error(client: openai.OpenAI, **kw: object) -> str:
    try:
        client.completions.create(**kw)
    except openai.BadRequestError as err:
        return err.body["message"]
    raise AssertionError("no error")


def test_update_weights_needs_the_token_and_swaps_the_policy(server, client: openai.OpenAI, model, tmp_path) -> None:
    url, engine = server
    prompt = rand_prompt(np.random.default_rng(4), 8)
    kw = dict(model="tiny", prompt=prompt, max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True,
                                                                                        "return_token_ids": True})
    new = perturb(model, 21)
    body = save({k: np.ascontiguousarray(v) for k, v in to_hf(new).items()})
    assert _http("POST", url + "/update_weights", body)[0] == 401
    assert _http("POST", url + "/update_weights", body, {"authorization": "Bearer nope"})[0] == 401
    auth = {"authorization": f"Bearer {TOKEN}"}
    bad = save({"model.no_such.weight": np.zeros(3, np.float32)})
    status, answer = _http("POST", url + "/update_weights", bad, auth)
    assert status == 400 and "no_such" in answer["error"]["message"]
    assert client.completions.create(**kw).choices[0].token_ids == Reference(model).greedy(prompt, 10)  # kept
    assert push_weights(url, to_hf(new), TOKEN, version=7) == 7
    choice = client.completions.create(**kw).choices[0]
    assert choice.token_ids == Reference(new).greedy(prompt, 10) and choice.policy_versions == [7] * 10
    with pytest.raises(RuntimeError, match="401"):
        push_weights(url, to_hf(model), "wrong")
    save_file({k: np.ascontiguousarray(v) for k, v in to_hf(model).items()}, str(tmp_path / "model.safetensors"))
    status, answer = _http("POST", url + "/update_weights?version=8", json.dumps({"path": str(tmp_path)}).encode(),
                           {**auth, "content-type": "application/json"})
    assert (status, answer) == (200, {"policy_version": 8})  # back to the old weights, from a directory
    assert client.completions.create(**kw).choices[0].token_ids == Reference(model).greedy(prompt, 10)


def test_many_concurrent_clients_equal_their_references(server, model) -> None:
    ref = Reference(model)
    prompts = [rand_prompt(np.random.default_rng(50 + i), 3 + i % 20) for i in range(24)]

    async def main() -> list[list[int]]:
        aclient = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)
        rs = await asyncio.gather(*(aclient.completions.create(
            model="tiny", prompt=p, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})
            for p in prompts))
        return [r.choices[0].token_ids for r in rs]

    got = asyncio.run(main())
    assert got == [ref.greedy(p, 6) for p in prompts]


@pytest.mark.slow
def test_the_command_line_server_on_the_default_model(tmp_path) -> None:
    """`python -m rollout.serve` on the embedded SmolLM2-135M: a chat request through the model's own chat
    template equals the engine's greedy completion of the same rendered prompt."""
    import os
    import subprocess
    import sys

    from rollout.sampling_params import SamplingParams

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "rollout.serve", "--port", str(port), "--max-model-len", "256",
                             "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--no-warmup"],
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=(log := open(tmp_path / "log", "w")),
                            stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if _http("GET", url + "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.25)
        else:
            raise AssertionError(f"the server did not come up:\n{(tmp_path / 'log').read_text()}")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        (model_card,) = client.models.list().data
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        r = client.chat.completions.create(model=model_card.id, messages=messages, max_tokens=12, temperature=0.0,
                                           extra_body={"return_token_ids": True})
        engine = Engine.from_pretrained(None, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)
        ids = engine.tokenizer.apply_chat_template(messages, tokenize=True)
        (want,) = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=12))
        assert r.choices[0].prompt_token_ids == ids
        assert r.choices[0].token_ids == want.outputs[0].token_ids
        assert r.choices[0].message.content == want.outputs[0].text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_streaming_several_prompts_with_n_interleaves_every_choice(client: openai.OpenAI) -> None:
    """Two prompts x n = 2 streamed: each of the four choices' chunks add up to its non-streamed text."""
    kw = dict(model="tiny", prompt=["Hello there", "General"], max_tokens=10, n=2, temperature=1.0, seed=9,
              extra_body={"ignore_eos": True})
    whole = {c.index: c.text for c in client.completions.create(**kw).choices}
    parts: dict[int, str] = {}
    finished = set()
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finished.add(c.index)
    assert parts == whole and finished == {0, 1, 2, 3}
