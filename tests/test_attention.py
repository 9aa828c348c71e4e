"""Paged attention against a numpy reference, and the Pallas GPU and TPU kernels (interpret mode) on the same cache.

On a GPU (`JAX_PLATFORMS=cuda,cpu JAX_DEFAULT_MATMUL_PRECISION=float32`, as `examples/bench_gpu.sh` runs
this file) the compiled Pallas GPU kernel joins the interpret-mode ones; elsewhere those cases skip.

The reference gathers each sequence's context from its page table and runs plain causal softmax
attention in float64; the kernels under test read the paged cache `[2, Hkv, pages, page, D]`.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollout import Engine, SamplingParams
from runner.attention import (MULTIPLY_REDUCE_MAX_ROWS, PIECES_PER_GROUP, AttentionKernel, AttentionMetadata,
                              paged_attention, ragged_paged_attention)
from runner.backends import auto_attention_impl
from runner.backends.attention_kernels import attention_kernel
from runner.backends.cpu.attention import load as load_cpu_attention
from runner.kv_layout import KVLayout
from runner.tpu_attention import INTERPRET_BLOCKS
from runner.models.llama import LlamaForCausalLM
from runner.step_padding import num_common_pages
from test_engine import ENGINE_KW, ByteTokenizer, make_model, rand_prompt

HKV, GROUP, D, PAGE, NUM_PAGES = 2, 3, 8, 4, 40
write_kv = KVLayout().write  # the engine's layout (a float32 cache)


def kernel_of(impl: str) -> AttentionKernel:
    """The attention callable a backend running `impl` puts in every step, for this file's heads."""
    return attention_kernel(impl, num_q_heads=HKV * GROUP, num_kv_heads=HKV, head_dim=D, cache_dtype="float32",
                            bits=False, blocks=INTERPRET_BLOCKS)
ON_GPU = jax.default_backend() == "gpu"
GPU_ONLY = pytest.mark.skipif(not ON_GPU, reason="the compiled Pallas GPU kernel needs a GPU (JAX_PLATFORMS=cuda)")


def reference(queries: np.ndarray, kv: np.ndarray, q_lens: list[int], kv_lens: list[int],
              tables: np.ndarray, sm_scale: float, window: int | None = None, soft_cap: float | None = None
              ) -> np.ndarray:
    """Causal GQA of each sequence's queries over its first kv_len cached tokens (float64 numpy); with a
    `window`, position p sees keys p - window + 1 .. p only; `soft_cap` maps scores to cap * tanh(s / cap)."""
    num_kv_heads, head_dim = kv.shape[1], kv.shape[-1]
    group = queries.shape[1] // num_kv_heads
    out = np.zeros(queries.shape, np.float64)
    start = 0
    for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        if kv_len == 0:  # a padding row: no context, output zero
            start += q_len
            continue
        ctx = kv[:, :, tables[s]].reshape(2, num_kv_heads, -1, head_dim)[:, :, :kv_len].astype(np.float64)
        for i in range(q_len):
            pos = kv_len - q_len + i
            first = 0 if window is None else max(0, pos - window + 1)
            for h in range(num_kv_heads * group):
                scores = ctx[0, h // group, first:pos + 1] @ queries[start + i, h].astype(np.float64) * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                p = np.exp(scores - scores.max())
                out[start + i, h] = (p / p.sum()) @ ctx[1, h // group, first:pos + 1]
        start += q_len
    return out


def random_case(seed: int, q_lens: list[int], kv_lens: list[int], width: int):
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((2, HKV, NUM_PAGES, PAGE, D)).astype(np.float32)
    tables = rng.permutation(NUM_PAGES)[:len(q_lens) * width].reshape(len(q_lens), width).astype(np.int32)
    queries = rng.standard_normal((sum(q_lens), HKV * GROUP, D)).astype(np.float32)
    return queries, kv, tables


@pytest.mark.parametrize("q_lens,kv_lens,max_q_len", [
    ([1, 1, 1, 1], [1, 5, 17, 24], 1),  # decode, contexts across page and chunk boundaries
    ([7, 3, 1], [7, 12, 20], 8),  # prefill from scratch, a chunked prefill continuing a context, a decode
])
def test_ragged_paged_attention_matches_reference(q_lens: list[int], kv_lens: list[int], max_q_len: int) -> None:
    width = 6
    queries, kv, tables = random_case(0, q_lens, kv_lens, width)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    got = ragged_paged_attention(jnp.asarray(queries), jnp.asarray(kv), jnp.asarray(kv_lens, jnp.int32),
                                 jnp.asarray(tables), jnp.asarray(cu), jnp.asarray([len(q_lens)], jnp.int32),
                                 sm_scale=D ** -0.5, max_q_len=max_q_len)
    want = reference(queries, kv, q_lens, kv_lens, tables, D ** -0.5)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)


@pytest.mark.parametrize("q_lens,kv_lens,max_q_len,common", [
    ([1, 1, 1, 0], [13, 17, 24, 0], 1, 3),  # decode over a shared prefix, a padding row
    ([1, 1, 1], [9, 17, 24], 1, 2),  # the shared prefix ends exactly at the shortest context's query page
    ([4, 3, 1], [20, 12, 17], 8, 2),  # prefill pieces and a decode after a shared prefix
    ([1], [23], 1, 5),  # one sequence: its whole context before the query is "common"
    ([1, 1], [9, 24], 1, 0),  # nothing shared
])
def test_cascade_over_common_pages_matches_reference(q_lens: list[int], kv_lens: list[int], max_q_len: int,
                                                      common: int) -> None:
    """Pages shared by every sequence, attended once for the batch, give the same attention."""
    queries, kv, tables = random_case(4, [max(q, 1) for q in q_lens], kv_lens, width=6)
    queries = queries[:sum(q_lens)]
    tables[:, :common] = tables[0, :common]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    assert num_common_pages(tables[:sum(1 for q in q_lens if q)], np.array([k - q for q, k in zip(q_lens, kv_lens) if q]),
                            PAGE) >= common
    got = ragged_paged_attention(jnp.asarray(queries), jnp.asarray(kv), jnp.asarray(kv_lens, jnp.int32),
                                 jnp.asarray(tables), jnp.asarray(cu), jnp.asarray([len(q_lens)], jnp.int32),
                                 sm_scale=D ** -0.5, max_q_len=max_q_len, num_common_pages=jnp.asarray([common], jnp.int32))
    np.testing.assert_allclose(np.asarray(got), reference(queries, kv, q_lens, kv_lens, tables, D ** -0.5), atol=2e-6)


@pytest.mark.parametrize("common", [None, 1])
def test_prefill_pieces_in_groups_match_reference(common: int | None) -> None:
    """Prefill pieces run in groups of PIECES_PER_GROUP, only up to the last real piece, each group to
    its own longest context: padding pieces after `num_seqs` stay zero and real ones stay exact."""
    q_lens = [10, 10, 4, 1, 7, 10, 2, 3, 5, 10, 1, 6]
    kv_lens = [12, 10, 9, 5, 12, 11, 6, 12, 12, 12, 8, 11]
    max_q_len = 10
    assert GROUP * max_q_len > MULTIPLY_REDUCE_MAX_ROWS and len(q_lens) > PIECES_PER_GROUP  # the grouped path
    queries, kv, tables = random_case(5, q_lens, kv_lens, width=3)
    if common:
        q_lens, kv_lens = [min(q, k - 4) for q, k in zip(q_lens, kv_lens)], kv_lens  # queries after page 1
        queries = queries[:sum(q_lens)]
        tables[:, :common] = tables[0, :common]
    num_real = len(q_lens)
    padded_tables = np.concatenate([tables, np.zeros((3, tables.shape[1]), np.int32)])  # 3 padding pieces
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * 3]).astype(np.int32)
    got = ragged_paged_attention(jnp.asarray(queries), jnp.asarray(kv), jnp.asarray(kv_lens + [0] * 3, jnp.int32),
                                 jnp.asarray(padded_tables), jnp.asarray(cu), jnp.asarray([num_real], jnp.int32),
                                 sm_scale=D ** -0.5, max_q_len=max_q_len,
                                 num_common_pages=None if common is None else jnp.asarray([common], jnp.int32))
    np.testing.assert_allclose(np.asarray(got), reference(queries, kv, q_lens, kv_lens, tables, D ** -0.5), atol=2e-6)


@pytest.mark.parametrize("window,soft_cap", [(3, None), (6, 2.0), (None, 1.5), (1, None)])
@pytest.mark.parametrize("path", ["decode", "mixed", "groups", "trim"])
def test_sliding_window_and_soft_cap_match_reference(window: int | None, soft_cap: float | None, path: str) -> None:
    """Gemma's per-layer attention: keys past the window are not attended (including whole chunks the
    walk skips), scores are soft-capped; on every path of the pure-JAX kernel and through
    `paged_attention` whatever `impl` the engine picked."""
    cases = {"decode": ([1, 1, 1, 1], [1, 5, 17, 24], 1), "mixed": ([7, 3, 1], [7, 12, 20], 8),
             "groups": ([10, 10, 4, 1, 7, 10, 2, 3, 5, 10, 1, 6], [12, 10, 9, 5, 12, 11, 6, 12, 12, 12, 8, 11], 10),
             "trim": ([5, 1, 3], [12, 9, 7], 8)}
    q_lens, kv_lens, max_q_len = cases[path]
    width = 3 if path in ("groups", "trim") else 6
    queries, kv, tables = random_case(7, q_lens, kv_lens, width)
    pad = 2 if path in ("groups", "trim") else 0
    tables = np.concatenate([tables, np.zeros((pad, width), np.int32)])
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * pad]).astype(np.int32)
    md = AttentionMetadata(slot_mapping=jnp.zeros(sum(q_lens), jnp.int32), kv_lens=jnp.asarray(kv_lens + [0] * pad, jnp.int32),
                           page_indices=jnp.asarray(tables), cu_q_lens=jnp.asarray(cu),
                           num_seqs=jnp.asarray([len(q_lens)], jnp.int32), max_q_len=max_q_len,
                           trim_rows=path == "trim", kernel=kernel_of("cpu_kernel"))
    want = reference(queries, kv, q_lens, kv_lens, tables, D ** -0.5, window, soft_cap)
    got = paged_attention(jnp.asarray(queries), jnp.asarray(kv), md, sm_scale=D ** -0.5, sliding_window=window,
                          soft_cap=soft_cap)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)
    if window is not None:  # the window changes the result: a test of it cannot pass without honouring it
        assert np.abs(want - reference(queries, kv, q_lens, kv_lens, tables, D ** -0.5, None, soft_cap)).max() > 1e-3


@pytest.mark.parametrize("num_real", [1, 2, 3, 8])
def test_trimmed_rows_match_reference(num_real: int) -> None:
    """`trim_rows` (verification steps) attends only the first power-of-two rows holding the real ones."""
    q_lens = [5, 1, 3, 4, 2, 5, 1, 2][:num_real]
    kv_lens = [12, 9, 7, 10, 5, 12, 3, 8][:num_real]
    queries, kv, tables = random_case(6, q_lens, kv_lens, width=3)
    padded_tables = np.concatenate([tables, np.zeros((8 - num_real, tables.shape[1]), np.int32)])
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * (8 - num_real)]).astype(np.int32)
    got = ragged_paged_attention(jnp.asarray(queries), jnp.asarray(kv), jnp.asarray(kv_lens + [0] * (8 - num_real), jnp.int32),
                                 jnp.asarray(padded_tables), jnp.asarray(cu), jnp.asarray([num_real], jnp.int32),
                                 sm_scale=D ** -0.5, max_q_len=8, trim_rows=True)
    np.testing.assert_allclose(np.asarray(got), reference(queries, kv, q_lens, kv_lens, tables, D ** -0.5), atol=2e-6)


def test_num_common_pages_stops_at_divergence_and_at_the_first_query() -> None:
    tables = np.array([[7, 3, 9, 4], [7, 3, 9, 5], [7, 3, 2, 6]])
    assert num_common_pages(tables, np.array([40, 40, 40]), PAGE) == 2  # the third table diverges at page 2
    assert num_common_pages(tables[:2], np.array([40, 40]), PAGE) == 3
    assert num_common_pages(tables[:2], np.array([40, 11]), PAGE) == 2  # page 2 holds the second row's query
    assert num_common_pages(tables[:2], np.array([40, 3]), PAGE) == 0
    assert num_common_pages(tables[:1], np.array([100]), PAGE) == 4  # never past the table
    assert num_common_pages(tables[:0], np.array([], np.int64), PAGE) == 0


def test_write_kv_places_k_and_v_and_drops_out_of_range() -> None:
    rng = np.random.default_rng(1)
    kv = np.zeros((2, HKV, NUM_PAGES, PAGE, D), np.float32)
    k = rng.standard_normal((3, HKV, D)).astype(np.float32)
    v = rng.standard_normal((3, HKV, D)).astype(np.float32)
    slots = np.array([5, 37, NUM_PAGES * PAGE], np.int32)  # the last one is past the cache: dropped
    out = np.asarray(write_kv(jnp.asarray(kv), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots)))
    for t, slot in enumerate(slots[:2]):
        np.testing.assert_array_equal(out[0, :, slot // PAGE, slot % PAGE], k[t])
        np.testing.assert_array_equal(out[1, :, slot // PAGE, slot % PAGE], v[t])
    assert np.count_nonzero(out) == 2 * 2 * HKV * D


@pytest.mark.parametrize("impl", ["pallas_gpu_interpret", "pallas_tpu_interpret", pytest.param("pallas_gpu", marks=GPU_ONLY)])
def test_pallas_kernel_reads_the_same_cache(impl: str) -> None:
    """JAX's Pallas paged-attention kernels (interpret mode; the TPU one under TPU interpret mode on CPU)
    on our cache equal the reference.

    The TPU kernel rounds K and V to bfloat16 inside, so for it the cache holds bfloat16-representable
    values (as a bfloat16 cache does); then only the float32 summation order differs.
    """
    q_lens, kv_lens = [1, 1, 1, 1], [1, 9, 24, 0]  # the last row is padding (no context)
    queries, kv, tables = random_case(2, q_lens, kv_lens, 6)
    if impl == "pallas_tpu_interpret":
        kv = np.asarray(jnp.asarray(kv).astype(jnp.bfloat16).astype(jnp.float32))
        tables[3] = NUM_PAGES  # a padding row's table pointing past the cache (the TPU kernel DMAs it)
    md = AttentionMetadata(slot_mapping=jnp.zeros(4, jnp.int32), kv_lens=jnp.asarray(kv_lens, jnp.int32),
                           page_indices=jnp.asarray(tables), cu_q_lens=jnp.arange(5, dtype=jnp.int32),
                           num_seqs=jnp.asarray([3], jnp.int32), max_q_len=1, kernel=kernel_of(impl))
    got = np.asarray(paged_attention(jnp.asarray(queries), jnp.asarray(kv), md, sm_scale=D ** -0.5))
    want = reference(queries, kv, q_lens, kv_lens, tables, D ** -0.5)
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_auto_attention_impl_keeps_float32_caches_exact() -> None:
    kernel = "cpu_kernel" if load_cpu_attention().available else "jax"
    assert auto_attention_impl("auto", "cpu", 1, "float32") == kernel
    assert auto_attention_impl("auto", "cpu", 1, "float32", num_devices=2) == "jax"  # the C++ kernel: one device
    assert auto_attention_impl("auto", "cpu", 1, "bfloat16") == kernel  # a bfloat16 cache too (as uint16 bits)
    assert auto_attention_impl("auto", "gpu", 1, "float32") == "pallas_gpu"
    assert auto_attention_impl("auto", "gpu", 2, "float32") == "jax"  # the kernels run unpartitioned
    assert auto_attention_impl("auto", "tpu", 1, "bfloat16") == "tpu_ragged"  # every step through the kernel
    assert auto_attention_impl("auto", "tpu", 1, "float32") == "tpu_ragged_jax"  # exact: its layout, pure JAX
    assert auto_attention_impl("auto", "tpu", 2, "bfloat16") == "tpu_ragged_jax"  # the kernel runs unpartitioned
    assert auto_attention_impl("tpu", "cpu", 1, "bfloat16") == "tpu_ragged_jax"  # the layout anywhere
    assert auto_attention_impl("pallas_tpu_interpret", "cpu", 1, "float32") == "pallas_tpu_interpret"


@pytest.mark.parametrize("impl", ["pallas_gpu_interpret", pytest.param("pallas_gpu", marks=GPU_ONLY)])
def test_engine_with_pallas_decode_equals_pure_jax(impl: str) -> None:
    model = make_model()
    rng = np.random.default_rng(3)
    prompts = [rand_prompt(rng, n) for n in (5, 19, 11)]
    sp = SamplingParams(temperature=0.8, seed=4, max_tokens=6, logprobs=2)
    outs = {}
    for backend in ("jax", impl):
        engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, attention_backend=backend)
        assert engine.runner.attention_impl == backend
        outs[backend] = engine.generate(prompts, sp)
    for a, b in zip(outs["jax"], outs[impl]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose([t.logprob for t in a.outputs[0].logprobs],
                                   [t.logprob for t in b.outputs[0].logprobs], atol=1e-5)


def test_engine_with_pallas_tpu_decode_on_a_bfloat16_cache_matches_pure_jax() -> None:
    """The TPU kernel in a bfloat16 engine (what "auto" picks on TPU): same tokens, logprobs within bfloat16."""
    f32 = make_model()
    model = LlamaForCausalLM(f32.config.with_dtype("bfloat16"), rngs=nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(f32, nnx.Param)))
    rng = np.random.default_rng(5)
    prompts = [rand_prompt(rng, 21)]  # one sequence: one decode bucket to compile (interpret mode is slow)
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)
    outs = {}
    for impl in ("jax", "pallas_tpu_interpret"):
        engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, attention_backend=impl)
        # the Pallas kernel reads a bfloat16 cache; the CPU backend's own path keeps it as its uint16 bits
        assert engine.runner.kv_caches[0].dtype == (jnp.uint16 if impl == "jax" else jnp.bfloat16)
        outs[impl] = engine.generate(prompts, sp)
    for a, b in zip(outs["jax"], outs["pallas_tpu_interpret"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose([t.logprob for t in a.outputs[0].logprobs],
                                   [t.logprob for t in b.outputs[0].logprobs], atol=3e-2)


def test_bad_attention_backend_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        Engine.from_model(make_model(), ByteTokenizer(), **ENGINE_KW, attention_backend="flash")


@pytest.mark.parametrize("num_tokens", [1, 8])
def test_write_kv_updates_the_cache_in_place(num_tokens: int) -> None:
    """The compiled write never copies the (donated) cache: a scatter along an inner axis made
    XLA:CPU copy the whole cache for one-token steps (B=1 decode ran 60x slower)."""
    import jax

    cache = jax.ShapeDtypeStruct((2, HKV, NUM_PAGES, PAGE, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((num_tokens, HKV, D), jnp.float32)
    slots = jax.ShapeDtypeStruct((num_tokens,), jnp.int32)
    hlo = jax.jit(write_kv, donate_argnums=0).lower(cache, kv, kv, slots).compile().as_text()
    cache_elems = 2 * HKV * NUM_PAGES * PAGE * D
    copies = [line.strip() for line in hlo.splitlines() if " copy(" in line
              and math.prod(int(x) for x in re.search(r"f32\[([\d,]*)\]", line).group(1).split(",") if x) == cache_elems]
    assert not copies, copies


@pytest.mark.parametrize("common", [None, 2])
def test_kv_head_sharded_cache_is_never_gathered(common: int | None) -> None:
    """With the cache sharded by KV head (tensor parallel), attention runs on each device's heads:
    no collective in the compiled program (flattening the head axis into the page rows made GSPMD
    all-gather the whole cache every layer, silently), with or without the cascade over common pages."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    q_lens, kv_lens = [1, 1, 1], [9, 17, 24]
    queries, kv, tables = random_case(3, q_lens, kv_lens, width=6)
    tables[:, :2] = tables[0, :2]  # 2 pages before every query
    mesh = Mesh(np.asarray(jax.devices()[:HKV]), ("model",))
    kv_sharded = jax.device_put(kv, NamedSharding(mesh, PartitionSpec(None, "model")))
    q_sharded = jax.device_put(queries, NamedSharding(mesh, PartitionSpec(None, "model")))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)

    def attend(q: jax.Array, cache: jax.Array) -> jax.Array:
        return ragged_paged_attention(q, cache, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables), jnp.asarray(cu),
                                      jnp.asarray([3], jnp.int32), sm_scale=0.3, max_q_len=1,
                                      num_common_pages=None if common is None else jnp.asarray([common], jnp.int32))

    compiled = jax.jit(attend).lower(q_sharded, kv_sharded).compile()
    collectives = re.findall(r"all-gather|all-to-all|collective-permute|all-reduce", compiled.as_text())
    assert not collectives, collectives
    out = np.asarray(compiled(q_sharded, kv_sharded))
    np.testing.assert_allclose(out, reference(queries, kv, q_lens, kv_lens, tables, 0.3), atol=2e-5)

    # the step's K/V write into the same sharded cache: no collective either, and in the right slots
    num_slots = kv.shape[2] * kv.shape[3]
    slots = np.asarray([5, num_slots - 1, -1, num_slots], np.int32)  # the last two are dropped
    new_k = np.random.default_rng(1).standard_normal((4, HKV, kv.shape[-1])).astype(np.float32)
    shard = NamedSharding(mesh, PartitionSpec(None, "model"))
    write = jax.jit(write_kv, out_shardings=NamedSharding(mesh, PartitionSpec(None, "model")))
    lowered = write.lower(kv_sharded, jax.device_put(new_k, shard), jax.device_put(-new_k, shard), jnp.asarray(slots))
    collectives = re.findall(r"all-gather|all-to-all|collective-permute|all-reduce", lowered.compile().as_text())
    assert not collectives, collectives
    written = np.asarray(write(kv_sharded, jax.device_put(new_k, shard), jax.device_put(-new_k, shard), jnp.asarray(slots)))
    want = np.asarray(kv).copy()
    for t, slot in enumerate(slots[:2]):
        page, offset = divmod(int(slot), kv.shape[3])
        want[0, :, page, offset], want[1, :, page, offset] = new_k[t], -new_k[t]
    np.testing.assert_array_equal(written, want)
