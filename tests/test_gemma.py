"""Gemma 2 and Gemma 3 (text), and Mistral's windowed layers, against transformers: tiny random checkpoints written by transformers load with
logits within 1e-4 of its forward; the engine's greedy tokens equal transformers' `generate` (whose cache
honours the sliding window) with prompts and outputs past the window and across pages; rollout logprobs
equal the model's own full-sequence forward, also for n samples sharing a cached prompt (windowed layers
skip the cascade); `sync_weights(mapping="hf")` takes another checkpoint; tensor-parallel meshes give the
same tokens; both config.json forms of Gemma 3 read the same."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from rollout.engine import Engine
from rollout.sampling_params import SamplingParams
from runner.models.loader import load_model
from runner.models.registry import config_from_hf
from test_engine import ByteTokenizer, rand_prompt

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

KW = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=64, block_size=16)
COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=128, sliding_window=6,
              query_pre_attn_scalar=12, eos_token_id=1, bos_token_id=2, pad_token_id=0)
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}


def hf_gemma(family: str, seed: int, tmp: Path) -> tuple[object, Path]:
    """A 4-layer model with a 6-token window (Gemma 2: layers 0, 2 sliding, soft-caps 3 / 15; Gemma 3:
    layers 0, 1, 3 sliding with their own RoPE base, linear RoPE scaling on the global layer), saved."""
    torch.manual_seed(seed)
    if family == "gemma2":
        cfg = transformers.Gemma2Config(**COMMON, attn_logit_softcapping=3.0, final_logit_softcapping=15.0)
        cls = transformers.Gemma2ForCausalLM
    else:
        cfg = transformers.Gemma3TextConfig(**COMMON, rope_parameters=GEMMA3_ROPE, layer_types=[
            "sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
        cls = transformers.Gemma3ForCausalLM
    cfg._attn_implementation = "eager"  # the soft-cap is applied by the eager path
    model = cls(cfg).eval()
    with torch.no_grad():  # unit-scale weights, norm offsets away from zero: peaked logits, no greedy ties
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.dim() > 1 else 0.2)
    path = tmp / f"{family}-{seed}"
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    return hf_gemma(request.param, 0, tmp_path_factory.mktemp(request.param))


def hf_greedy(hf: object, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                           pad_token_id=0)[0, len(prompt):].tolist()


def full_logprobs(model: object, ids: list[int]) -> np.ndarray:
    full = np.asarray(model(jnp.asarray([ids]), jnp.arange(len(ids))[None]))[0].astype(np.float64)
    return full - np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True)) - full.max(-1, keepdims=True)


def test_logits_greedy_and_logprobs_equal_transformers(checkpoint: tuple[object, Path]) -> None:
    hf, path = checkpoint
    model, cfg = load_model(str(path))
    assert cfg.sliding_window == 6 and cfg.sandwich_norms and cfg.tie_word_embeddings
    assert cfg.sliding_layers == ((0, 2) if cfg.family == "gemma2" else (0, 1, 3))
    ids = np.array([rand_prompt(np.random.default_rng(i), 24) for i in range(2)])
    ours = np.asarray(model(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(24), ids.shape)))
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    engine = Engine.from_model(model, ByteTokenizer(), **KW)
    prompts = [rand_prompt(np.random.default_rng(10 + i), n) for i, n in enumerate((3, 17, 35))]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0))
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert c.token_ids == hf_greedy(hf, prompt, 20)
        logp = full_logprobs(model, prompt + c.token_ids)
        np.testing.assert_allclose(c.logprobs.values, [logp[len(prompt) - 1 + i, t] for i, t in enumerate(c.token_ids)],
                                   atol=2e-5)


def test_samples_sharing_a_cached_prompt_keep_exact_logprobs(checkpoint: tuple[object, Path]) -> None:
    """n samples of one 40-token prompt (the cascade over its shared pages runs on global layers only)
    and a second request hitting the prefix cache: every sampled token's logprob is the full forward's."""
    _, path = checkpoint
    model, _ = load_model(str(path))
    engine = Engine.from_model(model, ByteTokenizer(), **KW)
    prompt = rand_prompt(np.random.default_rng(5), 40)
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=0, seed=3)
    for out in engine.generate([prompt], sp) + engine.generate([prompt], sp):
        for c in out.outputs:
            logp = full_logprobs(model, prompt + c.token_ids)
            np.testing.assert_allclose(c.logprobs.values,
                                       [logp[len(prompt) - 1 + i, t] for i, t in enumerate(c.token_ids)], atol=2e-5)


def test_sync_weights_takes_another_hf_checkpoint(checkpoint: tuple[object, Path], tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    hf, path = checkpoint
    family = "gemma2" if "gemma2" in path.name else "gemma3"
    model, _ = load_model(str(path))
    other, other_path = hf_gemma(family, 1, tmp_path)
    engine = Engine.from_model(model, ByteTokenizer(), **KW)
    tensors = load_file(str(other_path / "model.safetensors"))
    assert "model.layers.3.post_feedforward_layernorm.weight" in tensors
    engine.sync_weights(tensors, "hf", version=2)
    prompt = rand_prompt(np.random.default_rng(3), 12)
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert out.outputs[0].token_ids == hf_greedy(other, prompt, 10) and out.outputs[0].policy_version == 2
    bad = dict(tensors)
    del bad["model.layers.1.pre_feedforward_layernorm.weight"]
    with pytest.raises(ValueError, match="pre_feedforward_layernorm"):
        engine.sync_weights(bad, "hf")
    (again,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert again.outputs[0].token_ids == out.outputs[0].token_ids  # the refused sync changed nothing


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(1, 2), (2, 2)])
def test_a_mesh_gives_the_same_tokens(checkpoint: tuple[object, Path], mesh: tuple[int, int]) -> None:
    _, path = checkpoint
    model, _ = load_model(str(path))
    prompts = [rand_prompt(np.random.default_rng(20 + i), n) for i, n in enumerate((9, 30, 4))]
    sp = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=0)
    one = Engine.from_model(model, ByteTokenizer(), **KW).generate(prompts, sp)
    many = Engine.from_model(model, ByteTokenizer(), mesh=mesh, **KW).generate(prompts, sp)
    for a, b in zip(one, many):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(a.outputs[0].logprobs.values, b.outputs[0].logprobs.values, atol=2e-5)


def test_hub_and_transformers_5_gemma3_configs_read_the_same() -> None:
    """A hub config.json (rope_local_base_freq, sliding_window_pattern, rope_scaling) and transformers 5's
    (rope_parameters per layer type, layer_types) describe the same model."""
    base = dict(COMMON, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_hidden_layers=7)
    hub = config_from_hf(dict(base, rope_theta=1e6, rope_local_base_freq=10000.0, sliding_window_pattern=6,
                                        rope_scaling={"rope_type": "linear", "factor": 8.0}))
    new = config_from_hf(dict(base, layer_types=["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
                                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                            "rope_theta": 1e6}}))
    assert hub == new and hub.sliding_layers == (0, 1, 2, 3, 4, 6) and hub.rope_scaling.rope_type == "linear"
    with pytest.raises(ValueError, match="hidden_activation"):
        config_from_hf(dict(base, hidden_activation="relu"))


def test_mistral_sliding_window_equals_transformers(tmp_path: Path) -> None:
    """Mistral (Llama's layers, every one windowed): logits and greedy tokens past the window."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(**{k: v for k, v in COMMON.items() if k != "query_pre_attn_scalar"},
                                     rope_theta=10000.0, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    hf = transformers.MistralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3 if p.dim() > 1 else 0.2)
    hf.save_pretrained(tmp_path / "mistral")
    model, mc = load_model(str(tmp_path / "mistral"))
    assert mc.family == "mistral" and mc.sliding_layers == (0, 1, 2, 3) and mc.sliding_window == 6
    ids = np.array([rand_prompt(np.random.default_rng(i), 24) for i in range(2)])
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(24), ids.shape))),
                               theirs, atol=1e-4, rtol=0)
    prompt = rand_prompt(np.random.default_rng(4), 21)
    (out,) = Engine.from_model(model, ByteTokenizer(), **KW).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 16)
