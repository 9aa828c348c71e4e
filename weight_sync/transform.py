"""Run a `Transform`: on the host with numpy, or as a small cached jitted function on devices.

Jitted functions are cached by (transform, output sharding) — the transform includes the target
dtype, and jax's own cache keys on the input shapes/dtypes/shardings — so once every distinct
(shape, dtype, transform, sharding) has been seen, further syncs never compile.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Shaped

from weight_sync.plan import Transform

HostOrDevice = Shaped[Array, "..."] | Shaped[np.ndarray, "..."]


def run(xs: Sequence[HostOrDevice], t: Transform, xp: ModuleType) -> HostOrDevice:
    """concat -> transpose -> reshape -> split -> take -> cast, with `xp` = numpy or jax.numpy."""
    if t.stack:
        x = xp.stack(list(xs), axis=t.concat_axis)
    else:
        x = xs[0] if t.concat_axis is None else xp.concatenate(list(xs), axis=t.concat_axis)
    if t.transpose is not None:
        x = xp.transpose(x, t.transpose)
    if t.reshape is not None:
        x = xp.reshape(x, t.reshape)
    if t.split_axis is not None:
        index = [slice(None)] * x.ndim
        index[t.split_axis] = slice(t.split_start, t.split_start + t.split_size)
        x = x[tuple(index)]
    if t.take is not None:
        axis, entries = t.take
        picks = np.asarray(entries)
        keep = (picks >= 0).reshape([-1 if a == axis else 1 for a in range(x.ndim)])
        x = xp.where(keep, xp.take(x, np.maximum(picks, 0), axis=axis), xp.zeros((), x.dtype))
    return x.astype(jnp.dtype(t.dtype))


def on_host(xs: Sequence[Shaped[np.ndarray, "..."]], t: Transform) -> Shaped[np.ndarray, "..."]:
    """The transform in numpy, as a C-contiguous array ready for `jax.device_put`."""
    return np.ascontiguousarray(run(xs, t, np))


_JITTED: dict[tuple[Transform, jax.sharding.Sharding | None], Callable[..., jax.Array]] = {}


def jitted(t: Transform, out_sharding: jax.sharding.Sharding | None) -> Callable[..., jax.Array]:
    """The cached jitted transform; `out_sharding=None` lets XLA place the result (on the inputs' devices)."""
    key = (t, out_sharding)
    fn = _JITTED.get(key)
    if fn is None:
        fn = jax.jit(lambda *xs: run(xs, t, jnp), out_shardings=out_sharding)
        _JITTED[key] = fn
    return fn


@jax.jit
def _all_finite(x: Shaped[Array, "..."]) -> jax.Array:
    return jnp.isfinite(x).all()


def finite_flags(xs: Sequence[HostOrDevice]) -> list[bool]:
    """Whether each array is free of NaN/Inf (non-float arrays always are); one device round trip."""
    flags: list[bool | jax.Array] = []
    for x in xs:
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            flags.append(True)
        elif isinstance(x, np.ndarray):
            flags.append(bool(np.isfinite(x).all()))
        else:
            flags.append(_all_finite(x))
    return [bool(f) for f in jax.device_get(flags)]
