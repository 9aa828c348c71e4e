"""Colocated with a trainer (`EngineConfig.share_weights`): the engine's parameters are the trainer's own arrays
where their layout is the engine's (no second copy), a matching sync swaps references (no copy, no compile),
a trainer that donates them gets one clear error at the next step (nothing lost: a sync mends it), sleep and
wake leave the trainer's arrays alone; and the KV cache sized as a fraction of free memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rollout import Engine, SamplingParams, SharedWeightsDeleted
from weight_sync.compiles import CompileCounter
from test_engine import ENGINE_KW, ByteTokenizer, Reference, make_model, rand_prompt
from test_weight_sync import to_hf

PROMPTS = [rand_prompt(np.random.default_rng(i), n) for i, n in enumerate((5, 17))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)


def param_leaves(tree: object) -> list[jax.Array]:
    return jax.tree.leaves(tree)


def trained(model: nnx.Module, seed: int) -> nnx.State:
    """The model's parameters after one Adam step on a random objective (new arrays, the old ones kept)."""
    params = nnx.state(model, nnx.Param)
    tx = optax.adam(1e-2)
    grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(seed), x.shape, x.dtype), params)
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates)


def test_shared_weights_are_the_trainers_arrays() -> None:
    model = make_model(0)
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, share_weights=True)
    theirs = param_leaves(nnx.state(model, nnx.Param))
    ours = param_leaves(engine.runner.params)
    assert all(a is b for a, b in zip(ours, theirs)) and engine.runner.weights.shared == [True] * len(ours)
    stats = engine.stats()
    assert stats.weight_bytes_shared == sum(x.nbytes for x in theirs)
    # what the engine holds itself: the rest of the model state and the backend's packed copies only
    assert stats.weight_bytes_held == sum(x.nbytes for x in param_leaves(engine.runner.rest))
    private = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)
    assert private.stats().weight_bytes_shared == 0 and not any(a is b for a, b in zip(
        param_leaves(private.runner.params), theirs))
    assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)] == \
        [o.outputs[0].token_ids for o in private.generate(PROMPTS, GREEDY)]


def test_a_matching_sync_swaps_references() -> None:
    model = make_model(0)
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, share_weights=True)
    engine.generate(PROMPTS, GREEDY)
    engine.sync_weights(trained(model, 2))  # (compiles the backend's repacking program, as warmup() does)
    new = trained(model, 1)
    with CompileCounter() as compiles:
        engine.sync_weights(new)
    ours = param_leaves(engine.runner.params)
    assert all(a is b for a, b in zip(ours, param_leaves(new))) and compiles.count == 0
    nnx.update(model, new)  # (the reference: the model with the new parameters)
    ref = Reference(model)
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, GREEDY)):
        assert out.outputs[0].token_ids == ref.greedy(prompt, GREEDY.max_tokens)
    # a sync that must transform (HF names, [out, in] kernels, on the device) copies what it transforms and
    # shares what it takes as it is (the norms' scales); the trainer's arrays it shared before are not deleted
    hf = {k: jnp.asarray(v) for k, v in to_hf(model).items()}
    engine.sync_weights(hf, "hf")
    shared = dict(zip(engine.runner.weights._paths, engine.runner.weights.shared))
    assert not shared["layers.0.self_attn.q_proj.kernel"] and shared["layers.0.input_layernorm.scale"]
    assert not any(x.is_deleted() for x in param_leaves(new))
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, GREEDY)):
        assert out.outputs[0].token_ids == ref.greedy(prompt, GREEDY.max_tokens)


def test_a_repeated_shared_sync_is_matched_not_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """After one shared sync that only swapped references, a tree of the same structure and layouts is matched
    in one pass (no planning); a tree that differs in a leaf takes the full path, which copies that leaf; a
    tree with donated arrays is refused with nothing changed."""
    import weight_sync

    model = make_model(0)
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, share_weights=True)
    engine.sync_weights(trained(model, 1))  # the full path, which records the swap
    plans = []
    real_plan = weight_sync.plan
    monkeypatch.setattr(weight_sync, "plan", lambda *a, **k: plans.append(1) or real_plan(*a, **k))
    new = trained(model, 2)
    engine.sync_weights(new)
    assert plans == [] and all(a is b for a, b in zip(param_leaves(engine.runner.params), param_leaves(new)))
    nnx.update(model, new)
    ref = Reference(model)
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, GREEDY)):
        assert out.outputs[0].token_ids == ref.greedy(prompt, GREEDY.max_tokens)
    # one leaf on the host: not the engine's layout, so planned, copied and held by the engine
    flat = dict(nnx.to_flat_state(trained(model, 3)))
    key = next(k for k in flat if "q_proj" in ".".join(map(str, k)))
    flat[key] = nnx.Param(np.asarray(flat[key].get_value()))
    engine.sync_weights(nnx.from_flat_state(flat))
    assert plans == [1] and engine.runner.weights.shared.count(False) == 1
    # a donated tree: refused before anything changes, the engine keeps the arrays it had
    kept = trained(model, 4)
    engine.sync_weights(kept)
    donated = trained(model, 5)
    jax.tree.map(lambda x: x.delete(), donated)
    with pytest.raises(weight_sync.WeightSyncError, match="was deleted or donated"):
        engine.sync_weights(donated)
    assert all(a is b for a, b in zip(param_leaves(engine.runner.params), param_leaves(kept)))
    assert len(engine.generate(PROMPTS, GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_a_donating_update_gets_a_clear_error_and_a_sync_mends_it() -> None:
    """An Optax update jitted with `donate_argnums` deletes the arrays the engine shares: the next step raises
    `SharedWeightsDeleted` naming them and `sync_weights` as the fix, before anything runs; the request waits
    and finishes after the sync, as under the new weights."""
    model = make_model(0)
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, share_weights=True)
    params = nnx.state(model, nnx.Param)
    tx = optax.sgd(1e-2)
    opt_state = tx.init(params)

    @jax.jit
    def objective(p: nnx.State) -> jax.Array:
        return sum(jnp.sum(x * x) for x in jax.tree.leaves(p))

    update = jax.jit(lambda p, s: optax.apply_updates(p, tx.update(jax.grad(objective)(p), s, p)[0]),
                     donate_argnums=0)
    rid = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    new = update(params, opt_state)
    assert any(x.is_deleted() for x in param_leaves(params))
    with pytest.raises(SharedWeightsDeleted, match=r"engine.sync_weights\(params\)") as err:
        engine.step()
    assert "layers.0" in str(err.value) and rid in engine.core.requests  # nothing ran, nothing was lost
    engine.sync_weights(new)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == GREEDY.max_tokens


def test_sleep_and_wake_leave_the_trainers_arrays_alone() -> None:
    model = make_model(0)
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, share_weights=True)
    before = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]
    engine.sleep(offload_weights=True)
    assert not any(x.is_deleted() for x in param_leaves(nnx.state(model, nnx.Param)))
    assert engine.stats().kv_cache_bytes == 0
    engine.wake()
    assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)] == before


def test_the_kv_cache_as_a_fraction_of_free_memory() -> None:
    with open("/proc/meminfo") as f:
        available = int(dict(line.split(":", 1) for line in f)["MemAvailable"].split()[0]) * 1024
    kw = {k: v for k, v in ENGINE_KW.items() if k != "max_model_len"}
    engine = Engine.from_model(make_model(0), ByteTokenizer(), **kw, max_model_len=64, kv_cache_memory_fraction=0.001)
    stats = engine.stats()
    assert 0.0008 * available <= stats.kv_cache_bytes <= 0.001 * available  # (whole blocks only)
    assert stats.program_bytes == 0  # nothing compiled yet
    engine.generate(PROMPTS, GREEDY)
    assert engine.stats().program_bytes > 0
    with pytest.raises(ValueError, match="kv_cache_memory_fraction must be a number in"):
        Engine.from_model(make_model(0), ByteTokenizer(), **ENGINE_KW, kv_cache_memory_fraction=1.5)
