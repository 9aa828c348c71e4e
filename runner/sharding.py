"""Mesh and sharding rules as data: parameter path -> logical axes (each family's rules,
`runner.models.family.ModelFamily.sharding_rules`) -> mesh axes (LOGICAL_TO_MESH).

Tensor parallelism shards attention heads, MLP columns/rows and the vocabulary over the `model`
axis; the KV cache is sharded by KV head when the head count divides, replicated otherwise. Data
parallelism splits the KV cache's replica axis and every step input's leading (replica) axis over
`data`: each replica computes its own sequences over its own KV blocks. A
dimension whose size the mesh axis does not divide is replicated rather than split unevenly.
The jitted step is partitioned by XLA (GSPMD) from these input shardings.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LOGICAL_TO_MESH: dict[str, str] = {"vocab": "model", "heads": "model", "mlp": "model", "kv_heads": "model",
                                   "expert": "model", "replica": "data"}


def make_mesh(shape: tuple[int, int] | Mesh | None) -> Mesh:
    """A ("data", "model") mesh over the first data*model devices (None = one device)."""
    if isinstance(shape, Mesh):
        missing = {"data", "model"} - set(shape.axis_names)
        if missing:
            raise ValueError(f"the mesh needs axes 'data' and 'model'; it lacks {sorted(missing)}")
        return shape
    data, model = shape if shape is not None else (1, 1)
    if data < 1 or model < 1:
        raise ValueError(f"mesh sizes must be >= 1, got (data={data}, model={model})")
    devices = jax.devices()
    if data * model > len(devices):
        raise ValueError(f"a ({data}, {model}) mesh needs {data * model} devices; JAX sees {len(devices)} "
                         "(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing JAX)")
    return Mesh(np.asarray(devices[:data * model]).reshape(data, model), ("data", "model"))


def spec_for(shape: tuple[int, ...], logical: tuple[str | None, ...], mesh: Mesh) -> PartitionSpec:
    """Mesh axes for each dimension; a dimension the axis size does not divide stays replicated."""
    axes: list[str | None] = []
    for dim, name in zip(shape, logical + (None,) * (len(shape) - len(logical))):
        mesh_axis = LOGICAL_TO_MESH.get(name) if name else None
        if mesh_axis is not None and mesh.shape[mesh_axis] > 1 and dim % mesh.shape[mesh_axis] == 0:
            axes.append(mesh_axis)
        else:
            axes.append(None)
    return PartitionSpec(*axes)


def param_sharding(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """The sharding of one parameter with these logical axes (its family's sharding rules give them)."""
    return NamedSharding(mesh, spec_for(shape, logical, mesh))


def kv_cache_sharding(shape: tuple[int, ...], logical: tuple[str | None, ...], mesh: Mesh) -> NamedSharding:
    """A layer's KV cache split over replicas (`data`) and KV heads (`model`) by its layout's logical axes
    (`runner.kv_layout.KVLayout.cache_axes`; the TPU one's combined K/V head axis splits between heads: K and
    V of a head stay together)."""
    return NamedSharding(mesh, spec_for(shape, logical, mesh))


def shard_params(params: object, mesh: Mesh, logical_axes: Callable[[str], tuple[str | None, ...]],
                 put: Callable[[jax.Array, NamedSharding], jax.Array] = jax.device_put) -> object:
    """`params` (an nnx.State or any tree of arrays) placed on `mesh` by the logical axes of each path
    (a family's `ModelFamily.logical_axes`) with `put` (an abstract runner's gives shapes and shardings)."""
    def place(path: tuple, x: jax.Array) -> jax.Array:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        name = name.replace(".value", "")
        return put(x, param_sharding(logical_axes(name), tuple(x.shape), mesh))
    return jax.tree_util.tree_map_with_path(place, params)
