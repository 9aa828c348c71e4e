"""Mapping rules: source path pattern(s) -> target path pattern(s) plus a layout transform.

A mapping is an ordered sequence of `Rule`s; the first rule matching a source path wins.
Patterns are dot-joined path components where `*` matches exactly one component (a layer
index, a projection name); the components captured by the `*`s of the source pattern
substitute, in order, into the `*`s of the target pattern(s).

A rule's transform runs in this fixed order:

    concat (several sources, along `concat`) -> transpose -> reshape -> split -> cast

- `concat`: the rule has several source patterns (all with the same `*` count); the matched
  sources (same captures) are concatenated along axis `concat` into one fused tensor; with
  `stack=True` they are stacked along a new axis `concat` instead (per-expert tensors -> one
  `[experts, ...]` tensor).
- `split`: the rule has several target patterns; the (transformed) source is cut along
  `split.axis` into pieces of `split.sizes` (or, when `sizes` is None, the sizes read from
  the targets' shapes along that axis), one per target, in order.
- `dtype`: the dtype the rule says its result has. The target's dtype always wins: when the
  rule names a dtype, it must equal the target's dtype (else the plan reports it); without
  one the result is cast to the target dtype. Casts between floating dtypes (both ways,
  e.g. float32 -> bfloat16) are allowed; anything else must be the same dtype or a safe
  integer widening (non-float into float is an error).
- `target=None`: the matched sources are deliberately dropped (e.g. rotary buffers).
- `drop_if_target_missing`: when the substituted target path is absent from the target,
  drop the source instead of reporting it (used for `lm_head.weight` into a tied model).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Split:
    """Cut one fused tensor along `axis` into pieces of `sizes` (None: the targets' sizes)."""

    axis: int
    sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.sizes is not None:
            object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
            if any(s <= 0 for s in self.sizes):
                raise ValueError(f"Split.sizes must be positive, got {self.sizes}")


@functools.lru_cache(maxsize=4096)
def _components(pattern: str) -> tuple[str, ...]:
    return tuple(pattern.split("."))


def match(pattern: str, path: str) -> tuple[str, ...] | None:
    """The components captured by `pattern`'s `*`s when it matches `path`, else None."""
    pc, xc = _components(pattern), _components(path)
    if len(pc) != len(xc):
        return None
    caps: list[str] = []
    for p, x in zip(pc, xc):
        if p == "*":
            caps.append(x)
        elif p != x:
            return None
    return tuple(caps)


def substitute(pattern: str, captures: tuple[str, ...]) -> str:
    """`pattern` with its `*`s replaced, in order, by `captures`."""
    it = iter(captures)
    return ".".join(next(it) if c == "*" else c for c in _components(pattern))


def _stars(pattern: str) -> int:
    return sum(c == "*" for c in _components(pattern))


@dataclasses.dataclass(frozen=True)
class Rule:
    """One mapping rule (see the module docstring for semantics and transform order)."""

    source: str | tuple[str, ...]
    target: str | tuple[str, ...] | None
    transpose: tuple[int, ...] | None = None
    reshape: tuple[int, ...] | None = None
    split: Split | None = None
    concat: int | None = None
    dtype: str | None = None
    drop_if_target_missing: bool = False
    stack: bool = False  # sources stacked along a new axis `concat` (not concatenated along an existing one)

    def __post_init__(self) -> None:
        srcs = (self.source,) if isinstance(self.source, str) else tuple(self.source)
        tgts = () if self.target is None else (self.target,) if isinstance(self.target, str) else tuple(self.target)
        object.__setattr__(self, "source", srcs[0] if len(srcs) == 1 else srcs)
        if self.target is not None:
            object.__setattr__(self, "target", tgts[0] if len(tgts) == 1 else tgts)
        if not srcs or any(not s or "" in _components(s) for s in srcs):
            raise ValueError(f"Rule source patterns must be non-empty dot paths, got {self.source!r}")
        if any(not t or "" in _components(t) for t in tgts):
            raise ValueError(f"Rule target patterns must be non-empty dot paths, got {self.target!r}")
        n = _stars(srcs[0])
        if any(_stars(s) != n for s in srcs):
            raise ValueError(f"Rule source patterns {srcs} must all have the same number of '*'")
        if any(_stars(t) > n for t in tgts):
            raise ValueError(f"Rule target {self.target!r} has more '*' than its source {self.source!r}")
        if len(srcs) > 1 and self.concat is None:
            raise ValueError(f"Rule with several sources {srcs} needs `concat=axis`")
        if len(srcs) == 1 and self.concat is not None and not self.stack:
            raise ValueError("`concat` needs several source patterns")
        if self.stack and self.concat is None:
            raise ValueError("`stack=True` needs `concat=axis` (the new axis)")
        if len(tgts) > 1 and self.split is None:
            raise ValueError(f"Rule with several targets {tgts} needs `split=Split(axis, sizes)`")
        if self.split is not None:
            if len(tgts) < 2:
                raise ValueError("`split` needs several target patterns")
            if self.split.sizes is not None and len(self.split.sizes) != len(tgts):
                raise ValueError(f"Split.sizes {self.split.sizes} must have one size per target {tgts}")
        if self.target is None and (self.transpose or self.reshape or self.split or self.concat is not None
                                    or self.dtype):
            raise ValueError("a dropping rule (target=None) takes no transform")
        if self.transpose is not None:
            perm = tuple(int(a) for a in self.transpose)
            object.__setattr__(self, "transpose", perm)
            if sorted(perm) != list(range(len(perm))):
                raise ValueError(f"transpose {perm} is not a permutation of 0..{len(perm) - 1}")
        if self.reshape is not None:
            shape = tuple(int(d) for d in self.reshape)
            object.__setattr__(self, "reshape", shape)
            if any(d == 0 or d < -1 for d in shape) or shape.count(-1) > 1:
                raise ValueError(f"reshape {shape} must be positive sizes with at most one -1")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", str(jnp.dtype(self.dtype)))

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source,) if isinstance(self.source, str) else tuple(self.source)

    @property
    def targets(self) -> tuple[str, ...]:
        if self.target is None:
            return ()
        return (self.target,) if isinstance(self.target, str) else tuple(self.target)

    def match(self, path: str) -> tuple[int, tuple[str, ...]] | None:
        """(index of the matching source pattern, captures), or None."""
        for i, pat in enumerate(self.sources):
            caps = match(pat, path)
            if caps is not None:
                return i, caps
        return None
