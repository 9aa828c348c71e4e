"""`build_runner`: the one place a `ModelRunner` is put together from a model, a mesh and the runner's
share of the engine's configuration (`RunnerOptions`): the head layout for the mesh, the KV cache spec,
the backend, the buckets, the EAGLE-3 head and the executable store. `rollout.Engine` and the TPU
ahead-of-time check (`runner.tpu_aot`) both build their runner here, so they compile the same programs.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx
from jax.sharding import Mesh

from runner.backends import select_backend
from runner.buckets import BucketConfig
from runner.kv_cache import KVCacheSpec
from runner.model_runner import ModelRunner
from runner.models.family import CausalLM
from runner.models.registry import with_head_layout
from runner.spec_decode.eagle3_checkpoint import load_eagle3_head
from runner.spec_decode.eagle3_config import Eagle3Config


@dataclasses.dataclass(frozen=True)
class RunnerOptions:
    """What the runner takes of `rollout.EngineConfig` (validated there)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 1024
    block_size: int = 16
    kv_cache_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None  # of the device memory free now (`kv_memory_budget`)
    share_weights: bool = False
    backend: str = "auto"
    attention_backend: str = "auto"
    cpu_row_kernel: bool = True
    cpu_amx: bool = True
    cpu_amx_from_rows: int = 41
    cpu_bf16_matmul: bool = True
    batch_invariant: bool = False
    max_logprobs: int = 20
    max_kept_ids: int = 16
    num_scheduler_steps: int = 1
    speculative_k: int = 0  # tokens drafted per verification step (0: no speculation)
    eagle3: Eagle3Config | None = None  # the EAGLE-3 head drafting on the device
    executable_dir: str | None = None  # where compiled step programs are stored (None: not stored)
    record_routing: bool = False


def kv_memory_budget(mesh: Mesh, fraction: float, num_kv_heads: int, weight_bytes: int) -> int:
    """Bytes one replica's KV cache may take: `fraction` of the memory free once the engine's own weight copy
    (`weight_bytes` per replica, 0 when it shares the trainer's) is placed: an accelerator's own memory, split
    over the `model` axis where the KV heads divide; a CPU's host memory, shared by every replica."""
    stats = mesh.devices.flat[0].memory_stats() or {}
    model_axis = mesh.shape["model"]
    if "bytes_limit" in stats:
        free = min(d.memory_stats()["bytes_limit"] - d.memory_stats()["bytes_in_use"] for d in mesh.devices.flat)
        free -= weight_bytes // model_axis
        return max(0, int(fraction * free * (model_axis if num_kv_heads % model_axis == 0 else 1)))
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    available = int(info["MemAvailable"].split()[0]) * 1024 - weight_bytes * mesh.shape["data"]
    return max(0, int(fraction * available / mesh.shape["data"]))


def kv_cache_spec(model: CausalLM, options: RunnerOptions, mesh: Mesh) -> KVCacheSpec:
    """The paged cache for `options` (blocks given, or a memory budget: bytes, or a fraction of free memory;
    else one full sequence per slot), its block count per replica times the mesh's replicas."""
    cfg, block_size, num_replicas = model.config, options.block_size, mesh.shape["data"]
    max_pages = -(-options.max_model_len // block_size)
    num_blocks, memory_bytes = options.kv_cache_blocks, options.kv_cache_memory_bytes
    if num_blocks is None and memory_bytes is None and options.kv_cache_memory_fraction is not None:
        own = 0 if options.share_weights else sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        memory_bytes = kv_memory_budget(mesh, options.kv_cache_memory_fraction, cfg.num_key_value_heads, own)
    if num_blocks is None and memory_bytes is None:
        num_blocks = options.max_num_seqs * max_pages
    spec = KVCacheSpec.for_model(cfg, block_size=block_size, num_blocks=num_blocks, memory_bytes=memory_bytes)
    if spec.num_blocks < max_pages:
        raise ValueError(f"the KV cache ({spec.num_blocks} blocks of {block_size}) cannot hold one sequence "
                         f"of max_model_len={options.max_model_len}; give at least {max_pages} blocks")
    return dataclasses.replace(spec, num_blocks=spec.num_blocks * num_replicas, num_replicas=num_replicas)


def build_runner(model: CausalLM, mesh: Mesh, options: RunnerOptions, *, abstract: bool = False) -> ModelRunner:
    """The runner of `model` on `mesh` (whole heads on every device of its `model` axis: `with_head_layout`).

    `abstract`: `model` holds shapes only (`nnx.eval_shape`) and the mesh's devices need not exist (a TPU
    topology's); the runner's state is shapes and shardings, and `warmup()` compiles every program ahead of
    time (`ModelRunner.compiled_programs`) without running one."""
    if not abstract:
        model = with_head_layout(model, mesh.shape["model"])
    cfg = model.config
    kv_spec = kv_cache_spec(model, options, mesh)
    backend = select_backend(options.backend, mesh, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                             cache_dtype=kv_spec.dtype, attention_backend=options.attention_backend,
                             cpu_row_kernel=options.cpu_row_kernel, cpu_amx=options.cpu_amx,
                             cpu_amx_from_rows=options.cpu_amx_from_rows, cpu_bf16_matmul=options.cpu_bf16_matmul,
                             batch_invariant=options.batch_invariant)
    min_seqs, min_tokens = backend.min_buckets  # the smallest padded shapes worth compiling (TPU: its tile)
    buckets = BucketConfig(options.max_num_seqs, options.max_num_batched_tokens, -(-options.max_model_len // options.block_size),
                           min_seqs=min_seqs, min_tokens=min(min_tokens, options.max_num_batched_tokens),
                           verify_rows=options.speculative_k + 1 if options.speculative_k else 0)
    eagle3 = options.eagle3
    draft_head = None
    if eagle3 is not None:
        if abstract:
            raise ValueError("an abstract runner (ahead-of-time compilation) takes no EAGLE-3 head")
        draft_head = load_eagle3_head(eagle3.path, cfg, aux_layer_ids=eagle3.aux_layer_ids)
    return ModelRunner(model, kv_spec, buckets, max_logprobs=options.max_logprobs, max_kept_ids=options.max_kept_ids,
                       mesh=mesh, backend=backend, draft_head=draft_head,
                       num_scheduler_steps=options.num_scheduler_steps,
                       draft_min_confidence=eagle3.min_confidence if eagle3 is not None else 0.0,
                       num_verify_steps=eagle3.num_verify_steps if eagle3 is not None else 1,
                       executable_dir=None if abstract else options.executable_dir,
                       record_routing=options.record_routing, abstract=abstract, share_weights=options.share_weights)
