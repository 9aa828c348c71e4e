"""The few-row CPU matmul kernel (`runner/backends/cpu/row_matmul.py`): values, row independence, gradients, and
where the engine uses it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollout.engine import Engine
from rollout.sampling_params import SamplingParams
from runner.backends.base import XLA_MATMUL
from runner.backends.cpu.backend import CpuBackend, row_kernel_status
from runner.models.config import ModelConfig
from runner.models.llama import Linear, LlamaForCausalLM
from runner.backends.cpu.row_matmul import MAX_ROWS, MAX_ROWS_NT, load, row_matmul, row_matmul_nt
from runner.sharding import make_mesh
from tests.test_engine import ByteTokenizer

pytestmark = pytest.mark.skipif(not load().available, reason=f"row kernel unavailable: {load().reason}")

# K not a multiple of 16, N not a multiple of the kernel's strips, and N large enough for several chunks.
SHAPES = [(576, 1536), (40, 7), (37, 300), (64, 4099), (33, 20000)]


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_values_match_float64_reference(k: int, n: int, transposed: bool) -> None:
    rng = np.random.default_rng(k * n)
    max_rows = MAX_ROWS_NT if transposed else MAX_ROWS
    x = rng.standard_normal((max_rows, k), dtype=np.float32)
    w = rng.standard_normal((n, k) if transposed else (k, n), dtype=np.float32)
    want = x.astype(np.float64) @ (w.T if transposed else w).astype(np.float64)
    fn = jax.jit(row_matmul_nt if transposed else row_matmul)
    # every register-block size (1..8 rows together; past 8, groups of 6 and a remainder, in place up to
    # 20 rows, on copied panels past that)
    for rows in sorted({*range(1, min(max_rows, 8) + 1), *[r for r in (9, 12, 13, 16, 17, 20, 21, 31, 64) if r <= max_rows]}):
        got = np.asarray(fn(jnp.asarray(x[:rows]), jnp.asarray(w)))
        scale = np.abs(x[:rows]).astype(np.float64) @ np.abs(w.T if transposed else w)
        assert got.shape == (rows, n)
        assert np.all(np.abs(got - want[:rows]) <= 1e-6 * scale + 1e-6), (rows, k, n)


@pytest.mark.parametrize("transposed", [False, True])
def test_each_row_is_independent_of_the_others(transposed: bool) -> None:
    """Row r of an M-row product is bitwise the 1-row product of row r (XLA's GEMV and GEMM differ)."""
    rng = np.random.default_rng(1)
    k, n = 576, 3000
    max_rows = MAX_ROWS_NT if transposed else MAX_ROWS
    x = jnp.asarray(rng.standard_normal((max_rows, k), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((n, k) if transposed else (k, n), dtype=np.float32))
    fn = jax.jit(row_matmul_nt if transposed else row_matmul)
    full = np.asarray(fn(x, w))
    for rows in (1, 2, 4, 5) if transposed else (1, 2, 5, 8, 9, 13, 20, 21):
        for r in range(rows):
            np.testing.assert_array_equal(np.asarray(fn(x[r:r + rows], w))[0], full[r])


def test_gradients_equal_those_of_the_dot() -> None:
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 40), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((40, 24), dtype=np.float32))
    g = jnp.asarray(rng.standard_normal((3, 24), dtype=np.float32))
    for fn, ref, wt in [(row_matmul, lambda a, b: a @ b, w), (row_matmul_nt, lambda a, b: a @ b.T, w.T)]:
        got = jax.grad(lambda a, b: jnp.sum(fn(a, b) * g), argnums=(0, 1))(x, wt)
        want = jax.grad(lambda a, b: jnp.sum(ref(a, b) * g), argnums=(0, 1))(x, wt)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


TIED = ModelConfig(family="qwen3", vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                   max_position_embeddings=128, tie_word_embeddings=True, qk_norm=True, eos_token_ids=(2,))


def test_model_with_the_kernel_computes_the_same_logits() -> None:
    """Up to MAX_ROWS tokens take the kernel in Linear layers, up to MAX_ROWS_NT in the tied output
    projection; more take XLA's dot; the original model object is left unchanged."""
    model = LlamaForCausalLM(TIED, rngs=nnx.Rngs(0))
    backend = CpuBackend(make_mesh(None), dtype="float32", param_dtype="float32", attention_impl="jax", use_amx=False)
    fast = backend.prepare(model)
    assert all(m.matmul == XLA_MATMUL for _, m in nnx.iter_modules(model) if isinstance(m, Linear))
    assert all(m.matmul.row_max_rows == MAX_ROWS for _, m in nnx.iter_modules(fast) if isinstance(m, Linear))
    assert fast.head_matmul.row_max_rows == MAX_ROWS_NT
    for seq in (1, 4, 8, 12, MAX_ROWS + 3):
        ids = jnp.asarray(np.arange(seq)[None] * 7 % TIED.vocab_size)
        pos = jnp.arange(seq)[None]
        a = jax.jit(lambda m, i, p: m.compute_logits(m.hidden_states(i, p)))(model, ids, pos)
        b = jax.jit(lambda m, i, p: m.compute_logits(m.hidden_states(i, p)))(fast, ids, pos)
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


def test_where_the_engine_uses_it() -> None:
    model = LlamaForCausalLM(TIED, rngs=nnx.Rngs(0))
    assert row_kernel_status(make_mesh(None), "float32", "float32").available
    assert "mesh" in row_kernel_status(make_mesh((2, 1)), "float32", "float32").reason
    assert "float32" in row_kernel_status(make_mesh(None), "bfloat16", "bfloat16").reason
    assert "cpu_row_kernel=False" in row_kernel_status(make_mesh(None), "float32", "float32", enabled=False).reason
    engine = Engine.from_model(model, ByteTokenizer(), max_num_seqs=4, max_model_len=64,
                               max_num_batched_tokens=32, block_size=16)
    assert engine.stats().cpu_row_kernel == "ok"
    out = engine.generate(["ab", "cde"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
