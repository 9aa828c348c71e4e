"""Batch-invariant mode (`EngineConfig(batch_invariant=True)`): a request's raw logprobs and tokens are
bitwise the same alone and in batches of 1..63 random companions, however its prompt is chunked, with a
cached prefix, after preemption, with n-gram speculation, with 1 or 8 steps per call, with async
scheduling on or off, on one device and on a data-parallel mesh (the same bits); on the tiny test model
and on SmolLM2. Plus the pieces: the fixed-order sums
(`runner.row_sum`), the CPU matmul at every row count, and the configurations the mode refuses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout import Engine, NgramConfig, SamplingParams
from rollout.engine_config import EngineConfig
from runner import row_sum
from runner.backends.cpu import amx_matmul as amx
from runner.backends.cpu.backend import CpuMatmul
from runner.backends.cpu.row_matmul import MAX_ROWS, load as load_row_kernel
from test_engine import ENGINE_KW, ByteTokenizer, make_model, rand_prompt

needs_kernels = pytest.mark.skipif(not load_row_kernel().available, reason="the CPU row kernel does not build here")

TARGET = "the quick brown fox jumps"
TARGET_PARAMS = SamplingParams(temperature=1.0, seed=7, max_tokens=40, logprobs=0, ignore_eos=True)


# ---- the pieces -------------------------------------------------------------------------------------

@pytest.mark.parametrize("width", [8, 32, 576, 1000, 49152])
def test_fixed_order_sum_is_the_sum_and_ignores_other_rows(width: int) -> None:
    rng = np.random.default_rng(width)
    row = rng.standard_normal(width).astype(np.float32)
    total = jax.jit(row_sum.fixed_order_sum)
    first = None
    for rows in (1, 2, 7, 8, 9, 33, 64, 130):
        x = rng.standard_normal((rows, width)).astype(np.float32)
        x[rows // 2] = row
        got = np.asarray(total(x))
        np.testing.assert_allclose(got[:, 0], x.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-4)
        first = got[rows // 2] if first is None else first
        assert got[rows // 2].tobytes() == first.tobytes(), f"row bits changed with {rows} rows"


def test_fixed_order_log_softmax_matches_jax() -> None:
    x = np.random.default_rng(0).standard_normal((5, 1000)).astype(np.float32) * 4
    x[3] = -np.inf
    x[4, :10] = -np.inf
    got = np.asarray(row_sum.log_softmax(jnp.asarray(x)))
    want = np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))
    np.testing.assert_allclose(got[:3], want[:3], rtol=1e-6, atol=1e-5)
    assert np.isneginf(row_sum.logsumexp(jnp.asarray(x))[3])
    np.testing.assert_allclose(got[4, 10:], want[4, 10:], rtol=1e-6, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("transposed, on_amx", [(False, False), (True, False), (True, True)])
def test_invariant_matmul_rows_are_the_one_row_products(transposed: bool, on_amx: bool) -> None:
    """Every row count (past the kernel's 64 too) gives each row the bits of its 1-row product: the
    row kernel, and the tied head's transposed copy or AMX packing (`CpuBackend.packed_weight`)."""
    if on_amx and not amx.load().available:
        pytest.skip(f"AMX: {amx.load().reason}")
    rng = np.random.default_rng(1)
    k, n = 96, 208
    w = jnp.asarray(rng.standard_normal((n, k) if transposed else (k, n)), jnp.float32)
    packed = None if not transposed else amx.pack_kernel(jnp.transpose(w)) if on_amx else jnp.transpose(w)
    matmul = jax.jit(lambda x: CpuMatmul(MAX_ROWS, transposed=transposed, invariant=True)(x, w, packed))
    x = jnp.asarray(rng.standard_normal((200, k)), jnp.float32)
    alone = np.concatenate([np.asarray(matmul(x[i:i + 1])) for i in range(x.shape[0])])
    dense = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T if transposed else \
        np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(alone, dense, rtol=1e-4, atol=1e-4)
    for rows in (2, 9, 25, 64, 65, 130, 200):
        assert np.asarray(matmul(x[:rows])).tobytes() == alone[:rows].tobytes(), f"{rows} rows"


@pytest.mark.parametrize("filters", [dict(), dict(top_k=20), dict(min_p=0.05), dict(top_p=0.9)],
                         ids=["temperature", "top-k", "min-p", "top-p"])
def test_sampler_row_ignores_the_other_rows(filters: dict) -> None:
    """A row's token and raw logprob bits over SmolLM2's vocabulary, alone and among 7-63 random rows
    whose settings put the step in any sampling mode."""
    from runner.sampler import sample
    from runner.sampling_rows import choose_mode
    from test_sampler import make_inputs

    vocab = 49152
    rng = np.random.default_rng(3)
    row = rng.standard_normal(vocab).astype(np.float32) * 4
    target = {**dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=11, sample_index=0, positions=5), **filters}
    first = None
    for companions in (0, 7, 30, 63):
        n = companions + 1
        logits = rng.standard_normal((n, vocab)).astype(np.float32) * 4
        logits[0] = row
        settings = dict(temperature=rng.choice([0.0, 0.7, 1.0], n).astype(np.float32),
                        top_k=rng.choice([0, 5, 50], n), top_p=rng.choice([1.0, 0.8], n).astype(np.float32),
                        min_p=rng.choice([0.0, 0.1], n).astype(np.float32), seeds=rng.integers(0, 1 << 20, n),
                        sample_index=np.zeros(n, np.int64), positions=rng.integers(0, 500, n))
        for key, value in target.items():
            settings[key][0] = value
        mode = choose_mode(settings["temperature"], settings["top_k"], settings["top_p"], settings["min_p"], vocab_size=vocab)
        out = sample(jnp.asarray(logits), make_inputs(n, processed=False, **settings), mode=mode)
        got = (int(out.token_ids[0]), np.asarray(out.logprobs)[0].tobytes())
        first = got if first is None else first
        assert got == first, f"{companions} companions ({mode} mode)"


# ---- the engine on the tiny model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return make_model()


def engine(model, **config: object) -> Engine:
    return Engine.from_model(model, ByteTokenizer(), **{**ENGINE_KW, "max_num_seqs": 64, "batch_invariant": True,
                                                        **config})


def run(eng: Engine, companions: int, seed: int, target: str = TARGET, params: SamplingParams = TARGET_PARAMS
        ) -> tuple[list[int], bytes]:
    """The target's tokens and raw logprob bits, generated among `companions` random requests (random
    prompt lengths, temperatures, seeds and lengths) at a random place in the batch."""
    rng = np.random.default_rng(seed)
    prompts = [rand_prompt(rng, int(n)) for n in rng.integers(3, 100, companions)]
    others = [SamplingParams(temperature=float(rng.choice([0.0, 0.7, 1.0])), seed=int(rng.integers(1 << 20)),
                             max_tokens=int(rng.integers(5, 60)), logprobs=int(rng.choice([0, 2])))
              for _ in range(companions)]
    at = int(rng.integers(0, companions + 1))
    prompts.insert(at, target)
    others.insert(at, params)
    out = eng.generate(prompts, others, use_tqdm=False)[at].outputs[0]
    return out.token_ids, np.asarray(out.logprobs.values, np.float32).tobytes()


@pytest.fixture(scope="module")
def invariant(model) -> Engine:
    return engine(model)


@pytest.fixture(scope="module")
def alone(invariant: Engine) -> tuple[list[int], bytes]:
    return run(invariant, 0, seed=0)


@needs_kernels
def test_status_says_what_sums_rows_alike(invariant: Engine) -> None:
    stats = invariant.stats()
    assert stats.batch_invariant.startswith("on: the row kernel") and stats.attention_impl == "cpu_kernel"
    assert ("tied head on AMX" in stats.batch_invariant) == (stats.cpu_amx == "ok")


@needs_kernels
@pytest.mark.parametrize("companions", [1, 7, 8, 31, 63])
def test_same_bits_whatever_shares_the_batch(invariant: Engine, alone, companions: int) -> None:
    assert run(invariant, companions, seed=companions) == alone


@needs_kernels
def test_same_bits_with_a_cached_prefix(invariant: Engine, alone) -> None:
    before = invariant.stats().prefix_cache_hit_tokens
    invariant.generate([TARGET + " over the lazy dog"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert run(invariant, 3, seed=11) == alone
    assert invariant.stats().prefix_cache_hit_tokens > before


@needs_kernels
@pytest.mark.parametrize("config", [
    dict(max_num_batched_tokens=32),  # the prompt in other chunks, other prefill companions
    dict(num_scheduler_steps=1, async_scheduling=False),
    dict(enable_prefix_caching=False),
], ids=["chunking", "one-step-sync", "no-prefix-cache"])
def test_same_bits_under_other_engine_settings(model, alone, config: dict) -> None:
    eng = engine(model, **config)
    assert run(eng, 0, seed=0) == alone
    assert run(eng, 20, seed=3) == alone


@needs_kernels
def test_same_bits_with_speculation_greedy(model) -> None:
    """Greedy over a repetitive prompt, so drafts get accepted: verification rows give decode's bits."""
    prompt = "abcab" * 6
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=0, ignore_eos=True)
    plain = run(engine(model), 9, seed=4, target=prompt, params=params)
    spec = engine(model, speculative=NgramConfig(k=4, prompt_lookup_min=1, prompt_lookup_max=3, auto_disable=False))
    assert run(spec, 9, seed=5, target=prompt, params=params) == plain
    assert spec.stats().speculative.accepted_tokens > 0


@needs_kernels
def test_same_bits_after_preemption(model, alone) -> None:
    eng = engine(model, kv_cache_blocks=24)
    assert run(eng, 12, seed=6) == alone
    assert eng.stats().num_preemptions > 0


@needs_kernels
def test_tied_head_without_amx_takes_the_row_kernel() -> None:
    """A tied head where AMX is off (as on CPUs without it): the row kernel over its [H, V] copy, and a
    request's bits stay the same among companions."""
    import dataclasses

    from flax import nnx

    from runner.models.llama import LlamaForCausalLM
    from test_engine import CFG

    tied = LlamaForCausalLM(dataclasses.replace(CFG, tie_word_embeddings=True), rngs=nnx.Rngs(1))
    eng = engine(tied, cpu_amx=False)
    assert "AMX" not in eng.stats().batch_invariant
    assert run(eng, 9, seed=12) == run(eng, 0, seed=0)


@needs_kernels
def test_same_bits_on_a_data_parallel_mesh(model, alone) -> None:
    """Two replicas (each device runs the kernels on its own rows and cache): the bits of one device,
    whatever the other requests are and whichever replica the target lands on."""
    eng = engine(model, mesh=(2, 1), max_num_seqs=32)
    assert eng.stats().batch_invariant.startswith("on") and eng.stats().attention_impl == "cpu_kernel"
    for companions in (0, 5, 40):
        assert run(eng, companions, seed=companions + 1) == alone


@needs_kernels
def test_same_bits_with_eagle3_drafting(model, tmp_path) -> None:
    """Greedy with an EAGLE-3 head (random: drafts mostly rejected, so verification steps of k + 1 rows
    carry the target): the bits of plain decoding."""
    from rollout import Eagle3Config
    from runner.spec_decode.eagle3_checkpoint import init_eagle3_head, save_eagle3_head

    path = str(tmp_path / "head")
    save_eagle3_head(init_eagle3_head(model, seed=3), path)
    params = SamplingParams(temperature=0.0, max_tokens=30, logprobs=0, ignore_eos=True)
    plain = run(engine(model), 5, seed=8, params=params)
    spec = engine(model, speculative=Eagle3Config(path, k=3, auto_disable=False))
    assert run(spec, 5, seed=9, params=params) == plain
    assert spec.stats().speculative.drafted_tokens > 0


# ---- what the mode refuses ----------------------------------------------------------------------

def test_config_validates_the_flag() -> None:
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant="yes")


@pytest.mark.parametrize("config, match", [
    (dict(backend="reference"), "CPU backend only"),
    (dict(attention_backend="jax"), "C\\+\\+ paged attention"),
    (dict(mesh=(1, 2)), "'model' axis of 2"),
])
def test_refused_where_rows_would_depend_on_the_batch(model, config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Engine.from_model(model, ByteTokenizer(), **{**ENGINE_KW, "batch_invariant": True, **config})


@needs_kernels
@pytest.mark.parametrize("change, match", [
    (dict(moe_layers=(0,), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16), "mixture-of-experts"),
    (dict(sliding_layers=(0,), sliding_window=8), "sliding-window"),
])
def test_refused_for_models_it_does_not_cover(change: dict, match: str) -> None:
    import dataclasses

    from flax import nnx

    from runner.models.llama import LlamaForCausalLM
    from test_engine import CFG

    other = LlamaForCausalLM(dataclasses.replace(CFG, **change), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=match):
        Engine.from_model(other, ByteTokenizer(), **{**ENGINE_KW, "batch_invariant": True})
    Engine.from_model(other, ByteTokenizer(), **ENGINE_KW)  # the default mode takes it


# ---- SmolLM2 --------------------------------------------------------------------------------------

@pytest.mark.slow
@needs_kernels
def test_smollm2_same_bits_alone_and_among_63() -> None:
    """The real model (hidden 576, 49152-token vocabulary): alone and among 63 companions with long
    prompts (prefill chunks share the target's decode steps; as companions finish, the target's batch
    shrinks through smaller decode buckets). Other companion counts and token budgets: the tiny model's
    cases above."""
    eng = Engine.from_pretrained(None, max_num_seqs=64, max_model_len=1024, batch_invariant=True)
    words = "the a of to and in is it you that he was for on are with as I his they be at one have".split()
    target = "Write a short story about a robot who learns to paint."
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=24, logprobs=0, ignore_eos=True)

    def among(eng: Engine, companions: int, seed: int) -> tuple[list[int], bytes]:
        rng = np.random.default_rng(seed)
        # up to 120 words: with 63 companions the prompts still fill several 512-token prefill steps, so
        # their chunks share the target's steps
        prompts = [" ".join(rng.choice(words, int(rng.integers(5, 120)))) for _ in range(companions)]
        others = [SamplingParams(temperature=float(rng.choice([0.0, 1.0])), seed=int(rng.integers(1 << 20)),
                                 max_tokens=int(rng.integers(5, 40))) for _ in range(companions)]
        at = int(rng.integers(0, companions + 1))
        prompts.insert(at, target)
        others.insert(at, params)
        out = eng.generate(prompts, others, use_tqdm=False)[at].outputs[0]
        return out.token_ids, np.asarray(out.logprobs.values, np.float32).tobytes()

    assert among(eng, 63, 2) == among(eng, 0, 0)
