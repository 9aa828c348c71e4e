"""How one layer's paged KV cache is laid out: the one object (owned by the attention kernel that reads the
cache, `runner.attention.AttentionKernel.layout`) that shapes, writes and gathers it. Nothing guesses a
layout from an array's rank.

- `KVLayout`: `[2, Hkv, P, page, D]` per replica, K at index 0 and V at 1, each half in the
  `[kv_heads, pages, page_size, head_dim]` layout of JAX's Pallas paged-attention kernels. With `bits`,
  a bfloat16 cache is held as its uint16 bits (the CPU backend's: XLA:CPU scatters bfloat16 by converting
  the whole cache to float32 and back in every layer of every step; uint16 it scatters in place).
- `FusedKVLayout`: JAX's TPU `ragged_paged_attention` kernel's `[P, page, 2 * Hkv, D]` (K of head h at 2h,
  V at 2h + 1), its heads and head_dim possibly zero-padded to what the kernel tiles
  (`runner.tpu_attention.TpuKernelShape`); new rows are zero-padded when written, gathered pages sliced back.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from runner.kv_cache import KVCacheSpec


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """The engine's own layout, `[2, Hkv, P, page, D]` per replica."""

    bits: bool = False  # a bfloat16 cache held as its uint16 bits
    # each dimension's logical axis (`runner.sharding`): replicas over `data`, KV heads over `model`
    cache_axes: ClassVar[tuple[str | None, ...]] = ("replica", None, "kv_heads", None, None, None)

    def cache_shape(self, spec: KVCacheSpec) -> tuple[int, ...]:
        """One layer's cache, replica axis first."""
        return spec.shape

    def storage_dtype(self, dtype: str) -> str:
        return "uint16" if self.bits and jnp.dtype(dtype) == jnp.bfloat16 else dtype

    def geometry(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """(KV heads `take_pages` gives, pages, page_size) of one replica's cache of `shape`."""
        return shape[1], shape[2], shape[3]

    def stored(self, x: Array, cache_dtype: jnp.dtype) -> Array:
        """`x` as the cache holds it (bfloat16 bits in a uint16 cache)."""
        if cache_dtype == jnp.uint16:
            return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
        return x.astype(cache_dtype)

    @staticmethod
    def values(x: Array) -> Array:
        """Gathered cache entries as values (the inverse of `stored`)."""
        return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x

    def write(self, kv_pages: Array, k: Float[Array, "T Hkv D"], v: Float[Array, "T Hkv D"],
              slot_mapping: Int[Array, "T"]) -> Array:
        """Scatter one step's K and V into their slots; out-of-range slots are dropped.

        One scatter of `head_dim` rows indexed by (page, offset), with the K/V and head axes as explicit
        batching dimensions: XLA:CPU updates the cache in place (a scatter along an inner axis made it
        copy the whole cache for a one-token step), and GSPMD partitions it along a head-sharded cache
        with no collective (flattening the head axis into the rows made it all-gather the whole cache
        in every layer of a tensor-parallel step)."""
        two, num_kv_heads, num_pages, page_size, _ = kv_pages.shape
        in_range = (slot_mapping >= 0) & (slot_mapping < num_pages * page_size)
        page = jnp.where(in_range, slot_mapping // page_size, num_pages)  # past the last page: dropped
        index = jnp.stack([page, slot_mapping % page_size], axis=-1).astype(jnp.int32)  # [T, 2]
        index = jnp.broadcast_to(index, (two, num_kv_heads, *index.shape))
        updates = self.stored(jnp.stack([k, v]).transpose(0, 2, 1, 3), kv_pages.dtype)  # [2, Hkv, T, D]
        dims = jax.lax.ScatterDimensionNumbers(
            update_window_dims=(3,), inserted_window_dims=(2, 3), scatter_dims_to_operand_dims=(2, 3),
            operand_batching_dims=(0, 1), scatter_indices_batching_dims=(0, 1))
        return jax.lax.scatter(kv_pages, index, updates, dims, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)

    def take_pages(self, kv_pages: Array, idx: Int[Array, "N"]
                   ) -> tuple[Float[Array, "Hkv N pageD"], Float[Array, "Hkv N pageD"]]:
        """K and V values of pages `idx` for every KV head, one contiguous row of `page * D` each.

        K (`kv_pages[0]`) and V are viewed as rows `[Hkv, P, page * D]` (no data moves) and gathered with
        the head axis as an explicit batching dimension of the gather, so each output row is one contiguous
        copy and a KV-head-sharded cache stays sharded. Two layouts measured slower: vmapping a take over
        axis 1 of the whole cache fused a transpose of the whole cache into the gather (elementwise index
        math), and vmapping a take over the heads of `kv_pages[0]` became one gather of all heads per page
        (strided reads) followed by a transposing copy."""
        two, num_kv_heads, total_pages, page_size, head_dim = kv_pages.shape
        rows = kv_pages.reshape(two, num_kv_heads, total_pages, page_size * head_dim)
        index = jnp.broadcast_to(idx[None, :, None], (num_kv_heads, idx.shape[0], 1)).astype(jnp.int32)
        dims = jax.lax.GatherDimensionNumbers(offset_dims=(2,), collapsed_slice_dims=(1,), start_index_map=(1,),
                                              operand_batching_dims=(0,), start_indices_batching_dims=(0,))

        def take(head_rows: Array) -> Array:  # [Hkv, P, page * D] -> [Hkv, N, page * D]
            return jax.lax.gather(head_rows, index, dims, slice_sizes=(1, 1, page_size * head_dim),
                                  mode=jax.lax.GatherScatterMode.CLIP)

        return self.values(take(rows[0])), self.values(take(rows[1]))


@dataclasses.dataclass(frozen=True)
class FusedKVLayout(KVLayout):
    """The TPU ragged kernel's `[P, page, 2 * Hkv, D]` per replica, stored with `padded_kv_heads` heads of
    `padded_head_dim` lanes (zeros past the model's `num_kv_heads` and `head_dim`)."""

    num_kv_heads: int = 1
    head_dim: int = 128
    padded_kv_heads: int = 1
    padded_head_dim: int = 128
    cache_axes: ClassVar[tuple[str | None, ...]] = ("replica", None, None, "kv_heads", None)

    @classmethod
    def unpadded(cls, num_kv_heads: int, head_dim: int) -> "FusedKVLayout":
        return cls(num_kv_heads=num_kv_heads, head_dim=head_dim, padded_kv_heads=num_kv_heads,
                   padded_head_dim=head_dim)

    def cache_shape(self, spec: KVCacheSpec) -> tuple[int, ...]:
        replicas, _, _, pages, page_size, _ = spec.shape
        return (replicas, pages, page_size, 2 * self.padded_kv_heads, self.padded_head_dim)

    def geometry(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        return self.num_kv_heads, shape[0], shape[1]

    def write(self, kv_pages: Array, k: Float[Array, "T Hkv D"], v: Float[Array, "T Hkv D"],
              slot_mapping: Int[Array, "T"]) -> Array:
        num_pages, page_size, combined, head_dim = kv_pages.shape
        in_range = (slot_mapping >= 0) & (slot_mapping < num_pages * page_size)
        page = jnp.where(in_range, slot_mapping // page_size, num_pages)  # past the last page: dropped
        k, v = (pad_kv_rows(x, combined // 2, head_dim) for x in (k, v))
        updates = self.stored(jnp.stack([k, v], axis=2).reshape(k.shape[0], combined, head_dim), kv_pages.dtype)
        return kv_pages.at[page, slot_mapping % page_size].set(updates, mode="drop")

    def take_pages(self, kv_pages: Array, idx: Int[Array, "N"]
                   ) -> tuple[Float[Array, "Hkv N pageD"], Float[Array, "Hkv N pageD"]]:
        """Pages gathered whole, split into K and V per head (a transposing copy per chunk: this layout's
        reference path), the padded heads and lanes sliced off."""
        pages = self.values(jnp.take(kv_pages, idx, axis=0, mode="clip"))  # [N, page, 2 * Hkv, D]
        n, page_size, combined, _ = pages.shape
        pages = pages[:, :, :2 * self.num_kv_heads, :self.head_dim]
        pages = pages.reshape(n, page_size, self.num_kv_heads, 2, self.head_dim).transpose(3, 2, 0, 1, 4)
        pages = pages.reshape(2, self.num_kv_heads, n, page_size * self.head_dim)
        return pages[0], pages[1]


def pad_kv_rows(kv: Float[Array, "T Hkv D"], num_kv_heads: int, head_dim: int) -> Float[Array, "T Hkv2 D2"]:
    """New K or V rows zero-padded to the cache's head count and head_dim (no-op when they match)."""
    extra_heads, extra_dim = num_kv_heads - kv.shape[1], head_dim - kv.shape[2]
    if extra_heads == 0 and extra_dim == 0:
        return kv
    return jnp.pad(kv, ((0, 0), (0, extra_heads), (0, extra_dim)))
