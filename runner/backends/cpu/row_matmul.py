"""Few-row float32 matmuls on XLA:CPU through an FFI kernel (`runner/backends/cpu/kernels/row_matmul.cc`).

XLA:CPU computes a 1-row dot as a single-threaded GEMV and 2..8 rows as a YNNPACK GEMM that reads
the weights at about half the memory bandwidth. On the 2-core CPU the 30 layers' matmuls of SmolLM2
took 24 / 31 / 40 / 50 ms for 1 / 2 / 4 / 8 rows; the kernel (all rows per pass over the weights,
each of XLA's intra-op threads streaming one contiguous part of them) 21 / 23 / 25 / 31-33 ms, and
once it prefetched the next block of weight rows in software, 4 and 8 rows cost about what one does
(a layer-shaped chain: 17.5 / 18.7 / 21.3 ms at 1 / 4 / 8 rows on the Sapphire Rapids VM).
Decode at B <= 8 and B=1 verification steps are such few-row steps. From 9 to 64 rows (`x @ w`
only) groups of 6 rows take turns on each 64-row panel of weights (copied, the next one prefetched
meanwhile): the 30 layers' matmuls at 16 / 32 / 64 rows 15.5 / 22.9 / 44.8 ms on the Xeon (with 512-row
panels, read in place up to 20 rows, they were 18.9 / 30.8 / 47.4 ms; docs/engineering-notes.md). Each
output is summed in the same order whatever the row count, so a row's result does not depend on which
other rows share the step.

On CPUs with AMX-BF16, `runner.backends.cpu.amx_matmul` takes the layers' steps of 41 rows or more and the tied head's
past 8 (`amx_matmul.takes`, called by `Linear.__call__`).

The kernel is built on first use (`runner.backends.cpu.kernel_build`: AVX-512 CPUs with a C++ compiler); `load()`
says whether it is usable and, if not, why; the model then keeps XLA's dot.
`EngineConfig(cpu_row_kernel=False)` leaves it out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from runner.backends.cpu.kernel_build import KernelStatus, load_kernel

MAX_ROWS = 64  # x @ w (Flax kernels)
MAX_ROWS_NT = 8  # x @ w.T (the tied output projection); more rows: XLA's dot is faster
_TARGET, _TARGET_NT = "jax_rollout_row_matmul", "jax_rollout_row_matmul_nt"


@functools.cache
def load() -> KernelStatus:
    """Build (once per machine) and register the kernel for this process."""
    return load_kernel("row_matmul.cc", {_TARGET: "RowMatmul", _TARGET_NT: "RowMatmulNT"})


def _kernel_with_dot_gradients(target: str, transposed: bool) -> Callable[[Array, Array], Array]:
    """The FFI call for `target`, differentiable (the backward pass uses XLA's dots)."""

    @jax.custom_vjp
    def matmul(x: Array, w: Array) -> Array:
        num_out = w.shape[0] if transposed else w.shape[1]
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], num_out), jnp.float32))(x, w)

    def forward(x: Array, w: Array) -> tuple[Array, tuple[Array, Array]]:
        return matmul(x, w), (x, w)

    def backward(res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
        x, w = res
        return (g @ w, g.T @ x) if transposed else (g @ w.T, x.T @ g)

    matmul.defvjp(forward, backward)
    return matmul


_row_matmul = _kernel_with_dot_gradients(_TARGET, transposed=False)
_row_matmul_nt = _kernel_with_dot_gradients(_TARGET_NT, transposed=True)


def row_matmul(x: Float[Array, "... K"], w: Float[Array, "K N"]) -> Float[Array, "... N"]:
    """`x @ w` for 1..MAX_ROWS float32 rows in all (leading axes flattened; needs `load().available`)."""
    return _row_matmul(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])


def row_matmul_nt(x: Float[Array, "... K"], w: Float[Array, "N K"]) -> Float[Array, "... N"]:
    """`x @ w.T` for 1..MAX_ROWS_NT float32 rows: a tied embedding `[V, H]` as the output projection."""
    return _row_matmul_nt(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
