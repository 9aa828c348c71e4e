"""What `generate` and `rollout` return: `RequestOutput`, `CompletionOutput`, `RolloutBatch`."""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
from jaxtyping import Bool, Float, Int

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated (or prompt) position: the token's logprob and the top alternatives."""

    token_id: int
    logprob: float
    top: dict[int, float]  # token id -> logprob of the `logprobs` most likely tokens (mode as requested)


@dataclasses.dataclass
class CompletionOutput:
    """One of the n samples of a prompt."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    cumulative_logprob: float | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None  # the stop token id or stop string that ended it, None for EOS/length/abort
    policy_version: int | None = None  # the policy version (`sync_weights(version=...)`) that sampled its last token
    # per token of `token_ids`: the policy version that sampled it (weights may change between engine steps)
    policy_versions: list[int | None] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RequestOutput:
    """One prompt and its n completions (from `Engine.step`: all so far, or the part since the last
    output with `output_kind="delta"`; `finished` marks a request's last output)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprob | None] | None  # first position has no logprob (None)
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """Padded arrays for a jitted policy-gradient loss; one row per sample (prompt-major, n per prompt).

    `input_ids`/`positions` hold prompt + completion right-padded to `T`; `loss_mask[b, t]` is 1 where
    `input_ids[b, t + 1]` is a completion token, so `logits[:, :-1]` line up with `input_ids[:, 1:]`.
    `logprobs[b, t]` is the engine's logprob of `input_ids[b, t + 1]` (mode as requested).
    """

    prompt_ids: Int[np.ndarray, "B P"]  # right-padded with pad_id
    prompt_lens: Int[np.ndarray, "B"]
    completion_ids: Int[np.ndarray, "B C"]  # right-padded with pad_id
    completion_mask: Bool[np.ndarray, "B C"]
    completion_logprobs: Float[np.ndarray, "B C"]  # sampled-token logprobs, 0 where masked
    completion_lens: Int[np.ndarray, "B"]
    group_ids: Int[np.ndarray, "B"]  # index of the prompt each row was sampled from
    input_ids: Int[np.ndarray, "B T"]  # prompt + completion, right-padded
    positions: Int[np.ndarray, "B T"]
    attention_mask: Int[np.ndarray, "B T"]
    loss_mask: Float[np.ndarray, "B T-1"]
    logprobs: Float[np.ndarray, "B T-1"]  # aligned with loss_mask
    finish_reasons: tuple[str, ...]
    policy_version: int | None
    # the policy version that sampled each completion token (-1: none recorded, or padding)
    completion_policy_versions: Int[np.ndarray, "B C"]
    pad_id: int
