"""GGUF tokenizer metadata -> a `tokenizers.Tokenizer`, built the way transformers' GGUF converter
(`transformers/integrations/gguf/gguf_tokenizer_mapping.py`) builds it, so ids match
`AutoTokenizer.from_pretrained(dir, gguf_file=name)` exactly. `rollout/tokenizer.py` wraps the result
(special tokens, BOS/EOS post-processing, chat template) into the engine's `Tokenizer`."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from runner.models.gguf_file import read_gguf_file

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


def read_gguf_tokenizer_fields(path: str) -> dict[str, Any]:
    """`general.architecture` and every `tokenizer.*` metadata value of a GGUF file."""
    try:
        fields = read_gguf_file(path).fields
    except Exception as e:  # struct / memmap errors of several kinds on a bad file
        raise ValueError(f"cannot read GGUF file {path!r}: {e}") from e
    return {key: value for key, value in fields.items() if key.startswith("tokenizer.") or key == "general.architecture"}


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


def gguf_backend(meta: Mapping[str, Any], path: str) -> BackendTokenizer:
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
