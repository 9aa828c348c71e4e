"""Incremental detokenization: a sample's output text grown by the text each new token adds, with host work
proportional to the new tokens (never to the output so far), equal to a full decode of the output
(tests/test_detokenizer.py; the one thing no stream can match: a byte-fallback decoder shows a run of byte
tokens holding an invalid byte as replacement characters all along it, changing characters shown before).

vLLM's prefix-window method (as tokenizers' `DecodeStream`): decode a short window of recent tokens
with and without the new ones, and emit the difference once it does not end in an incomplete character
(a byte-fallback or byte-level token that starts a multi-byte character waits for the rest). Decoding
the window from a token before the new ones keeps what a decoder does at the start of a text (a
SentencePiece decoder drops the first space) out of the difference.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollout.tokenizer import Tokenizer

INCOMPLETE = "\ufffd"  # what a decode shows for bytes that do not make a whole character yet


class IncrementalDetokenizer:
    """The text of one sample's output ids, decoded as they arrive."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._chunks: list[str] = []  # the text emitted so far, in pieces
        self._joined = ""  # "".join(_chunks), rebuilt only when read after a change
        self._num_joined = 0  # chunks in `_joined`
        self.length = 0  # characters emitted
        self.num_tokens = 0  # output ids consumed
        self._prefix = 0  # window start: the tokens before `_read` are already in the text
        self._read = 0
        self._before: tuple[int, int, int] = (0, 0, 0)  # (prefix, read, length) before the last `advance`

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def advance(self, output_ids: Sequence[int], upto: int | None = None) -> int:
        """Consume `output_ids[num_tokens:upto]` (default: all); returns where the new text starts."""
        upto = len(output_ids) if upto is None else upto
        start = self.length
        if upto <= self.num_tokens:
            return start
        self._before = (self._prefix, self._read, self.length)
        prefix_text = self._decode(output_ids[self._prefix:self._read])
        new_text = self._decode(output_ids[self._prefix:upto])
        self.num_tokens = upto
        if len(new_text) > len(prefix_text) and not new_text.endswith(INCOMPLETE):
            delta = new_text[len(prefix_text):]
            self._chunks.append(delta)
            self.length += len(delta)
            self._prefix, self._read = self._read, upto
        return start

    @property
    def text(self) -> str:
        """The text emitted so far (a token that leaves a character incomplete adds nothing yet)."""
        if self._num_joined != len(self._chunks):
            self._joined = "".join(self._chunks)
            self._chunks = [self._joined] if self._joined else []
            self._num_joined = len(self._chunks)
        return self._joined

    def tail(self, num_chars: int) -> str:
        """The last `num_chars` characters emitted (work in proportion to them, not to the text)."""
        if num_chars <= 0:
            return ""
        parts, size = [], 0
        for chunk in reversed(self._chunks):
            parts.append(chunk)
            size += len(chunk)
            if size >= num_chars:
                break
        return "".join(reversed(parts))[-num_chars:]

    def final_text(self, output_ids: Sequence[int], *, drop_last: bool = False) -> str:
        """The whole text of `output_ids` (consumed up to their end), or of all but the last id (`drop_last`:
        the stop id or EOS that ended the sample), incomplete characters included as a full decode shows them."""
        self.advance(output_ids)
        prefix, read, length = self._before if drop_last else (self._prefix, self._read, self.length)
        end = len(output_ids) - drop_last
        text = self.text[:length]
        if end > read:
            prefix_text = self._decode(output_ids[prefix:read])
            text += self._decode(output_ids[prefix:end])[len(prefix_text):]
        return text
