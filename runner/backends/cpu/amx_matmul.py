"""Float32 matmuls on Intel AMX tiles through an FFI kernel (`runner/backends/cpu/kernels/amx_matmul.cc`).

AMX multiplies bfloat16 tiles into float32 sums. Splitting each float32 value exactly into three
bfloat16 parts (`split3`: truncation, so hi + mid + lo == x) and summing the six largest of the nine
part products gives float32 accuracy: the dropped terms are below 2^-24 of the result. On the 2-core
Sapphire-Rapids-class VM this ran the 30 layers' seven matmuls of SmolLM2 at 64 rows in ~50 ms where
the AVX-512 row kernel took ~65 and XLA's dot ~70 (docs/engineering-notes.md).

The weights are split and packed once (`pack_kernel`, a jitted JAX function: `[K, N]` float32 ->
`[N/16, K/32, 3, 16, 16, 2]` uint16, AMX's pair layout, 1.5x the float32 bytes) and kept next to the
float32 kernel (a `PackedKernel` of each `Linear`, added by the CPU backend, `runner/backends/cpu/backend.py`),
which packs them again whenever the parameters change (`sync_weights`). Each output tile is summed over k in one
fixed order, so a row's result does not depend on the other rows of the step.

A bfloat16 model's weights are packed with one part (`pack_kernel` of a bfloat16 kernel: its top bits are
all of it), and its activations are bfloat16 values too: the kernel then makes the one exact product per
tile, float32 sums of bfloat16 products (a bfloat16 matmul with float32 accumulation, as XLA's and
PyTorch's CPU bfloat16 dots), reading 2 bytes per weight; XLA's own bfloat16 dot on CPU converts every
weight to float32 in every step.

The kernel is built on first use (`runner.backends.cpu.kernel_build`) on CPUs with AMX-BF16 and a compiler that
knows it; `load()` says whether it is usable and, if not, why. `EngineConfig(cpu_amx=False)` leaves it out.
"""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, BFloat16, Float, Int, UInt16

from runner.backends.cpu.kernel_build import KernelStatus, cpu_flags, load_kernel

MIN_ROWS = 9  # fewer rows are bandwidth-bound: the float32 row kernel reads 4 bytes per weight, AMX 6
# Where the row kernel takes them, layer matmuls of fewer than 41 rows stay on it: with 64-row panels it
# beats AMX on the layer-shaped chain up to 40 rows (Xeon, medians: 32 rows 23.1 vs 28.2 ms, 40 rows 29.0
# vs 29.8; 48 rows 34.1 vs 29.8, 64 rows 45.0 vs 36.1).
DEFAULT_FROM_ROWS = 41


_TARGET, _TARGET_BF16 = "jax_rollout_amx_matmul", "jax_rollout_amx_matmul_bf16"


@functools.cache
def load() -> KernelStatus:
    """Build (once per machine), register the kernel and enable AMX tile data for this process."""
    flags = cpu_flags()
    if not {"amx_tile", "amx_bf16"} <= flags:
        return KernelStatus(False, "the CPU has no AMX-BF16")
    status = load_kernel("amx_matmul.cc", {_TARGET: "AmxMatmul", _TARGET_BF16: "AmxMatmulBf16"})
    if not status.available or status.library is None:
        return status
    code = ctypes.CDLL(status.library).jax_rollout_amx_enable()
    if code == -2:
        return KernelStatus(False, "the C++ compiler did not target AMX-BF16 (-march=native); XLA's dot is kept")
    if code != 0:
        return KernelStatus(False, "Linux refused AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)")
    return status


def takes(rows: int, row_kernel_max_rows: int, from_rows: int = DEFAULT_FROM_ROWS) -> bool:
    """Whether a matmul of `rows` rows with a packed kernel runs on AMX rather than on the row kernel
    (which takes up to `row_kernel_max_rows` rows; 0: off; AMX takes its rows from `from_rows` on) or
    XLA's dot."""
    return rows >= MIN_ROWS and (rows > row_kernel_max_rows or rows >= from_rows)


def shape_fits(w: Array) -> bool:
    """Whether a `[K, N]` kernel can be packed: K a multiple of 32, N of 16, float32 or bfloat16."""
    return (w.ndim == 2 and w.shape[0] % 32 == 0 and w.shape[1] % 16 == 0
            and w.dtype in (jnp.float32, jnp.bfloat16))


def split3(x: Float[Array, "..."]) -> tuple[UInt16[Array, "..."], UInt16[Array, "..."], UInt16[Array, "..."]]:
    """The bfloat16 bit patterns of x's exact three-part split (hi + mid + lo == x; for |x| below ~1e-33 a
    part would be a float32 subnormal and is flushed to zero, as AMX's arithmetic does anyway)."""
    mask = jnp.uint32(0xFFFF0000)
    hi = jax.lax.bitcast_convert_type(x, jnp.uint32) & mask
    rest = x - jax.lax.bitcast_convert_type(hi, jnp.float32)
    mid = jax.lax.bitcast_convert_type(rest, jnp.uint32) & mask
    lo = jax.lax.bitcast_convert_type(rest - jax.lax.bitcast_convert_type(mid, jnp.float32), jnp.uint32)
    return tuple((p >> 16).astype(jnp.uint16) for p in (hi, mid, lo))  # type: ignore[return-value]


@jax.jit
def pack_kernel(w: Float[Array, "K N"]) -> UInt16[Array, "N/16 K/32 P 16 16 2"]:
    """`w` split and laid out as AMX B tiles: packed[nb, kb, part, i, c, j] = part(w)[32 kb + 2 i + j, 16 nb + c];
    P = 3 parts for a float32 `w`, 1 (its bits) for a bfloat16 one."""
    K, N = w.shape
    if w.dtype == jnp.bfloat16:
        parts = jax.lax.bitcast_convert_type(w, jnp.uint16)[None]  # [1, K, N]
    else:
        parts = jnp.stack(split3(w))  # [3, K, N]
    return parts.reshape(parts.shape[0], K // 32, 16, 2, N // 16, 16).transpose(4, 1, 0, 2, 5, 3)


def unpack_kernel(packed: UInt16[Array, "N/16 K/32 P 16 16 2"]) -> Float[Array, "K N"]:
    """The kernel `packed` was made from, in float32 (exactly: the parts add up without rounding)."""
    nb, kb, num_parts = packed.shape[:3]
    parts = packed.transpose(2, 1, 3, 5, 0, 4).reshape(num_parts, kb * 32, nb * 16)
    f = jax.lax.bitcast_convert_type(parts.astype(jnp.uint32) << 16, jnp.float32)
    return f[0] if num_parts == 1 else (f[0] + f[1]) + f[2]


@jax.custom_vjp
def _matmul(x: Float[Array, "M K"], packed: UInt16[Array, "N/16 K/32 P 16 16 2"]) -> Float[Array, "M N"]:
    """float32 x -> float32 y; bfloat16 x (one-part weights) -> y rounded to bfloat16 by the kernel."""
    out = jax.ShapeDtypeStruct((x.shape[0], packed.shape[0] * 16), x.dtype)
    return jax.ffi.ffi_call(_TARGET_BF16 if x.dtype == jnp.bfloat16 else _TARGET, out)(x, packed)


def _forward(x: Array, packed: Array) -> tuple[Array, Array]:
    return _matmul(x, packed), packed


def _backward(packed: Array, g: Array) -> tuple[Array, np.ndarray]:
    grad_x = (g @ unpack_kernel(packed).T).astype(g.dtype)
    return grad_x, np.zeros(packed.shape, jax.dtypes.float0)  # packed: derived, no gradient


_matmul.defvjp(_forward, _backward)


def amx_matmul(x: Float[Array, "... K"], packed: UInt16[Array, "N/16 K/32 P 16 16 2"]) -> Float[Array, "... N"]:
    """`x @ w` with `packed = pack_kernel(w)` (needs `load().available`); differentiable in x (XLA's dot).
    With one part (a bfloat16 `w`), `x` must hold bfloat16 values; the result comes back in `x`'s dtype
    (a bfloat16 `x` goes in as it is and the kernel rounds y to bfloat16 as it stores it)."""
    bf16_io = x.dtype == jnp.bfloat16 and packed.shape[2] == 1
    y = _matmul(x.reshape(-1, x.shape[-1]).astype(jnp.bfloat16 if bf16_io else jnp.float32), packed)
    return y.reshape(*x.shape[:-1], y.shape[-1]).astype(x.dtype)


def packed_rows(packed: UInt16[Array, "V/16 H/32 1 16 16 2"], ids: Int[Array, "..."]) -> BFloat16[Array, "... H"]:
    """Rows `ids` of the bfloat16 table `E` [V, H] whose transpose was packed one-part (`pack_kernel(E.T)`:
    packed[nb, kb, 0, i, c, j] = E[16 nb + c, 32 kb + 2 i + j]): a gather of uint16 bits, no conversion."""
    rows = packed[ids // 16, :, 0, :, ids % 16, :]  # [..., H/32, 16, 2]
    return jax.lax.bitcast_convert_type(rows.reshape(*ids.shape, -1), jnp.bfloat16)
