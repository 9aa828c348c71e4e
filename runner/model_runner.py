"""The device step's host side: a `StepPlan` -> padded inputs -> one compiled program -> sampled ids.

The runner never sees a request object: a `StepPlan` is a handful of numpy arrays describing one step.
`launch` pads it to the bucket shape of its kind and hands it to that kind's launcher (the one table,
`runner.plan_programs.PROGRAMS`), straight from numpy on one device, one `device_put` onto the mesh
otherwise; the KV caches are donated and updated in place. `collect` brings back only the sampled ids
and the logprobs asked for.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array
from tqdm import tqdm

from runner.backends.base import Backend
from runner.buckets import BucketConfig
from runner.executable_store import CompiledProgram, StoredProgram, abstract_put, open_store
from runner.kv_cache import KVCacheSpec, allocate_kv_caches
from runner.models.family import CausalLM, KVCaches
from runner.device_weights import DeviceWeights, Leaves
from runner.models.registry import get_family
from runner.plan_programs import PROGRAMS, Launch, Programs
from runner.sharding import kv_cache_sharding, make_mesh
from runner.spec_decode.eagle3 import Eagle3Head
from runner.spec_decode.eagle3_drafter import Eagle3Drafter
from runner.step_padding import pad_plan
from runner.step_plan import StepPlan
from runner.step_program import compiled_chunk, compiled_step
from runner.step_result import PendingStep, StepResult
from runner.warmup_steps import DummySteps, WarmupProgram


@dataclasses.dataclass(frozen=True)
class RunnerMemory:
    """Bytes per device: the trainer's arrays the engine reads (shared weights), the engine's own weights
    (copies, packed copies, the rest of the model state), the KV cache, and the largest step program's
    working memory and code."""

    weights_shared: int
    weights_held: int
    kv_cache: int
    programs: int


def _first_shard_bytes(x: Array) -> int:
    return int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize


class ModelRunner:
    """Owns the model's device state, the paged KV caches and the compiled step programs."""

    def __init__(self, model: CausalLM, kv_spec: KVCacheSpec, buckets: BucketConfig,
                 *, max_logprobs: int = 20, max_kept_ids: int = 16, mesh: Mesh | None = None,
                 backend: Backend | None = None,
                 draft_head: Eagle3Head | None = None, num_scheduler_steps: int = 1,
                 draft_min_confidence: float = 0.0, num_verify_steps: int = 1,
                 executable_dir: str | None = None, record_routing: bool = False, abstract: bool = False,
                 share_weights: bool = False) -> None:
        """`draft_min_confidence > 0`: a verification step whose sequences' first drafts all have a lower
        probability under the head decodes plainly in the same program (`Eagle3Drafter.verify`).
        `num_verify_steps > 1`: with a draft head, verification may also run up to that many
        draft-verify steps in one device loop (`Eagle3Drafter.verify_steps`). `backend` (default: the
        reference backend, pure JAX) owns the kernel choices (`runner.backends.select_backend`).
        `executable_dir`: where the step programs' compiled executables are stored and loaded
        (`runner.executable_store`); None compiles them in every process. `record_routing`: every step
        returns each computed token's experts in every routed-experts layer (`StepResult.routed_experts`).
        `abstract`: the model and the runner's state are shapes and shardings only (`jax.ShapeDtypeStruct`,
        on devices that need not exist: a TPU topology's); `launch` compiles instead of running, and
        `warmup()` compiles every program ahead of time (`compiled_programs`). `share_weights`: parameters already
        laid out as the engine lays them out are the model's own arrays, not copies (`DeviceWeights`)."""
        if not 0.0 <= draft_min_confidence <= 1.0:
            raise ValueError(f"draft_min_confidence must be in [0, 1], got {draft_min_confidence}")
        self.draft_min_confidence = draft_min_confidence
        if num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {num_scheduler_steps}")
        self.num_scheduler_steps = num_scheduler_steps
        if num_verify_steps < 1 or (num_verify_steps > 1 and draft_head is None):
            raise ValueError(f"num_verify_steps must be >= 1 and 1 without a draft head, got {num_verify_steps}")
        self.num_verify_steps = num_verify_steps
        if abstract and (draft_head is not None or (backend is not None and backend.packs_weights)):
            raise ValueError("an abstract runner takes no draft head and no backend that packs weights")
        self.abstract = abstract
        self.warmup_programs: list[WarmupProgram] = []  # what an abstract runner's warmup() compiled, per step
        if record_routing and (not model.config.moe_layers or draft_head is not None):
            raise ValueError("record_routing needs a mixture-of-experts model and no EAGLE-3 head")
        self.record_routing = record_routing
        self.mesh = mesh if mesh is not None else make_mesh(None)
        self.backend = backend if backend is not None else Backend()
        model = self.backend.prepare(model)  # its kernels; packed weights live in `rest`, refreshed on sync
        draft_head = None if draft_head is None else self.backend.prepare(draft_head, pack=False)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        # the attention callable every step carries (`AttentionMetadata.kernel`), with its KV layout
        self.attention = self.backend.attention_for(model.config.num_attention_heads, kv_spec.num_kv_heads,
                                                    kv_spec.head_dim, kv_spec.dtype)
        if kv_spec.num_replicas != self.mesh.shape["data"]:
            raise ValueError(f"the KV cache has {kv_spec.num_replicas} replica(s) but the mesh's data axis is "
                             f"{self.mesh.shape['data']}")
        self.graphdef = graphdef
        defs = (jax.tree.structure(params), jax.tree.structure(rest))
        kv_shape = self.attention.layout.cache_shape(kv_spec)
        kv_sharding = kv_cache_sharding(kv_shape, self.attention.layout.cache_axes, self.mesh)
        pinned = kv_sharding if self.mesh.size > 1 else None
        store = open_store(executable_dir) if executable_dir is not None else None
        devices = tuple(self.mesh.devices.flat)
        # looked up once: hashing a GraphDef per step costs ~10 ms
        step_fn = StoredProgram(compiled_step(graphdef, *defs, pinned), "step", 3, devices, store, abstract)
        loop_fn = StoredProgram(compiled_chunk(graphdef, *defs, pinned), "chunk", 3, devices, store, abstract)
        self._graph = f"{graphdef!r}|{defs}|{pinned}"
        repack = (jax.jit(functools.partial(self.backend.refresh, graphdef), donate_argnums=1)
                  if self.backend.packs_weights else None)
        self.weights = DeviceWeights(params, rest, self.mesh, get_family(model.config.family).logical_axes,
                                     share=share_weights, abstract=abstract, repack=repack)
        self._scalar_sharding = NamedSharding(self.mesh, PartitionSpec())
        put = abstract_put if abstract else jax.device_put
        self.kv_spec = kv_spec
        self._kv_layout = (kv_shape, self.attention.layout.storage_dtype(kv_spec.dtype), kv_spec.num_layers, kv_sharding)
        self.kv_caches: KVCaches | None = (  # None while released
            tuple(jax.ShapeDtypeStruct(kv_shape, self._kv_layout[1], sharding=kv_sharding)
                  for _ in range(kv_spec.num_layers)) if abstract else allocate_kv_caches(*self._kv_layout))
        self._input_sharding = (self._scalar_sharding if kv_spec.num_replicas == 1
                                else NamedSharding(self.mesh, PartitionSpec("data")))
        self.buckets = buckets
        self.max_logprobs = max_logprobs
        self.max_kept_ids = max_kept_ids  # kept ids a step with a sampling record returns per row
        self.config = model.config
        self.drafter = None if draft_head is None else Eagle3Drafter(draft_head, graphdef, defs, kv_spec, self.mesh,
                                                                     pinned, store)
        # a decode loop reads its fed tokens from here when none are fed (fixed size: every bucket fits)
        no_feed = put(np.zeros(kv_spec.num_replicas * max(buckets.seq_buckets), np.int32), self._scalar_sharding)
        self.programs = Programs(step_fn, loop_fn, self.drafter, buckets, no_feed, num_scheduler_steps,
                                 num_verify_steps, draft_min_confidence, record_routing)
        self._set_program_identity()
        self.dummy_steps = DummySteps(buckets, kv_spec, num_verify_steps,
                                      has_drafter=draft_head is not None, max_logprobs=max_logprobs)

    def memory(self) -> RunnerMemory:
        """What the runner holds per device (the first device of the mesh)."""
        shared, held = self.weights.nbytes_per_device()
        kv = sum(_first_shard_bytes(c) for c in self.kv_caches) if self.kv_caches is not None else 0
        programs = [self.programs.step, self.programs.loop]
        return RunnerMemory(shared, held, kv, max((p.working_bytes() for p in programs), default=0))

    @property
    def attention_impl(self) -> str:
        """The attention impl every step runs (`runner.backends.attention_kernels.ATTENTION_IMPLS`)."""
        return self.attention.name

    @property
    def model(self) -> CausalLM:
        """The model bound to the runner's current parameters."""
        self.weights.leaves()
        return nnx.merge(self.graphdef, self.params, self.rest)

    def run(self, plan: StepPlan) -> StepResult:
        """Launch one step and wait for its result (`launch` then `collect`)."""
        return self.collect(self.launch(plan))

    def collect(self, pending: PendingStep) -> StepResult:
        """Wait for a launched step; only its sampled ids and requested logprobs come to the host."""
        return pending.finish(jax.device_get(pending.outputs))

    def launch(self, plan: StepPlan, after: PendingStep | None = None) -> PendingStep:
        """Pad (per replica) and dispatch one compiled step without waiting for it; the KV caches are
        donated and replaced by the step's outputs at once, so the next step may be launched before
        this one is collected. `after`: the decode loop whose last tokens `plan.loop.feed_rows` point at
        (not yet collected)."""
        spec, program = self.kv_spec, PROGRAMS[plan.kind]
        padded, layout = pad_plan(plan, program.shape, self.buckets, spec.block_size, spec.num_replicas,
                                  spec.blocks_per_replica, on_mesh=self.mesh.size > 1)
        padded = dataclasses.replace(padded, md=dataclasses.replace(padded.md, kernel=self.attention))
        if self.mesh.size == 1 and not self.abstract:  # numpy straight into the call(s): cheaper than a device_put
            device_batch = padded
        else:
            shardings = jax.tree.map(lambda x: self._input_sharding if np.ndim(x) else self._scalar_sharding, padded)
            device_batch = (jax.tree.map(abstract_put, padded, shardings) if self.abstract
                            else jax.device_put(padded, shardings))
        # two program sizes: the engine's usual top logprobs, and the whole vocabulary (`logprobs=-1`) past it
        k = plan.sampling.num_top_logprobs
        num_top = 0 if k == 0 else self.max_logprobs if k <= self.max_logprobs else self.config.vocab_size
        num_kept = self.max_kept_ids if plan.sampling.sampling_record else 0
        self.kv_caches, pending = program.launch(self.programs, self.kv_caches, Launch(
            plan, device_batch, layout, self._leaves(), num_top, num_kept, after))
        return pending

    @property
    def params(self) -> nnx.State:
        """The parameters (the target of a weight sync: `DeviceWeights`)."""
        return self.weights.params

    @property
    def rest(self) -> nnx.State:
        return self.weights.rest

    def _leaves(self) -> Leaves:
        return self.weights.leaves()

    def _set_program_identity(self) -> None:
        """Key the stored programs on the current parameters', packed weights' and caches' layouts."""
        fixed = (*self._leaves(), self.kv_caches)
        for program in (self.programs.step, self.programs.loop):
            program.set_identity(self._graph, fixed)
        if self.drafter is not None:
            self.drafter.set_identity(fixed[:2], self.kv_caches)

    @property
    def compiled_programs(self) -> list[CompiledProgram]:
        """The programs an abstract runner compiled (`warmup`), in order."""
        return [*self.programs.step.compiled_programs, *self.programs.loop.compiled_programs]

    @property
    def num_loaded_programs(self) -> int:
        """Step programs this runner loaded (from the executable store or another runner), not compiled."""
        return (self.programs.step.num_loaded + self.programs.loop.num_loaded
                + (self.drafter.num_loaded if self.drafter is not None else 0))

    def release(self, *, offload_weights: bool = False) -> None:
        """Free the KV cache's device memory (its contents are lost) and, with `offload_weights`, move the
        engine's own parameters to host memory (never the trainer's, with shared weights); `restore()`
        brings both back with the same shapes and shardings."""
        if self.kv_caches is not None:
            for cache in self.kv_caches:
                cache.delete()
            self.kv_caches = None
        if offload_weights:
            self.weights.release()

    def restore(self) -> None:
        """Undo `release`: a zeroed KV cache (no program compiled) and the parameters back on the devices."""
        if self.kv_caches is None:
            self.kv_caches = allocate_kv_caches(*self._kv_layout)
        self.weights.restore()
        self._set_program_identity()

    @property
    def released(self) -> bool:
        return self.kv_caches is None or self.weights.released

    def weights_updated(self) -> None:
        """After `sync_weights` wrote new arrays: recompute the packed weights now, inside the sync
        (else the next step would pay for it); returns when the new arrays are ready."""
        self.weights.updated()
        jax.block_until_ready(self.weights.leaves())  # (the programs' identity stays: layouts never change)

    def warmup(self, *, prompt_logprobs: bool = False, speculative_k: int = 0, rejection: bool = False,
               use_tqdm: bool = False) -> int:
        """Compile every bucket by running dummy steps whose K/V writes are all dropped; returns the count.

        `prompt_logprobs=True` also compiles the prefill programs that return per-token logprobs;
        `speculative_k > 0` the verification programs (a sampled row per token), `rejection` those
        of rejection-sampling verification.
        """
        count = 0
        if self.abstract:  # compile each program for the mesh's devices, run none
            for step in self.dummy_steps.every_bucket(prompt_logprobs=prompt_logprobs, speculative_k=speculative_k,
                                                      rejection=rejection):
                before = set(map(id, self.compiled_programs))
                self.launch(step)
                for program in (p for p in self.compiled_programs if id(p) not in before):
                    self.warmup_programs.append(WarmupProgram(step, program))
            return len(self.compiled_programs)
        if self.backend.packs_weights:  # the repacking program a weight sync runs
            self.weights.repack()
            count += 1
        steps = list(self.dummy_steps.every_bucket(prompt_logprobs=prompt_logprobs, speculative_k=speculative_k,
                                                   rejection=rejection))
        for step in tqdm(steps, desc="warmup: step programs", disable=not use_tqdm):
            self.run(step)
            count += 1
        return count
