"""Test session set-up: 8 fake CPU devices (for mesh tests) before JAX is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import gc  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


MAX_MAPPINGS = 30_000  # half of Linux's default vm.max_map_count


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop every compiled program after a test module once the process holds many memory mappings.

    An XLA:CPU executable keeps hundreds of mappings (its JIT-compiled kernels); the whole suite's
    programs together passed Linux's default `vm.max_map_count` (65530), and LLVM then segfaults
    inside a compilation. Clearing after every module would cost minutes of recompilation (modules
    share programs of the same model structure), so it happens only past MAX_MAPPINGS.
    """
    yield
    maps = Path("/proc/self/maps")
    if maps.exists() and sum(1 for _ in maps.open()) > MAX_MAPPINGS:
        import jax

        gc.collect()
        jax.clear_caches()
        gc.collect()
