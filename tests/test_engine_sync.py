"""`Engine.sync_weights` end to end: round trips through the presets, no recompilation, prefix-cache
invalidation, policy versions, atomic failure, no sync during generate, flat memory over many syncs.

Reuses the tiny model, tokenizer and full-forward reference of `test_engine.py`, and the HF-layout
helpers of `test_weight_sync.py` (so the compiled step programs are shared with those modules).
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollout.engine import Engine
from rollout.sampling_params import SamplingParams
from weight_sync.compiles import num_compilations
from runner.models.llama import LlamaForCausalLM
from test_engine import CFG, ENGINE_KW, ByteTokenizer, Reference, make_model, rand_prompt
from test_weight_sync import fuse, to_hf

PROMPTS = [rand_prompt(np.random.default_rng(50 + i), n) for i, n in enumerate([5, 21])]
LONG_PROMPT = rand_prompt(np.random.default_rng(77), 40)  # two full 16-token blocks (prefix-cacheable)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=0)


def perturb(model: LlamaForCausalLM, seed: int, scale: float = 0.3) -> LlamaForCausalLM:
    """A trainer's update: a new model of the same class with every parameter moved."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(seed)

    def move(x: jax.Array) -> jax.Array:
        a = np.asarray(x, np.float64)
        return jnp.asarray(a + scale * (a.std() + 0.05) * rng.standard_normal(a.shape), x.dtype)

    return nnx.merge(graphdef, jax.tree.map(move, params), rest)


def param_values(engine: Engine) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(engine.runner.params)}


def live_bytes() -> int:
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


@pytest.fixture(scope="module")
def base() -> LlamaForCausalLM:
    return make_model(0)


@pytest.fixture(scope="module")
def model_a(base) -> LlamaForCausalLM:
    return perturb(base, 1)


@pytest.fixture(scope="module")
def model_b(base) -> LlamaForCausalLM:
    return perturb(base, 2)


@pytest.fixture(scope="module")
def refs(base, model_a, model_b) -> dict[str, Reference]:
    return {"base": Reference(base), "a": Reference(model_a), "b": Reference(model_b)}


@pytest.fixture
def engine(base) -> Engine:
    """A fresh engine on the base weights (step programs are compiled once per process)."""
    return Engine.from_model(base, ByteTokenizer(), **ENGINE_KW)


def greedy_ids(engine: Engine, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]


def sampled(engine: Engine, prompts: list[list[int]] = PROMPTS) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(prompts, SAMPLED)
    return [(o.outputs[0].token_ids, [t.logprob for t in o.outputs[0].logprobs]) for o in outs]


def assert_matches(engine: Engine, ref: Reference, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    """Sampled-token raw logprobs == the full forward's log_softmax (1e-5); greedy == a greedy loop."""
    for prompt, (toks, lps) in zip(prompts, sampled(engine, prompts)):
        assert len(toks) == SAMPLED.max_tokens
        _, logp = ref.logits(prompt + toks)
        for j, (tok, lp) in enumerate(zip(toks, lps)):
            assert abs(lp - logp[len(prompt) - 1 + j, tok]) < 1e-5, (j, lp, logp[len(prompt) - 1 + j, tok])
    got = greedy_ids(engine, prompts)
    assert got == [ref.greedy(p, GREEDY.max_tokens) for p in prompts]
    return got


# ---- 1. round trips -----------------------------------------------------------------------------

def _source(kind: str, model: LlamaForCausalLM) -> tuple[object, str | None]:
    if kind == "hf":  # host numpy, HF names, [out, in] kernels
        return to_hf(model), "hf"
    if kind == "hf-fused":  # device arrays, fused qkv_proj / gate_up_proj
        return {k: jnp.asarray(v) for k, v in fuse(to_hf(model), CFG).items()}, "hf-fused"
    # identity: the nnx.State of a trainer's own copy of the model class
    trainer = LlamaForCausalLM(CFG, rngs=nnx.Rngs(123))
    nnx.update(trainer, jax.tree.map(lambda x: jnp.array(x, copy=True), nnx.state(model, nnx.Param)))
    return nnx.state(trainer, nnx.Param), None


@pytest.mark.parametrize("kind", ["hf", "hf-fused", "identity"])
def test_round_trip_matches_perturbed_forward(engine: Engine, refs, model_a, kind: str) -> None:
    before = assert_matches(engine, refs["base"])
    src, mapping = _source(kind, model_a)
    engine.sync_weights(src, mapping)
    after = assert_matches(engine, refs["a"])
    assert after != before
    # the engine's model property sees the new weights too
    ids = jnp.asarray([PROMPTS[1]])
    pos = jnp.arange(len(PROMPTS[1]))[None]
    np.testing.assert_allclose(np.asarray(engine.model(ids, pos)), np.asarray(model_a(ids, pos)), atol=1e-5)
    # the engine copied: the trainer deleting (donating) its arrays changes nothing
    if kind != "hf":
        for x in jax.tree.leaves(src):
            x.delete()
        assert greedy_ids(engine) == after


# ---- 2. no compilation --------------------------------------------------------------------------

def test_second_sync_and_generate_do_not_compile(engine: Engine, refs, model_a, model_b) -> None:
    src_a = {k: jnp.asarray(v) for k, v in to_hf(model_a).items()}  # device sources: jitted transposes
    src_b = {k: jnp.asarray(v) for k, v in to_hf(model_b).items()}
    greedy_ids(engine)
    sampled(engine)
    engine.sync_weights(src_a, "hf")
    greedy_ids(engine)
    sampled(engine)
    n0 = num_compilations()
    engine.sync_weights(src_b, "hf")
    got = greedy_ids(engine)
    sampled(engine)
    assert num_compilations() == n0
    assert got == [refs["b"].greedy(p, GREEDY.max_tokens) for p in PROMPTS]


# ---- 3. prefix cache ----------------------------------------------------------------------------

def test_sync_invalidates_prefix_cache(engine: Engine, refs, model_a) -> None:
    def run() -> tuple[list[int], int]:
        h0 = engine.stats().prefix_cache_hit_tokens
        (ids,) = greedy_ids(engine, [LONG_PROMPT])
        return ids, engine.stats().prefix_cache_hit_tokens - h0

    old, _ = run()
    again, hits = run()
    assert again == old and hits == 32  # sanity: the two full prompt blocks are reused
    engine.sync_weights(to_hf(model_a), "hf")
    new, hits = run()
    assert hits == 0, "stale pre-sync blocks were reused"
    expected = refs["a"].greedy(LONG_PROMPT, GREEDY.max_tokens)
    assert new == expected != old
    again, hits = run()
    assert hits == 32 and again == expected  # post-sync blocks are cached normally


# ---- 4. policy version --------------------------------------------------------------------------

def test_policy_version(engine: Engine, model_a, model_b) -> None:
    sp = SamplingParams(temperature=1.0, n=2, max_tokens=4)

    def versions() -> set[int | None]:
        return {c.policy_version for o in engine.generate(PROMPTS, sp) for c in o.outputs}

    assert versions() == {None}
    engine.sync_weights(to_hf(model_a), "hf", version=7)
    assert versions() == {7}
    assert engine.rollout(PROMPTS, sp).policy_version == 7
    engine.sync_weights(to_hf(model_b), "hf")
    assert versions() == {8}
    engine.sync_weights(to_hf(model_a), "hf", version=3)
    engine.sync_weights(to_hf(model_b), "hf")
    assert versions() == {4}
    assert engine.rollout(PROMPTS, sp).policy_version == 4
    assert engine.stats().num_weight_syncs == 4


# ---- 5. atomic failure --------------------------------------------------------------------------

def test_failed_sync_changes_nothing(engine: Engine, refs, model_a, model_b) -> None:
    engine.sync_weights(to_hf(model_a), "hf", version=1)
    greedy_before, sampled_before, params_before = greedy_ids(engine), sampled(engine), param_values(engine)

    def unchanged() -> None:
        assert engine.policy_version == 1
        after = param_values(engine)
        assert all(np.array_equal(after[k], v) for k, v in params_before.items())
        assert greedy_ids(engine) == greedy_before
        assert sampled(engine) == sampled_before

    bad = to_hf(model_b)
    del bad["model.layers.1.mlp.up_proj.weight"]  # missing
    bad["model.layers.0.self_attn.extra.weight"] = np.zeros((4, 4), np.float32)  # extra
    bad["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)  # wrong shape
    bad["model.layers.0.mlp.down_proj.weight"][3, 5] = np.nan  # NaN
    with pytest.raises(ValueError) as e:
        engine.sync_weights(bad, "hf", version=2, check_finite=True)
    msg = str(e.value)
    assert type(e.value).__name__ == "WeightSyncError", msg
    for needle in ("layers.1.mlp.up_proj.kernel", "self_attn.extra", "k_proj", "down_proj.weight"):
        assert needle in msg, (needle, msg)
    assert len(e.value.problems) == 4, msg
    unchanged()

    # non-finite values only (valid structure): every offender listed, nothing written
    bad = {k: jnp.asarray(v) for k, v in to_hf(model_b).items()}
    bad["model.norm.weight"] = bad["model.norm.weight"].at[0].set(jnp.nan)
    bad["lm_head.weight"] = bad["lm_head.weight"].at[2, 3].set(jnp.inf)
    with pytest.raises(ValueError) as e:
        engine.sync_weights(bad, "hf", version=2, check_finite=True)
    assert len(e.value.problems) == 2 and "model.norm.weight" in str(e.value) and "lm_head.weight" in str(e.value)
    unchanged()
    assert engine.stats().num_weight_syncs == 1

    # the engine keeps working: a good sync goes through
    engine.sync_weights(to_hf(model_b), "hf", check_finite=True)
    assert engine.policy_version == 2
    assert_matches(engine, refs["b"])


# ---- 6. no sync during generate -----------------------------------------------------------------

def test_sync_during_generate_is_refused(engine: Engine, refs, model_a) -> None:
    expected_base = [refs["base"].greedy(p, GREEDY.max_tokens) for p in PROMPTS]
    run = engine.runner.launch
    errors: list[Exception] = []

    def run_and_sync(batch, **kwargs):  # a sync attempted from inside a step, error caught by the caller
        if not errors:
            try:
                engine.sync_weights(to_hf(model_a), "hf")
            except RuntimeError as err:
                errors.append(err)
            else:
                errors.append(AssertionError("sync_weights during generate was not refused"))
        return run(batch, **kwargs)

    engine.runner.launch = run_and_sync
    try:
        got = greedy_ids(engine)
    finally:
        engine.runner.launch = run
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
    assert "generate() is running" in str(errors[0])
    assert got == expected_base and engine.policy_version is None

    def run_and_sync_uncaught(batch, **kwargs):  # the error escapes the step: generate raises it
        engine.sync_weights(to_hf(model_a), "hf")
        return run(batch, **kwargs)

    engine.runner.launch = run_and_sync_uncaught
    try:
        with pytest.raises(RuntimeError, match="generate\\(\\) is running"):
            greedy_ids(engine)
    finally:
        engine.runner.launch = run
    assert engine.policy_version is None and engine.stats().num_weight_syncs == 0
    # usable afterwards: generation on the old weights, then a sync, then the new weights
    assert greedy_ids(engine) == expected_base
    engine.sync_weights(to_hf(model_a), "hf")
    assert greedy_ids(engine) == [refs["a"].greedy(p, GREEDY.max_tokens) for p in PROMPTS]


# ---- 7. memory ----------------------------------------------------------------------------------

def test_many_syncs_keep_memory_flat(engine: Engine, refs, model_a, model_b) -> None:
    srcs = [{k: jnp.asarray(v) for k, v in to_hf(m).items()} for m in (model_a, model_b)]
    greedy_ids(engine)
    biggest = max(x.nbytes for x in jax.tree.leaves(engine.runner.params))
    at: dict[int, int] = {}
    for i in range(1, 51):
        engine.sync_weights(srcs[i % 2], "hf")
        if i in (10, 50):
            at[i] = live_bytes()
    assert abs(at[50] - at[10]) <= biggest, (at, biggest)
    assert engine.policy_version == 50
    assert greedy_ids(engine) == [refs["a"].greedy(p, GREEDY.max_tokens) for p in PROMPTS]  # 50 % 2 == 0 -> a
