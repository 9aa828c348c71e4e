"""The CPU paged-attention kernel (`runner/backends/cpu/attention.py`): values against the float64 reference
(float32 cache, and a bfloat16 cache as uint16 bits), row independence (a verification row is bitwise the
decode row at its position), and the engine's use in float32 and bfloat16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout import Engine, SamplingParams
from runner.backends.cpu.attention import MAX_Q_LEN, cpu_paged_attention, load
from test_attention import reference
from test_engine import ENGINE_KW, ByteTokenizer, make_model, rand_prompt

pytestmark = pytest.mark.skipif(not load().available, reason=f"CPU attention kernel unavailable: {load().reason}")

NUM_PAGES = 64


def run_kernel(queries: np.ndarray, kv: np.ndarray, q_lens: list[int], kv_lens: list[int], tables: np.ndarray,
               num_seqs: int, num_tokens: int) -> np.ndarray:
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    padded = np.zeros((num_tokens, *queries.shape[1:]), np.float32)
    padded[:len(queries)] = queries
    fn = jax.jit(lambda q, c: cpu_paged_attention(q, c, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables),
                                                  jnp.asarray(cu), jnp.asarray([num_seqs], jnp.int32),
                                                  sm_scale=queries.shape[-1] ** -0.5))
    return np.asarray(fn(jnp.asarray(padded), jnp.asarray(kv)))


@pytest.mark.parametrize("kv_heads,group,head_dim,page", [(3, 3, 64, 16), (2, 3, 8, 4), (1, 4, 24, 5), (2, 1, 130, 32)])
def test_values_match_float64_reference(kv_heads: int, group: int, head_dim: int, page: int) -> None:
    """Ragged queries (decode rows, verification rows, a short prefill), contexts across tile and page
    boundaries, a context-less row, padding sequences and tokens: within float32 rounding of float64."""
    rng = np.random.default_rng(head_dim * page)
    q_lens, kv_lens = [1, 4, 1, 3, 6, 1, 0, 0], [1, 37, 16, 17, 6, 0, 0, 0]
    num_seqs, width = 6, 12  # the last two rows are padding; table width covers 60 tokens at page 5
    kv = rng.standard_normal((2, kv_heads, NUM_PAGES, page, head_dim)).astype(np.float32)
    tables = rng.permutation(NUM_PAGES * 2)[:len(q_lens) * width].reshape(len(q_lens), width).astype(np.int32)
    tables = np.minimum(tables, NUM_PAGES - 1)  # some ids repeat: sequences may share pages
    queries = rng.standard_normal((sum(q_lens), kv_heads * group, head_dim)).astype(np.float32)
    got = run_kernel(queries, kv, q_lens, kv_lens, tables, num_seqs, num_tokens=sum(q_lens) + 3)
    want = reference(queries, kv, q_lens, kv_lens, tables, head_dim ** -0.5)
    np.testing.assert_allclose(got[:len(queries)], want, atol=2e-6, rtol=1e-5)
    assert not got[len(queries):].any()  # tokens past the real sequences' queries are zero


@pytest.mark.parametrize("page", [16, 5])
def test_prefill_pieces_match_float64_reference(page: int) -> None:
    """Prefill steps send pieces of up to `BucketConfig.query_block` queries (32 by default; up to
    MAX_Q_LEN) as sequences: the first piece of a prompt, a piece deep in a 300-token context, a short
    last piece."""
    rng = np.random.default_rng(page)
    kv_heads, group, head_dim = 3, 3, 64
    q_lens, kv_lens = [32, 32, 17, MAX_Q_LEN], [32, 300, 81, 150]
    width = -(-300 // page)
    kv = rng.standard_normal((2, kv_heads, NUM_PAGES * 2, page, head_dim)).astype(np.float32)
    tables = rng.integers(0, NUM_PAGES * 2, (len(q_lens), width)).astype(np.int32)
    queries = rng.standard_normal((sum(q_lens), kv_heads * group, head_dim)).astype(np.float32)
    got = run_kernel(queries, kv, q_lens, kv_lens, tables, len(q_lens), num_tokens=sum(q_lens))
    want = reference(queries, kv, q_lens, kv_lens, tables, head_dim ** -0.5)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("head_dim,page", [(64, 16), (24, 5)])
def test_bfloat16_cache_matches_float64_reference(head_dim: int, page: int) -> None:
    """A bfloat16 cache stored as uint16 bits, bfloat16 queries: each element widens exactly, the arithmetic
    is float32, so the result is the float64 reference of the bfloat16 inputs rounded once to bfloat16."""
    rng = np.random.default_rng(head_dim + page)
    kv_heads, group = 2, 3
    q_lens, kv_lens = [1, 4, 1, 6, 0], [1, 37, 16, 6, 0]
    width = -(-37 // page)
    kv = jnp.asarray(rng.standard_normal((2, kv_heads, NUM_PAGES, page, head_dim)), jnp.bfloat16)
    tables = rng.integers(0, NUM_PAGES, (len(q_lens), width)).astype(np.int32)
    queries = jnp.asarray(rng.standard_normal((sum(q_lens), kv_heads * group, head_dim)), jnp.bfloat16)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    got = cpu_paged_attention(queries, jax.lax.bitcast_convert_type(kv, jnp.uint16), jnp.asarray(kv_lens, jnp.int32),
                              jnp.asarray(tables), jnp.asarray(cu), jnp.asarray([4], jnp.int32),
                              sm_scale=head_dim ** -0.5)
    assert got.dtype == jnp.bfloat16
    want = reference(np.asarray(queries, np.float32), np.asarray(kv, np.float32), q_lens, kv_lens, tables,
                     head_dim ** -0.5)
    rounded = np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32)
    ulp = np.abs(rounded) * 2.0 ** -7 + 1e-30  # one bfloat16 step at the result's magnitude
    assert (np.abs(np.asarray(got, np.float32) - rounded) <= ulp).all()


def test_a_row_depends_only_on_its_position_and_context() -> None:
    """Verification rows (4 queries of one sequence, batched with 40 others so the pool runs) equal, bit
    for bit, the one-query decode step at each position alone."""
    rng = np.random.default_rng(7)
    kv_heads, group, head_dim, page = 3, 3, 64, 16
    kv = rng.standard_normal((2, kv_heads, NUM_PAGES, page, head_dim)).astype(np.float32)
    num_seqs, width = 41, 16
    tables = rng.integers(0, NUM_PAGES, (num_seqs, width)).astype(np.int32)
    q_lens = [4] + [1] * (num_seqs - 1)
    kv_lens = [203] + list(rng.integers(100, 250, num_seqs - 1))
    queries = rng.standard_normal((sum(q_lens), kv_heads * group, head_dim)).astype(np.float32)
    batched = run_kernel(queries, kv, q_lens, kv_lens, tables, num_seqs, num_tokens=len(queries))
    for i in range(4):
        alone = run_kernel(queries[i:i + 1], kv, [1], [kv_lens[0] - 3 + i], tables[:1], 1, num_tokens=1)
        np.testing.assert_array_equal(batched[i], alone[0])


def test_engine_uses_the_kernel_and_matches_the_pure_jax_path() -> None:
    """"auto" on one CPU device picks the kernel; greedy and sampled tokens equal the pure-JAX path's,
    logprobs within float32 rounding (prefill pieces run in the kernel too)."""
    model = make_model()
    rng = np.random.default_rng(3)
    prompts = [rand_prompt(rng, n) for n in (5, 19, 11)]
    outs = {}
    for backend in ("jax", "auto"):
        engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, attention_backend=backend)
        assert engine.runner.attention_impl == ("jax" if backend == "jax" else "cpu_kernel")
        assert engine.stats().attention_impl == engine.runner.attention_impl
        outs[backend] = [engine.generate(prompts, SamplingParams(temperature=t, seed=4, max_tokens=12, logprobs=2))
                         for t in (0.0, 1.0)]
    for a_run, b_run in zip(outs["jax"], outs["auto"]):
        for a, b in zip(a_run, b_run):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            np.testing.assert_allclose([t.logprob for t in a.outputs[0].logprobs],
                                       [t.logprob for t in b.outputs[0].logprobs], atol=1e-5)


def test_bfloat16_engine_uses_the_kernel_and_matches_the_pure_jax_path() -> None:
    """A bfloat16 model: "auto" picks the kernel over the uint16-stored cache; greedy tokens equal the pure-JAX
    path's and logprobs agree within bfloat16 rounding (the kernel sums in float32, the reference in bfloat16)."""
    import dataclasses

    from flax import nnx

    from runner.models.llama import LlamaForCausalLM
    from test_engine import CFG

    model = LlamaForCausalLM(dataclasses.replace(CFG, dtype="bfloat16", param_dtype="bfloat16"), rngs=nnx.Rngs(2))
    rng = np.random.default_rng(5)
    prompts = [rand_prompt(rng, n) for n in (5, 19, 11)]
    outs = {}
    for backend in ("jax", "auto"):
        engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, attention_backend=backend)
        assert engine.runner.attention_impl == ("jax" if backend == "jax" else "cpu_kernel")
        assert engine.runner.kv_caches[0].dtype == jnp.uint16
        outs[backend] = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, logprobs=0))
    for a, b in zip(outs["jax"], outs["auto"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(a.outputs[0].logprobs.values, b.outputs[0].logprobs.values, atol=0.05)


def test_the_kernel_on_a_mesh_is_a_clear_error() -> None:
    """"auto" keeps the pure-JAX path on a mesh; asking for the kernel there says why it cannot run."""
    model = make_model()
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, mesh=(2, 1))
    assert engine.stats().attention_impl == "jax"
    with pytest.raises(ValueError, match="one CPU device"):
        Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, mesh=(2, 1), attention_backend="cpu_kernel")
