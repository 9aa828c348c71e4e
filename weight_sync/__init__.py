"""weight_sync: move a trainer's parameters into the engine's state, validated, tensor by tensor.

    plan = weight_sync.plan(src_tree, target_state, mapping=rules)  # validate (shapes/dtypes only)
    weight_sync.apply(plan, src_tree, target_state)                  # sync; repeat with new values

`SwapPlan` repeats a sync that only swapped references (`apply(share=True)` of a tree laid out as the
target) by matching the next tree's structure and layouts in one pass.

Usable on its own by a trainer: it imports neither `runner` nor `rollout` (the HF-name presets "hf",
"hf-strict", "hf-fused" come from a model family's name table: `runner.models.registry` registers them).
"""

from weight_sync.apply import apply, unusable_leaves
from weight_sync.compiles import CompileCounter
from weight_sync.errors import WeightSyncError
from weight_sync.lora import LoraPair, merge_lora, plan_lora
from weight_sync.paths import FlatTree, flatten
from weight_sync.plan import SyncPlan, TargetOp, Transform, plan
from weight_sync.presets import identity, register, resolve
from weight_sync.rules import Rule, Split
from weight_sync.swap import SwapPlan

__all__ = [
    "CompileCounter", "FlatTree", "LoraPair", "Rule", "Split", "SwapPlan", "SyncPlan", "TargetOp", "Transform", "WeightSyncError",
    "apply", "flatten", "identity", "merge_lora", "plan", "plan_lora", "register", "resolve", "unusable_leaves",
]
