"""The attention impls a backend can run (`EngineConfig.attention_backend`), each an `AttentionKernel` with its
KV layout (`runner.attention`, `runner.kv_layout`), made for a model's heads by `attention_kernel`.

| impl | kernel | layout |
| --- | --- | --- |
| `jax` | the pure-JAX ragged paged attention, every step | the engine's |
| `cpu_kernel` | the CPU backend's C++ kernel (`runner.backends.cpu.attention`) | the engine's (bfloat16 as bits) |
| `pallas_gpu`, `pallas_tpu` (+ `_interpret`) | JAX's Pallas `paged_attention` for decode rows | the engine's |
| `tpu_ragged` (+ `_interpret`) | JAX's Pallas TPU `ragged_paged_attention`, every step | fused, padded where needed |
| `tpu_ragged_jax` | the pure-JAX path over the TPU kernel's layout | fused |
"""

from __future__ import annotations

from jax.sharding import Mesh

from runner.attention import AttentionKernel
from runner.backends.cpu.attention import CpuPagedAttention
from runner.backends.pallas_attention import PallasDecodeAttention
from runner.kv_layout import FusedKVLayout, KVLayout
from runner.tpu_attention import BlockSizes, TpuRaggedAttention

ATTENTION_IMPLS = ("jax", "cpu_kernel", "pallas_gpu", "pallas_gpu_interpret", "pallas_tpu", "pallas_tpu_interpret",
                   "tpu_ragged", "tpu_ragged_interpret", "tpu_ragged_jax")


def attention_kernel(impl: str, *, num_q_heads: int, num_kv_heads: int, head_dim: int, cache_dtype: str,
                     bits: bool, blocks: BlockSizes, tensor_parallel: Mesh | None = None) -> AttentionKernel:
    """The kernel of `impl` for a model's heads and cache dtype. `bits`: a bfloat16 cache in the engine's
    layout is held as its uint16 bits (the CPU backend's); `blocks`: the TPU ragged kernel's tiling;
    `tensor_parallel`: a mesh whose `model` axis splits the heads (the TPU kernel then runs on each
    device's heads)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {ATTENTION_IMPLS}")
    if impl in ("tpu_ragged", "tpu_ragged_interpret"):
        return TpuRaggedAttention.for_model(num_q_heads, num_kv_heads, head_dim, cache_dtype, blocks,
                                            interpret=impl.endswith("_interpret"), mesh=tensor_parallel)
    if impl == "tpu_ragged_jax":
        return AttentionKernel(FusedKVLayout.unpadded(num_kv_heads, head_dim))
    if impl.startswith("pallas_"):  # the kernels read their bfloat16 cache as it is
        return PallasDecodeAttention(KVLayout(), platform=impl.split("_")[1], interpret=impl.endswith("_interpret"))
    layout = KVLayout(bits=bits)
    return CpuPagedAttention(layout) if impl == "cpu_kernel" else AttentionKernel(layout)
