"""The Llama-family decoder (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3, Qwen3-MoE) as one Flax NNX model, and
the building blocks other families (`runner.models.gemma`) reuse.

The same layers serve the trainer's full-sequence forward (`model(input_ids, positions)`) and the
engine's paged step (`model.forward_paged(...)`), so both compute the same numbers.
Parameter names follow Hugging Face's module tree (`layers[i].self_attn.q_proj.kernel`), with
Flax `[in, out]` kernels.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from runner.attention import AttentionMetadata, causal_attention, paged_attention
from runner.backends.base import TABLE_ROWS, XLA_MATMUL, XLA_MATMUL_NT, EmbeddingRows, Matmul, PackedKernel
from runner.models.activations import silu
from runner.models.config import ModelConfig
from runner.models.family import AttentionSpec, KVCaches
from runner.models.moe import SparseMoE
from runner.row_sum import mean_square


def _dtype(name: str) -> jnp.dtype:
    return jnp.dtype(name)


class Linear(nnx.Module):
    """`y = x @ kernel (+ bias)` with a `[in, out]` kernel."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, cfg: ModelConfig, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(stddev=0.02)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), _dtype(cfg.param_dtype)))
        self.bias = nnx.Param(jnp.zeros((out_features,), _dtype(cfg.param_dtype))) if bias else None
        self.compute_dtype = _dtype(cfg.dtype)
        self.matmul: Matmul = XLA_MATMUL  # the engine's backend puts its kernel here (`Backend.prepare`)
        self.packed: PackedKernel | None = nnx.data(None)  # the kernel laid out for `matmul`, if it wants one

    def __call__(self, x: Float[Array, "... in"]) -> Float[Array, "... out"]:
        x, w = x.astype(self.compute_dtype), self.kernel[...].astype(self.compute_dtype)
        y = self.matmul(x, w, None if self.packed is None else self.packed[...])
        if self.bias is not None:
            y = y + self.bias[...].astype(self.compute_dtype)
        return y


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32, scaled in the input dtype (as Hugging Face does)."""

    def __init__(self, dim: int, *, eps: float, cfg: ModelConfig):
        self.scale = nnx.Param(jnp.ones((dim,), _dtype(cfg.param_dtype)))
        self.eps = eps
        self.fixed_order = False  # batch-invariant mode (`Backend.prepare`): `runner.row_sum`

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(mean_square(h, self.fixed_order) + self.eps)
        return self.scale[...].astype(x.dtype) * h.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig, layer: int | None = None) -> np.ndarray:
    """Rotary inverse frequencies `[head_dim / 2]` (float32) of `layer`, with the configured scaling;
    a sliding layer of a model with `rope_local_theta` (Gemma 3) uses that base, unscaled."""
    dim = cfg.head_dim
    local = cfg.rope_local_theta is not None and layer in cfg.sliding_layers
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    inv_freq = inv_freq.astype(np.float32)
    s = None if local else cfg.rope_scaling
    if s is not None and s.rope_type == "linear":
        inv_freq = (inv_freq / np.float32(s.factor)).astype(np.float32)
    elif s is not None:
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def apply_rope(x: Float[Array, "... H D"], positions: Int[Array, "..."], inv_freq: Float[Array, "D2"]
               ) -> Float[Array, "... H D"]:
    """Rotate-half rotary embedding (Hugging Face layout: first half / second half of head_dim)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
    emb = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # [..., 1, D]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class Attention(nnx.Module):
    """Grouped-query self-attention with optional QKV bias (Qwen2), per-head Q/K norm (Qwen3, Gemma 3),
    and the layer's sliding window and score soft-cap (`AttentionSpec`, Gemma)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, spec: AttentionSpec, layer: int = 0,
                 norm: type[nnx.Module] | None = None):
        h, d = cfg.hidden_size, cfg.head_dim
        norm = norm or RMSNorm
        self.scale = spec.scale
        self.sliding_window, self.soft_cap = spec.sliding_window, spec.logit_soft_cap
        self.q_proj = Linear(h, cfg.num_attention_heads * d, bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.k_proj = Linear(h, cfg.num_key_value_heads * d, bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.v_proj = Linear(h, cfg.num_key_value_heads * d, bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.o_proj = Linear(cfg.num_attention_heads * d, h, bias=cfg.o_bias, cfg=cfg, rngs=rngs)
        self.q_norm = norm(d, eps=cfg.rms_norm_eps, cfg=cfg) if cfg.qk_norm else None
        self.k_norm = norm(d, eps=cfg.rms_norm_eps, cfg=cfg) if cfg.qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(cfg, layer)))  # not a Param: never trained or synced

    def qkv(self, x: Float[Array, "... H"], positions: Int[Array, "..."]
            ) -> tuple[Float[Array, "... Hq D"], Float[Array, "... Hkv D"], Float[Array, "... Hkv D"]]:
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = self.inv_freq[...]
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def __call__(self, x: Float[Array, "B S H"], positions: Int[Array, "B S"],
                 attention_mask: Int[Array, "B S"] | None) -> Float[Array, "B S H"]:
        q, k, v = self.qkv(x, positions)
        o = causal_attention(q, k, v, sm_scale=self.scale, attention_mask=attention_mask,
                             sliding_window=self.sliding_window, soft_cap=self.soft_cap)
        return self.o_proj(o.reshape(*x.shape[:-1], -1))

    def paged(self, x: Float[Array, "T H"], positions: Int[Array, "T"], kv_pages: Float[Array, "2 Hkv P page D"],
              md: AttentionMetadata) -> tuple[Float[Array, "T H"], Float[Array, "2 Hkv P page D"]]:
        q, k, v = self.qkv(x, positions)
        kv_pages = md.kernel.write(kv_pages, k, v, md.slot_mapping)
        o = paged_attention(q, kv_pages, md, sm_scale=self.scale, sliding_window=self.sliding_window,
                            soft_cap=self.soft_cap)
        return self.o_proj(o.reshape(x.shape[0], -1)), kv_pages


class MLP(nnx.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, bias=cfg.mlp_bias, cfg=cfg, rngs=rngs)
        self.up_proj = Linear(h, i, bias=cfg.mlp_bias, cfg=cfg, rngs=rngs)
        self.down_proj = Linear(i, h, bias=cfg.mlp_bias, cfg=cfg, rngs=rngs)

    def __call__(self, x: Float[Array, "... H"]) -> Float[Array, "... H"]:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention then MLP (or routed experts: `runner.models.moe`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, spec: AttentionSpec, layer: int = 0):
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, cfg=cfg)
        self.self_attn = Attention(cfg, rngs, spec, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, cfg=cfg)
        self.mlp = SparseMoE(cfg, rngs) if layer in cfg.moe_layers else MLP(cfg, rngs)

    def __call__(self, x: Float[Array, "B S H"], positions: Int[Array, "B S"],
                 attention_mask: Int[Array, "B S"] | None) -> Float[Array, "B S H"]:
        x = x + self.self_attn(self.input_layernorm(x), positions, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def paged(self, x: Float[Array, "T H"], positions: Int[Array, "T"], kv_pages: Float[Array, "2 Hkv P page D"],
              md: AttentionMetadata, routing: list[Array] | None = None
              ) -> tuple[Float[Array, "T H"], Float[Array, "2 Hkv P page D"]]:
        """One engine step of the layer; a routed-experts layer appends each token's experts to `routing`."""
        attn, kv_pages = self.self_attn.paged(self.input_layernorm(x), positions, kv_pages, md)
        x = x + attn
        if isinstance(self.mlp, SparseMoE):
            out, experts = self.mlp.routed(self.post_attention_layernorm(x))
            if routing is not None:
                routing.append(experts)
            return x + out, kv_pages
        return x + self.mlp(self.post_attention_layernorm(x)), kv_pages


class LlamaForCausalLM(nnx.Module):
    """Decoder-only causal LM; `model(input_ids, positions)` is the trainer's forward. Other families
    subclass it with their own layer and norm classes (`runner.models.gemma`)."""

    layer_class: type[nnx.Module] = DecoderLayer
    norm_class: type[nnx.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        init = jax.nn.initializers.normal(stddev=0.02)
        self.embed_tokens = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), _dtype(cfg.param_dtype)))
        self.layers = nnx.List([self.layer_class(cfg, rngs, AttentionSpec.of_layer(cfg, i), i)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = self.norm_class(cfg.hidden_size, eps=cfg.rms_norm_eps, cfg=cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, cfg=cfg, rngs=rngs)
        self.head_matmul: Matmul = XLA_MATMUL_NT  # the tied output projection's (`Backend.prepare`)
        self.packed_head: PackedKernel | None = nnx.data(None)  # the tied embedding laid out for `head_matmul`
        self.embedding_rows: EmbeddingRows = TABLE_ROWS  # how rows are read (`Backend.prepare`)

    def embed(self, input_ids: Int[Array, "..."]) -> Float[Array, "... H"]:
        return self.embedding(input_ids).astype(_dtype(self.config.dtype))

    def embedding(self, input_ids: Int[Array, "..."]) -> Float[Array, "... H"]:
        """The embedding rows of `input_ids`, read as the backend says (from the tied head's packed copy on the
        CPU backend's bfloat16 models)."""
        return self.embedding_rows(self.embed_tokens[...], None if self.packed_head is None else self.packed_head[...],
                                   input_ids)

    def output_rows(self) -> Float[Array, "V H"]:
        """The output projection as one row per token id (the embedding when tied)."""
        return self.embed_tokens[...] if self.lm_head is None else self.lm_head.kernel[...].T

    def tied_output_rows(self) -> Float[Array, "V H"] | None:
        """The embedding when it is also the output projection (what `head_matmul` multiplies), else None."""
        return self.embed_tokens[...] if self.lm_head is None else None

    def compute_logits(self, hidden: Float[Array, "... H"]) -> Float[Array, "... V"]:
        """Final-norm'd hidden states -> float32 logits."""
        if self.lm_head is None:
            w = self.embed_tokens[...].astype(hidden.dtype)
            logits = self.head_matmul(hidden, w, None if self.packed_head is None else self.packed_head[...])
        else:
            logits = self.lm_head(hidden)
        return logits.astype(jnp.float32)

    def hidden_states(self, input_ids: Int[Array, "B S"], positions: Int[Array, "B S"],
                      attention_mask: Int[Array, "B S"] | None = None) -> Float[Array, "B S H"]:
        """Final-norm'd hidden states of a full-sequence causal forward."""
        return self.hidden_states_with_aux(input_ids, positions, attention_mask)[0]

    def hidden_states_with_aux(self, input_ids: Int[Array, "B S"], positions: Int[Array, "B S"],
                               attention_mask: Int[Array, "B S"] | None = None, aux_layers: tuple[int, ...] = ()
                               ) -> tuple[Float[Array, "B S H"], Float[Array, "B S A"]]:
        """Final-norm'd hidden states and the residual stream entering each of `aux_layers`
        (concatenated, `A = len(aux_layers) * H`; EAGLE-3's input features)."""
        x = self.embed(input_ids)
        entering = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                entering[i] = x
            x = layer(x, positions, attention_mask)
        return self.norm(x), _concat_aux([entering[i] for i in aux_layers], x)

    def __call__(self, input_ids: Int[Array, "B S"], positions: Int[Array, "B S"],
                 attention_mask: Int[Array, "B S"] | None = None) -> Float[Array, "B S V"]:
        """Full-sequence causal forward: float32 logits at every position."""
        return self.compute_logits(self.hidden_states(input_ids, positions, attention_mask))

    def forward_paged(self, token_ids: Int[Array, "T"], positions: Int[Array, "T"], kv_caches: KVCaches,
                      md: AttentionMetadata, aux_layers: tuple[int, ...] = (), routing: list[Array] | None = None
                      ) -> tuple[Float[Array, "T H"], KVCaches, Float[Array, "T A"]]:
        """One engine step over packed tokens: writes their K/V into the paged caches, returns final
        hidden, the new caches, and the residual stream entering each of `aux_layers` (`[T, 0]` if none).
        `routing`: a list that gets each routed-experts layer's `[T, k]` experts, in layer order."""
        x = self.embed(token_ids)
        new_caches = []
        entering = {}
        for i, (layer, kv_pages) in enumerate(zip(self.layers, kv_caches)):
            if i in aux_layers:
                entering[i] = x
            x, kv_pages = layer.paged(x, positions, kv_pages, md, routing) if routing is not None else \
                layer.paged(x, positions, kv_pages, md)
            new_caches.append(kv_pages)
        return self.norm(x), tuple(new_caches), _concat_aux([entering[i] for i in aux_layers], x)


def _concat_aux(aux: list[Array], like: Array) -> Array:
    return jnp.concatenate(aux, axis=-1) if aux else jnp.zeros((*like.shape[:-1], 0), like.dtype)
