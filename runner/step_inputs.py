"""Step inputs: the host-side `StepBatch`, its split over data-parallel replicas, and padding to a bucket.

`StepBatch` holds one step as exact-size numpy arrays in the engine's order. With data parallelism
each replica computes its own sequences against its own KV blocks: `split_replicas` cuts the batch
into per-replica parts (block ids made replica-local), `pad_replicas` pads every part to the same
bucket shape and stacks them on a leading replica axis (`[R, ...]`, split over the mesh's `data`
axis), and `ReplicaLayout` maps the padded outputs back to the engine's order.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Literal

import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from runner.attention import AttentionMetadata
from runner.buckets import BucketConfig, pick
from runner.logits_processors import AdjustRows, LogitsAdjust
from runner.sampling_rows import SamplingRows

SAMPLER_MODES = ("greedy", "random", "filtered")
MAX_SUPPRESS = 8  # ids a request may forbid per step (EOS + stop ids before min_tokens)
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


StepKind = Literal["prefill", "decode", "verify"]


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step as exact-size host arrays (S sequences, T tokens); built by the engine."""

    token_ids: np.ndarray  # [T] tokens whose K/V this step computes, packed by sequence
    positions: np.ndarray  # [T]
    q_lens: np.ndarray  # [S] tokens of each sequence in this step
    kv_lens: np.ndarray  # [S] context length of each sequence after this step
    block_tables: list[list[int]]  # [S][blocks] KV blocks of each sequence (global ids)
    sampling: SamplingRows  # [N] how each sampled row samples (N = S, or one per `logits_indices` entry)
    suppress_ids: np.ndarray  # [S, MAX_SUPPRESS] ids forbidden this step, -1 = none
    num_top_logprobs: int = 0
    sampling_record: bool = False  # also return each sampled row's kept mass and kept ids (`SamplerOutput`)
    adjust: AdjustRows | None = None  # [N] rows' logits processors; None: no row uses one
    # what the step does: "prefill" (prompt tokens, chunks, recomputation; samples after each sequence's
    # last token if it reaches its end), "decode" (one token per sequence, or `num_steps` in one device
    # loop) or "verify" (each sequence's last token and drafts, a sampled row per token)
    kind: StepKind = "prefill"
    target_ids: np.ndarray | None = None  # [T] next token of each position: asks for per-token logprobs
    # [N] packed tokens whose logits are sampled (speculative verification samples after every token);
    # None = the last token of each sequence. `sampling` then has N rows, not S.
    logits_indices: np.ndarray | None = None
    replicas: np.ndarray | None = None  # [S] data-parallel replica of each sequence; None = all on 0
    draft_ids: np.ndarray | None = None  # [N] draft token each sampled row verifies by rejection sampling (-1 none)
    # [T] drafts made on the device in the same program (EAGLE-3): token t is its sequence's draft
    # `draft_slots[t]` (-1: `token_ids[t]` as given); the rows' `draft_ids` then follow those drafts too.
    draft_slots: np.ndarray | None = None
    # Multi-step decode: the step runs up to max(num_steps) decode steps in one device loop, feeding
    # each sampled token back. With `draft_slots` (EAGLE-3), multi-step verification: the arrays have a
    # row per sampled row, holding its sequence's values. None = one plain step.
    num_steps: np.ndarray | None = None  # [S] decode steps of each sequence in this call (>= 1)
    suppress_steps: np.ndarray | None = None  # [S] of those, how many keep `suppress_ids` forbidden (min_tokens)
    stop_ids: np.ndarray | None = None  # [S, MAX_SUPPRESS] ids that end the sequence (EOS, stop ids), -1 = none
    # [S] multi-step decode launched before the previous call's tokens reached the host: the flat output
    # row of each sequence in the previous call, whose last token is its input (-1: `token_ids` as given)
    feed_rows: np.ndarray | None = None

    @property
    def is_decode(self) -> bool:
        return bool(np.all(self.q_lens == 1)) and self.target_ids is None and self.logits_indices is None

    @property
    def num_rows(self) -> int:
        """Sampled rows: one per sequence, or one per entry of `logits_indices`."""
        return len(self.sampling)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeChunk:
    """Per-row step counts of a multi-step decode call (padding rows run 0 steps)."""

    num_steps: Int[Array, "R N"]  # decode steps of each row; step t writes K/V only while t < num_steps
    suppress_steps: Int[Array, "R N"]  # steps during which the row's `suppress_ids` apply
    stop_ids: Int[Array, "R N M"]  # sampling one of these (-1 = none) ends the row's steps early
    feed_rows: Int[Array, "R N"]  # row of the previous call's last tokens that is this row's input (-1: none)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceBatch:
    """A padded `StepBatch` on the device; every array has a leading replica axis R."""

    token_ids: Int[Array, "R T"]
    positions: Int[Array, "R T"]
    md: AttentionMetadata  # each field [R, ...]
    logits_indices: Int[Array, "R N"]  # packed index of the token each sampled row samples after
    sampling: SamplingInputs  # each field [R, N, ...]
    mode: Int[Array, ""]  # index into SAMPLER_MODES (one per step)
    target_ids: Int[Array, "R T"]
    prev_slot_mapping: Int[Array, "R T"]  # KV slot of position - 1 of each token (out of range at 0 / padding)
    chunk: DecodeChunk | None = None  # multi-step decode; None = one step
    draft_slots: Int[Array, "R T"] | None = None  # see `StepBatch.draft_slots` (-1 at padding)


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """Where each sampled row and token of a `StepBatch` sits in the padded, flattened `[R * N]` outputs."""

    row_index: np.ndarray  # [num_rows] flat output row of each sampled row
    token_index: np.ndarray  # [T] flat output position of each token
    seq_index: np.ndarray  # [S] flat attention row of each sequence (its first query piece)


def sampler_mode(b: StepBatch) -> int:
    """The step's sampler mode (`runner.sampler.choose_mode`: filters count only in rows that sample or
    want processed logprobs)."""
    from runner.sampler import choose_mode  # runner.sampler imports this module

    r = b.sampling
    processed = r.processed | b.sampling_record  # a record describes the processed distribution, filters included
    return SAMPLER_MODES.index(choose_mode(r.temperature, r.top_k, r.top_p, r.min_p, processed=processed))


def split_replicas(b: StepBatch, num_replicas: int, blocks_per_replica: int
                   ) -> list[tuple[StepBatch, np.ndarray, np.ndarray]]:
    """Per replica: (its part with replica-local block ids, its rows' indices in `b`, its tokens' indices)."""
    if num_replicas == 1:  # the common case: the batch as it is, no copies
        return [(b, np.arange(b.num_rows), np.arange(len(b.token_ids)))]
    replicas = b.replicas if b.replicas is not None else np.zeros(len(b.q_lens), np.int64)
    token_seq = np.repeat(np.arange(len(b.q_lens)), b.q_lens)
    parts = []
    for r in range(num_replicas):
        seq_mask = replicas == r
        tok_mask = seq_mask[token_seq]
        local_token = np.cumsum(tok_mask) - 1
        rows = np.flatnonzero(seq_mask if b.logits_indices is None else tok_mask[b.logits_indices])
        row = lambda x: x[rows]  # noqa: E731
        offset = r * blocks_per_replica
        part = dataclasses.replace(
            b, token_ids=b.token_ids[tok_mask], positions=b.positions[tok_mask], q_lens=b.q_lens[seq_mask],
            kv_lens=b.kv_lens[seq_mask],
            block_tables=[[blk - offset for blk in t] for t, m in zip(b.block_tables, seq_mask) if m],
            sampling=b.sampling.take(rows), suppress_ids=row(b.suppress_ids),
            adjust=None if b.adjust is None else b.adjust.take(rows),
            target_ids=None if b.target_ids is None else b.target_ids[tok_mask],
            draft_ids=None if b.draft_ids is None else row(b.draft_ids),
            draft_slots=None if b.draft_slots is None else b.draft_slots[tok_mask],
            num_steps=None if b.num_steps is None else row(b.num_steps),
            suppress_steps=None if b.suppress_steps is None else row(b.suppress_steps),
            stop_ids=None if b.stop_ids is None else row(b.stop_ids),
            feed_rows=None if b.feed_rows is None else row(b.feed_rows),
            logits_indices=None if b.logits_indices is None else local_token[b.logits_indices[rows]].astype(np.int32),
            replicas=None)
        parts.append((part, rows, np.flatnonzero(tok_mask)))
    return parts


def pad_replicas(b: StepBatch, buckets: BucketConfig, block_size: int, num_replicas: int, blocks_per_replica: int,
                 *, on_mesh: bool = False) -> tuple[DeviceBatch, ReplicaLayout]:
    """Split `b` over replicas, pad every part to one bucket shape and stack them (pure numpy).
    Where the program maps over replicas (several of them, or `on_mesh`: a mesh maps even one)
    `trim_rows` stays off: under vmap its `lax.switch` would run every branch."""
    parts = split_replicas(b, num_replicas, blocks_per_replica)
    most_seqs = max(1, max(len(p.q_lens) for p, _, _ in parts))
    most_tokens = max(1, max(len(p.token_ids) for p, _, _ in parts))
    if b.is_decode:
        padded_tokens = rows = pick(buckets.seq_buckets, most_seqs)
        piece_len, num_pieces = 1, rows
    elif b.logits_indices is not None:  # speculative verification: a row per token
        padded_tokens = rows = pick(buckets.verify_buckets, most_tokens)
        # a sequence's k + 1 tokens in one attention row of exactly that many queries (not padded to
        # VERIFY_Q_LEN: fewer query rows; no wall-time change measured, docs/engineering-notes.md)
        piece_len = buckets.verify_rows or VERIFY_Q_LEN
        num_pieces = buckets.prefill_rows(padded_tokens)  # one attention row per sequence (>= 1 token each)
    else:
        padded_tokens = pick(buckets.token_buckets, most_tokens)
        rows = buckets.prefill_rows(padded_tokens)
        piece_len, num_pieces = buckets.query_block, buckets.prefill_pieces(padded_tokens)
    pages = pick(buckets.page_buckets, -(-int(np.max(b.kv_lens)) // block_size))
    trim = b.logits_indices is not None and num_replicas == 1 and not on_mesh
    shape = _Shape(padded_tokens, rows, piece_len, num_pieces, pages, block_size, blocks_per_replica, trim)
    padded = [_pad_one(p, shape) for p, _, _ in parts]
    stacked = jax.tree.map(lambda *xs: np.stack(xs) if len(xs) > 1 else xs[0][None], *padded)
    device_batch = dataclasses.replace(stacked, mode=np.int32(sampler_mode(b)))
    row_index = np.zeros(b.num_rows, np.int64)
    token_index = np.zeros(len(b.token_ids), np.int64)
    seq_index = np.zeros(len(b.q_lens), np.int64)
    replicas = b.replicas if b.replicas is not None and num_replicas > 1 else np.zeros(len(b.q_lens), np.int64)
    for r, (part, part_rows, part_tokens) in enumerate(parts):
        row_index[part_rows] = r * rows + np.arange(len(part_rows))
        token_index[part_tokens] = r * padded_tokens + np.arange(len(part_tokens))
        pieces = -(-part.q_lens // piece_len)
        seq_index[replicas == r] = r * num_pieces + np.cumsum(pieces) - pieces
    return device_batch, ReplicaLayout(row_index, token_index, seq_index)


@dataclasses.dataclass(frozen=True)
class _Shape:
    padded_tokens: int
    rows: int
    piece_len: int
    num_pieces: int
    pages: int
    block_size: int
    num_blocks: int  # per replica: slots past num_blocks * block_size are dropped
    trim_rows: bool = False  # see AttentionMetadata.trim_rows


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


def _pad_one(b: StepBatch, s: _Shape) -> DeviceBatch:
    """One replica's part padded to the bucket shape `s`, with its attention metadata."""
    page = s.block_size
    num_seqs, num_tokens = len(b.q_lens), len(b.token_ids)
    table = block_table_array(b.block_tables, s.pages)

    seq_of_token = np.repeat(np.arange(num_seqs), b.q_lens)
    pos = b.positions.astype(np.int64)
    slots = table[seq_of_token, pos // page].astype(np.int64) * page + pos % page
    slot_mapping = np.full(s.padded_tokens, s.num_blocks * page, np.int32)
    slot_mapping[:num_tokens] = slots
    prev = np.maximum(pos - 1, 0)
    prev_slots = np.where(pos > 0, table[seq_of_token, prev // page].astype(np.int64) * page + prev % page,
                          s.num_blocks * page)
    prev_slot_mapping = np.full(s.padded_tokens, s.num_blocks * page, np.int32)
    prev_slot_mapping[:num_tokens] = prev_slots

    # Split each sequence's queries into pieces of <= piece_len tokens (each a row of attention).
    pieces = -(-b.q_lens // s.piece_len)
    piece_seq = np.repeat(np.arange(num_seqs), pieces)
    piece_first = np.concatenate([[0], np.cumsum(pieces)[:-1]]).astype(np.int64)
    piece_rank = np.arange(len(piece_seq)) - piece_first[piece_seq]
    seq_start = np.concatenate([[0], np.cumsum(b.q_lens)[:-1]]).astype(np.int64)
    piece_start = seq_start[piece_seq] + piece_rank * s.piece_len
    piece_end = np.minimum(piece_start + s.piece_len, (seq_start + b.q_lens)[piece_seq])
    kv_start = (b.kv_lens - b.q_lens)[piece_seq]
    cu_q_lens = np.full(s.num_pieces + 1, num_tokens, np.int32)
    cu_q_lens[0] = 0
    cu_q_lens[1:len(piece_seq) + 1] = piece_end
    kv_lens = np.zeros(s.num_pieces, np.int32)
    kv_lens[:len(piece_seq)] = kv_start + (piece_end - seq_start[piece_seq])
    page_indices = np.zeros((s.num_pieces, s.pages), np.int32)
    page_indices[:len(piece_seq)] = table[piece_seq]

    def pad(x: np.ndarray, n: int, fill: float | int = 0, dtype: type = np.int32) -> np.ndarray:
        out = np.full((n, *x.shape[1:]), fill, dtype)
        out[:len(x)] = x
        return out

    logits_indices = np.cumsum(b.q_lens) - 1 if b.logits_indices is None else b.logits_indices
    sample_positions = b.positions[logits_indices] + 1
    rows = s.rows
    r = b.sampling
    sampling = SamplingInputs(
        temperature=pad(r.temperature, rows, 0.0, np.float32), top_k=pad(r.top_k, rows),
        top_p=pad(r.top_p, rows, 1.0, np.float32), min_p=pad(r.min_p, rows, 0.0, np.float32),
        seeds=pad(r.seeds, rows, 0, np.uint32), sample_index=pad(r.sample_index, rows),
        positions=pad(sample_positions, rows), processed=pad(r.processed, rows, False, np.bool_),
        suppress_ids=pad(b.suppress_ids, rows, -1),
        draft_ids=None if b.draft_ids is None else pad(b.draft_ids, rows, -1),
        want_logprob=pad(r.want_logprob, rows, False, np.bool_),
        adjust=None if b.adjust is None else b.adjust.padded(rows),
        as_logits=pad(r.as_logits, rows, False, np.bool_) if r.as_logits.any() else None)
    return DeviceBatch(
        token_ids=pad(b.token_ids, s.padded_tokens), positions=pad(b.positions, s.padded_tokens),
        md=AttentionMetadata(slot_mapping=slot_mapping, kv_lens=kv_lens, page_indices=page_indices,
                             cu_q_lens=cu_q_lens, num_seqs=np.array([len(piece_seq)], np.int32),
                             num_common_pages=np.array([num_common_pages(table, b.kv_lens - b.q_lens, page)], np.int32),
                             max_q_len=s.piece_len, trim_rows=s.trim_rows),
        logits_indices=pad(logits_indices, rows), sampling=sampling, mode=np.int32(0),
        target_ids=pad(b.target_ids if b.target_ids is not None else np.zeros(0, np.int32), s.padded_tokens),
        prev_slot_mapping=prev_slot_mapping,
        chunk=None if b.num_steps is None else DecodeChunk(
            pad(b.num_steps, rows), pad(b.suppress_steps, rows), pad(b.stop_ids, rows, -1),
            pad(b.feed_rows if b.feed_rows is not None else np.zeros(0, np.int32), rows, -1)),
        draft_slots=None if b.draft_slots is None else pad(b.draft_slots, s.padded_tokens, -1))
