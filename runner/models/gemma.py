"""The Gemma 2 / Gemma 3 (text) decoder: the Llama building blocks with Gemma's differences.

Embeddings scaled by sqrt(hidden) (in the compute dtype), RMSNorm scaling by `1 + w` in float32, four
norms per layer (around attention and around the MLP), a GeGLU MLP (tanh-approximated GELU), the
attention scale `query_pre_attn_scalar ** -0.5`, sliding-window layers between global ones, score
soft-capping (Gemma 2) and final-logit soft-capping (Gemma 2), per-head Q/K norms and a separate
RoPE base for sliding layers (Gemma 3). The per-layer attention settings come from the family's
`AttentionSpec` (runner/models/gemma_family.py); the window and caps are applied in runner/attention.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from runner.attention import AttentionMetadata
from runner.models.activations import gelu_tanh
from runner.models.config import ModelConfig
from runner.models.family import AttentionSpec
from runner.models.llama import MLP, Attention, LlamaForCausalLM
from runner.row_sum import mean_square


class GemmaRMSNorm(nnx.Module):
    """RMSNorm whose stored weight is an offset from one: `x / rms(x) * (1 + w)`, all in float32."""

    def __init__(self, dim: int, *, eps: float, cfg: ModelConfig):
        self.scale = nnx.Param(jnp.zeros((dim,), jnp.dtype(cfg.param_dtype)))
        self.eps = eps
        self.fixed_order = False  # batch-invariant mode (`Backend.prepare`): `runner.row_sum`

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(mean_square(h, self.fixed_order) + self.eps)
        return (h * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


class GemmaMLP(MLP):
    """GeGLU feed-forward: `down(gelu_tanh(gate(x)) * up(x))`."""

    def __call__(self, x: Float[Array, "... H"]) -> Float[Array, "... H"]:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class GemmaDecoderLayer(nnx.Module):
    """`x += post_attn_norm(attn(input_norm(x)))`, then `x += post_ff_norm(mlp(pre_ff_norm(x)))`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, spec: AttentionSpec, layer: int = 0):
        def norm() -> GemmaRMSNorm:
            return GemmaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, cfg=cfg)

        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, rngs, spec, layer, norm=GemmaRMSNorm)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GemmaMLP(cfg, rngs)
        self.post_feedforward_layernorm = norm()

    def _mlp(self, x: Float[Array, "... H"]) -> Float[Array, "... H"]:
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def __call__(self, x: Float[Array, "B S H"], positions: Int[Array, "B S"],
                 attention_mask: Int[Array, "B S"] | None) -> Float[Array, "B S H"]:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, attention_mask))
        return self._mlp(x)

    def paged(self, x: Float[Array, "T H"], positions: Int[Array, "T"], kv_pages: Float[Array, "2 Hkv P page D"],
              md: AttentionMetadata) -> tuple[Float[Array, "T H"], Float[Array, "2 Hkv P page D"]]:
        attn, kv_pages = self.self_attn.paged(self.input_layernorm(x), positions, kv_pages, md)
        return self._mlp(x + self.post_attention_layernorm(attn)), kv_pages


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text decoder; the trainer's forward and the engine's paged step as for Llama."""

    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def embed(self, input_ids: Int[Array, "..."]) -> Float[Array, "... H"]:
        dtype = jnp.dtype(self.config.dtype)
        normalizer = jnp.asarray(self.config.hidden_size ** 0.5, dtype)  # rounded to the compute dtype, as HF
        return self.embedding(input_ids).astype(dtype) * normalizer

    def compute_logits(self, hidden: Float[Array, "... H"]) -> Float[Array, "... V"]:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)
