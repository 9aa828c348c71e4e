"""How the engine stores attention heads for a tensor-parallel axis: whole heads on every device.

Tensor parallelism splits query heads and KV heads over the `model` axis. When the axis does not
divide a checkpoint's head counts (SmolLM2: 9 query / 3 KV heads on 4 devices), the engine stores
an equivalent model instead:

- KV heads are *replicated* when the axis is a multiple of their count (2 KV heads on 4 devices:
  each stored twice, each copy serving half of the group's query heads), as vLLM does;
- otherwise KV heads are *padded* with zero-weight heads up to a multiple of the axis, and each
  group's query heads padded with zero-weight heads to a common size (9 / 3 -> 12 / 4).

A zero query head attends to zero keys and values and its `o_proj` rows are zero, so it adds
exactly 0 to the output: the stored model computes the same function. `HeadLayout` is the map
stored head -> checkpoint head (-1 = zero weights); `expansions()` turns it into column indexes of
the q/k/v/o parameters, which the loader reads slice by slice and `sync_weights` applies to a
trainer's (checkpoint-layout) tensors.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Shaped

# (parameter path pattern, axis of the head columns, which heads): the parameters a layout expands
EXPANDED_PARAMS: tuple[tuple[str, int, str], ...] = (
    (r"layers\.\d+\.self_attn\.q_proj\.kernel", 1, "q"),
    (r"layers\.\d+\.self_attn\.q_proj\.bias", 0, "q"),
    (r"layers\.\d+\.self_attn\.(k_proj|v_proj)\.kernel", 1, "kv"),
    (r"layers\.\d+\.self_attn\.(k_proj|v_proj)\.bias", 0, "kv"),
    (r"layers\.\d+\.self_attn\.o_proj\.kernel", 0, "q"),
)
Expansion = tuple[int, tuple[int, ...]]  # (axis, source column of every stored column; -1 = zero)


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Stored heads -> checkpoint heads (-1 = a zero-weight head)."""

    head_dim: int
    num_source_heads: int  # the checkpoint's query heads
    num_source_kv_heads: int  # the checkpoint's KV heads
    q_heads: tuple[int, ...]  # [stored query heads] checkpoint query head, or -1
    kv_heads: tuple[int, ...]  # [stored KV heads] checkpoint KV head, or -1

    def __post_init__(self) -> None:
        if not self.kv_heads or len(self.q_heads) % len(self.kv_heads):
            raise ValueError(f"{len(self.q_heads)} stored query heads do not group over {len(self.kv_heads)} KV heads")
        group, stored_group = self.num_source_heads // self.num_source_kv_heads, len(self.q_heads) // len(self.kv_heads)
        for i, src in enumerate(self.q_heads):
            kv = self.kv_heads[i // stored_group]
            if src >= 0 and (kv < 0 or src // group != kv):
                raise ValueError(f"stored query head {i} (checkpoint head {src}) would read KV head {kv}, "
                                 f"not its own group's {src // group}")
        used = sorted(h for h in self.q_heads if h >= 0)
        if used != list(range(self.num_source_heads)):
            raise ValueError("every checkpoint query head must be stored exactly once")

    @classmethod
    def for_axis(cls, num_heads: int, num_kv_heads: int, head_dim: int, model_axis: int) -> HeadLayout:
        """The layout giving each of `model_axis` devices whole heads (identity when they divide)."""
        group = num_heads // num_kv_heads
        if num_kv_heads % model_axis == 0 and num_heads % model_axis == 0:
            copies = 1
        elif model_axis % num_kv_heads == 0:
            copies = model_axis // num_kv_heads  # replicate each KV head
        else:
            copies = 1
        num_stored_kv = math.ceil(num_kv_heads * copies / model_axis) * model_axis
        stored_group = math.ceil(group / copies)
        q_heads: list[int] = []
        kv_heads: list[int] = []
        for j in range(num_stored_kv):
            source, copy = divmod(j, copies)
            real = source < num_kv_heads
            kv_heads.append(source if real else -1)
            for t in range(stored_group):
                member = copy * stored_group + t
                q_heads.append(source * group + member if real and member < group else -1)
        return cls(head_dim, num_heads, num_kv_heads, tuple(q_heads), tuple(kv_heads))

    @property
    def is_identity(self) -> bool:
        return (self.q_heads == tuple(range(self.num_source_heads))
                and self.kv_heads == tuple(range(self.num_source_kv_heads)))

    def then(self, inner: HeadLayout) -> HeadLayout:
        """`inner` applied to a model already stored in this layout, as one layout from the checkpoint."""
        return HeadLayout(self.head_dim, self.num_source_heads, self.num_source_kv_heads,
                          tuple(self.q_heads[h] if h >= 0 else -1 for h in inner.q_heads),
                          tuple(self.kv_heads[h] if h >= 0 else -1 for h in inner.kv_heads))

    def columns(self, heads: str) -> tuple[int, ...]:
        """Source column of every stored column of a `heads` ("q" | "kv") projection (-1 = zero)."""
        d = self.head_dim
        return tuple(h * d + i if h >= 0 else -1 for h in (self.q_heads if heads == "q" else self.kv_heads)
                     for i in range(d))

    def expansion(self, path: str) -> Expansion | None:
        """How the parameter at `path` is expanded, or None when the layout leaves it as is."""
        for pattern, axis, heads in EXPANDED_PARAMS:
            if re.fullmatch(pattern, path):
                return axis, self.columns(heads)
        return None


def expand(x: Shaped[Array, "..."] | Shaped[np.ndarray, "..."], expansion: Expansion,
           ) -> Shaped[Array, "..."] | Shaped[np.ndarray, "..."]:
    """`x` with its head columns laid out by `expansion` (zeros where the index is -1); numpy in,
    numpy out, otherwise jax."""
    axis, index = expansion
    xp = np if isinstance(x, np.ndarray) else jnp
    idx = np.asarray(index)
    if not (idx >= 0).any():  # nothing to take (e.g. a padded device's slice; `x` may be empty there)
        return xp.zeros([len(idx) if a == axis % x.ndim else n for a, n in enumerate(x.shape)], x.dtype)
    taken = xp.take(x, np.maximum(idx, 0), axis=axis)
    mask = (idx >= 0).reshape([-1 if a == axis % x.ndim else 1 for a in range(x.ndim)])
    return xp.where(mask, taken, xp.zeros((), x.dtype))
