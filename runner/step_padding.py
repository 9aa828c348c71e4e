"""A `StepPlan` padded to a bucket shape for the device: its split over data-parallel replicas, the padded
`DeviceBatch` (every array with a leading replica axis) and where the padded outputs map back.

With data parallelism each replica computes its own sequences against its own KV blocks: `split_replicas`
cuts the plan into per-replica parts (block ids made replica-local), `pad_plan` pads every part to the
bucket shape of the plan's kind (`BucketShape`, chosen by `runner.plan_programs.PROGRAMS`) and stacks them
(`[R, ...]`, split over the mesh's `data` axis), and `ReplicaLayout` maps the outputs to the plan's order.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from runner.attention import AttentionMetadata
from runner.buckets import BucketConfig, pick
from runner.logits_processors import LogitsAdjust
from runner.step_plan import StepPlan

# Most tokens a verification step's attention row holds (k <= 7); rows are k + 1 long where the buckets know k.
VERIFY_Q_LEN = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingInputs:
    """Per-row sampling settings, arrays over the padded batch of S rows."""

    temperature: Float[Array, "S"]  # < GREEDY_EPS (e.g. 0) = greedy
    top_k: Int[Array, "S"]  # <= 0 or >= V = off
    top_p: Float[Array, "S"]  # >= 1.0 = off
    min_p: Float[Array, "S"]  # <= 0.0 = off
    seeds: Int[Array, "S"]  # uint32/int32 per-request seed
    sample_index: Int[Array, "S"]  # which of the request's n samples this row is
    positions: Int[Array, "S"]  # absolute position of the token being sampled
    suppress_ids: Int[Array, "S M"]  # token ids forbidden this step (-1 = none), e.g. EOS before min_tokens
    processed: Bool[Array, "S"]  # logprobs of the processed distribution (True) or raw logits (False)
    # Speculative rejection sampling: the draft token each row verifies (-1 = none, a plain draw).
    # None (the default) compiles no verification code.
    draft_ids: Int[Array, "S"] | None = None
    # Rows whose sampled token's logprob is wanted (None: all); other rows' values are unspecified.
    # Without top-k: "greedy" and "filtered" skip the log-sum-exp when no row wants one (zeros),
    # "random" skips the raw one when no row wants it (its processed logprob comes from the draw's sums).
    want_logprob: Bool[Array, "S"] | None = None
    # vLLM's logits processors (penalties, bias, allowed ids, bad words); None: no row uses one
    adjust: LogitsAdjust | None = None
    # rows that report logits instead of logprobs (`logprobs_mode` "raw_logits" / "processed_logits");
    # None: none does
    as_logits: Bool[Array, "S"] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopChunk:
    """Per-row step counts of a device loop (padding rows run 0 steps)."""

    num_steps: Int[Array, "R N"]  # steps of each row; step t writes K/V only while t < num_steps
    suppress_steps: Int[Array, "R N"]  # steps during which the row's `suppress_ids` apply
    stop_ids: Int[Array, "R N M"]  # sampling one of these (-1 = none) ends the row's steps early
    feed_rows: Int[Array, "R N"]  # row of the previous call's last tokens that is this row's input (-1: none)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceBatch:
    """A padded `StepPlan` on the device; every array has a leading replica axis R."""

    token_ids: Int[Array, "R T"]
    positions: Int[Array, "R T"]
    md: AttentionMetadata  # each field [R, ...]
    logits_indices: Int[Array, "R N"]  # packed index of the token each sampled row samples after
    sampling: SamplingInputs  # each field [R, N, ...]
    mode: Int[Array, ""]  # index into SAMPLER_MODES (one per step)
    target_ids: Int[Array, "R T"]
    prev_slot_mapping: Int[Array, "R T"]  # KV slot of position - 1 of each token (out of range at 0 / padding)
    loop: LoopChunk | None = None  # a device loop; None = one step
    draft_slots: Int[Array, "R T"] | None = None  # see `DraftInputs.draft_slots` (-1 at padding)


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """Where each sampled row and token of a `StepPlan` sits in the padded, flattened `[R * N]` outputs."""

    row_index: np.ndarray  # [num_rows] flat output row of each sampled row
    token_index: np.ndarray  # [T] flat output position of each token
    seq_index: np.ndarray  # [S] flat attention row of each sequence (its first query piece)


@dataclasses.dataclass(frozen=True)
class PaddedShape:
    """A bucket shape of one step: padded tokens, sampled rows and attention rows (query pieces)."""

    padded_tokens: int
    rows: int
    piece_len: int  # most queries of one attention row
    num_pieces: int


BucketShape = Callable[[BucketConfig, int, int], PaddedShape]  # (buckets, most sequences, most tokens) -> shape


def ragged_shape(buckets: BucketConfig, most_seqs: int, most_tokens: int) -> PaddedShape:
    """A token bucket; each sequence's queries in pieces of at most `query_block` tokens."""
    tokens = pick(buckets.token_buckets, most_tokens)
    return PaddedShape(tokens, buckets.prefill_rows(tokens), buckets.query_block, buckets.prefill_pieces(tokens))


def decode_shape(buckets: BucketConfig, most_seqs: int, most_tokens: int) -> PaddedShape:
    """A sequence bucket: one token, one row and one attention row per sequence."""
    rows = pick(buckets.seq_buckets, most_seqs)
    return PaddedShape(rows, rows, 1, rows)


def verify_shape(buckets: BucketConfig, most_seqs: int, most_tokens: int) -> PaddedShape:
    """A verification bucket (a row per token); a sequence's k + 1 tokens in one attention row of exactly
    that many queries (not padded to VERIFY_Q_LEN: fewer query rows; docs/engineering-notes.md)."""
    tokens = pick(buckets.verify_buckets, most_tokens)
    return PaddedShape(tokens, tokens, buckets.verify_rows or VERIFY_Q_LEN, buckets.prefill_rows(tokens))


def split_replicas(plan: StepPlan, num_replicas: int, blocks_per_replica: int
                   ) -> list[tuple[StepPlan, np.ndarray, np.ndarray]]:
    """Per replica: (its part with replica-local block ids, its rows' indices in `plan`, its tokens' indices)."""
    t = plan.tokens
    if num_replicas == 1:  # the common case: the plan as it is, no copies
        return [(plan, np.arange(plan.num_rows), np.arange(len(t.token_ids)))]
    replicas = t.replicas if t.replicas is not None else np.zeros(len(t.q_lens), np.int64)
    token_seq = np.repeat(np.arange(len(t.q_lens)), t.q_lens)
    parts = []
    for r in range(num_replicas):
        seq_mask = replicas == r
        tok_mask = seq_mask[token_seq]
        rows = np.flatnonzero(seq_mask if plan.drafts is None else tok_mask[plan.drafts.logits_indices])
        part = StepPlan(plan.kind, t.select(seq_mask, tok_mask, r * blocks_per_replica), plan.sampling.take(rows),
                        None if plan.loop is None else plan.loop.take(rows),
                        None if plan.drafts is None else plan.drafts.select(rows, tok_mask))
        parts.append((part, rows, np.flatnonzero(tok_mask)))
    return parts


def pad_plan(plan: StepPlan, bucket_shape: BucketShape, buckets: BucketConfig, block_size: int, num_replicas: int,
             blocks_per_replica: int, *, on_mesh: bool = False) -> tuple[DeviceBatch, ReplicaLayout]:
    """Split `plan` over replicas, pad every part to one bucket shape and stack them (pure numpy).
    Where the program maps over replicas (several of them, or `on_mesh`: a mesh maps even one)
    `trim_rows` stays off: under vmap its `lax.switch` would run every branch."""
    parts = split_replicas(plan, num_replicas, blocks_per_replica)
    shape = bucket_shape(buckets, max(1, max(p.num_seqs for p, _, _ in parts)),
                         max(1, max(len(p.tokens.token_ids) for p, _, _ in parts)))
    pages = pick(buckets.page_buckets, -(-int(np.max(plan.tokens.kv_lens)) // block_size))
    trim = plan.drafts is not None and num_replicas == 1 and not on_mesh
    padded = [_pad_one(p, shape, pages, block_size, blocks_per_replica, trim) for p, _, _ in parts]
    stacked = jax.tree.map(lambda *xs: np.stack(xs) if len(xs) > 1 else xs[0][None], *padded)
    device_batch = dataclasses.replace(stacked, mode=np.int32(plan.sampling.mode))
    row_index = np.zeros(plan.num_rows, np.int64)
    token_index = np.zeros(len(plan.tokens.token_ids), np.int64)
    seq_index = np.zeros(plan.num_seqs, np.int64)
    replicas = (plan.tokens.replicas if plan.tokens.replicas is not None and num_replicas > 1
                else np.zeros(plan.num_seqs, np.int64))
    for r, (part, part_rows, part_tokens) in enumerate(parts):
        row_index[part_rows] = r * shape.rows + np.arange(len(part_rows))
        token_index[part_tokens] = r * shape.padded_tokens + np.arange(len(part_tokens))
        pieces = -(-part.tokens.q_lens // shape.piece_len)
        seq_index[replicas == r] = r * shape.num_pieces + np.cumsum(pieces) - pieces
    return device_batch, ReplicaLayout(row_index, token_index, seq_index)


def num_common_pages(table: np.ndarray, context_before_queries: np.ndarray, page_size: int) -> int:
    """Leading pages that every sequence's table shares (prefix-cached blocks of a common prompt) and
    that lie wholly before each sequence's first query: attention reads them once for the batch."""
    if len(table) == 0:
        return 0
    limit = min(int(np.min(context_before_queries)) // page_size, table.shape[1])
    same = np.all(table[:, :limit] == table[:1, :limit], axis=0)
    return limit if bool(same.all()) else int(np.argmin(same))


def block_table_array(block_tables: list[list[int]], width: int) -> np.ndarray:
    """[S, width] the tables' first `width` block ids each, zero-padded (one flat copy, no per-row numpy call)."""
    lengths = np.fromiter(map(len, block_tables), np.int64, len(block_tables))
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), np.int32, int(lengths.sum()))
    rows = np.repeat(np.arange(len(block_tables)), lengths)
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    table = np.zeros((len(block_tables), width), np.int32)
    keep = cols < width
    table[rows[keep], cols[keep]] = flat[keep]
    return table


def _pad(x: np.ndarray, n: int, fill: float | int = 0, dtype: type = np.int32) -> np.ndarray:
    out = np.full((n, *x.shape[1:]), fill, dtype)
    out[:len(x)] = x
    return out


def _pad_one(plan: StepPlan, s: PaddedShape, pages: int, page: int, num_blocks: int, trim_rows: bool) -> DeviceBatch:
    """One replica's part padded to the bucket shape `s`, with its attention metadata; slots past
    `num_blocks * page` (the replica's blocks) are dropped."""
    t = plan.tokens
    num_seqs, num_tokens = len(t.q_lens), len(t.token_ids)
    table = block_table_array(t.block_tables, pages)
    drop = num_blocks * page

    seq_of_token = np.repeat(np.arange(num_seqs), t.q_lens)
    pos = t.positions.astype(np.int64)
    slot_mapping = _pad(table[seq_of_token, pos // page].astype(np.int64) * page + pos % page, s.padded_tokens, drop)
    prev = np.maximum(pos - 1, 0)
    prev_slots = np.where(pos > 0, table[seq_of_token, prev // page].astype(np.int64) * page + prev % page, drop)
    prev_slot_mapping = _pad(prev_slots, s.padded_tokens, drop)

    # Split each sequence's queries into pieces of <= piece_len tokens (each a row of attention).
    pieces = -(-t.q_lens // s.piece_len)
    piece_seq = np.repeat(np.arange(num_seqs), pieces)
    piece_first = np.concatenate([[0], np.cumsum(pieces)[:-1]]).astype(np.int64)
    piece_rank = np.arange(len(piece_seq)) - piece_first[piece_seq]
    seq_start = np.concatenate([[0], np.cumsum(t.q_lens)[:-1]]).astype(np.int64)
    piece_start = seq_start[piece_seq] + piece_rank * s.piece_len
    piece_end = np.minimum(piece_start + s.piece_len, (seq_start + t.q_lens)[piece_seq])
    kv_start = (t.kv_lens - t.q_lens)[piece_seq]
    cu_q_lens = np.full(s.num_pieces + 1, num_tokens, np.int32)
    cu_q_lens[0] = 0
    cu_q_lens[1:len(piece_seq) + 1] = piece_end
    kv_lens = _pad(kv_start + (piece_end - seq_start[piece_seq]), s.num_pieces)

    logits_indices = np.cumsum(t.q_lens) - 1 if plan.drafts is None else plan.drafts.logits_indices
    rows, r = s.rows, plan.sampling.rows
    sampling = SamplingInputs(
        temperature=_pad(r.temperature, rows, 0.0, np.float32), top_k=_pad(r.top_k, rows),
        top_p=_pad(r.top_p, rows, 1.0, np.float32), min_p=_pad(r.min_p, rows, 0.0, np.float32),
        seeds=_pad(r.seeds, rows, 0, np.uint32), sample_index=_pad(r.sample_index, rows),
        positions=_pad(t.positions[logits_indices] + 1, rows), processed=_pad(r.processed, rows, False, np.bool_),
        suppress_ids=_pad(plan.sampling.suppress_ids, rows, -1),
        draft_ids=None if plan.drafts is None or plan.drafts.draft_ids is None else _pad(plan.drafts.draft_ids, rows, -1),
        want_logprob=_pad(r.want_logprob, rows, False, np.bool_),
        adjust=None if plan.sampling.adjust is None else plan.sampling.adjust.padded(rows),
        as_logits=_pad(r.as_logits, rows, False, np.bool_) if r.as_logits.any() else None)
    loop = plan.loop
    draft_slots = None if plan.drafts is None else plan.drafts.draft_slots
    return DeviceBatch(
        token_ids=_pad(t.token_ids, s.padded_tokens), positions=_pad(t.positions, s.padded_tokens),
        md=AttentionMetadata(slot_mapping=slot_mapping, kv_lens=kv_lens, page_indices=_pad(table[piece_seq], s.num_pieces),
                             cu_q_lens=cu_q_lens, num_seqs=np.array([len(piece_seq)], np.int32),
                             num_common_pages=np.array([num_common_pages(table, t.kv_lens - t.q_lens, page)], np.int32),
                             max_q_len=s.piece_len, trim_rows=trim_rows),
        logits_indices=_pad(logits_indices, rows), sampling=sampling, mode=np.int32(0),
        target_ids=_pad(t.target_ids if t.target_ids is not None else np.zeros(0, np.int32), s.padded_tokens),
        prev_slot_mapping=prev_slot_mapping,
        loop=None if loop is None else LoopChunk(
            _pad(loop.num_steps, rows), _pad(loop.suppress_steps, rows), _pad(loop.stop_ids, rows, -1),
            _pad(loop.feed_rows if loop.feed_rows is not None else np.zeros(0, np.int32), rows, -1)),
        draft_slots=None if draft_slots is None else _pad(draft_slots, s.padded_tokens, -1))
