"""Tiny-model builders shared by model tests: config dicts, random weights, on-disk checkpoints.

Two ways to make a checkpoint:
  * without torch: `hf_config(family)` + `random_tensors(hf)` + `write_hf_dir(...)` / `write_gguf(...)`
    (config.json + `safetensors.numpy.save_file`, or `gguf.GGUFWriter`);
  * with transformers: `make_transformers_model(family)` then `model.save_pretrained(dir)`.
Every parameter is perturbed (norm scales away from 1, biases away from 0) so nothing is trivial.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

FAMILIES = ("llama", "qwen2", "qwen3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# Llama-3 rope scaling whose three regimes (kept, slowed, interpolated) all occur at head_dim 16.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128)


def hf_config(family: str, **overrides: Any) -> dict[str, Any]:
    """A `config.json` dict for a tiny model of `family` (llama: llama3 rope scaling + all biases)."""
    hf: dict[str, Any] = dict(TINY, architectures=[ARCHITECTURES[family]], model_type=family,
                              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if family == "llama":
        hf.update(rope_theta=50000.0, rope_scaling=dict(LLAMA3_ROPE), attention_bias=True, mlp_bias=True)
    elif family == "qwen2":
        hf.update(rope_theta=1e6)
    else:  # qwen3: head_dim decoupled from hidden_size / heads, tied output projection
        hf.update(rope_theta=1e6, head_dim=24, tie_word_embeddings=True)
    hf.update(overrides)
    return hf


def random_tensors(hf: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor the config needs (HF names, `[out, in]`), float32, none trivially zero or one."""
    from runner.models.checkpoint import expected_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(hf).items():
        if name.endswith("norm.weight"):
            arr = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            arr = 0.1 * rng.standard_normal(shape)
        else:
            arr = rng.standard_normal(shape) / np.sqrt(shape[-1])  # unit-scale activations
        out[name] = arr.astype(np.float32)
    return out


def write_hf_dir(path: Path, hf: dict[str, Any], tensors: dict[str, np.ndarray]) -> Path:
    """config.json + model.safetensors, written without torch or transformers."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def write_gguf(path: Path, hf: dict[str, Any], tensors: dict[str, np.ndarray], *,
               stored_as: dict[str, Any] | None = None) -> Path:
    """A GGUF file the way llama.cpp's converter writes one (llama Q/K rows permuted).

    `stored_as`: HF tensor name -> numpy dtype to store it as (default float32).
    """
    import gguf

    from runner.models.gguf_checkpoint import GGUF_GLOBAL_TENSORS, GGUF_LAYER_TENSORS, llama_permute

    arch = hf["model_type"]
    to_gguf = {v: k for k, v in GGUF_GLOBAL_TENSORS.items()}
    for n in range(hf["num_hidden_layers"]):
        to_gguf.update({f"model.layers.{n}.{v}": f"blk.{n}.{k}" for k, v in GGUF_LAYER_TENSORS.items()})
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(hf.get("rope_theta", 10000.0))
    w.add_vocab_size(hf["vocab_size"])
    if "head_dim" in hf:
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])
    for name, arr in tensors.items():
        key = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        if arch == "llama" and key.startswith(("self_attn.q_proj.", "self_attn.k_proj.")):
            heads = hf["num_attention_heads"] if key.startswith("self_attn.q_proj.") else hf["num_key_value_heads"]
            arr = llama_permute(arr, heads)
        dtype = (stored_as or {}).get(name, np.float32)
        w.add_tensor(to_gguf[name], np.ascontiguousarray(arr, dtype=dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------------------------
# transformers (callers importorskip it first)

TRANSFORMERS_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(TINY, attention_bias=True, mlp_bias=True,
                                  rope_parameters=dict(LLAMA3_ROPE, rope_theta=50000.0))),
    "qwen2": ("Qwen2Config", dict(TINY, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3": ("Qwen3Config", dict(TINY, head_dim=24, tie_word_embeddings=True, attention_bias=False)),
}


def make_transformers_model(family: str, seed: int = 0):
    """A float32 transformers model of `family` with every parameter (norms, biases too) perturbed."""
    import torch
    import transformers

    cls_name, kwargs = TRANSFORMERS_CASES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls_name)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model
