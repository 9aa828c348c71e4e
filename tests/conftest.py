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


# Seconds each test file took in a cold run of the main suite (2026-12-07, 2-core Zen 4, junit times).
# Only the order matters: files run heaviest first, so the two xdist workers (`.ci/run`, with
# `--no-loadscope-reorder`; xdist's own order is by test count) take the long files early and
# finish together instead of one worker running a long file alone at the end. New files sort last.
FILE_SECONDS = {
    "test_eagle3.py": 645, "test_batch_invariance.py": 466, "test_mesh.py": 351, "test_logits_processors.py": 326,
    "test_engine.py": 201, "test_gemma.py": 165, "test_spec_decode.py": 163, "test_engine_smollm.py": 148,
    "test_sampling_record.py": 142, "test_routed_experts.py": 132, "test_moe.py": 125, "test_sampler_blocks.py": 118,
    "test_compilation_cache.py": 104, "test_attention.py": 95, "test_tpu_path.py": 94, "test_multi_step.py": 67,
    "test_engine_requests.py": 66, "test_examples.py": 65, "test_model_oracle.py": 47, "test_multihost.py": 47,
    "test_sampler.py": 42, "test_server.py": 41, "test_engine_sync.py": 37, "test_bf16_matmul.py": 35,
    "test_checkpoint.py": 27, "test_colocation.py": 23, "test_row_matmul.py": 22, "test_cpu_attention.py": 22,
    "test_weight_sync.py": 21, "test_request_semantics.py": 11, "test_tokenizer.py": 8, "test_lag_admission.py": 7,
    "test_host_paths.py": 6, "test_async_engine.py": 5,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heaviest test files first (stable: each file keeps its own order)."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))
