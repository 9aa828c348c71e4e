"""Colocation: `Engine.sleep()` frees the KV cache (and offloads the weights on request), `wake()` brings
them back without compiling; 100 sleep / wake / sync cycles leave device memory where it was and every
output identical."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rollout.engine import Engine
from rollout.sampling_params import SamplingParams
from weight_sync.compiles import num_compilations
from test_engine import ENGINE_KW, ByteTokenizer, make_model, rand_prompt


def live_bytes() -> int:
    """Device memory held by live arrays (the CPU backend has no allocator statistics)."""
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def test_sleep_wake_cycles_keep_memory_and_outputs() -> None:
    model = make_model(0)
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)
    prompts = [rand_prompt(np.random.default_rng(i), 7 + i) for i in range(3)]
    sp = SamplingParams(temperature=0.7, seed=4, max_tokens=12, ignore_eos=True, logprobs=0)
    want = engine.generate(prompts, sp)
    from test_weight_sync import to_hf

    same = to_hf(model)
    kv = sum(c.nbytes for c in engine.runner.kv_caches)
    weights = sum(x.nbytes for x in jax.tree.leaves(engine.runner.params))
    for cycle in range(100):
        offload = cycle % 2 == 1
        if cycle == 2:
            base, compiles = live_bytes(), num_compilations()
        before = live_bytes()
        engine.sleep(offload_weights=offload)
        assert engine.is_sleeping and before - live_bytes() >= kv + (weights if offload else 0)
        with pytest.raises(RuntimeError, match="asleep"):
            engine.generate(prompts[:1], sp)
        with pytest.raises(RuntimeError, match="asleep"):
            engine.sync_weights(same, "hf")
        engine.wake()
        assert not engine.is_sleeping
        engine.sync_weights(same, "hf")
        got = engine.generate(prompts, sp)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want], cycle
        for a, b in zip(got, want):
            np.testing.assert_allclose(a.outputs[0].logprobs.values, b.outputs[0].logprobs.values, atol=1e-5)
        if cycle >= 2:
            assert live_bytes() == base, cycle  # no growth
    assert num_compilations() == compiles  # waking compiles nothing
    engine.add_request(prompts[0], sp)
    with pytest.raises(RuntimeError, match="unfinished"):
        engine.sleep()
