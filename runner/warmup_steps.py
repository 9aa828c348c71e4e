"""The dummy steps `ModelRunner.warmup` runs to compile every bucket before the first request, and what an
abstract runner's warmup compiled for each (`WarmupProgram`).

Each is a `StepBatch` of exactly a bucket's shape whose block tables point past the replica's blocks,
so every K/V write is dropped and the caches stay as they were.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import numpy as np

from runner.buckets import BucketConfig, pick
from runner.executable_store import CompiledProgram
from runner.kv_cache import KVCacheSpec
from runner.sampling_rows import SamplingRows
from runner.step_inputs import MAX_SUPPRESS, StepBatch


@dataclasses.dataclass(frozen=True)
class DummySteps:
    """Builds bucket-shaped dummy steps for one runner's buckets, cache and step programs."""

    buckets: BucketConfig
    kv_spec: KVCacheSpec
    num_scheduler_steps: int  # > 1: decode steps run as (one-step) multi-step calls
    num_verify_steps: int  # > 1: multi-step verification programs exist too
    has_drafter: bool  # verification steps carry `draft_slots` (the EAGLE-3 head drafts on the device)
    max_logprobs: int

    def every_bucket(self, *, prompt_logprobs: bool, speculative_k: int, rejection: bool) -> Iterator[StepBatch]:
        """One step per compiled program: prefill and decode buckets with and without top logprobs
        (prefill with per-token logprobs too if `prompt_logprobs`), then the verification buckets a
        batch of k + 1 tokens per sequence reaches (rejection sampling's or exact replay's, single and
        multi-step)."""
        bk = self.buckets
        shapes = [(True, s, p) for s, p in itertools.product(bk.seq_buckets, bk.page_buckets)]
        shapes += [(False, t, p) for t, p in itertools.product(bk.token_buckets, bk.page_buckets)]
        tops = (0, 1) if self.max_logprobs > 0 else (0,)
        for (decode, n, pages), top in itertools.product(shapes, tops):
            dummy = dataclasses.replace(self.step(decode, n, pages), num_top_logprobs=top)
            yield dummy
            if prompt_logprobs and not decode:
                yield dataclasses.replace(dummy, target_ids=np.zeros_like(dummy.token_ids))
        if not speculative_k:
            return
        for n, top in itertools.product(bk.verify_buckets, tops):
            if n <= bk.max_num_seqs * (speculative_k + 1):  # reachable
                step = self.verify(n, bk.page_buckets[-1], speculative_k, top)
                if rejection:
                    step = dataclasses.replace(step, draft_ids=np.full(step.num_rows, -1, np.int32))
                yield step
        if self.num_verify_steps > 1 and not rejection:
            for n, top in itertools.product(self.verify_steps_seqs(speculative_k), tops):
                yield self.verify_steps(n, bk.page_buckets[-1], speculative_k, top)

    def verify_steps_seqs(self, k: int) -> list[int]:
        """One sequence count per verification bucket that multi-step verification (k + 1 tokens each) reaches."""
        largest: dict[int, int] = {}
        for n in range(1, self.buckets.max_num_seqs + 1):
            if n * (k + 1) <= self.buckets.verify_buckets[-1]:
                largest[pick(self.buckets.verify_buckets, n * (k + 1))] = n
        return sorted(largest.values())

    def verify_steps(self, num_seqs: int, pages: int, k: int, num_top: int) -> StepBatch:
        """A one-step multi-step verification of `num_seqs` sequences (k + 1 tokens each)."""
        step = self.verify(num_seqs * (k + 1), pages, k, num_top)
        rows = step.num_rows
        return dataclasses.replace(step, num_steps=np.ones(rows, np.int32), suppress_steps=np.zeros(rows, np.int32),
                                   stop_ids=np.full((rows, MAX_SUPPRESS), -1, np.int32))

    def verify(self, n: int, pages: int, k: int, num_top: int) -> StepBatch:
        """A verification step of exactly `n` tokens (so it pads to bucket `n`): sequences of k + 1
        tokens and one shorter remainder, a sampled row per token."""
        q_len = min(k + 1, n)
        q_lens = np.full(n // q_len, q_len, np.int32)
        if n % q_len:
            q_lens = np.append(q_lens, np.int32(n % q_len))
        num_seqs = len(q_lens)
        base = self.step(True, num_seqs, pages)
        capacity = pages * self.kv_spec.block_size
        rep = lambda x: np.repeat(x, q_lens, axis=0)  # noqa: E731
        slots = np.concatenate([np.arange(q, dtype=np.int32) - 1 for q in q_lens])  # the head drafts after the first
        return dataclasses.replace(
            base, token_ids=np.zeros(n, np.int32),
            positions=np.concatenate([np.arange(capacity - q, capacity, dtype=np.int32) for q in q_lens]),
            q_lens=q_lens, sampling=base.sampling.take(np.repeat(np.arange(num_seqs), q_lens)),
            suppress_ids=rep(base.suppress_ids), num_top_logprobs=num_top,
            kind="verify", num_steps=None, suppress_steps=None, stop_ids=None,
            logits_indices=np.arange(n, dtype=np.int32), draft_slots=slots if self.has_drafter else None)

    def step(self, decode: bool, n: int, pages: int) -> StepBatch:
        """A step of bucket shape (n sequences for decode, n tokens for prefill; `pages` of context)."""
        capacity = pages * self.kv_spec.block_size
        if decode:
            q_lens = np.ones(n, np.int32)
        else:
            num_seqs = min(-(-n // capacity), self.buckets.max_num_seqs)
            q_lens = np.full(num_seqs, min(capacity, n // num_seqs), np.int32)
        num_seqs = len(q_lens)
        kv_lens = np.full(num_seqs, capacity, np.int32)
        positions = np.concatenate([np.arange(k - q, k) for k, q in zip(kv_lens, q_lens)]).astype(np.int32)
        drop = self.kv_spec.blocks_per_replica  # past replica 0's blocks: every write is dropped
        chunk = decode and self.num_scheduler_steps > 1  # decode steps run as (one-step) chunks
        return StepBatch(
            token_ids=np.zeros(len(positions), np.int32), positions=positions, q_lens=q_lens, kv_lens=kv_lens,
            block_tables=[[drop] * pages] * num_seqs,
            sampling=SamplingRows.from_rows([(1.0, 0, 1.0, 0.0, 0, 0, False, True, False)] * num_seqs),
            suppress_ids=np.full((num_seqs, MAX_SUPPRESS), -1, np.int32), kind="decode" if decode else "prefill",
            num_steps=np.ones(num_seqs, np.int32) if chunk else None,
            suppress_steps=np.zeros(num_seqs, np.int32) if chunk else None,
            stop_ids=np.full((num_seqs, MAX_SUPPRESS), -1, np.int32) if chunk else None)


@dataclasses.dataclass(frozen=True)
class WarmupProgram:
    """A program an abstract runner's `warmup()` compiled and the dummy step it was compiled for."""

    step: StepBatch  # the dummy step (bucket-shaped; every K/V write dropped)
    program: CompiledProgram

    @property
    def kind(self) -> str:
        return self.step.kind

    @property
    def num_seqs(self) -> int:
        return len(self.step.q_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.step.token_ids)

    @property
    def num_top_logprobs(self) -> int:
        return self.step.num_top_logprobs
