"""What a model family declares, in one place (`ModelFamily`), and the `CausalLM` protocol the engine,
runner and step programs name instead of any family's class.

A family's one name table (`NameEntry` rows: Hugging Face name, engine parameter path, GGUF name)
serves the checkpoint loader, GGUF renaming and `sync_weights(mapping="hf")`; its sharding rules map
parameter paths to logical axes; its attention spec gives each layer's scale, window and soft-cap.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Protocol

from flax import nnx
from jaxtyping import Array, Float, Int

from runner.attention import AttentionMetadata
from runner.kv_cache import KVCaches
from runner.models.config import ModelConfig
from weight_sync.rules import Rule, Split, match, substitute

ShardingRules = tuple[tuple[str, tuple[str | None, ...]], ...]  # (regex over the dotted path, logical axes)
_T = (1, 0)


class CausalLM(Protocol):
    """A decoder the trainer and the engine share: the same layers compute both forwards."""

    config: ModelConfig

    def __call__(self, input_ids: Int[Array, "B S"], positions: Int[Array, "B S"],
                 attention_mask: Int[Array, "B S"] | None = None) -> Float[Array, "B S V"]:
        """The trainer's full-sequence causal forward: float32 logits at every position."""

    def forward_paged(self, token_ids: Int[Array, "T"], positions: Int[Array, "T"], kv_caches: KVCaches,
                      md: AttentionMetadata, aux_layers: tuple[int, ...] = ()
                      ) -> tuple[Float[Array, "T H"], KVCaches, Float[Array, "T A"]]:
        """One engine step over packed tokens: final hidden states, new caches, aux-layer inputs."""

    def compute_logits(self, hidden: Float[Array, "... H"]) -> Float[Array, "... V"]:
        """Final-norm'd hidden states -> float32 logits."""


class DraftTarget(CausalLM, Protocol):
    """A `CausalLM` an EAGLE-3 head can draft for: it exposes its embedding, its output rows and the
    residual stream entering chosen layers."""

    def embed(self, input_ids: Int[Array, "..."]) -> Float[Array, "... H"]:
        """Token embeddings in the compute dtype."""

    def output_rows(self) -> Float[Array, "V H"]:
        """The output projection as one row per token id."""

    def hidden_states_with_aux(self, input_ids: Int[Array, "B S"], positions: Int[Array, "B S"],
                               attention_mask: Int[Array, "B S"] | None = None, aux_layers: tuple[int, ...] = ()
                               ) -> tuple[Float[Array, "B S H"], Float[Array, "B S A"]]:
        """Final-norm'd hidden states and the concatenated inputs of `aux_layers`."""


@dataclasses.dataclass(frozen=True)
class NameEntry:
    """One parameter's names. Patterns are dot paths where `*` is one component (the layer index)."""

    hf: str  # Hugging Face tensor name, PyTorch layout (`[out, in]` weights)
    path: str  # the engine's parameter path (Flax `[in, out]` kernels)
    transpose: bool = False  # `[out, in]` -> `[in, out]`
    gguf: str | None = None  # llama.cpp's name (`blk.*.attn_q.weight`); None: GGUF files do not carry it
    # the HF name's last `*` is the index along the parameter's leading axis (per-expert tensors stacked
    # into one `[experts, in, out]` parameter); `path` has one `*` fewer
    stacked: bool = False


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """How one layer attends."""

    scale: float  # multiplies q . k
    sliding_window: int | None = None  # attend to at most this many most recent positions
    logit_soft_cap: float | None = None  # scores -> cap * tanh(scores / cap)

    @classmethod
    def of_layer(cls, cfg: ModelConfig, layer: int) -> "AttentionSpec":
        """Layer `layer`'s spec from the config fields a family sets (`ModelFamily.config_fields`): scale
        `query_pre_attn_scalar ** -0.5` (Gemma) else `head_dim ** -0.5`, a window on `sliding_layers`,
        `attn_logit_softcap`."""
        return cls(scale=(cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5,
                   sliding_window=cfg.sliding_window if layer in cfg.sliding_layers else None,
                   logit_soft_cap=cfg.attn_logit_softcap)


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """Everything the engine knows about one family of architectures."""

    name: str  # ModelConfig.family, and the GGUF `general.architecture`
    architectures: tuple[str, ...]  # HF `architectures` entries (the registry's keys)
    module: Callable[..., CausalLM]  # `module(cfg, rngs=...)` builds the model
    names: tuple[NameEntry, ...]
    sharding_rules: ShardingRules  # first match wins; the last rule should catch every path
    config_fields: Callable[[Mapping[str, object]], dict[str, object]]  # family-specific ModelConfig fields
    buffers: Callable[[ModelConfig, nnx.State], nnx.State]  # non-parameter state (rotary tables) of a model
    ignored_hf: tuple[str, ...] = ()  # HF buffers some checkpoints carry that are recomputed, never loaded
    gguf_permuted: Mapping[str, str] = dataclasses.field(default_factory=dict)  # GGUF name -> head-count field

    def map_hf_name(self, name: str) -> tuple[str, bool, int | None] | None:
        """The engine path, transpose flag and (stacked rows) index along the parameter's leading axis of
        one HF tensor name, or None when no row matches."""
        for entry in self.names:
            caps = match(entry.hf, name)
            if caps is not None:
                if entry.stacked:
                    return substitute(entry.path, caps[:-1]), entry.transpose, int(caps[-1])
                return substitute(entry.path, caps), entry.transpose, None
        return None

    def hf_name(self, path: str, index: int | None = None) -> str:
        """The HF tensor name of one engine parameter path (the name table read backwards); `index`:
        the entry of a stacked parameter's leading axis."""
        for entry in self.names:
            caps = match(entry.path, path)
            if caps is not None and entry.stacked == (index is not None):
                return substitute(entry.hf, caps + ((str(index),) if entry.stacked else ()))
        raise KeyError(f"no {self.name} name-table row maps to {path!r}" + ("" if index is None else f"[{index}]"))

    def is_ignored(self, name: str) -> bool:
        return any(match(p, name) is not None for p in self.ignored_hf)

    def sync_rules(self, preset: str = "hf", num_experts: int = 0) -> tuple[Rule, ...]:
        """`weight_sync` rules from the name table: "hf" (a tied model's `lm_head.weight` dropped),
        "hf-strict" (reported instead), "hf-fused" (also fused `qkv_proj` / `gate_up_proj` sources).
        Stacked rows take the `num_experts` per-expert tensors of each layer, stacked."""
        if preset not in ("hf", "hf-strict", "hf-fused"):
            raise ValueError(f"unknown family preset {preset!r}; choose 'hf', 'hf-strict' or 'hf-fused'")
        rules = [Rule(p, None) for p in self.ignored_hf]
        for e in self.names:
            if e.stacked:
                if num_experts > 0:  # the last `*` is the expert: one source pattern per expert
                    head, _, tail = e.hf.rpartition("*")
                    rules.append(Rule(tuple(f"{head}{x}{tail}" for x in range(num_experts)), e.path,
                                      transpose=(0, 2, 1) if e.transpose else None, concat=0, stack=True))
                continue
            rules.append(Rule(e.hf, e.path, transpose=_T if e.transpose else None,
                              drop_if_target_missing=e.hf == "lm_head.weight" and preset != "hf-strict"))
        if preset == "hf-fused":
            rules = list(self._fused_rules()) + rules
        return tuple(rules)

    def _fused_rules(self) -> tuple[Rule, ...]:
        """Fused trainer tensors (`[q|k|v, H]`, `[gate|up, H]`) split into the engine's kernels."""
        path = {e.hf: e.path for e in self.names}
        layer = "model.layers.*"
        qkv = [f"{layer}.self_attn.{p}_proj" for p in "qkv"]
        rules = []
        if all(f"{n}.weight" in path for n in qkv):
            rules.append(Rule(f"{layer}.self_attn.qkv_proj.weight", tuple(path[f"{n}.weight"] for n in qkv),
                              transpose=_T, split=Split(axis=1)))
        if all(f"{n}.bias" in path for n in qkv):
            rules.append(Rule(f"{layer}.self_attn.qkv_proj.bias", tuple(path[f"{n}.bias"] for n in qkv),
                              split=Split(axis=0)))
        gate_up = [f"{layer}.mlp.{p}_proj.weight" for p in ("gate", "up")]
        if all(n in path for n in gate_up):
            rules.append(Rule(f"{layer}.mlp.gate_up_proj.weight", tuple(path[n] for n in gate_up), transpose=_T,
                              split=Split(axis=1)))
        return tuple(rules)

    def logical_axes(self, path: str) -> tuple[str | None, ...]:
        """The logical axes of one parameter path (`sharding_rules`)."""
        for pattern, logical in self.sharding_rules:
            if re.fullmatch(pattern, path):
                return logical
        return ()

