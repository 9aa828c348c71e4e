"""Merge LoRA adapters into the target's base weights, target by target: `W += scale * delta`.

The LoRA source holds only A/B matrices; the base weights are the target's current values.
Paths: `<module>.lora_A[.<adapter>][.weight|.kernel]` and the matching `lora_B`; leading
`base_model.model.` (PEFT) and then `model.` (HF decoder) are stripped from `<module>`, and the
target is `<module>.kernel` (an `[in, out]` kernel). Two layouts:

- `layout="jax"`: `A: [in, r]`, `B: [r, out]`, `delta = A @ B` (`[in, out]`);
- `layout="peft"`: HF/PEFT `lora_A.weight: [r, in]`, `lora_B.weight: [out, r]`,
  `delta = (B @ A).T = A.T @ B.T`.

`scale` is PEFT's `lora_alpha / r` (pass it explicitly). Each merge is one cached jitted
function with `out_shardings` = the kernel's sharding, computed in float32 and cast back to the
kernel's dtype; A and B are first replicated onto the kernel's devices (they are small). The old
kernel buffer is deleted right after, so no second copy of the model ever exists.

Merging adds to whatever the target holds: for a trainer whose adapter changes every step, first
sync the (frozen) base weights with `apply`, then `merge_lora` the new adapter — both passes are
tensor by tensor. Everything (pairs complete, shapes, ranks, NaN/Inf with `check_finite`) is
validated before anything changes; all problems come in one `WeightSyncError`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from weight_sync import transform as tf
from weight_sync.errors import WeightSyncError
from weight_sync.paths import PyTree, flatten

Layout = Literal["jax", "peft"]
_A, _B = ("lora_A", "lora_a"), ("lora_B", "lora_b")
_PREFIXES = ("base_model.model.", "model.")


@dataclasses.dataclass(frozen=True)
class LoraPair:
    """One adapter: the target kernel it updates and the source paths of its A and B matrices."""

    target: str
    a: str
    b: str


def _module_and_side(path: str) -> tuple[str, str] | None:
    comps = path.split(".")
    for i, c in enumerate(comps):
        if c in _A + _B:
            rest = comps[i + 1:]
            if rest in ([], ["weight"], ["kernel"]) or (len(rest) == 2 and rest[1] in ("weight", "kernel")):
                module = ".".join(comps[:i])
                for prefix in _PREFIXES:
                    module = module.removeprefix(prefix)
                return module, "a" if c in _A else "b"
    return None


def _merge(w: Float[Array, "i o"], a: Float[Array, "..."], b: Float[Array, "..."], scale: Float[Array, ""],
           peft: bool) -> Float[Array, "i o"]:
    delta = (a.T.astype(jnp.float32) @ b.T.astype(jnp.float32)) if peft else (
        a.astype(jnp.float32) @ b.astype(jnp.float32))
    return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)


_JITTED: dict[tuple[bool, jax.sharding.Sharding], jax.stages.Wrapped] = {}


def _replicated(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    devices = sorted(sharding.device_set, key=lambda d: d.id)
    if len(devices) == 1:
        return jax.sharding.SingleDeviceSharding(devices[0])
    return jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), ("d",)), jax.sharding.PartitionSpec())


def plan_lora(lora_tree: PyTree, target_state: PyTree, *, layout: Layout = "jax") -> tuple[LoraPair, ...]:
    """Pair up A/B matrices with target kernels and check shapes; raise one error listing all problems."""
    if layout not in ("jax", "peft"):
        raise ValueError(f"layout must be 'jax' or 'peft', got {layout!r}")
    src, tgt = flatten(lora_tree, what="LoRA source"), flatten(target_state, what="target")
    t_shape = {p: tuple(x.shape) for p, x in zip(tgt.paths, tgt.leaves)}
    s_shape = {p: tuple(x.shape) for p, x in zip(src.paths, src.leaves)}
    problems: list[str] = []
    sides: dict[str, dict[str, str]] = {}
    for p in src.paths:
        ms = _module_and_side(p)
        if ms is None:
            problems.append(f"LoRA source {p!r} is neither a lora_A nor a lora_B matrix")
            continue
        ab = sides.setdefault(ms[0], {})
        if ms[1] in ab:  # e.g. PEFT's lora_A.default and lora_A.other on one module
            problems.append(f"LoRA for {ms[0]!r} has several {ms[1].upper()} matrices ({ab[ms[1]]!r}, {p!r}): "
                            "merge one adapter per call")
            continue
        ab[ms[1]] = p
    pairs: list[LoraPair] = []
    for module, ab in sides.items():
        target = f"{module}.kernel"
        if set(ab) != {"a", "b"}:
            problems.append(f"LoRA for {module!r} has only {list(ab.values())} (needs both A and B)")
            continue
        if target not in t_shape:
            problems.append(f"LoRA {list(ab.values())} targets {target!r}, which the target lacks")
            continue
        sa, sb, sw = s_shape[ab["a"]], s_shape[ab["b"]], t_shape[target]
        if layout == "peft":
            sa, sb = sa[::-1], sb[::-1]  # as [in, r] / [r, out]
        if len(sa) != 2 or len(sb) != 2 or len(sw) != 2 or sa[1] != sb[0] or (sa[0], sb[1]) != sw:
            problems.append(f"LoRA {ab['a']!r} {list(s_shape[ab['a']])} / {ab['b']!r} {list(s_shape[ab['b']])} "
                            f"({layout} layout) do not fit {target!r} {list(sw)}")
            continue
        pairs.append(LoraPair(target, ab["a"], ab["b"]))
    if problems:
        raise WeightSyncError(problems, header="LoRA merge refused")
    return tuple(pairs)


def merge_lora(lora_tree: PyTree, target_state: PyTree, *, scale: float, layout: Layout = "jax",
               check_finite: bool = False) -> PyTree:
    """Merge every adapter in `lora_tree` into `target_state` (in place for NNX; new tree for dicts)."""
    pairs = plan_lora(lora_tree, target_state, layout=layout)
    src, tgt = flatten(lora_tree, what="LoRA source"), flatten(target_state, what="target")
    s_idx, t_idx = src.index(), tgt.index()
    if check_finite:
        paths = [p for pair in pairs for p in (pair.a, pair.b)]
        flags = tf.finite_flags([src.leaves[s_idx[p]] for p in paths])
        bad = [f"LoRA source {p!r} contains NaN or Inf" for p, ok in zip(paths, flags) if not ok]
        if bad:
            raise WeightSyncError(bad, header="LoRA merge refused")
    new_leaves = list(tgt.leaves)
    for pair in pairs:
        i = t_idx[pair.target]
        old = tgt.leaves[i]
        rep = _replicated(old.sharding)
        a = jax.device_put(src.leaves[s_idx[pair.a]], rep)
        b = jax.device_put(src.leaves[s_idx[pair.b]], rep)
        key = (layout == "peft", old.sharding)
        fn = _JITTED.get(key)
        if fn is None:
            fn = _JITTED[key] = jax.jit(lambda w, a, b, s, _p=key[0]: _merge(w, a, b, s, _p), out_shardings=old.sharding)
        new = fn(old, a, b, jnp.float32(scale))
        if tgt.variables[i] is not None:
            tgt.variables[i].set_value(new)
        new_leaves[i] = new
        old.delete()
    if all(v is not None for v in tgt.variables):
        return target_state
    leaves = [v if v is not None else x for v, x in zip(tgt.variables, new_leaves)]
    return jax.tree_util.tree_unflatten(tgt.treedef, leaves)
