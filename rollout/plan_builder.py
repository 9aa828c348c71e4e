"""Host-side plan building: a `ScheduledBatch` of sequences (and drafts) -> the runner's `StepPlan` (pure numpy).

`build_plan` is the one place a step's kind is decided: a ragged batch makes a ragged plan, a decode-loop
batch a decode-loop plan, or a verification (loop) plan when the speculator drafted for it.
"""

from __future__ import annotations

import numpy as np

from rollout.scheduler import ScheduledBatch
from rollout.sequence import Sequence, token_counts
from rollout.stop_rules import device_stops, ending_table, min_tokens, suppressed_ids
from runner.logits_processors import AdjustRows
from runner.sampling_rows import SamplingRows
from runner.step_plan import DraftInputs, LoopInputs, SamplingPlan, StepPlan, TokenInputs


def _top_k(top_k: int) -> int:
    """A request's top-k as the device takes it: 0 = off (also -1, and counts past int32 that mean the
    same as the whole vocabulary)."""
    return top_k if 0 < top_k < 2**31 else 0


def sampling_rows(seqs: list[Sequence]) -> SamplingRows:
    """The sequences' sampling settings, one row each, from tuples each sequence builds once."""
    rows = []
    for seq in seqs:
        if seq.rows.sampling_row is None:
            p = seq.params
            seq.rows.sampling_row = (p.temperature, _top_k(p.top_k), p.top_p, p.min_p, seq.seed, seq.sample_index,
                                p.logprobs_mode.startswith("processed"), p.logprobs is not None,
                                p.logprobs_mode.endswith("logits"))
        rows.append(seq.rows.sampling_row)
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
    words = np.full((n, _pow2(max(len(s.rows.bad_word_ids) for s in seqs)),
                     _pow2(max((len(w) for s in seqs for w in s.rows.bad_word_ids), default=1))), -1, np.int32)
    history = [s.reads_output for s in seqs]
    outputs = np.full((n, _pow2(max((s.num_output_tokens for s, h in zip(seqs, history) if h), default=0) + room)),
                      -1, np.int32)
    prompts = []
    for s in seqs:
        if s.params.repetition_penalty != 1.0 and s.rows.distinct_prompt_ids is None:
            s.rows.distinct_prompt_ids = tuple(dict.fromkeys(s.token_ids[:s.num_prompt_tokens]))
        prompts.append(s.rows.distinct_prompt_ids if s.params.repetition_penalty != 1.0 else ())
    prompt_ids = np.full((n, _pow2(max(len(p) for p in prompts))), -1, np.int32)
    for i, (s, p) in enumerate(zip(seqs, params)):
        allowed[i, :len(p.allowed_token_ids or ())] = p.allowed_token_ids or ()
        if p.logit_bias:
            bias_ids[i, :len(p.logit_bias)] = list(p.logit_bias)
            bias_values[i, :len(p.logit_bias)] = list(p.logit_bias.values())
        for j, word in enumerate(s.rows.bad_word_ids):
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


def build_plan(batch: ScheduledBatch, eos_token_ids: tuple[int, ...], drafts: list[np.ndarray] | None = None,
               *, rejection: bool = False, device_drafts: bool = False) -> StepPlan:
    """The plan of one scheduled batch: its tokens, with their sampling settings and stop inputs.

    `drafts` (a decode loop the speculator drafted for): a verification plan. `device_drafts`: `drafts`
    are placeholders the EAGLE-3 head fills on the device (only their lengths count).
    """
    if drafts is not None:
        return _verify_plan(batch, eos_token_ids, drafts, rejection=rejection, device_drafts=device_drafts)
    seqs = batch.seqs
    if batch.kind == "decode_loop":
        tokens = TokenInputs(np.array([s.token_ids[-1] for s in seqs], np.int32), _starts(seqs),
                             np.ones(len(seqs), np.int32), _starts(seqs) + 1, [s.block_table for s in seqs],
                             _replicas(seqs))
        suppress_steps, stop_ids = device_stops(seqs, eos_token_ids)
        return StepPlan.decode_loop(tokens, _sampling(seqs, eos_token_ids, room=max(batch.num_new_tokens)), LoopInputs(
            np.asarray(batch.num_new_tokens, np.int32), suppress_steps, stop_ids))
    counts, starts = np.asarray(batch.num_new_tokens, np.int32), _starts(seqs)
    target_ids = None
    if any(s.wants_prompt_logprobs for s in seqs):
        target_ids = np.concatenate([
            np.asarray((s.token_ids + [-1])[a + 1:a + n + 1], np.int32) for s, a, n in zip(seqs, starts, counts)])
    tokens = TokenInputs(
        np.concatenate([np.asarray(s.token_ids[a:a + n], np.int32) for s, a, n in zip(seqs, starts, counts)]),
        np.concatenate([np.arange(a, a + n, dtype=np.int32) for a, n in zip(starts, counts)]), counts,
        starts + counts, [s.block_table for s in seqs], _replicas(seqs), target_ids)
    return StepPlan.ragged(tokens, _sampling(seqs, eos_token_ids, room=1))


def ahead_plan(prev: StepPlan, batch: ScheduledBatch, kept: list[int], prev_rows: np.ndarray) -> StepPlan:
    """The decode loop after `prev` (still on the device) for `batch` (`Scheduler.schedule_ahead`): sequence
    i is row `kept[i]` of `prev`; its rows are taken from `prev` (`StepPlan.ahead`), not rebuilt."""
    params = [s.params for s in batch.seqs]
    return prev.ahead(np.asarray(kept, np.int64), np.asarray(batch.num_new_tokens, np.int32),
                      [s.block_table for s in batch.seqs], prev_rows, num_top_logprobs=_num_top(params),
                      sampling_record=any(p.sampling_record for p in params))


def _starts(seqs: list[Sequence]) -> np.ndarray:
    return np.fromiter((s.num_computed_tokens for s in seqs), np.int32, len(seqs))


def _replicas(seqs: list[Sequence]) -> np.ndarray:
    return np.fromiter((s.replica for s in seqs), np.int32, len(seqs))


def _num_top(params: list) -> int:
    return max((max(p.logprobs or 0, p.prompt_logprobs or 0) for p in params), default=0)


def _sampling(seqs: list[Sequence], eos_token_ids: tuple[int, ...], *, room: int) -> SamplingPlan:
    """A row per sequence; `room`: outputs its processors' state must hold (steps of a decode loop)."""
    params = [s.params for s in seqs]
    return SamplingPlan(sampling_rows(seqs), suppressed_ids(seqs, eos_token_ids), adjust_rows(seqs, room),
                        _num_top(params), any(p.sampling_record for p in params))


def _verify_plan(batch: ScheduledBatch, eos_token_ids: tuple[int, ...], drafts: list[np.ndarray],
                 *, rejection: bool = False, device_drafts: bool = False) -> StepPlan:
    """Each sequence feeds its last token and drafts, a row sampled after each.

    `rejection`: row r of a sequence verifies its draft r by rejection sampling (the last row has
    none); otherwise every row replays the plain per-position draw (exact replay).
    `batch.num_new_tokens` > 1: that many draft-verify steps in one device loop (the arrays describe
    the first; later steps' positions, `min_tokens` and stops are the device's).
    """
    seqs = batch.seqs
    counts = np.array([1 + len(d) for d in drafts], np.int32)
    starts = _starts(seqs)
    steps = np.asarray(batch.num_new_tokens, np.int32)
    looped = bool(np.any(steps > 1))
    row_seq = np.repeat(np.arange(len(seqs)), counts)
    row_rank = np.arange(len(row_seq)) - np.repeat(np.cumsum(counts) - counts, counts)
    num_out = token_counts(seqs)[1]
    suppress = ending_table(seqs, eos_token_ids)[row_seq]
    suppress[num_out[row_seq] + (0 if looped else row_rank) >= min_tokens(seqs)[row_seq]] = -1  # looped: the device's
    tokens = TokenInputs(
        np.concatenate([np.concatenate([[s.token_ids[-1]], d]).astype(np.int32) for s, d in zip(seqs, drafts)]),
        np.concatenate([np.arange(a, a + n, dtype=np.int32) for a, n in zip(starts, counts)]), counts, starts + counts,
        [s.block_table for s in seqs], _replicas(seqs))
    sampling = SamplingPlan(sampling_rows(seqs).take(row_seq), suppress, verify_adjust_rows(seqs, drafts, row_seq, row_rank),
                            max((s.params.logprobs or 0 for s in seqs), default=0),
                            any(s.params.sampling_record for s in seqs))
    draft_inputs = DraftInputs(
        np.arange(len(tokens.token_ids), dtype=np.int32),
        np.concatenate([np.append(d, -1) for d in drafts]).astype(np.int32) if rejection else None,
        np.concatenate([np.arange(-1, len(d), dtype=np.int32) for d in drafts]) if device_drafts else None)
    if not looped:
        return StepPlan.verify(tokens, sampling, draft_inputs)
    suppress_steps, stop_ids = device_stops(seqs, eos_token_ids)
    return StepPlan.verify_loop(tokens, sampling, draft_inputs,
                                LoopInputs(steps[row_seq], suppress_steps[row_seq], stop_ids[row_seq]))
