"""Qwen3-MoE and Mixtral (routed experts) against transformers: a tiny random checkpoint written by transformers loads
with logits within 1e-4 of its forward, the engine's greedy tokens equal transformers' `generate`, rollout
logprobs equal the model's own full-sequence forward, `sync_weights(mapping="hf")` takes the per-expert
HF tensors (stacked into one `[experts, in, out]` parameter per projection), and expert-parallel meshes
give the same tokens."""

from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from rollout.engine import Engine
from rollout.sampling_params import SamplingParams
from runner.models.loader import load_model
from test_engine import ByteTokenizer, rand_prompt

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

KW = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=64, block_size=16)


# HF name of layer 2's expert 1 up projection, and the family's expected MoE layers
EXPERT_UP = {"qwen3_moe": "model.layers.2.mlp.experts.1.up_proj.weight",
             "mixtral": "model.layers.2.block_sparse_moe.experts.1.w3.weight"}
MOE_LAYERS = {"qwen3_moe": (0, 2), "mixtral": (0, 1, 2)}


def hf_moe(seed: int, tmp: Path, family: str = "qwen3_moe") -> tuple[object, Path]:
    """A 3-layer MoE, 4 experts, top-2, renormalised: Qwen3-MoE (layer 1 dense) or Mixtral (every layer
    routed, a 20-token sliding window), saved."""
    torch.manual_seed(seed)
    common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False,
                  eos_token_id=1, bos_token_id=None, pad_token_id=0)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
        model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    else:
        cfg = transformers.MixtralConfig(**common, intermediate_size=16, num_local_experts=4, sliding_window=20)
        cfg._attn_implementation = "eager"
        model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():  # unit-scale weights: peaked logits, routing far from ties
        for p in model.parameters():
            p.normal_(0.0, (0.5 if family == "qwen3_moe" else 0.3) if p.dim() > 1 else 0.1)  # Mixtral: logits ~10 at 0.5
            if p.dim() == 1:
                p.add_(1.0)
    path = tmp / f"{family}-{seed}"
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    return hf_moe(0, tmp_path_factory.mktemp("moe"), request.param)


def family_of(path: Path) -> str:
    return path.name.rsplit("-", 1)[0]


def test_logits_and_greedy_equal_transformers(checkpoint: tuple[object, Path]) -> None:
    hf, path = checkpoint
    model, cfg = load_model(str(path))
    assert cfg.family == family_of(path) and cfg.moe_layers == MOE_LAYERS[cfg.family] and cfg.num_experts == 4
    ids = np.array([rand_prompt(np.random.default_rng(i), 24) for i in range(2)])
    ours = np.asarray(model(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(24), ids.shape)))
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    engine = Engine.from_model(model, ByteTokenizer(), **KW)
    prompts = [rand_prompt(np.random.default_rng(10 + i), n) for i, n in enumerate((5, 17, 30))]  # past the window
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                               pad_token_id=0)[0, len(prompt):].tolist()
        c = out.outputs[0]
        assert c.token_ids == want
        full = np.asarray(model(jnp.asarray([prompt + c.token_ids]), jnp.arange(len(prompt) + 16)[None]))[0]
        logp = full - np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True)) - full.max(-1, keepdims=True)
        want_lp = [logp[len(prompt) - 1 + i, t] for i, t in enumerate(c.token_ids)]
        np.testing.assert_allclose(c.logprobs.values, want_lp, atol=2e-5)


def test_sync_weights_takes_the_hf_expert_tensors(checkpoint: tuple[object, Path], tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    _, path = checkpoint
    model, _ = load_model(str(path))
    other, other_path = hf_moe(1, tmp_path, family_of(path))
    engine = Engine.from_model(model, ByteTokenizer(), **KW)
    tensors = load_file(str(other_path / "model.safetensors"))
    assert EXPERT_UP[family_of(path)] in tensors
    engine.sync_weights(tensors, "hf", version=2)
    prompt = rand_prompt(np.random.default_rng(3), 12)
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    with torch.no_grad():
        want = other.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == want and out.outputs[0].policy_version == 2
    bad = dict(tensors)
    del bad[EXPERT_UP[family_of(path)]]
    with pytest.raises(ValueError, match=re.escape(f"lacks source(s) ['{EXPERT_UP[family_of(path)]}']")):
        engine.sync_weights(bad, "hf")


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(1, 2), (2, 2)])
def test_expert_parallel_meshes_give_the_same_tokens(checkpoint: tuple[object, Path], mesh: tuple[int, int]) -> None:
    """Experts split over the `model` axis (each device holds whole experts), on one replica and on two."""
    from jax.sharding import PartitionSpec

    _, path = checkpoint
    model, _ = load_model(str(path))
    prompts = [rand_prompt(np.random.default_rng(20 + i), n) for i, n in enumerate((9, 26, 3))]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    one = Engine.from_model(model, ByteTokenizer(), **KW).generate(prompts, sp)
    engine = Engine.from_model(model, ByteTokenizer(), mesh=mesh, **KW)
    kernel = engine.runner.params["layers"][0]["mlp"]["experts"]["gate_proj"]["kernel"].value
    assert kernel.shape[0] == 4 and kernel.sharding.spec == PartitionSpec("model", None, None)
    for a, b in zip(one, engine.generate(prompts, sp)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(a.outputs[0].logprobs.values, b.outputs[0].logprobs.values, atol=2e-5)


@pytest.mark.parametrize("num_tokens", [16, 40, 300])
def test_segment_loop_equals_ragged_dot(checkpoint: tuple[object, Path], num_tokens: int) -> None:
    """The CPU backend's expert loop over row windows (`SparseMoE._segments`) gives ragged_dot's result,
    with segments shorter and longer than a window and experts nobody chose; the CPU engine uses it."""
    _, path = checkpoint
    model, _ = load_model(str(path))
    block = model.layers[0].mlp
    x = jnp.asarray(np.random.default_rng(num_tokens).standard_normal((num_tokens, model.config.hidden_size)),
                    jnp.float32)
    want = np.asarray(block(x))
    block.grouped_matmul = "segments"
    np.testing.assert_allclose(np.asarray(block(x)), want, atol=2e-5)
    engine = Engine.from_model(model, ByteTokenizer(), **KW)
    assert engine.runner.model.layers[0].mlp.grouped_matmul == ("segments" if engine.stats().backend == "cpu"
                                                                 else "ragged_dot")
