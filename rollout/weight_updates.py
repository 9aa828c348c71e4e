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
class MatchedSwap:
    """A sync that is a reference swap alone (the last shared sync's `weight_sync.SwapPlan` matched): the
    trainer's arrays, one per engine parameter in leaf order."""

    arrays: list[jax.Array]


@dataclasses.dataclass(frozen=True)
class CheckedSync:
    """A validated sync: its plans and the trees flattened once (what `WeightUpdates.write` applies)."""

    plan: weight_sync.SyncPlan
    draft_plan: weight_sync.SyncPlan | None
    source: weight_sync.FlatTree
    target: weight_sync.FlatTree
    mapping: str | tuple | list | None  # as the caller gave it


class WeightUpdates:
    """Applies new parameters to one runner in place (never reallocating, never recompiling)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._takes: dict[str, tuple[int, tuple[int, ...]]] | None = None
        # the last sync, if it only swapped references: (its mapping, its plan)
        self._swap: tuple[str | tuple | list | None, weight_sync.SwapPlan] | None = None

    def check(self, params: object, mapping: str | tuple | list | None, *, check_finite: bool = False,
              draft_params: object | None = None, draft_mapping: str | tuple | list | None = None,
              share: bool = False) -> CheckedSync | MatchedSwap:
        """Validate both trees (one error lists every problem) and plan the writes; raises
        `weight_sync.WeightSyncError` (or `ValueError`) with nothing changed if anything is wrong. With
        `share`, a tree the last shared sync's swap plan matches (same structure, every leaf in the
        engine's layout) skips the planning: the sync is a reference swap."""
        if share and self._swap is not None and draft_params is None and not check_finite:
            last_mapping, swap = self._swap
            arrays = swap.match(params) if mapping is last_mapping or mapping == last_mapping else None
            if arrays is not None:
                return MatchedSwap(arrays)
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
        problems = weight_sync.unusable_leaves(plan, src, tgt)  # (apply checks them too, after the engine drained)
        if draft_plan is not None:  # validate both before either is applied (apply checks only its own trees)
            draft_src = weight_sync.flatten(draft_params, what="source")
            problems += weight_sync.unusable_leaves(draft_plan, draft_src,
                                                    weight_sync.flatten(drafter.params, what="target"))
        if problems:
            raise weight_sync.WeightSyncError(problems)
        if draft_plan is not None and check_finite:
            reject_non_finite(draft_src, sorted({p for op in draft_plan.ops for p in op.sources}))
        return CheckedSync(plan, draft_plan, src, tgt, mapping)

    def write(self, checked: CheckedSync | MatchedSwap, draft_params: object | None = None, *,
              check_finite: bool = False, share: bool = False) -> None:
        """Write checked trees into the runner's arrays, tensor by tensor. `share`: a source array already
        laid out as the engine's becomes the engine's (a reference swap); the rest is copied. An array the
        engine shared before is the trainer's: replaced, never deleted."""
        weights, runner = self.runner.weights, self.runner
        if isinstance(checked, MatchedSwap):  # every old array was the trainer's: nothing to delete
            weights.swap(checked.arrays)
            if runner.backend.packs_weights:
                runner.weights_updated()
            return
        src = checked.source
        shared = {id(x) for x, s in zip(checked.target.leaves, weights.shared) if s}
        self._swap = None
        weight_sync.apply(checked.plan, src, checked.target, check_finite=check_finite, share=share,
                          delete_old=lambda old: id(old) not in shared)
        weights.updated()
        weights.mark_shared(src.leaves if share else [])
        if checked.draft_plan is not None:
            weight_sync.apply(checked.draft_plan, draft_params, runner.drafter.params)
        runner.weights_updated()
        if share:
            swap = weight_sync.SwapPlan.after(src, weights.leaves()[0])
            self._swap = (checked.mapping, swap) if swap is not None else None

    def _head_takes(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Per attention parameter, how the checkpoint layout expands into the stored heads (none
        unless the mesh needed padded or replicated heads); worked out once, the structure never changes."""
        if self._takes is None:
            layout = self.runner.config.head_layout
            paths = weight_sync.flatten(self.runner.params, what="target").paths if layout is not None else []
            self._takes = {p: e for p in paths if (e := layout.expansion(p)) is not None}
        return self._takes
