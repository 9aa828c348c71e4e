"""Reading checkpoints (Hugging Face safetensors directories and GGUF files) into Hugging Face names.

A `Checkpoint` (`runner.models.loader.read_checkpoint(path)` reads one) holds the Hugging Face `config.json` contents (or an
equivalent dict built from GGUF metadata) and every weight as a numpy array under its Hugging Face
`state_dict` name, in PyTorch `[out, in]` layout (`model.layers.0.self_attn.q_proj.weight`). Safetensors
weights are memory-mapped in the file's dtype (read only where sliced, so a sharded load reads each
device's part only); GGUF matrices are `GGUFTensor`s that de-quantize to float32 only the rows a reader
slices (a sharded load converts each device's part; `np.asarray` converts a whole tensor).
This module reads Hugging Face directories and validates any checkpoint; GGUF files are read by
`runner.models.gguf_checkpoint`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import struct
from typing import Any, Mapping

import numpy as np

from runner.models.gguf_tensor import GGUFTensor
from runner.models.registry import config_from_hf, get_family
from runner.models.torch_checkpoint import read_torch_state_dict



@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint in Hugging Face terms.

    hf_config: `config.json` contents (or the equivalent built from GGUF metadata).
    tensors: Hugging Face `state_dict` name -> numpy array in PyTorch `[out, in]` layout (memory-mapped
        float32/float16/bfloat16 for safetensors; for GGUF, `GGUFTensor` (float32, de-quantized lazily)
        for matrices and float32 arrays for vectors).
    dtype: the source's dominant storage type by element count ("bfloat16", "float32", "Q4_1", ...).
    tensor_dtypes: the source storage type of every tensor.
    source: "safetensors", "pytorch" (`pytorch_model.bin`, read without torch) or "gguf"; path: what was read.
    """

    hf_config: dict[str, Any]
    tensors: dict[str, np.ndarray | GGUFTensor]
    dtype: str
    tensor_dtypes: dict[str, str]
    source: str
    path: str


# ---------------------------------------------------------------------------------------------
# Validation shared by both formats


def expected_shapes(hf_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of this config needs (any registered family), with its PyTorch shape."""
    cfg = config_from_hf(hf_config)
    family = get_family(cfg.family)
    h, i, v, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        layer: dict[str, tuple[int, ...]] = {
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        }
        if n in cfg.moe_layers:  # routed experts (runner/models/moe.py), named as the family names them
            e, m = cfg.num_experts, cfg.moe_intermediate_size
            layer[family.hf_name(f"layers.{n}.mlp.gate.kernel")[len(p):]] = (e, h)
            for x in range(e):
                for proj, shape in (("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m))):
                    layer[family.hf_name(f"layers.{n}.mlp.experts.{proj}.kernel", x)[len(p):]] = shape
        else:
            layer.update({"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)})
        if cfg.qkv_bias:
            layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                          "self_attn.v_proj.bias": (kv,)})
        if cfg.o_bias:
            layer["self_attn.o_proj.bias"] = (h,)
        if cfg.mlp_bias and n not in cfg.moe_layers:
            layer.update({"mlp.gate_proj.bias": (i,), "mlp.up_proj.bias": (i,), "mlp.down_proj.bias": (h,)})
        if cfg.qk_norm:
            layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
        if cfg.sandwich_norms:
            layer.update({"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)})
        out.update({p + k: s for k, s in layer.items()})
    return out


def validate_tensors(hf_config: Mapping[str, Any], tensors: Mapping[str, np.ndarray], path: str) -> None:
    """Raise ValueError naming every missing or wrongly-shaped tensor (extra tensors are allowed)."""
    try:
        expected = expected_shapes(hf_config)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    missing = [k for k in expected if k not in tensors]
    bad = [f"{k}: {tuple(tensors[k].shape)} != expected {s}" for k, s in expected.items()
           if k in tensors and tuple(tensors[k].shape) != s]
    if missing or bad:
        msg = [f"{path}: checkpoint does not match its config"]
        if missing:
            msg.append(f"missing tensors ({len(missing)}): {', '.join(missing[:10])}"
                       + (" ..." if len(missing) > 10 else ""))
        if bad:
            msg.append(f"wrong shapes: {'; '.join(bad[:10])}" + (" ..." if len(bad) > 10 else ""))
        raise ValueError("\n  ".join(msg))


def dominant_dtype(tensor_dtypes: Mapping[str, str], tensors: Mapping[str, np.ndarray]) -> str:
    counts: collections.Counter[str] = collections.Counter()
    for k, dt in tensor_dtypes.items():
        counts[dt] += int(tensors[k].size)
    return counts.most_common(1)[0][0] if counts else "float32"


# ---------------------------------------------------------------------------------------------
# Hugging Face directories


def read_hf_dir(path: str) -> Checkpoint:
    """config.json + every safetensors tensor of a directory, without checking them against any model
    (draft heads reuse this)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: directory has no config.json (not a Hugging Face checkpoint)")
    try:
        with open(cfg_path) as f:
            hf_config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_path}: cannot parse config.json: {e}") from None
    if not isinstance(hf_config, dict):
        raise ValueError(f"{cfg_path}: config.json is not a JSON object")

    index_path = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    source, read_file = "safetensors", _read_safetensors
    if not os.path.isfile(index_path) and not os.path.isfile(single) and not any(
            f.endswith(".safetensors") for f in os.listdir(path)):
        # No safetensors: PyTorch `pytorch_model.bin` files, read without torch (runner.models.torch_checkpoint).
        index_path = os.path.join(path, "pytorch_model.bin.index.json")
        single = os.path.join(path, "pytorch_model.bin")
        source, read_file = "pytorch", read_torch_state_dict
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index_path}: cannot parse weight index ({type(e).__name__}: {e})") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise FileNotFoundError(f"{index_path}: names shard file(s) that do not exist: {', '.join(missing)}")
        files = [os.path.join(path, s) for s in shards]
    elif os.path.isfile(single):
        weight_map, files = {}, [single]
    else:
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        weight_map = {}
        if not files:
            raise FileNotFoundError(f"{path}: directory has no weights (looked for *.safetensors, "
                                    "model.safetensors.index.json, pytorch_model.bin[.index.json])")

    tensors: dict[str, np.ndarray] = {}
    tensor_dtypes: dict[str, str] = {}
    for file in files:
        for name, (arr, dt) in read_file(file).items():
            if name in tensors:
                raise ValueError(f"{path}: tensor {name!r} appears in more than one {source} file")
            tensors[name], tensor_dtypes[name] = arr, dt
    for name, shard in weight_map.items():
        if name not in tensors:
            raise ValueError(f"{index_path}: tensor {name!r} is listed in shard {shard!r} but not found in it")
    return Checkpoint(hf_config=hf_config, tensors=tensors, dtype=dominant_dtype(tensor_dtypes, tensors),
                      tensor_dtypes=tensor_dtypes, source=source, path=path)


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "I64": "int64", "I32": "int32", "BOOL": "bool"}  # integer/bool: EAGLE-3 vocab maps


def _read_safetensors(file: str) -> dict[str, tuple[np.ndarray, str]]:
    """name -> (memory-mapped array in the file's dtype, source dtype name) for one safetensors file.

    Nothing is read until a slice is taken, so a sharded load reads each device's part of a tensor
    only (`runner.models.loader` converts to the model dtype slice by slice).
    """
    import ml_dtypes

    try:
        header, data_start = _safetensors_header(file)
        raw = np.memmap(file, dtype=np.uint8, mode="r")
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: cannot read safetensors file (truncated or corrupt?): {e}") from None
    out: dict[str, tuple[np.ndarray, str]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            st_dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{file}: cannot read safetensors file (truncated or corrupt?): bad entry {name!r}") from None
        if st_dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{file}: tensor {name!r} has dtype {st_dtype}; supported: {', '.join(_SAFETENSORS_DTYPES)}")
        np_dtype = np.dtype(ml_dtypes.bfloat16) if st_dtype == "BF16" else np.dtype(_SAFETENSORS_DTYPES[st_dtype])
        if end - begin != np_dtype.itemsize * math.prod(shape) or data_start + end > raw.size:
            raise ValueError(f"{file}: cannot read safetensors file (truncated or corrupt?): tensor {name!r} is "
                             f"truncated")
        out[name] = (raw[data_start + begin:data_start + end].view(np_dtype).reshape(shape), _SAFETENSORS_DTYPES[st_dtype])
    return out


def _safetensors_header(file: str) -> tuple[dict[str, Any], int]:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > os.path.getsize(file) - 8:
            raise ValueError(f"header length {n} exceeds the file")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header, 8 + n


# ---------------------------------------------------------------------------------------------
# GGUF files
