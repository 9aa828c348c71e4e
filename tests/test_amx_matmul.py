"""The AMX matmul kernel (`runner/backends/cpu/amx_matmul.py`): the exact three-part split, the packed layout, values
against float64, row independence, gradients, and that the engine repacks after `sync_weights`."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollout.engine import Engine
from rollout.engine_config import EngineConfig
from rollout.sampling_params import SamplingParams
from runner.backends.cpu import amx_matmul as amx
from runner.backends.cpu.amx_matmul import MIN_ROWS, amx_matmul, load, pack_kernel, shape_fits, split3, unpack_kernel
from runner.models.config import ModelConfig
from runner.backends.base import Backend
from runner.backends.cpu.backend import CpuBackend
from runner.models.llama import Linear, LlamaForCausalLM
from runner.sharding import make_mesh
from tests.test_engine import ByteTokenizer

needs_amx = pytest.mark.skipif(not load().available, reason=f"AMX kernel unavailable: {load().reason}")


def _bits_to_f32(bits: jax.Array) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(bits.astype(jnp.uint32) << 16, jnp.float32))


def test_split_is_exact_and_packing_round_trips() -> None:
    """hi + mid + lo == x bit for bit (small, large, negative values; parts of |x| < ~1e-33 would be
    float32 subnormals, which XLA and AMX flush to zero), and unpack(pack(w)) == w."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4096).astype(np.float32) * s for s in (1e-25, 1e-3, 1.0, 1e30)])
    hi, mid, lo = (_bits_to_f32(p) for p in split3(jnp.asarray(x)))
    np.testing.assert_array_equal((hi + mid) + lo, x)
    assert np.all(np.abs(mid) <= np.abs(x) * 2.0**-7) and np.all(np.abs(lo) <= np.abs(x) * 2.0**-15)
    w = rng.standard_normal((96, 48), dtype=np.float32)
    packed = pack_kernel(jnp.asarray(w))
    assert packed.shape == (3, 3, 3, 16, 16, 2) and packed.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(unpack_kernel(packed)), w)
    # packed[nb, kb, part, i, c, j] = part(w)[32 kb + 2 i + j, 16 nb + c]
    assert packed[2, 1, 0, 5, 3, 1] == split3(jnp.asarray(w))[0][32 + 11, 32 + 3]
    assert shape_fits(jnp.zeros((64, 32))) and not shape_fits(jnp.zeros((48, 32))) and not shape_fits(jnp.zeros((64, 8)))


@needs_amx
@pytest.mark.parametrize("m, k, n", [(1, 32, 16), (9, 96, 48), (64, 576, 1536), (70, 1536, 576), (131, 64, 4096)])
def test_values_match_float64_reference(m: int, k: int, n: int) -> None:
    """Error relative to sum |x_k w_k| at float32 GEMM level (XLA's own dot is ~1e-7 here), for row
    counts that leave a partial tile and several 64-row groups."""
    rng = np.random.default_rng(m * k + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32) * 0.05
    got = np.asarray(jax.jit(amx_matmul)(jnp.asarray(x), pack_kernel(jnp.asarray(w))))
    want = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    assert got.shape == (m, n)
    assert np.max(np.abs(got - want) / scale) < 5e-7


@needs_amx
@pytest.mark.parametrize("m, k, n", [(1, 32, 16), (9, 96, 48), (70, 576, 1536)])
def test_bfloat16_weights_take_one_exact_product(m: int, k: int, n: int) -> None:
    """A bfloat16 kernel packs as one part (its bits); with bfloat16 activations every product is exact and
    the float32 sums round once to bfloat16: within one bfloat16 rounding of the float64 product."""
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.bfloat16)
    packed = pack_kernel(w)
    assert packed.shape == (n // 16, k // 32, 1, 16, 16, 2)
    np.testing.assert_array_equal(np.asarray(unpack_kernel(packed)), np.asarray(w, np.float32))
    got = np.asarray(jax.jit(amx_matmul)(x, packed))
    assert got.dtype == jnp.bfloat16
    # bfloat16 in and out: the kernel's rounding is bit for bit XLA's convert of its float32 sums
    f32_sums = jax.jit(amx_matmul)(x.astype(jnp.float32), packed)
    np.testing.assert_array_equal(got.view(np.uint16), np.asarray(f32_sums.astype(jnp.bfloat16)).view(np.uint16))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))
    assert np.max(np.abs(got.astype(np.float64) - want) / scale) < 2.0**-8


@needs_amx
def test_a_bfloat16_engine_runs_its_matmuls_on_amx() -> None:
    """A bfloat16 model on the CPU backend: every Linear and the tied head packed in one part, the KV cache
    kept as bfloat16 bits, and greedy tokens equal to the reference backend's (XLA's bfloat16 dots)."""
    cfg = ModelConfig(family="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                      max_position_embeddings=128, dtype="bfloat16", param_dtype="bfloat16")
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    kw = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32)
    cpu, ref = (Engine.from_model(model, ByteTokenizer(), backend=b, **kw) for b in ("cpu", "reference"))
    assert cpu.stats().cpu_amx == "ok" and cpu.runner.kv_caches[0].dtype == jnp.uint16
    layer = cpu.runner.model.layers[0].self_attn.q_proj
    assert layer.packed is not None and layer.packed[...].shape[2] == 1
    prompts = [[5, 9, 33, 2, 71], [8] * 12]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    for a, b in zip(cpu.generate(prompts, sp), ref.generate(prompts, sp)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(a.outputs[0].logprobs.values, b.outputs[0].logprobs.values, atol=5e-2)


@needs_amx
def test_rows_do_not_depend_on_each_other() -> None:
    """Row r of an M-row product is bitwise the product of that row alone, or within any other batch."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((100, 576), dtype=np.float32))
    packed = pack_kernel(jnp.asarray(rng.standard_normal((576, 192), dtype=np.float32)))
    fn = jax.jit(amx_matmul)
    full = np.asarray(fn(x, packed))
    for rows in (slice(0, 1), slice(37, 38), slice(5, 21), slice(64, 100)):
        np.testing.assert_array_equal(np.asarray(fn(x[rows], packed)), full[rows])


@needs_amx
def test_gradient_with_respect_to_x() -> None:
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((12, 64), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((64, 48), dtype=np.float32))
    g = jax.grad(lambda x: (amx_matmul(x, pack_kernel(w)) ** 2).sum())(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(jax.grad(lambda x: ((x @ w) ** 2).sum())(x)), rtol=1e-5, atol=1e-3)


CFG = ModelConfig(family="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  max_position_embeddings=256, tie_word_embeddings=True, eos_token_ids=(2,))


@needs_amx
def test_model_with_amx_computes_the_same_logits() -> None:
    """Every Linear and the tied output projection get a packed copy; MIN_ROWS tokens or more use it
    (AMX from MIN_ROWS rows here, not from the row kernel's limit)."""
    model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))
    backend = CpuBackend(make_mesh(None), dtype="float32", param_dtype="float32", attention_impl="jax",
                         amx_from_rows=MIN_ROWS)
    fast = backend.prepare(model)
    assert all(m.packed is None for _, m in nnx.iter_modules(model) if isinstance(m, Linear))
    assert all(m.packed is not None for _, m in nnx.iter_modules(fast) if isinstance(m, Linear))
    assert fast.packed_head is not None and model.packed_head is None
    plain = Backend().prepare(fast)  # e.g. an AMX engine's `model` handed to a mesh engine
    assert plain.packed_head is None and all(m.packed is None for _, m in nnx.iter_modules(plain)
                                             if isinstance(m, Linear))
    forward = jax.jit(lambda m, i, p: m.compute_logits(m.hidden_states(i, p)))
    for seq in (MIN_ROWS - 1, MIN_ROWS, 40, 130):
        ids = jnp.asarray(np.arange(seq)[None] * 7 % CFG.vocab_size)
        pos = jnp.arange(seq)[None]
        np.testing.assert_allclose(np.asarray(forward(fast, ids, pos)), np.asarray(forward(model, ids, pos)),
                                   rtol=1e-5, atol=1e-5)


def test_which_rows_go_to_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below MIN_ROWS never; where the row kernel takes the rows, only from FROM_ROWS (it is faster up to
    40 rows); without it (0) or past its limit (the tied head's 8), from MIN_ROWS. The threshold is an
    `EngineConfig` field, checked there; the environment is not read (`JAX_ROLLOUT_AMX_FROM_ROWS` is gone)."""
    assert not amx.takes(MIN_ROWS - 1, 0) and amx.takes(MIN_ROWS, 0)
    assert amx.takes(MIN_ROWS, 8) and not amx.takes(MIN_ROWS, 64)
    assert not amx.takes(40, 64, from_rows=41) and amx.takes(41, 64, from_rows=41)
    assert EngineConfig().cpu_amx_from_rows == amx.DEFAULT_FROM_ROWS == 41
    with pytest.raises(ValueError, match="cpu_amx_from_rows must be an integer >= 1, got 'sixteen'"):
        EngineConfig(cpu_amx_from_rows="sixteen")
    monkeypatch.setenv("JAX_ROLLOUT_AMX_FROM_ROWS", "9")  # no effect
    backend = CpuBackend(make_mesh(None), dtype="float32", param_dtype="float32", attention_impl="jax")
    assert backend.amx_from_rows == 41
    backend = CpuBackend(make_mesh(None), dtype="float32", param_dtype="float32", attention_impl="jax", amx_from_rows=9)
    assert backend.amx_from_rows == 9


@needs_amx
def test_engine_repacks_after_sync_weights() -> None:
    """Steps AMX takes read the packed kernels: after `sync_weights` they must be the new
    policy's, i.e. the engine's outputs equal those of an engine built from the new weights."""
    kw = dict(max_num_seqs=32, max_model_len=64, max_num_batched_tokens=128, block_size=16)
    prompts = [f"p{i}" for i in range(32)]  # decode steps of 32 rows: the layers on AMX (the head from 9)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    old, new = LlamaForCausalLM(CFG, rngs=nnx.Rngs(0)), LlamaForCausalLM(CFG, rngs=nnx.Rngs(1))
    engine = Engine.from_model(old, ByteTokenizer(), **kw)
    assert engine.stats().cpu_amx == "ok"
    before = engine.generate(prompts, sp)
    engine.sync_weights(nnx.state(new, nnx.Param))
    after = engine.generate(prompts, sp)
    fresh = Engine.from_model(new, ByteTokenizer(), **kw).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in fresh]
    assert [o.outputs[0].token_ids for o in after] != [o.outputs[0].token_ids for o in before]
    for a, f in zip(after, fresh):
        np.testing.assert_array_equal([lp.logprob for lp in a.outputs[0].logprobs],
                                      [lp.logprob for lp in f.outputs[0].logprobs])
