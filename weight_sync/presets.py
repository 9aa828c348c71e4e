"""Ready-made mappings.

- `identity()` (`mapping=None` or `"identity"`): the project's own model class on both sides,
  same paths, same layouts (any depth up to 12 components).
- `"hf"`, `"hf-strict"`, `"hf-fused"`: registered by each model family from its one name table
  (`runner/models/family.py: ModelFamily.sync_rules`; importing `runner.models.registry` registers the
  default Llama family's): Hugging-Face names and PyTorch `[out, in]` layouts -> the engine's model
  (`[in, out]` kernels, `.scale` norms, `lm_head.weight [V, H]` -> `lm_head.kernel [H, V]`), rotary
  `inv_freq` buffers dropped. A tied model's `state_dict()` still lists `lm_head.weight`: "hf" drops
  it when the target has no `lm_head.kernel`, "hf-strict" reports it; "hf-fused" also splits fused
  `self_attn.qkv_proj` (`[q|k|v, H]`) and `mlp.gate_up_proj` (`[gate|up, H]`) sources.
- `eagle3_hf()` (`"eagle3-hf"`): a draft head in the published EAGLE-3 layout -> the engine's head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Sequence

from weight_sync.rules import Rule

MappingLike = str | Sequence[Rule] | None

_T = (1, 0)


def identity(max_depth: int = 12) -> tuple[Rule, ...]:
    """Every path maps to itself, unchanged."""
    return tuple(Rule(".".join("*" * d), ".".join("*" * d)) for d in range(1, max_depth + 1))


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


_NAMED: dict[str, Callable[[], tuple[Rule, ...]]] = {
    "identity": identity,
    "eagle3-hf": eagle3_hf,
}
FAMILY_PRESETS = ("hf", "hf-strict", "hf-fused")  # registered by `runner.models.registry` from a name table


def register(name: str, rules: Callable[[], tuple[Rule, ...]]) -> None:
    """Make `rules()` available as the preset `name` (model families register their name tables)."""
    _NAMED[name] = rules


def resolve(mapping: MappingLike) -> tuple[Rule, ...]:
    """A preset name, None (identity) or a sequence of rules -> a tuple of rules."""
    if mapping is None:
        return identity()
    if isinstance(mapping, str):
        if mapping not in _NAMED:
            hint = (f"; {mapping!r} comes from a model family's name table: import runner.models.registry (the "
                    "engine does) or pass family.sync_rules()" if mapping in FAMILY_PRESETS else "")
            raise ValueError(f"unknown mapping preset {mapping!r}; known: {', '.join(_NAMED)}{hint}")
        return _NAMED[mapping]()
    rules = tuple(mapping)
    bad = [r for r in rules if not isinstance(r, Rule)]
    if bad:
        raise TypeError(f"a mapping is a sequence of weight_sync.Rule, got {type(bad[0]).__name__}")
    return rules
