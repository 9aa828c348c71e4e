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

    def signature(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        """(path, shape, dtype) of every leaf: what a plan depends on."""
        return tuple((p, tuple(x.shape), str(jnp.dtype(x.dtype))) for p, x in zip(self.paths, self.leaves))


def _key_str(key: object) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _is_leaf(x: object) -> bool:
    return isinstance(x, nnx.Variable)


def flatten(tree: PyTree, *, what: str = "tree") -> FlatTree:
    """Flatten `tree`; raises WeightSyncError on non-array leaves or on two leaves with one path."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    paths: list[str] = []
    leaves: list[Leaf] = []
    variables: list[nnx.Variable | None] = []
    problems: list[str] = []
    seen: set[str] = set()
    for keys, leaf in pairs:
        comps = [_key_str(k) for k in keys]
        if comps and comps[0] == "params":
            comps = comps[1:]
        path = ".".join(comps)
        var = leaf if isinstance(leaf, nnx.Variable) else None
        value = leaf.get_value() if var is not None else leaf
        if not (hasattr(value, "shape") and hasattr(value, "dtype")):
            problems.append(f"{what} leaf {path!r} is not an array ({type(value).__name__})")
            continue
        if path in seen:
            problems.append(f"{what} has two leaves named {path!r}")
        seen.add(path)
        paths.append(path)
        leaves.append(value)
        variables.append(var)
    if problems:
        raise WeightSyncError(problems)
    return FlatTree(tuple(paths), tuple(leaves), tuple(variables), treedef)
