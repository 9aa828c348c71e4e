"""After a step: append sampled tokens, logprobs and policy versions to sequences and apply the stop rules
(`rollout.stop_rules`). It reports what happened (`StepOutcome`); the engine core tells the scheduler."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from rollout.routing_record import RoutingRecord
from rollout.scheduler import ScheduledBatch
from rollout.sequence import Sequence
from rollout.stop_rules import StopChecker, first_stops
from rollout.tokenizer import Tokenizer
from runner.step_plan import StepPlan
from runner.step_result import StepResult

_NO_TOP: tuple[list[int], list[float]] = ([], [])  # the alternatives of a token when none were asked for
DraftRecord = tuple[Sequence, int, int]  # (sequence, drafted tokens, accepted drafts) of one verification step


@dataclasses.dataclass
class StepOutcome:
    """What one step did to its sequences (the core tells the scheduler)."""

    finished: list[Sequence] = dataclasses.field(default_factory=list)  # ended by a stop rule
    prefilled: list[Sequence] = dataclasses.field(default_factory=list)  # sampled their first token: prompt K/V done
    drafts: list[DraftRecord] = dataclasses.field(default_factory=list)  # per (sequence, verification step)
    num_steps_run: int = 0  # device iterations that carried a live sequence
    num_generated: int = 0  # tokens appended


class _HostRows:
    """A step's sampled ids (and logprobs, when some sequence wants them) as Python lists, converted once."""

    def __init__(self, result: StepResult, with_logprobs: bool) -> None:
        self.result = result
        self.token_ids: list[list[int]] = result.token_ids.tolist()
        self.logprobs: list[list[float]] | None = result.logprobs.tolist() if with_logprobs else None
        self.ranks: list[list[int]] | None = (result.ranks.tolist() if with_logprobs and result.ranks is not None
                                              else None)


class OutputProcessor:
    """Turns step results into sequence state, one method per plan kind."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int,
                 routing: RoutingRecord | None = None) -> None:
        self.stops = StopChecker(tokenizer, eos_token_ids, max_model_len)
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.routing = routing  # the routed-experts record, when the engine keeps one
        self.policy_version: int | None = None  # recorded with every token appended

    def apply(self, plan: StepPlan, batch: ScheduledBatch, result: StepResult,
              drafts: list[np.ndarray] | None = None) -> StepOutcome:
        """Apply one step's results: `result` is `[steps, rows]` for every kind (`runner.step_result`)."""
        outcome = StepOutcome()
        if plan.kind == "ragged":
            self._ragged(batch, result, outcome)
        elif plan.kind == "decode_loop":
            self._record_routing(batch, result, packed=False)
            live = [s for s, seq in enumerate(batch.seqs) if not seq.is_finished]  # (stopped in the call before)
            self._rows(batch.seqs, live, batch.num_new_tokens, result, outcome)
        else:
            self._verify(batch, result, drafts, outcome)
        return outcome

    def _ragged(self, batch: ScheduledBatch, result: StepResult, outcome: StepOutcome) -> None:
        """Sequence s computed `num_new_tokens[s]` tokens; its row's token counts where they reach its end."""
        self._record_routing(batch, result, packed=True)
        live, offset = [], 0  # offset: the sequence's first token in the step
        for s, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if result.token_logprobs is not None and seq.wants_prompt_logprobs:
                self._record_prompt_logprobs(seq, result, offset, count)
            offset += count
            seq.num_computed_tokens += count - 1  # the sampled row computes the last one
            if seq.num_computed_tokens + 1 < seq.num_tokens:  # a chunk short of the end: nothing sampled
                seq.num_computed_tokens += 1
            else:
                live.append(s)
        self._rows(batch.seqs, live, [1] * len(batch.seqs), result, outcome)

    def _verify(self, batch: ScheduledBatch, result: StepResult, drafts: list[np.ndarray],
                outcome: StepOutcome) -> None:
        """Sequence s owns rows `[start_s, start_s + 1 + len(drafts[s]))` of each step; row r sampled after
        its r-th input (its last token, then draft r - 1), so its token holds while every earlier draft
        equalled the token sampled before it. It runs `num_new_tokens` steps until one stops it (K/V its
        later steps wrote lies past its end and is never read)."""
        seqs, steps = batch.seqs, batch.num_new_tokens
        starts = list(itertools.accumulate((1 + len(d) for d in drafts), initial=0))
        if result.routed_experts is not None:
            self._write_routing(seqs, result.routed_experts, [1 + len(d) for d in drafts], steps, packed=True)
        rows = _HostRows(result, any(s.params.logprobs is not None for s in seqs))
        live = list(range(len(seqs)))
        for t in range(result.steps):
            live = [s for s in live if t < steps[s]]
            if not live:
                break
            outcome.num_steps_run += 1
            for s in list(live):
                seq = seqs[s]
                draft = drafts[s] if result.draft_ids is None else result.draft_ids[t, s, :len(drafts[s])]
                done, accepted = self._walk(seq, draft, rows, t, starts[s], outcome)
                outcome.drafts.append((seq, len(draft), accepted))
                if done:
                    live.remove(s)

    def _record_routing(self, batch: ScheduledBatch, result: StepResult, *, packed: bool) -> None:
        if result.routed_experts is not None:
            self._write_routing(batch.seqs, result.routed_experts, batch.num_new_tokens,
                                [1] * len(batch.seqs) if packed else batch.num_new_tokens, packed=packed)

    def _write_routing(self, seqs: list[Sequence], experts: np.ndarray, q_lens: list[int], steps: list[int],
                       *, packed: bool) -> None:
        """Write each computed token's experts at its KV slot (`rollout.routing_record`), before any
        sequence of the step finishes. `packed`: one call's tokens in packed order (ragged, verification);
        else `[steps, rows]` with one token per row and step."""
        for s, (seq, offset) in enumerate(zip(seqs, itertools.accumulate(q_lens, initial=0))):
            if not seq.is_finished:
                tokens = experts[0, offset:offset + q_lens[s]] if packed else experts[:steps[s], s]
                self.routing.write(seq.block_table, seq.num_computed_tokens, tokens)

    def _rows(self, seqs: list[Sequence], live: list[int], steps: list[int], result: StepResult,
              outcome: StepOutcome) -> None:
        """Steps without drafts: sequence s's token of step t sits in row s. The stop ids, `min_tokens` and
        the length limits are checked on arrays for all sequences at once and each sequence takes its
        tokens in one slice; sequences with stop strings go token by token (their text grows)."""
        few = len(live) * result.steps <= 16  # array set-up would cost more than it saves
        plain = [] if few else [s for s in live if not seqs[s].params.stop]
        if plain:
            self._take_tokens([seqs[s] for s in plain], np.asarray(plain), np.asarray([steps[s] for s in plain]),
                              result, outcome)
        wordy = live if few else [s for s in live if seqs[s].params.stop]
        if wordy:
            rows = _HostRows(result, any(seqs[s].params.logprobs is not None for s in wordy))
            for s in wordy:
                seq = seqs[s]
                for t in range(min(steps[s], result.steps)):
                    seq.num_computed_tokens += 1
                    outcome.num_steps_run = max(outcome.num_steps_run, t + 1)
                    if self._emit(seq, rows, t, s, outcome):
                        break

    def _take_tokens(self, seqs: list[Sequence], rows: np.ndarray, steps: np.ndarray, result: StepResult,
                     outcome: StepOutcome) -> None:
        tokens = result.token_ids[:, rows]  # [T, L]
        counts, finished, hit = first_stops(tokens, seqs, steps, self.eos_token_ids, self.max_model_len)
        num_out = np.fromiter((s.num_output_tokens for s in seqs), np.int64, len(seqs))
        params = [s.params for s in seqs]
        # flat lists, one per array: a list per sequence would keep hundreds of new containers alive at once,
        # each pass over the batch then paying a garbage collection
        columns = tokens.T.ravel().tolist()
        want_logprobs = [p.logprobs is not None for p in params]
        logprobs = result.logprobs[:, rows].T.ravel().tolist() if any(want_logprobs) else None
        ranks = result.ranks[:, rows].T.ravel().tolist() if any(want_logprobs) and result.ranks is not None else None
        version, width = self.policy_version, tokens.shape[0]
        for j, (seq, n, first, ends_now) in enumerate(zip(seqs, counts.tolist(), (num_out == 0).tolist(),
                                                           finished.tolist())):
            if first:
                outcome.prefilled.append(seq)
            at = j * width
            new = columns[at:at + n]
            seq.token_ids += new
            seq.num_computed_tokens += n
            seq.out.versions += [version] * n
            if want_logprobs[j]:
                seq.out.logprobs += logprobs[at:at + n]
                if ranks is not None:
                    seq.out.ranks += ranks[at:at + n]
                k = params[j].logprobs
                seq.out.top += [(result.top_ids[i, rows[j], :k].tolist(),
                                    result.top_logprobs[i, rows[j], :k].tolist()) for i in range(n)] if k else [_NO_TOP] * n
            if params[j].sampling_record:
                for i in range(n):
                    _record(seq, result, i, rows[j])
            if ends_now:
                if hit[n - 1, j]:
                    seq.out.finish_reason = "stop"
                    seq.out.stop_reason = new[-1] if new[-1] in params[j].stop_token_ids else None
                else:
                    seq.out.finish_reason = "length"
                outcome.finished.append(seq)
        outcome.num_generated += int(counts.sum())
        outcome.num_steps_run = max(outcome.num_steps_run, int(counts.max(initial=0)))

    def _walk(self, seq: Sequence, draft: np.ndarray, rows: _HostRows, step: int, row: int,
              outcome: StepOutcome) -> tuple[bool, int]:
        """One sequence's rows of one step from `row`: emit while drafts match; (finished, accepted drafts)."""
        for r in range(len(draft) + 1):
            seq.num_computed_tokens += 1  # K/V of this row's input token is valid
            if self._emit(seq, rows, step, row + r, outcome):
                return True, r
            if r < len(draft) and int(draft[r]) != seq.token_ids[-1]:
                return False, r
        return False, len(draft)

    def _emit(self, seq: Sequence, rows: _HostRows, step: int, row: int, outcome: StepOutcome) -> bool:
        """Append the token sampled in `row` of `step`; True if it ends the sequence."""
        if seq.num_output_tokens == 0:
            outcome.prefilled.append(seq)
        token = rows.token_ids[step][row]
        seq.token_ids.append(token)
        outcome.num_generated += 1
        seq.out.versions.append(self.policy_version)
        if seq.params.logprobs is not None:
            seq.out.logprobs.append(rows.logprobs[step][row])
            if rows.ranks is not None:
                seq.out.ranks.append(rows.ranks[step][row])
            k = seq.params.logprobs  # the step returns the batch's largest k
            seq.out.top.append((rows.result.top_ids[step, row, :k].tolist(),
                                   rows.result.top_logprobs[step, row, :k].tolist()) if k else _NO_TOP)
        if seq.params.sampling_record:
            _record(seq, rows.result, step, row)
        if self.stops.check(seq, token):
            outcome.finished.append(seq)
            return True
        return False

    def _record_prompt_logprobs(self, seq: Sequence, result: StepResult, offset: int, n: int) -> None:
        for j in range(n):
            position = seq.num_computed_tokens + j
            if position + 1 < seq.num_prompt_tokens and position == len(seq.out.prompt_logprobs):
                seq.out.prompt_logprobs.append(float(result.token_logprobs[offset + j]))
                k = seq.params.prompt_logprobs
                seq.out.prompt_top.append((result.token_top_ids[offset + j, :k].tolist(),
                                       result.token_top_logprobs[offset + j, :k].tolist()))


def _record(seq: Sequence, result: StepResult, step: int, row: int) -> None:
    """Append the sampling record of the token in `row` of `step` (its kept ids only where they all fit)."""
    seq.out.kept_logmass.append(float(result.kept_logmass[step, row]))
    count, k = int(result.kept_counts[step, row]), seq.params.max_kept_ids
    seq.out.kept_ids.append(result.kept_ids[step, row, :count].tolist() if count <= k else None)
