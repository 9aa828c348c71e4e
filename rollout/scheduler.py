"""The scheduler: which sequences compute which tokens in the next step, under token, sequence and
KV-block budgets. Plain Python.

vLLM v1's model: a sequence has computed tokens (K/V in the cache) and total tokens, nothing else says
"prefill" or "decode". A step gives every running sequence with one pending token (a decode) that token
first, then fills the rest of `max_num_batched_tokens` with chunks of pending prompts (resumed ones,
preempted ones recomputing, new ones admitted from the queue), all in one ragged step. While no prompt
waits to be computed, the step is a decode loop instead: every running sequence decodes up to
`num_scheduler_steps` tokens in one device call. When KV blocks run out, the most recently admitted
running sequence is preempted: its blocks are freed and it is recomputed later. No request fails for
lack of memory alone, and arriving prompts never stall running decodes.

Data parallelism: with `num_replicas > 1` each replica has its own KV blocks and its own budgets
(`max_num_seqs`, `max_num_batched_tokens` per replica, like one vLLM engine per data-parallel
rank). A new sequence goes to the replica that already caches most of its prefix, then to the least
loaded one; it stays there (its blocks are there) until it finishes or is preempted.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Literal

import numpy as np

from rollout.block_manager import BlockManager
from rollout.sequence import Sequence, SequenceStatus, token_counts


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Budgets of one step."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # positions a decode call may write per sequence (speculation: k + 1 per verification step, times
    # the EAGLE-3 verification steps of one call)
    decode_steps: int = 1
    num_replicas: int = 1  # data-parallel replicas; the two budgets above apply to each
    num_scheduler_steps: int = 1  # multi-step decode: decode steps per call, each sequence's count in num_new_tokens
    # speculation (drafts are made only in decode steps): after a ragged step, one decode step of the running
    # decodes before the next ragged one, so steady arrivals cannot keep every step draft-free
    interleave_decodes: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "decode_steps", "num_replicas",
                     "num_scheduler_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


BatchKind = Literal["ragged", "decode_loop"]


@dataclasses.dataclass(frozen=True)
class ScheduledBatch:
    """One step's work. A ragged step: each sequence computes `num_new_tokens` of its pending tokens (a
    decode its last one, a prefill a chunk) and samples after them if they reach its end. A decode loop:
    every sequence decodes, `num_new_tokens` = its decode steps in the call (one token's K/V computed and
    one sampled per step)."""

    kind: BatchKind
    seqs: list[Sequence]
    num_new_tokens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """Continuous batching with chunked prefill, prefix sharing and preemption by recompute."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: dict[Sequence, None] = {}  # in admission order (a dict: O(1) removal when one ends)
        self.num_preemptions = 0
        self._prefilled_requests: set[str | int] = set()
        self.admission_limit: int | None = None  # most samples that may have started (lag-aware admission)
        self.num_started = 0
        self.num_held = 0  # samples the limit postponed at least once
        self._last_kind: BatchKind | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _admissible(self, seq: Sequence, prompt_in_step: set[int]) -> bool:
        # Samples after the first wait until the prompt's K/V exists (or is computed whole in this
        # step: K/V is written before attention reads it), then share its blocks.
        return (seq.sample_index == 0 or seq.request_id in self._prefilled_requests
                or seq.request_id in prompt_in_step)

    @property
    def admission_held(self) -> bool:
        """Nothing runs and every waiting sample is new and held by the admission limit."""
        return (self.admission_limit is not None and not self.running and bool(self.waiting)
                and self.num_started >= self.admission_limit and not any(s.started for s in self.waiting))

    def schedule(self) -> ScheduledBatch:
        """A ragged step while some prompt can be computed (a running chunked prefill, or a waiting sequence
        that fits), else a decode loop of every running sequence (`interleave_decodes`: also right after a
        ragged step, when some sequence decodes)."""
        interleave = (self.config.interleave_decodes and self._last_kind == "ragged"
                      and any(not s.is_prefilling for s in self.running))
        batch = self._schedule_ragged() if self._prefill_waits() and not interleave else self._schedule_decode_loop()
        self._last_kind = batch.kind
        return batch

    def _prefill_waits(self) -> bool:
        """A running sequence is prefilling, or the first waiting sequence admission would take fits."""
        if any(seq.is_prefilling for seq in self.running):
            return True
        for seq in self.waiting:
            if self._admissible(seq, set()) and not self._held(seq):
                num_running = collections.Counter(s.replica for s in self.running)
                budgets = [self.config.max_num_batched_tokens] * self.config.num_replicas
                return self._place(seq, budgets, num_running) is not None
        return False

    def _held(self, seq: Sequence) -> bool:
        """Lag-aware admission postpones this new sample."""
        return not seq.started and self.admission_limit is not None and self.num_started >= self.admission_limit

    def _schedule_ragged(self) -> ScheduledBatch:
        budgets = [self.config.max_num_batched_tokens] * self.config.num_replicas
        seqs: list[Sequence] = []
        counts: list[int] = []
        preemptions = self.num_preemptions
        for seq in sorted(self.running, key=lambda s: s.arrival):  # running decodes first: one token each
            if seq.status == SequenceStatus.RUNNING and not seq.is_prefilling and budgets[seq.replica] > 0 \
                    and self._make_room(seq, 0):
                seqs.append(seq)
                counts.append(1)
                budgets[seq.replica] -= 1
        for seq in self.running:  # then unfinished chunked prefills
            if budgets[seq.replica] > 0 and seq.is_prefilling:
                take = min(seq.num_tokens - seq.num_computed_tokens, budgets[seq.replica])
                seqs.append(seq)
                counts.append(take)
                budgets[seq.replica] -= take
                self.block_manager.register_computed(seq, seq.num_computed_tokens + take)
        skipped: list[Sequence] = []
        prompt_in_step: set[int] = set()
        num_running = collections.Counter(s.replica for s in self.running)  # per replica, kept up to date below
        # no admission in a step that preempted (what was freed goes to the running sequences)
        while self.waiting and any(b > 0 for b in budgets) and self.num_preemptions == preemptions:
            seq = self.waiting.popleft()
            if not self._admissible(seq, prompt_in_step):
                skipped.append(seq)
                continue
            if self._held(seq):
                self.num_held += not seq.held  # (a preempted or resumed sample behind it still runs)
                seq.held = True
                skipped.append(seq)
                continue
            replica = self._place(seq, budgets, num_running)
            if replica is None:
                self.waiting.appendleft(seq)
                break
            seq.replica = replica
            num_running[replica] += 1
            self.num_started += not seq.started
            seq.started = True
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running[seq] = None
            take = min(seq.num_tokens - seq.num_computed_tokens, budgets[replica])
            seqs.append(seq)
            counts.append(take)
            budgets[replica] -= take
            # Published at once, so later prompts of this same step can share these blocks.
            self.block_manager.register_computed(seq, seq.num_computed_tokens + take)
            if seq.num_computed_tokens + take >= seq.num_prompt_tokens:
                prompt_in_step.add(seq.request_id)
        self.waiting.extendleft(reversed(skipped))
        kept = [i for i, s in enumerate(seqs) if s.status == SequenceStatus.RUNNING]  # (one may have been preempted)
        return ScheduledBatch("ragged", [seqs[i] for i in kept], [counts[i] for i in kept])

    def _make_room(self, seq: Sequence, extra: int) -> bool:
        """KV blocks for `extra` tokens past the sequence's current ones, preempting the newest running
        sequences of its replica while they do not fit; False if `seq` itself was preempted."""
        while not self.block_manager.can_append(seq, extra):
            same_replica = [s for s in self.running if s.replica == seq.replica]
            victim = max(same_replica, key=lambda s: s.arrival)
            if victim is seq and len(same_replica) == 1:
                raise RuntimeError("the KV cache cannot hold even one sequence of max_model_len tokens; "
                                   "raise kv_cache_blocks or lower max_model_len")
            self.preempt(victim)
            if victim is seq:
                return False
        self.block_manager.append(seq, extra)
        return True

    def _place(self, seq: Sequence, budgets: list[int], running: collections.Counter[int]) -> int | None:
        """The replica a waiting sequence joins: most cached prefix blocks, then fewest running; None = none fits."""
        fits = [r for r in range(self.config.num_replicas)
                if budgets[r] > 0 and running[r] < self.config.max_num_seqs and self.block_manager.can_allocate(seq, r)]
        if not fits:
            return None
        return max(fits, key=lambda r: (self.block_manager.num_cached_blocks(seq, r), -running[r], -r))

    def _schedule_decode_loop(self) -> ScheduledBatch:
        """Every running sequence decodes; room is made for `decode_steps` tokens (or for as many steps as
        it may still take, up to `num_scheduler_steps`)."""
        scheduled: list[Sequence] = []
        steps: list[int] = []
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status != SequenceStatus.RUNNING or seq.is_prefilling:  # (preempted below; a prompt's chunk)
                continue
            num_steps = max(1, min(self.config.num_scheduler_steps, seq.max_new_tokens(self.config.max_model_len)))
            extra = max(num_steps - 1, min(self.config.decode_steps - 1, self.config.max_model_len - seq.num_tokens))
            if self._make_room(seq, extra):
                scheduled.append(seq)
                steps.append(num_steps)
        kept = [i for i, s in enumerate(scheduled) if s.status == SequenceStatus.RUNNING]
        return ScheduledBatch("decode_loop", [scheduled[i] for i in kept], [steps[i] for i in kept])

    def schedule_ahead(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, list[int]] | None:
        """The multi-step decode call after `batch`, planned while `batch` runs on the device (its tokens
        not yet on the host): each sequence is assumed to take all its steps in `batch` (one that
        reaches its limit there is left out) and its next input token comes from the device. Returns
        the call and each of its sequences' index in `batch`; None when it cannot be planned: `batch`
        is not a decode of every running sequence, requests wait, every sequence ends in `batch`, or
        the blocks do not fit without preempting (the caller then finishes `batch` first)."""
        cfg = self.config
        if batch.kind != "decode_loop" or self.waiting or len(batch.seqs) != len(self.running) or cfg.decode_steps > 1:
            return None
        seqs, done = batch.seqs, np.asarray(batch.num_new_tokens, np.int64)
        num_tokens, num_output = token_counts(seqs)
        max_tokens = np.fromiter((s.params.max_tokens for s in seqs), np.int64, len(seqs))
        left = np.minimum(max_tokens - num_output, cfg.max_model_len - num_tokens) - done  # Sequence.max_new_tokens
        kept = np.flatnonzero(left > 0)
        if not len(kept):
            return None
        steps = np.minimum(cfg.num_scheduler_steps, left[kept])
        reach = done[kept] + steps - 1  # tokens past its current ones the call's K/V needs room for
        held = np.fromiter((len(seqs[i].block_table) for i in kept), np.int64, len(kept))
        need = np.maximum(-(-(num_tokens[kept] + reach) // self.block_manager.block_size) - held, 0)
        replicas = np.fromiter((seqs[i].replica for i in kept), np.int64, len(kept))
        per_replica = np.bincount(replicas, weights=need, minlength=cfg.num_replicas)
        if any(n > self.block_manager.num_free(r) for r, n in enumerate(per_replica.tolist())):
            return None
        for i, n in zip(kept[need > 0].tolist(), reach[need > 0].tolist()):
            self.block_manager.append(seqs[i], n)
        kept, steps = kept.tolist(), steps.tolist()
        return ScheduledBatch("decode_loop", [batch.seqs[i] for i in kept], steps), kept

    def preempt(self, seq: Sequence, *, count: bool = True) -> None:
        """Free a running sequence's blocks and put it back at the head of the queue (its tokens so far
        are recomputed when it is admitted again). `count`: a preemption for lack of memory (counted)."""
        del self.running[seq]
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        if count:
            seq.num_preemptions += 1
            self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def mark_prefilled(self, seq: Sequence) -> None:
        """Called once a sequence's prompt K/V is complete: its sibling samples may now be admitted."""
        self._prefilled_requests.add(seq.request_id)

    def finish(self, seq: Sequence) -> None:
        """End a running sequence; its computed full blocks (prompt and completion) stay cached for
        prefix sharing, so a next turn that extends its tokens (multi-turn RL) or a resumed continuation
        reuses their K/V."""
        seq.status = SequenceStatus.FINISHED
        del self.running[seq]
        self.block_manager.register_computed(seq, seq.num_computed_tokens)
        self.block_manager.deallocate(seq)

    def abort(self, seqs: list[Sequence]) -> None:
        """Remove unfinished sequences (waiting or running) and free their blocks."""
        for seq in seqs:
            if seq.status == SequenceStatus.RUNNING:
                self.finish(seq)
            elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.FINISHED

    def forget_request(self, request_id: str | int) -> None:
        self._prefilled_requests.discard(request_id)
