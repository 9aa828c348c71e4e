"""Packing completions (`RequestOutput`s) or multi-turn `Trajectory`s into a `RolloutBatch` of padded
arrays for a jitted policy-gradient loss."""

from __future__ import annotations

import dataclasses

import numpy as np

from rollout.outputs import RequestOutput, RolloutBatch, logprob_values
from rollout.trajectory import Trajectory


@dataclasses.dataclass(frozen=True)
class _Row:
    """One batch row: a prompt, what followed it, and which of those tokens the policy sampled."""

    group: int
    prompt_ids: list[int]
    completion_ids: list[int]
    sampled: list[bool]  # True: a policy token (in the loss); False: an environment token
    logprobs: list[float] | None  # per completion token (0 for environment tokens)
    versions: list[int | None]
    finish_reason: str
    kept_logmass: list[float] | None = None  # the sampling record, per completion token (None: none)
    kept_ids: list[list[int] | None] | None = None
    routed_experts: np.ndarray | None = None  # [prompt + completion - 1, L, k] (None: not recorded)


def build_rollout_batch(outputs: list[RequestOutput], *, pad_id: int, policy_version: int | None) -> RolloutBatch:
    """One row per completion, prompt-major; completions without logprobs get zeros there."""
    rows = [_Row(g, out.prompt_token_ids, c.token_ids, [True] * len(c.token_ids),
                 logprob_values(c.logprobs), c.policy_versions,
                 c.finish_reason or "", c.kept_logmass, c.kept_ids, c.routed_experts)
            for g, out in enumerate(outputs) for c in out.outputs]
    return _pack(rows, pad_id, policy_version)


def build_trajectory_batch(trajectories: list[Trajectory], *, pad_id: int, policy_version: int | None = None,
                           group_ids: list[int] | None = None) -> RolloutBatch:
    """One row per multi-turn trajectory: `prompt_ids` is its first prompt, `completion_ids` every token
    after it (policy turns and environment turns), and `completion_mask` / `loss_mask` are 1 only on
    the tokens the policy sampled (environment tokens 0), so they drop out of the loss."""
    if group_ids is not None and len(group_ids) != len(trajectories):
        raise ValueError(f"got {len(group_ids)} group_ids for {len(trajectories)} trajectories")
    groups = list(range(len(trajectories))) if group_ids is None else group_ids
    rows = [_Row(g, t.prompt_ids, t.completion_ids, t.sampled_mask, t.logprobs, t.policy_versions,
                 t.finish_reason or "")
            for g, t in zip(groups, trajectories)]
    return _pack(rows, pad_id, policy_version)


def _pack(rows: list[_Row], pad_id: int, policy_version: int | None) -> RolloutBatch:
    if not rows:
        raise ValueError("a RolloutBatch needs at least one completion")
    num = len(rows)
    max_prompt = max(len(r.prompt_ids) for r in rows)
    max_completion = max(1, max(len(r.completion_ids) for r in rows))
    total = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    prompt_ids = np.full((num, max_prompt), pad_id, np.int32)
    completion_ids = np.full((num, max_completion), pad_id, np.int32)
    completion_mask = np.zeros((num, max_completion), bool)
    completion_logprobs = np.zeros((num, max_completion), np.float32)
    input_ids = np.full((num, total), pad_id, np.int32)
    attention_mask = np.zeros((num, total), np.int32)
    loss_mask = np.zeros((num, total - 1), np.float32)
    logprobs = np.zeros((num, total - 1), np.float32)
    prompt_lens = np.zeros(num, np.int32)
    completion_lens = np.zeros(num, np.int32)
    versions = np.full((num, max_completion), -1, np.int32)
    for i, row in enumerate(rows):
        p, n = len(row.prompt_ids), len(row.completion_ids)
        prompt_lens[i], completion_lens[i] = p, n
        prompt_ids[i, :p] = row.prompt_ids
        completion_ids[i, :n] = row.completion_ids
        completion_mask[i, :n] = row.sampled
        input_ids[i, :p] = row.prompt_ids
        input_ids[i, p:p + n] = row.completion_ids
        attention_mask[i, :p + n] = 1
        loss_mask[i, p - 1:p - 1 + n] = row.sampled
        versions[i, :len(row.versions)] = [-1 if v is None else v for v in row.versions]
        if row.logprobs is not None:
            lp = np.array(row.logprobs, np.float32)
            completion_logprobs[i, :n] = lp
            logprobs[i, p - 1:p - 1 + n] = lp
    positions = np.broadcast_to(np.arange(total, dtype=np.int32), (num, total)).copy()
    record = _pack_record(rows, max_completion) if all(r.kept_logmass is not None for r in rows) else {}
    if all(r.routed_experts is not None for r in rows):
        routed = np.full((num, total, *rows[0].routed_experts.shape[1:]), -1, np.int32)
        for i, row in enumerate(rows):
            routed[i, :len(row.routed_experts)] = row.routed_experts
        record["routed_experts"] = routed
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_lens=prompt_lens, completion_ids=completion_ids,
        completion_mask=completion_mask, completion_logprobs=completion_logprobs, completion_lens=completion_lens,
        group_ids=np.array([r.group for r in rows], np.int32), input_ids=input_ids, positions=positions,
        attention_mask=attention_mask, loss_mask=loss_mask, logprobs=logprobs,
        finish_reasons=tuple(r.finish_reason for r in rows), policy_version=policy_version,
        completion_policy_versions=versions, pad_id=pad_id, **record)


def _pack_record(rows: list[_Row], width: int) -> dict[str, np.ndarray]:
    """The sampling record as padded arrays (see `RolloutBatch.completion_kept_logmass`)."""
    kept = max((len(ids) for r in rows for ids in r.kept_ids if ids is not None), default=0)
    logmass = np.zeros((len(rows), width), np.float32)
    ids = np.full((len(rows), width, max(kept, 1)), -1, np.int32)
    valid = np.zeros((len(rows), width), bool)
    for i, row in enumerate(rows):
        logmass[i, :len(row.kept_logmass)] = row.kept_logmass
        for t, token_ids in enumerate(row.kept_ids):
            if token_ids is not None:
                ids[i, t, :len(token_ids)] = token_ids
                valid[i, t] = True
    return dict(completion_kept_logmass=logmass, completion_kept_ids=ids, completion_kept_ids_valid=valid)
