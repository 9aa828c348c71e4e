"""`SwapPlan`: a sync in which every target tensor is a source array as it is (`apply(share=True)` of a tree
laid out as the target), repeated by reference alone.

After one such sync has gone through the full path (`plan` + `apply`), the next tree of the same structure
is matched in one pass: its structure by the recorded treedef (`flatten_up_to` checks node types and keys
in C++), each used leaf by its shape, dtype and sharding. A tree that differs in anything (a leaf moved to
another sharding, a deleted or donated array, a host array, a Variable with a value hook) is not matched,
and the caller takes the full path, which validates and explains. Nothing is copied and nothing changes
here: `match` only reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from weight_sync.paths import FlatTree, PyTree

_ARRAY = type(jnp.zeros(()))  # a concrete jax.Array


@dataclasses.dataclass(frozen=True)
class SwapPlan:
    """Which source leaf each target leaf is, and the layout each must have."""

    treedef: jax.tree_util.PyTreeDef  # the source's structure, NNX Variables as leaves
    sources: tuple[int, ...]  # [num_targets] index of each target's source leaf
    holders: tuple[type | None, ...]  # [num_targets] the NNX Variable class holding that leaf, or None
    shapes: tuple[tuple[int, ...], ...]  # [num_targets]
    dtypes: tuple[jnp.dtype, ...]  # [num_targets]
    shardings: tuple[jax.sharding.Sharding, ...]  # [num_targets]

    @classmethod
    def after(cls, src: FlatTree, targets: list[jax.Array]) -> SwapPlan | None:
        """The plan of a sync that just made `targets` (every target leaf, in order) out of `src`; None
        unless every target is one of the source's arrays."""
        index = {id(x): j for j, x in enumerate(src.leaves)}
        sources = [index.get(id(x)) for x in targets]
        if any(j is None for j in sources) or not all(type(x) is _ARRAY for x in targets):
            return None
        holders = tuple(type(src.variables[j]) if src.variables[j] is not None else None for j in sources)
        return cls(src.treedef, tuple(sources), holders, tuple(x.shape for x in targets), tuple(x.dtype for x in targets),
                   tuple(x.sharding for x in targets))

    def match(self, tree: PyTree) -> list[jax.Array] | None:
        """Each target's new array from `tree` when the tree fills every target as it is; None otherwise."""
        try:
            items = self.treedef.flatten_up_to(tree)
        except (ValueError, TypeError):
            return None
        arrays = []
        for j, holder, shape, dtype, sharding in zip(self.sources, self.holders, self.shapes, self.dtypes,
                                                     self.shardings):
            x = items[j]
            if type(x) is not (holder or _ARRAY):
                return None
            if holder is not None:
                if "on_get_value" in x.get_metadata():  # its value is what the hook makes: the full path reads it
                    return None
                x = x.get_raw_value()
            if (type(x) is not _ARRAY or x.shape != shape or x.dtype != dtype or x.is_deleted()
                    or not (x.sharding is sharding or x.sharding == sharding)):
                return None
            arrays.append(x)
        return arrays
