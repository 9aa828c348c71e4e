"""What a device step gives back: `StepResult` (the sampled rows on the host, one `[steps, rows]` layout
for every kind of step) and `PendingStep` (a launched step not yet collected)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from jaxtyping import Array, Float, Int

from runner.sampler import SamplerOutput


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What comes back to the host, one layout for every kind of step: `[steps, rows]`, where a row is
    a sampled row of the plan (one per sequence, or one per verified token) and a step one device
    iteration (one for a single step; a multi-step call's later steps past a sequence's count are
    garbage the host never reads). Per-token logprobs of a prefill come flat."""

    token_ids: Int[np.ndarray, "steps rows"]
    logprobs: Float[np.ndarray, "steps rows"]  # of the sampled token, in each sequence's mode
    top_ids: Int[np.ndarray, "steps rows K"]
    top_logprobs: Float[np.ndarray, "steps rows K"]
    token_logprobs: Float[np.ndarray, "T"] | None = None  # raw logprob of target_ids[t] after token t
    token_top_ids: Int[np.ndarray, "T K"] | None = None
    token_top_logprobs: Float[np.ndarray, "T K"] | None = None
    draft_ids: Int[np.ndarray, "steps S k"] | None = None  # drafts made on the device (`DraftInputs.draft_slots`)
    verified: bool = True  # False: the head was unsure and the step decoded plainly (drafts all -1)
    # the sampling record (`SamplingPlan.sampling_record`; see `runner.sampler.SamplerOutput`)
    kept_logmass: Float[np.ndarray, "steps rows"] | None = None
    kept_counts: Int[np.ndarray, "steps rows"] | None = None
    kept_ids: Int[np.ndarray, "steps rows M"] | None = None
    ranks: Int[np.ndarray, "steps rows"] | None = None  # of the sampled token in each row's mode (vLLM's rank)
    # experts per routed-experts layer of each computed token (`ModelRunner(record_routing=True)`): a
    # one-step call's tokens in packed order (`[1, T, L, k]`), a multi-step call's `[steps, rows, L, k]`
    routed_experts: Int[np.ndarray, "steps X L k"] | None = None

    @property
    def steps(self) -> int:
        return self.token_ids.shape[0]


@dataclasses.dataclass(frozen=True)
class PendingStep:
    """A launched step: its device outputs (not yet fetched) and how they become a `StepResult`."""

    outputs: tuple[SamplerOutput | Array | None, ...]
    finish: Callable[[tuple[SamplerOutput | np.ndarray | None, ...]], StepResult]
    rows: np.ndarray | None = None  # multi-step decode: each sequence's flat row in the outputs (`LoopInputs.feed_rows`)
    last_tokens: Array | None = None  # multi-step decode: each flat row's last sampled token, on the device


def sampled_rows(out: SamplerOutput, rows: np.ndarray, num_top: int, steps: slice | None = None) -> StepResult:
    """The sampled rows of a (host) output in the batch's order, `num_top` alternatives each: a one-step
    output (`steps=None`: given a step axis), or the `steps` of a device loop's `[steps, rows]` buffers."""
    index = (None, rows) if steps is None else (steps, rows)
    record = {} if out.kept_logmass is None else dict(
        kept_logmass=out.kept_logmass[index], kept_counts=out.kept_counts[index], kept_ids=out.kept_ids[index])
    if steps is not None and out.routed_experts is not None:  # a multi-step call: one token per row
        record["routed_experts"] = out.routed_experts[index]
    return StepResult(out.token_ids[index], out.logprobs[index], out.top_ids[index][..., :num_top],
                      out.top_logprobs[index][..., :num_top], ranks=out.ranks[index], **record)
