"""Packing `RequestOutput`s into a `RolloutBatch` of padded arrays for a jitted policy-gradient loss."""

from __future__ import annotations

import numpy as np

from rollout.outputs import RequestOutput, RolloutBatch


def build_rollout_batch(outputs: list[RequestOutput], *, pad_id: int, policy_version: int | None) -> RolloutBatch:
    """One row per completion, prompt-major; completions without logprobs get zeros there."""
    rows = [(g, out.prompt_token_ids, c) for g, out in enumerate(outputs) for c in out.outputs]
    num = len(rows)
    max_prompt = max(len(p) for _, p, _ in rows)
    max_completion = max(1, max(len(c.token_ids) for _, _, c in rows))
    total = max(len(p) + len(c.token_ids) for _, p, c in rows)
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
    for r, (_, prompt, c) in enumerate(rows):
        p, n = len(prompt), len(c.token_ids)
        prompt_lens[r], completion_lens[r] = p, n
        prompt_ids[r, :p] = prompt
        completion_ids[r, :n] = c.token_ids
        completion_mask[r, :n] = True
        input_ids[r, :p] = prompt
        input_ids[r, p:p + n] = c.token_ids
        attention_mask[r, :p + n] = 1
        loss_mask[r, p - 1:p - 1 + n] = 1.0
        versions[r, :len(c.policy_versions)] = [-1 if v is None else v for v in c.policy_versions]
        if c.logprobs is not None:
            lp = np.array([t.logprob for t in c.logprobs], np.float32)
            completion_logprobs[r, :n] = lp
            logprobs[r, p - 1:p - 1 + n] = lp
    positions = np.broadcast_to(np.arange(total, dtype=np.int32), (num, total)).copy()
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_lens=prompt_lens, completion_ids=completion_ids,
        completion_mask=completion_mask, completion_logprobs=completion_logprobs, completion_lens=completion_lens,
        group_ids=np.array([g for g, _, _ in rows], np.int32), input_ids=input_ids, positions=positions,
        attention_mask=attention_mask, loss_mask=loss_mask, logprobs=logprobs,
        finish_reasons=tuple(c.finish_reason or "" for _, _, c in rows), policy_version=policy_version,
        completion_policy_versions=versions, pad_id=pad_id)
