"""`AsyncEngine`: concurrent callers over one engine, streams, early exits that abort, weight syncs
between steps; on the tiny random Llama of test_engine against its full forward."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rollout.async_engine import AsyncEngine
from rollout.engine import Engine
from rollout.sampling_params import SamplingParams
from test_engine import ENGINE_KW, ByteTokenizer, Reference, make_model, rand_prompt
from test_engine_sync import perturb
from test_weight_sync import to_hf

PROMPTS = [rand_prompt(np.random.default_rng(400 + i), n) for i, n in enumerate([3, 12, 25, 40, 7, 18])]


@pytest.fixture(scope="module")
def model():
    return make_model(0)


@pytest.fixture(scope="module")
def ref(model) -> Reference:
    return Reference(model)


def test_concurrent_streams_equal_the_reference(model, ref: Reference) -> None:
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)
    free = engine.core.block_manager.num_free_blocks

    async def main() -> tuple[list[list[int]], list[int], list[int]]:
        aengine = AsyncEngine(engine)

        async def stream(prompt: list[int], max_tokens: int) -> list[int]:
            ids: list[int] = []
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind="delta")
            async for out in aengine.generate_stream(prompt, sp):
                ids += out.outputs[0].token_ids
            return ids

        async def quits_early(prompt: list[int]) -> list[int]:
            sp = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
            async for out in aengine.generate_stream(prompt, sp, request_id="quitter"):
                if len(out.outputs[0].token_ids) >= 3:
                    return out.outputs[0].token_ids  # leaving the stream aborts the request
            raise AssertionError("the stream ended by itself")

        async def staggered(prompt: list[int]) -> list[int]:
            await asyncio.sleep(0.05)  # arrives while others run
            out = await aengine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
            return out.outputs[0].token_ids

        results = await asyncio.gather(*[stream(p, 5 + 3 * i) for i, p in enumerate(PROMPTS[:4])],
                                       quits_early(PROMPTS[4]), staggered(PROMPTS[5]))
        await aengine.close()
        return results[:4], results[4], results[5]

    streams, quit_ids, late = asyncio.run(main())
    for i, (prompt, ids) in enumerate(zip(PROMPTS, streams)):
        assert ids == ref.greedy(prompt, 5 + 3 * i)
    assert quit_ids == ref.greedy(PROMPTS[4], len(quit_ids))
    assert late == ref.greedy(PROMPTS[5], 9)
    assert not engine.core.requests and engine.core.block_manager.num_free_blocks == free  # the quitter was aborted


def test_sync_weights_between_steps_while_streaming(model) -> None:
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)
    new = perturb(model, 9)

    async def main() -> list[int | None]:
        aengine = AsyncEngine(engine)
        versions: list[int | None] = []
        synced = False
        sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, output_kind="delta")
        async for out in aengine.generate_stream(PROMPTS[2], sp):
            versions += out.outputs[0].policy_versions
            if len(versions) >= 8 and not synced:
                synced = True
                await aengine.sync_weights(to_hf(new), "hf", version=3)
        await aengine.close()
        return versions

    versions = asyncio.run(main())
    assert len(versions) == 40 and versions[0] is None and versions[-1] == 3
    switch = versions.index(3)
    assert 8 <= switch < 40 and set(versions[switch:]) == {3}


def test_a_bad_request_raises_in_the_caller(model) -> None:
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)

    async def main() -> None:
        aengine = AsyncEngine(engine)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await aengine.generate([5, 10_000], SamplingParams(max_tokens=3))
        out = await aengine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3))
        assert len(out.outputs[0].token_ids) == 3
        await aengine.close()

    asyncio.run(main())
