"""Kernel backends, one per platform, behind `runner.backends.base.Backend`; `select_backend` picks one
per engine from its config. The CPU backend's C++ kernels are built only when first used.

| backend | matmul | attention ("auto") |
| --- | --- | --- |
| `reference` | XLA's dot | pure JAX (`runner.attention.ragged_paged_attention`), the oracle |
| `cpu` | row kernel / AMX where they build (`runner/backends/cpu/`) | the C++ paged kernel on one device, float32 |
| `gpu` | XLA's dot | JAX's Pallas GPU kernel for decode steps (no tensor parallelism) |
| `tpu` | XLA's dot; MoE experts through Megablox `gmm` | JAX's Pallas TPU `ragged_paged_attention` for every step, the cache in its layout (no tensor parallelism; off a TPU: the pure-JAX reference of that layout) |

`attention_backend="tpu"` puts the KV cache in the TPU ragged kernel's layout on any backend: on a TPU
every step runs that kernel ("tpu_ragged"), elsewhere its pure-JAX reference ("tpu_ragged_jax").
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from runner.backends.attention_kernels import ATTENTION_IMPLS
from runner.attention import AttentionKernel
from runner.backends.base import Backend, BackendStatus, ModuleT
from runner.backends.cpu.attention import load as load_cpu_attention
from runner.backends.cpu.backend import CpuBackend
from runner.tpu_attention import block_sizes_for

BACKENDS = ("auto", "reference", "cpu", "gpu", "tpu")


class GpuBackend(Backend):
    """XLA's dot; JAX's Pallas paged-attention kernel for decode steps."""

    name = "gpu"


class TpuBackend(Backend):
    """XLA's dot; JAX's Pallas TPU `ragged_paged_attention` for every step (the cache in its layout);
    mixture-of-experts matmuls through JAX's Megablox `gmm` (in interpret mode off a TPU)."""

    name = "tpu"

    def __init__(self, attention_impl: str, *, on_tpu: bool, device_kind: str = "cpu", mesh: Mesh | None = None) -> None:
        super().__init__(attention_impl)
        self.grouped_matmul = "megablox" if on_tpu else "megablox_interpret"
        self.device_kind = device_kind
        self.blocks = block_sizes_for(device_kind)  # the ragged kernel's tiling on this chip generation
        if mesh is not None and mesh.shape["model"] > 1:  # tensor parallel (data is 1: `auto_attention_impl`)
            self.tensor_parallel = mesh
        self.fallback = ""  # why the kernel asked for does not run

    def attention_for(self, num_q_heads: int, num_kv_heads: int, head_dim: int, cache_dtype: str) -> AttentionKernel:
        """The kernel's; on a tensor-parallel mesh whose devices' heads it cannot tile as they are, its pure-JAX
        reference over the same layout (and `stats()` says why)."""
        try:
            return super().attention_for(num_q_heads, num_kv_heads, head_dim, cache_dtype)
        except ValueError as err:
            if self.tensor_parallel is None or not self.attention_impl.startswith("tpu_ragged"):
                raise
            self.fallback, self.attention_impl = f" ({err})", "tpu_ragged_jax"
            return super().attention_for(num_q_heads, num_kv_heads, head_dim, cache_dtype)

    def status(self) -> BackendStatus:
        status = super().status()
        if self.attention_impl in ("tpu_ragged", "tpu_ragged_interpret"):
            return dataclasses.replace(status, attention_kernel=f"{status.attention_kernel} ({self.device_kind})")
        return dataclasses.replace(status, attention_kernel=status.attention_kernel + self.fallback)

    @property
    def min_buckets(self) -> tuple[int, int]:
        """Rows in multiples of the TPU's 8 sublanes, tokens of its 128 lanes: smaller pads up anyway."""
        return 8, 128

    def prepare(self, module: ModuleT, *, pack: bool = True) -> ModuleT:
        copy = super().prepare(module, pack=pack)
        for _, sub in nnx.iter_modules(copy):
            if hasattr(sub, "grouped_matmul"):  # a SparseMoE block
                sub.grouped_matmul = self.grouped_matmul
        return copy


def auto_attention_impl(backend: str, platform: str, model_axis: int, cache_dtype: str, num_devices: int = 1) -> str:
    """The attention impl for `attention_backend=backend` ("auto", "tpu" or one of ATTENTION_IMPLS) on `platform`.

    "tpu" (and "auto" on a TPU): the cache in the TPU ragged kernel's layout, every step through that
    kernel on a TPU with a bfloat16 cache, one device per replica or one replica over the `model` axis
    (the kernel on each device's heads) ("tpu_ragged"), else through the pure-JAX reference of that
    layout ("tpu_ragged_jax": a float32 cache stays exact; a mesh with both axes stays partitioned).
    "auto" elsewhere: on a GPU without tensor parallelism, the Pallas decode kernel; on one CPU device
    with a float32 or bfloat16 cache, the C++ kernel when it builds; otherwise pure JAX.
    """
    if backend == "tpu" or (backend == "auto" and platform == "tpu"):
        one_axis = model_axis == 1 or num_devices == model_axis
        kernel = platform == "tpu" and one_axis and jnp.dtype(cache_dtype) == jnp.bfloat16
        return "tpu_ragged" if kernel else "tpu_ragged_jax"
    if backend != "auto":
        return backend
    if model_axis != 1:
        return "jax"
    if platform == "cpu" and num_devices == 1 and jnp.dtype(cache_dtype) in (jnp.float32, jnp.bfloat16):
        return "cpu_kernel" if load_cpu_attention().available else "jax"
    if platform == "gpu":
        return "pallas_gpu"
    return "jax"


def select_backend(name: str, mesh: Mesh, *, dtype: str, param_dtype: str, cache_dtype: str,
                   attention_backend: str = "auto", cpu_row_kernel: bool = True, cpu_amx: bool = True,
                   cpu_amx_from_rows: int = 41, cpu_bf16_matmul: bool = True, batch_invariant: bool = False) -> Backend:
    """The backend `name` ("auto": the mesh's platform) with its attention impl chosen. `batch_invariant`:
    kernels that sum every row alike whatever shares the step (the CPU backend's; raises elsewhere)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    platform = mesh.devices.flat[0].platform
    kind = platform if name == "auto" else name
    if batch_invariant and kind != "cpu":
        raise ValueError(f"batch_invariant=True is implemented by the CPU backend only; the {kind!r} backend runs "
                         f"XLA's dot and reductions, whose order depends on the batch: use backend 'cpu' on CPU "
                         f"devices or batch_invariant=False")
    if attention_backend not in ("auto", "tpu", *ATTENTION_IMPLS):
        raise ValueError(f"unknown attention impl {attention_backend!r}; choose 'auto', 'tpu' or one of {ATTENTION_IMPLS}")
    requested = "tpu" if kind == "tpu" and attention_backend == "auto" else attention_backend
    if kind == "reference" and requested == "auto":
        attention = "jax"
    else:  # the TPU layout's kernel only on a TPU; the other kernels by the backend asked for
        on = platform if requested == "tpu" else kind
        attention = auto_attention_impl(requested, on, mesh.shape["model"], cache_dtype, mesh.size)
    if batch_invariant and requested == "auto" and kind == "cpu" and mesh.size > 1 and mesh.shape["model"] == 1:
        # data parallel: each device runs the C++ kernel on its replica
        attention = "cpu_kernel" if load_cpu_attention().available else attention
    splits_heads = attention in ("tpu_ragged", "tpu_ragged_interpret") and mesh.shape["data"] == 1
    if attention not in ("jax", "tpu_ragged_jax") and mesh.shape["model"] > 1 and not splits_heads:
        raise ValueError(f"attention impl {attention!r} runs unpartitioned: it needs a mesh whose 'model' axis "
                         f"is 1, got {mesh.shape['model']} (use 'jax'; the TPU ragged kernel splits heads on a "
                         "mesh of data axis 1)")
    if kind == "cpu":
        return CpuBackend(mesh, dtype=dtype, param_dtype=param_dtype, attention_impl=attention,
                          row_kernel=cpu_row_kernel, use_amx=cpu_amx, amx_from_rows=cpu_amx_from_rows,
                          bf16_matmul=cpu_bf16_matmul, batch_invariant=batch_invariant)
    if kind == "gpu":
        return GpuBackend(attention)
    if kind == "tpu":
        return TpuBackend(attention, on_tpu=platform == "tpu", device_kind=mesh.devices.flat[0].device_kind, mesh=mesh)
    return Backend(attention)
