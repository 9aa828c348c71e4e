"""Lag-aware admission (`EngineConfig(max_policy_lag=k, samples_per_version=B)`, AReaL's staleness
control) on the tiny random Llama of test_engine: at most (versions since the start + k + 1) x B samples
start; the rest wait (counted in `stats().num_lag_held`) until a sync, so no sample outlives the bound
and none is aborted for lag; a blocking `generate` that could only wait says so; `AsyncEngine` waits
for the sync and then finishes every request."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from flax import nnx

from rollout.async_engine import AsyncEngine
from rollout.engine import Engine
from rollout.sampling_params import SamplingParams
from test_engine import ENGINE_KW, ByteTokenizer, make_model, rand_prompt

PROMPTS = [rand_prompt(np.random.default_rng(900 + i), 8) for i in range(7)]
SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def make_engine() -> Engine:
    return Engine.from_model(make_model(0), ByteTokenizer(), max_policy_lag=1, samples_per_version=2, **ENGINE_KW)


def run_until_held(engine: Engine, finished: dict[str, list[int | None]]) -> None:
    while engine.has_unfinished_requests() and not engine.admission_held():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].policy_versions


def test_admission_keeps_every_sample_within_the_lag_bound() -> None:
    engine = make_engine()
    params = nnx.state(make_model(0), nnx.Param)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, SP, request_id=f"r{i}")
    finished: dict[str, list[int | None]] = {}
    run_until_held(engine, finished)
    assert len(finished) == 4 and engine.admission_held()  # (0 + 1 + 1) x 2 started, three held
    assert engine.stats().num_lag_held == 3
    with pytest.raises(RuntimeError, match="lag-aware admission"):
        engine.generate([PROMPTS[0]], SP)
    for version in (1, 2):
        engine.sync_weights(params, version=version)
        run_until_held(engine, finished)
    assert sorted(finished) == [f"r{i}" for i in range(7)] and not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats.num_lag_aborts == 0 and stats.num_lag_recomputes == 0 and stats.num_lag_held == 3
    (out,) = engine.generate([PROMPTS[0]], SP)  # usable afterwards (limit (2 + 1 + 1) x 2 = 8)
    assert len(out.outputs[0].token_ids) == 4


def test_async_engine_waits_for_the_sync_that_admits() -> None:
    engine = make_engine()
    params = nnx.state(make_model(0), nnx.Param)

    async def main() -> list[int]:
        aengine = AsyncEngine(engine)
        tasks = [asyncio.create_task(aengine.generate(p, SP)) for p in PROMPTS[:5]]
        for _ in range(600):
            if sum(t.done() for t in tasks) >= 4:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert sum(t.done() for t in tasks) == 4 and engine.admission_held()
        await aengine.sync_weights(params, version=1)
        outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        await aengine.close()
        return [len(o.outputs[0].token_ids) for o in outs]

    assert asyncio.run(main()) == [4] * 5
