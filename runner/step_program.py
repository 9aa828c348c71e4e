"""The jitted device programs of an engine step: one step (`_step`) and multi-step decode (`_decode_chunk`,
`decode_loop`, which EAGLE-3 engines also run with the head's cache fill after every step).

Both take the model as a graphdef plus flat parameter leaves (cheaper for jit's per-call argument
handling than `nnx.State`s), the KV caches (donated: updated in place) and a padded `DeviceBatch`,
and return the caches and what was sampled. `runner.model_runner.ModelRunner` is their host side.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

from runner import row_sum
from runner.attention import AttentionMetadata, paged_slots
from runner.models.family import CausalLM, KVCaches
from runner.logits_processors import LogitsAdjust, append_outputs
from runner.sampler import SamplerOutput, sample
from runner.sampling_rows import SAMPLER_MODES
from runner.step_padding import DeviceBatch

LoopState = TypeVar("LoopState")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Per-token raw logprobs of given next tokens (prompt logprobs)."""

    logprobs: Float[Array, "T"]
    top_ids: Int[Array, "T K"]
    top_logprobs: Float[Array, "T K"]


def merge_leaves(graphdef: nnx.GraphDef, params_def: jax.tree_util.PyTreeDef, rest_def: jax.tree_util.PyTreeDef,
                 param_leaves: list[Array], rest_leaves: list[Array]) -> nnx.Module:
    """The module of `graphdef` over flat parameter and state leaves (how every compiled program takes a model)."""
    return nnx.merge(graphdef, jax.tree.unflatten(params_def, param_leaves), jax.tree.unflatten(rest_def, rest_leaves))


def _step(graphdef: nnx.GraphDef, params_def: jax.tree_util.PyTreeDef, rest_def: jax.tree_util.PyTreeDef,
          kv_sharding: NamedSharding | None, param_leaves: list[Array], rest_leaves: list[Array], kv_caches: KVCaches,
          batch: DeviceBatch, *, num_top: int, token_logprobs: bool, aux_layers: tuple[int, ...] = (),
          num_kept: int = 0, record_routing: bool = False
          ) -> tuple[KVCaches, SamplerOutput, TokenLogprobs | None, Float[Array, "R T A"]]:
    model = merge_leaves(graphdef, params_def, rest_def, param_leaves, rest_leaves)
    return forward_and_sample(model, kv_caches, batch, num_top=num_top, token_logprobs=token_logprobs,
                              aux_layers=aux_layers, kv_sharding=kv_sharding, num_kept=num_kept,
                              record_routing=record_routing)


def forward_and_sample(model: CausalLM, kv_caches: KVCaches, batch: DeviceBatch, *, num_top: int,
                       token_logprobs: bool, aux_layers: tuple[int, ...] = (), kv_sharding: NamedSharding | None = None,
                       num_kept: int = 0, record_routing: bool = False
                       ) -> tuple[KVCaches, SamplerOutput, TokenLogprobs | None, Float[Array, "R T A"]]:
    """One step's forward over the paged cache (per replica) and sampling of its rows.

    `record_routing`: the output's `routed_experts` holds every token's experts in each routed-experts
    layer (`[R * T, L, k]`, in packed token order).

    `kv_sharding`: the caches' layout on a mesh, pinned on the updated caches; left to XLA's
    propagation, a head-sharded cache came back replicated (every device then held all of it and
    all-gathered the new K/V in every layer).

    Kernels without a partitioning rule (`AttentionKernel.per_device`: the CPU backend's C++ attention in
    batch-invariant mode, the Pallas TPU ragged kernel) on a data-parallel mesh: each replica's forward
    and logits run on its own device under `shard_map`, so the kernel sees that device's rows and cache only.
    """

    def replica_forward(m: CausalLM, token_ids: Array, positions: Array, kv: KVCaches, md: AttentionMetadata,
                        logits_indices: Array) -> tuple[Array, Array, KVCaches, Array, Array]:
        routing: list[Array] | None = [] if record_routing else None
        hidden, kv, aux = m.forward_paged(token_ids, positions, kv, md, aux_layers, routing)
        routed = (jnp.stack(routing, axis=1).astype(jnp.int32) if routing
                  else jnp.zeros((token_ids.shape[0], 0, 0), jnp.int32))
        return hidden, hidden[logits_indices], kv, aux, routed

    args = (batch.token_ids, batch.positions, kv_caches, batch.md, batch.logits_indices)
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731  [R, N, ...] -> [R * N, ...]
    logits = None
    # One replica on one device: no vmap, the plain program (vmap over 1 costs ~15% there). On a
    # mesh, vmap even over one replica: squeezing the replica axis of a cache whose head axis is 1
    # per device made XLA:CPU copy every layer's cache twice per step (TP=4 at half the speed).
    if kv_sharding is not None and batch.md.kernel.per_device:
        hidden, rows_logits, kv_caches, aux, routed = _per_device_replicas(model, replica_forward, args, kv_sharding)
        logits = flat(rows_logits)
    elif kv_caches[0].shape[0] == 1 and kv_sharding is None:
        hidden, rows_hidden, kv, aux, routed = replica_forward(model, *jax.tree.map(lambda x: x[0], args))
        hidden, rows_hidden, kv_caches, aux, routed = jax.tree.map(lambda x: x[None],
                                                                   (hidden, rows_hidden, kv, aux, routed))
    else:  # data parallel: each replica (a slice of the `data` axis) over its own KV blocks
        hidden, rows_hidden, kv_caches, aux, routed = jax.vmap(functools.partial(replica_forward, model))(*args)
    if kv_sharding is not None:
        kv_caches = tuple(jax.lax.with_sharding_constraint(kv, kv_sharding) for kv in kv_caches)
    if logits is None:
        logits = model.compute_logits(flat(rows_hidden))
    branches = [functools.partial(sample, mode=m, num_top_logprobs=num_top, num_kept=num_kept) for m in SAMPLER_MODES]
    out = jax.lax.switch(batch.mode, branches, logits, jax.tree.map(flat, batch.sampling))
    if record_routing:
        out = dataclasses.replace(out, routed_experts=flat(routed))
    extra = None
    if token_logprobs:
        logp = row_sum.log_softmax(model.compute_logits(flat(hidden)))
        target = jnp.clip(flat(batch.target_ids), 0, logp.shape[-1] - 1)
        top_lp, top_ids = jax.lax.top_k(logp, num_top)
        extra = TokenLogprobs(jnp.take_along_axis(logp, target[:, None], axis=-1)[:, 0], top_ids, top_lp)
    return kv_caches, out, extra, aux


def _per_device_replicas(model: CausalLM, replica_forward: Callable[..., tuple[Array, Array, KVCaches, Array, Array]],
                         args: tuple[Array, Array, KVCaches, AttentionMetadata, Array], kv_sharding: NamedSharding
                         ) -> tuple[Array, Array, KVCaches, Array, Array]:
    """`replica_forward` of each replica on its own device of the mesh's `data` axis (`shard_map`; the
    parameters replicated), with the logits of its rows: (hidden, row logits, caches, aux, routed), each
    with the replica axis first."""
    graphdef, state = nnx.split(model)

    def local(state: nnx.State, *local_args: Array) -> tuple[Array, Array, KVCaches, Array, Array]:
        m = nnx.merge(graphdef, state)
        hidden, rows_hidden, kv, aux, routed = replica_forward(m, *jax.tree.map(lambda x: x[0], local_args))
        return jax.tree.map(lambda x: x[None], (hidden, m.compute_logits(rows_hidden), kv, aux, routed))

    data = PartitionSpec("data")
    return jax.shard_map(local, mesh=kv_sharding.mesh, in_specs=(PartitionSpec(), *(data,) * len(args)),
                         out_specs=data, check_vma=False)(state, *args)


# Called after every step of `decode_loop`: (state, the step's batch, its aux hidden states, the KV slot of
# each row's previous position) -> state. EAGLE-3 engines fill the head's cache with it.
StepHook = Callable[[LoopState, DeviceBatch, Float[Array, "R T A"], Int[Array, "R T"]], LoopState]


def decode_loop(model: CausalLM, kv_caches: KVCaches, batch: DeviceBatch, state: LoopState, *, num_top: int,
                max_steps: int, kv_sharding: NamedSharding | None, aux_layers: tuple[int, ...] = (),
                after_step: StepHook | None = None, num_kept: int = 0, record_routing: bool = False
                ) -> tuple[KVCaches, SamplerOutput, LoopState]:
    """Up to `max_steps` decode steps in one device loop (multi-step decode); outputs are `[max_steps, R * N]`.

    Step t feeds each row the token sampled at step t - 1 at position `positions + t`. A row stays
    active for its `num_steps` steps or until it samples one of its `stop_ids`; an inactive row's K/V
    writes are dropped and its outputs ignored, and the loop ends when no row is active. Sampling
    keys depend on (seed, sample, position) only, so the tokens are those of as many single steps.
    `after_step` carries `state` through the loop (inactive rows' slots are out of range: dropped).
    """
    chunk, md, sampling = batch.loop, batch.md, batch.sampling
    _, num_pages, page_size = md.kernel.layout.geometry(kv_caches[0].shape[1:])
    num_slots = num_pages * page_size
    last = jnp.maximum(chunk.num_steps - 1, 0)  # [R, N] a row's last step

    def body(carry: tuple[Array, KVCaches, Array, Array, SamplerOutput, LoopState, LogitsAdjust | None]
             ) -> tuple[Array, KVCaches, Array, Array, SamplerOutput, LoopState, LogitsAdjust | None]:
        t, kv, token_ids, active, outs, state, adjust = carry
        positions = batch.positions + jnp.minimum(t, last)
        slots = paged_slots(md.page_indices, positions, page_size, num_slots, active)
        suppress = jnp.where((t < chunk.suppress_steps)[..., None], sampling.suppress_ids, -1)
        step = dataclasses.replace(
            batch, token_ids=token_ids, positions=positions,
            md=dataclasses.replace(md, slot_mapping=slots, kv_lens=jnp.where(chunk.num_steps > 0, positions + 1, 0)),
            sampling=dataclasses.replace(sampling, positions=positions + 1, suppress_ids=suppress, adjust=adjust),
            loop=None)
        kv, out, _, aux = forward_and_sample(model, kv, step, num_top=num_top, token_logprobs=False,
                                             aux_layers=aux_layers, kv_sharding=kv_sharding, num_kept=num_kept,
                                             record_routing=record_routing)
        if after_step is not None:
            prev_slots = paged_slots(md.page_indices, positions - 1, page_size, num_slots, active)
            state = after_step(state, step, aux, prev_slots)
        outs = jax.tree.map(lambda buf, x: buf.at[t].set(x), outs, out)
        sampled = out.token_ids.reshape(token_ids.shape).astype(token_ids.dtype)
        stopped = jnp.any(sampled[..., None] == chunk.stop_ids, axis=-1)
        if adjust is not None:  # later steps' penalties and bad words see this token
            adjust = jax.vmap(append_outputs)(adjust, sampled, active)
        return t + 1, kv, sampled, active & ~stopped & (t + 1 < chunk.num_steps), outs, state, adjust

    num_rows = batch.token_ids.shape[0] * batch.token_ids.shape[1]
    record = record_buffers(max_steps, num_rows, num_kept)
    if record_routing:
        cfg = model.config
        record["routed_experts"] = jnp.zeros((max_steps, num_rows, len(cfg.moe_layers), cfg.num_experts_per_tok),
                                             jnp.int32)
    outs = SamplerOutput(jnp.zeros((max_steps, num_rows), jnp.int32), jnp.zeros((max_steps, num_rows), jnp.float32),
                         jnp.zeros((max_steps, num_rows, num_top), jnp.int32),
                         jnp.zeros((max_steps, num_rows, num_top), jnp.float32), **record,
                         ranks=jnp.zeros((max_steps, num_rows), jnp.int32))
    carry = (jnp.int32(0), kv_caches, batch.token_ids, chunk.num_steps > 0, outs, state, sampling.adjust)
    _, kv_caches, _, _, outs, state, _ = jax.lax.while_loop(lambda c: jnp.any(c[3]), body, carry)
    return kv_caches, outs, state


def record_buffers(steps: int, num_rows: int, num_kept: int) -> dict[str, Array]:
    """A device loop's output buffers of the sampling record (`num_kept` > 0; none otherwise)."""
    if num_kept == 0:
        return {}
    return dict(kept_logmass=jnp.zeros((steps, num_rows), jnp.float32), kept_counts=jnp.zeros((steps, num_rows), jnp.int32),
                kept_ids=jnp.zeros((steps, num_rows, num_kept), jnp.int32))


def _decode_chunk(graphdef: nnx.GraphDef, params_def: jax.tree_util.PyTreeDef, rest_def: jax.tree_util.PyTreeDef,
                  kv_sharding: NamedSharding | None, param_leaves: list[Array], rest_leaves: list[Array],
                  kv_caches: KVCaches, batch: DeviceBatch, prev_last: Int[Array, "M"], *, num_top: int,
                  max_steps: int, num_kept: int = 0, record_routing: bool = False
                  ) -> tuple[KVCaches, SamplerOutput, Int[Array, "M"]]:
    """Multi-step decode (`decode_loop`) of the model given as leaves.

    Rows with `chunk.feed_rows >= 0` take their input token from `prev_last` (the previous call's last
    tokens, still on the device: a call launched before its predecessor's tokens reached the host).
    Returns the caches, every step's sampled rows, and each row's token of its last step, padded to M."""
    model = merge_leaves(graphdef, params_def, rest_def, param_leaves, rest_leaves)
    chunk = batch.loop
    fed = jnp.where(chunk.feed_rows >= 0, prev_last[jnp.maximum(chunk.feed_rows, 0)], batch.token_ids)
    batch = dataclasses.replace(batch, token_ids=fed.astype(batch.token_ids.dtype))
    kv_caches, outs, _ = decode_loop(model, kv_caches, batch, (), num_top=num_top, max_steps=max_steps,
                                     kv_sharding=kv_sharding, num_kept=num_kept, record_routing=record_routing)
    last_step = jnp.maximum(chunk.num_steps - 1, 0).reshape(-1)
    last = outs.token_ids[last_step, jnp.arange(last_step.shape[0])]
    return kv_caches, outs, jnp.zeros_like(prev_last).at[:last.shape[0]].set(last)


@functools.lru_cache(maxsize=None)
def compiled_step(graphdef: nnx.GraphDef, params_def: jax.tree_util.PyTreeDef, rest_def: jax.tree_util.PyTreeDef,
                  kv_sharding: NamedSharding | None = None
                  ) -> Callable[..., tuple[KVCaches, SamplerOutput, TokenLogprobs | None, Array]]:
    """The jitted step of one model structure and cache layout: engines over the same structure share
    compiled programs.

    It takes the parameters as flat lists of arrays, not `nnx.State`s: jit's per-call argument
    handling of ~300 `nnx.Variable` nodes cost ~1.5 ms per step on CPU (a B=1 decode step is ~35 ms).
    """
    return jax.jit(functools.partial(_step, graphdef, params_def, rest_def, kv_sharding),
                   static_argnames=("num_top", "token_logprobs", "aux_layers", "num_kept", "record_routing"), donate_argnums=(2,))


@functools.lru_cache(maxsize=None)
def compiled_chunk(graphdef: nnx.GraphDef, params_def: jax.tree_util.PyTreeDef, rest_def: jax.tree_util.PyTreeDef,
                   kv_sharding: NamedSharding | None = None) -> Callable[..., tuple[KVCaches, SamplerOutput]]:
    """The jitted multi-step decode program of one model structure (shared like `compiled_step`)."""
    return jax.jit(functools.partial(_decode_chunk, graphdef, params_def, rest_def, kv_sharding),
                   static_argnames=("num_top", "max_steps", "num_kept", "record_routing"), donate_argnums=(2,))
