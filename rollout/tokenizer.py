"""Text <-> token ids for the engine, and chat-template rendering.

This file owns `load_tokenizer(path)` and the `Tokenizer` class. A tokenizer comes from one of:

  * a Hugging Face model directory: `tokenizer.json`, plus optional `tokenizer_config.json` (special
    tokens, `add_bos_token`/`add_eos_token`, `chat_template`), `chat_template.jinja`/`chat_template.json`
    and `generation_config.json` (extra end-of-generation ids);
  * a `.gguf` file: the `tokenizer.ggml.*` metadata is turned into a `tokenizers.Tokenizer` the way
    transformers' GGUF converter (`transformers/integrations/gguf/gguf_tokenizer_mapping.py`) does it,
    so ids match `AutoTokenizer.from_pretrained(dir, gguf_file=name)` exactly;
  * None: the embedded default model (`runner.models.default_model.default_model_path()`).

Chat templates are rendered with a sandboxed jinja2 environment set up like transformers' (trim_blocks,
lstrip_blocks, loopcontrols, a non-escaping `tojson`, `raise_exception`, `strftime_now`).
Only `tokenizers`, `jinja2` and `gguf` are used at runtime; never torch or transformers.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

__all__ = ["Tokenizer", "load_tokenizer"]

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# GGUF token types (llama.cpp `llama_token_type`).
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

# Pre-tokenizer split regexes by `tokenizer.ggml.pre`, copied from transformers' GGUF converter. A name
# not listed here (SmolLM2's "smollm", GPT-2's "gpt-2", ...) keeps the GPT-2 `ByteLevel` regex, as there.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
_SUPPORTED_GGUF_MODELS = ("gpt2", "llama")


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
        text = _compile_template(self.chat_template).render(
            messages=chat,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


# -- chat templates ------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """Accept transformers' `{% generation %}...{% endgeneration %}` and render its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        """Parse the block into a call that just returns its body."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile_template(template: str) -> jinja2.Template:
    """Compile a chat template in an environment configured like transformers'."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


# -- loading -------------------------------------------------------------------------------------


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """Load the tokenizer of a HF model directory, a `.gguf` file, or (None) the embedded default model."""
    if path is None:
        from runner.models.default_model import default_model_path

        path = default_model_path()
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
    if os.path.isdir(path):
        return _load_hf_dir(path)
    if _is_gguf(path):
        return _load_gguf(path)
    raise ValueError(f"tokenizer path {path!r} is neither a Hugging Face model directory nor a .gguf file")


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


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


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, used to spell byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _read_gguf_tokenizer_fields(path: str) -> dict[str, Any]:
    """`general.architecture` and every `tokenizer.*` metadata value of a GGUF file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct errors of several kinds on a bad file
        raise ValueError(f"cannot read GGUF file {path!r}: {e}") from e
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.") or key == "general.architecture"
    }


def _gguf_merges(meta: Mapping[str, Any], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """The file's merges, or (SentencePiece files without any) merges recovered from the token scores,
    ordered as transformers' `generate_merges` orders them."""
    if "tokenizer.ggml.merges" in meta:
        return [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]  # type: ignore[misc]
    scores = dict(zip(meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.scores") or ()))
    found: list[tuple[str, str, float]] = []
    for merged, score in scores.items():
        splits = ((merged[:i], merged[i:]) for i in range(1, len(merged)))
        local = [(left, right, score) for left, right in splits if left in vocab and right in vocab]
        found.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _gguf_backend(meta: Mapping[str, Any], path: str) -> BackendTokenizer:
    """Build the `tokenizers.Tokenizer` that transformers builds from this GGUF tokenizer metadata."""
    model = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or ())
    if not tokens:
        raise ValueError(f"GGUF file {path!r} has no tokenizer.ggml.tokens")
    if model == "gpt2":
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {
            tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
            for i, tok in enumerate(tokens)
        }
        backend = BackendTokenizer(BPE(vocab=vocab, merges=_gguf_merges(meta, vocab), dropout=None,
                                       continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
    elif model == "llama":
        if meta.get("general.architecture") in ("gemma", "gemma2", "gemma3", "phi3"):
            raise ValueError(
                f"GGUF file {path!r}: SentencePiece tokenizers of architecture "
                f"{meta['general.architecture']!r} are not supported"
            )
        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = BackendTokenizer(BPE(vocab=vocab, merges=_gguf_merges(meta, vocab), fuse_unk=True,
                                       byte_fallback=True, dropout=None))
        backend.normalizer = None
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)
        ])
    else:
        raise ValueError(
            f"GGUF file {path!r} has tokenizer model {model!r}; supported: {', '.join(_SUPPORTED_GGUF_MODELS)}"
        )

    # Control tokens become special added tokens (in a byte-level vocabulary only those spelled in the byte
    # alphabet, like transformers), user-defined ones plain added tokens.
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or ())
    spelled = set(_bytes_to_unicode().values()) if model == "gpt2" else None
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, types)
        if kind == _GGUF_CONTROL and (spelled is None or set(tok) <= spelled)
    ]
    if control:
        backend.add_special_tokens(control)
    known = backend.get_vocab(with_added_tokens=True)
    user = [AddedToken(tok, normalized=False, special=False)
            for tok, kind in zip(tokens, types) if kind == _GGUF_USER_DEFINED and tok in known]
    if user:
        backend.add_tokens(user)

    split = _GGUF_PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))  # type: ignore[arg-type]
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return backend


def _load_gguf(path: str) -> Tokenizer:
    """Tokenizer described by a GGUF file's `tokenizer.*` metadata."""
    meta = _read_gguf_tokenizer_fields(path)
    backend = _gguf_backend(meta, path)
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
