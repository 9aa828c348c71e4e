"""Reading a `.gguf` file into Hugging Face names and layouts (a `runner.models.checkpoint.Checkpoint`).

GGUF facts this module relies on:
  * GGUF lists tensor dims innermost-first (`[in, out]`); `runner.models.gguf_file` (as `gguf.GGUFReader`)
    reverses them, so the numpy
    data (and `gguf.quants.dequantize`'s output) is already `[out, in]`, like PyTorch.
  * llama.cpp's converter permutes the rows of `llama` Q and K projections (weights and biases) from
    Hugging Face's rotate-half RoPE layout to its interleaved layout; we undo it exactly as
    `transformers.modeling_gguf_pytorch_utils.LlamaTensorProcessor._reverse_permute_weights` does.
    `qwen2`/`qwen3` tensors are not permuted.
  * llama.cpp bakes Llama-3 RoPE scaling into a `rope_freqs.weight` tensor of per-frequency
    divisors; we recover the equivalent `rope_scaling` dict (or fail loudly when it matches none).
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import numpy as np

from runner.models.checkpoint import Checkpoint, dominant_dtype
from runner.models.family import ModelFamily
from runner.models.gguf_file import GGUFFile, read_gguf_file
from runner.models.gguf_tensor import GGUFTensor
from runner.models.llama_family import LLAMA
from runner.models.registry import FAMILIES


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


def supported_gguf_types() -> list[str]:
    """GGML tensor types `gguf.quants.dequantize` can turn into float32."""
    import gguf
    from gguf import quants

    traits = getattr(quants, "_type_traits", {})
    types = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, *traits}
    return sorted(t.name for t in types)


def _field(reader: GGUFFile, key: str) -> Any:
    return reader.fields.get(key)


def read_gguf(path: str) -> Checkpoint:
    from gguf.quants import dequantize

    try:
        reader = read_gguf_file(path)
    except ValueError:
        raise
    except Exception as e:  # short memmap reads surface as reshape/struct errors
        raise ValueError(f"{path}: cannot read GGUF file (truncated or corrupt?): {type(e).__name__}: {e}") from None

    arch = _field(reader, "general.architecture")
    gguf_families = [name for name, f in FAMILIES.items() if any(e.gguf for e in f.names)]
    if arch not in gguf_families:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(gguf_families)} "
                         f"(other families load from a Hugging Face safetensors directory)")
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
    return Checkpoint(hf_config=hf_config, tensors=tensors, dtype=dominant_dtype(tensor_dtypes, tensors),
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
