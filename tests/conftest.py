"""Test session set-up: 8 fake CPU devices (for mesh tests) before JAX is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop every compiled program after each test module. An XLA:CPU executable keeps hundreds of
    memory mappings (its JIT-compiled kernels); the whole suite's programs together passed Linux's
    default `vm.max_map_count` (65530), and LLVM then segfaults inside a compilation."""
    yield
    import jax

    gc.collect()
    jax.clear_caches()
    gc.collect()
