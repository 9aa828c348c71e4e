"""The EAGLE-3 head's device programs, pure functions of flat leaf lists (`Eagle3Drafter` holds the state).

- `_fill`: after a target step that verifies nothing (prefill, plain decode), store g = fc(aux) of every
  computed token and the head's K/V at p - 1 for every token fed at p.
- `_draft_verify`: one speculative step: the head drafts k tokens per sequence (`lax.scan`), the target
  verifies them and samples after every position, the fill follows.
- `_draft_verify_steps`: several such steps in a `lax.while_loop`, the device accepting as the host would.
- `_decode_chunk_fill`: multi-step plain decode with the fill after every step (auto-disabled steps).

`compiled_programs` jits them once per (head, target) structure and cache layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.tree_util import PyTreeDef
from jaxtyping import Array, Bool, Float, Int

from runner.attention import paged_slots
from runner.models.family import KVCaches
from runner.sampler import SamplerOutput
from runner.spec_decode.eagle3 import DraftCache, DraftChain, Eagle3Head, draft_paged, fill_cache
from runner.step_padding import DeviceBatch
from runner.step_program import decode_loop, forward_and_sample, merge_leaves, record_buffers


# Tree structures of (head params, head rest, target params, target rest): the jitted programs take
# flat leaf lists, which jit handles ~2x faster per call than `nnx.State`s (see `runner.model_runner`).
TreeDefs = tuple[PyTreeDef, PyTreeDef, PyTreeDef, PyTreeDef]
TargetLeaves = tuple[list[Array], list[Array]]  # the target's params and rest as leaf lists (`ModelRunner`)


def _per_replica(fn: Callable[..., tuple], num_replicas: int, on_mesh: bool, *args: Array) -> tuple:
    """`fn` over the leading replica axis (no vmap for one replica on one device: the plain program;
    see `runner.step_program` for why a mesh keeps the vmap)."""
    if num_replicas == 1 and not on_mesh:
        return jax.tree.map(lambda x: x[None], fn(*jax.tree.map(lambda x: x[0], args)))
    return jax.vmap(fn)(*args)


CacheShardings = tuple[NamedSharding, NamedSharding]  # (kv, hidden) of the head's cache


def _pinned(cache: DraftCache, shardings: CacheShardings | None) -> DraftCache:
    """The cache in its own layout (XLA's propagation alone handed it back with the head axis replicated)."""
    if shardings is None:
        return cache
    return DraftCache(jax.lax.with_sharding_constraint(cache.kv, shardings[0]),
                      jax.lax.with_sharding_constraint(cache.hidden, shardings[1]))


def _fill(head_gd: nnx.GraphDef, target_gd: nnx.GraphDef, defs: TreeDefs, shardings: CacheShardings | None,
          head_params: list[Array],
          head_rest: list[Array], params: list[Array], rest: list[Array], cache: DraftCache,
          aux: Float[Array, "R T A"], batch: DeviceBatch) -> DraftCache:
    head = merge_leaves(head_gd, defs[0], defs[1], head_params, head_rest)
    target = merge_leaves(target_gd, defs[2], defs[3], params, rest)
    return _fill_after(head, target, cache.kv, cache.hidden, aux, batch, batch.md.slot_mapping,
                       batch.prev_slot_mapping, shardings)


def place_drafts(batch: DeviceBatch, drafts: Int[Array, "R S K"]) -> DeviceBatch:
    """`batch` with each sequence's drafts (per attention row) in the tokens its `draft_slots` name and,
    under rejection sampling, in the `draft_ids` of the rows that verify them (row r verifies the
    draft that follows its token)."""
    num_drafts = drafts.shape[-1]

    def insert(token_ids: Array, slots: Array, cu_q_lens: Array, seq_drafts: Array) -> Array:
        t = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
        seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, seq_drafts.shape[0] - 1)
        made = seq_drafts[seq, jnp.clip(slots, 0, num_drafts - 1)].astype(token_ids.dtype)
        return jnp.where(slots >= 0, made, token_ids)

    token_ids = jax.vmap(insert)(batch.token_ids, batch.draft_slots, batch.md.cu_q_lens, drafts)
    sampling = batch.sampling
    if sampling.draft_ids is not None:
        follows = jnp.pad(jnp.where(batch.draft_slots[:, 1:] >= 0, token_ids[:, 1:], -1), ((0, 0), (0, 1)),
                          constant_values=-1)
        at_rows = jnp.take_along_axis(follows, batch.logits_indices, axis=1)
        real_rows = jnp.arange(at_rows.shape[1])[None, :] < batch.md.cu_q_lens[:, -1:]  # padding rows keep -1
        sampling = dataclasses.replace(
            sampling, draft_ids=jnp.where(real_rows & (at_rows >= 0), at_rows, sampling.draft_ids))
    return dataclasses.replace(batch, token_ids=token_ids, sampling=sampling)


def first_token_batch(batch: DeviceBatch, rows: int, num_slots: int) -> DeviceBatch:
    """The plain decode step inside a verification batch: each sequence's first token (the one it feeds,
    its drafts dropped), `rows` sequences per replica; `num_slots` (out of range) drops padding writes."""
    md = batch.md
    first = md.cu_q_lens[:, :rows]  # [R, rows]
    valid = jnp.arange(rows)[None, :] < md.num_seqs
    at = lambda x: jnp.take_along_axis(x, first, axis=1, mode="clip")  # noqa: E731
    drop = lambda x: jnp.where(valid, x, num_slots)  # noqa: E731
    q_lens = md.cu_q_lens[:, 1:rows + 1] - first
    plain_md = dataclasses.replace(
        md, slot_mapping=drop(at(md.slot_mapping)), kv_lens=jnp.where(valid, md.kv_lens[:, :rows] - q_lens + 1, 0),
        page_indices=md.page_indices[:, :rows], cu_q_lens=jnp.minimum(jnp.arange(rows + 1)[None, :], md.num_seqs),
        max_q_len=1)
    sampling = jax.tree.map(jax.vmap(lambda x, i: jnp.take(x, i, axis=0, mode="clip")), batch.sampling,
                            jax.tree.map(lambda _: first, batch.sampling))
    if sampling.draft_ids is not None:  # a plain draw, whatever the verification mode
        sampling = dataclasses.replace(sampling, draft_ids=jnp.full_like(sampling.draft_ids, -1))
    return DeviceBatch(token_ids=at(batch.token_ids), positions=at(batch.positions), md=plain_md,
                       logits_indices=jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32), first.shape),
                       sampling=sampling, mode=batch.mode, target_ids=jnp.zeros_like(first),
                       prev_slot_mapping=drop(at(batch.prev_slot_mapping)))


def _draft(head: Eagle3Head, target: nnx.Module, cache: DraftCache, batch: DeviceBatch, num_steps: int,
           on_mesh: bool) -> tuple[Array, Int[Array, "R S K"], DraftChain]:
    """The head's `num_steps` drafts per sequence from the first token each sequence feeds (its drafts
    follow it in `batch`): the head's K/V cache, the drafts and the chain after step 0."""
    md = batch.md

    def draft(kv: Array, hid: Array, token_ids: Array, positions: Array, cu_q_lens: Array, pages: Array,
              num_seqs: Array) -> tuple[Array, Array, DraftChain]:
        first = cu_q_lens[:-1]  # each sequence's first token: the one it feeds at c (its drafts follow)
        last = jnp.take(token_ids, first, mode="clip")
        return draft_paged(head, target, kv, hid, last, jnp.take(positions, first, mode="clip") - 1, pages, num_seqs,
                           num_steps=num_steps, kernel=md.kernel.head_kernel())

    return _per_replica(draft, cache.kv.shape[0], on_mesh, cache.kv, cache.hidden, batch.token_ids, batch.positions,
                        md.cu_q_lens, md.page_indices, md.num_seqs)


def _fill_after(head: Eagle3Head, target: nnx.Module, head_kv: Array, hidden: Array, aux: Float[Array, "R T A"],
                placed: DeviceBatch, slots: Int[Array, "R T"], prev_slots: Int[Array, "R T"],
                shardings: CacheShardings | None) -> DraftCache:
    """The head's cache after a target step (`fill_cache` per replica): what the target computed at
    `placed`'s tokens, written at `slots`, with the head's K/V at `prev_slots`."""
    fn = functools.partial(fill_cache, head, target, kernel=placed.md.kernel.head_kernel())
    head_kv, hidden = _per_replica(fn, head_kv.shape[0], shardings is not None, head_kv, hidden, aux, placed.token_ids,
                                   placed.positions, slots, prev_slots)
    return _pinned(DraftCache(head_kv, hidden), shardings)


def _draft_verify(head_gd: nnx.GraphDef, target_gd: nnx.GraphDef, defs: TreeDefs, shardings: CacheShardings | None,
                  kv_sharding: NamedSharding | None, head_params: list[Array], head_rest: list[Array],
                  params: list[Array], rest: list[Array], kv_caches: KVCaches, cache: DraftCache, batch: DeviceBatch,
                  min_confidence: Float[Array, ""], *, num_top: int, aux_layers: tuple[int, ...], num_steps: int,
                  plain_rows: int, num_kept: int = 0
                  ) -> tuple[KVCaches, DraftCache, SamplerOutput, Int[Array, "R S K"], Bool[Array, ""]]:
    """Draft, verify and fill in one program: the head drafts `num_steps` tokens per sequence from the
    first token each sequence feeds, the drafts take the tokens `batch.draft_slots` names, the target
    verifies them (`runner.step_program`) and the head's cache takes what the target computed.

    `plain_rows > 0`: when the head's first draft has probability below `min_confidence` for every
    sequence, the step decodes plainly instead (`first_token_batch`, at most `plain_rows` sequences per
    replica): the sampled tokens land in each sequence's first row, the drafts come back as -1 and the
    returned flag is False. One program instead of three saves two calls and a round trip to the host
    per step (a B=1 step's host work is a large part of its time on CPU).
    """
    head = merge_leaves(head_gd, defs[0], defs[1], head_params, head_rest)
    target = merge_leaves(target_gd, defs[2], defs[3], params, rest)
    md = batch.md
    head_kv, drafts, chain = _draft(head, target, cache, batch, num_steps, shardings is not None)
    placed = place_drafts(batch, drafts)

    def verify(kv_caches: KVCaches) -> tuple:
        kv_caches, out, _, aux = forward_and_sample(target, kv_caches, placed, num_top=num_top, token_logprobs=False,
                                                     aux_layers=aux_layers, kv_sharding=kv_sharding, num_kept=num_kept)
        return kv_caches, out, aux, placed.md.slot_mapping, placed.prev_slot_mapping

    def plain(kv_caches: KVCaches) -> tuple:
        """Each sequence's first token alone; outputs laid out as the verification's (its first row / token)."""
        _, num_pages, page_size = md.kernel.layout.geometry(kv_caches[0].shape[1:])
        num_slots = num_pages * page_size
        b = first_token_batch(batch, plain_rows, num_slots)
        kv_caches, out, _, aux = forward_and_sample(target, kv_caches, b, num_top=num_top, token_logprobs=False,
                                                     aux_layers=aux_layers, kv_sharding=kv_sharding, num_kept=num_kept)
        r, n = batch.logits_indices.shape  # rows = tokens: sequence s samples in row / token cu_q_lens[s]
        valid = jnp.arange(plain_rows)[None, :] < md.num_seqs
        at = jnp.where(valid, jnp.arange(r)[:, None] * n + md.cu_q_lens[:, :plain_rows], r * n).reshape(-1)
        spread = lambda x, fill: jnp.full((r * n, *x.shape[1:]), fill, x.dtype).at[at].set(x, mode="drop")  # noqa: E731
        flat = lambda x: x.reshape(r * plain_rows, *x.shape[2:])  # noqa: E731
        out = jax.tree.map(lambda x: spread(x, 0), out)  # already [R * rows, ...]
        slots = [spread(flat(x), num_slots).reshape(r, n) for x in (b.md.slot_mapping, b.prev_slot_mapping)]
        return kv_caches, out, spread(flat(aux), 0).reshape(r, n, aux.shape[-1]), *slots

    unsure = jnp.max(chain.confidence) < min_confidence if plain_rows else jnp.bool_(False)
    if plain_rows:
        kv_caches, out, aux, slots, prev_slots = jax.lax.cond(unsure, plain, verify, kv_caches)
    else:
        kv_caches, out, aux, slots, prev_slots = verify(kv_caches)
    # the head's fill after the branch: caches passed through a cond came back as copies (XLA:CPU)
    cache = _fill_after(head, target, head_kv, cache.hidden, aux, placed, slots, prev_slots, shardings)
    return kv_caches, cache, out, jnp.where(unsure, -1, drafts), ~unsure


def _draft_verify_steps(head_gd: nnx.GraphDef, target_gd: nnx.GraphDef, defs: TreeDefs,
                        shardings: CacheShardings | None, kv_sharding: NamedSharding | None, head_params: list[Array],
                        head_rest: list[Array], params: list[Array], rest: list[Array], kv_caches: KVCaches,
                        cache: DraftCache, batch: DeviceBatch, *, num_top: int, aux_layers: tuple[int, ...],
                        num_steps: int, max_iters: int, num_kept: int = 0
                        ) -> tuple[KVCaches, DraftCache, SamplerOutput, Int[Array, "I R S K"]]:
    """Up to `max_iters` whole speculative steps (draft, verify, fill) in one device loop, exact replay only.

    `batch` is the first step's verification batch: every sequence feeds its last token and `num_steps`
    drafts (`draft_slots`), and its `chunk` holds, per row, the steps its sequence runs
    (`num_steps`, per sequence: as many as fit before `max_model_len` and no more than its `max_tokens`
    could use; tokens past `max_tokens` are dropped by the host, and the scheduler made room for every
    step's k + 1 positions in the KV cache), how many more of
    its tokens suppress `suppress_ids` (`min_tokens`) and its `stop_ids`. After each step, on the
    device, a sequence accepts its drafts while they equal the target's tokens, and its next step
    feeds the last target token at the next position; it stops after a step that emitted a stop id.
    Returns every step's sampled rows `[I, R * T]` and drafts `[I, R, S, K]` (steps after a sequence
    stopped: ignore); the host replays acceptance from them (`OutputProcessor.process_verify_steps`).
    """
    head = merge_leaves(head_gd, defs[0], defs[1], head_params, head_rest)
    target = merge_leaves(target_gd, defs[2], defs[3], params, rest)
    md, chunk, sampling = batch.md, batch.loop, batch.sampling
    _, num_pages, page = md.kernel.layout.geometry(kv_caches[0].shape[1:])
    num_slots = num_pages * page
    num_replicas, num_tokens = batch.token_ids.shape
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jax.vmap(lambda cu: jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, cu.shape[0] - 2))(md.cu_q_lens)
    first = md.cu_q_lens[:, :-1]  # [R, S] each sequence's first token / row
    rank = t[None, :] - jnp.take_along_axis(first, seq, axis=1)  # [R, T] 0 = the fed token, j = draft j - 1
    real = t[None, :] < md.cu_q_lens[:, -1:]
    per_seq = lambda x: jnp.take_along_axis(x, first.reshape(num_replicas, -1, *([1] * (x.ndim - 2))), axis=1,  # noqa: E731
                                                mode="clip")
    at_seq = lambda x: jnp.take_along_axis(x, seq, axis=1)  # noqa: E731  [R, S] -> [R, T]
    pages_of_token = jnp.take_along_axis(md.page_indices, seq[..., None], axis=1)  # [R, T, W]
    slot_of = lambda pos, ok: paged_slots(pages_of_token, pos, page, num_slots, ok)  # noqa: E731

    seq_real = jnp.arange(first.shape[1])[None, :] < md.num_seqs
    iters, suppress_steps = per_seq(chunk.num_steps), per_seq(chunk.suppress_steps)
    stop_ids = per_seq(chunk.stop_ids)  # [R, S, MAX_SUPPRESS]
    num_rows = num_replicas * num_tokens
    outs = SamplerOutput(jnp.zeros((max_iters, num_rows), jnp.int32), jnp.zeros((max_iters, num_rows), jnp.float32),
                             jnp.zeros((max_iters, num_rows, num_top), jnp.int32),
                             jnp.zeros((max_iters, num_rows, num_top), jnp.float32),
                             ranks=jnp.zeros((max_iters, num_rows), jnp.int32), **record_buffers(max_iters, num_rows, num_kept))
    all_drafts = jnp.zeros((max_iters, *first.shape, num_steps), jnp.int32)

    def body(carry: tuple) -> tuple:
        it, kv_caches, cache, fed, last, emitted, active, outs, all_drafts = carry
        pos = at_seq(fed) + rank
        ok = real & at_seq(active)
        slots, prev_slots = slot_of(pos, ok), slot_of(pos - 1, ok)
        suppress = jnp.where((at_seq(emitted) + rank < at_seq(suppress_steps))[..., None], sampling.suppress_ids, -1)
        step = dataclasses.replace(
            batch, token_ids=jnp.where(rank == 0, at_seq(last), batch.token_ids), positions=pos,
            md=dataclasses.replace(md, slot_mapping=slots, kv_lens=jnp.where(seq_real, fed + num_steps + 1, 0)),
            prev_slot_mapping=prev_slots, loop=None,
            sampling=dataclasses.replace(sampling, positions=pos + 1, suppress_ids=suppress))
        head_kv, drafts, _ = _draft(head, target, cache, step, num_steps, shardings is not None)
        placed = place_drafts(step, drafts)
        kv_caches, out, _, aux = forward_and_sample(target, kv_caches, placed, num_top=num_top,
                                                         token_logprobs=False, aux_layers=aux_layers,
                                                         kv_sharding=kv_sharding, num_kept=num_kept)
        cache = _fill_after(head, target, head_kv, cache.hidden, aux, placed, slots, prev_slots, shardings)
        rows = first[..., None] + jnp.arange(num_steps + 1)  # [R, S, K + 1]
        sampled = jnp.take_along_axis(out.token_ids.reshape(num_replicas, num_tokens),
                                          rows.reshape(num_replicas, -1), axis=1, mode="clip").reshape(rows.shape)
        accepted = jnp.sum(jnp.cumprod(drafts == sampled[..., :-1], axis=-1), axis=-1)  # [R, S]
        kept = jnp.arange(num_steps + 1) <= accepted[..., None]
        stopped = jnp.any(kept & jnp.any(sampled[..., None] == stop_ids[:, :, None, :], axis=-1), axis=-1)
        nxt = jnp.take_along_axis(sampled, accepted[..., None], axis=-1)[..., 0]
        outs = jax.tree.map(lambda buf, x: buf.at[it].set(x), outs, out)
        return (it + 1, kv_caches, cache, jnp.where(active, fed + accepted + 1, fed), jnp.where(active, nxt, last),
                jnp.where(active, emitted + accepted + 1, emitted), active & ~stopped & (it + 1 < iters), outs,
                all_drafts.at[it].set(drafts))

    carry = (jnp.int32(0), kv_caches, cache, per_seq(batch.positions), per_seq(batch.token_ids),
             jnp.zeros_like(first), seq_real & (iters > 0), outs, all_drafts)
    _, kv_caches, cache, _, _, _, _, outs, all_drafts = jax.lax.while_loop(lambda c: jnp.any(c[6]), body, carry)
    return kv_caches, cache, outs, all_drafts


def _decode_chunk_fill(head_gd: nnx.GraphDef, target_gd: nnx.GraphDef, defs: TreeDefs,
                      shardings: CacheShardings | None, kv_sharding: NamedSharding | None, head_params: list[Array],
                      head_rest: list[Array], params: list[Array], rest: list[Array], kv_caches: KVCaches,
                      cache: DraftCache, batch: DeviceBatch, *, num_top: int, aux_layers: tuple[int, ...],
                      max_steps: int, num_kept: int = 0) -> tuple[KVCaches, DraftCache, SamplerOutput]:
    """Multi-step plain decode (`runner.step_program.decode_loop`) with the head's cache filled after every
    step, as `_fill` does after a single step: the steps that auto-disable takes off drafting."""
    head = merge_leaves(head_gd, defs[0], defs[1], head_params, head_rest)
    target = merge_leaves(target_gd, defs[2], defs[3], params, rest)

    def fill(cache: DraftCache, step: DeviceBatch, aux: Float[Array, "R T A"], prev_slots: Int[Array, "R T"]
             ) -> DraftCache:
        return _fill_after(head, target, cache.kv, cache.hidden, aux, step, step.md.slot_mapping, prev_slots,
                           shardings)

    kv_caches, outs, cache = decode_loop(target, kv_caches, batch, cache, num_top=num_top, max_steps=max_steps,
                                         kv_sharding=kv_sharding, aux_layers=aux_layers, after_step=fill,
                                         num_kept=num_kept)
    return kv_caches, cache, outs


@functools.lru_cache(maxsize=None)
def compiled_programs(head_gd: nnx.GraphDef, target_gd: nnx.GraphDef, defs: TreeDefs, shardings: CacheShardings | None,
              kv_sharding: NamedSharding | None
              ) -> tuple[Callable[..., DraftCache], Callable[..., tuple], Callable[..., tuple], Callable[..., tuple]]:
    """The jitted fill, draft-verify, multi-step draft-verify and multi-step plain decode programs of one
    (head, target) structure and cache layout, shared by engines."""
    fill = jax.jit(functools.partial(_fill, head_gd, target_gd, defs, shardings), donate_argnums=(4,))
    verify = jax.jit(functools.partial(_draft_verify, head_gd, target_gd, defs, shardings, kv_sharding),
                     static_argnames=("num_top", "aux_layers", "num_steps", "plain_rows", "num_kept"), donate_argnums=(4, 5))
    verify_steps = jax.jit(functools.partial(_draft_verify_steps, head_gd, target_gd, defs, shardings, kv_sharding),
                           static_argnames=("num_top", "aux_layers", "num_steps", "max_iters", "num_kept"),
                           donate_argnums=(4, 5))
    decode_chunk = jax.jit(functools.partial(_decode_chunk_fill, head_gd, target_gd, defs, shardings, kv_sharding),
                           static_argnames=("num_top", "aux_layers", "max_steps", "num_kept"), donate_argnums=(4, 5))
    return fill, verify, verify_steps, decode_chunk
