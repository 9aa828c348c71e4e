"""Launching the verification steps whose drafts an EAGLE-3 head makes on the device, in the same program
(one draft-verify step, or several in one device loop); `ModelRunner.launch` hands them over."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
from jaxtyping import Array

from runner.sampler import SamplerOutput
from runner.step_inputs import DeviceBatch, StepBatch
from runner.step_result import PendingStep, StepResult, sampled_rows

if TYPE_CHECKING:
    from runner.model_runner import ModelRunner


def launch_draft_verify(runner: ModelRunner, batch: StepBatch, leaves: tuple[list[Array], list[Array]],
                         device_batch: DeviceBatch, rows: np.ndarray, seqs: np.ndarray, num_top: int,
                         num_kept: int = 0) -> PendingStep:
    """A verification step whose drafts the EAGLE-3 head makes in the same program."""
    num_drafts = runner.buckets.verify_rows - 1
    if runner.drafter is None or num_drafts < 1 or batch.target_ids is not None:
        raise ValueError("drafts made on the device need a draft head, verify buckets (k >= 1) and no "
                         "prompt logprobs in the step")
    if int(np.max(batch.draft_slots, initial=-1)) >= num_drafts:
        raise ValueError(f"a token asks for draft {int(np.max(batch.draft_slots))}; the head drafts {num_drafts}")
    plain_rows, floor = 0, 0.0
    if runner.draft_min_confidence > 0:
        plain_rows = runner.buckets.verify_plain_rows(device_batch.logits_indices.shape[1])
        replicas = batch.replicas if batch.replicas is not None else np.zeros(len(batch.q_lens), np.int64)
        if np.bincount(replicas).max() <= plain_rows:  # else this step always verifies
            floor = runner.draft_min_confidence
    runner.kv_caches, out, drafts, verified = runner.drafter.verify(
        leaves, runner.kv_caches, device_batch, num_top=num_top, num_steps=num_drafts, plain_rows=plain_rows,
        min_confidence=floor, num_kept=num_kept)
    k = batch.num_top_logprobs
    return PendingStep((out, drafts, verified), lambda host: dataclasses.replace(
        sampled_rows(host[0], rows, k), verified=bool(host[2]),
        draft_ids=np.asarray(host[1]).reshape(-1, num_drafts)[None, seqs]))

def launch_draft_verify_steps(runner: ModelRunner, batch: StepBatch, leaves: tuple[list[Array], list[Array]],
                               device_batch: DeviceBatch, rows: np.ndarray, seqs: np.ndarray, num_top: int,
                               num_kept: int = 0) -> PendingStep:
    """Multi-step verification (EAGLE-3, exact replay): up to `num_verify_steps` draft-verify steps."""
    num_drafts = runner.buckets.verify_rows - 1
    if runner.drafter is None or num_drafts < 1 or batch.draft_ids is not None or runner.num_verify_steps < 2:
        raise ValueError("multi-step verification needs a draft head, verify buckets (k >= 1), exact replay "
                         "and num_verify_steps >= 2")
    if np.any(batch.q_lens != num_drafts + 1):
        raise ValueError(f"multi-step verification feeds every sequence {num_drafts} drafts; got q_lens "
                         f"{batch.q_lens.tolist()}")
    steps = runner.num_verify_steps
    if int(np.max(batch.num_steps, initial=1)) > steps:
        raise ValueError(f"a sequence asks for {int(np.max(batch.num_steps))} steps; this runner runs at most {steps}")
    runner.kv_caches, out, drafts = runner.drafter.verify_steps(leaves, runner.kv_caches, device_batch, num_top=num_top,
                                                            num_steps=num_drafts, max_iters=steps, num_kept=num_kept)
    k, ran = batch.num_top_logprobs, int(np.max(batch.num_steps))  # later steps' buffers stay unwritten

    def finish(host: tuple[SamplerOutput, Array]) -> StepResult:
        out, drafts = host
        return dataclasses.replace(sampled_rows(out, rows, k, slice(None, ran)),
                                   draft_ids=np.asarray(drafts)[:ran].reshape(ran, -1, num_drafts)[:, seqs])

    return PendingStep((out, drafts), finish)
