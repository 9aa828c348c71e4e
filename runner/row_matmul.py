"""Few-row float32 matmuls on XLA:CPU through an FFI kernel (`runner/cpu_kernels/row_matmul.cc`).

XLA:CPU computes a 1-row dot as a single-threaded GEMV and 2..8 rows as a YNNPACK GEMM that reads
the weights at about half the memory bandwidth. On the 2-core CPU the 30 layers' matmuls of SmolLM2
took 24 / 31 / 40 / 50 ms for 1 / 2 / 4 / 8 rows; the kernel (all rows per pass over the weights,
each of XLA's intra-op threads streaming one contiguous part of them) 21 / 23 / 25 / 31-33 ms.
Decode at B <= 8 and B=1 verification steps are such few-row steps. Each output is summed in the
same order whatever the row count, so a row's result does not depend on which other rows share the
step.

The kernel is compiled on first use with the system C++ compiler (`$CXX`, else `g++` or `c++`) for
this CPU (`-march=native`; x86 with AVX-512 only) into `$JAX_ROLLOUT_CACHE_DIR` (default
`~/.cache/jax-rollout`), keyed by the source, jaxlib's version, the compiler and the CPU. `load()`
says whether it is usable and, if not, why; the model then keeps XLA's dot.
`JAX_ROLLOUT_ROW_KERNEL=0` turns it off.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
from jaxtyping import Array, Float

MAX_ROWS = 8
SOURCE = Path(__file__).parent / "cpu_kernels" / "row_matmul.cc"
_TARGET, _TARGET_NT = "jax_rollout_row_matmul", "jax_rollout_row_matmul_nt"


@dataclasses.dataclass(frozen=True)
class RowKernelStatus:
    """Whether the few-row kernel can be used in this process, and why not when it cannot."""

    available: bool
    reason: str  # "ok" or what is missing
    library: str | None = None


def _cpu_id() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(compiler: str) -> Path:
    """The compiled library, built into the cache directory unless already there."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = ["-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC", "-w"]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), jaxlib.__version__, version, _cpu_id(), *flags]).encode())
    cache = Path(os.environ.get("JAX_ROLLOUT_CACHE_DIR", Path.home() / ".cache" / "jax-rollout"))
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        cache = Path(tempfile.gettempdir()) / "jax-rollout"
        cache.mkdir(parents=True, exist_ok=True)
    library = cache / f"row_matmul-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    partial = cache / f"{library.name}.{os.getpid()}.tmp"  # concurrent builders (pytest-xdist) each rename theirs
    result = subprocess.run([compiler, *flags, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(partial)],
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
    os.replace(partial, library)
    return library


@functools.cache
def load() -> RowKernelStatus:
    """Build (once per machine) and register the kernel for this process."""
    if os.environ.get("JAX_ROLLOUT_ROW_KERNEL", "1") == "0":
        return RowKernelStatus(False, "turned off by JAX_ROLLOUT_ROW_KERNEL=0")
    if platform.system() != "Linux":
        return RowKernelStatus(False, f"built only on Linux, not {platform.system()}")
    if "avx512f" not in _cpu_id().split():
        return RowKernelStatus(False, "needs AVX-512 (built for AVX2 it was slower than XLA's dot)")
    compiler = _compiler()
    if compiler is None:
        return RowKernelStatus(False, "no C++ compiler found (set CXX or install g++)")
    try:
        library = _build(compiler)
        lib = ctypes.CDLL(str(library))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.RowMatmul), platform="cpu")
        jax.ffi.register_ffi_target(_TARGET_NT, jax.ffi.pycapsule(lib.RowMatmulNT), platform="cpu")
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as err:
        return RowKernelStatus(False, f"could not build or load the kernel: {err}")
    return RowKernelStatus(True, "ok", str(library))


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
    """`x @ w.T` for 1..MAX_ROWS float32 rows: a tied embedding `[V, H]` as the output projection."""
    return _row_matmul_nt(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
