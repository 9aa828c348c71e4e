"""Host-side input preparation: a `ScheduledBatch` of sequences -> the runner's `StepBatch` arrays."""

from __future__ import annotations

import dataclasses

import numpy as np

from rollout.scheduler import ScheduledBatch
from rollout.sequence import Sequence, token_counts
from runner.logits_processors import AdjustRows
from runner.model_runner import MAX_SUPPRESS, StepBatch
from runner.sampling_rows import SamplingRows


def ending_ids(seq: Sequence, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """EOS (unless the sequence ignores it: then it is an ordinary token, never masked, as in vLLM) and the
    sequence's stop ids, without repeats; built once per sequence (`Sequence.ending_ids`)."""
    if seq.ending_ids is None:
        eos = () if seq.params.ignore_eos else eos_token_ids
        seq.ending_ids = tuple(dict.fromkeys([*eos, *seq.params.stop_token_ids]))
    return seq.ending_ids


def ending_table(seqs: list[Sequence], eos_token_ids: tuple[int, ...], keep: np.ndarray | None = None) -> np.ndarray:
    """[S, W] each sequence's ending ids, -1 padded; rows where `keep` is False are all -1. W is
    `MAX_SUPPRESS`, or the next power of two that holds the longest (a request with many stop ids compiles
    a wider program, nothing is cut). Sequences mostly share a few id tuples: each is written once."""
    rows = [ending_ids(s, eos_token_ids) for s in seqs]
    distinct = {ids: i for i, ids in enumerate(dict.fromkeys([(), *rows]))}  # () -> row 0, all -1
    table = np.full((len(distinct), max(MAX_SUPPRESS, _pow2(max(map(len, distinct))))), -1, np.int32)
    for ids, i in distinct.items():
        table[i, :len(ids)] = ids
    index = np.fromiter((distinct[ids] for ids in rows), np.int64, len(rows))
    return table[index if keep is None else np.where(keep, index, 0)]


def _num_outputs_and_min_tokens(seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
    return token_counts(seqs)[1], np.fromiter((s.params.min_tokens for s in seqs), np.int64, len(seqs))


def _top_k(top_k: int) -> int:
    """A request's top-k as the device takes it: 0 = off (also -1, and counts past int32 that mean the
    same as the whole vocabulary)."""
    return top_k if 0 < top_k < 2**31 else 0


def sampling_rows(seqs: list[Sequence]) -> SamplingRows:
    """The sequences' sampling settings, one row each, from tuples each sequence builds once."""
    rows = []
    for seq in seqs:
        if seq.sampling_row is None:
            p = seq.params
            seq.sampling_row = (p.temperature, _top_k(p.top_k), p.top_p, p.min_p, seq.seed, seq.sample_index,
                                p.logprobs_mode.startswith("processed"), p.logprobs is not None,
                                p.logprobs_mode.endswith("logits"))
        rows.append(seq.sampling_row)
    return SamplingRows.from_rows(rows)


def _pow2(n: int) -> int:
    """The power of two >= n (>= 1): processor arrays come in few shapes, so few programs compile."""
    return 1 << max(0, int(n) - 1).bit_length()


def adjust_rows(seqs: list[Sequence], room: int) -> AdjustRows | None:
    """The sequences' logits processors (`runner.logits_processors`), or None when none uses one.
    `room`: steps this call may append to each output on the device."""
    params = [s.params for s in seqs]
    if not any(p.has_processors for p in params):
        return None
    n = len(seqs)
    allowed = np.full((n, _pow2(max(len(p.allowed_token_ids or ()) for p in params))), -1, np.int32)
    width = _pow2(max(len(p.logit_bias or {}) for p in params))
    bias_ids, bias_values = np.full((n, width), -1, np.int32), np.zeros((n, width), np.float32)
    words = np.full((n, _pow2(max(len(s.bad_word_ids) for s in seqs)),
                     _pow2(max((len(w) for s in seqs for w in s.bad_word_ids), default=1))), -1, np.int32)
    history = [s.reads_output for s in seqs]
    outputs = np.full((n, _pow2(max((s.num_output_tokens for s, h in zip(seqs, history) if h), default=0) + room)),
                      -1, np.int32)
    prompts = []
    for s in seqs:
        if s.params.repetition_penalty != 1.0 and s.distinct_prompt_ids is None:
            s.distinct_prompt_ids = tuple(dict.fromkeys(s.token_ids[:s.num_prompt_tokens]))
        prompts.append(s.distinct_prompt_ids if s.params.repetition_penalty != 1.0 else ())
    prompt_ids = np.full((n, _pow2(max(len(p) for p in prompts))), -1, np.int32)
    for i, (s, p) in enumerate(zip(seqs, params)):
        allowed[i, :len(p.allowed_token_ids or ())] = p.allowed_token_ids or ()
        if p.logit_bias:
            bias_ids[i, :len(p.logit_bias)] = list(p.logit_bias)
            bias_values[i, :len(p.logit_bias)] = list(p.logit_bias.values())
        for j, word in enumerate(s.bad_word_ids):
            words[i, j, words.shape[2] - len(word):] = word
        if history[i]:
            outputs[i, :s.num_output_tokens] = s.output_ids
        prompt_ids[i, :len(prompts[i])] = prompts[i]
    return AdjustRows(allowed, bias_ids, bias_values, words, outputs,
                      np.array([s.num_output_tokens if h else 0 for s, h in zip(seqs, history)], np.int32), prompt_ids,
                      np.array([p.presence_penalty for p in params], np.float32),
                      np.array([p.frequency_penalty for p in params], np.float32),
                      np.array([p.repetition_penalty for p in params], np.float32))


def verify_adjust_rows(seqs: list[Sequence], drafts: list[np.ndarray], row_seq: np.ndarray, row_rank: np.ndarray
                       ) -> AdjustRows | None:
    """The logits processors of a verification step's rows: row k of a sequence samples after its
    first k drafts, so its penalties and bad words read them as output (host drafts; EAGLE-3 engines
    take no processors)."""
    rows = adjust_rows(seqs, 1 + max((len(d) for d in drafts), default=0))
    if rows is None:
        return None
    rows = rows.take(row_seq)  # (copies)
    for r, (i, k) in enumerate(zip(row_seq, row_rank)):
        if k and seqs[i].reads_output:
            n = rows.num_output[r]
            rows.output_ids[r, n:n + k] = drafts[i][:k]
            rows.num_output[r] = n + k
    return rows


def device_stops(seqs: list[Sequence], eos_token_ids: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence, for a device loop: how many more tokens keep its ending ids suppressed (`min_tokens`),
    and the ids that stop it (EOS unless ignored, its stop ids). Only lets the device stop early: the host
    applies every stop rule afterwards."""
    num_out, min_tokens = _num_outputs_and_min_tokens(seqs)
    return np.maximum(min_tokens - num_out, 0).astype(np.int32), ending_table(seqs, eos_token_ids)


def build_step(batch: ScheduledBatch, eos_token_ids: tuple[int, ...],
               drafts: list[np.ndarray] | None = None, *, rejection: bool = False, multi_step: bool = False,
               device_drafts: bool = False) -> StepBatch:
    """Pack the scheduled tokens of every sequence, with their sampling settings (pure numpy).

    `multi_step`: a decode batch becomes one multi-step call (`batch.num_new_tokens` = steps per sequence).
    `device_drafts`: `drafts` are placeholders the device fills (EAGLE-3; only their lengths count).
    """
    if drafts is not None:
        return build_verify_step(batch, eos_token_ids, drafts, rejection=rejection, device_drafts=device_drafts)
    if multi_step and not batch.is_prefill:
        one = _plain_step(ScheduledBatch(False, batch.seqs, [1] * len(batch.seqs)), eos_token_ids,
                          room=max(batch.num_new_tokens))
        suppress_steps, stop_ids = device_stops(batch.seqs, eos_token_ids)
        return dataclasses.replace(one, kind="decode", num_steps=np.asarray(batch.num_new_tokens, np.int32),
                                   suppress_steps=suppress_steps, stop_ids=stop_ids)
    return _plain_step(batch, eos_token_ids, room=1)


def _plain_step(batch: ScheduledBatch, eos_token_ids: tuple[int, ...], *, room: int) -> StepBatch:
    """A prefill or one-token-per-sequence decode step; `room`: outputs its processors' state must hold."""
    seqs, counts = batch.seqs, np.asarray(batch.num_new_tokens, np.int32)
    starts = np.array([s.num_computed_tokens for s in seqs], np.int32)
    kv_lens = starts + counts
    if all(n == 1 for n in batch.num_new_tokens):
        token_ids = np.array([s.token_ids[-1] for s in seqs], np.int32)
        positions = starts.copy()
    else:
        token_ids = np.concatenate([np.asarray(s.token_ids[a:a + n], np.int32) for s, a, n in zip(seqs, starts, counts)])
        positions = np.concatenate([np.arange(a, a + n, dtype=np.int32) for a, n in zip(starts, counts)])
    num_out, min_tokens = _num_outputs_and_min_tokens(seqs)
    suppress = ending_table(seqs, eos_token_ids, keep=num_out < min_tokens)  # until `min_tokens` are out
    target_ids = None
    if batch.is_prefill and any(s.wants_prompt_logprobs for s in seqs):
        target_ids = np.concatenate([
            np.asarray((s.token_ids + [-1])[a + 1:a + n + 1], np.int32) for s, a, n in zip(seqs, starts, counts)])
    params = [s.params for s in seqs]
    return StepBatch(
        token_ids=token_ids, positions=positions, q_lens=counts, kv_lens=kv_lens,
        block_tables=[s.block_table for s in seqs], sampling=sampling_rows(seqs), suppress_ids=suppress,
        adjust=adjust_rows(seqs, room),
        num_top_logprobs=max((max(p.logprobs or 0, p.prompt_logprobs or 0) for p in params), default=0),
        sampling_record=any(p.sampling_record for p in params), kind="prefill" if batch.is_prefill else "decode",
        target_ids=target_ids, replicas=np.array([s.replica for s in seqs], np.int32))


def build_ahead_step(prev: StepBatch, batch: ScheduledBatch, kept: list[int], prev_rows: np.ndarray,
                     eos_token_ids: tuple[int, ...]) -> StepBatch:
    """The multi-step decode call after `prev`, a multi-step decode call still on the device (async
    scheduling): sequence i of `batch` is row `kept[i]` of `prev`, `prev.num_steps` tokens further than
    `prev` started; its input token is its last token of `prev` (`feed_rows`: its row there), fed on the
    device. Rows are taken from `prev`, not rebuilt per sequence: the settings are the sequence's own, and
    a row's `suppress_ids` are its ending ids whenever `suppress_steps` still counts down (the device
    applies them only then). Steps with logits processors are built from the sequences."""
    index = np.asarray(kept, np.int64)
    done = prev.num_steps[index]
    params = [s.params for s in batch.seqs]
    if prev.adjust is not None:
        step = build_step(batch, eos_token_ids, multi_step=True)
        return dataclasses.replace(step, token_ids=np.zeros_like(step.token_ids), positions=step.positions + done,
                                   kv_lens=step.kv_lens + done, suppress_steps=np.maximum(step.suppress_steps - done, 0),
                                   feed_rows=np.asarray(prev_rows, np.int32))
    return dataclasses.replace(
        prev, token_ids=np.zeros(len(index), np.int32), positions=prev.positions[index] + done,
        q_lens=prev.q_lens[index], kv_lens=prev.kv_lens[index] + done, block_tables=[s.block_table for s in batch.seqs],
        sampling=prev.sampling.take(index), suppress_ids=prev.suppress_ids[index],
        num_top_logprobs=max((max(p.logprobs or 0, p.prompt_logprobs or 0) for p in params), default=0),
        sampling_record=any(p.sampling_record for p in params), num_steps=np.asarray(batch.num_new_tokens, np.int32),
        suppress_steps=np.maximum(prev.suppress_steps[index] - done, 0), stop_ids=prev.stop_ids[index],
        feed_rows=np.asarray(prev_rows, np.int32), replicas=None if prev.replicas is None else prev.replicas[index])


def build_verify_step(batch: ScheduledBatch, eos_token_ids: tuple[int, ...], drafts: list[np.ndarray],
                      *, rejection: bool = False, device_drafts: bool = False) -> StepBatch:
    """A decode step that also feeds each sequence's draft tokens and samples after every position.

    `rejection`: row r of a sequence verifies its draft r by rejection sampling (the last row has
    none); otherwise every row replays the plain per-position draw (exact replay). `device_drafts`:
    draft j of a sequence is made on the device in the same program (`StepBatch.draft_slots`).
    `batch.num_new_tokens` > 1: that many draft-verify steps in one device loop (the arrays describe
    the first; later steps' positions, `min_tokens` and stops are the device's).
    """
    seqs = batch.seqs
    counts = np.array([1 + len(d) for d in drafts], np.int32)
    starts = np.array([s.num_computed_tokens for s in seqs], np.int32)
    steps = np.asarray(batch.num_new_tokens, np.int32)  # > 1: multi-step verification (EAGLE-3, device drafts)
    multi_step = bool(np.any(steps > 1))
    token_ids = np.concatenate([np.concatenate([[s.token_ids[-1]], d]).astype(np.int32) for s, d in zip(seqs, drafts)])
    positions = np.concatenate([np.arange(a, a + n, dtype=np.int32) for a, n in zip(starts, counts)])
    row_seq = np.repeat(np.arange(len(seqs)), counts)
    row_rank = np.arange(len(row_seq)) - np.repeat(np.cumsum(counts) - counts, counts)
    num_out, min_tokens = _num_outputs_and_min_tokens(seqs)
    ahead = 0 if multi_step else row_rank  # steps > 1: the device decides
    suppress = ending_table(seqs, eos_token_ids)[row_seq]
    suppress[num_out[row_seq] + ahead >= min_tokens[row_seq]] = -1
    multi: dict[str, np.ndarray] = {}
    if multi_step:
        if not device_drafts or rejection or len(set(counts.tolist())) != 1:
            raise ValueError("multi-step verification takes device drafts, exact replay and as many drafts per sequence")
        suppress_steps, stop_ids = device_stops(seqs, eos_token_ids)
        multi = dict(num_steps=steps[row_seq], suppress_steps=suppress_steps[row_seq], stop_ids=stop_ids[row_seq])
    return StepBatch(
        token_ids=token_ids, positions=positions, q_lens=counts, kv_lens=starts + counts,
        block_tables=[s.block_table for s in seqs], sampling=sampling_rows(seqs).take(row_seq), suppress_ids=suppress,
        adjust=verify_adjust_rows(seqs, drafts, row_seq, row_rank),
        num_top_logprobs=max((s.params.logprobs or 0 for s in seqs), default=0), kind="verify",
        sampling_record=any(s.params.sampling_record for s in seqs),
        logits_indices=np.arange(len(token_ids), dtype=np.int32), replicas=np.array([s.replica for s in seqs], np.int32),
        draft_ids=np.concatenate([np.append(d, -1) for d in drafts]).astype(np.int32) if rejection else None,
        draft_slots=np.concatenate([np.arange(-1, len(d), dtype=np.int32) for d in drafts]) if device_drafts else None,
        **multi)
