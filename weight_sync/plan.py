"""Validate a sync up front, from shapes and dtypes only, and record it as a cacheable plan.

`plan(src_tree, target_state, mapping)` matches every source leaf against the mapping, works out
each target tensor's recipe (`TargetOp`) and checks all of it without touching any value (so
`jax.ShapeDtypeStruct` leaves work on both sides). Every problem is collected and raised in one
`WeightSyncError`: unmapped source leaves, sources mapped to unknown targets, incomplete concat
groups, unfilled targets, targets filled twice, shape mismatches after the transform and
disallowed casts. Plans are frozen and carry a structural fingerprint (rules + every leaf's
path, shape, dtype on both sides); `plan()` keeps a small cache keyed by it, so repeated syncs of
the same structure reuse one plan.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Mapping

import jax.numpy as jnp
import numpy as np

from weight_sync.errors import WeightSyncError
from weight_sync.paths import FlatTree, PyTree, flatten
from weight_sync.presets import MappingLike, resolve
from weight_sync.rules import Rule, substitute

Shape = tuple[int, ...]
Take = tuple[int, tuple[int, ...]]  # (axis, index into the source's axis of every target entry; -1 = zero)


@dataclasses.dataclass(frozen=True)
class Transform:
    """How one target tensor is computed from its source tensor(s) (order: see `rules`)."""

    concat_axis: int | None
    transpose: tuple[int, ...] | None
    reshape: Shape | None
    split_axis: int | None
    split_start: int
    split_size: int
    dtype: str  # the target's dtype: the result is always cast to it
    take: Take | None = None  # last: rows / columns of the target picked from the result (see `plan`)
    stack: bool = False  # the sources are stacked along a new axis `concat_axis` (not concatenated)

    def is_trivial(self, src_dtype: str) -> bool:
        """True when the target is the (single) source as is: a plain device_put suffices."""
        return (self.concat_axis is None and self.transpose is None and self.reshape is None
                and self.split_axis is None and self.take is None and self.dtype == src_dtype)


@dataclasses.dataclass(frozen=True)
class TargetOp:
    """One target tensor: its path, the source paths it reads and the transform."""

    target: str
    sources: tuple[str, ...]
    transform: Transform
    rule_index: int


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    """A validated sync: one op per target tensor, plus the sources deliberately dropped."""

    ops: tuple[TargetOp, ...]
    dropped: tuple[str, ...]
    rules: tuple[Rule, ...]
    fingerprint: tuple[object, ...]


def fingerprint(rules: tuple[Rule, ...], src: FlatTree, tgt: FlatTree) -> tuple[object, ...]:
    """The structure a plan is for: the rules plus the paths, shapes and dtypes of every leaf on both sides
    (a hashable tuple: comparing and hashing it is cheap enough for every sync)."""
    return rules, src.signature(), tgt.signature()


def _dtype_problem(src: str, dst: str) -> str | None:
    s, d = jnp.dtype(src), jnp.dtype(dst)
    if s == d or (jnp.issubdtype(s, jnp.floating) and jnp.issubdtype(d, jnp.floating)):
        return None
    if jnp.issubdtype(s, jnp.integer) and jnp.issubdtype(d, jnp.integer) and np.can_cast(s, d, "safe"):
        return None
    return f"cannot cast {src} to {dst}"


def _shape_after(shapes: list[Shape], rule: Rule) -> tuple[Shape | None, str | None]:
    """Shape after concat -> transpose -> reshape (before split), or an error message."""
    shape = shapes[0]
    if rule.stack:
        ax = rule.concat
        if any(s != shape for s in shapes) or not -len(shape) - 1 <= ax <= len(shape):
            return None, f"cannot stack shapes {shapes} on a new axis {ax}"
        ax %= len(shape) + 1
        shape = shape[:ax] + (len(shapes),) + shape[ax:]
    elif rule.concat is not None:
        ax = rule.concat
        if any(len(s) != len(shape) for s in shapes) or not -len(shape) <= ax < len(shape):
            return None, f"cannot concat shapes {shapes} on axis {ax}"
        ax %= len(shape)
        if any(s[:ax] + s[ax + 1:] != shape[:ax] + shape[ax + 1:] for s in shapes):
            return None, f"cannot concat shapes {shapes} on axis {ax}"
        shape = shape[:ax] + (sum(s[ax] for s in shapes),) + shape[ax + 1:]
    if rule.transpose is not None:
        if len(rule.transpose) != len(shape):
            return None, f"transpose {rule.transpose} does not fit shape {shape}"
        shape = tuple(shape[a] for a in rule.transpose)
    if rule.reshape is not None:
        known = math.prod(d for d in rule.reshape if d != -1)
        size = math.prod(shape)
        if (-1 in rule.reshape and (known == 0 or size % known)) or (-1 not in rule.reshape and known != size):
            return None, f"cannot reshape {shape} to {rule.reshape}"
        shape = tuple(size // known if d == -1 else d for d in rule.reshape)
    return shape, None


def plan(src_tree: PyTree, target_state: PyTree, mapping: MappingLike = None, *,
         takes: Mapping[str, Take] | None = None) -> SyncPlan:
    """Validate a sync of `src_tree` into `target_state` under `mapping`; raise one error or plan.

    `takes`: target path -> (axis, index) for targets stored in an expanded layout (the engine's
    attention heads padded or replicated for a mesh): a source whose shape matches the target's
    with `len(index)` replaced by the source's own size along `axis` is expanded by taking entry
    `index[i]` (zeros for -1) along that axis. A source already in the target's shape is copied as is.
    """
    rules = resolve(mapping)
    src, tgt = flatten(src_tree, what="source"), flatten(target_state, what="target")
    fp = fingerprint(rules, src, tgt)
    takes = dict(takes or {})
    key = (fp, tuple(sorted(takes.items())))
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    result = _build(rules, src, tgt, fp, takes)
    if len(_CACHE) >= 64:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = result
    return result


_CACHE: dict[tuple[str, tuple[tuple[str, Take], ...]], SyncPlan] = {}


def _build(rules: tuple[Rule, ...], src: FlatTree, tgt: FlatTree, fp: str, takes: dict[str, Take]) -> SyncPlan:
    problems: list[str] = []
    s_shape = {p: (tuple(x.shape), str(jnp.dtype(x.dtype))) for p, x in zip(src.paths, src.leaves)}
    t_shape = {p: (tuple(x.shape), str(jnp.dtype(x.dtype))) for p, x in zip(tgt.paths, tgt.leaves)}
    groups: dict[tuple[int, tuple[str, ...]], dict[int, str]] = collections.defaultdict(dict)
    dropped: list[str] = []
    for path in src.paths:
        hit = next(((ri, m) for ri, r in enumerate(rules) if (m := r.match(path)) is not None), None)
        if hit is None:
            problems.append(f"source {path!r} {list(s_shape[path][0])} matches no rule (unmapped)")
            continue
        ri, (si, caps) = hit
        if rules[ri].target is None:
            dropped.append(path)
        else:
            groups[(ri, caps)][si] = path
    ops: list[TargetOp] = []
    attempted: set[str] = set()  # targets whose (failed) op is already reported: not also "unfilled"
    for (ri, caps), found in groups.items():
        rule = rules[ri]
        missing = [substitute(p, caps) for i, p in enumerate(rule.sources) if i not in found]
        if missing:
            kind = "stack" if rule.stack else "concat"
            problems.append(f"{kind} rule {rule.sources} for {[substitute(t, caps) for t in rule.targets]} "
                            f"lacks source(s) {missing}")
            attempted.update(substitute(t, caps) for t in rule.targets)  # reported here, not also as unfilled
            continue
        srcs = tuple(found[i] for i in range(len(rule.sources)))
        targets = [substitute(t, caps) for t in rule.targets]
        attempted.update(targets)
        absent = [t for t in targets if t not in t_shape]
        if absent:
            if rule.drop_if_target_missing and len(absent) == len(targets):
                dropped.extend(srcs)
            else:
                problems.append(f"source(s) {list(srcs)} map to {absent}, which the target lacks")
            continue
        shape, err = _shape_after([s_shape[s][0] for s in srcs], rule)
        if err is not None:
            problems.append(f"{list(srcs)} -> {targets}: {err}")
            continue
        ops.extend(_split_ops(rule, ri, srcs, targets, shape, s_shape, t_shape, takes, problems))
    filled = collections.Counter(op.target for op in ops)
    for t, n in filled.items():
        if n > 1:
            problems.append(f"target {t!r} is filled {n} times, from "
                            f"{[list(op.sources) for op in ops if op.target == t]} (duplicate target)")
    for t in tgt.paths:
        if t not in filled and t not in attempted:
            problems.append(f"target {t!r} {list(t_shape[t][0])} is not filled by any source (unfilled)")
    if problems:
        raise WeightSyncError(problems)
    order = {t: i for i, t in enumerate(tgt.paths)}
    ops.sort(key=lambda op: order[op.target])
    return SyncPlan(tuple(ops), tuple(dropped), rules, fp)


def _split_ops(rule: Rule, ri: int, srcs: tuple[str, ...], targets: list[str], shape: Shape,
               s_shape: dict[str, tuple[Shape, str]], t_shape: dict[str, tuple[Shape, str]],
               takes: dict[str, Take], problems: list[str]) -> list[TargetOp]:
    """One op per target; checks split sizes, final shapes and dtypes."""
    where = f"{list(srcs)} -> {targets if len(targets) > 1 else targets[0]}"
    if rule.split is not None:
        ax = rule.split.axis
        if not -len(shape) <= ax < len(shape):
            problems.append(f"{where}: split axis {ax} out of range for shape {shape}")
            return []
        ax %= len(shape)
        sizes = rule.split.sizes or tuple(t_shape[t][0][ax] if len(t_shape[t][0]) > ax else -1 for t in targets)
        if sum(sizes) != shape[ax] or min(sizes) <= 0:
            problems.append(f"{where}: split sizes {list(sizes)} do not add up to {shape[ax]} (axis {ax} of {shape})")
            return []
        starts = np.cumsum((0,) + tuple(sizes[:-1])).tolist()
        pieces = [(ax, int(st), int(sz), shape[:ax] + (sz,) + shape[ax + 1:]) for st, sz in zip(starts, sizes)]
    else:
        pieces = [(None, 0, 0, shape)]
    ops: list[TargetOp] = []
    ok = True
    for t, (ax, st, sz, pshape) in zip(targets, pieces):
        tshape, tdtype = t_shape[t]
        take = _fitting_take(pshape, tshape, takes.get(t))
        if pshape != tshape and take is None:
            expanded = " (nor expands to it by the target's layout)" if t in takes else ""
            problems.append(f"{list(srcs)} -> {t!r}: shape {list(pshape)} after transform != target "
                            f"{list(tshape)}{expanded}")
            ok = False
        if rule.dtype is not None and rule.dtype != tdtype:
            problems.append(f"{list(srcs)} -> {t!r}: rule dtype {rule.dtype} != target dtype {tdtype}")
            ok = False
        for s in srcs:
            err = _dtype_problem(s_shape[s][1], tdtype)
            if err:
                problems.append(f"{s!r} -> {t!r}: {err}")
                ok = False
        ops.append(TargetOp(t, srcs, Transform(rule.concat, rule.transpose, rule.reshape, ax, st, sz, tdtype, take,
                                               rule.stack), ri))
    return ops if ok else []


def _fitting_take(shape: Shape, target: Shape, take: Take | None) -> Take | None:
    """`take` when it turns `shape` into `target` (and `shape` is not `target` already), else None."""
    if take is None or shape == target or len(shape) != len(target):
        return None
    axis, index = take
    axis %= len(shape)
    fits = (shape[:axis] + (len(index),) + shape[axis + 1:] == target and max(index) < shape[axis]
            and {i for i in index if i >= 0} == set(range(shape[axis])))  # every source entry lands somewhere
    return (axis, tuple(index)) if fits else None
