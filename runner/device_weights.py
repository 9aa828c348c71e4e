"""`DeviceWeights`: the runner's parameters on its devices, and what they cost.

Private (the default): the runner places its own copy by the sharding rules (a trainer may update, donate
or delete its arrays at any time). Shared (`share=True`, colocated with a trainer): a parameter already laid
out as the engine lays it out (same shape, dtype and sharding) is the trainer's array itself; only leaves
that need a transform or another sharding are copied. A sync of such a tree swaps references
(`weight_sync.apply(share=True)`). A shared array the trainer deleted or donated is caught before the next
step reads it (`check`: one error naming the leaves and the fix), never read.

The backend's packed copies (AMX's layout on the CPU backend) live in `rest` and are recomputed whenever a
parameter array is replaced (`leaves`); `release` / `restore` move the engine's own arrays to the host and
back (`Engine.sleep(offload_weights=True)`), never the trainer's.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array

from runner.executable_store import abstract_put
from runner.sharding import shard_params

Leaves = tuple[list[Array], list[Array]]  # the parameters and the rest of the model state, as leaf lists


class SharedWeightsDeleted(RuntimeError):
    """The trainer deleted or donated arrays the engine shares; `sync_weights` with the new ones fixes it."""


class DeviceWeights:
    """Parameters (`params`) and the rest of the model state (`rest`: rotary tables, packed copies)."""

    def __init__(self, params: nnx.State, rest: nnx.State, mesh: Mesh, logical_axes: Callable[[str], tuple],
                 *, share: bool, abstract: bool, repack: Callable[[nnx.State, nnx.State], nnx.State] | None) -> None:
        scalar = NamedSharding(mesh, PartitionSpec())
        if abstract:
            self.params = shard_params(params, mesh, logical_axes, put=abstract_put)
            self.rest = jax.tree.map(lambda x: abstract_put(x, scalar), rest)
        else:
            # `device_put(may_alias=False)` copies in the runtime: `x.copy()` compiled (or loaded from the
            # persistent cache) a program per parameter shape, ~1 s of each start
            def place(x: Array, sharding: NamedSharding) -> Array:
                if share and isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
                    return x
                return jax.device_put(x, sharding, may_alias=False)

            self.params = shard_params(params, mesh, logical_axes, put=place)
            self.rest = jax.tree.map(lambda x: jax.device_put(x, scalar, may_alias=False), rest)
        self._paths = [".".join(map(str, k)) for k, _ in nnx.to_flat_state(self.params)]
        self._variables = _variables(self.params)
        self._flat: list[Array] | None = None  # the parameter leaves, until `updated()`
        self.mark_shared(jax.tree.leaves(params) if share and not abstract else [])
        self._repack = repack
        self._packed_from = tuple(map(id, self._param_leaves()))
        self._offloaded: tuple[list[np.ndarray], list[np.ndarray]] | None = None  # own arrays on the host

    def mark_shared(self, sources: list[object]) -> None:
        """Which parameter leaves are the trainer's arrays (`sources` the trees they came from)."""
        ids = {id(x) for x in sources}
        params = self._param_leaves()
        self.shared = [id(x) in ids for x in params]
        self._watched = [(p, x) for p, x, s in zip(self._paths, params, self.shared) if s]  # what `check` reads

    @property
    def shares(self) -> bool:
        return any(self.shared)

    def check(self) -> None:
        """Raise `SharedWeightsDeleted` (nothing else changes) if the trainer deleted a shared array."""
        gone = [p for p, x in self._watched if x.is_deleted()]
        if gone:
            raise SharedWeightsDeleted(
                f"the trainer deleted or donated {len(gone)} parameter array(s) the engine shares ({', '.join(gone[:4])}"
                f"{', ...' if len(gone) > 4 else ''}): pass the trainer's new parameters with "
                "engine.sync_weights(params) before the next step (a jitted update with donate_argnums deletes its "
                "inputs), or build the engine with share_weights=False to give it its own copy")

    def swap(self, arrays: list[Array]) -> None:
        """Make `arrays` (one per parameter, in leaf order; the trainer's, laid out as the engine's: a matched
        `weight_sync.SwapPlan`) the parameters, by reference."""
        for var, x in zip(self._variables, arrays):
            var.set_raw_value(x, _unsafe_bypass_check=True)  # (outside any trace: nothing for the check to find)
        self._flat = list(arrays)
        self.shared = [True] * len(arrays)
        self._watched = list(zip(self._paths, arrays))

    def updated(self) -> None:
        """The parameters' Variables were written in place (`weight_sync.apply`): read them anew."""
        self._flat = None

    def _param_leaves(self) -> list[Array]:
        if self._flat is None:
            self._flat = jax.tree.leaves(self.params)
        return self._flat

    def leaves(self) -> Leaves:
        """Params and rest as the flat leaf lists the compiled programs take (after a sync, `updated()` or
        `swap`: the new arrays, and the backend's packed copies recomputed from them first)."""
        params = self._param_leaves()
        ids = tuple(map(id, params))
        if self._repack is not None and ids != self._packed_from:
            self.rest = self._repack(self.params, self.rest)
            self._packed_from = ids
        return params, jax.tree.leaves(self.rest)

    def repack(self) -> None:
        """Run the repacking program once (warm-up: a weight sync runs it)."""
        if self._repack is not None:
            self.rest = self._repack(self.params, self.rest)

    def release(self) -> None:
        """Move the engine's own arrays to host memory (shared ones stay the trainer's)."""
        if self._offloaded is not None:
            return
        params, rest = self._param_leaves(), jax.tree.leaves(self.rest)
        own = [x for x, s in zip(params, self.shared) if not s]
        self._offloaded = jax.device_get((own, rest))
        self._offload_shardings = jax.tree.map(lambda x: x.sharding, (own, rest))
        for x in (*own, *rest):
            x.delete()

    def restore(self) -> None:
        if self._offloaded is None:
            return
        own, rest = jax.device_put(self._offloaded, self._offload_shardings)
        own_iter = iter(own)
        params = [x if s else next(own_iter) for x, s in zip(self._param_leaves(), self.shared)]
        self.params = jax.tree.unflatten(jax.tree.structure(self.params), params)
        self._variables, self._flat = _variables(self.params), params
        self.rest = jax.tree.unflatten(jax.tree.structure(self.rest), rest)
        self._packed_from = tuple(map(id, params))  # `rest` came back packed as it was
        self._offloaded = None

    @property
    def released(self) -> bool:
        return self._offloaded is not None

    def nbytes_per_device(self) -> tuple[int, int]:
        """(bytes of the trainer's arrays the engine reads, bytes the engine holds itself: its own parameter
        copies and the rest, packed copies included), on the first device."""
        shared = held = 0
        for x, s in zip(self._param_leaves(), self.shared):
            n = _device_bytes(x)
            shared, held = (shared + n, held) if s else (shared, held + n)
        return shared, held + sum(_device_bytes(x) for x in jax.tree.leaves(self.rest))


def _variables(params: nnx.State) -> list[nnx.Variable]:
    """The Variables holding the parameter leaves, in leaf order."""
    return jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _device_bytes(x: Array) -> int:
    """Bytes of `x` on its first device (a shard's, or the whole array when replicated)."""
    if not isinstance(x, jax.Array) or x.is_deleted():
        return 0
    shard = x.sharding.shard_shape(x.shape)
    return int(np.prod(shard)) * x.dtype.itemsize
