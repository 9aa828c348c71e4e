"""Ready-made mappings.

- `identity()` (`mapping=None` or `"identity"`): the project's own model class on both sides,
  same paths, same layouts (any depth up to 12 components).
- `hf()` (`"hf"`): Hugging-Face names and PyTorch `[out, in]` layouts -> the engine's
  `LlamaForCausalLM` (`[in, out]` kernels, `.scale` norms, `embed_tokens` `[V, H]` unchanged,
  `lm_head.weight [V, H]` -> `lm_head.kernel [H, V]`). Rotary `inv_freq` buffers are dropped.
  Tied embeddings: HF's `state_dict()` of a tied model still lists `lm_head.weight` (the
  embedding under a second name); `hf()` drops it when the target has no `lm_head.kernel`.
  Shapes alone cannot prove it was tied on the trainer's side; `"hf-strict"` (`tied_lm_head=
  "error"`) reports it instead.
- `hf_fused()` (`"hf-fused"`): `hf()` plus a trainer with fused `self_attn.qkv_proj.weight`
  (`[q|k|v, H]`, concatenated on the output axis) and fused `mlp.gate_up_proj.weight`
  (`[gate|up, H]`), each split into the engine's separate kernels (sizes from the targets).
- `eagle3_hf()` (`"eagle3-hf"`): a draft head in the published EAGLE-3 layout -> the engine's head.
"""

from __future__ import annotations

from typing import Literal, Sequence

from weight_sync.rules import Rule, Split

MappingLike = str | Sequence[Rule] | None

_T = (1, 0)


def identity(max_depth: int = 12) -> tuple[Rule, ...]:
    """Every path maps to itself, unchanged."""
    return tuple(Rule(".".join("*" * d), ".".join("*" * d)) for d in range(1, max_depth + 1))


def hf(*, tied_lm_head: Literal["drop", "error"] = "drop") -> tuple[Rule, ...]:
    """Hugging-Face Llama/Qwen2/Qwen3 names -> the engine's LlamaForCausalLM."""
    L = "model.layers.*"
    return (
        Rule("model.rotary_emb.inv_freq", None),
        Rule(f"{L}.self_attn.rotary_emb.inv_freq", None),
        Rule("model.embed_tokens.weight", "embed_tokens"),
        Rule("model.norm.weight", "norm.scale"),
        Rule(f"{L}.input_layernorm.weight", "layers.*.input_layernorm.scale"),
        Rule(f"{L}.post_attention_layernorm.weight", "layers.*.post_attention_layernorm.scale"),
        Rule(f"{L}.self_attn.q_norm.weight", "layers.*.self_attn.q_norm.scale"),
        Rule(f"{L}.self_attn.k_norm.weight", "layers.*.self_attn.k_norm.scale"),
        Rule(f"{L}.self_attn.*.weight", "layers.*.self_attn.*.kernel", transpose=_T),
        Rule(f"{L}.self_attn.*.bias", "layers.*.self_attn.*.bias"),
        Rule(f"{L}.mlp.*.weight", "layers.*.mlp.*.kernel", transpose=_T),
        Rule(f"{L}.mlp.*.bias", "layers.*.mlp.*.bias"),
        Rule("lm_head.weight", "lm_head.kernel", transpose=_T, drop_if_target_missing=tied_lm_head == "drop"),
    )


def hf_fused() -> tuple[Rule, ...]:
    """`hf()` plus fused `qkv_proj` / `gate_up_proj` sources split into separate kernels."""
    L = "model.layers.*"
    return (
        Rule(f"{L}.self_attn.qkv_proj.weight",
             ("layers.*.self_attn.q_proj.kernel", "layers.*.self_attn.k_proj.kernel", "layers.*.self_attn.v_proj.kernel"),
             transpose=_T, split=Split(axis=1)),
        Rule(f"{L}.self_attn.qkv_proj.bias",
             ("layers.*.self_attn.q_proj.bias", "layers.*.self_attn.k_proj.bias", "layers.*.self_attn.v_proj.bias"),
             split=Split(axis=0)),
        Rule(f"{L}.mlp.gate_up_proj.weight", ("layers.*.mlp.gate_proj.kernel", "layers.*.mlp.up_proj.kernel"),
             transpose=_T, split=Split(axis=1)),
    ) + hf()


def eagle3_hf() -> tuple[Rule, ...]:
    """The published EAGLE-3 head layout (`fc.weight`, `midlayer.*`, `norm`, `lm_head`) -> the engine's
    `Eagle3Head`. The vocabulary maps `d2t`/`t2d` are structure, not weights: dropped (a head with
    another draft vocabulary needs a new engine)."""
    return (
        Rule("d2t", None),
        Rule("t2d", None),
        Rule("fc.weight", "fc.kernel", transpose=_T),
        Rule("midlayer.self_attn.*.weight", "midlayer.self_attn.*.kernel", transpose=_T),
        Rule("midlayer.mlp.*.weight", "midlayer.mlp.*.kernel", transpose=_T),
        Rule("midlayer.*.weight", "midlayer.*.scale"),
        Rule("norm.weight", "norm.scale"),
        Rule("lm_head.weight", "lm_head.kernel", transpose=_T),
        Rule("embed_tokens.weight", "embed_tokens"),
    )


_NAMED = {
    "identity": identity,
    "hf": hf,
    "hf-strict": lambda: hf(tied_lm_head="error"),
    "hf-fused": hf_fused,
    "eagle3-hf": eagle3_hf,
}


def resolve(mapping: MappingLike) -> tuple[Rule, ...]:
    """A preset name, None (identity) or a sequence of rules -> a tuple of rules."""
    if mapping is None:
        return identity()
    if isinstance(mapping, str):
        if mapping not in _NAMED:
            raise ValueError(f"unknown mapping preset {mapping!r}; known: {', '.join(_NAMED)}")
        return _NAMED[mapping]()
    rules = tuple(mapping)
    bad = [r for r in rules if not isinstance(r, Rule)]
    if bad:
        raise TypeError(f"a mapping is a sequence of weight_sync.Rule, got {type(bad[0]).__name__}")
    return rules
