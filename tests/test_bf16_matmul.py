"""The AVX512_BF16 matmul kernel (`runner/backends/cpu/bf16_matmul.py`), a bfloat16 model's matmuls without AMX:
both variants (VDPBF16PS, widened FMAs) against float64, against each other, row independence, gradients,
and a bfloat16 engine with `cpu_amx=False` against the reference backend; plus the bfloat16 embedding gather
(`runner.models.llama.embedding_rows`) that keeps XLA:CPU from converting the table."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollout.engine import Engine
from rollout.sampling_params import SamplingParams
from runner.backends.cpu import bf16_matmul as bf16
from runner.backends.cpu.amx_matmul import pack_kernel
from runner.models.config import ModelConfig
from runner.backends.cpu.amx_matmul import packed_rows as packed_embedding_rows
from runner.models.embedding import embedding_rows
from runner.models.llama import Linear, LlamaForCausalLM
from tests.test_engine import ByteTokenizer

needs_kernel = pytest.mark.skipif(not bf16.load().available, reason=f"kernel unavailable: {bf16.load().reason}")
INTEL = "GenuineIntel" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False


def _operands(m: int, k: int, n: int, seed: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.bfloat16)
    return x, w


@needs_kernel
@pytest.mark.parametrize("m, k, n", [(1, 32, 16), (7, 96, 48), (13, 64, 80), (64, 576, 1536), (70, 1536, 576)])
def test_both_variants_match_float64_and_each_other(m: int, k: int, n: int) -> None:
    """Float32 sums of exact bfloat16 products: the error is a float32 GEMM's relative to sum |x w| (row
    counts with partial register blocks, column counts with partial groups of 4 tiles). The FMA variant adds
    each pair in the order Intel documents for VDPBF16PS, so on Intel CPUs the two agree bit for bit."""
    x, w = _operands(m, k, n, m * k + n)
    packed = pack_kernel(w)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))
    got = {}
    for dot in (True, False):
        y = jax.jit(functools.partial(bf16.bf16_matmul, dot=dot))(x.astype(jnp.float32), packed)
        assert y.shape == (m, n) and y.dtype == jnp.float32
        got[dot] = np.asarray(y)
        assert np.max(np.abs(got[dot] - want) / scale) < 5e-7
    if INTEL:
        np.testing.assert_array_equal(got[True], got[False])
    else:
        np.testing.assert_allclose(got[True], got[False], rtol=0, atol=float(np.max(scale)) * 2e-7)


@needs_kernel
@pytest.mark.parametrize("dot", [True, False])
def test_bfloat16_output_rounds_as_xla_converts(dot: bool) -> None:
    """With bfloat16 activations the kernel stores bfloat16: bit for bit XLA's convert of its float32 sums
    (ties to even; a NaN weight gives NaN, never an infinity)."""
    x, w = _operands(20, 96, 64, 3)
    w = w.at[5, 7].set(jnp.nan)
    packed = pack_kernel(w)
    fn = jax.jit(functools.partial(bf16.bf16_matmul, dot=dot))
    got = fn(x, packed)
    assert got.dtype == jnp.bfloat16
    want = fn(x.astype(jnp.float32), packed).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint16) & 0xFFFF),
                                  np.asarray(jax.lax.bitcast_convert_type(want, jnp.uint16)))
    assert np.isnan(np.asarray(got[:, 7], np.float32)).all() and not np.isinf(np.asarray(got, np.float32)).any()


@needs_kernel
@pytest.mark.parametrize("dot", [True, False])
def test_rows_do_not_depend_on_each_other(dot: bool) -> None:
    """Row r of an M-row product is bitwise that row's product alone or in any other batch."""
    x, w = _operands(100, 576, 192, 1)
    fn = jax.jit(functools.partial(bf16.bf16_matmul, dot=dot))
    packed = pack_kernel(w)
    full = np.asarray(fn(x, packed).astype(jnp.float32))
    for rows in (slice(0, 1), slice(37, 38), slice(5, 21), slice(64, 100)):
        np.testing.assert_array_equal(np.asarray(fn(x[rows], packed).astype(jnp.float32)), full[rows])


@needs_kernel
def test_gradient_with_respect_to_x() -> None:
    x, w = _operands(12, 64, 48, 2)
    x = x.astype(jnp.float32)
    g = jax.grad(lambda x: (bf16.bf16_matmul(x, pack_kernel(w), dot=False) ** 2).sum())(x)
    want = jax.grad(lambda x: ((x @ w.astype(jnp.float32)) ** 2).sum())(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=2e-2, atol=2e-2)


def test_the_faster_instruction_is_measured() -> None:
    """`dot_speed` is a positive ratio where the kernel loads (0 where it does not), and the choice follows it."""
    speed = bf16.dot_speed()
    assert (speed > 0) == bf16.load().available
    assert bf16.prefers_dot() == (speed > 1.25)


@needs_kernel
def test_a_bfloat16_engine_without_amx_uses_the_kernel() -> None:
    """`cpu_amx=False` on a bfloat16 model: every Linear and the tied head packed in one part and computed by
    this kernel (the FMA variant up to MAX_ROWS rows, XLA's dot past it: a 270-token prompt's prefill; the
    VDPBF16PS variant at every row count, in chunks of MAX_ROWS), greedy tokens equal to
    the reference backend's (XLA's bfloat16 dots) and logprobs within bfloat16 rounding."""
    cfg = ModelConfig(family="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                      max_position_embeddings=512, dtype="bfloat16", param_dtype="bfloat16")
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    kw = dict(max_num_seqs=4, max_model_len=320, max_num_batched_tokens=288)
    cpu = Engine.from_model(model, ByteTokenizer(), backend="cpu", cpu_amx=False, **kw)
    ref = Engine.from_model(model, ByteTokenizer(), backend="reference", **kw)
    stats = cpu.stats()
    assert stats.cpu_bf16_matmul.startswith("ok: ") and "VDPBF16PS" in stats.cpu_bf16_matmul
    assert stats.cpu_amx == "turned off by EngineConfig(cpu_amx=False)"
    linears = [m for _, m in nnx.iter_modules(cpu.runner.model) if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.packed[...].shape[2] == 1 for m in linears)
    assert all(m.matmul.bf16_kernel in ("dot", "fma") for m in linears)
    assert bf16.MAX_ROWS < 270 <= 288
    prompts = [[5, 9, 33, 2, 71], [8] * 12, list(np.arange(270) * 7 % 128)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    for a, b in zip(cpu.generate(prompts, sp), ref.generate(prompts, sp)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(a.outputs[0].logprobs.values, b.outputs[0].logprobs.values, atol=5e-2)


@needs_kernel
def test_a_bfloat16_engine_without_amx_repacks_after_sync_weights() -> None:
    """The kernel and the embedding gather read packed copies: after `sync_weights` they hold the new
    policy, i.e. the engine's outputs equal those of an engine built from the new weights, bit for bit."""
    cfg = ModelConfig(family="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                      max_position_embeddings=128, dtype="bfloat16", param_dtype="bfloat16")
    kw = dict(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=64, cpu_amx=False)
    old, new = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), LlamaForCausalLM(cfg, rngs=nnx.Rngs(1))
    engine = Engine.from_model(old, ByteTokenizer(), **kw)
    assert engine.runner.model.packed_head is not None  # the embedding rows come from it
    prompts = [[5, 9, 33, 2, 71], [8] * 12, [40, 41, 42]]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    before = engine.generate(prompts, sp)
    engine.sync_weights(nnx.state(new, nnx.Param))
    after = engine.generate(prompts, sp)
    fresh = Engine.from_model(new, ByteTokenizer(), **kw).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in fresh]
    for a, f, b in zip(after, fresh, before):
        np.testing.assert_array_equal(a.outputs[0].logprobs.values, f.outputs[0].logprobs.values)
        assert not np.array_equal(a.outputs[0].logprobs.values, b.outputs[0].logprobs.values)


def test_bfloat16_embedding_rows_are_the_gather_with_its_gradient() -> None:
    table = jnp.asarray(np.random.default_rng(0).standard_normal((50, 8)), jnp.bfloat16)
    ids = jnp.asarray([[1, 3, 3], [49, 0, 1]])
    np.testing.assert_array_equal(np.asarray(embedding_rows(table, ids), np.float32), np.asarray(table[ids], np.float32))
    grads = [jax.jit(jax.grad(lambda t, f=f: (f(t).astype(jnp.float32) ** 2).sum()))(table)
             for f in (lambda t: embedding_rows(t, ids), lambda t: t[ids])]
    assert grads[0].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(grads[0], np.float32), np.asarray(grads[1], np.float32))


def test_embedding_rows_from_the_packed_head() -> None:
    """A bfloat16 tied embedding packed for the head gives back its rows bit for bit (any ids, any shape)."""
    table = jnp.asarray(np.random.default_rng(1).standard_normal((96, 64)), jnp.bfloat16)
    ids = jnp.asarray([[0, 17, 95], [31, 16, 1]])
    got = packed_embedding_rows(pack_kernel(table.T), ids)
    assert got.dtype == jnp.bfloat16 and got.shape == (2, 3, 64)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(table[ids], np.float32))
