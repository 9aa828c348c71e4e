"""JAX's Pallas TPU `ragged_paged_attention` kernel itself, run by Pallas's generic interpreter on CPU
(`runner.tpu_attention`), inside the engine.

Runs in its own virtualenv (`.ci/run`: `.venv-tpu`, JAX 0.10.0, the newest release whose interpreter
runs the kernel; 0.10.2's fails on it) and is skipped elsewhere. The kernel against its own pure-JAX
contract (`ref_ragged_paged_attention`), zero-padded heads and head_dim included; then engines with
`attention_backend="tpu_ragged_interpret"` against the CPU backend: prefill, chunked prefill, decode,
multi-step decode and n-gram verification steps, a sliding window and a score soft-cap, greedy and
seeded samples: tokens identical, logprobs within 1e-5 (float32).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from rollout import Engine, SamplingParams
from runner.attention import AttentionKernel, AttentionMetadata, paged_attention
from runner.models.gemma import GemmaForCausalLM
from runner.spec_decode.ngram import NgramConfig
from runner.tpu_attention import INTERPRET_BLOCKS, TpuRaggedAttention
from test_engine import CFG, ENGINE_KW, ByteTokenizer, make_model, rand_prompt

INTERPRETER_RUNS = tuple(int(p) for p in jax.__version__.split(".")[:3]) <= (0, 10, 0)
pytestmark = pytest.mark.skipif(not INTERPRETER_RUNS, reason=(
    f"jax {jax.__version__}'s generic Pallas interpreter cannot run the TPU ragged kernel (0.7.2-0.10.0 can); "
    "`.ci/run` runs this file in .venv-tpu with jax 0.10.0"))


def kernel_case(rng: np.random.Generator, q_lens: list[int], kv_lens: list[int], num_kv_heads: int, group: int,
                head_dim: int, kernel: TpuRaggedAttention, num_pages: int = 24, page: int = 16
                ) -> tuple[jax.Array, jax.Array, AttentionMetadata, jax.Array, jax.Array]:
    """Queries and a cache in the kernel's (padded) layout filled through its layout's write, and the unpadded K/V."""
    cache = kernel.shape
    width = -(-max(kv_lens) // page)
    tables = rng.permutation(num_pages)[:len(q_lens) * width].reshape(len(q_lens), width).astype(np.int32)
    tokens = sum(kv_lens)
    k = jnp.asarray(rng.standard_normal((tokens, num_kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((tokens, num_kv_heads, head_dim)), jnp.float32)
    slots = np.concatenate([tables[s, np.arange(n) // page] * page + np.arange(n) % page
                            for s, n in enumerate(kv_lens)]).astype(np.int32)
    kv = kernel.layout.write(jnp.zeros((num_pages, page, 2 * cache.padded_kv_heads, cache.padded_head_dim), jnp.float32),
                             k, v, jnp.asarray(slots))
    queries = jnp.asarray(rng.standard_normal((sum(q_lens), num_kv_heads * group, head_dim)), jnp.float32)
    md = AttentionMetadata(slot_mapping=jnp.zeros(sum(q_lens), jnp.int32), kv_lens=jnp.asarray(kv_lens, jnp.int32),
                           page_indices=jnp.asarray(tables),
                           cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
                           num_seqs=jnp.asarray([len(q_lens)], jnp.int32), max_q_len=max(q_lens), kernel=kernel)
    return queries, kv, md, k, v


@pytest.mark.parametrize("heads, head_dim, window, soft_cap", [
    ((2, 3), 128, None, None), ((2, 3), 128, 7, 2.0), ((3, 3), 64, None, None), ((3, 3), 64, 7, None),
    ((1, 4), 32, None, 2.0)])
def test_the_kernel_equals_its_reference(heads: tuple[int, int], head_dim: int, window: int | None,
                                         soft_cap: float | None) -> None:
    """A prefill from scratch, a chunked prefill and two decodes in one ragged step; the model's heads
    (2 KV x 3, head_dim 128) or zero-padded ones (SmolLM2's 3 KV heads and head_dim 64; head_dim 32)."""
    num_kv_heads, group = heads
    kernel = TpuRaggedAttention.for_model(num_kv_heads * group, num_kv_heads, head_dim, "float32", INTERPRET_BLOCKS,
                                          interpret=True)
    assert kernel.shape.padded == ((num_kv_heads, head_dim) != (2, 128))
    q_lens, kv_lens = [9, 5, 1, 1], [9, 40, 17, 33]
    queries, kv, md, k, v = kernel_case(np.random.default_rng(1), q_lens, kv_lens, num_kv_heads, group, head_dim, kernel)
    got = paged_attention(queries, kv, md, sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=soft_cap)
    unpadded = kv[:, :, :2 * num_kv_heads, :head_dim]
    want = ref_ragged_paged_attention(queries, unpadded, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
                                      sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=soft_cap)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)
    reference = AttentionKernel(kernel.layout)  # the pure-JAX path over the same (padded) cache
    jax_path = paged_attention(queries, kv, dataclasses.replace(md, kernel=reference), sm_scale=head_dim ** -0.5,
                               sliding_window=window, soft_cap=soft_cap)
    np.testing.assert_allclose(np.asarray(jax_path), np.asarray(want), atol=2e-6)


def _compare(cpu: Engine, tpu: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> None:
    for sp in params:
        for a, b in zip(cpu.generate(prompts, sp), tpu.generate(prompts, sp)):
            for x, y in zip(a.outputs, b.outputs):
                assert x.token_ids == y.token_ids
                np.testing.assert_allclose(x.logprobs.values, y.logprobs.values, atol=1e-5)


def test_an_engine_on_the_kernel_equals_the_cpu_backend() -> None:
    """Chunked prefill (a 90-token prompt in 64-token steps), multi-step decode, a shared prompt (n = 3)
    and n-gram verification: every step kind's attention through the interpreted kernel."""
    model = make_model()
    kw = dict(ENGINE_KW, num_scheduler_steps=4)
    rng = np.random.default_rng(0)
    prompts = [rand_prompt(rng, n) for n in (5, 19, 90)] + [[7, 8, 9, 10] * 6]  # the last one rewards lookup
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0),
              SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=8, ignore_eos=True, logprobs=0)]
    cpu = Engine.from_model(model, ByteTokenizer(), **kw)
    tpu = Engine.from_model(model, ByteTokenizer(), backend="tpu", attention_backend="tpu_ragged_interpret", **kw)
    stats = tpu.stats()
    assert stats.attention_impl == "tpu_ragged_interpret" and "head_dim 8 -> 128" in stats.attention_kernel
    assert tpu.runner.kv_caches[0].shape[-2:] == (2 * CFG.num_key_value_heads, 128)
    _compare(cpu, tpu, prompts, params)
    spec = dict(kw, speculative=NgramConfig(k=3, auto_disable=False))
    cpu_spec = Engine.from_model(model, ByteTokenizer(), **spec)
    tpu_spec = Engine.from_model(model, ByteTokenizer(), backend="tpu", attention_backend="tpu_ragged_interpret", **spec)
    _compare(cpu_spec, tpu_spec, prompts[3:], params[:1])
    assert tpu_spec.stats().speculative.drafted_tokens > 0


def test_a_sliding_window_and_soft_capped_model_on_the_kernel() -> None:
    """A tiny Gemma 2 (every other layer windowed to 8 positions, scores soft-capped): prompts longer
    than the window, decode past it."""
    cfg = dataclasses.replace(CFG, family="gemma2", num_attention_heads=6, num_key_value_heads=3, sliding_window=8,
                              sliding_layers=(0,), attn_logit_softcap=5.0, final_logit_softcap=30.0,
                              query_pre_attn_scalar=8.0, sandwich_norms=True, tie_word_embeddings=True)
    model = GemmaForCausalLM(cfg, rngs=nnx.Rngs(3))
    prompts = [rand_prompt(np.random.default_rng(i), n) for i, n in enumerate((23, 6))]
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=0)]
    cpu = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)
    tpu = Engine.from_model(model, ByteTokenizer(), backend="tpu", attention_backend="tpu_ragged_interpret", **ENGINE_KW)
    assert "heads 6 query / 3 KV -> 8 / 4" in tpu.stats().attention_kernel
    _compare(cpu, tpu, prompts, params)



def test_tensor_parallel_runs_the_kernel_on_each_devices_heads() -> None:
    """A (1, 2) mesh: the cache's KV heads split over the `model` axis, the kernel runs under `shard_map` on
    each device's share (head_dim zero-padded per device), tokens and logprobs as the CPU backend's."""
    model = make_model()
    kw = dict(ENGINE_KW, num_scheduler_steps=4)
    prompts = [rand_prompt(np.random.default_rng(i), n) for i, n in enumerate((5, 19, 70))]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0),
              SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=6, ignore_eos=True, logprobs=0)]
    cpu = Engine.from_model(model, ByteTokenizer(), **kw)
    tpu = Engine.from_model(model, ByteTokenizer(), mesh=(1, 2), backend="tpu", attention_backend="tpu_ragged_interpret",
                            **kw)
    stats = tpu.stats()
    assert stats.attention_impl == "tpu_ragged_interpret" and "on each of 2 devices' heads" in stats.attention_kernel
    cache = tpu.runner.kv_caches[0]
    assert cache.shape[-2:] == (2 * CFG.num_key_value_heads, 128)
    assert cache.sharding.spec[3] == "model"  # each device holds its own heads' K and V
    _compare(cpu, tpu, prompts, params)
