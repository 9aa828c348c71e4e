"""Randomly initialised models of real families' shapes, for benchmarks (`bench_rollout.py --model-config`).

Real checkpoints are not reachable from the machines the benchmarks run on, so the shapes are the real
ones and the values random (transformers' own initialisation, seed 0). `materialize(name)` writes the
model once as a HF safetensors directory under `~/.cache/jax-rollout/bench-models/` (float32); both the
engine and transformers load that directory, so they run the same weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# name -> (transformers config class, its arguments); shapes from each model's published config.json
MODEL_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)),
    "gemma-3-1b": ("Gemma3TextConfig", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512, rms_norm_eps=1e-6,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
        max_position_embeddings=32768, bos_token_id=2, eos_token_id=1, pad_token_id=0)),
    # Qwen3-MoE's layout scaled down: 8 experts, top-2, every layer routed
    "moe-8x2": ("Qwen3MoeConfig", dict(
        vocab_size=49152, hidden_size=512, intermediate_size=1536, moe_intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1e6, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
}


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jax-rollout" / "bench-models"


def materialize(name: str) -> Path:
    """The HF directory of model `name` (written on first use)."""
    if name not in MODEL_CONFIGS:
        raise SystemExit(f"unknown --model-config {name!r}; choose one of {', '.join(MODEL_CONFIGS)}")
    path = cache_dir() / name
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    import torch
    import transformers

    cls_name, kwargs = MODEL_CONFIGS[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_name)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


def active_params(hf_config: dict[str, Any], total: int) -> int:
    """Parameters one decode token reads: all of them, minus the experts a MoE layer does not route to."""
    experts, top_k = int(hf_config.get("num_experts") or 0), int(hf_config.get("num_experts_per_tok") or 0)
    if not experts:
        return total
    per_expert = 3 * int(hf_config["hidden_size"]) * int(hf_config["moe_intermediate_size"])
    layers = int(hf_config["num_hidden_layers"]) - len(hf_config.get("mlp_only_layers") or [])
    return total - layers * (experts - top_k) * per_expert


# name -> (HF architecture, model_type) of the configs above, and the embedded default's shapes
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "qwen3-0.6b": ("Qwen3ForCausalLM", "qwen3"), "gemma-3-1b": ("Gemma3ForCausalLM", "gemma3_text"),
    "moe-8x2": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}


def hf_config_dict(name: str) -> dict[str, Any]:
    """The `config.json` contents of model `name` without transformers (the TPU ahead-of-time check builds
    shapes only: `runner.tpu_aot`)."""
    if name not in MODEL_CONFIGS:
        raise SystemExit(f"unknown --model-config {name!r}; choose one of {', '.join(MODEL_CONFIGS)}")
    arch, model_type = ARCHITECTURES[name]
    return {"architectures": [arch], "model_type": model_type, **MODEL_CONFIGS[name][1]}
