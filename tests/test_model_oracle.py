"""Oracle tests for `runner.models`: our NNX forward against transformers and the float64 numpy reference.

* tiny Llama (llama3 rope scaling, all biases), Qwen2 and Qwen3 checkpoints written by transformers:
  `load_model` logits == transformers logits (float32 within 1e-4; bfloat16 within a justified bound),
  including right- and left-padded masked batches against per-sequence runs;
* the same families written without torch: `load_model` == `numpy_forward` (never skipped);
* the real SmolLM2-135M GGUF (slow): `load_model(None)` == transformers' own GGUF loader within 1e-3;
* gradients flow: one jitted `optax.adam` step lowers a next-token loss;
* bad checkpoints fail with a clear error raised from our code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from runner.models.config import ModelConfig
from runner.models.llama import LlamaForCausalLM
from runner.models.loader import load_model
from runner.models.registry import config_from_hf
from tests.helpers_models import (
    FAMILIES,
    hf_config,
    make_transformers_model,
    random_tensors,
    write_gguf,
    write_hf_dir,
)
from tests.reference_numpy import numpy_forward

RUNNER_DIR = str(Path(__file__).resolve().parents[1] / "runner")

# Three different sequences (the third starts with the others' tokens then diverges).
IDS = np.array([[5, 17, 3, 88, 41, 41, 9, 60, 2, 33, 71, 14, 90],
                [94, 0, 27, 27, 27, 6, 50, 12, 81, 39, 44, 3, 7],
                [5, 17, 3, 11, 62, 30, 8, 19, 74, 55, 1, 95, 20]], dtype=np.int32)
LENGTHS = (13, 8, 4)  # padding cases: real tokens per row


def _positions(ids: np.ndarray) -> np.ndarray:
    return np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)


def _ours(model: LlamaForCausalLM, ids: np.ndarray, mask: np.ndarray | None = None,
          positions: np.ndarray | None = None) -> np.ndarray:
    positions = _positions(ids) if positions is None else positions
    out = model(jnp.asarray(ids), jnp.asarray(positions), None if mask is None else jnp.asarray(mask))
    assert out.dtype == jnp.float32
    return np.asarray(out)


def _padded(ids: np.ndarray, lengths: tuple[int, ...], pad_id: int, side: str
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[slice]]:
    """Row r's first lengths[r] tokens, padded on `side`: (ids, mask, positions, slice of the real tokens)."""
    width = ids.shape[1]
    out, mask = np.full_like(ids, pad_id), np.zeros_like(ids)
    spans = []
    for r, n in enumerate(lengths):
        span = slice(0, n) if side == "right" else slice(width - n, width)
        out[r, span], mask[r, span] = ids[r, :n], 1
        spans.append(span)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return out, mask, positions, spans


def _check_padded(model: LlamaForCausalLM, reference: Any, pad_id: int) -> None:
    """Right- and left-padded batches with a mask: each row's real positions == `reference(row ids)`."""
    for side in ("right", "left"):
        ids, mask, positions, spans = _padded(IDS, LENGTHS, pad_id, side)
        got = _ours(model, ids, mask, positions)
        for row, (n, span) in enumerate(zip(LENGTHS, spans)):
            want = reference(IDS[row:row + 1, :n])[0]
            assert _max_abs(got[row, span], want) < 1e-4, (side, row, _max_abs(got[row, span], want))
        if side == "left":  # real queries see pad keys unless masked: the mask must be what hides them
            other = _ours(model, np.where(mask > 0, ids, pad_id + 5).astype(np.int32), mask, positions)
            for row, span in enumerate(spans):
                assert _max_abs(other[row, span], got[row, span]) < 1e-5
            unmasked = _ours(model, ids, None, positions)
            assert _max_abs(unmasked[1, spans[1]], got[1, spans[1]]) > 1e-3


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ---------------------------------------------------------------------------------------------
# 1. tiny models written by transformers


def _torch_logits(model: Any, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(np.asarray(ids, np.int64))).logits.float().numpy()


@pytest.fixture(scope="module", params=FAMILIES)
def hf_tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(family, transformers model, directory it was saved to), one per family per module."""
    pytest.importorskip("transformers")
    family = request.param
    model = make_transformers_model(family, seed=FAMILIES.index(family))
    path = tmp_path_factory.mktemp(f"hf_{family}")
    model.save_pretrained(path, safe_serialization=True)
    return family, model, path


def test_transformers_float32_logits(hf_tiny: tuple[str, Any, Path]) -> None:
    family, hf_model, path = hf_tiny
    model, cfg = load_model(str(path))
    assert cfg.family == family and cfg.param_dtype == "float32"
    if family == "llama":
        assert cfg.rope_scaling is not None and cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias
    want = _torch_logits(hf_model, IDS)
    got = _ours(model, IDS)
    assert got.shape == want.shape == (3, IDS.shape[1], cfg.vocab_size)
    assert np.abs(want).max() > 0.1  # the comparison is not between near-zero numbers
    assert _max_abs(got, want) < 1e-4, _max_abs(got, want)
    assert _max_abs(got[0], got[1]) > 0.1  # rows really differ


def test_transformers_padding(hf_tiny: tuple[str, Any, Path]) -> None:
    """Padded batches with an attention mask: each row's real positions == transformers on that row alone."""
    family, hf_model, path = hf_tiny
    model, _ = load_model(str(path))
    _check_padded(model, lambda ids: _torch_logits(hf_model, ids), pad_id=0)


def test_transformers_bfloat16_params(hf_tiny: tuple[str, Any, Path]) -> None:
    """bfloat16 parameters and compute vs the float32 transformers logits.

    bfloat16 keeps 8 significant bits: every rounding (weights, each matmul output, residual adds,
    norm outputs) has relative error <= 2**-9 ~ 0.2%. Through ~10 rounded ops per layer x 2 layers the
    errors add up to a few 2**-9 of the activation scale, i.e. a few percent of the logit scale at worst.
    We allow 5% of the largest |logit| (and at least check that the result is not float32 by accident,
    nor garbage: a wrong kernel layout or a missing bias is off by O(100%)), and the mean error must be
    well below that (1%), since most errors cancel.
    """
    family, hf_model, path = hf_tiny
    model, cfg = load_model(str(path), dtype="bfloat16")
    assert cfg.param_dtype == cfg.dtype == "bfloat16"
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    want = _torch_logits(hf_model, IDS)
    got = _ours(model, IDS)
    scale = float(np.abs(want).max())
    err = np.abs(got.astype(np.float64) - want)
    assert err.max() < 0.05 * scale, (err.max(), scale)
    assert err.mean() < 0.01 * scale, (err.mean(), scale)
    assert err.max() > 1e-6  # really computed in bfloat16
    # the ranking mostly survives: top-1 tokens agree at >= 90% of positions
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9


# ---------------------------------------------------------------------------------------------
# 2. without torch: checkpoints written by hand, the float64 numpy reference as oracle


@pytest.mark.parametrize("family", FAMILIES)
def test_numpy_reference(family: str, tmp_path: Path) -> None:
    hf = hf_config(family)
    tensors = random_tensors(hf, seed=10 + FAMILIES.index(family))
    write_hf_dir(tmp_path, hf, tensors)
    model, cfg = load_model(str(tmp_path))
    assert cfg.family == family
    want = numpy_forward(hf, tensors, IDS)
    got = _ours(model, IDS)
    assert np.abs(want).max() > 1.0
    assert _max_abs(got, want) < 1e-4, _max_abs(got, want)
    if family == "llama":  # the rope scaling matters at these positions
        plain = {k: v for k, v in hf.items() if k != "rope_scaling"}
        assert _max_abs(numpy_forward(plain, tensors, IDS), want) > 1e-2
    _check_padded(model, lambda ids: numpy_forward(hf, tensors, ids), pad_id=3)


@pytest.mark.parametrize("family", FAMILIES)
def test_numpy_reference_gguf(family: str, tmp_path: Path) -> None:
    """A float32 GGUF of the same weights (llama Q/K permuted like llama.cpp) gives the same logits."""
    hf = hf_config(family)
    hf.pop("rope_scaling", None)  # llama3 scaling in GGUF is covered in test_checkpoint.py
    tensors = random_tensors(hf, seed=20)
    model, _ = load_model(str(write_gguf(tmp_path / "tiny.gguf", hf, tensors)))
    assert _max_abs(_ours(model, IDS), numpy_forward(hf, tensors, IDS)) < 1e-4


# ---------------------------------------------------------------------------------------------
# 3. the real model (SmolLM2-135M-Instruct GGUF) vs transformers' GGUF loader

PROMPTS = [f"Question {i}: Write a short paragraph about the number {i} and why it is interesting. Answer:"
           for i in range(8)]


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    from runner.models.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm2_ours(smollm2_path: str) -> tuple[LlamaForCausalLM, ModelConfig]:
    return load_model(None)


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_path: str) -> Any:
    transformers = pytest.importorskip("transformers")
    import torch

    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smollm2_batch(smollm2_path: str) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    """The 8 prompts tokenized by our tokenizer (checked against transformers'), right-padded."""
    from rollout.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    rows = [tok.encode(p) for p in PROMPTS]
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))
    assert rows == [hf_tok.encode(p) for p in PROMPTS]
    width = max(map(len, rows))
    ids = np.full((len(rows), width), tok.pad_token_id, np.int32)
    mask = np.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, :len(row)], mask[r, :len(row)] = row, 1
    return ids, mask, rows


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf(smollm2_ours: tuple[LlamaForCausalLM, ModelConfig], smollm2_hf: Any,
                                           smollm2_batch: tuple[np.ndarray, np.ndarray, list[list[int]]]) -> None:
    import torch

    model, cfg = smollm2_ours
    assert cfg.family == "llama" and cfg.num_hidden_layers == 30 and cfg.tie_word_embeddings
    ids, mask, rows = smollm2_batch
    got = np.asarray(nnx.jit(lambda m, i, p, a: m(i, p, a))(
        model, jnp.asarray(ids), jnp.asarray(_positions(ids)), jnp.asarray(mask)))
    with torch.no_grad():
        want = smollm2_hf(input_ids=torch.tensor(ids, dtype=torch.long),
                          attention_mask=torch.tensor(mask, dtype=torch.long)).logits.float().numpy()
    worst = 0.0
    for r, row in enumerate(rows):
        n = len(row)
        worst = max(worst, _max_abs(got[r, :n], want[r, :n]))
    assert worst < 1e-3, worst
    assert np.abs(want[0, :len(rows[0])]).max() > 5.0  # real logits, not a degenerate model


# ---------------------------------------------------------------------------------------------
# 4. gradients


def test_adam_step_lowers_next_token_loss() -> None:
    import optax

    hf = hf_config("qwen3", num_hidden_layers=1)  # qk-norm, tied embeddings: every kind of parameter
    cfg = config_from_hf(hf)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ids = jnp.asarray(IDS)
    positions = jnp.asarray(_positions(IDS))

    def loss_fn(m: LlamaForCausalLM) -> jax.Array:
        logits = m(ids[:, :-1], positions[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    @nnx.jit
    def train_step(m: LlamaForCausalLM, opt: nnx.Optimizer) -> tuple[jax.Array, Any]:
        loss, grads = nnx.value_and_grad(loss_fn)(m)
        opt.update(m, grads)
        return loss, grads

    inv_freq_before = np.asarray(model.layers[0].self_attn.inv_freq[...])
    loss0, grads = train_step(model, optimizer)
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert len(leaves) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert all(bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).max()) > 0 for g in leaves)
    loss1 = nnx.jit(loss_fn)(model)
    assert np.isfinite(float(loss0)) and float(loss1) < float(loss0) - 1e-3, (float(loss0), float(loss1))
    # the rotary buffer is not a Param: untouched by the optimizer
    np.testing.assert_array_equal(np.asarray(model.layers[0].self_attn.inv_freq[...]), inv_freq_before)


# ---------------------------------------------------------------------------------------------
# 5. bad input gives a clear error from our code


def _assert_ours(excinfo: pytest.ExceptionInfo) -> None:
    """The exception was raised in runner/ (not deep inside a parser), and says which file."""
    origin = str(excinfo.traceback[-1].path)
    assert origin.startswith(RUNNER_DIR), origin


def test_error_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist.*nope") as e:
        load_model(str(tmp_path / "nope"))
    _assert_ours(e)


def test_error_directory_without_config(tmp_path: Path) -> None:
    write_hf_dir(tmp_path, hf_config("qwen2"), random_tensors(hf_config("qwen2")))
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json") as e:
        load_model(str(tmp_path))
    _assert_ours(e)


def test_error_unsupported_architecture(tmp_path: Path) -> None:
    hf = hf_config("qwen2")
    write_hf_dir(tmp_path, hf, random_tensors(hf))
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, architectures=["GPT2LMHeadModel"], model_type="gpt2")))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel") as e:
        load_model(str(tmp_path))
    assert "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM" in str(e.value)
    _assert_ours(e)


def test_error_truncated_safetensors(tmp_path: Path) -> None:
    hf = hf_config("qwen2")
    write_hf_dir(tmp_path, hf, random_tensors(hf))
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    for cut in (len(data) - 100, 30, 4):
        f.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="model.safetensors.*truncated or corrupt") as e:
            load_model(str(tmp_path))
        _assert_ours(e)


def test_error_truncated_gguf(tmp_path: Path) -> None:
    hf = hf_config("qwen2")
    path = write_gguf(tmp_path / "tiny.gguf", hf, random_tensors(hf))
    data = path.read_bytes()
    for cut in (len(data) - 1000, 200, 10):
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="tiny.gguf.*truncated") as e:
            load_model(str(path))
        _assert_ours(e)


def test_error_gguf_unsupported_tensor_type(tmp_path: Path) -> None:
    hf = hf_config("qwen2")
    path = write_gguf(tmp_path / "f64.gguf", hf, random_tensors(hf),
                      stored_as={"model.layers.1.mlp.up_proj.weight": np.float64})
    with pytest.raises(ValueError, match="'blk.1.ffn_up.weight' has type F64.*supported types: .*Q8_0") as e:
        load_model(str(path))
    _assert_ours(e)


def test_error_head_counts_do_not_divide(tmp_path: Path) -> None:
    hf = hf_config("qwen2")
    write_hf_dir(tmp_path, hf, random_tensors(hf))
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, num_key_value_heads=3)))
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be a multiple of "
                                         r"num_key_value_heads \(3\)") as e:
        load_model(str(tmp_path))
    _assert_ours(e)
