"""Tunix's model classes as the engine sees them: which family a Tunix model is, the engine's
`ModelConfig` for it, and the engine's model built from its parameters in memory (no file read).

Supported: `tunix.models.llama3.model.Llama3`, `tunix.models.qwen2.model.Qwen2`,
`tunix.models.qwen3.model.Qwen3` (dense and MoE), `tunix.models.gemma3.model.Gemma3` (text), as of
google-tunix 0.1.7. Tunix 0.1.7's Llama 3 and
Qwen 3 apply RoPE with base 1e6 whatever their config's `rope_theta` says (their `apply_rope` is
called without it); the engine serves the model Tunix trains, so it takes that base too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import weight_sync
from runner.models.config import ModelConfig, RopeScaling
from runner.models.family import CausalLM
from runner.models.registry import build_model
from weight_sync.rules import Rule
from weight_sync.tunix_presets import TunixShapes, tunix_rules

TUNIX_ROPE_BASE = 1_000_000.0  # what Tunix 0.1.7's Llama 3 and Qwen 3 forward passes compute with
_MODULES = {"tunix.models.llama3.model": "llama3", "tunix.models.qwen2.model": "qwen2",
            "tunix.models.qwen3.model": "qwen3", "tunix.models.gemma3.model": "gemma3"}


def tunix_family(model: nnx.Module) -> str:
    """"llama3", "qwen2" or "qwen3" for a Tunix model, or a ValueError naming what is supported."""
    family = _MODULES.get(type(model).__module__)
    if family is None:
        raise ValueError(f"the engine serves Tunix's Llama3, Qwen2, Qwen3 and Gemma3 classes; got {type(model).__module__}."
                         f"{type(model).__name__} (build the engine with Engine.from_model for other models)")
    return family


def engine_config(model: nnx.Module, *, dtype: str, max_model_len: int) -> ModelConfig:
    """The engine's `ModelConfig` of a Tunix model (float `dtype` for weights and compute)."""
    family, c = tunix_family(model), model.config
    if family == "gemma3":
        return _gemma3_config(c, dtype=dtype, max_model_len=max_model_len)
    tied = bool(getattr(c, "weight_tying", False) or getattr(c, "use_tied_embedding", False))
    moe = family == "qwen3" and bool(getattr(c, "num_experts", None))
    if moe and getattr(c, "num_experts_per_tok", None) is None:
        raise ValueError("a Tunix Qwen3 MoE config needs num_experts_per_tok")
    return ModelConfig(
        family={"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3_moe" if moe else "qwen3"}[family],
        vocab_size=c.vocab_size, hidden_size=c.embed_dim, intermediate_size=c.hidden_dim,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=float(c.norm_eps),
        rope_theta=float(c.rope_theta) if family == "qwen2" else TUNIX_ROPE_BASE,
        max_position_embeddings=max(max_model_len, 1), tie_word_embeddings=tied,
        qkv_bias=family == "qwen2", qk_norm=family == "qwen3", param_dtype=dtype, dtype=dtype,
        **(dict(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                moe_intermediate_size=c.hidden_dim, norm_topk_prob=True,
                moe_layers=tuple(range(c.num_layers))) if moe else {}))


def _gemma3_config(c: object, *, dtype: str, max_model_len: int) -> ModelConfig:
    """Tunix's Gemma 3 config: every sixth layer global (the rest sliding), RMSNorm eps 1e-6, tied head."""
    if getattr(c, "vision_config", None) is not None:
        raise ValueError("Tunix's Gemma 3 with a vision encoder is not served: build it without vision_config")
    if float(c.local_scale_factor) != 1.0:
        raise ValueError(f"Gemma 3 local_scale_factor {c.local_scale_factor} is not supported; supported: 1.0")
    by_head_dim = c.query_pre_attn_norm.name == "BY_ONE_OVER_SQRT_HEAD_DIM"
    window = c.sliding_window_size
    return ModelConfig(
        family="gemma3", vocab_size=c.num_embed, hidden_size=c.embed_dim, intermediate_size=c.hidden_dim,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=1e-6, rope_theta=float(c.global_base_frequency),
        rope_scaling=(RopeScaling(factor=float(c.global_scale_factor), rope_type="linear")
                      if float(c.global_scale_factor) != 1.0 else None),
        rope_local_theta=float(c.local_base_frequency), max_position_embeddings=max(max_model_len, 1),
        tie_word_embeddings=True, qk_norm=True, sandwich_norms=True,
        query_pre_attn_scalar=float(c.head_dim if by_head_dim else c.embed_dim // c.num_heads),
        sliding_window=int(window) if window else None,
        sliding_layers=tuple(i for i in range(c.num_layers) if i % 6 != 5) if window else (),
        param_dtype=dtype, dtype=dtype)


def sync_rules(model: nnx.Module) -> tuple[Rule, ...]:
    """The `weight_sync` mapping from this Tunix model's parameters to the engine's model."""
    c = model.config
    return tunix_rules(tunix_family(model), TunixShapes(c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim))


def params_dtype(model: nnx.Module) -> str:
    """The floating dtype of a Tunix model's parameters."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return str(jnp.dtype(leaves[0].dtype)) if leaves else "float32"


def engine_model(model: nnx.Module, *, dtype: str, max_model_len: int) -> CausalLM:
    """The engine's model of a Tunix model, its parameters copied (and cast to `dtype`) from memory."""
    cfg = engine_config(model, dtype=dtype, max_model_len=max_model_len)
    target = build_model(cfg, rngs=nnx.Rngs(0))  # its random parameters are replaced (and freed) one by one
    source = nnx.state(model, nnx.Param)
    state = nnx.state(target, nnx.Param)
    weight_sync.apply(weight_sync.plan(source, state, sync_rules(model)), source, state)
    return target
