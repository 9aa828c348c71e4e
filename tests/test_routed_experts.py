"""The routed-experts record (`EngineConfig(record_routed_experts=True)`): every token's experts in every
routed-experts layer equal the routing of the trainer's full-sequence forward over prompt + completion,
for chunked prefills, n samples sharing a prompt, prompts served from the prefix cache, preempted
sequences, one-step and multi-step decoding, async scheduling and n-gram speculation; the record packs
into `RolloutBatch.routed_experts` aligned with `input_ids`; bad settings are refused before anything is built."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollout.engine import Engine
from rollout.engine_config import EngineConfig
from rollout.routing_record import RoutingRecord
from rollout.sampling_params import SamplingParams
from runner.models.llama import LlamaForCausalLM
from runner.models.moe import SparseMoE
from runner.spec_decode.eagle3_config import Eagle3Config
from runner.spec_decode.ngram import NgramConfig
from test_engine import CFG, ByteTokenizer, make_model, rand_prompt

MOE_CFG = dataclasses.replace(CFG, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, moe_layers=(0, 1),
                              norm_topk_prob=True)
KW = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=32, block_size=8, record_routed_experts=True)


def make_moe(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer model whose MLPs are both 8 experts, top-2, with unit-scale weights (routing far from ties)."""
    model = LlamaForCausalLM(MOE_CFG, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(
        rng.standard_normal(x.shape) / np.sqrt(x.shape[-2] if x.ndim > 1 else 1) + (1.0 if x.ndim == 1 else 0.0),
        x.dtype), params))
    return model


def trainer_routing(model: LlamaForCausalLM, ids: list[int], monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    """The experts the full-sequence forward routes each token to, `[T, layers, k]` (layers in order)."""
    seen: list[np.ndarray] = []
    route = SparseMoE.route

    def recording(self: SparseMoE, x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        weights, experts = route(self, x)
        seen.append(np.asarray(experts))
        return weights, experts

    with monkeypatch.context() as m:
        m.setattr(SparseMoE, "route", recording)
        model(jnp.asarray([ids]), jnp.arange(len(ids))[None])
    return np.stack(seen, axis=1)


def check(model: LlamaForCausalLM, prompt: list[int], completion: object, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = prompt + completion.token_ids
    record = completion.routed_experts
    assert record is not None and record.shape == (len(ids) - 1, 2, 2), None if record is None else record.shape
    np.testing.assert_array_equal(record, trainer_routing(model, ids, monkeypatch)[:-1])


@pytest.fixture(scope="module")
def moe() -> LlamaForCausalLM:
    return make_moe(0)


@pytest.mark.parametrize("steps", [1, 4])
def test_record_equals_the_trainers_routing(moe: LlamaForCausalLM, steps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked prefills (prompts past the 32-token budget), n = 2 from one prompt, greedy and sampled."""
    engine = Engine.from_model(moe, ByteTokenizer(), num_scheduler_steps=steps, **KW)
    prompts = [rand_prompt(np.random.default_rng(i), n) for i, n in enumerate((5, 41, 17))]
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        for completion in out.outputs:
            check(moe, prompt, completion, monkeypatch)
    # a prompt extending a finished one: its first blocks come from the prefix cache, their record with them
    longer = prompts[1] + outs[1].outputs[0].token_ids[:8]
    (out,) = engine.generate([longer], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert engine.stats().prefix_cache_hit_tokens >= 40
    check(moe, longer, out.outputs[0], monkeypatch)


def test_record_after_preemption_and_with_ngram_drafts(moe: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    small = Engine.from_model(moe, ByteTokenizer(), **{**KW, "kv_cache_blocks": 14})
    prompts = [rand_prompt(np.random.default_rng(10 + i), 20) for i in range(4)]
    outs = small.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert small.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        check(moe, prompt, out.outputs[0], monkeypatch)
    drafting = Engine.from_model(moe, ByteTokenizer(), speculative=NgramConfig(k=3, auto_disable=False), **KW)
    repetitive = [[7, 8, 9, 10] * 6]
    (out,) = drafting.generate(repetitive, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    check(moe, repetitive[0], out.outputs[0], monkeypatch)


@pytest.mark.slow
def test_record_on_a_data_parallel_mesh(moe: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas, each over its own KV blocks: the record is written at global slots."""
    engine = Engine.from_model(moe, ByteTokenizer(), mesh=(2, 1), **KW)
    prompts = [rand_prompt(np.random.default_rng(40 + i), n) for i, n in enumerate((4, 19, 9, 35))]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        check(moe, prompt, out.outputs[0], monkeypatch)


def test_rollout_batch_aligns_the_record_with_input_ids(moe: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine.from_model(moe, ByteTokenizer(), **KW)
    prompts = [rand_prompt(np.random.default_rng(30 + i), n) for i, n in enumerate((6, 11))]
    batch = engine.rollout(prompts, SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=9, ignore_eos=True))
    routed = batch.routed_experts
    assert routed.shape == (*batch.input_ids.shape, 2, 2)
    for b in range(routed.shape[0]):
        n = int(batch.prompt_lens[b] + batch.completion_lens[b])
        ids = batch.input_ids[b, :n].tolist()
        np.testing.assert_array_equal(routed[b, :n - 1], trainer_routing(moe, ids, monkeypatch)[:-1])
        assert (routed[b, n - 1:] == -1).all()


def test_without_recording_there_is_no_record(moe: LlamaForCausalLM) -> None:
    engine = Engine.from_model(moe, ByteTokenizer(), **{**KW, "record_routed_experts": False})
    (out,) = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=3))
    assert out.outputs[0].routed_experts is None and engine.rollout([[3, 4]], SamplingParams(max_tokens=2)).routed_experts is None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="record_routed_experts needs a mixture-of-experts model"):
        Engine.from_model(make_model(0), ByteTokenizer(), **KW)
    with pytest.raises(ValueError, match="record_routed_experts must be True or False"):
        EngineConfig(record_routed_experts=1)
    with pytest.raises(ValueError, match="EAGLE-3"):
        EngineConfig(record_routed_experts=True, speculative=Eagle3Config(path="unused"))


def test_record_pages_like_the_kv_cache() -> None:
    """Slots are block * block_size + offset; positions past the block table are dropped."""
    record = RoutingRecord(num_blocks=4, block_size=2, num_layers=1, top_k=1)
    record.write([3, 1], 0, np.arange(5).reshape(5, 1, 1))  # the 5th position has no block: dropped
    np.testing.assert_array_equal(record.experts[:, 0, 0], [0, 0, 2, 3, 0, 0, 0, 1])
    np.testing.assert_array_equal(record.read([3, 1], 3)[:, 0, 0], [0, 1, 2])
