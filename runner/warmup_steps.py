"""The dummy steps `ModelRunner.warmup` runs to compile every bucket before the first request, and what an
abstract runner's warmup compiled for each (`WarmupProgram`).

Each is a `StepPlan` of exactly a bucket's shape whose block tables point past the replica's blocks,
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
from runner.step_plan import MAX_SUPPRESS, DraftInputs, LoopInputs, SamplingPlan, StepPlan, TokenInputs


@dataclasses.dataclass(frozen=True)
class DummySteps:
    """Builds bucket-shaped dummy steps for one runner's buckets, cache and step programs."""

    buckets: BucketConfig
    kv_spec: KVCacheSpec
    num_verify_steps: int  # > 1: multi-step verification programs exist too
    has_drafter: bool  # verification steps carry `draft_slots` (the EAGLE-3 head drafts on the device)
    max_logprobs: int

    def every_bucket(self, *, prompt_logprobs: bool, speculative_k: int, rejection: bool) -> Iterator[StepPlan]:
        """One plan per compiled program: decode loops and ragged steps of every bucket with and without
        top logprobs (ragged with prompt logprobs too if `prompt_logprobs`), then the verification buckets
        a batch of k + 1 tokens per sequence reaches (rejection sampling's or exact replay's, single and
        multi-step)."""
        bk = self.buckets
        shapes = [(True, s, p) for s, p in itertools.product(bk.seq_buckets, bk.page_buckets)]
        shapes += [(False, t, p) for t, p in itertools.product(bk.token_buckets, bk.page_buckets)]
        tops = (0, 1) if self.max_logprobs > 0 else (0,)
        for (decode, n, pages), top in itertools.product(shapes, tops):
            dummy = self.decode_loop(n, pages, top) if decode else self.ragged(n, pages, top)
            yield dummy
            if prompt_logprobs and not decode:
                yield self.ragged(n, pages, top, prompt_logprobs=True)
        if not speculative_k:
            return
        for n, top in itertools.product(bk.verify_buckets, tops):
            if n <= bk.max_num_seqs * (speculative_k + 1):  # reachable
                yield self.verify(n, bk.page_buckets[-1], speculative_k, top, rejection=rejection)
        if self.num_verify_steps > 1 and not rejection:
            for n, top in itertools.product(self.verify_steps_seqs(speculative_k), tops):
                yield self.verify_loop(n, bk.page_buckets[-1], speculative_k, top)

    def verify_steps_seqs(self, k: int) -> list[int]:
        """One sequence count per verification bucket that a verification loop (k + 1 tokens each) reaches."""
        largest: dict[int, int] = {}
        for n in range(1, self.buckets.max_num_seqs + 1):
            if n * (k + 1) <= self.buckets.verify_buckets[-1]:
                largest[pick(self.buckets.verify_buckets, n * (k + 1))] = n
        return sorted(largest.values())

    def verify_loop(self, num_seqs: int, pages: int, k: int, num_top: int) -> StepPlan:
        """A one-step verification loop of `num_seqs` sequences (k + 1 tokens each)."""
        plan = self.verify(num_seqs * (k + 1), pages, k, num_top)
        rows = plan.num_rows
        return StepPlan.verify_loop(plan.tokens, plan.sampling, plan.drafts, LoopInputs(
            np.ones(rows, np.int32), np.zeros(rows, np.int32), np.full((rows, MAX_SUPPRESS), -1, np.int32)))

    def verify(self, n: int, pages: int, k: int, num_top: int, *, rejection: bool = False) -> StepPlan:
        """A verification step of exactly `n` tokens (so it pads to bucket `n`): sequences of k + 1
        tokens and one shorter remainder, a sampled row per token."""
        q_len = min(k + 1, n)
        q_lens = np.full(n // q_len, q_len, np.int32)
        if n % q_len:
            q_lens = np.append(q_lens, np.int32(n % q_len))
        capacity = pages * self.kv_spec.block_size
        tokens = self._tokens(q_lens, pages, positions=np.concatenate(
            [np.arange(capacity - q, capacity, dtype=np.int32) for q in q_lens]))
        slots = np.concatenate([np.arange(q, dtype=np.int32) - 1 for q in q_lens])  # the head drafts after the first
        return StepPlan.verify(tokens, self._sampling(n, num_top), DraftInputs(
            np.arange(n, dtype=np.int32), np.full(n, -1, np.int32) if rejection else None,
            slots if self.has_drafter else None))

    def decode_loop(self, n: int, pages: int, num_top: int) -> StepPlan:
        """A one-step decode loop of `n` sequences with `pages` of context."""
        return StepPlan.decode_loop(self._tokens(np.ones(n, np.int32), pages), self._sampling(n, num_top), LoopInputs(
            np.ones(n, np.int32), np.zeros(n, np.int32), np.full((n, MAX_SUPPRESS), -1, np.int32)))

    def ragged(self, n: int, pages: int, num_top: int, *, prompt_logprobs: bool = False) -> StepPlan:
        """A ragged step of `n` tokens over as few sequences as hold them (`pages` of context each)."""
        capacity = pages * self.kv_spec.block_size
        num_seqs = min(-(-n // capacity), self.buckets.max_num_seqs)
        tokens = self._tokens(np.full(num_seqs, min(capacity, n // num_seqs), np.int32), pages)
        if prompt_logprobs:
            tokens = dataclasses.replace(tokens, target_ids=np.zeros_like(tokens.token_ids))
        return StepPlan.ragged(tokens, self._sampling(num_seqs, num_top))

    def _tokens(self, q_lens: np.ndarray, pages: int, positions: np.ndarray | None = None) -> TokenInputs:
        """Each sequence's last `q_lens` positions of `pages` pages, every K/V write dropped."""
        capacity = pages * self.kv_spec.block_size
        if positions is None:
            positions = np.concatenate([np.arange(capacity - q, capacity) for q in q_lens]).astype(np.int32)
        drop = self.kv_spec.blocks_per_replica  # past replica 0's blocks: every write is dropped
        return TokenInputs(np.zeros(len(positions), np.int32), positions, q_lens,
                           np.full(len(q_lens), capacity, np.int32), [[drop] * pages] * len(q_lens))

    @staticmethod
    def _sampling(rows: int, num_top: int) -> SamplingPlan:
        return SamplingPlan(SamplingRows.from_rows([(1.0, 0, 1.0, 0.0, 0, 0, False, True, False)] * rows),
                            np.full((rows, MAX_SUPPRESS), -1, np.int32), num_top_logprobs=num_top)


@dataclasses.dataclass(frozen=True)
class WarmupProgram:
    """A program an abstract runner's `warmup()` compiled and the dummy plan it was compiled for."""

    plan: StepPlan  # the dummy plan (bucket-shaped; every K/V write dropped)
    program: CompiledProgram

    @property
    def kind(self) -> str:
        return self.plan.kind

    @property
    def num_seqs(self) -> int:
        return self.plan.num_seqs

    @property
    def num_tokens(self) -> int:
        return len(self.plan.tokens.token_ids)

    @property
    def num_top_logprobs(self) -> int:
        return self.plan.sampling.num_top_logprobs
