"""JAX's Pallas `paged_attention` kernels (GPU and TPU) for decode attention rows, over the engine's own
layout (`kv_pages[0]`, `kv_pages[1]` go to them as they are); every other step and any windowed or
soft-capped layer runs the pure-JAX reference. The "_interpret" variants run the kernels in Pallas
interpret mode (any platform; tests). The TPU kernel rounds K and V to bfloat16 inside."""

from __future__ import annotations

import contextlib
import dataclasses

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as gpu_paged_attention
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention
from jaxtyping import Array, Float, Int

from runner.attention import AttentionKernel, AttentionMetadata


@dataclasses.dataclass(frozen=True)
class PallasDecodeAttention(AttentionKernel):
    """Decode rows (one query per sequence) through the Pallas kernel of `platform` ("gpu" | "tpu")."""

    platform: str = "gpu"
    interpret: bool = False

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"pallas_{self.platform}" + ("_interpret" if self.interpret else "")

    def __call__(self, queries: Float[Array, "T Hq D"], kv_pages: Array, md: AttentionMetadata, *, sm_scale: float,
                 sliding_window: int | None = None, soft_cap: float | None = None) -> Float[Array, "T Hq D"]:
        if sliding_window is None and soft_cap is None and md.max_q_len == 1 and \
                queries.shape[0] == md.page_indices.shape[0]:
            return _pallas_decode(queries, kv_pages, md.kv_lens, md.page_indices, sm_scale=sm_scale,
                                  platform=self.platform, interpret=self.interpret)
        return self.reference(queries, kv_pages, md, sm_scale=sm_scale, sliding_window=sliding_window,
                              soft_cap=soft_cap)

    def describe(self) -> str:
        return (f"JAX's Pallas {self.platform.upper()} paged_attention for decode rows; pure JAX for ragged "
                "and verification steps and for sliding-window or soft-capped layers")


def _largest_divisor(n: int, options: tuple[int, ...]) -> int:
    return next(d for d in options if n % d == 0)


def _pallas_decode(
    queries: Float[Array, "S Hq D"],
    kv_pages: Float[Array, "2 Hkv P page D"],
    kv_lens: Int[Array, "S"],
    page_indices: Int[Array, "S W"],
    *,
    sm_scale: float,
    platform: str,
    interpret: bool,
) -> Float[Array, "S Hq D"]:
    """One query per sequence through JAX's Pallas `paged_attention` kernel of `platform`.

    The TPU kernel DMAs every listed page, so table entries past the cache (padding) are clipped
    into it. Rows without context are zeroed, as the reference does.
    """
    q = (queries.astype(jnp.float32) * sm_scale).astype(queries.dtype)
    pages_per_seq = page_indices.shape[1]
    if platform == "gpu":
        k_splits = _largest_divisor(pages_per_seq, (16, 8, 4, 2, 1))
        per_block = _largest_divisor(pages_per_seq // k_splits, (8, 4, 2, 1))
        out = gpu_paged_attention(q, kv_pages[0], kv_pages[1], page_indices, kv_lens, k_splits=k_splits,
                                  pages_per_compute_block=per_block, interpret=interpret)
    else:
        pages = jnp.clip(page_indices, 0, kv_pages.shape[2] - 1)
        # Interpret mode applies to the pallas calls traced inside this context (so it works under jit).
        with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
            out = tpu_paged_attention(q, kv_pages[0], kv_pages[1], kv_lens, pages,
                                      pages_per_compute_block=_largest_divisor(pages_per_seq, (8, 4, 2, 1)))
    return jnp.where((kv_lens > 0)[:, None, None], out, 0.0).astype(queries.dtype)
