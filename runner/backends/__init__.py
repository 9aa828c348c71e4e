"""Kernel backends, one per platform, behind `runner.backends.base.Backend`; `select_backend` picks one
per engine from its config. The CPU backend's C++ kernels are imported only when it is chosen.

| backend | matmul | attention ("auto") |
| --- | --- | --- |
| `reference` | XLA's dot | pure JAX (`runner.attention.ragged_paged_attention`), the oracle |
| `cpu` | row kernel / AMX where they build (`runner/backends/cpu/`) | the C++ paged kernel on one device, float32 |
| `gpu` | XLA's dot | JAX's Pallas GPU kernel for decode steps (no tensor parallelism) |
| `tpu` | XLA's dot | JAX's Pallas TPU decode kernel for a bfloat16 cache (no tensor parallelism) |
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import Mesh

from runner.attention import ATTENTION_IMPLS
from runner.backends.base import Backend

BACKENDS = ("auto", "reference", "cpu", "gpu", "tpu")


class GpuBackend(Backend):
    """XLA's dot; JAX's Pallas paged-attention kernel for decode steps."""

    name = "gpu"


class TpuBackend(Backend):
    """XLA's dot; JAX's Pallas TPU paged-attention kernel for decode steps with a bfloat16 cache."""

    name = "tpu"


def auto_attention_impl(backend: str, platform: str, model_axis: int, cache_dtype: str, num_devices: int = 1) -> str:
    """The attention impl for `attention_backend=backend` ("auto" or one of ATTENTION_IMPLS) on `platform`.

    "auto" takes the Pallas decode kernel of the device's platform when the cache is not sharded over
    a `model` axis; on TPU only for a bfloat16 cache, since that kernel rounds K/V to bfloat16 (with
    a float32 cache it would move logprobs off the trainer's by ~1e-2). On one CPU device with a
    float32 cache, the C++ kernel when it builds. Otherwise (and on the reference backend) pure JAX.
    """
    if backend != "auto":
        return backend
    if model_axis != 1:
        return "jax"
    if platform == "cpu" and num_devices == 1 and jnp.dtype(cache_dtype) == jnp.float32:
        from runner.backends.cpu.attention import load

        return "cpu_kernel" if load().available else "jax"
    if platform == "gpu":
        return "pallas_gpu"
    if platform == "tpu" and jnp.dtype(cache_dtype) == jnp.bfloat16:
        return "pallas_tpu"
    return "jax"


def select_backend(name: str, mesh: Mesh, *, dtype: str, param_dtype: str, cache_dtype: str,
                   attention_backend: str = "auto", cpu_row_kernel: bool = True, cpu_amx: bool = True,
                   cpu_amx_from_rows: int = 25) -> Backend:
    """The backend `name` ("auto": the mesh's platform) with its attention impl chosen."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    platform = mesh.devices.flat[0].platform
    kind = platform if name == "auto" else name
    if attention_backend not in ("auto", *ATTENTION_IMPLS):
        raise ValueError(f"unknown attention impl {attention_backend!r}; choose 'auto' or one of {ATTENTION_IMPLS}")
    if kind == "reference":
        attention = "jax" if attention_backend == "auto" else attention_backend
    else:
        attention = auto_attention_impl(attention_backend, kind, mesh.shape["model"], cache_dtype, mesh.size)
    if attention != "jax" and mesh.shape["model"] > 1:
        raise ValueError(f"attention impl {attention!r} runs unpartitioned: it needs a mesh whose 'model' axis "
                         f"is 1, got {mesh.shape['model']} (use 'jax')")
    if kind == "cpu":
        from runner.backends.cpu.backend import CpuBackend  # the C++ kernels: only on this path

        return CpuBackend(mesh, dtype=dtype, param_dtype=param_dtype, attention_impl=attention,
                          row_kernel=cpu_row_kernel, use_amx=cpu_amx, amx_from_rows=cpu_amx_from_rows)
    if kind == "gpu":
        return GpuBackend(attention)
    if kind == "tpu":
        return TpuBackend(attention)
    return Backend(attention)
