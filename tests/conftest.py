"""Test set-up: 8 fake CPU devices (for mesh tests) before JAX is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import gc  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


MAX_MAPPINGS = 30_000  # half of Linux's default vm.max_map_count


@pytest.fixture(autouse=True)
def _free_compiled_programs():
    """Drop the compiled programs no live engine holds, after a test, once the process holds many memory mappings.

    An XLA:CPU executable keeps hundreds of mappings (its JIT-compiled kernels); the whole suite's
    programs together passed Linux's default `vm.max_map_count` (65530), and LLVM then segfaults
    inside a compilation or an executable's serialization (tests/test_eagle3.py alone reached ~47k
    with every program freshly compiled). Clearing after every test would cost minutes of
    recompilation (tests share programs of the same model structure), so it happens only past
    MAX_MAPPINGS; engines still alive (module fixtures) keep their programs, and the rest reload
    from the executable store on disk when used again.
    """
    yield
    maps = Path("/proc/self/maps")
    if maps.exists() and sum(1 for _ in maps.open()) > MAX_MAPPINGS:
        import jax

        from runner.executable_store import open_store

        open_store.cache_clear()  # the executables the process loaded or compiled for its store
        gc.unfreeze()  # engines freeze the heap at start-up (EngineConfig.freeze_gc): dead ones must go too
        gc.collect()
        jax.clear_caches()
        gc.collect()


# Seconds each test file took in a clean-clone CI run (2026-12-03, 2-core machine, junit times).
# Only the order matters: files run heaviest first, so the two xdist workers (`.ci/run`, with
# `--no-loadscope-reorder`; xdist's own order is by test count) take the long files early and
# finish together instead of one worker running a long file alone at the end. New files sort last.
FILE_SECONDS = {
    "test_eagle3.py": 347, "test_mesh.py": 336, "test_spec_decode.py": 232, "test_engine.py": 189,
    "test_sampler.py": 100, "test_sampler_blocks.py": 85, "test_engine_smollm.py": 122, "test_multi_step.py": 93, "test_attention.py": 86,
    "test_checkpoint.py": 63, "test_model_oracle.py": 49, "test_examples.py": 49, "test_engine_sync.py": 39,
    "test_multihost.py": 26, "test_weight_sync.py": 23, "test_cpu_attention.py": 20, "test_row_matmul.py": 17,
    "test_tokenizer.py": 11, "test_amx_matmul.py": 14, "test_engine_requests.py": 80, "test_async_engine.py": 40,
    "test_request_semantics.py": 20, "test_server.py": 70, "test_compilation_cache.py": 70, "test_moe.py": 40, "test_sleep.py": 15,
    "test_routed_experts.py": 60, "test_batch_invariance.py": 250, "test_colocation.py": 35,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heaviest test files first (stable: each file keeps its own order)."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))
