"""Row sums in one fixed order: the norms' mean square and the log-sum-exp of every raw logprob.

XLA:CPU picks a reduction's order from the whole shape: `jnp.mean(x * x, axis=-1)` over `[B, 576]`
(RMSNorm's) gives row 0 the same bits for B = 1..7 and different ones from B = 8 on, where it vectorises
across rows, and a 128-token vocabulary's log-sum-exp changed in the last bit with the sampler's batch
(docs/engineering-notes.md). Here a row's slices are added in turn (chunks of `width` columns, then
16-wide slices of the folded chunk) and the 16 lanes then halved by slice adds: elementwise adds only,
which XLA does not reassociate, so a row's sum depends only on its own values and length, never on the
other rows (and at B = 64 RMSNorm's is faster than XLA's reduce: 20 vs 32 us).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

LANES = 16
MAX_SLICES = 128  # slices folded per level: bounds the number of adds in the program


def _fold(x: Float[Array, "... D"], width: int) -> Float[Array, "... W"]:
    """Add the `width`-column slices of the last axis in turn (zero-padded to a multiple of `width`)."""
    d = x.shape[-1]
    if d % width:  # zeros add nothing
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - d % width)])
    acc = x[..., :width]
    for start in range(width, x.shape[-1], width):
        acc = acc + x[..., start:start + width]
    return acc


def fixed_order_sum(x: Float[Array, "... D"]) -> Float[Array, "... 1"]:
    """The sum over the last axis, in an order that depends only on D."""
    width = LANES
    while x.shape[-1] > width * MAX_SLICES:
        width *= 2
    acc = _fold(_fold(x, width), LANES) if width > LANES else _fold(x, LANES)
    while width := acc.shape[-1] // 2:
        acc = acc[..., :width] + acc[..., width:2 * width]
    return acc


def mean_square(h: Float[Array, "... D"], fixed_order: bool) -> Float[Array, "... 1"]:
    """`mean(h * h)` over the last axis: XLA's reduce, or with `fixed_order` `fixed_order_sum`'s."""
    if fixed_order:
        return fixed_order_sum(h * h) / h.shape[-1]
    return jnp.mean(h * h, axis=-1, keepdims=True)


def logsumexp(x: Float[Array, "... V"]) -> Float[Array, "..."]:
    """`log(sum(exp(x)))` over the last axis with the sum in a fixed order (`fixed_order_sum`); a row
    of -inf gives -inf."""
    row_max = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    shift = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    return (shift + jnp.log(fixed_order_sum(jnp.exp(x - shift))))[..., 0]


def log_softmax(x: Float[Array, "... V"]) -> Float[Array, "... V"]:
    """`x - logsumexp(x)` (this module's, so each row's bits ignore the other rows)."""
    return x - logsumexp(x)[..., None]
