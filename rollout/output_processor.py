"""After a step: append sampled tokens, logprobs and policy versions to sequences, apply stop rules."""

from __future__ import annotations

import functools

import numpy as np

from rollout.scheduler import ScheduledBatch, Scheduler
from rollout.sequence import Sequence
from rollout.tokenizer import Tokenizer
from runner.model_runner import StepResult


class OutputProcessor:
    """Turns step results into sequence state."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...],
                 max_model_len: int) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.policy_version: int | None = None  # recorded with every token appended

    def process(self, batch: ScheduledBatch, result: StepResult) -> list[Sequence]:
        """Apply one step's results; returns the sequences that finished."""
        if result.steps > 1:
            return self._process_steps(batch, result)
        finished: list[Sequence] = []
        offset = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if result.token_logprobs is not None and seq.wants_prompt_logprobs:
                self._record_prompt_logprobs(seq, result, offset, n)
            offset += n
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that does not reach the end: nothing sampled
            if self._emit(seq, result, i):
                finished.append(seq)
        return finished

    def _process_steps(self, batch: ScheduledBatch, result: StepResult) -> list[Sequence]:
        """A multi-step decode call: each sequence takes its steps' tokens until one stops it (the
        K/V its later steps wrote lies past its end and is never read)."""
        finished: list[Sequence] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            for t in range(n):
                seq.num_computed_tokens += 1
                if self._emit(seq, result, i * result.steps + t):
                    finished.append(seq)
                    break
        return finished

    def process_verified(self, batch: ScheduledBatch, result: StepResult, drafts: list[np.ndarray]
                         ) -> tuple[list[Sequence], list[int]]:
        """Apply a verification step: per sequence, keep target tokens while its drafts matched them.

        Row r of a sequence sampled after its r-th input (the last token, then draft r-1), so its
        token is valid while every earlier draft equalled the target's token. Returns the finished
        sequences and the number of accepted drafts per sequence.
        """
        finished: list[Sequence] = []
        accepted: list[int] = []
        row = 0
        for seq, draft in zip(batch.seqs, drafts):
            done, num_accepted = self._verify_one(seq, draft, result, row)
            finished += [seq] if done else []
            accepted.append(num_accepted)
            row += len(draft) + 1
        return finished, accepted

    def process_verify_steps(self, batch: ScheduledBatch, result: StepResult
                             ) -> tuple[list[Sequence], list[tuple[Sequence, int, int]], int]:
        """Apply a multi-step verification call (`result.steps` draft-verify steps ran on the device): step
        i's rows start at i * rows per step, sequence s's drafts at `draft_ids[i * S + s]`. A sequence
        takes its `batch.num_new_tokens` steps until one finishes it (the device stopped it there too;
        or `max_tokens` or a stop string, which the device does not check: its later steps are dropped).
        Returns the finished sequences, (sequence, drafted, accepted) per sequence step, and how many
        steps carried a live sequence."""
        finished: list[Sequence] = []
        records: list[tuple[Sequence, int, int]] = []
        num_seqs, rows_per_step = len(batch.seqs), len(result.token_ids) // result.steps
        k = result.draft_ids.shape[1]
        live = list(range(num_seqs))
        steps_run = 0
        for i in range(result.steps):
            live = [s for s in live if i < batch.num_new_tokens[s]]
            if not live:
                break
            steps_run += 1
            for s in list(live):
                seq, draft = batch.seqs[s], result.draft_ids[i * num_seqs + s]
                done, num_accepted = self._verify_one(seq, draft, result, i * rows_per_step + s * (k + 1))
                records.append((seq, k, num_accepted))
                if done:
                    finished.append(seq)
                    live.remove(s)
        return finished, records, steps_run

    def _verify_one(self, seq: Sequence, draft: np.ndarray, result: StepResult, row: int) -> tuple[bool, int]:
        """One sequence's verification rows from `row`: emit while drafts match; (finished, accepted drafts)."""
        for r in range(len(draft) + 1):
            seq.num_computed_tokens += 1  # K/V of this row's input token is valid
            if self._emit(seq, result, row + r):
                return True, r
            if r < len(draft) and int(draft[r]) != seq.token_ids[-1]:
                return False, r
        return False, len(draft)

    def _emit(self, seq: Sequence, result: StepResult, row: int) -> bool:
        """Append the token sampled in `row`; finish the sequence (and return True) if it stops."""
        if seq.num_output_tokens == 0:  # its prompt's K/V is complete: its sibling samples may share it
            self.scheduler.mark_prefilled(seq)
        token = int(result.token_ids[row])
        seq.token_ids.append(token)
        seq.output_versions.append(self.policy_version)
        if seq.params.logprobs is not None:
            seq.output_logprobs.append(float(result.logprobs[row]))
            k = seq.params.logprobs  # the step returns the batch's largest k
            seq.output_top.append((result.top_ids[row, :k].tolist(), result.top_logprobs[row, :k].tolist()))
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


def _common_prefix_length(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search on slices: comparisons run in C
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
