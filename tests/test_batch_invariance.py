"""Batch-invariant mode (`EngineConfig(batch_invariant=True)`): one request's raw logprobs are bitwise the same
whatever shares its steps (0 to 63 other requests with random prompts and sampling settings), however its
prompt is chunked (token budgets 32 / 64 / 128), whether its prefix came from the cache, after preemption,
with n-gram speculation, with one or eight decode steps per call and with async scheduling. Without the
mode the same comparison differs (so the test can fail)."""

from __future__ import annotations

import numpy as np
import pytest

from rollout import Engine, NgramConfig, SamplingParams
from runner.backends.cpu.amx_matmul import load as load_amx
from test_engine import ByteTokenizer, make_model, rand_prompt

pytestmark = pytest.mark.skipif(not load_amx().available, reason=f"needs the AMX matmul: {load_amx().reason}")

TARGET = rand_prompt(np.random.default_rng(0), 40)
TARGET_SP = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True, logprobs=0)


def companions(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    prompts = [rand_prompt(rng, int(rng.integers(3, 60))) for _ in range(n)]
    params = [SamplingParams(temperature=float(rng.choice([0.0, 0.7, 1.0])), top_p=float(rng.choice([1.0, 0.9])),
                             top_k=int(rng.choice([0, 20])), seed=i, max_tokens=int(rng.integers(4, 30)),
                             ignore_eos=True, logprobs=int(rng.choice([0, 2])), n=int(rng.choice([1, 2])))
              for i in range(n)]
    return prompts, params


def target_bits(model: object, n: int, seed: int = 0, before: list[list[int]] | None = None, **config: object
                ) -> tuple[list[int], np.ndarray]:
    kw = dict(max_num_seqs=64, max_model_len=128, max_num_batched_tokens=64, block_size=16)
    engine = Engine.from_model(model, ByteTokenizer(), **{**kw, **config})
    if before:  # requests run first, leaving their KV blocks in the prefix cache
        engine.generate(before, SamplingParams(max_tokens=2))
    prompts, params = companions(n, seed)
    out = engine.generate([TARGET] + prompts, [TARGET_SP] + params)[0].outputs[0]
    return out.token_ids, np.asarray(out.logprobs.values, np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def alone(model) -> tuple[list[int], np.ndarray]:
    return target_bits(model, 0, batch_invariant=True)


@pytest.mark.parametrize("case", [
    dict(n=1), dict(n=7, seed=1), dict(n=31, seed=2), dict(n=63, seed=3),
    dict(n=7, seed=4, max_num_batched_tokens=32), dict(n=15, seed=5, max_num_batched_tokens=128),
    dict(n=7, seed=6, before=[TARGET[:35]]),  # its first two blocks come from the prefix cache
    dict(n=40, seed=7, kv_cache_blocks=24),  # too few blocks: sequences are preempted and recomputed
    dict(n=3, seed=8, speculative=NgramConfig(k=3)), dict(n=7, seed=9, num_scheduler_steps=1),
    dict(n=7, seed=10, async_scheduling=False),
])
def test_raw_logprobs_are_bitwise_the_same(model, alone, case: dict) -> None:
    tokens, bits = target_bits(model, batch_invariant=True, **case)
    assert tokens == alone[0]
    np.testing.assert_array_equal(bits, alone[1])


def test_without_the_mode_the_bits_move(model) -> None:
    """The default engine (row kernel below 25 rows, AMX above, C++ attention, cascade) gives other bits
    for the same request in a big batch: the comparison above is not vacuous."""
    _, alone_bits = target_bits(model, 0)
    _, crowd_bits = target_bits(model, 31, seed=2)
    assert not np.array_equal(alone_bits, crowd_bits)


def test_the_mode_is_refused_where_it_cannot_hold(model) -> None:
    with pytest.raises(ValueError, match="one CPU device with AMX"):
        Engine.from_model(model, ByteTokenizer(), batch_invariant=True, cpu_amx=False, max_model_len=64)
    with pytest.raises(ValueError, match="leave attention_backend='auto'"):
        Engine.from_model(model, ByteTokenizer(), batch_invariant=True, attention_backend="jax", max_model_len=64)
