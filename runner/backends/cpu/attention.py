"""Paged attention on XLA:CPU through an FFI kernel (`runner/backends/cpu/kernels/paged_attention.cc`): decode,
verification and prefill steps.

The pure-JAX `ragged_paged_attention` walks each sequence's pages in a `lax.while_loop`; on XLA:CPU
its iterations cost more in dispatch than in arithmetic at decode sizes, and it runs on one thread.
The kernel gives each (sequence, KV head) to XLA's intra-op pool and walks the pages 16 keys at a
time with an online softmax. A query row's result depends only on its own position and context, so
a verification row equals the decode row at that position bitwise.

Used for steps of at most `MAX_Q_LEN` queries per sequence (prefill steps attend in pieces of
`BucketConfig.query_block` = 32 queries, which the kernel takes as sequences: one 512-token R1 prefill
step 600 -> 450 ms, with ~350-token prompts 900 -> 500 ms against the reference's batched dots), a
float32 cache or a bfloat16 one stored as its uint16 bits (the CPU backend's bfloat16 cache: each
element widens exactly to float32 in the kernel; queries go in as float32, the result comes back in
the queries' dtype), one CPU device (or, `per_device`, each replica of a data-parallel mesh on its own).
Built on first use (`runner.backends.cpu.kernel_build`); `EngineConfig(attention_backend="jax")` leaves it out.
`CpuPagedAttention` is the attention callable the CPU backend puts in every step (`runner.attention`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from runner.attention import AttentionKernel, AttentionMetadata
from runner.backends.cpu.kernel_build import KernelStatus, load_kernel
from runner.kv_layout import KVLayout

MAX_Q_LEN = 64  # queries per sequence (or prefill piece) up to which a step uses the kernel
MAX_HEAD_DIM = 256
_TARGET = "jax_rollout_paged_attention"
_TARGET_BF16 = "jax_rollout_paged_attention_bf16"  # a bfloat16 cache as uint16 bits


@functools.cache
def load() -> KernelStatus:
    """Build (once per machine) and register the kernel for this process."""
    return load_kernel("paged_attention.cc", {_TARGET: "PagedAttention", _TARGET_BF16: "PagedAttentionBf16"})


def cpu_paged_attention(
    queries: Float[Array, "T Hq D"],
    kv_pages: Float[Array, "2 Hkv P page D"],
    kv_lens: Int[Array, "S"],
    page_indices: Int[Array, "S W"],
    cu_q_lens: Int[Array, "S+1"],
    num_seqs: Int[Array, "1"],
    *,
    sm_scale: float,
) -> Float[Array, "T Hq D"]:
    """`runner.attention.ragged_paged_attention`'s result from the kernel (needs `load().available`), in
    the queries' dtype.

    Tokens outside the first `num_seqs` sequences' query ranges, and rows without context, are zero.
    """
    if not supports(queries.dtype, kv_pages.dtype):
        raise ValueError(f"the CPU attention kernel takes float32 queries and cache, or bfloat16 queries and a "
                         f"bfloat16 cache as uint16 bits; got {queries.dtype} queries, {kv_pages.dtype} cache")
    if queries.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"the CPU attention kernel takes head_dim <= {MAX_HEAD_DIM}, got {queries.shape[-1]}")
    target = _TARGET if kv_pages.dtype == jnp.float32 else _TARGET_BF16
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(queries.shape, jnp.float32), vmap_method="sequential")
    i32 = lambda x: x.astype(jnp.int32)  # noqa: E731
    out = call(queries.astype(jnp.float32), kv_pages, i32(kv_lens), i32(page_indices), i32(cu_q_lens),
               i32(num_seqs), sm_scale=np.float32(sm_scale))
    return out.astype(queries.dtype)


def supports(query_dtype: jnp.dtype, cache_dtype: jnp.dtype) -> bool:
    """Whether the kernel takes these dtypes: a float32 cache with float32 queries, or a bfloat16 cache
    stored as uint16 bits with bfloat16 queries."""
    pair = (jnp.dtype(query_dtype), jnp.dtype(cache_dtype))
    return pair in ((jnp.dtype(jnp.float32), jnp.dtype(jnp.float32)), (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint16)))


@dataclasses.dataclass(frozen=True)
class CpuPagedAttention(AttentionKernel):
    """The C++ kernel for steps of at most `MAX_Q_LEN` queries per attention row in dtypes it takes; the
    pure-JAX reference for the rest and for sliding-window or soft-capped layers (the kernel has neither)."""

    name: ClassVar[str] = "cpu_kernel"
    per_device: ClassVar[bool] = True

    def __call__(self, queries: Float[Array, "T Hq D"], kv_pages: Array, md: AttentionMetadata, *, sm_scale: float,
                 sliding_window: int | None = None, soft_cap: float | None = None) -> Float[Array, "T Hq D"]:
        if (sliding_window is None and soft_cap is None and md.max_q_len <= MAX_Q_LEN
                and supports(queries.dtype, kv_pages.dtype) and queries.shape[-1] <= MAX_HEAD_DIM):
            return cpu_paged_attention(queries, kv_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
                                       sm_scale=sm_scale)
        return self.reference(queries, kv_pages, md, sm_scale=sm_scale, sliding_window=sliding_window,
                              soft_cap=soft_cap)

    def head_kernel(self) -> AttentionKernel:
        return CpuPagedAttention(KVLayout())

    def describe(self) -> str:
        return (f"the C++ paged attention for attention rows of <= {MAX_Q_LEN} queries (decode loops, verification, "
                f"ragged steps' pieces) over a float32 or a bfloat16 cache (held as uint16 bits); pure JAX for "
                "sliding-window and soft-capped layers")
