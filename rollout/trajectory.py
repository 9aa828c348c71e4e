"""`Trajectory`: a multi-turn conversation kept as token ids (token in, token out), for agentic RL.

Each turn's prompt is the previous one's tokens plus the completion plus the environment's reply,
exactly (no re-tokenisation drift), so the engine's prefix cache serves the history's K/V. The
trajectory records which tokens the policy sampled (in the loss) and which the environment wrote (a
tool result, an observation: out of the loss); `build_trajectory_batch` packs many into a `RolloutBatch`.
"""

from __future__ import annotations

import dataclasses

from rollout.outputs import CompletionOutput, logprob_values


@dataclasses.dataclass
class Trajectory:
    """The first prompt, then policy turns and environment turns as one token list with a mask."""

    prompt_ids: list[int]
    completion_ids: list[int] = dataclasses.field(default_factory=list)  # every token after the prompt
    sampled_mask: list[bool] = dataclasses.field(default_factory=list)  # True: the policy sampled it
    logprobs: list[float] = dataclasses.field(default_factory=list)  # per completion token; 0.0 for environment ones
    policy_versions: list[int | None] = dataclasses.field(default_factory=list)  # None for environment tokens
    finish_reason: str | None = None  # of the last policy turn
    num_turns: int = 0  # policy turns added

    def __post_init__(self) -> None:
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        if not self.prompt_ids:
            raise ValueError("a trajectory needs a non-empty first prompt")

    @property
    def token_ids(self) -> list[int]:
        """Prompt and everything after it: the next turn's prompt."""
        return self.prompt_ids + self.completion_ids

    def add_completion(self, completion: CompletionOutput) -> None:
        """Append a policy turn (the engine's output for prompt `token_ids`): its tokens enter the loss.
        Ask for `logprobs=0` (or more) to have its logprobs; else they are recorded as 0.0."""
        n = len(completion.token_ids)
        self.completion_ids += completion.token_ids
        self.sampled_mask += [True] * n
        values = logprob_values(completion.logprobs)
        self.logprobs += [0.0] * n if values is None else values
        versions = list(completion.policy_versions)
        self.policy_versions += versions + [completion.policy_version] * (n - len(versions))
        self.finish_reason = completion.finish_reason
        self.num_turns += 1

    def add_environment(self, token_ids: list[int]) -> None:
        """Append tokens the environment wrote (tool output, an observation, the next user message):
        out of the loss."""
        ids = [int(t) for t in token_ids]
        self.completion_ids += ids
        self.sampled_mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.policy_versions += [None] * len(ids)
