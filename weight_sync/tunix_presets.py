"""Mappings from Tunix's own model classes (`tunix.models.llama3`, `qwen2`, `qwen3`, `gemma3`, as of
google-tunix 0.1.7) to the engine's model: Tunix names (`embedder.input_embedding`, `layers.i.attn.q_proj.w`,
`final_norm.w`) and its einsum-shaped attention kernels (`[embed, heads, head_dim]` for q/k/v,
`[heads, head_dim, embed]` for o; Gemma 3's fused `qkv_einsum [3, heads, embed, head_dim]` or
`q_einsum [heads, embed, head_dim]` + `kv_einsum [2, kv_heads, embed, head_dim]`) -> the engine's
`[in, out]` kernels. Plain data, like every preset;
the attention reshapes need the model's sizes, so each preset is a function of them.

    rules = weight_sync.tunix_presets.tunix_rules("qwen3", TunixShapes(hidden, heads, kv_heads, head_dim))
    engine.sync_weights(nnx.state(tunix_model, nnx.Param), mapping=rules)
"""

from __future__ import annotations

import dataclasses

from weight_sync.rules import Rule, Split


@dataclasses.dataclass(frozen=True)
class TunixShapes:
    """The sizes the attention reshapes need."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if any(not isinstance(v, int) or v < 1 for v in dataclasses.astuple(self)):
            raise ValueError(f"TunixShapes takes positive integers, got {self}")


TUNIX_FAMILIES = ("llama3", "qwen2", "qwen3", "gemma3")


def tunix_rules(family: str, shapes: TunixShapes) -> tuple[Rule, ...]:
    """Tunix's `family` model (one of `TUNIX_FAMILIES`) -> the engine's model of the same family.

    Tunix's MoE layers (Qwen3-MoE: `mlp.router.kernel [in, E]`, `mlp.gate_proj [E, in, out]`) map onto the
    engine's router and stacked experts; dense MLPs keep their names. A tied model has no `lm_head.w`."""
    if family not in TUNIX_FAMILIES:
        raise ValueError(f"no Tunix mapping for family {family!r}; known: {', '.join(TUNIX_FAMILIES)}")
    h, q_width, kv_width = shapes.hidden_size, shapes.num_heads * shapes.head_dim, shapes.num_kv_heads * shapes.head_dim
    if family == "gemma3":
        return _gemma3_rules(h, q_width, kv_width)
    attn = "layers.*.attn"
    rules: list[Rule] = []  # the first matching rule wins: family-specific names first
    if family == "qwen3":
        rules += [Rule(f"{attn}.q_norm.w", "layers.*.self_attn.q_norm.scale"),
                  Rule(f"{attn}.k_norm.w", "layers.*.self_attn.k_norm.scale"),
                  Rule("layers.*.mlp.router.kernel", "layers.*.mlp.gate.kernel"),
                  Rule("layers.*.mlp.*", "layers.*.mlp.experts.*.kernel")]  # [E, in, out] both sides
    if family == "qwen2":
        rules += [Rule(f"{attn}.{p}_bias", f"layers.*.self_attn.{p}_proj.bias") for p in "qkv"]
    rules += [
        Rule("embedder.input_embedding", "embed_tokens"),
        Rule(f"{attn}.q_proj.w", "layers.*.self_attn.q_proj.kernel", reshape=(h, q_width)),
        Rule(f"{attn}.k_proj.w", "layers.*.self_attn.k_proj.kernel", reshape=(h, kv_width)),
        Rule(f"{attn}.v_proj.w", "layers.*.self_attn.v_proj.kernel", reshape=(h, kv_width)),
        Rule(f"{attn}.o_proj.w", "layers.*.self_attn.o_proj.kernel", reshape=(q_width, h)),
        Rule("layers.*.mlp.*.kernel", "layers.*.mlp.*.kernel"),  # dense gate/up/down: [in, out] both sides
        Rule("layers.*.input_layernorm.w", "layers.*.input_layernorm.scale"),
        Rule("layers.*.post_attention_layernorm.w", "layers.*.post_attention_layernorm.scale"),
        Rule("final_norm.w", "norm.scale"),
        Rule("lm_head.w", "lm_head.kernel"),
    ]
    return tuple(rules)


def _gemma3_rules(h: int, q_width: int, kv_width: int) -> tuple[Rule, ...]:
    """Tunix's `Gemma3` (text) -> the engine's Gemma 3: einsum attention, (1 + w) norms on both sides."""
    attn, ours = "layers.*.attn", "layers.*.self_attn"
    qkv = tuple(f"{ours}.{p}_proj.kernel" for p in "qkv")
    return (
        Rule("embedder.input_embedding", "embed_tokens"),
        Rule(f"{attn}.qkv_einsum.w", qkv, transpose=(2, 0, 1, 3), reshape=(h, q_width + 2 * kv_width),
             split=Split(1, (q_width, kv_width, kv_width))),
        Rule(f"{attn}.q_einsum.w", f"{ours}.q_proj.kernel", transpose=(1, 0, 2), reshape=(h, q_width)),
        Rule(f"{attn}.kv_einsum.w", qkv[1:], transpose=(2, 0, 1, 3), reshape=(h, 2 * kv_width),
             split=Split(1, (kv_width, kv_width))),
        Rule(f"{attn}.attn_vec_einsum.w", f"{ours}.o_proj.kernel", reshape=(q_width, h)),
        Rule(f"{attn}._query_norm.scale", f"{ours}.q_norm.scale"),
        Rule(f"{attn}._key_norm.scale", f"{ours}.k_norm.scale"),
        Rule("layers.*.pre_attention_norm.scale", "layers.*.input_layernorm.scale"),
        Rule("layers.*.post_attention_norm.scale", "layers.*.post_attention_layernorm.scale"),
        Rule("layers.*.pre_ffw_norm.scale", "layers.*.pre_feedforward_layernorm.scale"),
        Rule("layers.*.post_ffw_norm.scale", "layers.*.post_feedforward_layernorm.scale"),
        Rule("layers.*.mlp.*.kernel", "layers.*.mlp.*.kernel"),
        Rule("final_norm.scale", "norm.scale"),
    )
