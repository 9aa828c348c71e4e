"""The TPU path, proven on CPU (docs/tpu.md): the KV cache in the layout of JAX's TPU `ragged_paged_attention`
(`[pages, page_size, 2 * kv_heads, head_dim]`, K and V interleaved per head), every attention call through
that kernel's contract.

(a) the engine's attention over that layout equals JAX's own `ref_ragged_paged_attention` on ragged
    batches (prefill pieces, chunked prefill and decodes mixed, page-crossing lengths, GQA, window,
    soft-cap), and the KV write puts K and V where the kernel reads them;
(b) the kernel's shapes per model (the model's heads, or zero-padded ones) and block sizes per chip; the
    kernel itself runs in tests/test_tpu_kernel.py (Pallas's interpreter, JAX 0.10.0: its own virtualenv);
(c) a tiny model generates with `attention_backend="tpu"` (the reference path off a TPU) with tokens
    identical and logprobs within 1e-5 of the CPU backend, on one device and a (1, 2) mesh;
(d) MoE on the TPU backend: Megablox `gmm` (interpret mode) equals `ragged_dot`, in the block and in the engine.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from rollout import Engine, SamplingParams
from runner.attention import AttentionKernel, AttentionMetadata, paged_attention
from runner.backends import TpuBackend, auto_attention_impl
from runner.kv_cache import KVCacheSpec
from runner.kv_layout import FusedKVLayout
from runner.tpu_attention import BLOCK_SIZES, TpuKernelShape, block_sizes_for
from test_engine import ENGINE_KW, ByteTokenizer, make_model, rand_prompt

HKV, GROUP, D, PAGE, NUM_PAGES = 2, 3, 8, 4, 40
LAYOUT = FusedKVLayout.unpadded(HKV, D)  # the TPU kernel's layout at this file's heads


def tpu_case(seed: int, q_lens: list[int], kv_lens: list[int], width: int, num_rows: int
             ) -> tuple[jax.Array, jax.Array, AttentionMetadata]:
    """Random queries, a random cache in the TPU layout and the metadata of a ragged step (padded rows)."""
    rng = np.random.default_rng(seed)
    kv = jnp.asarray(rng.standard_normal((NUM_PAGES, PAGE, 2 * HKV, D)), jnp.float32)
    queries = jnp.asarray(rng.standard_normal((sum(q_lens), HKV * GROUP, D)), jnp.float32)
    pad = num_rows - len(q_lens)
    tables = rng.permutation(NUM_PAGES)[:num_rows * width].reshape(num_rows, width).astype(np.int32)
    md = AttentionMetadata(
        slot_mapping=jnp.zeros(sum(q_lens), jnp.int32), kv_lens=jnp.asarray(kv_lens + [0] * pad, jnp.int32),
        page_indices=jnp.asarray(tables), cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * pad]),
                                                                  jnp.int32),
        num_seqs=jnp.asarray([len(q_lens)], jnp.int32), max_q_len=max(q_lens), kernel=AttentionKernel(LAYOUT))
    return queries, kv, md


CASES = {
    "decode": ([1, 1, 1, 1], [1, 5, 17, 24]),
    "mixed": ([7, 3, 1, 5], [7, 12, 20, 23]),  # a prefill from scratch, chunked prefills, a decode
    "pieces": ([10, 10, 4, 1, 7, 10, 2, 3, 5, 10], [12, 10, 9, 5, 12, 11, 6, 12, 12, 12]),  # grouped prefill path
}


@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, None), (None, 2.0), (3, 1.5)])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_in_the_tpu_layout_equals_jax_reference(case: str, window: int | None, soft_cap: float | None) -> None:
    q_lens, kv_lens = CASES[case]
    queries, kv, md = tpu_case(3, q_lens, kv_lens, width=-(-max(kv_lens) // PAGE), num_rows=len(q_lens) + 2)
    got = paged_attention(queries, kv, md, sm_scale=D ** -0.5, sliding_window=window, soft_cap=soft_cap)
    want = ref_ragged_paged_attention(queries, kv, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
                                      sm_scale=D ** -0.5, sliding_window=window, soft_cap=soft_cap)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)


def test_write_kv_puts_k_and_v_where_the_kernel_reads_them() -> None:
    kv = jnp.zeros((NUM_PAGES, PAGE, 2 * HKV, D), jnp.float32)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((3, HKV, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, HKV, D)), jnp.float32)
    slots = jnp.asarray([5 * PAGE + 2, 7 * PAGE, NUM_PAGES * PAGE + 1], jnp.int32)  # the last is out of range
    out = np.asarray(LAYOUT.write(kv, k, v, slots))
    for t, (page, offset) in enumerate([(5, 2), (7, 0)]):
        np.testing.assert_array_equal(out[page, offset, 0::2], np.asarray(k[t]))  # K of head h at 2h
        np.testing.assert_array_equal(out[page, offset, 1::2], np.asarray(v[t]))  # V at 2h + 1
    assert np.count_nonzero(out) == 2 * 2 * HKV * D  # the out-of-range token was dropped


@pytest.mark.parametrize("name, heads, head_dim, dtype, padded", [
    ("SmolLM2-135M", (9, 3), 64, "bfloat16", (12, 4, 128)),
    ("SmolLM2-135M", (9, 3), 64, "float32", (12, 4, 128)),
    ("Qwen3-0.6B", (16, 8), 128, "bfloat16", (16, 8, 128)),
    ("Gemma-3-1B", (4, 1), 256, "bfloat16", (4, 1, 256)),
    ("Llama-3-8B", (32, 8), 128, "bfloat16", (32, 8, 128)),
    ("Qwen2.5-1.5B", (12, 2), 128, "bfloat16", (12, 2, 128)),
    ("3 KV heads, float32", (6, 3), 128, "float32", (8, 4, 128)),
    ("5 KV heads, bfloat16", (10, 5), 128, "bfloat16", (16, 8, 128)),
])
def test_the_kernel_shape_each_model_runs_at(name: str, heads: tuple[int, int], head_dim: int, dtype: str,
                                             padded: tuple[int, int, int]) -> None:
    """The TPU ragged kernel's heads and head_dim per model (`TpuKernelShape`): the model's own where the
    kernel tiles them, else zero-padded (head_dim to a multiple of 128 lanes, KV heads to a count whose
    combined K/V axis tiles, each query group with its KV head), as the TPU backend lays out its cache."""
    shape = TpuKernelShape.for_model(*heads, head_dim, dtype)
    assert (shape.padded_q_heads, shape.padded_kv_heads, shape.padded_head_dim) == padded, name
    assert shape.padded == (padded != (*heads, head_dim))
    backend = TpuBackend("tpu_ragged", on_tpu=False, device_kind="TPU v5 lite")
    replicas, pages, page = 2, 40, 16
    spec = KVCacheSpec(1, replicas * pages, page, heads[1], head_dim, dtype, num_replicas=replicas)
    got = backend.attention_for(heads[0], heads[1], head_dim, dtype).layout.cache_shape(spec)
    assert got == (replicas, pages, page, 2 * padded[1], padded[2])
    assert backend.blocks == BLOCK_SIZES["TPU v5 lite"] and "TPU v5 lite" in backend.status().attention_kernel
    reference = TpuBackend("tpu_ragged_jax", on_tpu=False)  # the pure-JAX path reads the model's own layout
    assert reference.attention_for(heads[0], heads[1], head_dim, dtype).layout.cache_shape(spec) == (
        replicas, pages, page, 2 * heads[1], head_dim)
    assert "padded" not in reference.status().attention_kernel  # (no kernel shapes: "pure JAX for every step")


def test_the_tpu_backend_picks_the_kernel_and_block_sizes_per_chip() -> None:
    """"auto" on a TPU: the kernel for a bfloat16 cache on a mesh without a `model` axis, its pure-JAX
    reference otherwise; block sizes are passed for every chip generation, never looked up by the kernel."""
    assert auto_attention_impl("auto", "tpu", 1, "bfloat16") == "tpu_ragged"
    assert auto_attention_impl("auto", "tpu", 2, "bfloat16") == "tpu_ragged_jax"  # tensor parallel: GSPMD
    assert auto_attention_impl("auto", "tpu", 1, "float32") == "tpu_ragged_jax"
    for kind in ("TPU v4", "TPU v5 lite", "TPU v5", "TPU v6 lite", "TPU7x"):
        blocks = block_sizes_for(kind)
        pages, queries = blocks.for_shape(16, 64, 512)
        assert 64 % pages == 0 and pages * 16 <= blocks.kv_tokens and queries == blocks.queries
    assert block_sizes_for("cpu").for_shape(16, 6, 5) == (3, 5)  # the interpreter's: a divisor, the step's tokens


@pytest.mark.parametrize("mesh", [None, pytest.param((1, 2), marks=pytest.mark.slow)])
def test_engine_with_the_tpu_layout_equals_the_cpu_backend(mesh: tuple[int, int] | None) -> None:
    """Chunked prefill, multi-step decode, a shared prompt (n samples) and greedy/sampled rows."""
    model = make_model()
    kw = dict(ENGINE_KW, num_scheduler_steps=4)
    prompts = [rand_prompt(np.random.default_rng(i), n) for i, n in enumerate((5, 19, 90, 3))]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0),
              SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=12, ignore_eos=True, logprobs=0)]
    cpu = Engine.from_model(model, ByteTokenizer(), mesh=mesh, **kw)
    tpu = Engine.from_model(model, ByteTokenizer(), mesh=mesh, attention_backend="tpu", **kw)
    assert tpu.stats().attention_impl == "tpu_ragged_jax" and tpu.runner.kv_caches[0].ndim == 5
    for sp in params:
        for a, b in zip(cpu.generate(prompts, sp), tpu.generate(prompts, sp)):
            for x, y in zip(a.outputs, b.outputs):
                assert x.token_ids == y.token_ids
                np.testing.assert_allclose(x.logprobs.values, y.logprobs.values, atol=1e-5)


def test_megablox_gmm_equals_ragged_dot(tmp_path: Path) -> None:
    """The TPU backend's grouped matmul, interpreted, in the MoE block and through an engine's prefill."""
    pytest.importorskip("torch")
    from test_moe import hf_moe

    from runner.models.loader import load_model

    _, path = hf_moe(0, tmp_path)
    model, _ = load_model(str(path))
    block = model.layers[0].mlp
    x = jnp.asarray(np.random.default_rng(0).standard_normal((13, model.config.hidden_size)), jnp.float32)
    want = block(x)
    block.grouped_matmul = "megablox_interpret"
    np.testing.assert_allclose(np.asarray(block(x)), np.asarray(want), atol=1e-5)
    block.grouped_matmul = "ragged_dot"
    prompts = [rand_prompt(np.random.default_rng(30 + i), n) for i, n in enumerate((17, 30))]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    kw = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=64, block_size=16)
    ref = Engine.from_model(model, ByteTokenizer(), **kw).generate(prompts, sp)
    tpu = Engine.from_model(model, ByteTokenizer(), backend="tpu", **kw)
    assert tpu.runner.backend.grouped_matmul == "megablox_interpret"
    for a, b in zip(ref, tpu.generate(prompts, sp)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(a.outputs[0].logprobs.values, b.outputs[0].logprobs.values, atol=1e-5)
