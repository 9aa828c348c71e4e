"""EAGLE-3 heads on disk: the published Hugging Face layout <-> `Eagle3Head`, and fresh heads.

The layout (vLLM / SpecForge / the EAGLE authors' `LlamaForCausalLMEagle3`): `config.json`, and
safetensors tensors `fc.weight [H, 3H]`, `midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v read 2H),
`midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, optionally `lm_head.weight
[draft_vocab, H]` with `d2t [draft_vocab]` (int64 offsets) and `t2d [vocab]` (bool), and
`embed_tokens.weight` when the head does not share the target's embedding. A `model.` prefix is
accepted. The name mapping is a table; unmatched, duplicate, missing and mis-shaped tensors fail
loudly, all listed in one error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from runner.models.checkpoint import read_hf_dir
from runner.models.config import ModelConfig
from runner.models.family import DraftTarget
from runner.models.loader import NameRule, map_hf_name
from runner.spec_decode.eagle3 import Eagle3Head, Eagle3HeadConfig, vocab_maps

EAGLE3_RULES: tuple[NameRule, ...] = (
    NameRule(r"fc\.weight", "fc.kernel", transpose=True),
    NameRule(r"midlayer\.(input_layernorm|hidden_norm|post_attention_layernorm)\.weight", "midlayer.{0}.scale"),
    NameRule(r"midlayer\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", "midlayer.self_attn.{0}.kernel",
             transpose=True),
    NameRule(r"midlayer\.mlp\.(gate_proj|up_proj|down_proj)\.weight", "midlayer.mlp.{0}.kernel", transpose=True),
    NameRule(r"norm\.weight", "norm.scale"),
    NameRule(r"lm_head\.weight", "lm_head.kernel", transpose=True),
    NameRule(r"embed_tokens\.weight", "embed_tokens"),
)
VOCAB_MAPS = ("d2t", "t2d")


def _path(key: tuple) -> str:
    return ".".join(str(k) for k in key)


def load_eagle3_head(path: str, target: ModelConfig, *, aux_layer_ids: tuple[int, ...] | None = None
                     ) -> Eagle3Head:
    """Read a head saved in the published layout, checked against the target it drafts for."""
    ckpt = read_hf_dir(path)
    tensors = {n.removeprefix("model."): a for n, a in ckpt.tensors.items()}
    cfg = Eagle3HeadConfig.from_hf_dict(ckpt.hf_config, has_lm_head="lm_head.weight" in tensors,
                                        has_embedding="embed_tokens.weight" in tensors,
                                        num_target_layers=target.num_hidden_layers, dtype=target.dtype)
    if aux_layer_ids is not None:
        cfg = dataclasses.replace(cfg, aux_layer_ids=tuple(aux_layer_ids))
    problems = _check_target(cfg, target)
    abstract = nnx.eval_shape(lambda: Eagle3Head(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    flat = {_path(k): v for k, v in nnx.to_flat_state(params)}
    values: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        if name in VOCAB_MAPS:
            continue
        mapped = map_hf_name(name, EAGLE3_RULES)
        if mapped is None:
            problems.append(f"tensor {name!r} matches no EAGLE-3 rule")
            continue
        key, transpose = mapped
        if key in values:
            problems.append(f"two tensors map to {key!r}")
            continue
        arr = np.asarray(array.T if transpose else array)
        if key not in flat:
            problems.append(f"tensor {name!r} -> {key!r}, which this head config does not have")
        elif arr.shape != flat[key].value.shape:
            problems.append(f"{name!r}: shape {arr.shape} (after layout change) != {flat[key].value.shape} for {key!r}")
        else:
            values[key] = arr
    problems += [f"head parameter {k!r} is not in the checkpoint" for k in sorted(set(flat) - set(values))]
    d2t = _read_d2t(tensors, cfg, problems)
    if problems:
        raise ValueError(f"{path}: EAGLE-3 checkpoint does not fit:\n  " + "\n  ".join(problems))
    for key, var in nnx.to_flat_state(params):
        var.value = jnp.asarray(values[_path(key)], jnp.dtype(cfg.dtype))
    head = nnx.merge(graphdef, params, _fresh_rest(cfg, rest))
    head.d2t.value = jnp.asarray(d2t, jnp.int32)
    return head


def _check_target(cfg: Eagle3HeadConfig, target: ModelConfig) -> list[str]:
    problems = []
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"the head's vocab_size {cfg.vocab_size} != the target's {target.vocab_size}")
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(f"the head reads target hidden size {cfg.target_hidden_size}, the target has {target.hidden_size}")
    if (cfg.hidden_size != target.hidden_size) and not (cfg.has_lm_head and cfg.has_embedding):
        problems.append(f"a head of hidden size {cfg.hidden_size} cannot share the target's embedding/lm_head "
                        f"of width {target.hidden_size}")
    bad = [i for i in cfg.aux_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        problems.append(f"aux layer ids {bad} are outside the target's {target.num_hidden_layers} layers")
    return problems


def _read_d2t(tensors: dict[str, np.ndarray], cfg: Eagle3HeadConfig, problems: list[str]) -> np.ndarray:
    if "d2t" not in tensors:
        if cfg.draft_vocab_size != cfg.vocab_size:
            problems.append(f"draft_vocab_size {cfg.draft_vocab_size} < vocab_size needs a 'd2t' tensor")
        return np.zeros(cfg.draft_vocab_size, np.int64)
    d2t = np.asarray(tensors["d2t"]).astype(np.int64)
    if d2t.shape != (cfg.draft_vocab_size,):
        problems.append(f"'d2t' has shape {d2t.shape}, expected ({cfg.draft_vocab_size},)")
        return np.zeros(cfg.draft_vocab_size, np.int64)
    ids = d2t + np.arange(len(d2t))
    if ids.min() < 0 or ids.max() >= cfg.vocab_size or len(np.unique(ids)) != len(ids):
        problems.append("'d2t' maps draft ids to repeated or out-of-vocabulary target ids")
    elif "t2d" in tensors and not np.array_equal(np.asarray(tensors["t2d"]).astype(bool), vocab_maps(ids, cfg.vocab_size)[1]):
        problems.append("'t2d' disagrees with 'd2t'")
    return d2t


def _fresh_rest(cfg: Eagle3HeadConfig, rest: nnx.State) -> nnx.State:
    """Non-parameter state of a head built abstractly: rotary buffers computed, d2t zero."""
    real = Eagle3Head(cfg, rngs=nnx.Rngs(0))
    return nnx.split(real, nnx.Param, ...)[2]


def save_eagle3_head(head: Eagle3Head, path: str) -> None:
    """Write `head` in the published layout (`config.json` + `model.safetensors`)."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    cfg = head.config
    params = nnx.split(head, nnx.Param, ...)[1]
    by_target = {_path(k): np.asarray(v.value) for k, v in nnx.to_flat_state(params)}
    tensors: dict[str, np.ndarray] = {}
    for key, arr in by_target.items():
        name = re.sub(r"\.(kernel|scale)$", ".weight", key) if key != "embed_tokens" else "embed_tokens.weight"
        assert map_hf_name(name, EAGLE3_RULES) == (key, key.endswith(".kernel")), f"{key} has no published name"
        tensors[name] = np.ascontiguousarray((arr.T if key.endswith(".kernel") else arr).astype(np.float32))
    if cfg.has_lm_head:
        d2t = np.asarray(head.d2t[...], np.int64)
        tensors["d2t"] = d2t
        tensors["t2d"] = vocab_maps(d2t + np.arange(len(d2t)), cfg.vocab_size)[1]
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)


def init_eagle3_head(target: DraftTarget, *, draft_vocab_ids: np.ndarray | None = None,
                     aux_layer_ids: tuple[int, ...] | None = None, seed: int = 0) -> Eagle3Head:
    """A fresh head for `target`: random layer; with `draft_vocab_ids` (target ids, most useful first)
    its own lm_head starts as the target's output rows of those ids, else it shares the target's."""
    cfg = Eagle3HeadConfig.for_target(target.config, aux_layer_ids=aux_layer_ids,
                                      draft_vocab_size=None if draft_vocab_ids is None else len(draft_vocab_ids))
    head = Eagle3Head(cfg, rngs=nnx.Rngs(seed))
    if draft_vocab_ids is not None:
        ids = np.asarray(draft_vocab_ids, np.int64)
        d2t, _ = vocab_maps(ids, cfg.vocab_size)
        head.lm_head.kernel.value = jnp.asarray(target.output_rows())[ids].T.astype(head.lm_head.kernel.value.dtype)
        head.d2t.value = jnp.asarray(d2t, jnp.int32)
    # Start from the target's view: fc passes the highest aux layer's features through unchanged and
    # the head's norm is the target's final norm, so its lm_head reads the kind of features it expects.
    h = cfg.hidden_size
    fc = np.asarray(head.fc.kernel[...]).copy()
    fc[2 * h:] += np.eye(h, dtype=fc.dtype)
    head.fc.kernel.value = jnp.asarray(fc)
    head.norm.scale.value = jnp.array(target.norm.scale[...], copy=True)
    return head
