"""`load_model`: a checkpoint (HF directory, GGUF file, or the embedded default) -> NNX model + config.

The Hugging Face name -> model parameter mapping is the family's name table (`runner.models.registry`);
loading fails loudly on checkpoint tensors it does not map, on model parameters nothing fills, and on
shape mismatches. `NameRule` / `map_hf_name` map other regex tables (the EAGLE-3 head's).
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from runner.models.checkpoint import Checkpoint, read_hf_dir, validate_tensors
from runner.models.config import ModelConfig
from runner.models.default_model import default_model_path
from runner.models.family import CausalLM
from runner.models.gguf_checkpoint import read_gguf
from runner.models.gguf_file import is_gguf
from runner.models.head_layout import Expansion, expand
from runner.models.registry import build_model, config_from_hf, get_family
from runner.sharding import param_sharding


@dataclasses.dataclass(frozen=True)
class NameRule:
    """One row of the HF -> model table: `hf` regex (groups fill `target`), and whether to transpose."""

    hf: str
    target: str
    transpose: bool = False


def map_hf_name(name: str, rules: tuple[NameRule, ...]) -> tuple[str, bool] | None:
    """The model path and transpose flag for one HF tensor name, or None when no rule matches."""
    for rule in rules:
        m = re.fullmatch(rule.hf, name)
        if m:
            return rule.target.format(*m.groups()), rule.transpose
    return None


def _path_str(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def model_from_hf_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray], *, mesh: Mesh | None = None
                          ) -> CausalLM:
    """Build the model with its parameters taken from HF-named `[out, in]` tensors.

    With a `mesh`, each tensor goes from the host straight into its sharded layout
    (`runner.sharding` rules): no device ever holds a full copy of a tensor it does not own. Heads
    the mesh's `model` axis does not divide are padded / replicated on the way
    (`runner.models.head_layout`): the model's config then says so.
    """
    if mesh is not None:
        cfg = cfg.stored_for(mesh.shape["model"])
    layout = cfg.head_layout  # checkpoint heads -> stored heads (None: stored as they are)
    family = get_family(cfg.family)
    abstract = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    flat = {_path_str(k): v for k, v in nnx.to_flat_state(params)}
    values: dict[str, jax.Array] = {}
    problems: list[str] = []
    sources: dict[str, tuple[str, object]] = {}  # target -> (what it is read from, the host tensor)
    rows: dict[str, dict[int, np.ndarray]] = {}  # stacked parameters (experts): their rows, by index
    for name, array in tensors.items():
        if family.is_ignored(name):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the embedding is the output projection
        mapped = family.map_hf_name(name)
        if mapped is None:
            problems.append(f"checkpoint tensor {name!r} matches no rule")
            continue
        target, transpose, index = mapped
        if target not in flat:
            problems.append(f"checkpoint tensor {name!r} -> {target!r}, which this model config does not have")
            continue
        arr = array.T if transpose else array  # a view: memory-mapped sources stay unread
        if index is not None:
            if index in rows.setdefault(target, {}):
                problems.append(f"two checkpoint tensors map to {target!r}[{index}]")
            rows[target][index] = arr
            continue
        if target in sources:
            problems.append(f"two checkpoint tensors map to {target!r}")
            continue
        sources[target] = (repr(name), arr)
    for target, by_index in rows.items():
        count = flat[target].value.shape[0]
        absent = sorted(set(range(count)) - set(by_index))
        if absent or max(by_index) >= count:
            problems.append(f"{target!r} stacks {count} tensors; the checkpoint has indices {sorted(by_index)}")
            continue
        pieces = [by_index[i] for i in range(count)]
        if len({tuple(p.shape) for p in pieces}) != 1:
            problems.append(f"the tensors stacked into {target!r} differ in shape: {sorted({p.shape for p in pieces})}")
            continue
        sources[target] = (f"{count} tensors stacked", StackedRows(pieces))
    for target, (name, arr) in sources.items():
        expansion = layout.expansion(target) if layout is not None else None
        if expansion is not None:
            arr = ExpandedColumns(arr, expansion)
        want = flat[target].value
        if arr.shape != want.shape:
            problems.append(f"{name}: shape {arr.shape} (after layout change) != model's {want.shape} for {target!r}")
            continue
        values[target] = _to_device(arr, want.dtype, None if mesh is None else param_sharding(family.logical_axes(target), arr.shape, mesh))
    missing = sorted(set(flat) - set(values))
    problems += [f"model parameter {t!r} is not in the checkpoint" for t in missing]
    if problems:
        raise ValueError("checkpoint does not fit the model:\n  " + "\n  ".join(problems))
    for key, var in nnx.to_flat_state(params):
        var.value = values[_path_str(key)]
    return nnx.merge(graphdef, params, family.buffers(cfg, rest))


class StackedRows:
    """A lazy `[n, ...]` stack of equally shaped host tensors (per-expert weights): slicing reads only
    the rows (and the part of each) the slice needs."""

    def __init__(self, rows: list[np.ndarray]) -> None:
        self.rows, self.shape, self.dtype = rows, (len(rows), *rows[0].shape), rows[0].dtype

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        first, rest = index[0], tuple(index[1:])
        return np.stack([np.asarray(self.rows[i][rest]) for i in range(len(self.rows))[first]])

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        out = self[tuple(slice(None) for _ in self.shape)]
        return out if dtype is None else out.astype(dtype, copy=False)


class ExpandedColumns:
    """A lazy view of a host tensor with its head columns laid out by an `Expansion` (-1 = zeros):
    slicing reads only the source entries the slice needs."""

    def __init__(self, source: np.ndarray, expansion: Expansion) -> None:
        self.source, (self.axis, index) = source, expansion
        self.index = np.asarray(index)
        self.shape = tuple(len(index) if a == self.axis else n for a, n in enumerate(source.shape))
        self.dtype = source.dtype

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        picks = self.index[index[self.axis]]
        keep = picks >= 0
        read = list(index)
        read[self.axis] = picks[keep]
        values = np.asarray(self.source[tuple(read)])
        placed = np.where(keep, np.cumsum(keep) - 1, -1)  # position of each pick among those read
        return expand(values, (self.axis, tuple(placed.tolist())))

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        out = self[tuple(slice(None) for _ in self.shape)]
        return out if dtype is None else out.astype(dtype, copy=False)


def _to_device(arr: np.ndarray, dtype: np.dtype, sharding: jax.sharding.Sharding | None) -> jax.Array:
    """One host tensor -> device; with a sharding, each device's slice is read and converted on its own."""
    if sharding is None:
        return jnp.asarray(np.asarray(arr, dtype=dtype))
    done: dict[str, np.ndarray] = {}  # data-parallel replicas ask for the same slice: read (de-quantize) it once

    def read(index: tuple[slice, ...]) -> np.ndarray:
        key = repr(index)
        if key not in done:
            done[key] = np.asarray(arr[index], dtype=dtype)
        return done[key]
    return jax.make_array_from_callback(arr.shape, sharding, read)


def load_model(path: str | None = None, *, dtype: str = "float32", mesh: Mesh | None = None
               ) -> tuple[CausalLM, ModelConfig]:
    """Load a HF directory or `.gguf` file (None = the embedded SmolLM2-135M-Instruct) as an NNX model.

    `mesh` (a ("data", "model") Mesh) places every parameter directly in its tensor-parallel layout.
    """
    ckpt = read_checkpoint(default_model_path() if path is None else path)
    model = model_from_hf_tensors(config_from_hf(ckpt.hf_config, dtype=dtype), ckpt.tensors, mesh=mesh)
    return model, model.config


def read_checkpoint(path: str) -> Checkpoint:
    """Read a Hugging Face directory (`config.json` + safetensors) or a `.gguf` file, validated."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint path does not exist: {path}")
    if os.path.isdir(path):
        ckpt = read_hf_dir(path)
    elif is_gguf(path):
        ckpt = read_gguf(path)
    else:
        raise ValueError(
            f"{path}: not a checkpoint; expected a Hugging Face directory (config.json + *.safetensors) "
            f"or a .gguf file")
    validate_tensors(ckpt.hf_config, ckpt.tensors, path)
    return ckpt
