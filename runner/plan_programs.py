"""The runner's one table (`PROGRAMS`): for each plan kind, the bucket shape its plan is padded to and how
it is launched (which compiled program runs, and how its outputs become a `StepResult`).

A launcher gets the runner's programs (`Programs`), the KV caches and the padded inputs (`Launch`), and
returns the new caches and the `PendingStep`; `runner.model_runner.ModelRunner.launch` keeps the caches.
Runners with an EAGLE-3 head run its programs (`runner.spec_decode.eagle3_drafter`) for every kind: the
head's cache follows every target step, and verification drafts on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from jaxtyping import Array

from runner.buckets import BucketConfig
from runner.device_weights import Leaves
from runner.executable_store import StoredProgram
from runner.models.family import KVCaches
from runner.sampler import SamplerOutput
from runner.spec_decode.eagle3_drafter import Eagle3Drafter
from runner.step_padding import BucketShape, DeviceBatch, ReplicaLayout, decode_shape, ragged_shape, verify_shape
from runner.step_plan import PlanKind, StepPlan
from runner.step_result import PendingStep, StepResult, sampled_rows



@dataclasses.dataclass(frozen=True)
class Programs:
    """A runner's compiled programs and the settings launching them reads."""

    step: StoredProgram  # one step (ragged, or verification of host drafts): `runner.step_program._step`
    loop: StoredProgram  # a decode loop: `runner.step_program._decode_chunk`
    drafter: Eagle3Drafter | None
    buckets: BucketConfig
    no_feed: Array  # what a decode loop reads its fed tokens from when none are fed (fixed size)
    num_scheduler_steps: int
    num_verify_steps: int
    draft_min_confidence: float
    record_routing: bool


@dataclasses.dataclass(frozen=True)
class Launch:
    """One plan's inputs to a launcher."""

    plan: StepPlan
    batch: DeviceBatch  # padded (numpy, or on the mesh)
    layout: ReplicaLayout
    leaves: Leaves
    num_top: int  # top logprobs the program computes (the engine's usual k, or the whole vocabulary)
    num_kept: int  # kept ids per row of the sampling record (0: none)
    after: PendingStep | None = None  # the decode loop whose last tokens a decode loop launched ahead reads


Launcher = Callable[[Programs, KVCaches, Launch], tuple[KVCaches, PendingStep]]


def launch_step(p: Programs, kv: KVCaches, x: Launch) -> tuple[KVCaches, PendingStep]:
    """One step of the plain program: a ragged step, or the verification of drafts made on the host."""
    kv, out, extra, aux = p.step(*x.leaves, kv, x.batch, num_top=x.num_top,
                                 token_logprobs=x.plan.tokens.target_ids is not None,
                                 aux_layers=p.drafter.aux_layers if p.drafter is not None else (), num_kept=x.num_kept,
                                 record_routing=p.record_routing)
    if p.drafter is not None:  # the head's cache follows every target step, on the device
        p.drafter.fill(x.leaves, aux, x.batch)
    k, tokens = x.plan.sampling.num_top_logprobs, x.layout.token_index

    def finish(host: tuple[SamplerOutput, SamplerOutput | None]) -> StepResult:
        out, extra = host
        result = sampled_rows(out, x.layout.row_index, k)
        if out.routed_experts is not None:
            result = dataclasses.replace(result, routed_experts=out.routed_experts[tokens][None])
        if extra is not None:
            result = dataclasses.replace(
                result, token_logprobs=extra.logprobs[tokens], token_top_ids=extra.top_ids[tokens, :k],
                token_top_logprobs=extra.top_logprobs[tokens, :k])
        return result

    return kv, PendingStep((out, extra), finish)


def launch_decode_loop(p: Programs, kv: KVCaches, x: Launch) -> tuple[KVCaches, PendingStep]:
    """A decode loop: up to `num_scheduler_steps` steps of one row per sequence."""
    loop = x.plan.loop
    if int(np.max(loop.num_steps, initial=1)) > p.num_scheduler_steps:
        raise ValueError(f"a sequence asks for {int(np.max(loop.num_steps))} steps; this runner runs at most "
                         f"{p.num_scheduler_steps}")
    if (loop.feed_rows is None) != (x.after is None or x.after.last_tokens is None):
        raise ValueError("feed_rows need the decode loop they read from (`after`), and only then")
    last = None
    if p.drafter is not None:  # the head's cache follows every step
        if loop.feed_rows is not None:
            raise ValueError("a decode loop with a draft head cannot take its tokens from the previous call")
        kv, out = p.drafter.decode_chunk(x.leaves, kv, x.batch, num_top=x.num_top, max_steps=p.num_scheduler_steps,
                                         num_kept=x.num_kept)
    else:
        fed = x.after.last_tokens if x.after is not None else p.no_feed
        kv, out, last = p.loop(*x.leaves, kv, x.batch, fed, num_top=x.num_top, max_steps=p.num_scheduler_steps,
                               num_kept=x.num_kept, record_routing=p.record_routing)
    k, rows = x.plan.sampling.num_top_logprobs, x.layout.row_index
    return kv, PendingStep((out,), lambda host: sampled_rows(host[0], rows, k, slice(None)), rows=rows, last_tokens=last)


def launch_verify(p: Programs, kv: KVCaches, x: Launch) -> tuple[KVCaches, PendingStep]:
    """A verification step: of host drafts in the plain program, or (with a head) of drafts it makes in
    the same program, which decodes plainly instead when the head is unsure (`Eagle3Config.min_confidence`)."""
    if p.drafter is None:
        return launch_step(p, kv, x)
    plan, num_drafts = x.plan, p.buckets.verify_rows - 1
    if num_drafts < 1 or plan.tokens.target_ids is not None or plan.drafts.draft_slots is None:
        raise ValueError("drafts made on the device need verify buckets (k >= 1), draft slots and no prompt "
                         "logprobs in the step")
    if int(np.max(plan.drafts.draft_slots, initial=-1)) >= num_drafts:
        raise ValueError(f"a token asks for draft {int(np.max(plan.drafts.draft_slots))}; the head drafts {num_drafts}")
    plain_rows, floor = 0, 0.0
    if p.draft_min_confidence > 0:
        plain_rows = p.buckets.verify_plain_rows(x.batch.logits_indices.shape[1])
        replicas = plan.tokens.replicas if plan.tokens.replicas is not None else np.zeros(plan.num_seqs, np.int64)
        if np.bincount(replicas).max() <= plain_rows:  # else this step always verifies
            floor = p.draft_min_confidence
    kv, out, drafts, verified = p.drafter.verify(x.leaves, kv, x.batch, num_top=x.num_top, num_steps=num_drafts,
                                                 plain_rows=plain_rows, min_confidence=floor, num_kept=x.num_kept)
    k, rows, seqs = plan.sampling.num_top_logprobs, x.layout.row_index, x.layout.seq_index
    return kv, PendingStep((out, drafts, verified), lambda host: dataclasses.replace(
        sampled_rows(host[0], rows, k), verified=bool(host[2]),
        draft_ids=np.asarray(host[1]).reshape(-1, num_drafts)[None, seqs]))


def launch_verify_loop(p: Programs, kv: KVCaches, x: Launch) -> tuple[KVCaches, PendingStep]:
    """Up to `num_verify_steps` draft-verify steps in one device loop (EAGLE-3, exact replay)."""
    plan, num_drafts = x.plan, p.buckets.verify_rows - 1
    if p.drafter is None or num_drafts < 1 or p.num_verify_steps < 2:
        raise ValueError("a verification loop needs a draft head, verify buckets (k >= 1) and num_verify_steps >= 2")
    if np.any(plan.tokens.q_lens != num_drafts + 1):
        raise ValueError(f"a verification loop feeds every sequence {num_drafts} drafts; got q_lens "
                         f"{plan.tokens.q_lens.tolist()}")
    ran = int(np.max(plan.loop.num_steps))  # later steps' buffers stay unwritten
    if ran > p.num_verify_steps:
        raise ValueError(f"a sequence asks for {ran} steps; this runner runs at most {p.num_verify_steps}")
    kv, out, drafts = p.drafter.verify_steps(x.leaves, kv, x.batch, num_top=x.num_top, num_steps=num_drafts,
                                             max_iters=p.num_verify_steps, num_kept=x.num_kept)
    k, rows, seqs = plan.sampling.num_top_logprobs, x.layout.row_index, x.layout.seq_index

    def finish(host: tuple[SamplerOutput, Array]) -> StepResult:
        out, drafts = host
        return dataclasses.replace(sampled_rows(out, rows, k, slice(None, ran)),
                                   draft_ids=np.asarray(drafts)[:ran].reshape(ran, -1, num_drafts)[:, seqs])

    return kv, PendingStep((out, drafts), finish)


@dataclasses.dataclass(frozen=True)
class PlanProgram:
    """How one plan kind runs: its bucket shape and its launcher."""

    shape: BucketShape
    launch: Launcher


PROGRAMS: dict[PlanKind, PlanProgram] = {
    "ragged": PlanProgram(ragged_shape, launch_step),
    "decode_loop": PlanProgram(decode_shape, launch_decode_loop),
    "verify": PlanProgram(verify_shape, launch_verify),
    "verify_loop": PlanProgram(verify_shape, launch_verify_loop),
}
