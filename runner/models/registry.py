"""The model-family registry, keyed by family name and by Hugging Face architecture.

To add a family: declare a `ModelFamily` (runner/models/<family>_family.py) and list it in FAMILIES.
Importing this module also registers the name-table presets "hf", "hf-strict" and "hf-fused" of the
default (Llama) family with `weight_sync`, for trainers that map HF names without an engine.
"""

from __future__ import annotations

from collections.abc import Mapping

from flax import nnx

import weight_sync.presets
from runner.models.config import ModelConfig
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
