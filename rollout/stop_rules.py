"""Stop rules in one place, for the plan builder (which ids the device suppresses before `min_tokens` and
stops a loop on) and the output processor (what ends a sequence on the host), as vLLM has them:

- EOS (unless `ignore_eos`: then it is an ordinary token, never masked) and `stop_token_ids` end a
  sequence once `min_tokens` are out; before that the device suppresses them;
- a stop string ends it when it ends in the text of a token after the first `min_tokens` (it may start
  earlier); the text comes from the sequence's incremental detokenizer, searched only around new text, so a
  token that also starts a multi-byte character shows its text (and a stop string in it) with that character;
- `max_tokens` and `max_model_len` end it with finish reason "length".
"""

from __future__ import annotations

import numpy as np

from rollout.sequence import Sequence, token_counts
from rollout.tokenizer import Tokenizer
from runner.step_plan import MAX_SUPPRESS


def ending_ids(seq: Sequence, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """EOS (unless the sequence ignores it) and the sequence's stop ids, without repeats; built once per
    sequence (`Sequence.ending_ids`)."""
    if seq.rows.ending_ids is None:
        eos = () if seq.params.ignore_eos else eos_token_ids
        seq.rows.ending_ids = tuple(dict.fromkeys([*eos, *seq.params.stop_token_ids]))
    return seq.rows.ending_ids


def ending_table(seqs: list[Sequence], eos_token_ids: tuple[int, ...], keep: np.ndarray | None = None) -> np.ndarray:
    """[S, W] each sequence's ending ids, -1 padded; rows where `keep` is False are all -1. W is
    `MAX_SUPPRESS`, or the next power of two that holds the longest (a request with many stop ids compiles
    a wider program, nothing is cut). Sequences mostly share a few id tuples: each is written once."""
    rows = [ending_ids(s, eos_token_ids) for s in seqs]
    distinct = {ids: i for i, ids in enumerate(dict.fromkeys([(), *rows]))}  # () -> row 0, all -1
    width = max(MAX_SUPPRESS, 1 << max(0, max(map(len, distinct)) - 1).bit_length())
    table = np.full((len(distinct), width), -1, np.int32)
    for ids, i in distinct.items():
        table[i, :len(ids)] = ids
    index = np.fromiter((distinct[ids] for ids in rows), np.int64, len(rows))
    return table[index if keep is None else np.where(keep, index, 0)]


def min_tokens(seqs: list[Sequence]) -> np.ndarray:
    return np.fromiter((s.params.min_tokens for s in seqs), np.int64, len(seqs))


def suppressed_ids(seqs: list[Sequence], eos_token_ids: tuple[int, ...]) -> np.ndarray:
    """[S, W] the ids each sequence may not sample in its next token (its ending ids until `min_tokens`)."""
    return ending_table(seqs, eos_token_ids, keep=token_counts(seqs)[1] < min_tokens(seqs))


def device_stops(seqs: list[Sequence], eos_token_ids: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence, for a device loop: how many more tokens keep its ending ids suppressed (`min_tokens`),
    and the ids that stop it. Only lets the device stop early: the host applies every rule afterwards."""
    num_out = token_counts(seqs)[1]
    return np.maximum(min_tokens(seqs) - num_out, 0).astype(np.int32), ending_table(seqs, eos_token_ids)


def first_stops(tokens: np.ndarray, seqs: list[Sequence], steps: np.ndarray, eos_token_ids: tuple[int, ...],
                max_model_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sequences without stop strings, all at once: `tokens` [T, L] holds sequence j's sampled tokens in
    column j, `steps` [L] how many count. Returns (tokens each takes, whether it ends, [T, L] where an
    ending id stopped it)."""
    t = np.arange(tokens.shape[0])[:, None]
    num_tokens, num_out = token_counts(seqs)
    max_tokens = np.fromiter((s.params.max_tokens for s in seqs), np.int64, len(seqs))
    limit = np.minimum(max_tokens - num_out, max_model_len - num_tokens)
    hit = (tokens[:, :, None] == ending_table(seqs, eos_token_ids)[None]).any(-1)
    hit &= num_out[None] + t + 1 >= min_tokens(seqs)[None]
    ends = (hit | (t + 1 >= limit[None])) & (t < steps[None])
    finished = ends.any(0)
    return np.where(finished, ends.argmax(0) + 1, np.minimum(steps, tokens.shape[0])), finished, hit


class StopChecker:
    """The host's per-token check (sequences with stop strings, and few-row steps)."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def check(self, seq: Sequence, token: int) -> bool:
        """Did `token`, just appended, end `seq`? Sets its finish and stop reasons if so."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                seq.out.finish_reason, seq.out.stop_reason = "stop", token
                return True
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.out.finish_reason = "stop"
                return True
        if p.stop and self._stop_string(seq):
            return True
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.out.finish_reason = "length"
            return True
        return False

    def _stop_string(self, seq: Sequence) -> bool:
        """Did a stop string end in the text the last token added? (Searched from where that text starts,
        back by the stop string's length less one.)"""
        p, n = seq.params, seq.num_output_tokens
        if n <= p.min_tokens:
            return False
        detok, output = seq.text_decoder(self.tokenizer), seq.output_ids
        detok.advance(output, n - 1)  # the text before this token (all of it at the first search)
        start = detok.advance(output, n)
        longest = max(map(len, p.stop))
        window = detok.tail(detok.length - start + longest - 1)
        base = detok.length - len(window)
        hits = [(base + i, s) for s in p.stop if (i := window.find(s, max(0, start - len(s) + 1 - base))) >= 0]
        if not hits:
            return False
        seq.out.stop_text_at, hit = min(hits)
        seq.out.finish_reason, seq.out.stop_reason = "stop", hit
        return True
