"""`Sequence`: one sample (one of a request's n), split by concern: what the scheduler and block manager
see (tokens, computed tokens, blocks, status), what it produced (`SampleOutput`, `seq.out`), and what
plans read of it, built once (`PlanRows`, `seq.rows`)."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from rollout.detokenizer import IncrementalDetokenizer
from rollout.sampling_params import SamplingParams
from rollout.tokenizer import Tokenizer
from runner.sampling_rows import SamplingRow


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class SampleOutput:
    """What a sample produced: per output token its policy version, logprob (with alternatives, rank and
    sampling record, as asked), the prompt's logprobs, how it ended and its text so far."""

    versions: list[int | None] = dataclasses.field(default_factory=list)  # policy version that sampled each token
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[tuple[list[int], list[float]]] = dataclasses.field(default_factory=list)
    ranks: list[int] = dataclasses.field(default_factory=list)  # of each sampled token in its logprobs mode
    kept_logmass: list[float] = dataclasses.field(default_factory=list)  # the sampling record
    kept_ids: list[list[int] | None] = dataclasses.field(default_factory=list)  # None where the set exceeds max
    prompt_logprobs: list[float] = dataclasses.field(default_factory=list)  # of prompt token i+1 given tokens <= i
    prompt_top: list[tuple[list[int], list[float]]] = dataclasses.field(default_factory=list)
    # each computed token's experts per routed-experts layer, read when the blocks are released
    # (`rollout.routing_record`; None unless the engine records them)
    routed_experts: np.ndarray | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_text_at: int | None = None  # where the stop string that ended it starts in the output text
    detokenizer: IncrementalDetokenizer | None = None  # its output text so far (stop strings, streams)


@dataclasses.dataclass
class PlanRows:
    """What plans read of a sequence, built once (not once per step)."""

    sampling_row: SamplingRow | None = None  # its sampling settings as a step packs them
    ending_ids: tuple[int, ...] | None = None  # ids that stop it: EOS unless ignored, its stop ids
    bad_word_ids: tuple[tuple[int, ...], ...] = ()  # `SamplingParams.bad_words` tokenized (set on add)
    distinct_prompt_ids: tuple[int, ...] | None = None  # for the repetition penalty


class Sequence:
    """Token ids (prompt + output so far) and KV bookkeeping of one sample; its results in `out`."""

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
        self.admitted_version: int | None = None  # policy version its lag counts from
        self.num_preemptions = 0
        self.started = False  # admitted once (a preempted or resumed sample is not new)
        self.held = False  # postponed by lag-aware admission at least once
        self.out = SampleOutput()
        self.rows = PlanRows()

    def text_decoder(self, tokenizer: Tokenizer) -> IncrementalDetokenizer:
        """Its incremental detokenizer (made on first use: stop strings, streamed deltas)."""
        if self.out.detokenizer is None:
            self.out.detokenizer = IncrementalDetokenizer(tokenizer, self.params.skip_special_tokens)
        return self.out.detokenizer

    @property
    def reads_output(self) -> bool:
        """Its logits processors read the tokens sampled so far (penalties, bad words)."""
        return self.params.has_penalties or bool(self.rows.bad_word_ids)

    def reset_for_resume(self) -> None:
        """Waiting again after it ended (aborted or cut by length): tokens and results kept, K/V to recompute."""
        self.status = SequenceStatus.WAITING
        out = self.out
        out.finish_reason = out.stop_reason = out.stop_text_at = out.detokenizer = out.routed_experts = None
        self.num_computed_tokens = self.num_cached_tokens = 0
        self.block_table = []
        self.rows = PlanRows(bad_word_ids=self.rows.bad_word_ids)  # its params changed

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
