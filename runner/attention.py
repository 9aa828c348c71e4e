"""Attention kernels: dense causal attention (training forward) and ragged paged attention (engine).

One layer's cache is `kv_pages [2, kv_heads, pages, page_size, head_dim]`: K at index 0 and V at 1,
each in the `[kv_heads, total_num_pages, page_size, head_dim]` layout of JAX's Pallas
`paged_attention` kernels (`jax.experimental.pallas.ops.gpu.paged_attention` and
`...ops.tpu.paged_attention`), so `kv_pages[0]`, `kv_pages[1]` go to them as they are (decode steps).
JAX's TPU `ragged_paged_attention` kernel wants K and V interleaved per page instead
(`[pages, page, 2 * kv_heads, head_dim]`), so it is not one of the impls.
`ragged_paged_attention` (runner/ragged_attention.py: the pure-JAX reference and the path of every
step no kernel takes) attends queries packed across requests (`kv_lens`, `page_indices`, `cu_q_lens`,
`num_seqs`, as the TPU ragged kernel does). This file owns the metadata, the boundary that picks a
kernel, the KV write and the trainer's dense causal attention.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from runner.tpu_attention import BlockSizes, INTERPRET_BLOCKS, pad_kv_rows, tpu_ragged_attention
from runner.ragged_attention import (  # noqa: F401  (re-exported: the kernel's constants and entry point)
    MASK_VALUE, MULTIPLY_REDUCE_MAX_ROWS, PIECES_PER_GROUP, cache_geometry, cache_values, ragged_paged_attention,
    soft_capped)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where one engine step's tokens live in the paged KV cache (explicit, no global context)."""

    slot_mapping: Int[Array, "T"]  # flat KV slot (page * page_size + offset) of each token; out of range = drop
    kv_lens: Int[Array, "S"]  # context length of each sequence after this step's tokens
    page_indices: Int[Array, "S W"]  # KV pages of each sequence (W = context bucket in pages)
    cu_q_lens: Int[Array, "S+1"]  # start of each sequence's queries in the packed token axis
    num_seqs: Int[Array, "1"]  # number of real sequences (the rest of S is padding)
    # leading pages shared by every real sequence and wholly before each one's first query (cascade); None = 0
    num_common_pages: Int[Array, "1"] | None = None
    max_q_len: int = dataclasses.field(metadata=dict(static=True), default=1)  # static bound on any q_len
    # attend only the first power-of-two count of rows that holds every real one (verification steps,
    # whose row count is bucketed by tokens, not sequences); off under vmap, where a switch runs every branch
    trim_rows: bool = dataclasses.field(metadata=dict(static=True), default=False)
    impl: str = dataclasses.field(metadata=dict(static=True), default="jax")  # one of ATTENTION_IMPLS
    # the TPU ragged kernel's tiling on this chip generation (`runner.tpu_attention.BLOCK_SIZES`)
    tpu_blocks: BlockSizes = dataclasses.field(metadata=dict(static=True), default=INTERPRET_BLOCKS)


ATTENTION_IMPLS = ("jax", "cpu_kernel", "pallas_gpu", "pallas_gpu_interpret", "pallas_tpu", "pallas_tpu_interpret",
                   "tpu_ragged", "tpu_ragged_interpret", "tpu_ragged_jax")


def paged_attention(
    queries: Float[Array, "T Hq D"],
    kv_pages: Float[Array, "2 Hkv P page D"],
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_kv_heads: int | None = None,
) -> Float[Array, "T Hq D"]:
    """The engine's one attention boundary: `md.impl` picks the kernel.

    A layer with a `sliding_window` (keys more than that many positions back are not attended) or a
    score `soft_cap` (`cap * tanh(s / cap)`, Gemma) runs the pure-JAX version on every impl, and a
    windowed layer without the cascade (its shared prefix may lie outside the window).

    "jax" is the pure-JAX `ragged_paged_attention` (every step, every backend). "cpu_kernel" (the CPU
    backend's) sends steps of at most `runner.backends.cpu.attention.MAX_Q_LEN` queries per sequence or prefill piece with float32
    queries and cache to that C++ kernel, other steps to the pure-JAX version. "pallas_gpu" and
    "pallas_tpu" send decode steps (one query per sequence) to JAX's Pallas `paged_attention` kernel
    for that backend over the same cache (`kv_pages[0]`, `kv_pages[1]`), and every other step to the
    pure-JAX version; the "_interpret" variants run those kernels in Pallas interpret mode (any
    backend; tests). The TPU kernel rounds K and V to bfloat16 inside (exact for a bfloat16 cache).

    A cache in the TPU ragged layout (`[P, page, 2 * Hkv, D]`, `TPU_LAYOUT_IMPLS`) sends every step
    (prefill, chunked prefill, decode, verification; windows and soft-caps included) to JAX's Pallas
    TPU `ragged_paged_attention` ("tpu_ragged"; "tpu_ragged_interpret" in interpret mode) or to the
    pure-JAX version over that layout ("tpu_ragged_jax", the reference). No cascade there: the kernel
    has none. A cache in the engine's layout (an EAGLE-3 head's) under those impls runs pure JAX. That
    cache may be zero-padded for the kernel (more KV heads, a wider head_dim: `runner.tpu_attention`);
    `num_kv_heads` is the model's own count (default: the cache's).
    """
    if md.impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {md.impl!r}; choose one of {ATTENTION_IMPLS}")
    if kv_pages.ndim == 4:
        return _tpu_ragged(queries, kv_pages, md, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                           num_kv_heads=kv_pages.shape[2] // 2 if num_kv_heads is None else num_kv_heads)
    if sliding_window is not None or soft_cap is not None:
        return ragged_paged_attention(
            queries, kv_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs, sm_scale=sm_scale,
            max_q_len=md.max_q_len, num_common_pages=md.num_common_pages if sliding_window is None else None,
            trim_rows=md.trim_rows, sliding_window=sliding_window, soft_cap=soft_cap)
    if md.impl == "cpu_kernel":  # the CPU backend's C++ kernel (imported only by engines that chose it)
        from runner.backends.cpu.attention import MAX_HEAD_DIM, MAX_Q_LEN, cpu_paged_attention, supports

        if md.max_q_len <= MAX_Q_LEN and supports(queries.dtype, kv_pages.dtype) and queries.shape[-1] <= MAX_HEAD_DIM:
            return cpu_paged_attention(queries, kv_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
                                       sm_scale=sm_scale)
    elif md.impl.startswith("pallas_") and md.max_q_len == 1 and queries.shape[0] == md.page_indices.shape[0]:
        return _pallas_decode(queries, kv_pages, md.kv_lens, md.page_indices, sm_scale=sm_scale,
                              platform=md.impl.split("_")[1], interpret=md.impl.endswith("_interpret"))
    return ragged_paged_attention(queries, kv_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
                                  sm_scale=sm_scale, max_q_len=md.max_q_len, num_common_pages=md.num_common_pages,
                                  trim_rows=md.trim_rows)


def _tpu_ragged(
    queries: Float[Array, "T Hq D"],
    kv_pages: Float[Array, "P page 2Hkv Dp"],
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    num_kv_heads: int,
) -> Float[Array, "T Hq D"]:
    """Every step over a cache in the TPU ragged layout: the Pallas kernel (compiled, or in the generic
    interpreter), or the pure-JAX reference."""
    if md.impl in ("tpu_ragged", "tpu_ragged_interpret"):
        return tpu_ragged_attention(queries, kv_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
                                    num_kv_heads=num_kv_heads, sm_scale=sm_scale, sliding_window=sliding_window,
                                    soft_cap=soft_cap, blocks=md.tpu_blocks,
                                    interpret=md.impl.endswith("_interpret"))
    num_q_heads, head_dim = queries.shape[1:]
    if kv_pages.shape[2] != 2 * num_kv_heads or kv_pages.shape[3] != head_dim:  # a cache padded for the kernel
        kv_pages = kv_pages[:, :, :2 * num_kv_heads, :head_dim]
    return ragged_paged_attention(queries, kv_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
                                  sm_scale=sm_scale, max_q_len=md.max_q_len, trim_rows=md.trim_rows,
                                  sliding_window=sliding_window, soft_cap=soft_cap)


def _largest_divisor(n: int, options: tuple[int, ...]) -> int:
    return next(d for d in options if n % d == 0)


def _pallas_decode(
    queries: Float[Array, "S Hq D"],
    kv_pages: Float[Array, "2 Hkv P page D"],
    kv_lens: Int[Array, "S"],
    page_indices: Int[Array, "S W"],
    *,
    sm_scale: float,
    platform: str,
    interpret: bool,
) -> Float[Array, "S Hq D"]:
    """One query per sequence through JAX's Pallas `paged_attention` kernel of `platform` ("gpu" | "tpu").

    The TPU kernel DMAs every listed page, so table entries past the cache (padding) are clipped
    into it. Rows without context are zeroed, as the reference does.
    """
    q = (queries.astype(jnp.float32) * sm_scale).astype(queries.dtype)
    pages_per_seq = page_indices.shape[1]
    if platform == "gpu":
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as gpu_paged_attention

        k_splits = _largest_divisor(pages_per_seq, (16, 8, 4, 2, 1))
        per_block = _largest_divisor(pages_per_seq // k_splits, (8, 4, 2, 1))
        out = gpu_paged_attention(q, kv_pages[0], kv_pages[1], page_indices, kv_lens, k_splits=k_splits,
                                  pages_per_compute_block=per_block, interpret=interpret)
    else:
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention

        pages = jnp.clip(page_indices, 0, kv_pages.shape[2] - 1)
        # Interpret mode applies to the pallas calls traced inside this context (so it works under jit).
        with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
            out = tpu_paged_attention(q, kv_pages[0], kv_pages[1], kv_lens, pages,
                                      pages_per_compute_block=_largest_divisor(pages_per_seq, (8, 4, 2, 1)))
    return jnp.where((kv_lens > 0)[:, None, None], out, 0.0).astype(queries.dtype)


def paged_slots(page_indices: Int[Array, "... W"], positions: Int[Array, "..."], page_size: int, num_slots: int,
                valid: Array | bool = True) -> Int[Array, "..."]:
    """The KV slot of each position through its sequence's page table (`page_indices[..., i]`: the block
    holding positions [i * page_size, (i + 1) * page_size)); `num_slots` (a write there is dropped)
    where not `valid`, for a negative position, or past the table."""
    page = positions // page_size
    blocks = jnp.take_along_axis(page_indices, page[..., None], axis=-1, mode="clip")[..., 0]
    ok = valid & (positions >= 0) & (page < page_indices.shape[-1])
    return jnp.where(ok, blocks * page_size + positions % page_size, num_slots)


def write_kv(
    kv_pages: Float[Array, "2 Hkv P page D"],
    k: Float[Array, "T Hkv D"],
    v: Float[Array, "T Hkv D"],
    slot_mapping: Int[Array, "T"],
) -> Float[Array, "2 Hkv P page D"]:
    """Scatter this step's K and V into their slots; out-of-range slots are dropped. A cache in the TPU
    ragged layout (`[P, page, 2 * Hkv, D]`) takes K of head h at 2h and V at 2h + 1 (zeros in the heads
    and lanes of a cache padded for the kernel); a uint16 cache holds bfloat16 bits (`cache_values`).

    One scatter of `head_dim` rows indexed by (page, offset), with the K/V and head axes as explicit
    batching dimensions: XLA:CPU updates the cache in place (a scatter along an inner axis made it
    copy the whole cache for a one-token step), and GSPMD partitions it along a head-sharded cache
    with no collective (flattening the head axis into the rows made it all-gather the whole cache
    in every layer of a tensor-parallel step).
    """
    if kv_pages.ndim == 4:
        num_pages, page_size, combined, head_dim = kv_pages.shape
        in_range = (slot_mapping >= 0) & (slot_mapping < num_pages * page_size)
        page = jnp.where(in_range, slot_mapping // page_size, num_pages)  # past the last page: dropped
        k, v = (pad_kv_rows(x, combined // 2, head_dim) for x in (k, v))  # a cache padded for the kernel
        updates = cache_values(jnp.stack([k, v], axis=2).reshape(k.shape[0], combined, head_dim), kv_pages.dtype)
        return kv_pages.at[page, slot_mapping % page_size].set(updates, mode="drop")
    two, num_kv_heads, num_pages, page_size, _ = kv_pages.shape
    in_range = (slot_mapping >= 0) & (slot_mapping < num_pages * page_size)
    page = jnp.where(in_range, slot_mapping // page_size, num_pages)  # past the last page: dropped
    index = jnp.stack([page, slot_mapping % page_size], axis=-1).astype(jnp.int32)  # [T, 2]
    index = jnp.broadcast_to(index, (two, num_kv_heads, *index.shape))
    updates = cache_values(jnp.stack([k, v]).transpose(0, 2, 1, 3), kv_pages.dtype)  # [2, Hkv, T, D]
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(3,), inserted_window_dims=(2, 3), scatter_dims_to_operand_dims=(2, 3),
        operand_batching_dims=(0, 1), scatter_indices_batching_dims=(0, 1))
    return jax.lax.scatter(kv_pages, index, updates, dims, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def causal_attention(
    q: Float[Array, "B S Hq D"],
    k: Float[Array, "B S Hkv D"],
    v: Float[Array, "B S Hkv D"],
    *,
    sm_scale: float,
    attention_mask: Int[Array, "B S"] | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> Float[Array, "B S Hq D"]:
    """Dense causal grouped-query attention over full sequences (the trainer's forward); with a
    `sliding_window`, query i attends keys j > i - window only; `soft_cap` caps the scaled scores."""
    batch, seq, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    qg = q.reshape(batch, seq, num_kv_heads, group, head_dim)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * sm_scale
    scores = soft_capped(scores, soft_cap)
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))[None]
    if sliding_window is not None:
        mask = mask & ~jnp.tril(jnp.ones((seq, seq), dtype=bool), k=-sliding_window)[None]
    if attention_mask is not None:
        mask = mask & (attention_mask[:, None, :] > 0)
    scores = jnp.where(mask[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(batch, seq, num_q_heads, head_dim)
