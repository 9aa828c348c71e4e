"""The Llama-family decoder (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3) as one Flax NNX model.

The same layers serve the trainer's full-sequence forward (`model(input_ids, positions)`) and the
engine's paged step (`model.forward_paged(...)`), so both compute the same numbers.
Parameter names follow Hugging Face's module tree (`layers[i].self_attn.q_proj.kernel`), with
Flax `[in, out]` kernels.
"""

from __future__ import annotations

import math
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from runner import amx_matmul as amx
from runner.attention import AttentionMetadata, causal_attention, paged_attention, write_kv
from runner.models.config import ModelConfig
from runner.row_matmul import MAX_ROWS_NT, row_matmul, row_matmul_nt

KVCaches = tuple[Float[Array, "2 Hkv P page D"], ...]


def _dtype(name: str) -> jnp.dtype:
    return jnp.dtype(name)


class AmxPacked(nnx.Variable):
    """A kernel split and packed for `runner.amx_matmul` (derived from the `Param`, not trained or synced)."""


class Linear(nnx.Module):
    """`y = x @ kernel (+ bias)` with a `[in, out]` kernel."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, cfg: ModelConfig, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(stddev=0.02)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), _dtype(cfg.param_dtype)))
        self.bias = nnx.Param(jnp.zeros((out_features,), _dtype(cfg.param_dtype))) if bias else None
        self.compute_dtype = _dtype(cfg.dtype)
        self.row_kernel_max_rows = 0  # > 0: up to this many rows on `runner.row_matmul` (`with_row_kernel`)
        self.amx_packed: AmxPacked | None = nnx.data(None)  # set: rows `amx.takes` on `runner.amx_matmul` (`with_amx`)

    def __call__(self, x: Float[Array, "... in"]) -> Float[Array, "... out"]:
        x, w = x.astype(self.compute_dtype), self.kernel[...].astype(self.compute_dtype)
        rows = math.prod(x.shape[:-1])
        if self.amx_packed is not None and amx.takes(rows, self.row_kernel_max_rows):
            y = amx.amx_matmul(x, self.amx_packed[...])
        elif 0 < rows <= self.row_kernel_max_rows:
            y = row_matmul(x, w)
        else:
            y = jnp.dot(x, w)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.compute_dtype)
        return y


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32, scaled in the input dtype (as Hugging Face does)."""

    def __init__(self, dim: int, *, eps: float, cfg: ModelConfig):
        self.scale = nnx.Param(jnp.ones((dim,), _dtype(cfg.param_dtype)))
        self.eps = eps

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * h.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Rotary inverse frequencies `[head_dim / 2]` (float32), with llama3 scaling when configured."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    inv_freq = inv_freq.astype(np.float32)
    s = cfg.rope_scaling
    if s is not None:
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
    """Grouped-query self-attention with optional QKV bias (Qwen2) and per-head Q/K norm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_attention_heads * d, bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.k_proj = Linear(h, cfg.num_key_value_heads * d, bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.v_proj = Linear(h, cfg.num_key_value_heads * d, bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.o_proj = Linear(cfg.num_attention_heads * d, h, bias=cfg.o_bias, cfg=cfg, rngs=rngs)
        self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps, cfg=cfg) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps, cfg=cfg) if cfg.qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(cfg)))  # not a Param: never trained or synced

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
        o = causal_attention(q, k, v, sm_scale=self.head_dim ** -0.5, attention_mask=attention_mask)
        return self.o_proj(o.reshape(*x.shape[:-1], -1))

    def paged(self, x: Float[Array, "T H"], positions: Int[Array, "T"], kv_pages: Float[Array, "2 Hkv P page D"],
              md: AttentionMetadata) -> tuple[Float[Array, "T H"], Float[Array, "2 Hkv P page D"]]:
        q, k, v = self.qkv(x, positions)
        kv_pages = write_kv(kv_pages, k, v, md.slot_mapping)
        o = paged_attention(q, kv_pages, md, sm_scale=self.head_dim ** -0.5)
        return self.o_proj(o.reshape(x.shape[0], -1)), kv_pages


class MLP(nnx.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, bias=cfg.mlp_bias, cfg=cfg, rngs=rngs)
        self.up_proj = Linear(h, i, bias=cfg.mlp_bias, cfg=cfg, rngs=rngs)
        self.down_proj = Linear(i, h, bias=cfg.mlp_bias, cfg=cfg, rngs=rngs)

    def __call__(self, x: Float[Array, "... H"]) -> Float[Array, "... H"]:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, cfg=cfg)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, cfg=cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x: Float[Array, "B S H"], positions: Int[Array, "B S"],
                 attention_mask: Int[Array, "B S"] | None) -> Float[Array, "B S H"]:
        x = x + self.self_attn(self.input_layernorm(x), positions, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def paged(self, x: Float[Array, "T H"], positions: Int[Array, "T"], kv_pages: Float[Array, "2 Hkv P page D"],
              md: AttentionMetadata) -> tuple[Float[Array, "T H"], Float[Array, "2 Hkv P page D"]]:
        attn, kv_pages = self.self_attn.paged(self.input_layernorm(x), positions, kv_pages, md)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv_pages


class LlamaForCausalLM(nnx.Module):
    """Decoder-only causal LM; `model(input_ids, positions)` is the trainer's forward."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        init = jax.nn.initializers.normal(stddev=0.02)
        self.embed_tokens = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), _dtype(cfg.param_dtype)))
        self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, cfg=cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, cfg=cfg, rngs=rngs)
        self.row_kernel_max_rows = 0  # the tied output projection's; see `with_row_kernel`
        self.amx_head: AmxPacked | None = nnx.data(None)  # the tied embedding packed as `[H, V]`; see `with_amx`

    def embed(self, input_ids: Int[Array, "..."]) -> Float[Array, "... H"]:
        return self.embed_tokens[...][input_ids].astype(_dtype(self.config.dtype))

    def output_rows(self) -> Float[Array, "V H"]:
        """The output projection as one row per token id (the embedding when tied)."""
        return self.embed_tokens[...] if self.lm_head is None else self.lm_head.kernel[...].T

    def compute_logits(self, hidden: Float[Array, "... H"]) -> Float[Array, "... V"]:
        """Final-norm'd hidden states -> float32 logits."""
        if self.lm_head is None:
            w, rows = self.embed_tokens[...].astype(hidden.dtype), math.prod(hidden.shape[:-1])
            if self.amx_head is not None and amx.takes(rows, self.row_kernel_max_rows):
                logits = amx.amx_matmul(hidden, self.amx_head[...])
            elif 0 < rows <= self.row_kernel_max_rows:
                logits = row_matmul_nt(hidden, w)
            else:
                logits = jnp.einsum("...h,vh->...v", hidden, w)
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
                      md: AttentionMetadata, aux_layers: tuple[int, ...] = ()
                      ) -> tuple[Float[Array, "T H"], KVCaches, Float[Array, "T A"]]:
        """One engine step over packed tokens: writes their K/V into the paged caches, returns final
        hidden, the new caches, and the residual stream entering each of `aux_layers` (`[T, 0]` if none)."""
        x = self.embed(token_ids)
        new_caches = []
        entering = {}
        for i, (layer, kv_pages) in enumerate(zip(self.layers, kv_caches)):
            if i in aux_layers:
                entering[i] = x
            x, kv_pages = layer.paged(x, positions, kv_pages, md)
            new_caches.append(kv_pages)
        return self.norm(x), tuple(new_caches), _concat_aux([entering[i] for i in aux_layers], x)


def _concat_aux(aux: list[Array], like: Array) -> Array:
    return jnp.concatenate(aux, axis=-1) if aux else jnp.zeros((*like.shape[:-1], 0), like.dtype)


ModuleT = TypeVar("ModuleT", bound=nnx.Module)


def with_row_kernel(module: ModuleT, max_rows: int) -> ModuleT:
    """A copy of `module` (sharing its arrays) whose `Linear` layers compute steps of up to `max_rows`
    rows with `runner.row_matmul`, its tied output projection up to min(max_rows, MAX_ROWS_NT) (0: XLA's
    dot everywhere)."""
    copy = nnx.merge(*nnx.split(module))
    for _, sub in nnx.iter_modules(copy):
        if isinstance(sub, Linear):
            sub.row_kernel_max_rows = max_rows
        elif isinstance(sub, LlamaForCausalLM):
            sub.row_kernel_max_rows = min(max_rows, MAX_ROWS_NT)
    return copy


def _amx_kernel(sub: nnx.Module) -> Array | None:
    """The `[K, N]` float32 kernel `with_amx` packs for this module (a Linear's kernel, a tied output
    projection's `[H, V]` embedding), or None where it packs nothing."""
    if isinstance(sub, Linear) and sub.compute_dtype == jnp.float32:
        w = sub.kernel[...]
    elif isinstance(sub, LlamaForCausalLM) and sub.lm_head is None and sub.config.dtype == "float32":
        w = sub.embed_tokens[...].T
    else:
        return None
    return w if amx.shape_fits(w) else None


def with_amx(module: ModuleT, enabled: bool = True) -> ModuleT:
    """A copy of `module` (sharing its arrays) whose float32 `Linear` layers of AMX-friendly shapes keep a
    packed copy of their kernel and compute the steps `amx.takes` (9+ rows the row kernel leaves) on `runner.amx_matmul`
    (needs `amx.load().available`). Refresh the packed copies after changing the kernels: `repack_amx`.
    `enabled=False`: a copy without packed kernels (a model taken from an engine that had them)."""
    copy = nnx.merge(*nnx.split(module))
    for _, sub in nnx.iter_modules(copy):
        if isinstance(sub, Linear | LlamaForCausalLM):
            w = _amx_kernel(sub) if enabled else None
            packed = AmxPacked(amx.pack_kernel(w)) if w is not None else nnx.data(None)
            if isinstance(sub, Linear):
                sub.amx_packed = packed
            else:
                sub.amx_head = packed
    return copy


def repack_amx(graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State) -> nnx.State:
    """`rest` with every `AmxPacked` recomputed from its layer's current kernel (jit it; donate `rest`)."""
    model = nnx.merge(graphdef, params, rest)
    for _, sub in nnx.iter_modules(model):
        packed = sub.amx_packed if isinstance(sub, Linear) else sub.amx_head if isinstance(sub, LlamaForCausalLM) else None
        if packed is not None:
            packed.value = amx.pack_kernel(_amx_kernel(sub))
    return nnx.split(model, nnx.Param, ...)[2]
