"""The engine's attention boundary: `AttentionMetadata` (where one step's tokens live in the paged KV cache,
an explicit argument of every paged forward) and `AttentionKernel`, the attention callable a backend puts
in it with the KV layout it reads (`runner.kv_layout`); plus the trainer's dense `causal_attention`.

`AttentionKernel` itself is the reference: the pure-JAX `ragged_paged_attention`
(runner/ragged_attention.py) over its layout, for every step. Backends subclass it (`runner/backends/`):
the CPU backend's C++ kernel, JAX's Pallas decode kernels (GPU), JAX's Pallas TPU ragged kernel
(`runner.tpu_attention`); each takes the steps and layers it supports and leaves the rest to the reference.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from runner.kv_layout import KVLayout
from runner.ragged_attention import (  # noqa: F401  (re-exported: the kernel's constants and entry point)
    MASK_VALUE, MULTIPLY_REDUCE_MAX_ROWS, PIECES_PER_GROUP, ragged_paged_attention, soft_capped)


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """Paged attention over a cache in `layout`; this base class is the pure-JAX reference."""

    layout: KVLayout = KVLayout()
    name: ClassVar[str] = "jax"  # what `Engine.stats().attention_impl` reports
    # a custom call XLA cannot partition: on a data-parallel mesh each replica runs on its own device
    # (`runner.step_program.forward_and_sample` maps it there with `shard_map`)
    per_device: ClassVar[bool] = False

    def __call__(self, queries: Float[Array, "T Hq D"], kv_pages: Array, md: AttentionMetadata, *, sm_scale: float,
                 sliding_window: int | None = None, soft_cap: float | None = None) -> Float[Array, "T Hq D"]:
        """One layer's attention of a step's packed queries (`md`), after their K/V were written."""
        return self.reference(queries, kv_pages, md, sm_scale=sm_scale, sliding_window=sliding_window,
                              soft_cap=soft_cap)

    def reference(self, queries: Float[Array, "T Hq D"], kv_pages: Array, md: AttentionMetadata, *,
                  sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None
                  ) -> Float[Array, "T Hq D"]:
        """The pure-JAX path; a windowed layer skips the cascade (its shared prefix may lie outside the window)."""
        return ragged_paged_attention(
            queries, kv_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs, sm_scale=sm_scale,
            max_q_len=md.max_q_len, num_common_pages=md.num_common_pages if sliding_window is None else None,
            trim_rows=md.trim_rows, sliding_window=sliding_window, soft_cap=soft_cap, layout=self.layout)

    def write(self, kv_pages: Array, k: Float[Array, "T Hkv D"], v: Float[Array, "T Hkv D"],
              slot_mapping: Int[Array, "T"]) -> Array:
        """This step's K and V into the cache (`KVLayout.write`)."""
        return self.layout.write(kv_pages, k, v, slot_mapping)

    def head_kernel(self) -> AttentionKernel:
        """The kernel of an EAGLE-3 head's own cache (the engine's layout, in the head's dtype)."""
        return AttentionKernel()

    def describe(self) -> str:
        """Which steps it serves, and why (`Engine.stats().attention_kernel`)."""
        return "pure JAX (runner.ragged_attention) for every step"


REFERENCE = AttentionKernel()


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
    kernel: AttentionKernel = dataclasses.field(metadata=dict(static=True), default=REFERENCE)  # the backend's


def paged_attention(queries: Float[Array, "T Hq D"], kv_pages: Array, md: AttentionMetadata, *, sm_scale: float,
                    sliding_window: int | None = None, soft_cap: float | None = None) -> Float[Array, "T Hq D"]:
    """The engine's one attention boundary: the step's kernel (`md.kernel`). A layer with a `sliding_window`
    (keys more than that many positions back are not attended) or a score `soft_cap` (`cap * tanh(s / cap)`,
    Gemma) runs wherever the kernel supports it, else on the reference."""
    return md.kernel(queries, kv_pages, md, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)


def paged_slots(page_indices: Int[Array, "... W"], positions: Int[Array, "..."], page_size: int, num_slots: int,
                valid: Array | bool = True) -> Int[Array, "..."]:
    """The KV slot of each position through its sequence's page table (`page_indices[..., i]`: the block
    holding positions [i * page_size, (i + 1) * page_size)); `num_slots` (a write there is dropped)
    where not `valid`, for a negative position, or past the table."""
    page = positions // page_size
    blocks = jnp.take_along_axis(page_indices, page[..., None], axis=-1, mode="clip")[..., 0]
    ok = valid & (positions >= 0) & (page < page_indices.shape[-1])
    return jnp.where(ok, blocks * page_size + positions % page_size, num_slots)


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
