"""The Gemma family's declarations (Gemma 2, Gemma 3 text): name table, config fields, attention spec.

Gemma 3 configs come in two forms: transformers 5 writes `rope_parameters` keyed by layer type
(`sliding_attention` / `full_attention`) and `layer_types`; hub checkpoints written by older versions
carry `rope_theta`, `rope_local_base_freq`, `rope_scaling` and `sliding_window_pattern`. Both are read.
GGUF Gemma files are not read (llama.cpp stores their norms with the `+ 1` folded in).
"""

from __future__ import annotations

from collections.abc import Mapping

from runner.models.config import RopeScaling
from runner.models.family import ModelFamily, NameEntry
from runner.models.gemma import GemmaForCausalLM
from runner.models.llama_family import LLAMA_SHARDING, ROTARY_BUFFERS, layer_inv_freq_buffers

_L = "model.layers.*"


def _layer(name: str, transpose: bool = False) -> NameEntry:
    kind = "kernel" if transpose else "scale"
    return NameEntry(f"{_L}.{name}.weight", f"layers.*.{name}.{kind}", transpose)


GEMMA_NAMES: tuple[NameEntry, ...] = (
    NameEntry("model.embed_tokens.weight", "embed_tokens"),
    NameEntry("model.norm.weight", "norm.scale"),
    NameEntry("lm_head.weight", "lm_head.kernel", transpose=True),
    *(_layer(n) for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                          "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm")),
    *(_layer(n, transpose=True) for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
)


def _sliding_layers(hf: Mapping[str, object], num_layers: int, default_pattern: int) -> tuple[int, ...]:
    """`layer_types` when given, else every layer but each `sliding_window_pattern`-th (Gemma 2: 2)."""
    types = hf.get("layer_types")
    if types:
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown or len(types) != num_layers:
            raise ValueError(f"layer_types {types} must list {num_layers} of 'sliding_attention' / 'full_attention'")
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or default_pattern)
    return tuple(i for i in range(num_layers) if (i + 1) % pattern)


def _common_fields(hf: Mapping[str, object], default_pattern: int) -> dict[str, object]:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma hidden_activation {act!r} is not supported; supported: gelu_pytorch_tanh")
    bias = bool(hf.get("attention_bias", False))
    window = hf.get("sliding_window")
    layers = _sliding_layers(hf, int(hf["num_hidden_layers"]), default_pattern) if window else ()
    caps = {name: None if hf.get(key) is None else float(hf[key]) for name, key in (
        ("attn_logit_softcap", "attn_logit_softcapping"), ("final_logit_softcap", "final_logit_softcapping"))}
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "sandwich_norms": True,
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar") or hf.get("head_dim") or 256),
            "sliding_window": int(window) if window else None, "sliding_layers": layers, **caps}


def _gemma2_fields(hf: Mapping[str, object]) -> dict[str, object]:
    return _common_fields(hf, default_pattern=2)


def _gemma3_fields(hf: Mapping[str, object]) -> dict[str, object]:
    fields = {**_common_fields(hf, default_pattern=6), "qk_norm": True}
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: one entry per layer type
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        if RopeScaling.from_hf(local) is not None:
            raise ValueError(f"Gemma 3 sliding-layer rope_parameters {local} are not supported; supported: default")
        fields.update(rope_theta=float(full.get("rope_theta", 1e6)), rope_scaling=RopeScaling.from_hf(full),
                      rope_local_theta=float(local.get("rope_theta", 10000.0)))
    else:
        fields["rope_local_theta"] = float(hf.get("rope_local_base_freq") or 10000.0)
    return fields


def _family(name: str, arch: str, fields: object) -> ModelFamily:
    return ModelFamily(name=name, architectures=(arch,), module=GemmaForCausalLM, names=GEMMA_NAMES,
                       sharding_rules=LLAMA_SHARDING, config_fields=fields,
                       buffers=layer_inv_freq_buffers, ignored_hf=ROTARY_BUFFERS)


GEMMA2 = _family("gemma2", "Gemma2ForCausalLM", _gemma2_fields)
GEMMA3 = _family("gemma3", "Gemma3ForCausalLM", _gemma3_fields)
