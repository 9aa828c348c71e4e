"""Incremental detokenization (rollout/detokenizer.py) and the stop-string search over it (rollout/stop_rules.py):
the text grown token by token (or a few tokens at a time) equals a full decode of the output, for the
embedded model's byte-level BPE and a SentencePiece tokenizer with byte-fallback tokens, with and without
special tokens; multi-byte characters split over tokens wait until they are whole; the stop-string search
reads only the text around what is new and finds what a search of the whole text finds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rollout.detokenizer import IncrementalDetokenizer
from rollout.sampling_params import SamplingParams
from rollout.sequence import Sequence
from rollout.stop_rules import StopChecker
from rollout.tokenizer import Tokenizer, load_tokenizer
from test_tokenizer import _write_gguf

TEXTS = ["Hello, world! ", "héllo wörld — 日本語のテキスト 🙂🚀 ", "  spaces\n\nand\ttabs ", "x = f(y) ** 2  # ok\n",
         "ÀÉÎÕÜ ñ ç ß ø å æ œ ", "<|im_start|>assistant\n", "emoji 👩‍👩‍👧 family "]


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("sp") / "sp.gguf"
    _write_gguf(path)
    return load_tokenizer(str(path))


def samples(tok: Tokenizer, rng: np.random.Generator, n: int, *, garbage: bool) -> list[list[int]]:
    """Token sequences of mixed texts with special tokens spliced in (multi-byte characters span several
    byte-level or byte-fallback tokens); `garbage`: random ids too (invalid byte runs)."""
    specials = tok.all_special_ids
    out = []
    for _ in range(n):
        ids: list[int] = []
        for j in rng.integers(0, len(TEXTS), 4):
            ids += tok.encode(TEXTS[j], add_special_tokens=False)
            if rng.random() < 0.3:
                ids.append(int(rng.choice(specials)))
            if garbage and rng.random() < 0.5:
                ids += rng.integers(0, tok.vocab_size, int(rng.integers(1, 4))).tolist()
        out.append(ids)
    return out


def check_stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool, rng: np.random.Generator,
                 every_prefix: bool) -> None:
    """Feed `ids` one token or a few at a time: the text only grows, towards the full decode (`every_prefix`:
    it is a prefix of the full decode of the ids so far at every step), and ends equal to it."""
    final = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(tok, skip_special_tokens)
    n, before = 0, ""
    while n < len(ids):
        n = min(len(ids), n + int(rng.integers(1, 4)))  # one token at a time, or a few (a streamed step)
        start = detok.advance(ids, n)
        assert detok.text.startswith(before) and start == len(before) and detok.length == len(detok.text)
        assert final.startswith(detok.text)
        if every_prefix:
            assert tok.decode(ids[:n], skip_special_tokens=skip_special_tokens).startswith(detok.text)
        assert detok.tail(5) == detok.text[-5:]
        before = detok.text
    assert detok.final_text(ids) == final
    if ids:
        assert detok.final_text(ids, drop_last=True) == tok.decode(ids[:-1], skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("which", ["smollm", "sentencepiece"])
def test_the_incremental_text_is_the_full_decode(which: str, skip_special_tokens: bool,
                                                 request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    rng = np.random.default_rng(0)
    for ids in samples(tok, rng, 30, garbage=False):
        check_stream(tok, ids, skip_special_tokens, rng, every_prefix=which == "smollm")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_byte_level_ids_too(smollm: Tokenizer, skip_special_tokens: bool) -> None:
    """A byte-level decoder replaces each invalid byte run where it stands (`from_utf8_lossy`), so even
    random ids stream exactly. (A byte-fallback decoder renders a run of byte tokens that holds an invalid
    byte as replacement characters all along the run, changing characters already shown: no stream can
    match that ahead of time; model outputs of valid text do not do it.)"""
    rng = np.random.default_rng(2)
    for ids in samples(smollm, rng, 30, garbage=True):
        check_stream(smollm, ids, skip_special_tokens, rng, every_prefix=True)


def test_a_split_character_waits_until_whole(smollm: Tokenizer) -> None:
    ids = smollm.encode("a🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm, True)
    pieces = []
    for n in range(1, len(ids) + 1):
        start = detok.advance(ids, n)
        pieces.append(detok.text[start:])
    assert "".join(pieces) == "a🙂" and all("\ufffd" not in p for p in pieces)
    assert len(ids) > 2  # the emoji took several byte-level tokens: some steps added nothing


def test_the_host_work_per_token_does_not_grow_with_the_output(smollm: Tokenizer) -> None:
    """A token's advance decodes a window of a few tokens, whatever came before (not the whole output)."""
    ids = smollm.encode(" ".join(TEXTS) * 40, add_special_tokens=False)
    decoded: list[int] = []

    class Counting:
        def decode(self, part: list[int], skip_special_tokens: bool = True) -> str:
            decoded.append(len(part))
            return smollm.decode(part, skip_special_tokens=skip_special_tokens)

    detok = IncrementalDetokenizer(Counting(), True)  # type: ignore[arg-type]
    for n in range(1, len(ids) + 1):
        detok.advance(ids, n)
    assert len(ids) > 1000 and max(decoded) <= 8
    assert detok.final_text(ids) == smollm.decode(ids)


@pytest.mark.parametrize("which", ["smollm", "sentencepiece"])
def test_the_stop_string_search_finds_what_a_whole_search_finds(which: str, request: pytest.FixtureRequest) -> None:
    """Token by token: a stop string ends the sequence at the first token whose text completes it (after
    `min_tokens`), with `stop_text_at` where it starts in the full text."""
    tok: Tokenizer = request.getfixturevalue(which)
    rng = np.random.default_rng(1)
    checked = 0
    for ids in samples(tok, rng, 40, garbage=False):
        text = tok.decode(ids)
        if len(text) < 6:
            continue
        at = int(rng.integers(0, len(text) - 3))
        stop = text[at:at + int(rng.integers(1, 4))]
        if "\ufffd" in stop:
            continue
        min_tokens = int(rng.integers(0, 3))
        params = SamplingParams(stop=[stop], max_tokens=len(ids) + 1, min_tokens=min_tokens)
        seq = Sequence(0, "r", 0, [5], params, seed=0, arrival=0)
        checker = StopChecker(tok, eos_token_ids=(), max_model_len=10_000)
        ended = None
        for n, token in enumerate(ids, 1):
            seq.token_ids.append(token)
            if checker.check(seq, token):
                ended = n
                break
        # the reference, by whole decodes: the first token after min_tokens whose text (up to its last whole
        # character: a token that starts a multi-byte character shows its text with the character) holds the
        # stop string ending after the text of the first min_tokens tokens
        def whole(n: int) -> str:
            return next(t for m in range(n, -1, -1) if not (t := tok.decode(ids[:m])).endswith("\ufffd"))

        first = max(0, len(whole(min_tokens)) - len(stop) + 1)
        want = next((n for n in range(min_tokens + 1, len(ids) + 1) if whole(n).find(stop, first) >= 0), None)
        assert ended == want, (stop, ids)
        if want is None:
            continue
        assert seq.out.stop_reason == stop and seq.out.stop_text_at == whole(want).find(stop, first)
        checked += 1
    assert checked > 20


def test_streamed_deltas_join_to_the_final_text(tmp_path: Path, smollm: Tokenizer) -> None:
    """`request.delta_text`: what each streamed delta adds joins to the final text, stop strings held back."""
    from rollout.request import delta_text, sample_text

    ids = smollm.encode("héllo wörld 日本 stop here and more", add_special_tokens=False)
    for stop in (None, ["stop"]):
        seq = Sequence(0, "r", 0, [5], SamplingParams(stop=stop, max_tokens=100), seed=0, arrival=0)
        checker = StopChecker(smollm, eos_token_ids=(), max_model_len=10_000)
        sent, pieces = 0, []
        for token in ids:
            seq.token_ids.append(token)
            done = checker.check(seq, token)
            if done:
                seq.status = seq.status.FINISHED
            piece = delta_text(seq, smollm, sent)
            sent += len(piece)
            pieces.append(piece)
            if done:
                break
        assert "".join(pieces) == sample_text(seq, smollm)
        assert sample_text(seq, smollm) == ("héllo wörld 日本 " if stop else smollm.decode(ids))
