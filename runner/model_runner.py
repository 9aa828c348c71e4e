"""The device step's host side: padded inputs -> one jitted call (`runner.step_program`) -> ids.

The runner never sees a request object: `StepBatch` is a handful of numpy arrays describing one
step. It pads them to a bucket (`runner.buckets`), hands them to the compiled program for that bucket
(straight from numpy on one device, one `device_put` onto the mesh otherwise; the KV caches are
donated and updated in place) and brings back only the sampled ids and logprobs. A multi-step
decode batch (`StepBatch.num_steps`) goes to the program that runs several decode steps per call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array

from runner.attention import ATTENTION_IMPLS
from runner.buckets import BucketConfig
from runner.cpu_attention import load as load_cpu_attention
from runner.kernel_build import KernelStatus
from runner.kv_cache import KVCacheSpec, allocate_kv_caches
from runner.amx_matmul import load as load_amx
from runner.models.llama import LlamaForCausalLM, repack_amx, with_amx, with_row_kernel
from runner.row_matmul import MAX_ROWS, load
from runner.sampler import SamplerOutput
from runner.sharding import kv_cache_sharding, make_mesh, shard_params
from runner.spec_decode.eagle3 import Eagle3Head
from runner.spec_decode.eagle3_drafter import Eagle3Drafter
from runner.step_inputs import (  # noqa: F401  (StepBatch, MAX_SUPPRESS: re-exported for the engine)
    MAX_SUPPRESS, DeviceBatch, StepBatch, pad_replicas)
from runner.step_program import compiled_chunk, compiled_step
from runner.warmup_steps import DummySteps


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What comes back to the host: one sampled token per sequence (and per-token logprobs if asked)."""

    token_ids: np.ndarray  # [S]
    logprobs: np.ndarray  # [S] of the sampled token, in each sequence's mode
    top_ids: np.ndarray  # [S, K]
    top_logprobs: np.ndarray  # [S, K]
    token_logprobs: np.ndarray | None = None  # [T] raw logprob of target_ids[t] after token t
    token_top_ids: np.ndarray | None = None  # [T, K]
    token_top_logprobs: np.ndarray | None = None  # [T, K]
    # rows per sequence: a multi-step decode call's row i * steps + t is sequence i's step t; a multi-step
    # verification call's rows are step-major (see `ModelRunner._run_draft_verify_steps`)
    steps: int = 1
    draft_ids: np.ndarray | None = None  # [S, k] drafts made on the device (`StepBatch.draft_slots`)
    verified: bool = True  # False: the head was unsure and the step decoded plainly (drafts all -1)


def _sampled_rows(out: SamplerOutput, rows: np.ndarray, num_top: int) -> StepResult:
    """The sampled rows of a step's (host) output in the batch's order, `num_top` alternatives each."""
    return StepResult(out.token_ids[rows], out.logprobs[rows], out.top_ids[rows, :num_top],
                      out.top_logprobs[rows, :num_top])


def row_kernel_status(mesh: Mesh, model: LlamaForCausalLM) -> KernelStatus:
    """Whether the engine's few-row steps (decode at B <= 64, verification up to 64 rows) use `runner.row_matmul`:
    float32 on one CPU device (the kernel has no partitioning rule, so never on a mesh)."""
    cfg = model.config
    if any(d.platform != "cpu" for d in mesh.devices.flat):
        return KernelStatus(False, "not a CPU device: XLA's dot")
    if mesh.size > 1:
        return KernelStatus(False, "a mesh of several devices: XLA's dot partitions, the kernel does not")
    if (cfg.dtype, cfg.param_dtype) != ("float32", "float32"):
        return KernelStatus(False, f"float32 only, the model computes in {cfg.dtype} ({cfg.param_dtype} weights)")
    return load()


class ModelRunner:
    """Owns the model's device state, the paged KV caches and the compiled step programs."""

    def __init__(self, model: LlamaForCausalLM, kv_spec: KVCacheSpec, buckets: BucketConfig,
                 *, max_logprobs: int = 20, mesh: Mesh | None = None, attention_impl: str = "jax",
                 draft_head: Eagle3Head | None = None, num_scheduler_steps: int = 1,
                 draft_min_confidence: float = 0.0, num_verify_steps: int = 1) -> None:
        """`draft_min_confidence > 0`: a verification step whose sequences' first drafts all have a lower
        probability under the head decodes plainly in the same program (`Eagle3Drafter.verify`).
        `num_verify_steps > 1`: with a draft head, verification may also run up to that many
        draft-verify steps in one device loop (`Eagle3Drafter.verify_steps`)."""
        if not 0.0 <= draft_min_confidence <= 1.0:
            raise ValueError(f"draft_min_confidence must be in [0, 1], got {draft_min_confidence}")
        self.draft_min_confidence = draft_min_confidence
        if num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {num_scheduler_steps}")
        self.num_scheduler_steps = num_scheduler_steps
        if num_verify_steps < 1 or (num_verify_steps > 1 and draft_head is None):
            raise ValueError(f"num_verify_steps must be >= 1 and 1 without a draft head, got {num_verify_steps}")
        self.num_verify_steps = num_verify_steps
        self.mesh = mesh if mesh is not None else make_mesh(None)
        self.row_kernel = row_kernel_status(self.mesh, model)
        self.amx = load_amx() if self.row_kernel.available else self.row_kernel
        if self.row_kernel.available:
            model = with_row_kernel(model, MAX_ROWS)
            draft_head = None if draft_head is None else with_row_kernel(draft_head, MAX_ROWS)
        model = with_amx(model, self.amx.available)  # packed kernels live in `rest`, recomputed when params change
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention impl {attention_impl!r}; choose one of {ATTENTION_IMPLS}")
        if attention_impl != "jax" and self.mesh.shape["model"] > 1:
            raise ValueError(f"attention impl {attention_impl!r} runs unpartitioned: it needs a mesh whose "
                             f"'model' axis is 1, got {self.mesh.shape['model']} (use 'jax')")
        if attention_impl == "cpu_kernel" and (self.mesh.size > 1 or self.mesh.devices.flat[0].platform != "cpu"):
            raise ValueError("attention impl 'cpu_kernel' runs on one CPU device; use 'jax' on a mesh or accelerator")
        if attention_impl == "cpu_kernel" and not load_cpu_attention().available:
            raise ValueError(f"attention impl 'cpu_kernel' is unavailable here ({load_cpu_attention().reason}); use 'jax'")
        self.attention_impl = attention_impl
        if kv_spec.num_replicas != self.mesh.shape["data"]:
            raise ValueError(f"the KV cache has {kv_spec.num_replicas} replica(s) but the mesh's data axis is "
                             f"{self.mesh.shape['data']}")
        self.graphdef = graphdef
        defs = (jax.tree.structure(params), jax.tree.structure(rest))
        kv_sharding = kv_cache_sharding(kv_spec.shape, self.mesh)
        pinned = kv_sharding if self.mesh.size > 1 else None
        self._step_fn = compiled_step(graphdef, *defs, pinned)  # looked up once: hashing a GraphDef per step costs ~10 ms
        self._chunk_fn = compiled_chunk(graphdef, *defs, pinned)
        # The runner owns its copy (a trainer may update or donate its arrays at any time), laid out
        # by the sharding rules; device_put to a new sharding copies, so copy explicitly otherwise.
        self.params = shard_params(jax.tree.map(lambda x: x.copy(), params), self.mesh)
        self.rest = jax.device_put(jax.tree.map(lambda x: jnp.array(x, copy=True), rest),
                                   NamedSharding(self.mesh, PartitionSpec()))
        self.kv_spec = kv_spec
        self.kv_caches = allocate_kv_caches(kv_spec, kv_sharding)
        self._scalar_sharding = NamedSharding(self.mesh, PartitionSpec())
        self._input_sharding = (self._scalar_sharding if kv_spec.num_replicas == 1
                                else NamedSharding(self.mesh, PartitionSpec("data")))
        self.buckets = buckets
        self.max_logprobs = max_logprobs
        self.config = model.config
        self._repack = jax.jit(functools.partial(repack_amx, graphdef), donate_argnums=1) if self.amx.available else None
        self._packed_from = tuple(map(id, jax.tree.leaves(self.params)))
        self.drafter = None if draft_head is None else Eagle3Drafter(draft_head, graphdef, defs, kv_spec, self.mesh,
                                                                     pinned)
        self.dummy_steps = DummySteps(buckets, kv_spec, num_scheduler_steps, num_verify_steps,
                                      has_drafter=draft_head is not None, max_logprobs=max_logprobs)

    @property
    def model(self) -> LlamaForCausalLM:
        """The model bound to the runner's current parameters."""
        self._refresh_packed(jax.tree.leaves(self.params))
        return nnx.merge(self.graphdef, self.params, self.rest)

    def run(self, batch: StepBatch) -> StepResult:
        """Pad (per replica), run one compiled step, and return the sampled tokens in the batch's order."""
        spec = self.kv_spec
        padded, layout = pad_replicas(batch, self.buckets, spec.block_size, spec.num_replicas, spec.blocks_per_replica,
                                      on_mesh=self.mesh.size > 1)
        if self.attention_impl != "jax":
            padded = dataclasses.replace(padded, md=dataclasses.replace(padded.md, impl=self.attention_impl))
        if self.mesh.size == 1:  # numpy straight into the call(s): cheaper than a device_put of ~20 small arrays
            device_batch = padded
        else:
            shardings = jax.tree.map(lambda x: self._input_sharding if np.ndim(x) else self._scalar_sharding, padded)
            device_batch = jax.device_put(padded, shardings)
        leaves = self._leaves()
        num_top = self.max_logprobs if batch.num_top_logprobs > 0 else 0
        if batch.num_steps is not None and batch.draft_slots is not None:
            return self._run_draft_verify_steps(batch, leaves, device_batch, layout.row_index, layout.seq_index,
                                                num_top)
        if batch.num_steps is not None:
            return self._run_chunk(batch, leaves, device_batch, layout.row_index, num_top)
        if batch.draft_slots is not None:
            return self._run_draft_verify(batch, leaves, device_batch, layout.row_index, layout.seq_index, num_top)
        self.kv_caches, out, extra, aux = self._step_fn(
            *leaves, self.kv_caches, device_batch,
            num_top=num_top, token_logprobs=batch.target_ids is not None,
            aux_layers=self.drafter.aux_layers if self.drafter is not None else ())
        if self.drafter is not None:  # the head's cache follows every target step, on the device
            self.drafter.fill(leaves, aux, device_batch)
        out, extra = jax.device_get((out, extra))
        k, tokens = batch.num_top_logprobs, layout.token_index
        result = _sampled_rows(out, layout.row_index, k)
        if extra is not None:
            result = dataclasses.replace(
                result, token_logprobs=extra.logprobs[tokens], token_top_ids=extra.top_ids[tokens, :k],
                token_top_logprobs=extra.top_logprobs[tokens, :k])
        return result

    def _run_chunk(self, batch: StepBatch, leaves: tuple[list[Array], list[Array]], device_batch: DeviceBatch,
                   rows: np.ndarray, num_top: int) -> StepResult:
        """A multi-step decode call: rows come back sequence-major, `steps` per sequence."""
        if not batch.is_decode:
            raise ValueError("multi-step decode takes plain decode batches")
        steps = self.num_scheduler_steps
        if int(np.max(batch.num_steps, initial=1)) > steps:
            raise ValueError(f"a sequence asks for {int(np.max(batch.num_steps))} steps; this runner runs at most {steps}")
        if self.drafter is not None:  # the head's cache follows every step
            self.kv_caches, out = self.drafter.decode_chunk(leaves, self.kv_caches, device_batch, num_top=num_top,
                                                            max_steps=steps)
        else:
            self.kv_caches, out = self._chunk_fn(*leaves, self.kv_caches, device_batch, num_top=num_top,
                                                 max_steps=steps)
        out = jax.device_get(out)
        k = batch.num_top_logprobs
        seq_major = lambda x: np.swapaxes(x[:, rows], 0, 1).reshape(len(rows) * steps, *x.shape[2:])  # noqa: E731
        return StepResult(seq_major(out.token_ids), seq_major(out.logprobs), seq_major(out.top_ids[..., :k]),
                          seq_major(out.top_logprobs[..., :k]), steps=steps)

    def _run_draft_verify(self, batch: StepBatch, leaves: tuple[list[Array], list[Array]], device_batch: DeviceBatch,
                          rows: np.ndarray, seqs: np.ndarray, num_top: int) -> StepResult:
        """A verification step whose drafts the EAGLE-3 head makes in the same program."""
        num_drafts = self.buckets.verify_rows - 1
        if self.drafter is None or num_drafts < 1 or batch.target_ids is not None:
            raise ValueError("drafts made on the device need a draft head, verify buckets (k >= 1) and no "
                             "prompt logprobs in the step")
        if int(np.max(batch.draft_slots, initial=-1)) >= num_drafts:
            raise ValueError(f"a token asks for draft {int(np.max(batch.draft_slots))}; the head drafts {num_drafts}")
        plain_rows, floor = 0, 0.0
        if self.draft_min_confidence > 0:
            plain_rows = self.buckets.verify_plain_rows(device_batch.logits_indices.shape[1])
            replicas = batch.replicas if batch.replicas is not None else np.zeros(len(batch.q_lens), np.int64)
            if np.bincount(replicas).max() <= plain_rows:  # else this step always verifies
                floor = self.draft_min_confidence
        self.kv_caches, out, drafts, verified = self.drafter.verify(
            leaves, self.kv_caches, device_batch, num_top=num_top, num_steps=num_drafts, plain_rows=plain_rows,
            min_confidence=floor)
        out, drafts, verified = jax.device_get((out, drafts, verified))
        return dataclasses.replace(_sampled_rows(out, rows, batch.num_top_logprobs), verified=bool(verified),
                                   draft_ids=np.asarray(drafts).reshape(-1, num_drafts)[seqs])

    def _run_draft_verify_steps(self, batch: StepBatch, leaves: tuple[list[Array], list[Array]],
                                device_batch: DeviceBatch, rows: np.ndarray, seqs: np.ndarray, num_top: int
                                ) -> StepResult:
        """Multi-step verification (EAGLE-3, exact replay): row i * num_rows + r of the result is step i's
        sampled row r, and draft_ids[i * S + s] sequence s's drafts in step i."""
        num_drafts = self.buckets.verify_rows - 1
        if self.drafter is None or num_drafts < 1 or batch.draft_ids is not None or self.num_verify_steps < 2:
            raise ValueError("multi-step verification needs a draft head, verify buckets (k >= 1), exact replay "
                             "and num_verify_steps >= 2")
        if np.any(batch.q_lens != num_drafts + 1):
            raise ValueError(f"multi-step verification feeds every sequence {num_drafts} drafts; got q_lens "
                             f"{batch.q_lens.tolist()}")
        steps = self.num_verify_steps
        if int(np.max(batch.num_steps, initial=1)) > steps:
            raise ValueError(f"a sequence asks for {int(np.max(batch.num_steps))} steps; this runner runs at most {steps}")
        self.kv_caches, out, drafts = self.drafter.verify_steps(leaves, self.kv_caches, device_batch, num_top=num_top,
                                                                num_steps=num_drafts, max_iters=steps)
        out, drafts = jax.device_get((out, drafts))
        k, ran = batch.num_top_logprobs, int(np.max(batch.num_steps))  # later steps' buffers stay unwritten
        flat = lambda x: x[:ran, rows].reshape(ran * len(rows), *x.shape[2:])  # noqa: E731
        return StepResult(flat(out.token_ids), flat(out.logprobs), flat(out.top_ids[..., :k]),
                          flat(out.top_logprobs[..., :k]), steps=ran,
                          draft_ids=drafts[:ran].reshape(ran, -1, num_drafts)[:, seqs].reshape(-1, num_drafts))

    def _leaves(self) -> tuple[list[Array], list[Array]]:
        """Params and rest as the flat leaf lists the compiled programs take; taken per call (not
        cached), so a `sync_weights` that updates `self.params` in place is seen (and the AMX-packed
        kernels in `rest` are recomputed from the new arrays first)."""
        params = jax.tree.leaves(self.params)
        self._refresh_packed(params)
        return params, jax.tree.leaves(self.rest)

    def _refresh_packed(self, params: list[Array]) -> None:
        """Recompute the AMX-packed kernels in `rest` if any parameter array was replaced since."""
        ids = tuple(map(id, params))
        if self._repack is not None and ids != self._packed_from:
            self.rest = self._repack(self.params, self.rest)
            self._packed_from = ids

    def warmup(self, *, prompt_logprobs: bool = False, speculative_k: int = 0, rejection: bool = False) -> int:
        """Compile every bucket by running dummy steps whose K/V writes are all dropped; returns the count.

        `prompt_logprobs=True` also compiles the prefill programs that return per-token logprobs;
        `speculative_k > 0` the verification programs (a sampled row per token), `rejection` those
        of rejection-sampling verification.
        """
        count = 0
        for step in self.dummy_steps.every_bucket(prompt_logprobs=prompt_logprobs, speculative_k=speculative_k,
                                                  rejection=rejection):
            self.run(step)
            count += 1
        return count
