"""The model-family registry, keyed by family name and by Hugging Face architecture, and what needs it:
building a family's model (`build_model`, `with_head_layout` for a tensor-parallel mesh) and reading a
Hugging Face `config.json` into a `ModelConfig` (`config_from_hf`).

To add a family: declare a `ModelFamily` (runner/models/<family>_family.py) and list it in FAMILIES.
Importing this module also registers the name-table presets "hf", "hf-strict" and "hf-fused" of the
default (Llama) family with `weight_sync`, for trainers that map HF names without an engine.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

import weight_sync.presets
from runner.models.config import ModelConfig, RopeScaling
from runner.models.head_layout import HeadLayout, expand
from runner.models.family import CausalLM, ModelFamily
from runner.models.gemma_family import GEMMA2, GEMMA3
from runner.models.llama_family import LLAMA, MISTRAL, MIXTRAL, QWEN2, QWEN3, QWEN3_MOE

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (LLAMA, QWEN2, QWEN3, QWEN3_MOE, MISTRAL, MIXTRAL, GEMMA2, GEMMA3)}
ARCHITECTURES: dict[str, ModelFamily] = {arch: f for f in FAMILIES.values() for arch in f.architectures}

for _preset in ("hf", "hf-strict", "hf-fused"):
    weight_sync.presets.register(_preset, lambda preset=_preset: LLAMA.sync_rules(preset))


def get_family(name: str) -> ModelFamily:
    """The family of `ModelConfig.family` (or a GGUF `general.architecture`)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; supported: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_for_hf(hf: Mapping[str, object]) -> ModelFamily:
    """The family of a HF `config.json`: by `architectures`, else by `model_type`."""
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if hf.get("model_type") in FAMILIES:
        return FAMILIES[hf["model_type"]]
    raise ValueError(f"unsupported architecture {archs or hf.get('model_type')!r}; supported: "
                     f"{', '.join(ARCHITECTURES)}")


def build_model(cfg: ModelConfig, *, rngs: nnx.Rngs) -> CausalLM:
    """A freshly initialised model of `cfg`'s family."""
    return get_family(cfg.family).module(cfg, rngs=rngs)


def with_head_layout(model: CausalLM, model_axis: int) -> CausalLM:
    """`model` itself when the mesh's `model` axis divides its heads, else an equivalent model whose
    heads are padded / replicated for it (new arrays; `model` is untouched; `runner.models.head_layout`)."""
    cfg = model.config
    stored = cfg.stored_for(model_axis)
    if stored is cfg:
        return model
    step = HeadLayout.for_axis(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, model_axis)
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: build_model(stored, rngs=nnx.Rngs(0))),
                                       nnx.Param, ...)
    _, source_params, source_rest = nnx.split(model, nnx.Param, ...)
    source = {".".join(map(str, k)): v.value for k, v in nnx.to_flat_state(source_params)}
    for key, var in nnx.to_flat_state(params):
        path = ".".join(map(str, key))
        rule = step.expansion(path)
        var.value = expand(source[path], rule) if rule is not None else jnp.array(source[path], copy=True)
    rest = jax.tree.map(lambda x: jnp.array(x, copy=True), source_rest)
    return nnx.merge(graphdef, params, rest)


def config_from_hf(hf: Mapping[str, object], *, dtype: str = "float32") -> ModelConfig:
    """The `ModelConfig` of a Hugging Face `config.json`'s contents (its family's fields included)."""
    family = family_for_hf(hf)
    try:
        hidden = int(hf["hidden_size"])
        n_heads = int(hf["num_attention_heads"])
        layers = int(hf["num_hidden_layers"])
        vocab = int(hf["vocab_size"])
        inter = int(hf["intermediate_size"])
    except KeyError as e:
        raise ValueError(f"config.json lacks required field {e.args[0]!r}") from None
    if n_heads <= 0 or hidden % n_heads and hf.get("head_dim") is None:
        raise ValueError(f"hidden_size ({hidden}) is not divisible by num_attention_heads ({n_heads})")
    head_dim = int(hf.get("head_dim") or hidden // n_heads)
    rope_params = hf.get("rope_parameters") or {}
    rope_theta = float(hf.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
    rope_scaling = RopeScaling.from_hf(hf.get("rope_scaling") or rope_params)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    fields: dict[str, object] = dict(
        family=family.name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        param_dtype=dtype,
        dtype=dtype,
    )
    fields.update(family.config_fields(hf))  # qkv_bias, o_bias, qk_norm, ...; may override the above
    return ModelConfig(**fields)
