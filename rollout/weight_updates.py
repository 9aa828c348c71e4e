"""`WeightUpdates`: a trainer's parameters (and an EAGLE-3 head's) validated and written into one runner's
device state through `weight_sync`, every check before any array changes. The engine core's
`sync_weights` drives it between steps (`rollout.engine_core`)."""

from __future__ import annotations

import dataclasses

import jax

import weight_sync
import weight_sync.presets
from weight_sync.apply import reject_non_finite

from runner.model_runner import ModelRunner
from runner.models.registry import get_family


@dataclasses.dataclass(frozen=True)
class CheckedSync:
    """A validated sync: its plans and the trees flattened once (what `WeightUpdates.write` applies)."""

    plan: weight_sync.SyncPlan
    draft_plan: weight_sync.SyncPlan | None
    source: weight_sync.FlatTree
    target: weight_sync.FlatTree


class WeightUpdates:
    """Applies new parameters to one runner in place (never reallocating, never recompiling)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._takes: dict[str, tuple[int, tuple[int, ...]]] | None = None

    def check(self, params: object, mapping: str | tuple | list | None, *, check_finite: bool = False,
              draft_params: object | None = None, draft_mapping: str | tuple | list | None = None
              ) -> CheckedSync:
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
            src, tgt = weight_sync.flatten(params, what="source"), weight_sync.flatten(runner.params, what="target")
            plan = weight_sync.plan(src, tgt, mapping, takes=takes)  # cached per structure
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
            problems = (weight_sync.abstract_leaves(src, tgt)
                        + weight_sync.abstract_leaves(draft_src, flat(drafter.params, what="target")))
            if problems:
                raise weight_sync.WeightSyncError(problems)
            if check_finite:
                reject_non_finite(draft_src, sorted({p for op in draft_plan.ops for p in op.sources}))
        return CheckedSync(plan, draft_plan, src, tgt)

    def write(self, checked: CheckedSync, draft_params: object | None = None, *, check_finite: bool = False,
              share: bool = False) -> None:
        """Write checked trees into the runner's arrays, tensor by tensor. `share`: a source array already
        laid out as the engine's becomes the engine's (a reference swap); the rest is copied. An array the
        engine shared before is the trainer's: replaced, never deleted."""
        weights, src = self.runner.weights, checked.source
        shared = {id(x) for x, s in zip(checked.target.leaves, weights.shared) if s}
        weight_sync.apply(checked.plan, src, checked.target, check_finite=check_finite, share=share,
                          delete_old=lambda old: id(old) not in shared)
        weights.mark_shared(src.leaves if share else [])
        if checked.draft_plan is not None:
            weight_sync.apply(checked.draft_plan, draft_params, self.runner.drafter.params)
        self.runner.weights_updated()

    def _head_takes(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Per attention parameter, how the checkpoint layout expands into the stored heads (none
        unless the mesh needed padded or replicated heads); worked out once, the structure never changes."""
        if self._takes is None:
            layout = self.runner.config.head_layout
            paths = weight_sync.flatten(self.runner.params, what="target").paths if layout is not None else []
            self._takes = {p: e for p in paths if (e := layout.expansion(p)) is not None}
        return self._takes
