"""The paged KV cache: its size (`KVCacheSpec`: layers, blocks, heads, dtype, data-parallel replicas) and
its allocation, one array per layer. Each replica owns one slice of the leading axis (its own blocks,
on its own devices); how a layer's array is laid out is its attention kernel's `runner.kv_layout`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array

from runner.models.config import ModelConfig

KVCaches = tuple[Array, ...]  # one paged cache per layer, in its attention kernel's layout (`runner.kv_layout`)


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """Shape and dtype of the paged KV cache."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    num_replicas: int = 1  # data-parallel replicas; num_blocks counts all of them

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError(f"KV cache needs num_blocks >= 1 and block_size >= 1, got {self.num_blocks}, {self.block_size}")
        if self.num_replicas < 1 or self.num_blocks % self.num_replicas:
            raise ValueError(f"{self.num_blocks} KV blocks do not split over {self.num_replicas} replicas")

    @property
    def blocks_per_replica(self) -> int:
        return self.num_blocks // self.num_replicas

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """One layer's cache: `[replicas, 2 (K, V), kv_heads, blocks_per_replica, block_size, head_dim]`."""
        return (self.num_replicas, 2, self.num_kv_heads, self.blocks_per_replica, self.block_size, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.block_size * 2 * self.num_kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize

    @classmethod
    def for_model(cls, cfg: ModelConfig, *, block_size: int, num_blocks: int | None = None,
                  memory_bytes: int | None = None) -> "KVCacheSpec":
        """Size by block count, or by a memory budget in bytes."""
        spec = cls(cfg.num_hidden_layers, 1, block_size, cfg.num_key_value_heads, cfg.head_dim, cfg.dtype)
        if num_blocks is None:
            if memory_bytes is None:
                raise ValueError("give kv_cache_blocks or a KV memory budget")
            num_blocks = memory_bytes // spec.bytes_per_block
            if num_blocks < 1:
                raise ValueError(f"a KV budget of {memory_bytes} bytes holds no block of {spec.bytes_per_block} bytes")
        return dataclasses.replace(spec, num_blocks=int(num_blocks))


def allocate_kv_caches(shape: tuple[int, ...], dtype: str, num_layers: int,
                       sharding: jax.sharding.Sharding | None = None) -> KVCaches:
    """Zeroed caches of one layer's `shape` (the backend's layout of `KVCacheSpec.shape`), one array per
    layer (created directly in `sharding` when given). The zeroing program is compiled once per layout,
    so a cache freed and allocated again (`Engine.sleep` / `wake`) compiles nothing."""
    make = _zeros_program(tuple(shape), str(dtype), sharding)
    return tuple(make() for _ in range(num_layers))


@functools.lru_cache(maxsize=None)
def _zeros_program(shape: tuple[int, ...], dtype: str, sharding: jax.sharding.Sharding | None) -> Callable[[], jax.Array]:
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
