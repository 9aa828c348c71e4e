"""What `generate` and `rollout` return: `RequestOutput`, `CompletionOutput`, `RolloutBatch`."""

from __future__ import annotations

import collections.abc
from collections.abc import Callable
import dataclasses
from typing import Literal, NamedTuple

import numpy as np
from jaxtyping import Bool, Float, Int

FinishReason = Literal["stop", "length", "abort"]


class Logprob(NamedTuple):
    """One entry of vLLM's per-position dict: a token's logprob (or logit, in the `*_logits` modes), its
    rank among the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class TokenLogprob(NamedTuple):
    """One generated (or prompt) position: the token's logprob and the top alternatives (a named tuple:
    one is made per token, so it must be cheap)."""

    token_id: int
    logprob: float
    top: dict[int, float]  # token id -> logprob of the `logprobs` most likely tokens (mode as requested)
    rank: int | None = None  # the sampled token's rank in its logprobs mode (1 = most likely); None for prompts
    decoded_token: str | None = None  # the token decoded alone (None with `detokenize=False`)

    def as_dict(self, decode: Callable[[int], str] | None = None) -> dict[int, Logprob]:
        """vLLM's shape: token id -> `Logprob` for the sampled token and each alternative (ranked
        1..k in order); `decode` (e.g. `lambda t: tokenizer.decode([t])`) fills `decoded_token`."""
        text = (lambda t: None) if decode is None else decode
        out = {t: Logprob(lp, rank, text(t)) for rank, (t, lp) in enumerate(self.top.items(), 1)}
        if self.token_id not in out:
            out[self.token_id] = Logprob(self.logprob, self.rank,
                                         self.decoded_token if self.decoded_token is not None else text(self.token_id))
        return out


class CompletionLogprobs(collections.abc.Sequence):
    """A completion's per-token logprobs, kept as plain lists until read: indexing or iterating yields
    `TokenLogprob`s (made then, not per generated token); `values` is the sampled tokens' logprobs."""

    __slots__ = ("token_ids", "values", "top", "ranks", "decode")

    def __init__(self, token_ids: list[int], values: list[float], top: list[tuple[list[int], list[float]]] | None,
                 ranks: list[int] | None = None, decode: Callable[[int], str] | None = None) -> None:
        self.token_ids = token_ids
        self.values = values  # the sampled token's logprob, per token
        self.top = top  # per token (alternative ids, their logprobs); None: no alternatives asked for
        self.ranks = ranks  # per token, the sampled token's rank
        self.decode = decode  # a token id's text (None: no `decoded_token`)

    def __getitem__(self, index: int | slice) -> "TokenLogprob | CompletionLogprobs":
        if isinstance(index, slice):
            return CompletionLogprobs(self.token_ids[index], self.values[index],
                                      None if self.top is None else self.top[index],
                                      None if self.ranks is None else self.ranks[index], self.decode)
        top = {} if self.top is None else dict(zip(*self.top[index]))
        token = self.token_ids[index]
        return TokenLogprob(token, self.values[index], top, None if self.ranks is None else self.ranks[index],
                            None if self.decode is None else self.decode(token))

    def __len__(self) -> int:
        return len(self.values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, collections.abc.Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"CompletionLogprobs({list(self)!r})"


def logprob_values(logprobs: "CompletionLogprobs | list[TokenLogprob] | None") -> list[float] | None:
    """The sampled tokens' logprobs of a completion, without building a `TokenLogprob` per token."""
    if logprobs is None:
        return None
    return logprobs.values if isinstance(logprobs, CompletionLogprobs) else [t.logprob for t in logprobs]


@dataclasses.dataclass
class CompletionOutput:
    """One of the n samples of a prompt."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: CompletionLogprobs | list[TokenLogprob] | None  # a sequence of TokenLogprob
    cumulative_logprob: float | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None  # the stop token id or stop string that ended it, None for EOS/length/abort
    policy_version: int | None = None  # the policy version (`sync_weights(version=...)`) that sampled its last token
    # per token of `token_ids`: the policy version that sampled it (weights may change between engine steps)
    policy_versions: list[int | None] = dataclasses.field(default_factory=list)
    # the sampling record (`SamplingParams.sampling_record`; None without it), per token of `token_ids`: the
    # log of the mass of softmax(logits / T) the filters kept, and the kept ids (most likely first) where
    # the kept set has at most `max_kept_ids` tokens (None where it has more)
    kept_logmass: list[float] | None = None
    kept_ids: list[list[int] | None] | None = None
    # `EngineConfig(record_routed_experts=True)`, once finished: the experts each token of prompt + `token_ids`
    # (all but the last, whose forward never ran) was routed to in every routed-experts layer,
    # `[prompt + completion - 1, num_moe_layers, num_experts_per_tok]`, so a trainer can replay the routing
    routed_experts: Int[np.ndarray, "N L k"] | None = None


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
    # the sampling record (None unless every completion has one): kept log-mass per completion token (0
    # where masked), and the kept ids padded with -1 (M = the most any token kept; a token whose set did
    # not fit its `max_kept_ids` has all -1 and `completion_kept_ids_valid` False)
    completion_kept_logmass: Float[np.ndarray, "B C"] | None = None
    completion_kept_ids: Int[np.ndarray, "B C M"] | None = None
    completion_kept_ids_valid: Bool[np.ndarray, "B C"] | None = None
    # the routed-experts record aligned with `input_ids` (`CompletionOutput.routed_experts`; -1 at the last
    # token and padding), when every completion has one
    routed_experts: Int[np.ndarray, "B T L k"] | None = None
