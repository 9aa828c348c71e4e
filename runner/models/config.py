"""Model configuration: the Llama-family hyper-parameters, built from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from runner.models.head_layout import HeadLayout

SUPPORTED_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama-3's (`rope_type="llama3"`) or linear (every frequency / `factor`)."""

    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 1.0  # llama3 only
    original_max_position_embeddings: int = 0  # llama3 only
    rope_type: str = "llama3"  # "llama3" | "linear"

    def __post_init__(self) -> None:
        if self.rope_type not in ("llama3", "linear"):
            raise ValueError(f"unsupported rope_scaling type {self.rope_type!r}; supported: llama3, linear")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be positive, got {self.factor}")

    @classmethod
    def from_hf(cls, scaling: Mapping[str, object] | None) -> "RopeScaling | None":
        """From a HF `rope_scaling` / `rope_parameters` dict; None for no (default) scaling."""
        kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
        if kind in (None, "default"):
            return None
        if kind == "linear":
            return cls(factor=float(scaling["factor"]), rope_type="linear")
        if kind == "llama3":
            return cls(factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                       high_freq_factor=float(scaling["high_freq_factor"]),
                       original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: llama3, linear")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one decoder of a registered family (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3,
    Qwen3-MoE, Gemma 2, Gemma 3)."""

    family: str  # a key of `runner.models.registry.FAMILIES`: "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "mistral" | "mixtral" | "gemma2" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype
    # Mixture of experts (Qwen3-MoE): the layers whose MLP is `num_experts` experts of
    # `moe_intermediate_size`, `num_experts_per_tok` chosen per token by softmax routing (renormalised
    # over the chosen ones when `norm_topk_prob`); the other layers keep the dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    # Gemma 2/3: `sliding_layers` attend to at most the `sliding_window` most recent positions (and
    # rotate with base `rope_local_theta`, unscaled, when set: Gemma 3); scores and final logits are
    # soft-capped (`cap * tanh(x / cap)`) when the caps are set; the attention scale is
    # `query_pre_attn_scalar ** -0.5` when set; `sandwich_norms`: every layer also normalises its
    # attention output and its MLP input and output.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    sandwich_norms: bool = False
    # Set when the heads above are padded / replicated for a tensor-parallel mesh: maps them to the
    # checkpoint's (trainer's) heads, whose layout `sync_weights` accepts (`runner.models.head_layout`).
    head_layout: HeadLayout | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.moe_layers and not (0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0):
            raise ValueError(f"a mixture of experts needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= "
                             f"num_experts ({self.num_experts}) and moe_intermediate_size > 0")
        if self.sliding_layers and not (self.sliding_window or 0) > 0:
            raise ValueError(f"sliding_layers {self.sliding_layers} need a positive sliding_window, got {self.sliding_window}")
        for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar", "rope_local_theta"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"config.{name} must be positive or None, got {getattr(self, name)}")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in SUPPORTED_DTYPES:
                raise ValueError(f"{name} must be one of {SUPPORTED_DTYPES}, got {getattr(self, name)!r}")

    def with_dtype(self, dtype: str, param_dtype: str | None = None) -> "ModelConfig":
        return dataclasses.replace(self, dtype=dtype, param_dtype=param_dtype or dtype)

    def stored_for(self, model_axis: int) -> "ModelConfig":
        """This config with the head counts the engine stores on a `model_axis`-way tensor-parallel mesh; its
        `head_layout` maps them to the checkpoint's heads (itself while they are the checkpoint's own)."""
        layout = HeadLayout.for_axis(self.num_attention_heads, self.num_key_value_heads, self.head_dim, model_axis)
        if layout.is_identity:
            return self
        full = layout if self.head_layout is None else self.head_layout.then(layout)
        return dataclasses.replace(self, num_attention_heads=len(layout.q_heads),
                                   num_key_value_heads=len(layout.kv_heads), head_layout=full)
