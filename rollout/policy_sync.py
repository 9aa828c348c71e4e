"""Weight syncs: `WeightUpdater` validates and applies a trainer's parameters (and an EAGLE-3 head's) to
the runner's device state through `weight_sync`, all checks before any array changes; `PolicyUpdates`
is the engine core's `sync_weights` (between steps, with requests running) and its staleness bound."""

from __future__ import annotations

import jax

import weight_sync
import weight_sync.presets
from weight_sync.apply import reject_non_finite

from runner.model_runner import ModelRunner
from runner.models.registry import get_family

from rollout.request import request_output


class WeightUpdater:
    """Applies new parameters to one runner in place (never reallocating, never recompiling)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._takes: dict[str, tuple[int, tuple[int, ...]]] | None = None

    def check(self, params: object, mapping: str | tuple | list | None, *, check_finite: bool = False,
              draft_params: object | None = None, draft_mapping: str | tuple | list | None = None
              ) -> tuple[weight_sync.SyncPlan, weight_sync.SyncPlan | None]:
        """Validate both trees (one error lists every problem) and plan the writes; raises
        `weight_sync.WeightSyncError` (or `ValueError`) with nothing changed if anything is wrong."""
        runner = self.runner
        drafter = runner.drafter
        if draft_params is not None and drafter is None:
            raise ValueError("draft_params were given but this engine has no EAGLE-3 head "
                             "(build it with speculative=Eagle3Config(...))")
        if isinstance(mapping, str) and mapping in weight_sync.presets.FAMILY_PRESETS:  # this model's names
            mapping = get_family(runner.config.family).sync_rules(mapping, runner.config.num_experts)
        try:
            takes = self._head_takes()  # trainer-layout attention tensors into padded / replicated heads
            plan = weight_sync.plan(params, runner.params, mapping, takes=takes)  # cached per structure
            draft_plan = None if draft_params is None else weight_sync.plan(draft_params, drafter.params, draft_mapping)
        except weight_sync.WeightSyncError as err:
            problems = list(err.problems)
            if check_finite:  # one error lists every problem: the NaN/Inf sources too
                try:
                    src = weight_sync.flatten(params, what="source")
                    reject_non_finite(src, [p for p, x in zip(src.paths, src.leaves)
                                            if not isinstance(x, jax.ShapeDtypeStruct)])
                except weight_sync.WeightSyncError as nan_err:
                    problems += [p for p in nan_err.problems if p not in problems]
            raise weight_sync.WeightSyncError(problems) from None
        if draft_plan is not None:  # validate both before either is applied (apply checks only its own trees)
            draft_src = weight_sync.flatten(draft_params, what="source")
            flat = weight_sync.flatten
            problems = (weight_sync.abstract_leaves(flat(params, what="source"), flat(runner.params, what="target"))
                        + weight_sync.abstract_leaves(draft_src, flat(drafter.params, what="target")))
            if problems:
                raise weight_sync.WeightSyncError(problems)
            if check_finite:
                reject_non_finite(draft_src, sorted({p for op in draft_plan.ops for p in op.sources}))
        return plan, draft_plan

    def write(self, plans: tuple[weight_sync.SyncPlan, weight_sync.SyncPlan | None], params: object,
              draft_params: object | None = None, *, check_finite: bool = False) -> None:
        """Write checked trees into the runner's arrays, tensor by tensor."""
        plan, draft_plan = plans
        weight_sync.apply(plan, params, self.runner.params, check_finite=check_finite)
        if draft_plan is not None:
            weight_sync.apply(draft_plan, draft_params, self.runner.drafter.params)

    def _head_takes(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Per attention parameter, how the checkpoint layout expands into the stored heads (none
        unless the mesh needed padded or replicated heads); worked out once, the structure never changes."""
        if self._takes is None:
            layout = self.runner.config.head_layout
            paths = weight_sync.flatten(self.runner.params, what="target").paths if layout is not None else []
            self._takes = {p: e for p in paths if (e := layout.expansion(p)) is not None}
        return self._takes


class PolicyUpdates:
    """The engine core's weight-sync half (`EngineCore` inherits it): it uses the core's `weights`,
    `runner`, `scheduler`, `block_manager`, `requests`, `config`, `stats_`, `policy_version`, `_drain`,
    `_forget`, `_deferred`, `_in_step` and `tokenizer`."""

    def sync_weights(self, params: object, mapping: str | tuple | list | None = None, *,
                     version: int | None = None, check_finite: bool = False,
                     draft_params: object | None = None, draft_mapping: str | tuple | list | None = None,
                     recompute_running: bool = False) -> None:
        """Put new policy parameters into the engine in place: no reload, no recompilation. Legal
        between any two steps, with requests running.

        `params` is the trainer's pytree: an `nnx.State` of this model class (mapping None), HF
        names and `[out, in]` layouts (mapping "hf"), or any tree with a `weight_sync` rule list.
        `draft_params`: new EAGLE-3 head weights in the same call (an `nnx.State` of the head, or the
        published layout with `draft_mapping="eagle3-hf"`); the head's shared embedding / lm_head
        are the policy's own arrays, so they follow `params` without being passed.
        Everything is validated first (one error lists every problem, weights untouched). The KV
        cache allocation is kept; cached prefixes are dropped (their K/V came from old weights).
        Running requests go on under the new weights: by default they keep the K/V computed so far
        (PipelineRL's in-flight update); `recompute_running=True` recomputes it under the new weights
        first (their tokens so far are kept). Tokens sampled from now on record `version` (default:
        previous version + 1).
        """
        if self._in_step:
            raise RuntimeError("sync_weights() was called inside an engine step (while generate() is running "
                               "one, say); call it between steps")
        if self.runner.released:
            raise RuntimeError("sync_weights() while the engine is asleep: call wake() first")
        plans = self.weights.check(params, mapping, check_finite=check_finite, draft_params=draft_params,
                                   draft_mapping=draft_mapping)
        self._drain()  # tokens of a call launched ahead were sampled under the old weights
        try:
            self.weights.write(plans, params, draft_params, check_finite=check_finite)
            self.runner.weights_updated()
        finally:  # even a sync that failed part way (device memory) may have changed weights
            self.block_manager.invalidate_prefix_cache()
        self.policy_version = version if version is not None else (self.policy_version or 0) + 1
        if recompute_running:
            for seq in sorted(self.scheduler.running, key=lambda s: -s.arrival):
                self.scheduler.preempt(seq, count=False)
                seq.admitted_version = self.policy_version  # its policy lag counts from here
        self.stats_.num_weight_syncs += 1
        self._bound_policy_lag()

    def _bound_policy_lag(self) -> None:
        """`EngineConfig.max_policy_lag`: samples that began more versions ago (version None counts as 0)
        are aborted (their outputs wait for `step()`) or recomputed under the weights just synced."""
        bound, now = self.config.max_policy_lag, self.policy_version
        if bound is None:
            return
        for seq in [s for s in [*self.scheduler.running, *self.scheduler.waiting] if not s.is_finished]:
            if not seq.num_output_tokens and seq not in self.scheduler.running:
                seq.admitted_version = now  # not begun yet: its lag starts now
            if now - (seq.admitted_version or 0) <= bound:
                continue
            if self.config.policy_lag_action == "recompute":
                if seq in self.scheduler.running:
                    self.scheduler.preempt(seq, count=False)
                seq.admitted_version = now
                self.stats_.num_lag_recomputes += 1
            else:
                self.scheduler.abort([seq])
                seq.finish_reason = "abort"
                self.stats_.num_lag_aborts += 1
        for rid, req in list(self.requests.items()):
            if req.finished:
                self._deferred.append(request_output(req, self.tokenizer, kind="cumulative"))
                self._forget(req)

