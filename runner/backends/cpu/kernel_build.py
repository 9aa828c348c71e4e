"""Builds the C++ XLA FFI kernels of `runner/backends/cpu/kernels/` for this CPU and registers them with JAX.

Each kernel source is compiled on first use with the system C++ compiler (`$CXX`, else `g++` or
`c++`) for this CPU (`-march=native`; x86 with AVX-512 only, the code is tuned for its 32 vector
registers) into `$JAX_ROLLOUT_CACHE_DIR` (default `~/.cache/jax-rollout`), keyed by the source,
jaxlib's version, the compiler and the CPU. `load_kernel` says whether a kernel is usable and, if
not, why; callers then keep XLA's own ops. Each kernel has an environment switch (`NAME=0` turns it off).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

KERNEL_DIR = Path(__file__).parent / "kernels"


@dataclasses.dataclass(frozen=True)
class KernelStatus:
    """Whether a CPU kernel can be used in this process, and why not when it cannot."""

    available: bool
    reason: str  # "ok" or what is missing
    library: str | None = None


def _cpu_id() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    return set(_cpu_id().split())


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(source: Path, compiler: str) -> Path:
    """The compiled library of `source`, built into the cache directory unless already there."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = ["-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC", "-w"]
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # pool_items.h and the like
    key = hashlib.sha256("\0".join([source.read_text(), *headers, jaxlib.__version__, version, _cpu_id(), *flags]).encode())
    cache = Path(os.environ.get("JAX_ROLLOUT_CACHE_DIR", Path.home() / ".cache" / "jax-rollout"))
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        cache = Path(tempfile.gettempdir()) / "jax-rollout"
        cache.mkdir(parents=True, exist_ok=True)
    library = cache / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    partial = cache / f"{library.name}.{os.getpid()}.tmp"  # concurrent builders (pytest-xdist) each rename theirs
    result = subprocess.run([compiler, *flags, f"-I{jax.ffi.include_dir()}", f"-I{source.parent}", str(source), "-o", str(partial)],
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
    os.replace(partial, library)
    return library


def load_kernel(source_name: str, targets: dict[str, str]) -> KernelStatus:
    """Build `kernels/<source_name>` and register its handler symbols (`targets`: FFI target -> symbol)."""
    if platform.system() != "Linux":
        return KernelStatus(False, f"built only on Linux, not {platform.system()}")
    if "avx512f" not in cpu_flags():
        return KernelStatus(False, "needs AVX-512 (built for AVX2 the matmul kernel was slower than XLA's dot)")
    compiler = _compiler()
    if compiler is None:
        return KernelStatus(False, "no C++ compiler found (set CXX or install g++)")
    try:
        library = _build(KERNEL_DIR / source_name, compiler)
        lib = ctypes.CDLL(str(library))
        for target, symbol in targets.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as err:
        return KernelStatus(False, f"could not build or load the kernel: {err}")
    return KernelStatus(True, "ok", str(library))
