"""Speculative decoding on the host side: which decode steps draft, the drafts, and acceptance stats.

Drafts come from `runner.spec_decode` proposers: n-gram lookup here on the host, or the EAGLE-3
head through the runner (`draft_fn`). The target verifies all drafts in one step and
samples after every position with the request's own per-position key ("exact replay"), so the
emitted tokens and logprobs are those of plain decoding. Speculation turns itself off for a step
when measured step times and acceptance say plain decoding would be faster (that step may then be a
multi-step call: the time per decode step is what is compared). Each sequence carries its own
estimate of tokens per verification step (from 1 + k, an EMA of what it emitted); while it skips
drafting, that estimate drifts back towards the population's mean, since nothing refreshes it.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from rollout.scheduler import ScheduledBatch
from rollout.sequence import Sequence
from weight_sync.compiles import num_compilations
from runner.spec_decode.eagle3_config import Eagle3Config
from runner.spec_decode.ngram import NgramConfig, propose_batch

# (decode batch, per-sequence cap on drafted tokens) -> drafts per sequence
DraftFn = Callable[[list[Sequence], list[int]], list[np.ndarray]]
K = TypeVar("K")

EMA = 0.2  # weight of a sequence's latest verification step in its own estimate
POPULATION_EMA = 0.05  # weight of one (sequence, verification step) in the population's mean
STALE_DECAY = 1 / 8  # per skipped step, how far a sequence's estimate moves back towards the population's
EXPLORE_EVERY = 16  # decode steps between re-measurements of the losing path (doubling while it keeps losing)
MAX_EXPLORE_EVERY = 128
# Steps of a call that re-measures plain decoding while drafting wins: more would cost more drafting
# (8 measured ~11% at B=1 with n-gram drafts on R3), one would charge plain decoding a whole call's
# host work (one-step plain calls measured 34.6-45.7 ms per step at B=8 against ~31.5 in 8-step ones).
PROBE_STEPS = 2


@dataclasses.dataclass
class SpecStats:
    """Drafting counters (a copy is reported by `Engine.stats()`)."""

    num_draft_steps: int = 0
    num_disabled_steps: int = 0  # decode steps where speculation was judged slower and skipped
    # draft steps that decoded plainly because the EAGLE-3 head was unsure (`Eagle3Config.min_confidence`);
    # they count in num_draft_steps, not in the token counters below
    num_unsure_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # tokens produced by draft steps (accepted + one target token per sequence)
    num_seq_steps: int = 0  # (sequence, draft step) pairs
    acceptance_by_version: dict[int | None, tuple[int, int]] = dataclasses.field(default_factory=dict)

    @property
    def mean_accepted_per_step(self) -> float:
        """Mean tokens emitted per sequence per verification step (1 = nothing accepted)."""
        return self.emitted_tokens / self.num_seq_steps if self.num_seq_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


class Speculator:
    """Proposes drafts for decode steps (n-gram lookup, or `draft_fn`: the EAGLE-3 head on the device)
    and decides per step whether drafting pays."""

    def __init__(self, config: NgramConfig | Eagle3Config, max_model_len: int, max_num_batched_tokens: int,
                 draft_fn: DraftFn | None = None) -> None:
        self.config = config
        self.draft_fn = draft_fn if draft_fn is not None else self._ngram_drafts
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stats = SpecStats()
        self._seconds: dict[tuple[bool, int], float] = {}  # (drafted, batch size) -> seconds per step, EMA
        self.step_seconds: dict[str, float] = {}  # "plain@B" / "verify@B" / "unsure@B" -> seconds per step, EMA
        self._steps_since_probe = 0  # decode steps since the losing path was last re-measured
        self._probe_every = EXPLORE_EVERY
        self._last_choice: bool | None = None
        self._compiles: int | None = None  # compilations before the timed step (a step that compiles is not timed)
        self._probing = False  # the last decision took the losing path to re-measure it
        self._untimed = False  # the last decision ran a lone plain step (`propose`): not timed
        self._population_tokens_per_step: float | None = None  # mean over recent (sequence, verification) pairs
        # each sequence's tokens emitted per verification step, an EMA (none until it first verified)
        self._estimates: weakref.WeakKeyDictionary[Sequence, float] = weakref.WeakKeyDictionary()

    def propose(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, list[np.ndarray] | None]:
        """The batch to run and its drafts per sequence (None: decode plainly).

        A step judged not worth drafting keeps the scheduler's multi-step count (a one-step call would
        charge plain decoding the host's per-call cost that its multi-step calls share out), except a
        re-measurement of plain decoding while drafting wins (`PROBE_STEPS` steps; the first measurement
        takes the whole count) and a step where drafting still wins for the population and only these
        sequences dipped: that plain step runs alone (and is not timed), so the next one can draft again.
        A plain step because nothing matched runs one step too; verification runs EAGLE-3's
        `num_verify_steps` per call, except one that re-measures drafting while plain decoding wins.
        """
        self._compiles = num_compilations()
        self._untimed = False
        if batch.kind != "decode_loop" or not batch.seqs:
            return batch, None
        one_step = dataclasses.replace(batch, num_new_tokens=[1] * len(batch.seqs))
        if not self._worth_it(batch.seqs):
            self.stats.num_disabled_steps += 1
            if self._probing and (False, len(batch.seqs)) in self._seconds:  # re-measure plain: a short call
                run = dataclasses.replace(batch, num_new_tokens=[min(n, PROBE_STEPS) for n in batch.num_new_tokens])
            elif self._probing or not self._drafting_wins_overall(len(batch.seqs)):
                run = batch
            else:
                run = one_step
            self._untimed = run is one_step
            self._forget_stale(batch.seqs, max(run.num_new_tokens))
            if not self._probing:
                self._steps_since_probe += max(run.num_new_tokens) - 1  # a multi-step call: its steps count
            return run, None
        per_seq = min(self.config.k, self.max_num_batched_tokens // len(batch.seqs) - 1)
        if per_seq < 1:
            return batch, None
        steps = None if self._probing else self._verify_steps(batch.seqs, per_seq)  # a probe verifies once
        if steps is not None:  # multi-step verification: full drafts every step
            return dataclasses.replace(batch, num_new_tokens=steps), self.draft_fn(batch.seqs, [per_seq] * len(steps))
        limits = [min(per_seq, s.params.max_tokens - s.num_output_tokens - 1, self.max_model_len - s.num_tokens - 1)
                  for s in batch.seqs]
        drafts = self.draft_fn(batch.seqs, limits)
        if not any(len(d) for d in drafts):
            return one_step, None
        self.stats.num_draft_steps += 1
        return one_step, drafts

    def _verify_steps(self, seqs: list[Sequence], per_seq: int) -> list[int] | None:
        """Draft-verify steps of each sequence in one device call (EAGLE-3 `num_verify_steps`), or None
        for one step. A step writes k + 1 positions, so a sequence takes as many as fit before
        `max_model_len` (none fit: the call is one step), and no more than its `max_tokens` could use
        (each step emits >= 1 token; tokens past `max_tokens` are dropped by the host)."""
        most = self.config.num_verify_steps if isinstance(self.config, Eagle3Config) else 1
        if most < 2 or per_seq < self.config.k:
            return None
        width = self.config.k + 1
        steps = [min(most, (self.max_model_len - s.num_tokens + 1) // width, s.params.max_tokens - s.num_output_tokens)
                 for s in seqs]
        return steps if min(steps) >= 1 and max(steps) >= 2 else None

    def _ngram_drafts(self, seqs: list[Sequence], limits: list[int]) -> list[np.ndarray]:
        assert isinstance(self.config, NgramConfig)
        return propose_batch([np.asarray(s.token_ids, np.int32) for s in seqs], limits, self.config)

    def expected_tokens_per_step(self, seqs: list[Sequence]) -> float:
        """Tokens a sequence of `seqs` emits per verification step, on average: each one's own estimate,
        which starts at 1 + k (optimistic: every new sequence drafts and gets measured; an estimate carried
        over from earlier sequences, e.g. the tails of the last call, misjudged new ones)."""
        return float(np.mean([self._estimate(s) for s in seqs]))

    def _estimate(self, seq: Sequence) -> float:
        return self._estimates.get(seq, 1.0 + self.config.k)

    def _record_yield(self, seq: Sequence, emitted: int) -> None:
        """Move the sequence's own estimate (from 1 + k at first) and the population's mean towards `emitted`."""
        self._estimates[seq] = (1 - EMA) * self._estimate(seq) + EMA * emitted
        pop = self._population_tokens_per_step
        self._population_tokens_per_step = emitted if pop is None else (1 - POPULATION_EMA) * pop + POPULATION_EMA * emitted

    def _forget_stale(self, seqs: list[Sequence], num_steps: int) -> None:
        """Steps that do not draft measure nothing: the skipped sequences' estimates drift back towards the
        population's mean, so a few unlucky verifications do not switch a sequence off for good."""
        pop = self._population_tokens_per_step
        if pop is None:
            return
        keep = (1 - STALE_DECAY) ** num_steps
        for seq in seqs:
            if seq in self._estimates:
                self._estimates[seq] = pop + keep * (self._estimates[seq] - pop)

    def _drafting_pays(self, tokens_per_step: float, num_seqs: int) -> bool | None:
        """Drafting's tokens per second at `tokens_per_step` against plain decoding's, at this batch size
        (None: a path not measured yet)."""
        plain, spec = self._seconds.get((False, num_seqs)), self._seconds.get((True, num_seqs))
        if plain is None or spec is None:
            return None
        return tokens_per_step / spec >= 1.0 / plain

    def _drafting_wins_overall(self, num_seqs: int) -> bool:
        """Would drafting pay at this batch size with the population's mean tokens per verification step?"""
        pop = self._population_tokens_per_step
        return pop is not None and self._drafting_pays(pop, num_seqs) is True

    def _worth_it(self, seqs: list[Sequence]) -> bool:
        """Draft this step? Compares tokens per second of both paths for this batch size; every
        `_probe_every` decode steps it takes the losing path once to re-measure it (the interval doubles
        while the same path keeps winning and resets when the winner changes)."""
        self._probing = False
        if not self.config.auto_disable:
            return True
        plain = self._seconds.get((False, len(seqs)))
        spec = self._seconds.get((True, len(seqs)))
        if spec is None:
            return True
        self._steps_since_probe += 1
        explore = self._probing = self._steps_since_probe >= self._probe_every
        if explore:
            self._steps_since_probe = 0
        if plain is None:  # measure plain decoding once in a while, then judge
            return not explore
        choice = bool(self._drafting_pays(self.expected_tokens_per_step(seqs), len(seqs)))
        if explore:
            self._probe_every = min(2 * self._probe_every, MAX_EXPLORE_EVERY)
            return not choice
        if self._last_choice is not None and choice != self._last_choice:  # the winner changed: re-measure in 16
            self._probe_every, self._steps_since_probe = EXPLORE_EVERY, 0
        self._last_choice = choice
        return choice

    def record(self, kind: str, seqs: list[Sequence], drafts: list[tuple[Sequence, int, int]], verified: bool,
               version: int | None, *, seconds: float, num_steps: float) -> None:
        """After a decode loop or a verification (plan `kind`) of `seqs`: acceptance per (sequence, drafted,
        accepted drafts), or an unsure step (`verified` False: the head decoded plainly), and its time per step."""
        if kind != "decode_loop" and verified:
            for seq, drafted, accepted in drafts:
                self.record_acceptance(seq, drafted, accepted, accepted + 1, version)
            if kind == "verify_loop":
                self.record_verify_steps(int(num_steps))
        elif kind != "decode_loop":
            self.record_unsure(seqs)
        self.record_step(len(seqs), kind != "decode_loop", seconds, num_steps, verified=verified)

    def record_step(self, num_seqs: int, drafted: bool, seconds: float, num_steps: float = 1.0,
                    verified: bool = True) -> None:
        """Time one decode call; a plain multi-step call of `num_steps` steps counts per step. Draft steps
        are judged together (`verified` False: the EAGLE-3 head was unsure) and reported apart."""
        if self._compiles is not None and num_compilations() != self._compiles:  # compile time, not step time
            return
        if self._untimed:  # a lone plain step between drafting ones: its host overhead is not plain decoding's
            return
        seconds /= num_steps
        _ema_into(self._seconds, (drafted, num_seqs), seconds)
        kind = "plain" if not drafted else "verify" if verified else "unsure"
        _ema_into(self.step_seconds, f"{kind}@{num_seqs}", seconds)

    def record_verify_steps(self, num_steps: int) -> None:
        """A multi-step verification call ran `num_steps` draft steps (each counts towards the next probe)."""
        self.stats.num_draft_steps += num_steps
        self._steps_since_probe += num_steps - 1

    def record_unsure(self, seqs: list[Sequence]) -> None:
        """A draft step that decoded plainly: one token per sequence, for the estimates that judge drafting."""
        self.stats.num_unsure_steps += 1
        for seq in seqs:
            self._record_yield(seq, 1)

    def record_acceptance(self, seq: Sequence, drafted: int, accepted: int, emitted: int, version: int | None) -> None:
        """Count one sequence's verification; its own estimate follows what it emitted."""
        s = self.stats
        s.drafted_tokens += drafted
        s.accepted_tokens += accepted
        s.emitted_tokens += emitted
        s.num_seq_steps += 1
        d, a = s.acceptance_by_version.get(version, (0, 0))
        s.acceptance_by_version[version] = (d + drafted, a + accepted)
        # measured per sequence, so short drafts (few matches, the end of max_tokens) count as they are
        self._record_yield(seq, emitted)


def _ema_into(averages: dict[K, float], key: K, value: float) -> None:
    old = averages.get(key)
    averages[key] = value if old is None else (1 - EMA) * old + EMA * value


def device_draft_slots(seqs: list[Sequence], limits: list[int]) -> list[np.ndarray]:
    """Placeholders for EAGLE-3 drafts (-1, as many as each sequence may take): the head makes them
    on the device in the verification step's own program (`DraftInputs.draft_slots`)."""
    return [np.full(max(lim, 0), -1, np.int32) for lim in limits]
