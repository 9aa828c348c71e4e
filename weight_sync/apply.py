"""Carry out a validated `SyncPlan`: target by target, straight into the target's sharding.

For each target tensor (in target order):

- trivial op (same layout and dtype) on device: `jax.device_put(x, target.sharding,
  may_alias=False)`, copied once more when the result still holds one of the source's buffers
  (a replicated target reuses the source's shard on its device) — a fresh copy, so the engine
  never shares a buffer with the trainer (which may donate or delete its own); unless `share=True`
  and the source is already in the target's sharding: then the target is the source array itself
  (a reference swap: no bytes move, no device work);
- host (numpy) sources: transform with numpy, then `jax.device_put` to the target sharding;
- device sources on the target's devices: one cached jitted transform with
  `out_shardings=target.sharding`;
- device sources on other devices (another mesh): the cached jitted transform runs where the
  source lives, then `jax.device_put` reshards the result onto the target's devices and the
  temporary is deleted. Each device set so holds at most one extra tensor at a time.

The new array replaces the old one (an NNX Variable's value is set in place; a plain dict target
gets a new tree back) and the old buffer is deleted at once unless a source array is that very
object or `delete_old` says not to (an array the target shared with an earlier source is not its to
delete). Peak extra memory is therefore about one tensor, and shapes, dtypes and shardings of the
target never change, so jitted engine steps are reused.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from weight_sync import transform as tf
from weight_sync.errors import WeightSyncError
from weight_sync.paths import FlatTree, PyTree, flatten
from weight_sync.plan import SyncPlan, TargetOp, fingerprint


def check_structure(plan: SyncPlan, src: FlatTree, tgt: FlatTree) -> None:
    """Raise unless the trees have exactly the structure the plan was built for."""
    if fingerprint(plan.rules, src, tgt) != plan.fingerprint:
        raise WeightSyncError(["the trees' structure (paths, shapes or dtypes) differs from the one "
                               "this plan was built for; build a new plan with weight_sync.plan()"])


def reject_non_finite(src: FlatTree, paths: list[str]) -> None:
    """Raise, listing every offender, if any of the named source tensors holds NaN or Inf."""
    idx = src.index()
    flags = tf.finite_flags([src.leaves[idx[p]] for p in paths])
    bad = [f"source {p!r} contains NaN or Inf" for p, ok in zip(paths, flags) if not ok]
    if bad:
        raise WeightSyncError(bad)


@functools.cache
def _dtype_name(dtype: np.dtype) -> str:
    return str(jnp.dtype(dtype))


def produce(xs: list[jax.Array | np.ndarray], op: TargetOp, sharding: jax.sharding.Sharding, *,
            share: bool = False) -> jax.Array:
    """The op's target tensor, laid out in `sharding` (see the module docstring)."""
    t = op.transform
    if all(isinstance(x, np.ndarray) for x in xs):
        return jax.device_put(tf.on_host(xs, t), sharding)
    xs = [jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in xs]
    trivial = len(xs) == 1 and t.is_trivial(_dtype_name(xs[0].dtype))
    if share and trivial and (xs[0].sharding == sharding or xs[0].sharding.is_equivalent_to(sharding, xs[0].ndim)):
        return xs[0]
    if trivial:
        out = jax.device_put(xs[0], sharding, may_alias=False)
        return jnp.copy(out) if _shares_buffers(out, xs[0]) else out
    if all(x.sharding.device_set == sharding.device_set for x in xs):
        return tf.jitted(t, sharding)(*xs)
    tmp = tf.jitted(t, None)(*xs)
    out = jax.device_put(tmp, sharding)
    if out is not tmp:
        tmp.delete()
    return out


def _shares_buffers(a: jax.Array, b: jax.Array) -> bool:
    """Whether `a` holds one of `b`'s buffers: `device_put(may_alias=False)` onto a replicated sharding
    reuses the source's shard on its own device (JAX 0.10.2), and deleting the engine's copy later
    would delete the trainer's array."""
    ours = {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}
    return any(s.data.unsafe_buffer_pointer() in ours for s in b.addressable_shards)


def unusable_leaves(plan: SyncPlan, src: FlatTree, tgt: FlatTree) -> list[str]:
    """One problem per leaf `apply` cannot use: a `jax.ShapeDtypeStruct` on either side (`plan` accepts them,
    it needs shapes only) or a source array the plan reads that was deleted or donated. Callers applying
    several plans together check them all first, so that none is applied when another would fail."""
    read = {p for op in plan.ops for p in op.sources}
    return ([f"{what} {p!r} is a ShapeDtypeStruct: apply needs real arrays" for what, f in
             (("source", src), ("target", tgt)) for p, x in zip(f.paths, f.leaves)
             if isinstance(x, jax.ShapeDtypeStruct)]
            + [f"source {p!r} was deleted or donated (a jitted update with donate_argnums deletes its inputs): "
               "pass the update's outputs" for p, x in zip(src.paths, src.leaves)
               if p in read and isinstance(x, jax.Array) and x.is_deleted()])


def apply(plan: SyncPlan, src_tree: PyTree | FlatTree, target_state: PyTree | FlatTree, *, check_finite: bool = False,
          delete_old: bool | Callable[[jax.Array], bool] = True, share: bool = False,
          on_tensor: Callable[[str], None] | None = None) -> PyTree:
    """Sync `src_tree` into `target_state` following `plan`; returns the updated target.

    An `nnx.State` (or any tree of NNX Variables) is updated in place and returned; a tree of
    plain arrays is left as is and a new tree is returned (its old buffers are deleted unless
    `delete_old` is False, or returns False for them). `share=True`: a target the source fills as it is
    becomes the source array (no copy). `check_finite=True` rejects NaN/Inf in any used source before
    anything changes. `on_tensor(path)` is called right after each new target tensor exists and before
    the old buffer is freed (the moment of peak memory; used by the benchmark). Either tree may come
    flattened already (`flatten`).
    """
    src, tgt = flatten(src_tree, what="source"), flatten(target_state, what="target")
    check_structure(plan, src, tgt)
    if unusable := unusable_leaves(plan, src, tgt):
        raise WeightSyncError(unusable)
    if check_finite:
        reject_non_finite(src, sorted({p for op in plan.ops for p in op.sources}))
    s_idx, t_idx = src.index(), tgt.index()
    source_ids = {id(x) for x in src.leaves}
    new_leaves: list[jax.Array] = list(tgt.leaves)
    for op in plan.ops:
        i = t_idx[op.target]
        old = tgt.leaves[i]
        new = produce([src.leaves[s_idx[p]] for p in op.sources], op, old.sharding, share=share)
        if on_tensor is not None:
            on_tensor(op.target)
        var = tgt.variables[i]
        if var is not None:
            var.set_value(new)
        new_leaves[i] = new
        ours = delete_old(old) if callable(delete_old) else delete_old
        if ours and new is not old and id(old) not in source_ids and isinstance(old, jax.Array):
            old.delete()
    if all(v is not None for v in tgt.variables):
        return target_state
    leaves = [v if v is not None else x for v, x in zip(tgt.variables, new_leaves)]
    return jax.tree_util.tree_unflatten(tgt.treedef, leaves)
