"""The Llama family's declarations (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3, Qwen3-MoE, Mistral, Mixtral share one
module): the name tables, sharding rules, the family-specific config fields and the attention spec."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from runner.models.config import ModelConfig
from runner.models.family import ModelFamily, NameEntry, ShardingRules
from runner.models.llama import LlamaForCausalLM, rope_inv_freq

_L = "model.layers.*"


def _layer(hf: str, path: str, gguf: str, transpose: bool = False) -> NameEntry:
    return NameEntry(f"{_L}.{hf}", f"layers.*.{path}", transpose, f"blk.*.{gguf}")


LLAMA_NAMES: tuple[NameEntry, ...] = (
    NameEntry("model.embed_tokens.weight", "embed_tokens", gguf="token_embd.weight"),
    NameEntry("model.norm.weight", "norm.scale", gguf="output_norm.weight"),
    NameEntry("lm_head.weight", "lm_head.kernel", transpose=True, gguf="output.weight"),
    _layer("input_layernorm.weight", "input_layernorm.scale", "attn_norm.weight"),
    _layer("post_attention_layernorm.weight", "post_attention_layernorm.scale", "ffn_norm.weight"),
    _layer("self_attn.q_norm.weight", "self_attn.q_norm.scale", "attn_q_norm.weight"),
    _layer("self_attn.k_norm.weight", "self_attn.k_norm.scale", "attn_k_norm.weight"),
    *(entry for hf, gguf in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                             ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                             ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"))
      for entry in (_layer(f"{hf}.weight", f"{hf}.kernel", f"{gguf}.weight", transpose=True),
                    _layer(f"{hf}.bias", f"{hf}.bias", f"{gguf}.bias"))),
)

MOE_NAMES: tuple[NameEntry, ...] = (
    _layer("mlp.gate.weight", "mlp.gate.kernel", "ffn_gate_inp.weight", transpose=True),
    # llama.cpp stacks the experts into one tensor (`ffn_*_exps`): no per-expert GGUF names
    *(NameEntry(f"{_L}.mlp.experts.*.{p}.weight", f"layers.*.mlp.experts.{p}.kernel", True, stacked=True)
      for p in ("gate_proj", "up_proj", "down_proj")),
)

# Mixtral's names for the same router and experts (w1 = gate, w3 = up, w2 = down)
MIXTRAL_NAMES: tuple[NameEntry, ...] = (
    NameEntry(f"{_L}.block_sparse_moe.gate.weight", "layers.*.mlp.gate.kernel", True),
    *(NameEntry(f"{_L}.block_sparse_moe.experts.*.{w}.weight", f"layers.*.mlp.experts.{p}.kernel", True,
                stacked=True) for w, p in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))),
)

LLAMA_SHARDING: ShardingRules = (
    (r"embed_tokens", ("vocab", None)),
    (r"lm_head\.kernel", (None, "vocab")),
    (r"layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj)\.kernel", (None, "heads")),
    (r"layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj)\.bias", ("heads",)),
    (r"layers\.\d+\.self_attn\.o_proj\.kernel", ("heads", None)),
    (r"layers\.\d+\.mlp\.(gate_proj|up_proj)\.kernel", (None, "mlp")),
    (r"layers\.\d+\.mlp\.(gate_proj|up_proj)\.bias", ("mlp",)),
    (r"layers\.\d+\.mlp\.down_proj\.kernel", ("mlp", None)),
    # expert parallelism: each device of the `model` axis holds whole experts (`[E, in, out]` split on E)
    (r"layers\.\d+\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.kernel", ("expert", None, None)),
    (r".*", ()),  # norms, biases of row-parallel layers, buffers: replicated
)
# llama.cpp permuted Q/K rows of `llama` GGUFs -> the head count that undoes it
LLAMA_GGUF_PERMUTED = {"blk.*.attn_q.weight": "num_attention_heads", "blk.*.attn_q.bias": "num_attention_heads",
                       "blk.*.attn_k.weight": "num_key_value_heads", "blk.*.attn_k.bias": "num_key_value_heads"}
ROTARY_BUFFERS = ("model.rotary_emb.inv_freq", f"{_L}.self_attn.rotary_emb.inv_freq")


def _llama_fields(hf: Mapping[str, object]) -> dict[str, object]:
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}


def _qwen2_fields(hf: Mapping[str, object]) -> dict[str, object]:
    if hf.get("use_sliding_window"):
        raise ValueError("Qwen2 with use_sliding_window=true is not supported")
    return {"qkv_bias": True, "o_bias": False, "qk_norm": False}


def _qwen3_fields(hf: Mapping[str, object]) -> dict[str, object]:
    return {**_llama_fields(hf), "qk_norm": True}


def _qwen3_moe_fields(hf: Mapping[str, object]) -> dict[str, object]:
    """Qwen3-MoE: layer l routes to experts when `(l + 1) % decoder_sparse_step == 0` and it is not in
    `mlp_only_layers` (transformers' rule)."""
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)  # the hub name, transformers 5's
    layers = tuple(i for i in range(int(hf["num_hidden_layers"])) if experts > 0 and i not in dense
                   and (i + 1) % step == 0)
    return {**_qwen3_fields(hf), "num_experts": experts, "num_experts_per_tok": int(hf.get("num_experts_per_tok", 0)),
            "moe_intermediate_size": int(hf.get("moe_intermediate_size", 0)),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)), "moe_layers": layers}


def _mistral_fields(hf: Mapping[str, object]) -> dict[str, object]:
    """Mistral: Llama's layers; every layer attends within `sliding_window` when it is set."""
    window = hf.get("sliding_window")
    layers = tuple(range(int(hf["num_hidden_layers"]))) if window else ()
    return {**_llama_fields(hf), "sliding_window": int(window) if window else None, "sliding_layers": layers}


def _mixtral_fields(hf: Mapping[str, object]) -> dict[str, object]:
    """Mixtral: Mistral with every MLP routed to `num_local_experts` experts of `intermediate_size`,
    softmax over all experts then renormalised over the chosen ones."""
    experts = int(hf.get("num_local_experts") or 0)
    return {**_mistral_fields(hf), "num_experts": experts, "num_experts_per_tok": int(hf.get("num_experts_per_tok", 0)),
            "moe_intermediate_size": int(hf["intermediate_size"]), "norm_topk_prob": True,
            "moe_layers": tuple(range(int(hf["num_hidden_layers"]))) if experts else ()}


def layer_inv_freq_buffers(cfg: ModelConfig, rest: nnx.State) -> nnx.State:
    """The non-parameter state of a model: each layer's rotary table (`layers.<i>.self_attn.inv_freq`)."""
    tables: dict[int, jax.Array] = {}

    def table(path: tuple, _: object) -> jax.Array:
        keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
        layer = int(keys[keys.index("layers") + 1]) if "layers" in keys else None
        if layer not in tables:
            tables[layer] = jnp.asarray(rope_inv_freq(cfg, layer))
        return tables[layer]
    return jax.tree_util.tree_map_with_path(table, rest)


def _family(name: str, arch: str, fields: object, gguf_permuted: Mapping[str, str] | None = None,
            names: tuple[NameEntry, ...] = LLAMA_NAMES) -> ModelFamily:
    return ModelFamily(name=name, architectures=(arch,), module=LlamaForCausalLM, names=names,
                       sharding_rules=LLAMA_SHARDING, config_fields=fields,
                       buffers=layer_inv_freq_buffers, ignored_hf=ROTARY_BUFFERS, gguf_permuted=gguf_permuted or {})


LLAMA = _family("llama", "LlamaForCausalLM", _llama_fields, LLAMA_GGUF_PERMUTED)
QWEN2 = _family("qwen2", "Qwen2ForCausalLM", _qwen2_fields)
QWEN3 = _family("qwen3", "Qwen3ForCausalLM", _qwen3_fields)
QWEN3_MOE = _family("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe_fields, names=LLAMA_NAMES + MOE_NAMES)
# llama.cpp writes Mistral as `llama` and stacks Mixtral's experts: neither has GGUF names of its own
MISTRAL = _family("mistral", "MistralForCausalLM", _mistral_fields,
                  names=tuple(dataclasses.replace(e, gguf=None) for e in LLAMA_NAMES))
MIXTRAL = _family("mixtral", "MixtralForCausalLM", _mixtral_fields,
                  names=tuple(dataclasses.replace(e, gguf=None) for e in LLAMA_NAMES) + MIXTRAL_NAMES)
