"""`Backend`: the kernel choices of one engine behind one boundary (matmul, the attention callable and its
KV layout, parameter packing, the embedding read, status), chosen once per engine
(`runner.backends.select_backend`).

The model code calls what the backend put into it (a `Matmul` in every `Linear`, one for the tied
output projection, an `EmbeddingRows` reader; the `AttentionKernel` in every step's metadata) and never
tests platforms; the default everywhere is XLA's own dot (`XlaMatmul`) and the pure-JAX attention, which
are also the reference backend's.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, TypeVar

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from runner.attention import AttentionKernel
from runner.backends.attention_kernels import attention_kernel
from runner.models.embedding import embedding_rows
from runner.tpu_attention import INTERPRET_BLOCKS, BlockSizes

ModuleT = TypeVar("ModuleT", bound=nnx.Module)

class PackedKernel(nnx.Variable):
    """A weight laid out for a backend's matmul (derived from the `Param`: never trained or synced,
    recomputed by `Backend.refresh` when the parameters change)."""


class Matmul(Protocol):
    """`x @ w` (or `x @ w.T` for a transposed one), given the weight and its packed copy, if any."""

    def __call__(self, x: Float[Array, "... K"], w: Array, packed: Array | None) -> Float[Array, "... N"]:
        ...


@dataclasses.dataclass(frozen=True)
class XlaMatmul:
    """XLA's dot: `x @ w` with a `[K, N]` weight, or with `transposed` `x @ w.T` with a `[N, K]` one."""

    transposed: bool = False

    def __call__(self, x: Float[Array, "... K"], w: Array, packed: Array | None) -> Float[Array, "... N"]:
        return jnp.einsum("...h,vh->...v", x, w) if self.transposed else jnp.dot(x, w)


XLA_MATMUL = XlaMatmul()
XLA_MATMUL_NT = XlaMatmul(transposed=True)


class EmbeddingRows(Protocol):
    """The embedding rows of `ids`, given the table and the tied head's packed copy, if any."""

    def __call__(self, table: Float[Array, "V H"], packed: Array | None, ids: Int[Array, "..."]) -> Array:
        ...


@dataclasses.dataclass(frozen=True)
class TableRows:
    """`table[ids]` (`runner.models.embedding.embedding_rows`: a bfloat16 table gathered in its own bits)."""

    def __call__(self, table: Float[Array, "V H"], packed: Array | None, ids: Int[Array, "..."]) -> Array:
        return embedding_rows(table, ids)


TABLE_ROWS = TableRows()


@dataclasses.dataclass(frozen=True)
class BackendStatus:
    """What `Engine.stats()` reports of the backend: its name and, per kernel choice, "ok" or why not."""

    name: str
    matmul: str  # the few-row matmul kernel ("ok", or why XLA's dot runs)
    amx: str  # the AMX matmul ("ok", or why not)
    attention: str  # the attention impl (one of `runner.backends.attention_kernels.ATTENTION_IMPLS`)
    bf16_matmul: str = "off"  # a bfloat16 model's matmul kernel ("ok: ..." and which, or why XLA's dot)
    batch_invariant: str = "off"  # "on: ..." (what sums each row alike) or "off"
    # which steps the attention kernel serves and why; the TPU ragged kernel's shapes (the model's heads, or
    # zero-padded ones) and block sizes
    attention_kernel: str = ""


class Backend:
    """The reference backend: pure JAX everywhere, the oracle of every other backend."""

    name = "reference"
    kv_bits = False  # a bfloat16 cache in the engine's layout held as uint16 bits (`runner.kv_layout`)
    blocks: BlockSizes = INTERPRET_BLOCKS  # the TPU ragged kernel's tiling, where it runs

    def __init__(self, attention_impl: str = "jax") -> None:
        self.attention_impl = attention_impl
        self.attention: AttentionKernel | None = None  # made for the model's heads (`attention_for`)
        self.tensor_parallel: Mesh | None = None  # a mesh whose `model` axis a kernel splits the heads over

    def attention_for(self, num_q_heads: int, num_kv_heads: int, head_dim: int, cache_dtype: str) -> AttentionKernel:
        """The attention callable (with its KV layout) every step of this engine carries, for a model's heads."""
        self.attention = attention_kernel(self.attention_impl, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                          head_dim=head_dim, cache_dtype=cache_dtype, bits=self.kv_bits,
                                          blocks=self.blocks, tensor_parallel=self.tensor_parallel)
        return self.attention

    def prepare(self, module: ModuleT, *, pack: bool = True) -> ModuleT:
        """A copy of `module` (a model or draft head; sharing its arrays) with this backend's kernels wired
        in: every module with a `matmul` (a `Linear`) or a `head_matmul` (a tied output projection) gets
        this backend's; `pack` lets it add packed weights. Here: XLA's dot, nothing packed (kernels a
        model brought from another engine are taken out)."""
        copy = nnx.merge(*nnx.split(module))
        for _, sub in nnx.iter_modules(copy):
            if hasattr(sub, "matmul"):
                sub.matmul, sub.packed = XLA_MATMUL, nnx.data(None)
            elif hasattr(sub, "head_matmul"):
                sub.head_matmul, sub.packed_head = XLA_MATMUL_NT, nnx.data(None)
                sub.embedding_rows = TABLE_ROWS
            elif hasattr(sub, "grouped_matmul"):  # a mixture of experts
                sub.grouped_matmul = "ragged_dot"
            elif hasattr(sub, "fixed_order"):  # a norm: XLA's reduce
                sub.fixed_order = False
        return copy

    @property
    def packs_weights(self) -> bool:
        """Whether `prepare` adds `PackedKernel`s that `refresh` must recompute after a weight update."""
        return False

    def refresh(self, graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State) -> nnx.State:
        """`rest` with every packed weight recomputed from `params` (jit it, donating `rest`)."""
        return rest

    @property
    def min_buckets(self) -> tuple[int, int]:
        """The smallest sequence and token buckets worth compiling: (1, 32) (XLA:CPU runs a 1-row decode
        ~3x faster than an 8-row one)."""
        return 1, 32

    def status(self) -> BackendStatus:
        return BackendStatus(self.name, matmul="XLA's dot", amx="off", attention=self.attention_impl,
                             attention_kernel=self.attention_status())

    def attention_status(self) -> str:
        """Which steps the attention kernel serves (`AttentionKernel.describe`), "" before it is made."""
        return "" if self.attention is None else self.attention.describe()
