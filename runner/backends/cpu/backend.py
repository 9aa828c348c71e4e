"""`CpuBackend`: the C++ XLA FFI kernels of this folder, each optional, on one CPU device (in batch-invariant
mode also on a data-parallel mesh, each replica's forward on its own device).

- few-row matmuls (`row_matmul`: 1-64 rows of `x @ w`, up to 8 of the tied head's `x @ w.T`),
- AMX tiles for larger float32 matmuls where the CPU has AMX-BF16 (`amx_matmul`: weights kept packed
  next to the float32 ones, recomputed by `refresh` after a weight update), and for every matmul of a
  bfloat16 model (its weights packed as they are: one exact product per tile),
- without AMX, a bfloat16 model's matmuls on AVX512_BF16 (`bf16_matmul`: the same packed weights,
  VDPBF16PS at every row count where this core runs it faster than FMA, else widened FMAs up to
  `bf16_matmul.MAX_ROWS` rows),
- paged attention (`attention`: decode, verification and prefill pieces of up to 64 queries).

Batch-invariant mode (`EngineConfig(batch_invariant=True)`): one kernel per matmul at every row count,
whose rows are summed alike whatever shares the step: the row kernel in chunks of 64 rows (the tied head
through a transposed float32 copy), AMX or the AVX512_BF16 kernel (in chunks) for a bfloat16 model; the
C++ attention for every step; the norms' sums in a fixed order (`runner.row_sum`). On a mesh of
`(data, 1)` each replica's forward runs on its own device under `shard_map` (`runner.step_program`), so
the kernels and the bits are those of one device; a `model` axis (tensor parallelism) is refused.

Each runs only where it builds and helps (AVX-512, float32, one device); otherwise XLA's dot or the
pure-JAX attention runs, and `status()` says why. Options come from `EngineConfig` only
(`cpu_row_kernel`, `cpu_amx`, `cpu_amx_from_rows`, `cpu_bf16_matmul`, `attention_backend`).
A bfloat16 model's tied embedding is read from the head's packed copy (`PackedTableRows`), and its KV
cache is held as uint16 bits (`runner.kv_layout.KVLayout.bits`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from runner.backends.base import Backend, BackendStatus, ModuleT, PackedKernel, XlaMatmul
from runner.backends.cpu import amx_matmul as amx
from runner.backends.cpu import bf16_matmul as bf16
from runner.backends.cpu.attention import load as load_attention
from runner.backends.cpu.kernel_build import KernelStatus
from runner.backends.cpu.row_matmul import MAX_ROWS, MAX_ROWS_NT, load as load_row_kernel, row_matmul, row_matmul_nt


@dataclasses.dataclass(frozen=True)
class CpuMatmul:
    """`x @ w` (`transposed`: `x @ w.T`): AMX where a packed weight exists and `amx.takes` the rows,
    the row kernel up to `row_max_rows` rows, XLA's dot otherwise; a bfloat16 model's packed weights on
    AMX at every row count, or on the AVX512_BF16 kernel (VDPBF16PS: at every row count, in chunks of
    `bf16_matmul.MAX_ROWS`; the FMA variant: up to that many rows, XLA's dot past it).

    `invariant` (batch-invariant mode): one kernel at every row count, each row's bits those of its
    product alone: the row kernel in chunks of `MAX_ROWS` (the tied head: AMX where packed for it, else
    the row kernel over its `[H, V]` copy), a bfloat16 model's AMX or AVX512_BF16 kernel (in chunks)."""

    row_max_rows: int
    amx_from_rows: int = amx.DEFAULT_FROM_ROWS
    transposed: bool = False
    bf16_kernel: str = "amx"  # a bfloat16 model's packed weights: "amx", or AVX512_BF16's "dot" / "fma" variant
    invariant: bool = False  # batch-invariant mode: one kernel at every row count (float32: the row kernel)

    def __call__(self, x: Float[Array, "... K"], w: Array, packed: Array | None) -> Float[Array, "... N"]:
        rows = math.prod(x.shape[:-1])
        if packed is not None and packed.ndim == 6 and packed.shape[2] == 1:  # bfloat16 weights
            if self.bf16_kernel == "amx":  # at every row count
                return amx.amx_matmul(x.astype(jnp.bfloat16), packed)
            if rows <= bf16.MAX_ROWS or (rows > 0 and (self.invariant or self.bf16_kernel == "dot")):
                kernel = lambda xs, p: bf16.bf16_matmul(xs, p, dot=self.bf16_kernel == "dot")  # noqa: E731
                return in_row_chunks(kernel, x, packed, bf16.MAX_ROWS)
            return XlaMatmul(self.transposed)(x, w, None)
        if self.invariant and rows > 0:
            if packed is not None and packed.ndim == 6:  # the tied head on AMX (`CpuBackend.packed_weight`)
                return amx.amx_matmul(x, packed)
            return in_row_chunks(row_matmul, x, (w.T if packed is None else packed) if self.transposed else w, MAX_ROWS)
        if packed is not None and amx.takes(rows, self.row_max_rows, self.amx_from_rows):
            return amx.amx_matmul(x, packed)
        if 0 < rows <= self.row_max_rows:
            return row_matmul_nt(x, w) if self.transposed else row_matmul(x, w)
        return XlaMatmul(self.transposed)(x, w, None)


@dataclasses.dataclass(frozen=True)
class PackedTableRows:
    """Embedding rows read from the tied head's one-part packed copy (a bfloat16 table): uint16 bits
    gathered, no conversion (`amx_matmul.packed_rows`)."""

    def __call__(self, table: Float[Array, "V H"], packed: Array | None, ids: Int[Array, "..."]) -> Array:
        return amx.packed_rows(packed, ids)


def in_row_chunks(kernel: Callable[[Array, Array], Array], x: Float[Array, "... K"], w: Array, chunk: int
                  ) -> Float[Array, "... N"]:
    """`kernel(x, w)` over consecutive chunks of at most `chunk` rows (a kernel whose rows do not depend
    on each other gives each row the bits it has alone)."""
    flat = x.reshape(-1, x.shape[-1])
    parts = [kernel(flat[start:start + chunk], w) for start in range(0, flat.shape[0], chunk)]
    y = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def row_kernel_status(mesh: Mesh, dtype: str, param_dtype: str, enabled: bool = True, per_device: bool = False
                      ) -> KernelStatus:
    """Whether few-row steps use the row kernel: float32 on one CPU device (the kernel has no
    partitioning rule, so not on a mesh, except `per_device`: each data replica on its own device)."""
    if not enabled:
        return KernelStatus(False, "turned off by EngineConfig(cpu_row_kernel=False)")
    if any(d.platform != "cpu" for d in mesh.devices.flat):
        return KernelStatus(False, "not a CPU device: XLA's dot")
    if mesh.size > 1 and not per_device:
        return KernelStatus(False, "a mesh of several devices: XLA's dot partitions, the kernel does not")
    if (dtype, param_dtype) != ("float32", "float32"):
        return KernelStatus(False, f"float32 only, the model computes in {dtype} ({param_dtype} weights)")
    return load_row_kernel()


class CpuBackend(Backend):
    """The C++ kernels where they run, XLA's ops elsewhere."""

    name = "cpu"

    def __init__(self, mesh: Mesh, *, dtype: str, param_dtype: str, attention_impl: str, row_kernel: bool = True,
                 use_amx: bool = True, amx_from_rows: int = amx.DEFAULT_FROM_ROWS, bf16_matmul: bool = True,
                 batch_invariant: bool = False) -> None:
        super().__init__(attention_impl)
        self.kv_bits = not attention_impl.startswith("pallas_")  # (the Pallas kernels read bfloat16 as it is)
        # batch-invariant mode on a data-parallel mesh: each replica's forward on its own device
        # (`runner.step_program`), so the kernels run there as on one device
        per_device = batch_invariant and mesh.shape["model"] == 1
        if attention_impl == "cpu_kernel" and ((mesh.size > 1 and not per_device)
                                               or mesh.devices.flat[0].platform != "cpu"):
            raise ValueError("attention impl 'cpu_kernel' runs on one CPU device; use 'jax' on a mesh or accelerator")
        if attention_impl == "cpu_kernel" and not load_attention().available:
            raise ValueError(f"attention impl 'cpu_kernel' is unavailable here ({load_attention().reason}); use 'jax'")
        self.row_kernel = row_kernel_status(mesh, dtype, param_dtype, row_kernel, per_device)
        bf16_model = ((dtype, param_dtype) == ("bfloat16", "bfloat16") and (mesh.size == 1 or per_device)
                      and row_kernel)
        if not self.row_kernel.available and not bf16_model:
            self.amx = self.row_kernel
        elif not use_amx:
            self.amx = KernelStatus(False, "turned off by EngineConfig(cpu_amx=False)")
        else:
            self.amx = amx.load()
        self.amx_from_rows = amx_from_rows
        self.bf16_kernel, self.bf16_status = _bf16_kernel(bf16_model, self.amx, bf16_matmul)
        self.batch_invariant = batch_invariant
        if batch_invariant:
            _check_batch_invariant(mesh, attention_impl, self.row_kernel, bf16_model, self.bf16_kernel, self.bf16_status)

    @property
    def packs_weights(self) -> bool:
        return self.amx.available or self.bf16_kernel != "" or self.batch_invariant

    def prepare(self, module: ModuleT, *, pack: bool = True) -> ModuleT:
        """A copy of `module` (sharing its arrays) computing with the kernels that run here: every
        `Linear` (and a tied output projection) gets a `CpuMatmul`, and with AMX (`pack`) a packed copy
        of its float32 weight where the shape fits."""
        copy = super().prepare(module)
        if self.batch_invariant:
            _check_invariant_model(copy)
        for _, sub in nnx.iter_modules(copy):
            if hasattr(sub, "grouped_matmul"):  # a mixture of experts: XLA:CPU's ragged_dot multiplies every expert
                sub.grouped_matmul = "segments"
            elif hasattr(sub, "fixed_order"):  # a norm
                sub.fixed_order = self.batch_invariant
        if not self.row_kernel.available and not self.packs_weights:
            return copy
        rows_on = self.row_kernel.available  # off for a bfloat16 model: its packed-weight kernel or XLA's dot
        kernel = self.bf16_kernel or "amx"
        for _, sub in nnx.iter_modules(copy):
            if hasattr(sub, "matmul"):  # a Linear
                sub.matmul = CpuMatmul(MAX_ROWS if rows_on else 0, self.amx_from_rows, bf16_kernel=kernel,
                                       invariant=self.batch_invariant)
            elif hasattr(sub, "head_matmul"):  # a causal LM: its tied output projection
                sub.head_matmul = CpuMatmul(MAX_ROWS_NT if rows_on else 0, self.amx_from_rows, transposed=True,
                                            bf16_kernel=kernel, invariant=self.batch_invariant)
            else:
                continue
            value = self.packed_weight(sub) if pack and self.packs_weights else None
            packed = PackedKernel(value) if value is not None else nnx.data(None)
            if hasattr(sub, "matmul"):
                sub.packed = packed
            else:
                sub.packed_head = packed
                if value is not None and value.ndim == 6 and value.shape[2] == 1:  # a bfloat16 table, one part
                    sub.embedding_rows = PackedTableRows()
        return copy

    def refresh(self, graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State) -> nnx.State:
        model = nnx.merge(graphdef, params, rest)
        for _, sub in nnx.iter_modules(model):
            packed = getattr(sub, "packed", None) if hasattr(sub, "matmul") else getattr(sub, "packed_head", None)
            if packed is not None:
                packed.value = self.packed_weight(sub)
        return nnx.split(model, nnx.Param, ...)[2]

    def packed_weight(self, sub: nnx.Module) -> Array | None:
        """The packed copy of a module's weight its `CpuMatmul` reads, or None: AMX's layout. In float32
        batch-invariant mode only the tied head has one: AMX's layout (as fast as the row kernel at one row
        and twice as fast at 64 on the Xeon), or without AMX its `[H, V]` transpose (the row kernel's `x @ w`)."""
        if self.batch_invariant and not self.bf16_kernel:  # float32: the layers read their own kernels
            if hasattr(sub, "matmul"):
                return None
            w = _amx_weight(sub) if self.amx.available else None
            if w is None:
                tied = sub.tied_output_rows()
                return None if tied is None else jnp.transpose(tied)
        else:
            w = _amx_weight(sub)
        return None if w is None else amx.pack_kernel(w)

    def status(self) -> BackendStatus:
        invariant = "off"
        if self.batch_invariant:
            head = " (the tied head on AMX tiles)" if self.amx.available else ""
            kernel = {"amx": "AMX tiles", "": f"the row kernel in chunks of 64 rows{head}"}.get(
                self.bf16_kernel, "the AVX512_BF16 kernel in chunks")
            invariant = f"on: {kernel} at every row count, the C++ attention, fixed-order norms"
        return BackendStatus(self.name, matmul=self.row_kernel.reason, amx=self.amx.reason,
                             attention=self.attention_impl, bf16_matmul=self.bf16_status, batch_invariant=invariant,
                             attention_kernel=self.attention_status())


def _check_batch_invariant(mesh: Mesh, attention_impl: str, row_kernel: KernelStatus, bf16_model: bool,
                           bf16_kernel: str, bf16_status: str) -> None:
    """Raise if batch-invariant mode cannot run here: it needs kernels whose row sums ignore the batch."""
    why = "batch_invariant=True"
    if mesh.shape["model"] > 1:
        raise ValueError(f"{why} runs on one CPU device or a data-parallel mesh; this one splits every row's sums "
                         f"over a 'model' axis of {mesh.shape['model']}: use mesh=(data, 1) or batch_invariant=False")
    if attention_impl != "cpu_kernel":
        raise ValueError(f"{why} needs the C++ paged attention (attention_backend 'auto' or 'cpu_kernel'), got "
                         f"{attention_impl!r}: the pure-JAX attention's reductions are XLA's, ordered by the batch")
    if bf16_model and not bf16_kernel:
        raise ValueError(f"{why} needs AMX or AVX512_BF16 for a bfloat16 model ({bf16_status}); use float32")
    if not bf16_model and not row_kernel.available:
        raise ValueError(f"{why} needs the row kernel for a float32 model ({row_kernel.reason})")


def _check_invariant_model(model: nnx.Module) -> None:
    """Raise for model features batch-invariant mode does not cover (they run XLA's own reductions)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "moe_layers"):  # a draft head: it only proposes tokens
        return
    if cfg.moe_layers:
        raise ValueError("batch_invariant=True does not cover mixture-of-experts models yet (an expert's rows "
                         "are grouped with whatever else routed to it); use batch_invariant=False")
    if cfg.sliding_layers or cfg.attn_logit_softcap is not None:
        raise ValueError("batch_invariant=True does not cover sliding-window or soft-capped attention yet (those "
                         "layers run the pure-JAX attention); use batch_invariant=False")


def _bf16_kernel(bf16_model: bool, amx_status: KernelStatus, enabled: bool) -> tuple[str, str]:
    """The kernel of a bfloat16 model's packed weights ("amx", "dot", "fma"; "" for none) and what
    `stats()` says of it."""
    if not bf16_model:
        return "", "not a bfloat16 model on one CPU device with kernels on"
    if amx_status.available:
        return "amx", "ok: AMX tiles"
    if not enabled:
        return "", "XLA's dot: turned off by EngineConfig(cpu_bf16_matmul=False)"
    status = bf16.load()
    if not status.available:
        return "", f"XLA's dot: {status.reason}"
    if bf16.prefers_dot():
        return "dot", f"ok: AVX512_BF16 dot products (VDPBF16PS {bf16.dot_speed():.2f}x FMA's multiply-adds here)"
    return "fma", f"ok: widened weights and FMAs (VDPBF16PS {bf16.dot_speed():.2f}x FMA's multiply-adds here)"


def _amx_weight(sub: nnx.Module) -> Array | None:
    """The `[K, N]` float32 weight AMX packs for a module (a Linear's kernel, a tied output projection's
    `[H, V]` embedding), or None where it packs nothing."""
    if hasattr(sub, "matmul"):
        w = sub.kernel[...] if sub.compute_dtype == sub.kernel[...].dtype else None
    else:
        tied = sub.tied_output_rows()
        w = tied.T if tied is not None and jnp.dtype(sub.config.dtype) == tied.dtype else None
    return w if w is not None and amx.shape_fits(w) else None
