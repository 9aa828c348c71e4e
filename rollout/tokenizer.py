"""Text <-> token ids for the engine, and chat-template rendering.

This file owns `load_tokenizer(path)` and the `Tokenizer` class. A tokenizer comes from one of:

  * a Hugging Face model directory: `tokenizer.json`, plus optional `tokenizer_config.json` (special
    tokens, `add_bos_token`/`add_eos_token`, `chat_template`), `chat_template.jinja`/`chat_template.json`
    and `generation_config.json` (extra end-of-generation ids);
  * a `.gguf` file: the `tokenizer.ggml.*` metadata is turned into a `tokenizers.Tokenizer` the way
    transformers' GGUF converter (`transformers/integrations/gguf/gguf_tokenizer_mapping.py`) does it,
    so ids match `AutoTokenizer.from_pretrained(dir, gguf_file=name)` exactly;
  * None: the embedded default model (`runner.models.default_model.default_model_path()`).

GGUF metadata becomes a `tokenizers.Tokenizer` in `rollout/gguf_tokenizer.py`; chat templates render
in `rollout/chat_template.py`.
Only `tokenizers`, `jinja2` and `gguf` are used at runtime; never torch or transformers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as BackendTokenizer

from rollout.chat_template import compile_template
from rollout.gguf_tokenizer import gguf_backend, read_gguf_tokenizer_fields
from runner.models.default_model import default_model_path
from runner.models.gguf_file import is_gguf

__all__ = ["Tokenizer", "load_tokenizer"]

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens, end-of-generation ids and chat template of a model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        chat_template: str | None = None,
        token_ids: Mapping[str, int | None] | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        name_or_path: str = "",
    ) -> None:
        """`special_tokens` maps bos/eos/unk/pad_token to its text; `token_ids` may pin bos/eos/pad ids
        (else they are looked up from the text); `extra_eos_token_ids` adds end-of-generation ids."""
        self.backend = backend
        self.special_tokens: dict[str, str] = {
            name: tok for name, tok in (special_tokens or {}).items() if name in _SPECIAL_NAMES and tok is not None
        }
        self.chat_template = chat_template
        self.name_or_path = name_or_path
        ids = dict(token_ids or {})
        self._bos_token_id = ids["bos_token_id"] if "bos_token_id" in ids else self._lookup("bos_token")
        self._eos_token_id = ids["eos_token_id"] if "eos_token_id" in ids else self._lookup("eos_token")
        self._pad_token_id = ids["pad_token_id"] if "pad_token_id" in ids else self._lookup("pad_token")
        eos = [self._eos_token_id, *extra_eos_token_ids]
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos if i is not None))

    def _lookup(self, name: str) -> int | None:
        tok = self.special_tokens.get(name)
        return None if tok is None else self.backend.token_to_id(tok)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size})"

    # -- ids -------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token, if any."""
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """Id of the end-of-sequence token, if any."""
        return self._eos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the eos token, then generation-config / GGUF eot/eom ids."""
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        """Id of the padding token, if any."""
        return self._pad_token_id

    @property
    def all_special_ids(self) -> list[int]:
        """Sorted ids of all special tokens: the named ones plus every added token flagged special
        (exactly the ids `decode(..., skip_special_tokens=True)` drops)."""
        ids = {i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special}
        ids.update(i for i in (self._lookup(name) for name in self.special_tokens) if i is not None)
        return sorted(ids)

    # -- text ------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, dropping special tokens unless `skip_special_tokens` is False."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        """Render `messages` with the chat template; with `tokenize`, return ids (no extra special tokens)."""
        if not self.chat_template:
            raise ValueError(f"tokenizer {self.name_or_path!r} has no chat template")
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        text = compile_template(self.chat_template).render(
            messages=chat,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


# -- loading -------------------------------------------------------------------------------------


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """Load the tokenizer of a HF model directory, a `.gguf` file, or (None) the embedded default model."""
    path = os.fspath(default_model_path() if path is None else path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
    if os.path.isdir(path):
        return _load_hf_dir(path)
    if is_gguf(path):
        return _load_gguf(path)
    raise ValueError(f"tokenizer path {path!r} is neither a Hugging Face model directory nor a .gguf file")


def _token_text(value: Any) -> str | None:
    """A special token from a config: a string, or a serialized `AddedToken` dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(file: str) -> dict[str, Any]:
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{file!r} does not hold a JSON object")
    return data


def _pick_template(value: Any) -> str | None:
    """A chat template from a config value: a string, or a list of `{name, template}` (take "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default", next(iter(named.values()), None))
    return None


def _ensure_special_tokens(backend: BackendTokenizer, tokens: Sequence[str | None]) -> None:
    """Add named special tokens not yet among the added tokens, as transformers' backend does on init."""
    added = {tok.content for tok in backend.get_added_tokens_decoder().values()}
    new = [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(tokens) if t and t not in added]
    if new:
        backend.add_tokens(new)


def _set_post_processor(backend: BackendTokenizer, bos: str | None, eos: str | None,
                        add_bos: bool, add_eos: bool) -> None:
    """Template post-processor adding BOS/EOS, exactly as transformers' `update_post_processor` builds it."""
    add_bos = add_bos and bos is not None
    add_eos = add_eos and eos is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    special: list[tuple[str, int]] = []
    if add_bos:
        special.append((bos, backend.token_to_id(bos)))  # type: ignore[arg-type]
    if add_eos:
        special.append((eos, backend.token_to_id(eos)))  # type: ignore[arg-type]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _generation_eos_ids(directory: str) -> list[int]:
    """`eos_token_id` (int or list) from `generation_config.json` in `directory`, if any."""
    value = _read_json(os.path.join(directory, "generation_config.json")).get("eos_token_id")
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def _load_hf_dir(path: str) -> Tokenizer:
    """Tokenizer of a Hugging Face model directory (`tokenizer.json` required)."""
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise FileNotFoundError(
            f"{path!r} has no tokenizer.json; only fast (tokenizers-library) tokenizers are supported"
        )
    backend = BackendTokenizer.from_file(tokenizer_file)
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    special = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}

    chat_template = None
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            chat_template = f.read()
    if chat_template is None:
        chat_template = _pick_template(_read_json(os.path.join(path, "chat_template.json")).get("chat_template"))
    if chat_template is None:
        chat_template = _pick_template(config.get("chat_template"))

    _ensure_special_tokens(backend, [special[name] for name in _SPECIAL_NAMES])
    if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
        _set_post_processor(backend, special["bos_token"], special["eos_token"],
                            bool(config.get("add_bos_token", False)), bool(config.get("add_eos_token", False)))
    return Tokenizer(
        backend,
        special_tokens=special,
        chat_template=chat_template,
        extra_eos_token_ids=_generation_eos_ids(path),
        name_or_path=path,
    )


def _load_gguf(path: str) -> Tokenizer:
    """Tokenizer described by a GGUF file's `tokenizer.*` metadata."""
    meta = read_gguf_tokenizer_fields(path)
    backend = gguf_backend(meta, path)
    tokens = meta["tokenizer.ggml.tokens"]

    def token_at(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    special = {
        "bos_token": token_at("bos_token_id"),
        "eos_token": token_at("eos_token_id"),
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
    }
    _ensure_special_tokens(backend, list(special.values()))
    model = meta.get("tokenizer.ggml.model")
    # Like transformers: SentencePiece ("llama") files without the flag add a BOS, as llama.cpp does.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    _set_post_processor(backend, special["bos_token"], special["eos_token"], add_bos, add_eos)

    def id_of(key: str) -> int | None:
        return int(meta[key]) if meta.get(key) is not None else None

    template = meta.get("tokenizer.chat_template")
    return Tokenizer(
        backend,
        special_tokens=special,
        chat_template=template if isinstance(template, str) else None,
        token_ids={"bos_token_id": id_of("tokenizer.ggml.bos_token_id"),
                   "eos_token_id": id_of("tokenizer.ggml.eos_token_id"),
                   "pad_token_id": id_of("tokenizer.ggml.padding_token_id")},
        # llama.cpp also ends generation on end-of-turn / end-of-message tokens.
        extra_eos_token_ids=[i for i in (id_of("tokenizer.ggml.eot_token_id"), id_of("tokenizer.ggml.eom_token_id"))
                             if i is not None],
        name_or_path=path,
    )
