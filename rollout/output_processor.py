"""After a step: append sampled tokens, logprobs and policy versions to sequences, apply stop rules."""

from __future__ import annotations

import functools
import itertools

import numpy as np

from rollout.scheduler import ScheduledBatch, Scheduler
from rollout.sequence import Sequence, token_counts
from rollout.step_builder import ending_table
from rollout.tokenizer import Tokenizer
from runner.model_runner import StepResult

_NO_TOP: tuple[list[int], list[float]] = ([], [])  # the alternatives of a token when none were asked for
DraftRecord = tuple[Sequence, int, int]  # (sequence, drafted tokens, accepted drafts) of one verification step


class _HostRows:
    """A step's sampled ids (and logprobs, when some sequence wants them) as Python lists, converted once."""

    def __init__(self, result: StepResult, with_logprobs: bool) -> None:
        self.result = result
        self.token_ids: list[list[int]] = result.token_ids.tolist()
        self.logprobs: list[list[float]] | None = result.logprobs.tolist() if with_logprobs else None
        self.ranks: list[list[int]] | None = (result.ranks.tolist() if with_logprobs and result.ranks is not None
                                              else None)


class OutputProcessor:
    """Turns step results into sequence state."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...],
                 max_model_len: int) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.eos_ids_ordered = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.policy_version: int | None = None  # recorded with every token appended
        self.num_generated = 0  # tokens appended to outputs so far (the engine's stats read it)

    def apply(self, batch: ScheduledBatch, result: StepResult, drafts: list[np.ndarray] | None = None
              ) -> tuple[list[DraftRecord], int]:
        """Apply one step's results (every kind of step: one walker over `result`'s `[steps, rows]`).

        Sequence s owns rows `[start_s, start_s + 1 + len(drafts[s]))` of each step (one row when
        nothing is drafted); row r sampled after the sequence's r-th input (its last token, then draft
        r - 1), so its token holds while every earlier draft equalled the token sampled before it.
        A prefill sequence computes its `num_new_tokens` and samples once if they reach its end; a
        decode or verification sequence runs `num_new_tokens` steps until one stops it (K/V its later
        steps wrote lies past its end and is never read). Returns (sequence, drafted, accepted) per
        sequence step that had drafts, and how many steps carried a live sequence.
        """
        seqs, counts = batch.seqs, batch.num_new_tokens
        widths = [1] * len(seqs) if drafts is None else [1 + len(d) for d in drafts]
        starts = list(itertools.accumulate(widths, initial=0))
        steps = [1] * len(seqs) if batch.is_prefill else counts
        if result.routed_experts is not None:
            self._record_routing(batch, result.routed_experts, counts if batch.is_prefill else widths, steps,
                                 packed=batch.is_prefill or drafts is not None)
        records: list[DraftRecord] = []
        live = []
        offset = 0  # prefill: the sequence's first token in the step
        for s, seq in enumerate(seqs):
            if seq.is_finished:  # a call launched ahead: it stopped (or was aborted) in the call before
                continue
            if batch.is_prefill:
                if result.token_logprobs is not None and seq.wants_prompt_logprobs:
                    self._record_prompt_logprobs(seq, result, offset, counts[s])
                offset += counts[s]
                seq.num_computed_tokens += counts[s] - 1  # the sampled row below computes the last one
                if seq.num_computed_tokens + 1 < seq.num_tokens:  # a chunk short of the end: nothing sampled
                    seq.num_computed_tokens += 1
                    continue
            live.append(s)
        if drafts is None:  # one row per sequence and step
            return [], self._apply_rows(seqs, live, steps, result)
        rows = _HostRows(result, any(seqs[s].params.logprobs is not None for s in live))
        steps_run = 0
        for t in range(result.token_ids.shape[0]):
            live = [s for s in live if t < steps[s]]
            if not live:
                break
            steps_run += 1
            for s in list(live):
                seq = seqs[s]
                draft = drafts[s] if result.draft_ids is None else result.draft_ids[t, s, :len(drafts[s])]
                done, accepted = self._walk(seq, draft, rows, t, starts[s])
                records.append((seq, len(draft), accepted))
                if done:
                    live.remove(s)
        return records, steps_run

    def _record_routing(self, batch: ScheduledBatch, experts: np.ndarray, q_lens: list[int], steps: list[int],
                        *, packed: bool) -> None:
        """Write each computed token's experts at its KV slot (`rollout.routing_record`), before any
        sequence of the step finishes. `packed`: one call's tokens in packed order (prefill, verification);
        else `[steps, rows]` with one token per row and step."""
        record = self.scheduler.block_manager.routing
        offsets = itertools.accumulate(q_lens, initial=0)
        for s, (seq, offset) in enumerate(zip(batch.seqs, offsets)):
            if seq.is_finished:
                continue
            tokens = experts[0, offset:offset + q_lens[s]] if packed else experts[:steps[s], s]
            record.write(seq.block_table, seq.num_computed_tokens, tokens)

    def _apply_rows(self, seqs: list[Sequence], live: list[int], steps: list[int], result: StepResult) -> int:
        """Steps without drafts: sequence s's token of step t sits in row s. The stop ids, `min_tokens`
        and the length limits are checked on arrays for all sequences at once and each sequence takes
        its tokens in one slice; sequences with stop strings go token by token (text must be decoded).
        Returns how many steps carried a live sequence."""
        few = len(live) * result.token_ids.shape[0] <= 16  # array set-up would cost more than it saves
        plain = [] if few else [s for s in live if not seqs[s].params.stop]
        steps_run = 0
        if plain:
            steps_run = self._take_tokens([seqs[s] for s in plain], np.asarray(plain), np.asarray(
                [steps[s] for s in plain]), result)
        wordy = live if few else [s for s in live if seqs[s].params.stop]
        if wordy:
            rows = _HostRows(result, any(seqs[s].params.logprobs is not None for s in wordy))
            for s in wordy:
                seq = seqs[s]
                for t in range(min(steps[s], result.token_ids.shape[0])):
                    seq.num_computed_tokens += 1
                    steps_run = max(steps_run, t + 1)
                    if self._emit(seq, rows, t, s):
                        break
        return steps_run

    def _take_tokens(self, seqs: list[Sequence], rows: np.ndarray, steps: np.ndarray, result: StepResult) -> int:
        tokens = result.token_ids[:, rows]  # [T, L]
        t = np.arange(tokens.shape[0])[:, None]
        num_tokens, num_out = token_counts(seqs)
        params = [s.params for s in seqs]
        limit = np.minimum(np.fromiter((p.max_tokens for p in params), np.int64, len(seqs)) - num_out,
                           self.max_model_len - num_tokens)
        ending = ending_table(seqs, self.eos_ids_ordered)  # [L, M], -1 padded
        hit = (tokens[:, :, None] == ending[None]).any(-1)
        hit &= num_out[None] + t + 1 >= np.fromiter((p.min_tokens for p in params), np.int64, len(seqs))[None]
        ends = (hit | (t + 1 >= limit[None])) & (t < steps[None])
        finished = ends.any(0)
        counts = np.where(finished, ends.argmax(0) + 1, np.minimum(steps, tokens.shape[0]))
        # flat lists, one per array: a list per sequence would keep hundreds of new containers alive at once,
        # each pass over the batch then paying a garbage collection
        columns = tokens.T.ravel().tolist()
        want_logprobs = [p.logprobs is not None for p in params]
        logprobs = result.logprobs[:, rows].T.ravel().tolist() if any(want_logprobs) else None
        ranks = result.ranks[:, rows].T.ravel().tolist() if any(want_logprobs) and result.ranks is not None else None
        version = self.policy_version
        width = tokens.shape[0]
        for j, (seq, n, first, ends_now) in enumerate(zip(seqs, counts.tolist(), (num_out == 0).tolist(),
                                                           finished.tolist())):
            if first:  # its prompt's K/V is complete: its sibling samples may share it
                self.scheduler.mark_prefilled(seq)
            at = j * width
            new = columns[at:at + n]
            seq.token_ids += new
            seq.num_computed_tokens += n
            seq.output_versions += [version] * n
            if want_logprobs[j]:
                seq.output_logprobs += logprobs[at:at + n]
                if ranks is not None:
                    seq.output_ranks += ranks[at:at + n]
                k = params[j].logprobs
                seq.output_top += [(result.top_ids[i, rows[j], :k].tolist(),
                                    result.top_logprobs[i, rows[j], :k].tolist()) for i in range(n)] if k else [_NO_TOP] * n
            if params[j].sampling_record:
                for i in range(n):
                    _record(seq, result, i, rows[j])
            if ends_now:
                if hit[n - 1, j]:
                    seq.finish_reason = "stop"
                    seq.stop_reason = new[-1] if new[-1] in params[j].stop_token_ids else None
                else:
                    seq.finish_reason = "length"
                self.scheduler.finish(seq)
        self.num_generated += int(counts.sum())
        return int(counts.max(initial=0))

    def _walk(self, seq: Sequence, draft: np.ndarray, rows: _HostRows, step: int, row: int) -> tuple[bool, int]:
        """One sequence's rows of one step from `row`: emit while drafts match; (finished, accepted drafts)."""
        for r in range(len(draft) + 1):
            seq.num_computed_tokens += 1  # K/V of this row's input token is valid
            if self._emit(seq, rows, step, row + r):
                return True, r
            if r < len(draft) and int(draft[r]) != seq.token_ids[-1]:
                return False, r
        return False, len(draft)

    def _emit(self, seq: Sequence, rows: _HostRows, step: int, row: int) -> bool:
        """Append the token sampled in `row` of `step`; finish the sequence (and return True) if it stops."""
        if seq.num_output_tokens == 0:  # its prompt's K/V is complete: its sibling samples may share it
            self.scheduler.mark_prefilled(seq)
        token = rows.token_ids[step][row]
        seq.token_ids.append(token)
        self.num_generated += 1
        seq.output_versions.append(self.policy_version)
        if seq.params.logprobs is not None:
            seq.output_logprobs.append(rows.logprobs[step][row])
            if rows.ranks is not None:
                seq.output_ranks.append(rows.ranks[step][row])
            k = seq.params.logprobs  # the step returns the batch's largest k
            seq.output_top.append((rows.result.top_ids[step, row, :k].tolist(),
                                   rows.result.top_logprobs[step, row, :k].tolist()) if k else _NO_TOP)
        if seq.params.sampling_record:
            _record(seq, rows.result, step, row)
        if self._check_stop(seq, token):
            self.scheduler.finish(seq)
            return True
        return False

    def _record_prompt_logprobs(self, seq: Sequence, result: StepResult, offset: int, n: int) -> None:
        for j in range(n):
            position = seq.num_computed_tokens + j
            if position + 1 < seq.num_prompt_tokens and position == len(seq.prompt_logprobs):
                seq.prompt_logprobs.append(float(result.token_logprobs[offset + j]))
                k = seq.params.prompt_logprobs
                seq.prompt_top.append((result.token_top_ids[offset + j, :k].tolist(),
                                       result.token_top_logprobs[offset + j, :k].tolist()))

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return True
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
                return True
        if p.stop and self._stop_string(seq):
            return True
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    def _stop_string(self, seq: Sequence) -> bool:
        """Did a stop string end in the text the last token added? As in vLLM, a stop string may end only
        in the text of a token after the first `min_tokens` (where stop ids and EOS are masked), though
        it may start earlier."""
        p = seq.params
        if seq.num_output_tokens <= p.min_tokens:
            return False
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=p.skip_special_tokens)
        text = decode(seq.output_ids)
        # the first search: the text before this token was never searched (min_tokens)
        old = seq.stop_text_checked if seq.num_output_tokens > p.min_tokens + 1 else decode(seq.output_ids[:-1])
        seq.stop_text_checked = text
        # new text starts where the two decodes part (a token completing a multi-byte character can
        # change the characters decoded before it)
        start = len(old) if text.startswith(old) else _common_prefix_length(old, text)
        hits = [(i, s) for s in p.stop if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
        if not hits:
            return False
        seq.stop_text_at, hit = min(hits)
        seq.finish_reason, seq.stop_reason = "stop", hit
        return True


def _record(seq: Sequence, result: StepResult, step: int, row: int) -> None:
    """Append the sampling record of the token in `row` of `step` (its kept ids only where they all fit)."""
    seq.output_kept_logmass.append(float(result.kept_logmass[step, row]))
    count, k = int(result.kept_counts[step, row]), seq.params.max_kept_ids
    seq.output_kept_ids.append(result.kept_ids[step, row, :count].tolist() if count <= k else None)


def _common_prefix_length(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search on slices: comparisons run in C
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
