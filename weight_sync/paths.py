"""Flatten any parameter pytree into dot-joined paths and leaves.

Path components are dict keys, sequence indices and attribute names joined by `.`; a flat dict
whose keys already contain dots (Hugging Face names) therefore gives the same paths as the
equivalent nested dict. Flax NNX `Variable`s are unwrapped to their arrays (and remembered, so
`apply` can set their value in place). A leading `params` component (Flax Linen's
`{'params': {...}}`) is stripped.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from weight_sync.errors import WeightSyncError

Leaf = jax.Array | np.ndarray | jax.ShapeDtypeStruct
PyTree = object  # any pytree of `Leaf`s / NNX Variables (kept as `object`: pytrees are untyped)


@dataclasses.dataclass(frozen=True)
class FlatTree:
    """A flattened tree: `paths[i]` names `leaves[i]`; `variables[i]` is its NNX Variable, if any."""

    paths: tuple[str, ...]
    leaves: tuple[Leaf, ...]
    variables: tuple[nnx.Variable | None, ...]
    treedef: jax.tree_util.PyTreeDef

    def index(self) -> dict[str, int]:
        return {p: i for i, p in enumerate(self.paths)}

    def signature(self) -> tuple[object, ...]:
        """The structure (paths) and every leaf's shape and dtype: what a plan depends on."""
        return (self.paths, tuple((tuple(x.shape), x.dtype) for x in self.leaves))


def _key_str(key: object) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _is_leaf(x: object) -> bool:
    return isinstance(x, nnx.Variable)


def _paths(tree: PyTree) -> tuple[str, ...]:
    """Every leaf's dot-joined path, in flattening order."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    paths = []
    for keys, _leaf in pairs:
        comps = [_key_str(k) for k in keys]
        paths.append(".".join(comps[1:] if comps and comps[0] == "params" else comps))
    return tuple(paths)


_PLAIN = (type(jnp.zeros(())), np.ndarray, jax.ShapeDtypeStruct)


def _values(items: list[object], variables: tuple[nnx.Variable | None, ...]) -> tuple[Leaf, ...]:
    """Each leaf's value: a Variable's own array where it holds a plain one (`get_value` costs ~10x more per
    leaf: a sync of a few hundred tensors paid milliseconds for it), else what `get_value` gives."""
    raw = jax.tree_util.tree_leaves(items)
    if len(raw) != len(items):
        return tuple(v.get_value() if v is not None else x for x, v in zip(items, variables))
    return tuple(r if type(r) in _PLAIN and (v is None or "on_get_value" not in v.get_metadata()) else
                 (v.get_value() if v is not None else x) for x, v, r in zip(items, variables, raw))


def flatten(tree: PyTree | FlatTree, *, what: str = "tree") -> FlatTree:
    """Flatten `tree` (a `FlatTree` is returned as is); raises WeightSyncError on non-array leaves or on two
    leaves with one path."""
    if isinstance(tree, FlatTree):
        return tree
    items, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_leaf)
    paths = _paths(tree)
    variables = tuple(x if isinstance(x, nnx.Variable) else None for x in items)
    leaves = _values(items, variables)
    problems: list[str] = []
    seen: set[str] = set()
    for path, value in zip(paths, leaves):
        if not (hasattr(value, "shape") and hasattr(value, "dtype")):
            problems.append(f"{what} leaf {path!r} is not an array ({type(value).__name__})")
        if path in seen:
            problems.append(f"{what} has two leaves named {path!r}")
        seen.add(path)
    if problems:
        raise WeightSyncError(problems)
    return FlatTree(paths, leaves, variables, treedef)
