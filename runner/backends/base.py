"""`Backend`: the kernel choices of one engine behind one boundary (matmul, attention, KV cache layout,
parameter packing, status), chosen once per engine (`runner.backends.select_backend`).

The model code calls what the backend put into it (a `Matmul` in every `Linear`, one for the tied
output projection) and never tests platforms; the default everywhere is XLA's own dot (`XlaMatmul`),
which is also the reference backend's.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, TypeVar

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from runner.tpu_attention import TpuKernelShape

ModuleT = TypeVar("ModuleT", bound=nnx.Module)

# impls whose KV cache is laid out for JAX's TPU `ragged_paged_attention` kernel: `[P, page, 2 * Hkv, D]`
TPU_LAYOUT_IMPLS = ("tpu_ragged", "tpu_ragged_interpret", "tpu_ragged_jax")
TPU_KERNEL_IMPLS = ("tpu_ragged", "tpu_ragged_interpret")  # of those, the ones that run the kernel


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


@dataclasses.dataclass(frozen=True)
class BackendStatus:
    """What `Engine.stats()` reports of the backend: its name and, per kernel choice, "ok" or why not."""

    name: str
    matmul: str  # the few-row matmul kernel ("ok", or why XLA's dot runs)
    amx: str  # the AMX matmul ("ok", or why not)
    attention: str  # the attention impl of paged steps (one of `runner.attention.ATTENTION_IMPLS`)
    bf16_matmul: str = "off"  # a bfloat16 model's matmul kernel ("ok: ..." and which, or why XLA's dot)
    batch_invariant: str = "off"  # "on: ..." (what sums each row alike) or "off"
    # the TPU ragged kernel's shapes (the model's heads, or zero-padded ones) and block sizes; "" without it
    attention_kernel: str = ""


class Backend:
    """The reference backend: pure JAX everywhere, the oracle of every other backend."""

    name = "reference"

    def __init__(self, attention_impl: str = "jax") -> None:
        self.attention_impl = attention_impl
        self.tpu_kernel: TpuKernelShape | None = None  # set by `kv_cache_shape` for the TPU ragged kernel's impls

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

    def kv_cache_dtype(self, dtype: str) -> str:
        """The dtype a KV cache of `dtype` values is stored in (the CPU backend keeps bfloat16 as its bits)."""
        return dtype

    def kv_cache_shape(self, shape: tuple[int, ...], dtype: str, num_q_heads: int) -> tuple[int, ...]:
        """One layer's KV cache shape in this backend's layout, from the engine's
        `[replicas, 2, kv_heads, pages, page_size, head_dim]`: kept, except for the TPU ragged kernel's
        impls (`TPU_LAYOUT_IMPLS`): `[replicas, pages, page_size, 2 * kv_heads, head_dim]`, with the heads
        and head_dim zero-padded to what the kernel tiles when it runs (`runner.tpu_attention.TpuKernelShape`)."""
        if self.attention_impl in TPU_LAYOUT_IMPLS:
            replicas, _, kv_heads, pages, page_size, head_dim = shape
            if self.attention_impl in TPU_KERNEL_IMPLS:
                self.tpu_kernel = TpuKernelShape.for_model(num_q_heads, kv_heads, head_dim, dtype)
                kv_heads, head_dim = self.tpu_kernel.padded_kv_heads, self.tpu_kernel.padded_head_dim
            return (replicas, pages, page_size, 2 * kv_heads, head_dim)
        return shape

    def metadata_fields(self) -> dict[str, object]:
        """The static `AttentionMetadata` fields every step of this backend carries (its attention impl)."""
        return {"impl": self.attention_impl}

    def status(self) -> BackendStatus:
        return BackendStatus(self.name, matmul="XLA's dot", amx="off", attention=self.attention_impl,
                             attention_kernel=self.kernel_status())

    def kernel_status(self) -> str:
        """What `stats()` says of the TPU ragged kernel's shapes, "" where it does not run."""
        if self.tpu_kernel is None:
            return ""
        return f"{self.attention_impl}: {self.tpu_kernel.describe()}"

