"""An independent float64 numpy forward pass of the Llama-family decoder: the oracle when torch is absent.

Written from the math (not from `runner/models/llama.py`): token embedding, then per layer
`x += o(attn(rope(q), rope(k), v))` on `rmsnorm(x)` and `x += down(silu(gate) * up)` on `rmsnorm(x)`,
then a final RMSNorm and the (possibly tied) output projection. Covers Llama (incl. llama3 RoPE
scaling and `attention_bias`), Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm before RoPE).
Weights use PyTorch `[out, in]` layout and Hugging Face names.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np


def _rope_settings(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = hf.get("rope_scaling") or params
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        raise NotImplementedError(f"reference forward: rope type {kind!r}")
    return float(theta), dict(scaling)


def rotary_frequencies(hf: Mapping[str, Any], head_dim: int) -> np.ndarray:
    """Angular frequency of each of the head_dim/2 rotation planes (float64)."""
    theta, scaling = _rope_settings(hf)
    freqs = [theta ** (-2.0 * j / head_dim) for j in range(head_dim // 2)]
    if scaling is None:
        return np.array(freqs, dtype=np.float64)
    factor = float(scaling["factor"])
    lo, hi = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    ctx = float(scaling["original_max_position_embeddings"])
    out = []
    for f in freqs:
        period = 2.0 * math.pi / f
        if period < ctx / hi:  # high frequency: untouched
            out.append(f)
        elif period > ctx / lo:  # low frequency: slowed down by `factor`
            out.append(f / factor)
        else:  # in between: interpolate linearly in ctx/period
            t = (ctx / period - lo) / (hi - lo)
            out.append((1.0 - t) * f / factor + t * f)
    return np.array(out, dtype=np.float64)


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps) * weight


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: [B, S, H, D]; cos/sin: [S, D/2]. Plane j pairs element j with element j + D/2."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def numpy_forward(hf_config: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
                  input_ids: np.ndarray) -> np.ndarray:
    """Causal-LM logits `[B, S, V]` (float64) for `input_ids` `[B, S]` (positions 0..S-1, no padding)."""
    hf = hf_config
    model_type = hf.get("model_type")
    n_layers = int(hf["num_hidden_layers"])
    n_heads = int(hf["num_attention_heads"])
    n_kv = int(hf.get("num_key_value_heads") or n_heads)
    d = int(hf.get("head_dim") or int(hf["hidden_size"]) // n_heads)
    eps = float(hf.get("rms_norm_eps", 1e-6))
    attn_bias = bool(hf.get("attention_bias", False))
    qkv_bias = model_type == "qwen2" or attn_bias
    o_bias = model_type != "qwen2" and attn_bias
    mlp_bias = bool(hf.get("mlp_bias", False))
    qk_norm = model_type == "qwen3"

    def w(name: str) -> np.ndarray:
        return np.asarray(tensors[name], dtype=np.float64)

    def linear(x: np.ndarray, prefix: str, bias: bool) -> np.ndarray:
        y = x @ w(prefix + ".weight").T
        return y + w(prefix + ".bias") if bias else y

    ids = np.asarray(input_ids)
    bsz, seq = ids.shape
    x = w("model.embed_tokens.weight")[ids]  # [B, S, H]

    angles = np.arange(seq, dtype=np.float64)[:, None] * rotary_frequencies(hf, d)[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    future = np.triu(np.ones((seq, seq), dtype=bool), k=1)  # key index > query index
    group = n_heads // n_kv

    for n in range(n_layers):
        p = f"model.layers.{n}."
        h = _rms_norm(x, w(p + "input_layernorm.weight"), eps)
        q = linear(h, p + "self_attn.q_proj", qkv_bias).reshape(bsz, seq, n_heads, d)
        k = linear(h, p + "self_attn.k_proj", qkv_bias).reshape(bsz, seq, n_kv, d)
        v = linear(h, p + "self_attn.v_proj", qkv_bias).reshape(bsz, seq, n_kv, d)
        if qk_norm:
            q = _rms_norm(q, w(p + "self_attn.q_norm.weight"), eps)
            k = _rms_norm(k, w(p + "self_attn.k_norm.weight"), eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        heads = []
        for head in range(n_heads):
            kvh = head // group
            scores = np.einsum("bqd,bkd->bqk", q[:, :, head], k[:, :, kvh]) / math.sqrt(d)
            scores = np.where(future[None], -np.inf, scores)
            scores = scores - scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            heads.append(np.einsum("bqk,bkd->bqd", probs, v[:, :, kvh]))
        attn = np.stack(heads, axis=2).reshape(bsz, seq, n_heads * d)
        x = x + linear(attn, p + "self_attn.o_proj", o_bias)
        h = _rms_norm(x, w(p + "post_attention_layernorm.weight"), eps)
        gate = linear(h, p + "mlp.gate_proj", mlp_bias)
        up = linear(h, p + "mlp.up_proj", mlp_bias)
        x = x + linear(_silu(gate) * up, p + "mlp.down_proj", mlp_bias)

    x = _rms_norm(x, w("model.norm.weight"), eps)
    tied = bool(hf.get("tie_word_embeddings", False))
    head_w = w("model.embed_tokens.weight") if tied else w("lm_head.weight")
    return x @ head_w.T
