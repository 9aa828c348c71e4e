"""The engine as Tunix's rollout engine (`rollout.integrations.tunix.JaxRollout`), on tiny random Tunix
models of each supported family: the engine built from a Tunix model gives Tunix's logits; `generate`
returns Tunix's `RolloutOutput` with greedy tokens and logprobs of Tunix's own forward; `update_params`
makes it exactly an engine built from the new parameters, with no compile; a short `GrpoLearner` run
with `rollout_engine=JaxRollout` completes and its rollout logprobs agree with Tunix's recomputation."""

from __future__ import annotations

import numpy as np
import pytest

tunix = pytest.importorskip("tunix", reason="the [tunix] extra is not installed")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from tunix.models.gemma3 import model as gemma3  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.models.qwen2 import model as qwen2  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402
from tunix.rl import common  # noqa: E402
from tunix.rl import rl_cluster as rlc  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from rollout.integrations.tunix import JaxRollout  # noqa: E402
from rollout.integrations.tunix_models import engine_model  # noqa: E402
from weight_sync.compiles import num_compilations  # noqa: E402

VOCAB, PAD, BOS, EOS = 96, 0, 1, 2


class CharTokenizer:
    """One token per printable character (ids 3..95), BOS 1, EOS 2, PAD 0: the interface Tunix adapts."""

    def encode(self, text: str, **kw: object) -> list[int]:
        return [3 + (ord(c) - 32) % (VOCAB - 3) for c in text]

    def decode(self, ids: list[int], **kw: object) -> str:
        return "".join(chr(32 + (i - 3) % 95) if i >= 3 else "" for i in ids)

    def bos_id(self) -> int:
        return BOS

    def eos_id(self) -> int:
        return EOS

    def pad_id(self) -> int:
        return PAD


def make_tunix(family: str, seed: int = 0, tied: bool = False) -> nnx.Module:
    """A tiny Tunix model with unit-scale random weights (Tunix zero-initialises some kernels)."""
    common_kw = dict(num_layers=2, vocab_size=VOCAB, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8,
                     num_kv_heads=2, norm_eps=1e-5)
    if family == "llama3":
        model = llama3.Llama3(llama3.ModelConfig(**common_kw, rope_theta=500_000, weight_tying=tied),
                              rngs=nnx.Rngs(seed))
    elif family == "qwen2":
        model = qwen2.Qwen2(qwen2.ModelConfig(**common_kw, rope_theta=10_000, use_tied_embedding=tied),
                            rngs=nnx.Rngs(seed))
    elif family.startswith("gemma3"):  # six layers: five sliding (window 4), one global with linear RoPE scaling
        model = gemma3.Gemma3(gemma3.ModelConfig(
            num_layers=6, num_embed=VOCAB, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8,
            num_kv_heads=4 if family == "gemma3_mha" else 2, sliding_window_size=4, local_base_frequency=10_000,
            global_base_frequency=1_000_000, global_scale_factor=8.0, param_dtype=jnp.float32), rngs=nnx.Rngs(seed))
    else:
        moe = dict(num_experts=4, num_experts_per_tok=2) if family == "qwen3_moe" else {}
        model = qwen3.Qwen3(qwen3.ModelConfig(**common_kw, rope_theta=1_000_000, use_tied_embedding=tied, **moe),
                            rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def init(path: tuple, x: jax.Array) -> jax.Array:
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            return jnp.asarray(1.0 + 0.2 * rng.standard_normal(x.shape), x.dtype)
        if "o_proj" in name or "attn_vec" in name:
            fan_in = int(np.prod(x.shape[:-1]))  # [heads, head_dim, embed]
        elif "kv_einsum" in name or "qkv_einsum" in name:
            fan_in = x.shape[2]  # [2 or 3, heads, embed, head_dim]
        elif "q_einsum" in name:
            fan_in = x.shape[1]  # [heads, embed, head_dim]
        else:
            fan_in = x.shape[1] if x.ndim == 3 and "mlp" in name else x.shape[0]  # experts [E, in, out]
        scale = 1.0 if "embed" in name else 1.0 / np.sqrt(max(fan_in, 1))
        return jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(init, params), rest)


def tunix_logits(model: nnx.Module, ids: list[int]) -> np.ndarray:
    tokens = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    mask = jnp.tril(jnp.ones((1, len(ids), len(ids)), jnp.bool_))
    logits, _ = model(tokens, positions, None, mask)
    return np.asarray(logits[0], np.float64)


def rollout_config(**kw: object) -> base_rollout.RolloutConfig:
    defaults = dict(max_tokens_to_generate=10, max_prompt_length=16, temperature=0.0, kv_cache_size=64,
                    return_logprobs=True)
    return base_rollout.RolloutConfig(**{**defaults, **kw})


FAMILIES = [("llama3", False), ("llama3", True), ("qwen2", True), ("qwen3", False), ("qwen3_moe", False),
            ("gemma3", True), ("gemma3_mha", True)]


@pytest.mark.parametrize("family, tied", FAMILIES)
def test_engine_model_gives_tunix_logits(family: str, tied: bool) -> None:
    model = make_tunix(family, tied=tied)
    ours = engine_model(model, dtype="float32", max_model_len=64)
    ids = [BOS] + CharTokenizer().encode("What is 12 + 30? It is")
    want = tunix_logits(model, ids)
    got = np.asarray(ours(jnp.asarray([ids]), jnp.arange(len(ids))[None])[0], np.float64)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family, tied", FAMILIES[:1] + FAMILIES[3:4] + FAMILIES[5:6])
def test_generate_update_params_and_logps(family: str, tied: bool) -> None:
    model = make_tunix(family, tied=tied)
    cfg = rollout_config()
    rollout = JaxRollout(model, CharTokenizer(), None, cfg, max_num_seqs=8)
    prompts = ["What is 2 + 3?", "What is 2 + 3?", "Name a colour:"]
    out = rollout.generate(prompts, cfg)
    tok = CharTokenizer()
    assert out.left_padded_prompt_tokens.shape == (3, 16)
    for i, prompt in enumerate(prompts):
        ids = [BOS] + tok.encode(prompt)
        assert out.left_padded_prompt_tokens[i, 16 - len(ids):].tolist() == ids
        assert np.all(out.left_padded_prompt_tokens[i, :16 - len(ids)] == PAD)
        seq = list(ids)
        for j, token in enumerate(out.tokens[i].tolist()):  # greedy: Tunix's argmax, logprob of its forward
            logits = tunix_logits(model, seq)[-1]
            assert token == int(np.argmax(logits)) and token != EOS
            logp = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
            np.testing.assert_allclose(out.logprobs[i][j], logp[token], atol=1e-4)
            seq.append(token)
        assert out.text[i] == tok.decode(out.tokens[i].tolist())

    # get_per_token_logps = Tunix's own recomputation on its model
    completions = np.full((3, 10), PAD, np.int32)
    for i, t in enumerate(out.tokens):
        completions[i, :len(t)] = t
    ours = np.asarray(rollout.get_per_token_logps(jnp.asarray(out.left_padded_prompt_tokens), jnp.asarray(completions)))
    graphdef, state = nnx.split(model)
    want = np.asarray(common.compute_per_token_logps(graphdef, state, jnp.asarray(out.left_padded_prompt_tokens),
                                                     jnp.asarray(completions), PAD, EOS))
    valid = completions != PAD
    np.testing.assert_allclose(ours[valid], want[valid], atol=1e-4)

    # update_params: exactly an engine built from the new parameters, with no compile
    new_model = make_tunix(family, seed=5, tied=tied)
    compiles = num_compilations()
    rollout.update_params(nnx.state(new_model, nnx.Param), (nnx.Param,))
    synced = rollout.generate(prompts, cfg)
    assert num_compilations() == compiles
    fresh = JaxRollout(new_model, CharTokenizer(), None, cfg, max_num_seqs=8).generate(prompts, cfg)
    assert [t.tolist() for t in synced.tokens] == [t.tolist() for t in fresh.tokens]
    assert [t.tolist() for t in synced.tokens] != [t.tolist() for t in out.tokens]
    np.testing.assert_allclose(np.concatenate(synced.logprobs), np.concatenate(fresh.logprobs), atol=1e-6)


def test_groups_sample_distinct_completions_and_bad_config_is_refused() -> None:
    model = make_tunix("llama3")
    cfg = rollout_config(temperature=1.0, seed=3)
    rollout = JaxRollout(model, CharTokenizer(), None, cfg, max_num_seqs=8)
    out = rollout.generate(["Count: 1 2 3"] * 4, cfg)
    assert len({tuple(t.tolist()) for t in out.tokens}) > 1  # one request, n = 4 distinct samples
    again = rollout.generate(["Count: 1 2 3"] * 4, cfg)
    assert [t.tolist() for t in again.tokens] == [t.tolist() for t in out.tokens]  # seeded
    filtered = rollout_config(temperature=0.7, top_k=20, top_p=0.9, seed=4)  # logprobs without renormalisation
    out = rollout.generate(["Count: 1 2 3"], filtered)
    seq = [BOS] + CharTokenizer().encode("Count: 1 2 3")
    for j, token in enumerate(out.tokens[0].tolist()):
        scaled = tunix_logits(model, seq)[-1] / 0.7
        want = scaled[token] - scaled.max() - np.log(np.sum(np.exp(scaled - scaled.max())))
        np.testing.assert_allclose(out.logprobs[0][j], want, atol=1e-4)
        seq.append(token)
    with pytest.raises(ValueError, match="expert_parallel_size"):
        rollout.generate(["x"], rollout_config(expert_parallel_size=2))
    with pytest.raises(ValueError, match="filter_types"):
        rollout.update_params(nnx.state(model, nnx.LoRAParam), (nnx.LoRAParam,))
    assert len(rollout.generate(["x"], cfg).tokens) == 1  # still usable


class SpacePadTokenizer(CharTokenizer):
    """Pad = the id of " ": prompts hold pad-valued tokens, which Tunix's trainer masks out."""

    def pad_id(self) -> int:
        return CharTokenizer().encode(" ")[0]


def test_pad_valued_prompt_tokens_are_what_tunix_trains_on() -> None:
    model = make_tunix("qwen3")
    tok = SpacePadTokenizer()
    cfg = rollout_config(temperature=0.8, seed=9, max_prompt_length=32)
    rollout = JaxRollout(model, tok, None, cfg, max_num_seqs=8)
    out = rollout.generate(["What is 2 + 3 ?", "a b c"], cfg)
    pad = tok.pad_id()
    assert int(np.sum(out.left_padded_prompt_tokens[0] == pad)) > 32 - len("What is 2 + 3 ?") - 1  # spaces kept
    completions = np.full((2, 10), pad, np.int32)
    for i, t in enumerate(out.tokens):
        completions[i, :len(t)] = t
    graphdef, state = nnx.split(model)
    want = np.asarray(common.compute_per_token_logps(graphdef, state, jnp.asarray(out.left_padded_prompt_tokens),
                                                     jnp.asarray(completions), pad, EOS, temperature=0.8))
    for i, lp in enumerate(out.logprobs):
        kept = np.flatnonzero(out.tokens[i] != pad)  # (a sampled pad token is masked by Tunix too)
        kept = kept[kept < (np.argmax(out.tokens[i] == pad) if np.any(out.tokens[i] == pad) else len(lp))]
        np.testing.assert_allclose(np.asarray(lp)[kept], want[i, kept], atol=1e-4)


@pytest.mark.slow
def test_grpo_learner_runs_with_this_engine() -> None:
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    actor, reference = make_tunix("llama3"), make_tunix("llama3")
    cfg = rollout_config(temperature=0.9, max_tokens_to_generate=8)
    training = rlc.RLTrainingConfig(actor_optimizer=optax.adam(1e-3), eval_every_n_steps=100, max_steps=2,
                                    mini_batch_size=2, train_micro_batch_size=2)
    cluster = rlc.RLCluster(actor=actor, reference=reference, tokenizer=CharTokenizer(), cluster_config=rlc.ClusterConfig(
        role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
        rollout_engine=JaxRollout, offload_to_cpu=False, training_config=training, rollout_config=cfg))
    assert isinstance(cluster.rollout, JaxRollout)
    before = jax.tree.map(np.asarray, nnx.state(cluster.actor_trainer.model, nnx.Param))

    def reward(prompts: list[str], completions: list[str], **kw: object) -> list[float]:
        return [float(c.count("1")) for c in completions]

    learner = grpo_learner.GrpoLearner(rl_cluster=cluster, reward_fns=[reward],
                                       algo_config=grpo_learner.GrpoConfig(num_generations=2, beta=0.04))
    learner.train([{"prompts": np.array(["Count: 1 2", "Say 1:"])} for _ in range(2)])
    after = nnx.state(cluster.actor_trainer.model, nnx.Param)
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before, after))
    assert any(changed)  # it trained, and synced into the engine between steps:
    out = cluster.rollout.generate(["Count: 1 2"], cfg)
    graphdef, state = nnx.split(cluster.actor_trainer.model)
    completion = np.full((1, 8), PAD, np.int32)
    completion[0, :len(out.tokens[0])] = out.tokens[0]
    want = np.asarray(common.compute_per_token_logps(graphdef, state, jnp.asarray(out.left_padded_prompt_tokens),
                                                     jnp.asarray(completion), PAD, EOS, temperature=0.9))
    n = len(out.tokens[0])
    np.testing.assert_allclose(out.logprobs[0], want[0, :n], atol=1e-4)
