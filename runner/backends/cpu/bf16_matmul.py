"""Bfloat16 matmuls on AVX512_BF16 dot products for CPUs without AMX (`runner/backends/cpu/kernels/bf16_matmul.cc`).

XLA:CPU computes a bfloat16 dot by converting both operands to float32 in every call, so without AMX a
bfloat16 model ran slower than the same model in float32. This kernel multiplies bfloat16 activations by
the bfloat16 weights as they are stored (packed once by `amx_matmul.pack_kernel`, the layout VDPBF16PS
reads as well as AMX), summing the exact products in float32 and reading 2 bytes per weight. The CPU
backend uses it for a bfloat16 model's matmuls where AMX is missing or turned off
(`EngineConfig(cpu_amx=False)`).

Two variants compute the same exact products (`dot`): VDPBF16PS, or each bfloat16 weight vector widened to
float32 in registers and FMAs. `dot_speed()` times both instructions on this core once per process; the
CPU backend takes VDPBF16PS where it does more multiply-adds per second than FMA (AMD Zen 4 is built
so), the FMAs elsewhere (the Intel Xeon VM here: VDPBF16PS at 0.5x).

The kernel is built on first use (`runner.backends.cpu.kernel_build`) on CPUs with AVX512_BF16; `load()`
says whether it is usable and, if not, why. `EngineConfig(cpu_bf16_matmul=False)` leaves it out.
"""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, BFloat16, Float, UInt16

from runner.backends.cpu.amx_matmul import unpack_kernel
from runner.backends.cpu.kernel_build import KernelStatus, cpu_flags, load_kernel

_TARGET, _TARGET_BF16_OUT = "jax_rollout_bf16_matmul", "jax_rollout_bf16_matmul_bf16_out"
# Rows per kernel call. Past it the FMA variant hands over to XLA's dot: at 512 rows (SmolLM2's layer shapes,
# 2-core Xeon) XLA's dot was 3% faster than it, at 256 even (170 vs 168 ms), at 64 slower (54 vs 44). The
# VDPBF16PS variant takes every row count in chunks of this many: on a 2-core Zen 4 a layer's seven matmuls
# at 512 rows took 8.9 ms against XLA's 18.2 (which converts each weight to float32 per call), at 1024 16.1 vs 26.5.
MAX_ROWS = 256


@functools.cache
def load() -> KernelStatus:
    """Build (once per machine) and register the kernel for this process."""
    if "avx512_bf16" not in cpu_flags():
        return KernelStatus(False, "the CPU has no AVX512_BF16")
    status = load_kernel("bf16_matmul.cc", {_TARGET: "Bf16Matmul", _TARGET_BF16_OUT: "Bf16MatmulBf16Out"})
    if status.available and status.library and ctypes.CDLL(status.library).jax_rollout_bf16_matmul_built() != 0:
        return KernelStatus(False, "the C++ compiler did not target AVX512_BF16 (-march=native); XLA's dot is kept")
    return status


@functools.cache
def dot_speed() -> float:
    """VDPBF16PS multiply-adds per second over float32 FMA's on this core (0 where the kernel is unusable)."""
    status = load()
    if not status.available or status.library is None:
        return 0.0
    speed = ctypes.CDLL(status.library).jax_rollout_bf16_dot_speed
    speed.restype = ctypes.c_double
    return float(speed())


def prefers_dot() -> bool:
    """Whether the dot-product variant is the faster one here (with a margin, so timing noise on a CPU
    where the two are close does not flip the choice from one process to the next)."""
    return dot_speed() > 1.25


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(x: BFloat16[Array, "M K"], packed: UInt16[Array, "N/16 K/32 1 16 16 2"], dot: bool, bf16_out: bool
            ) -> Float[Array, "M N"]:
    out = jax.ShapeDtypeStruct((x.shape[0], packed.shape[0] * 16), jnp.bfloat16 if bf16_out else jnp.float32)
    return jax.ffi.ffi_call(_TARGET_BF16_OUT if bf16_out else _TARGET, out)(x, packed, dot=dot)


def _forward(x: Array, packed: Array, dot: bool, bf16_out: bool) -> tuple[Array, Array]:
    return _matmul(x, packed, dot, bf16_out), packed


def _backward(dot: bool, bf16_out: bool, packed: Array, g: Array) -> tuple[Array, np.ndarray]:
    grad_x = (g @ unpack_kernel(packed).T).astype(jnp.bfloat16)
    return grad_x, np.zeros(packed.shape, jax.dtypes.float0)  # packed: derived, no gradient


_matmul.defvjp(_forward, _backward)


def bf16_matmul(x: Float[Array, "... K"], packed: UInt16[Array, "N/16 K/32 1 16 16 2"], dot: bool = True
                ) -> Float[Array, "... N"]:
    """`x @ w` with `packed = amx_matmul.pack_kernel(w)` of a bfloat16 `w` (needs `load().available`):
    `x` is rounded to bfloat16 (a bfloat16 model's activations already are); the float32 sums come back
    in `x`'s dtype (for bfloat16 rounded by the kernel as it stores them). `dot`: VDPBF16PS, else widened
    weights and FMAs. Differentiable in x (XLA's dot)."""
    y = _matmul(x.reshape(-1, x.shape[-1]).astype(jnp.bfloat16), packed, dot, x.dtype == jnp.bfloat16)
    return y.reshape(*x.shape[:-1], y.shape[-1]).astype(x.dtype)
