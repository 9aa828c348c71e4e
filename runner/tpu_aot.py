"""The engine's step programs compiled ahead of time for real TPU chips, on a machine without one.

With `jax[tpu]` installed (libtpu from PyPI), `TPU_SKIP_MDS_QUERY=1` set and JAX's platform forced to
CPU, `jax.experimental.topologies.get_topology_desc` gives the devices of a TPU slice that is not there;
`jit(...).lower(shapes).compile()` then runs libtpu's compiler for them (the Pallas kernels through
Mosaic: a kernel that cannot tile or overflows VMEM fails here as it would on the chip). `compile_warmup`
builds the engine's own runner (`runner.build.build_runner`) over an abstract model (`nnx.eval_shape`) on
such a mesh and runs its `warmup()`, which compiles every step program instead of running it.

`predict_step` turns one compiled program into a predicted step time: XLA's own estimate
(`cost_analysis()["optimal_seconds"]`) and its bytes accessed over the chip's HBM bandwidth, plus the
K/V bytes the attention kernel reads (a Pallas call is not costed by XLA: `kv_bytes`, by formula).
These are predictions, never measurements.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from runner.build import RunnerOptions, build_runner
from runner.executable_store import CompiledProgram
from runner.model_runner import ModelRunner
from runner.models.config import ModelConfig
from runner.models.registry import build_model, with_head_layout
from runner.tpu_attention import TpuKernelShape


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU generation's topology names and the public per-chip figures a roofline needs."""

    kind: str  # jax's device_kind
    hbm_bytes_per_second: float
    bf16_flops_per_second: float


# topology -> (get_topology_desc's chip_config_name, chips_per_host_bounds)
TOPOLOGIES: dict[str, tuple[str, tuple[int, int, int]]] = {
    "v5e:1x1": ("default", (1, 1, 1)), "v5e:2x2": ("default", (2, 2, 1)),
    "v6e:1x1": ("default", (1, 1, 1)), "v6e:2x2": ("default", (2, 2, 1)),
    "v4:2x2x1": ("megacore", (2, 2, 1)), "v5p:2x2x1": ("megacore", (2, 2, 1)),
}
CHIPS: dict[str, Chip] = {  # Google Cloud's published per-chip HBM bandwidth and bfloat16 peak
    "v5e": Chip("TPU v5 lite", 819e9, 197e12), "v6e": Chip("TPU v6 lite", 1640e9, 918e12),
    "v4": Chip("TPU v4", 1228e9, 275e12), "v5p": Chip("TPU v5", 2765e9, 459e12),
}


def prepare_aot() -> None:
    """Settings libtpu's compiler needs on a machine without a TPU; call before JAX starts a backend."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    jax.config.update("jax_platforms", "cpu")


def topology_mesh(topology: str, mesh_shape: tuple[int, int]) -> Mesh:
    """A ("data", "model") mesh over the devices of a TPU slice described by name (no TPU needed)."""
    from jax.experimental import topologies

    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; choose one of {', '.join(TOPOLOGIES)}")
    config, bounds = TOPOLOGIES[topology]
    desc = topologies.get_topology_desc(topology, "tpu", chip_config_name=config, chips_per_host_bounds=bounds,
                                        num_slices=1)
    data, model = mesh_shape
    if data * model > len(desc.devices):
        raise ValueError(f"a ({data}, {model}) mesh needs {data * model} chips; {topology} has {len(desc.devices)}")
    return Mesh(np.asarray(desc.devices[:data * model]).reshape(data, model), ("data", "model"))


def abstract_model(cfg: ModelConfig, model_axis: int) -> object:
    """`cfg`'s model as shapes only, with whole heads on every device of a `model_axis`-way mesh."""
    return nnx.eval_shape(lambda: with_head_layout(build_model(cfg, rngs=nnx.Rngs(0)), model_axis))


def compile_warmup(cfg: ModelConfig, mesh: Mesh, options: RunnerOptions) -> ModelRunner:
    """The engine's runner of `cfg` on `mesh`, every program of its `warmup()` compiled for the mesh's chips
    (`runner.compiled_programs`)."""
    runner = build_runner(abstract_model(cfg, mesh.shape["model"]), mesh, options, abstract=True)
    with jax.set_mesh(mesh):  # a Pallas TPU kernel lowers only with a TPU mesh (or device) in context
        runner.warmup()
    return runner


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """`Compiled.memory_analysis()` of one program, per device."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    code_bytes: int

    @classmethod
    def of(cls, program: CompiledProgram) -> "ProgramMemory":
        m = program.compiled.memory_analysis()
        return cls(int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.temp_size_in_bytes),
                   int(m.generated_code_size_in_bytes))


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    """A predicted step time (not a measurement) and the roofline fraction the program's bytes imply."""

    optimal_seconds: float  # XLA's own estimate (its custom calls uncosted; 0 where it gives none)
    bytes_accessed: float  # XLA's count, plus `kv_bytes`
    kv_bytes: int  # what the attention kernel reads, by formula
    flops: float
    predicted_seconds: float  # max(XLA's estimate, bytes over HBM bandwidth, flops over the bf16 peak)
    roofline_fraction: float  # (weights + K/V read once) over HBM bandwidth, over the predicted time
    # the same without XLA's count of the in-place K/V scatters as a read and a write of the whole cache
    # (`cache_bytes` twice): on the chip they touch only the new rows; a lower estimate, not a bound
    scatter_free_seconds: float
    scatter_free_roofline_fraction: float


def kv_bytes(kernel: TpuKernelShape | None, num_layers: int, itemsize: int, q_lens: Sequence[int],
             kv_lens: Sequence[int], queries_per_block: int) -> int:
    """K/V bytes the ragged kernel reads in one step: each block of queries of a sequence streams that
    sequence's context once (padded heads and lanes included)."""
    if kernel is None:
        return 0
    per_token = 2 * kernel.padded_kv_heads * kernel.padded_head_dim * itemsize * num_layers
    blocks = sum(-(-q // queries_per_block) * kv for q, kv in zip(q_lens, kv_lens))
    return int(blocks * per_token)


def predict_step(program: CompiledProgram, chip: Chip, *, weight_bytes: int, kv_read: int, kv_ideal: int,
                 cache_bytes: int) -> StepPrediction:
    """One program's predicted time on `chip` given the kernel's K/V traffic (`kv_read`), what a perfect
    step would read (`weight_bytes` + `kv_ideal`, each once) and the KV cache's size per device."""
    cost = program.compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    optimal = max(0.0, float(cost.get("optimal_seconds", 0.0)))  # libtpu reports a negative one for some programs
    accessed = float(cost.get("bytes accessed", 0.0)) + kv_read
    flops = float(cost.get("flops", 0.0))
    bandwidth, compute = chip.hbm_bytes_per_second, flops / chip.bf16_flops_per_second
    predicted = max(optimal, accessed / bandwidth, compute)
    scatter_free = max(optimal, max(accessed - 2 * cache_bytes, weight_bytes + kv_read) / bandwidth, compute)
    ideal = (weight_bytes + kv_ideal) / bandwidth
    return StepPrediction(optimal, accessed, kv_read, flops, predicted, ideal / predicted if predicted else 0.0,
                          scatter_free, ideal / scatter_free if scatter_free else 0.0)
