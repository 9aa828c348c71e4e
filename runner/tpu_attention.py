"""JAX's Pallas TPU `ragged_paged_attention` kernel at the engine's shapes: head padding, block sizes
per chip generation, and the generic Pallas interpreter off a TPU.

The kernel (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`, the same in JAX 0.6-0.10) reads
a cache `[pages, page_size, 2 * kv_heads, head_dim]` (K of head h at 2h, V at 2h + 1) and accepts only
some shapes: its softmax statistics are 128 lanes wide (head_dim a multiple of 128) and the combined
K/V head axis must tile XLA's layout (`2 * kv_heads / packing` in 1, 2, 4, 8 or a multiple of 8, where
`packing` is 32 bits over the cache dtype's). A model outside those (SmolLM2-135M: head_dim 64, 3 KV
heads) runs the kernel on a zero-padded layout, `TpuKernelShape`: head_dim up to the next multiple of
128, KV heads up to the next count that tiles and each query-head group with them (9 / 3 -> 12 / 4).
Padded K/V lanes and heads are zero, so a padded lane adds 0 to every score and every output lane, and
a padded query head (over zero keys and values) yields zeros that are sliced off: the result is exact.
The price is cache memory (`TpuKernelShape.memory_factor`; 2.67x for SmolLM2), which `stats()` names.

Block sizes are always passed (the kernel's own lookup needs a real device kind and, per Levanter's
report, can run out of VMEM in long prefills on v5p): `BLOCK_SIZES` per chip generation.

Off a TPU the kernel runs in Pallas's generic (state-discharge) interpreter: `pallas_call(...,
interpret=True)` while the kernel's Python function is traced (it takes no `interpret` argument). The TPU
interpret mode (`force_tpu_interpret_mode`) cannot run it: the kernel reshapes refs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from types import ModuleType

import jax
import jax.numpy as jnp
from jax.experimental import pallas
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa_kernel
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Float, Int

from runner.attention import AttentionKernel, AttentionMetadata
from runner.kv_layout import FusedKVLayout

LANES = 128  # the TPU vector's lane count: head_dim and the softmax statistics come in these


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """The kernel's tiling on one chip generation: KV tokens per block (over pages) and queries per block."""

    kv_tokens: int
    queries: int

    def for_shape(self, page_size: int, pages_per_seq: int, num_tokens: int) -> tuple[int, int]:
        """(num_kv_pages_per_block, num_queries_per_block) for a step: the largest page count up to
        `kv_tokens` that divides `pages_per_seq`, and at most the step's tokens of queries."""
        cap = max(1, min(pages_per_seq, self.kv_tokens // page_size))
        pages = next(p for p in range(cap, 0, -1) if pages_per_seq % p == 0)
        return pages, max(1, min(self.queries, num_tokens))


# chip generation (a device kind's prefix) -> block sizes. v5e and v6e: the kernel's own defaults
# (128 pages of 16 = 2,048 tokens is what its table tops out at; 512 keeps the double-buffered KV block
# of a 16-head, head_dim 128 bfloat16 layer at 4 MiB); v4 and v5p (less VMEM per core): half of that.
BLOCK_SIZES: dict[str, BlockSizes] = {
    "TPU v6": BlockSizes(kv_tokens=512, queries=32),
    "TPU v5 lite": BlockSizes(kv_tokens=512, queries=32),
    "TPU v5e": BlockSizes(kv_tokens=512, queries=32),
    "TPU v5": BlockSizes(kv_tokens=256, queries=32),  # v5p
    "TPU v4": BlockSizes(kv_tokens=256, queries=32),
}
INTERPRET_BLOCKS = BlockSizes(kv_tokens=64, queries=8)  # off a TPU: small blocks, quick to interpret


def block_sizes_for(device_kind: str) -> BlockSizes:
    """The block sizes of a device kind ("TPU v5 lite", "TPU v6e", ...); a CPU runs the interpreter's."""
    if "TPU" not in device_kind:
        return INTERPRET_BLOCKS
    for prefix in sorted(BLOCK_SIZES, key=len, reverse=True):
        if device_kind.startswith(prefix):
            return BLOCK_SIZES[prefix]
    return BLOCK_SIZES["TPU v5"]  # a newer chip: the conservative sizes


def _tiles(num_combined_kv_heads: int, packing: int) -> bool:
    """The kernel's `can_be_xla_fully_tiled` for the combined K/V head axis."""
    if num_combined_kv_heads % packing:
        return False
    x = num_combined_kv_heads // packing
    return x in (1, 2, 4, 8) or x % 8 == 0


@dataclasses.dataclass(frozen=True)
class TpuKernelShape:
    """The head counts and head_dim the kernel runs at for a model (its own, or zero-padded up)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    padded_q_heads: int
    padded_kv_heads: int
    padded_head_dim: int

    @classmethod
    def for_model(cls, num_q_heads: int, num_kv_heads: int, head_dim: int, cache_dtype: str) -> "TpuKernelShape":
        packing = max(1, 4 // jnp.dtype(cache_dtype).itemsize)
        kv_heads = next(h for h in range(num_kv_heads, 8 * num_kv_heads + 8) if _tiles(2 * h, packing))
        group = num_q_heads // num_kv_heads
        return cls(num_q_heads, num_kv_heads, head_dim, kv_heads * group, kv_heads,
                   -(-head_dim // LANES) * LANES)

    @property
    def padded(self) -> bool:
        return (self.padded_kv_heads, self.padded_head_dim) != (self.num_kv_heads, self.head_dim)

    @property
    def memory_factor(self) -> float:
        """The padded cache's size over the model's own."""
        return self.padded_kv_heads * self.padded_head_dim / (self.num_kv_heads * self.head_dim)

    def describe(self) -> str:
        """What `stats()` says: the model's own shapes, or what was zero-padded and what it costs."""
        if not self.padded:
            return f"the model's heads ({self.num_q_heads} query / {self.num_kv_heads} KV, head_dim {self.head_dim})"
        padded = []
        if self.padded_kv_heads != self.num_kv_heads:
            padded.append(f"heads {self.num_q_heads} query / {self.num_kv_heads} KV -> {self.padded_q_heads} / "
                          f"{self.padded_kv_heads}")
        if self.padded_head_dim != self.head_dim:
            padded.append(f"head_dim {self.head_dim} -> {self.padded_head_dim}")
        return f"zero-padded for the kernel: {', '.join(padded)} (KV cache x{self.memory_factor:.2f})"


class _Interpreted:
    """`jax.experimental.pallas` with `pallas_call(..., interpret=True)`: put in the kernel module's
    namespace while its function is traced."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module

    def __getattr__(self, name: str) -> object:
        return getattr(self._module, name)

    def pallas_call(self, *args: object, **kwargs: object) -> Callable[..., object]:
        return self._module.pallas_call(*args, interpret=True, **kwargs)


def _kernel_call(interpret: bool, **kwargs: object) -> Callable[..., Array]:
    """The kernel's function; `interpret`: traced with the generic interpreter (bypassing its own jit, whose
    cache would not see the switch)."""
    if not interpret:
        return functools.partial(rpa_kernel.ragged_paged_attention, **kwargs)

    def call(*args: Array) -> Array:
        original = rpa_kernel.pl
        rpa_kernel.pl = _Interpreted(pallas)
        try:
            return rpa_kernel.ragged_paged_attention.__wrapped__(*args, **kwargs)
        finally:
            rpa_kernel.pl = original

    return call


def tpu_ragged_attention(
    queries: Float[Array, "T Hq D"],
    kv_pages: Float[Array, "P page 2Hkv Dp"],
    kv_lens: Int[Array, "S"],
    page_indices: Int[Array, "S W"],
    cu_q_lens: Int[Array, "S+1"],
    num_seqs: Int[Array, "1"],
    *,
    num_kv_heads: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    blocks: BlockSizes,
    interpret: bool,
) -> Float[Array, "T Hq D"]:
    """Every step's attention through the Pallas kernel, over a cache in its (possibly padded) layout.

    `num_kv_heads` is the model's; the cache may hold more (zero) heads and a wider head_dim, and the
    queries are padded to match: each group of `Hq / num_kv_heads` query heads keeps its KV head, the
    padded groups read the zero heads. Rows past `cu_q_lens[num_seqs]` are undefined (padding)."""
    num_tokens, num_q_heads, head_dim = queries.shape
    _, page_size, combined, padded_dim = kv_pages.shape
    padded_kv = combined // 2
    group = num_q_heads // num_kv_heads
    q = queries
    if padded_kv != num_kv_heads or padded_dim != head_dim:
        q = jnp.pad(q, ((0, 0), (0, (padded_kv - num_kv_heads) * group), (0, padded_dim - head_dim)))
    pages_per_block, queries_per_block = blocks.for_shape(page_size, page_indices.shape[1], num_tokens)
    call = _kernel_call(interpret, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                        num_kv_pages_per_block=pages_per_block, num_queries_per_block=queries_per_block)
    out = call(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    return out[:, :num_q_heads, :head_dim].astype(queries.dtype)


@dataclasses.dataclass(frozen=True)
class TpuRaggedAttention(AttentionKernel):
    """Every step (prefill, chunked prefill, decode, verification; windows and soft caps included) through
    the Pallas kernel over its fused, possibly zero-padded cache (`layout`, `shape`), tiled by `blocks`;
    `interpret`: in Pallas's generic interpreter (off a TPU)."""

    layout: FusedKVLayout = FusedKVLayout()
    shape: TpuKernelShape = TpuKernelShape(1, 1, 128, 1, 1, 128)  # one device's heads
    blocks: BlockSizes = INTERPRET_BLOCKS
    interpret: bool = False
    # tensor parallel: the mesh whose `model` axis splits the heads; the kernel runs on each device's share
    # (`shard_map`), which must tile as it is (the padding is per device, never between devices' heads)
    mesh: Mesh | None = None

    @classmethod
    def for_model(cls, num_q_heads: int, num_kv_heads: int, head_dim: int, cache_dtype: str, blocks: BlockSizes,
                  *, interpret: bool, mesh: Mesh | None = None) -> "TpuRaggedAttention":
        """The kernel for a model's heads; on a tensor-parallel `mesh` for each device's share of them
        (`ValueError` if those would need zero heads between the devices' heads: use "tpu_ragged_jax")."""
        parts = 1 if mesh is None else mesh.shape["model"]
        shape = TpuKernelShape.for_model(num_q_heads // parts, num_kv_heads // parts, head_dim, cache_dtype)
        if parts > 1 and shape.padded_kv_heads != shape.num_kv_heads:
            raise ValueError(f"each of {parts} devices would hold {shape.num_kv_heads} KV heads, which the TPU ragged "
                             f"kernel cannot tile without padding between devices; use 'tpu_ragged_jax'")
        layout = FusedKVLayout(num_kv_heads=num_kv_heads, head_dim=head_dim, padded_kv_heads=shape.padded_kv_heads * parts,
                               padded_head_dim=shape.padded_head_dim)
        return cls(layout, shape, blocks, interpret, mesh if parts > 1 else None)

    @property
    def per_device(self) -> bool:  # type: ignore[override]
        """Data parallel: a replica per device (`forward_and_sample`); tensor parallel maps itself."""
        return self.mesh is None

    @property
    def name(self) -> str:  # type: ignore[override]
        return "tpu_ragged_interpret" if self.interpret else "tpu_ragged"

    def __call__(self, queries: Float[Array, "T Hq D"], kv_pages: Array, md: AttentionMetadata, *, sm_scale: float,
                 sliding_window: int | None = None, soft_cap: float | None = None) -> Float[Array, "T Hq D"]:
        def local(q: Array, kv: Array, md: AttentionMetadata) -> Array:
            return tpu_ragged_attention(q, kv, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
                                        num_kv_heads=self.shape.num_kv_heads, sm_scale=sm_scale,
                                        sliding_window=sliding_window, soft_cap=soft_cap, blocks=self.blocks,
                                        interpret=self.interpret)

        if self.mesh is None:
            return local(queries, kv_pages, md)
        heads, cache = PartitionSpec(None, "model", None), PartitionSpec(None, None, "model", None)
        return jax.shard_map(local, mesh=self.mesh, in_specs=(heads, cache, jax.tree.map(lambda _: PartitionSpec(), md)),
                             out_specs=heads, check_vma=False)(queries, kv_pages, md)

    def describe(self) -> str:
        split = "" if self.mesh is None else f"on each of {self.mesh.shape['model']} devices' heads, "
        return (f"{self.name} for every step, {split}{self.shape.describe()}; blocks of {self.blocks.kv_tokens} KV "
                f"tokens x {self.blocks.queries} queries")
