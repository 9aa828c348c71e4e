"""`Sequence`: one sample (one of a request's n) as the scheduler and block manager see it."""

from __future__ import annotations

import enum

import numpy as np

from rollout.sampling_params import SamplingParams
from runner.sampling_rows import SamplingRow


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt + output so far), KV bookkeeping and the per-token results of one sample."""

    def __init__(self, seq_id: int, request_id: str | int, sample_index: int, prompt_ids: list[int],
                 params: SamplingParams, seed: int, arrival: int) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.sample_index = sample_index
        self.params = params
        self.seed = seed
        self.arrival = arrival  # admission order: the newest running sequence is preempted first
        self.token_ids: list[int] = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.num_computed_tokens = 0  # tokens whose K/V is in the cache
        self.num_cached_tokens = 0  # of those, tokens taken from the prefix cache at the last allocation
        self.block_table: list[int] = []
        self.replica = 0  # data-parallel replica whose KV blocks it holds (set on admission)
        self.status = SequenceStatus.WAITING
        self.output_versions: list[int | None] = []  # policy version that sampled each output token
        self.admitted_version: int | None = None  # policy version in force when it was added
        self.output_logprobs: list[float] = []
        self.output_top: list[tuple[list[int], list[float]]] = []
        self.output_ranks: list[int] = []  # rank of each sampled token in its logprobs mode (with logprobs)
        # each computed token's experts per routed-experts layer, read when the blocks are released
        # (`rollout.routing_record`; None unless the engine records them)
        self.routed_experts: np.ndarray | None = None
        self.output_kept_logmass: list[float] = []  # the sampling record (`SamplingParams.sampling_record`)
        self.output_kept_ids: list[list[int] | None] = []  # the kept set where it fits `max_kept_ids`, else None
        self.prompt_logprobs: list[float] = []  # logprob of prompt token i+1 given tokens <= i
        self.prompt_top: list[tuple[list[int], list[float]]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stop_text_checked = ""  # the output text as last searched for stop strings
        self.stop_text_at: int | None = None  # where the stop string that ended it starts in the output text
        self.num_preemptions = 0
        self.sampling_row: SamplingRow | None = None  # its sampling settings as a step packs them (built once)
        self.ending_ids: tuple[int, ...] | None = None  # ids that stop it: EOS unless ignored, its stop ids (built once)
        self.tokens_per_draft_step: float | None = None  # speculative decoding: EMA of tokens emitted per verification
        self.started = False  # admitted once (a preempted or resumed sample is not new)
        self.held = False  # postponed by lag-aware admission at least once
        self.bad_word_ids: tuple[tuple[int, ...], ...] = ()  # `SamplingParams.bad_words` tokenized (set on add)
        self.distinct_prompt_ids: tuple[int, ...] | None = None  # for the repetition penalty (built once)

    @property
    def reads_output(self) -> bool:
        """Its logits processors read the tokens sampled so far (penalties, bad words)."""
        return self.params.has_penalties or bool(self.bad_word_ids)

    def reset_for_resume(self) -> None:
        """Waiting again after it ended (aborted or cut by length): tokens and results kept, K/V to recompute."""
        self.status = SequenceStatus.WAITING
        self.finish_reason = self.stop_reason = self.stop_text_at = None
        self.num_computed_tokens = self.num_cached_tokens = 0
        self.block_table = []
        self.routed_experts = None
        self.sampling_row = self.ending_ids = None  # its params changed

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """True while tokens other than the last one still lack K/V (a decode step computes exactly one)."""
        return self.num_tokens - self.num_computed_tokens > 1

    def max_new_tokens(self, max_model_len: int) -> int:
        """Tokens it may still generate before `max_tokens` or `max_model_len` stops it."""
        return min(self.params.max_tokens - self.num_output_tokens, max_model_len - self.num_tokens)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None


def token_counts(seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
    """[S] each sequence's tokens (prompt + output) and output tokens, as arrays (one pass over `seqs`)."""
    num_tokens = np.fromiter(map(len, (s.token_ids for s in seqs)), np.int64, len(seqs))
    return num_tokens, num_tokens - np.fromiter((s.num_prompt_tokens for s in seqs), np.int64, len(seqs))
