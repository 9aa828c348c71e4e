"""Reading checkpoints (Hugging Face safetensors directories and GGUF files) into Hugging Face names.

`read_checkpoint(path)` returns a `Checkpoint`: the Hugging Face `config.json` contents (or an
equivalent dict built from GGUF metadata) and every weight as a numpy array under its Hugging Face
`state_dict` name, in PyTorch `[out, in]` layout (`model.layers.0.self_attn.q_proj.weight`). Safetensors
weights are memory-mapped in the file's dtype (read only where sliced, so a sharded load reads each
device's part only); GGUF matrices are `GGUFTensor`s that de-quantize to float32 only the rows a reader
slices (a sharded load converts each device's part; `np.asarray` converts a whole tensor).

GGUF facts this module relies on:
  * GGUF lists tensor dims innermost-first (`[in, out]`); `GGUFReader` reverses them, so the numpy
    data (and `gguf.quants.dequantize`'s output) is already `[out, in]`, like PyTorch.
  * llama.cpp's converter permutes the rows of `llama` Q and K projections (weights and biases) from
    Hugging Face's rotate-half RoPE layout to its interleaved layout; we undo it exactly as
    `transformers.modeling_gguf_pytorch_utils.LlamaTensorProcessor._reverse_permute_weights` does.
    `qwen2`/`qwen3` tensors are not permuted.
  * llama.cpp bakes Llama-3 RoPE scaling into a `rope_freqs.weight` tensor of per-frequency
    divisors; we recover the equivalent `rope_scaling` dict (or fail loudly when it matches none).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import struct
from typing import Any, Callable, Mapping

import numpy as np

from runner.models.config import ModelConfig
from runner.models.family import ModelFamily
from runner.models.llama_family import LLAMA
from runner.models.registry import FAMILIES
from runner.models.gguf_tensor import GGUFTensor
from runner.models.torch_checkpoint import read_torch_state_dict



def gguf_tables(family: ModelFamily) -> tuple[dict[str, str], dict[str, str]]:
    """Views of a family's name table: GGUF -> HF names of the global tensors, and of the per-layer
    ones (`blk.{N}.{key}` -> `model.layers.{N}.{value}`)."""
    glob = {e.gguf: e.hf for e in family.names if e.gguf is not None and "*" not in e.gguf}
    layer = {e.gguf.removeprefix("blk.*."): e.hf.removeprefix("model.layers.*.") for e in family.names
             if e.gguf is not None and e.gguf.startswith("blk.*.")}
    return glob, layer


GGUF_GLOBAL_TENSORS, GGUF_LAYER_TENSORS = gguf_tables(LLAMA)
GGUF_ROPE_FREQS = "rope_freqs.weight"

# `{arch}.{key}` GGUF metadata -> (HF config key, converter, required).
GGUF_CONFIG_KEYS: dict[str, tuple[str, Callable[[Any], Any], bool]] = {
    "block_count": ("num_hidden_layers", int, True),
    "embedding_length": ("hidden_size", int, True),
    "feed_forward_length": ("intermediate_size", int, True),
    "attention.head_count": ("num_attention_heads", int, True),
    "attention.head_count_kv": ("num_key_value_heads", int, False),
    "attention.key_length": ("head_dim", int, False),
    "attention.layer_norm_rms_epsilon": ("rms_norm_eps", float, True),
    "rope.freq_base": ("rope_theta", float, False),
    "context_length": ("max_position_embeddings", int, False),
    "vocab_size": ("vocab_size", int, False),
}
GGUF_TOKEN_KEYS: dict[str, str] = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}


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


def read_checkpoint(path: str) -> Checkpoint:
    """Read a Hugging Face directory (`config.json` + safetensors) or a `.gguf` file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint path does not exist: {path}")
    if os.path.isdir(path):
        ckpt = _read_hf_dir(path)
    elif _is_gguf(path):
        ckpt = _read_gguf(path)
    else:
        raise ValueError(
            f"{path}: not a checkpoint; expected a Hugging Face directory (config.json + *.safetensors) "
            f"or a .gguf file")
    validate_tensors(ckpt.hf_config, ckpt.tensors, path)
    return ckpt


# ---------------------------------------------------------------------------------------------
# Validation shared by both formats


def expected_shapes(hf_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama-family model of this config needs, with its PyTorch shape."""
    cfg = ModelConfig.from_hf_dict(hf_config)
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
        if n in cfg.moe_layers:  # routed experts (runner/models/moe.py)
            e, m = cfg.num_experts, cfg.moe_intermediate_size
            layer["mlp.gate.weight"] = (e, h)
            for x in range(e):
                layer.update({f"mlp.experts.{x}.gate_proj.weight": (m, h), f"mlp.experts.{x}.up_proj.weight": (m, h),
                              f"mlp.experts.{x}.down_proj.weight": (h, m)})
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


def _dominant(tensor_dtypes: Mapping[str, str], tensors: Mapping[str, np.ndarray]) -> str:
    counts: collections.Counter[str] = collections.Counter()
    for k, dt in tensor_dtypes.items():
        counts[dt] += int(tensors[k].size)
    return counts.most_common(1)[0][0] if counts else "float32"


# ---------------------------------------------------------------------------------------------
# Hugging Face directories


def _read_hf_dir(path: str) -> Checkpoint:
    return read_hf_dir(path)


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
    return Checkpoint(hf_config=hf_config, tensors=tensors, dtype=_dominant(tensor_dtypes, tensors),
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


def _is_gguf(path: str) -> bool:
    if path.endswith(".gguf"):
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def supported_gguf_types() -> list[str]:
    """GGML tensor types `gguf.quants.dequantize` can turn into float32."""
    import gguf
    from gguf import quants

    traits = getattr(quants, "_type_traits", {})
    types = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, *traits}
    return sorted(t.name for t in types)


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _read_gguf(path: str) -> Checkpoint:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(path)
    except Exception as e:  # short memmap reads surface as reshape/struct/Value errors
        raise ValueError(f"{path}: cannot read GGUF file (truncated or corrupt?): {type(e).__name__}: {e}") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise ValueError(f"{path}: GGUF file is truncated (tensor {t.name!r} extends past end of file)")

    arch = _field(reader, "general.architecture")
    if arch not in FAMILIES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(FAMILIES)}")
    family = FAMILIES[arch]
    hf_arch, model_type = family.architectures[0], family.name
    global_tensors, layer_tensors = gguf_tables(family)
    by_name = {t.name: t for t in reader.tensors}

    hf_config: dict[str, Any] = {"architectures": [hf_arch], "model_type": model_type}
    for key, (hf_key, conv, required) in GGUF_CONFIG_KEYS.items():
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            if required:
                raise ValueError(f"{path}: GGUF metadata lacks required key {arch}.{key}")
            continue
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(f"{path}: per-layer {arch}.{key} = {value} is not supported")
            value = value[0]
        hf_config[hf_key] = conv(value)
    rope_kind = _field(reader, f"{arch}.rope.scaling.type")
    if rope_kind not in (None, "none"):
        raise ValueError(f"{path}: GGUF rope scaling type {rope_kind!r} ({arch}.rope.scaling.type) is not "
                         f"supported; supported: none, or Llama-3 factors in {GGUF_ROPE_FREQS}")
    hf_config.setdefault("num_key_value_heads", hf_config["num_attention_heads"])
    hf_config.setdefault("rope_theta", 10000.0)
    if "token_embd.weight" in by_name:  # the embedding is authoritative for the vocabulary size
        hf_config["vocab_size"] = int(by_name["token_embd.weight"].shape[-1])
    for key, hf_key in GGUF_TOKEN_KEYS.items():
        if (value := _field(reader, key)) is not None:
            hf_config[hf_key] = int(value)
    hf_config["tie_word_embeddings"] = "output.weight" not in by_name
    if arch == "llama":
        hf_config["attention_bias"] = any(n.endswith(".attn_q.bias") for n in by_name)
    hf_config["mlp_bias"] = any(n.endswith(".ffn_gate.bias") for n in by_name)

    supported = None
    tensors: dict[str, np.ndarray] = {}
    tensor_dtypes: dict[str, str] = {}
    sources: dict[str, str] = {}
    unknown: list[str] = []
    layer_re = re.compile(r"blk\.(\d+)\.(.+)")
    n_layers = hf_config["num_hidden_layers"]
    for t in reader.tensors:
        if t.name == GGUF_ROPE_FREQS:
            continue
        m = layer_re.fullmatch(t.name)
        if m and m.group(2) in layer_tensors and int(m.group(1)) < n_layers:
            hf_name, key = f"model.layers.{int(m.group(1))}.{layer_tensors[m.group(2)]}", f"blk.*.{m.group(2)}"
        elif t.name in global_tensors:
            hf_name, key = global_tensors[t.name], t.name
        else:
            unknown.append(t.name)
            continue
        if hf_name in sources:
            raise ValueError(f"{path}: GGUF tensors {sources[hf_name]!r} and {t.name!r} both map to {hf_name!r}")
        sources[hf_name] = t.name
        want = tuple(int(x) for x in reversed(t.shape.tolist()))
        two_d = len(want) == 2 and t.data.ndim == 2 and t.data.shape[0] == want[0]
        try:  # 2-D weights: the first row now (type and shape check), the rest when sliced (GGUFTensor)
            probe = np.asarray(dequantize(t.data[:1] if two_d else t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError:
            supported = supported or supported_gguf_types()
            raise ValueError(f"{path}: GGUF tensor {t.name!r} has type {t.tensor_type.name}, which cannot be "
                             f"dequantized; supported types: {', '.join(supported)}") from None
        got = (want[0], *probe.shape[1:]) if two_d else probe.shape
        if got != want:
            raise ValueError(f"{path}: GGUF tensor {t.name!r} dequantized to shape {got}, expected {want}")
        permuted = key in family.gguf_permuted
        if two_d:
            order = (reverse_llama_permute(np.arange(want[0]), hf_config[family.gguf_permuted[key]]) if permuted
                     else None)
            arr: np.ndarray | GGUFTensor = GGUFTensor(t.data, t.tensor_type, want, order)
        else:
            arr = np.array(probe)  # norms and biases: small, read now (a copy out of the memmap)
            if permuted:
                arr = reverse_llama_permute(arr, hf_config[family.gguf_permuted[key]])
        tensors[hf_name], tensor_dtypes[hf_name] = arr, t.tensor_type.name
    if unknown:
        raise ValueError(f"{path}: GGUF tensors with no Hugging Face mapping for a {n_layers}-layer {arch} model: "
                         f"{', '.join(unknown[:10])}" + (" ..." if len(unknown) > 10 else ""))
    if GGUF_ROPE_FREQS in by_name:
        freqs = np.array(dequantize(by_name[GGUF_ROPE_FREQS].data, by_name[GGUF_ROPE_FREQS].tensor_type),
                         dtype=np.float64).reshape(-1)
        head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
        scaling = llama3_scaling_from_rope_freqs(freqs, hf_config["rope_theta"], head_dim)
        if scaling is not None:
            if scaling.get("rope_type") == "unrecognized":
                raise ValueError(f"{path}: {GGUF_ROPE_FREQS} holds rope factors that match no Llama-3 "
                                 f"rope_scaling (factor, low/high_freq_factor, original context); unsupported")
            hf_config["rope_scaling"] = scaling
    del reader
    return Checkpoint(hf_config=hf_config, tensors=tensors, dtype=_dominant(tensor_dtypes, tensors),
                      tensor_dtypes=tensor_dtypes, source="gguf", path=path)


def reverse_llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head, n_head_kv)` on Q/K rows (weights `[out, in]` or biases `[out]`).

    llama.cpp: `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)`.
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation (Hugging Face rotate-half rows -> GGUF interleaved rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(head_dim: int, rope_theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp writes for a Llama-3 `rope_scaling` (divisors of inv_freq)."""
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    old = original_max_position_embeddings
    smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    return np.where(wavelen < old / high_freq_factor, 1.0,
                    np.where(wavelen > old / low_freq_factor, factor, 1 / ((1 - smooth) / factor + smooth)))


def llama3_scaling_from_rope_freqs(freqs: np.ndarray, rope_theta: float, head_dim: int) -> dict[str, Any] | None:
    """Recover a Llama-3 `rope_scaling` dict from llama.cpp's baked rope factors.

    None when every factor is 1 (no scaling); `{"rope_type": "unrecognized"}` when no candidate fits.
    """
    if freqs.shape != (head_dim // 2,):
        return {"rope_type": "unrecognized"}
    if np.allclose(freqs, 1.0):
        return None
    factor = float(freqs.max())
    for old in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
        for low in (1.0, 0.5, 2.0):
            for high in (4.0, 2.0, 8.0, 1.0):
                if high <= low:
                    continue
                ref = llama3_rope_factors(head_dim, rope_theta, factor, low, high, old)
                if np.allclose(ref, freqs, rtol=1e-4, atol=1e-5):
                    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                            "high_freq_factor": high, "original_max_position_embeddings": old}
    return {"rope_type": "unrecognized"}
