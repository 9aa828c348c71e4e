"""The pure-JAX ragged paged attention: the reference of every attention kernel and the path of every
step no kernel takes (prefill, chunked prefill, mixed and verification steps; windowed or soft-capped
layers). It gathers each request's pages once, a few pages at a time (never a copy of the context per
query token), and its cost follows the step's longest live context, never `max_model_len`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from runner.kv_layout import KVLayout

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


MULTIPLY_REDUCE_MAX_ROWS = 24  # query rows per (sequence, KV head) up to which scores skip the dot


def ragged_paged_attention(
    queries: Float[Array, "T Hq D"],
    kv_pages: Float[Array, "2 Hkv P page D"],
    kv_lens: Int[Array, "S"],
    page_indices: Int[Array, "S W"],
    cu_q_lens: Int[Array, "S+1"],
    num_seqs: Int[Array, "1"],
    *,
    sm_scale: float,
    max_q_len: int,
    pages_per_chunk: int = 2,
    num_common_pages: Int[Array, "1"] | None = None,
    trim_rows: bool = False,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    layout: KVLayout = KVLayout(),
) -> Float[Array, "T Hq D"]:
    """Causal attention of packed queries over each sequence's paged context (pure JAX reference), over a
    cache in `layout` (`runner.kv_layout`).

    `sliding_window`: a query at position p attends keys at positions > p - window only, and the walk
    starts at the first chunk any row's window reaches. `soft_cap`: scores (after `sm_scale`) become
    `cap * tanh(s / cap)` before the softmax.

    Walks the context `pages_per_chunk` pages at a time (`lax.while_loop`, online softmax) up to the
    longest real context in the step, so the cost follows the live context, not the padded width of
    `page_indices`. Each chunk of every sequence's pages is gathered once (whole
    pages of contiguous `[page, D]` memory per head) and consumed while it is still in cache.

    Prefill steps (query pieces of more than `MULTIPLY_REDUCE_MAX_ROWS` rows per KV head, more than
    `PIECES_PER_GROUP` pieces) run their pieces in
    groups of `PIECES_PER_GROUP`, only as many groups as hold real rows (`num_seqs`), each group's
    walk ending at its own longest context: a step's padded rows cost nothing, and short prompts
    batched with a long one do not walk its context. `trim_rows`: other steps attend only the first
    1, 2, 4, ... rows that hold all `num_seqs` real ones (`lax.switch`), e.g. one sequence's
    verification step in a program whose rows are bucketed for up to `max_num_seqs` sequences.

    Cascade: the first `num_common_pages` pages (the same in every real sequence's table, e.g. a
    shared system prompt or the prompt of n samples, and before every query) are gathered once for
    the whole batch (per group) and attended by all query rows as one matmul; each sequence's own
    loop then starts after them. It changes only the order of the softmax sums.
    """
    num_tokens, num_q_heads, head_dim = queries.shape
    num_rows, pages_per_seq = page_indices.shape
    num_kv_heads = layout.geometry(kv_pages.shape)[0]
    group = num_q_heads // num_kv_heads
    rows = group * max_q_len  # query rows per (sequence, KV head): row = g * max_q_len + i

    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    q_offsets = jnp.arange(max_q_len, dtype=jnp.int32)
    q_index = cu_q_lens[:-1, None] + q_offsets[None, :]  # [S, Qm]
    q = jnp.take(queries, q_index.reshape(-1), axis=0, mode="clip")
    q = q.reshape(num_rows, max_q_len, num_kv_heads, group, head_dim).transpose(2, 0, 3, 1, 4)
    q = (q.astype(jnp.float32) * sm_scale).astype(queries.dtype).reshape(num_kv_heads, num_rows, rows, head_dim)
    q_pos = jnp.tile((kv_lens - q_lens)[:, None] + q_offsets[None, :], (1, group))  # [S, rows] absolute position
    common = _CommonPages(page_indices[0], num_common_pages[0]) if num_common_pages is not None else None
    if common is not None and sliding_window is not None:
        raise ValueError("the cascade (num_common_pages) cannot be combined with a sliding window")
    attend = functools.partial(_attend_rows, kv_pages=kv_pages, layout=layout, common=common,
                               pages_per_chunk=pages_per_chunk, sliding_window=sliding_window, soft_cap=soft_cap)

    if rows > MULTIPLY_REDUCE_MAX_ROWS and num_rows > PIECES_PER_GROUP:  # prefill pieces (not decode / verification)
        size = PIECES_PER_GROUP
        padded = -(-num_rows // size) * size
        pad = lambda x, axis: jnp.pad(x, [(0, padded - num_rows if a == axis else 0) for a in range(x.ndim)])  # noqa: E731
        q, page_indices, kv_lens, q_pos = pad(q, 1), pad(page_indices, 0), pad(kv_lens, 0), pad(q_pos, 0)

        def group_body(carry: tuple[Array, Array]) -> tuple[Array, Array]:
            g, out = carry
            take = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, g * size, size, axis)  # noqa: E731
            part = attend(take(q, 1), take(page_indices, 0), take(kv_lens, 0), take(q_pos, 0))
            return g + 1, jax.lax.dynamic_update_slice_in_dim(out, part, g * size, axis=1)

        num_groups = jnp.minimum(-(-num_seqs[0] // size), padded // size)
        init = (jnp.int32(0), jnp.zeros((num_kv_heads, padded, rows, head_dim), jnp.float32))
        _, out = jax.lax.while_loop(lambda carry: carry[0] < num_groups, group_body, init)
        out = out[:, :num_rows]
    elif trim_rows and num_rows > 1:
        sizes = [1 << i for i in range((num_rows - 1).bit_length())] + [num_rows]  # 1, 2, 4, ... < num_rows

        def first_rows(size: int) -> Callable[[Array, Array, Array, Array], Array]:
            def run(q: Array, page_indices: Array, kv_lens: Array, q_pos: Array) -> Array:
                part = attend(q[:, :size], page_indices[:size], kv_lens[:size], q_pos[:size])
                return jnp.pad(part, ((0, 0), (0, num_rows - size), (0, 0), (0, 0)))
            return run

        branch = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), num_seqs[0])  # the first size >= num_seqs
        out = jax.lax.switch(jnp.minimum(branch, len(sizes) - 1), [first_rows(n) for n in sizes],
                             q, page_indices, kv_lens, q_pos)
    else:
        out = attend(q, page_indices, kv_lens, q_pos)
    out = out.reshape(num_kv_heads, num_rows, group, max_q_len, head_dim).transpose(1, 3, 0, 2, 4)
    out = out.reshape(num_rows * max_q_len, num_q_heads, head_dim)

    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_of_token = jnp.clip(jnp.searchsorted(cu_q_lens, token, side="right") - 1, 0, num_rows - 1)
    offset = jnp.clip(token - cu_q_lens[seq_of_token], 0, max_q_len - 1)
    return jnp.take(out, seq_of_token * max_q_len + offset, axis=0, mode="clip").astype(queries.dtype)


PIECES_PER_GROUP = 8  # prefill rows (query pieces) attended together; measured in docs/engineering-notes.md


@dataclasses.dataclass(frozen=True)
class _CommonPages:
    """Leading pages every real row shares (cascade): the first row's table and how many of its pages."""

    table: Int[Array, "W"]
    num_pages: Int[Array, ""]


def _attend_rows(
    q: Float[Array, "Hkv S R D"],
    page_indices: Int[Array, "S W"],
    kv_lens: Int[Array, "S"],
    q_pos: Int[Array, "S R"],
    *,
    kv_pages: Float[Array, "2 Hkv P page D"],
    layout: KVLayout,
    common: _CommonPages | None,
    pages_per_chunk: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> Float[Array, "Hkv S R D"]:
    """Normalised attention output of rows `q` (positions `q_pos`) over their paged contexts; rows
    without context give zeros. The walk ends at the longest of these rows' contexts (and, with a
    window, starts at the first chunk the earliest row's window reaches)."""
    num_kv_heads, num_rows, rows, head_dim = q.shape
    pages_per_seq = page_indices.shape[1]
    page_size = layout.geometry(kv_pages.shape)[2]
    chunk = min(pages_per_chunk, pages_per_seq)
    num_chunks = -(-pages_per_seq // chunk)
    page_indices = jnp.pad(page_indices, ((0, 0), (0, num_chunks * chunk - pages_per_seq)))
    chunk_tokens = chunk * page_size

    # The head axis stays a batch axis (not flattened into the page rows): a reshape across it would
    # make GSPMD all-gather a KV-head-sharded cache.
    def gather(idx: Array) -> tuple[Array, Array]:  # [S, chunk] -> [Hkv, S, chunk_tokens, D] each
        k, v = layout.take_pages(kv_pages, idx.reshape(-1))
        shape = (num_kv_heads, num_rows, chunk_tokens, head_dim)
        return k.reshape(shape), v.reshape(shape)

    # Few query rows (decode, verification): multiply-reduce forms fuse on XLA:CPU and beat tiny batched dots.
    multiply_reduce = rows <= MULTIPLY_REDUCE_MAX_ROWS

    def body(carry: tuple[Array, Array, Array, Array]) -> tuple[Array, Array, Array, Array]:
        c, m, l, acc = carry
        idx = jax.lax.dynamic_slice_in_dim(page_indices, c * chunk, chunk, axis=1)
        k, v = gather(idx)
        if multiply_reduce:
            s = jnp.sum(q[:, :, :, None, :].astype(jnp.float32) * k[:, :, None, :, :], axis=-1)
        else:
            s = jnp.einsum("hsrd,hskd->hsrk", q, k, preferred_element_type=jnp.float32)
        s = soft_capped(s, soft_cap)
        k_pos = c * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < kv_lens[:, None, None])
        if sliding_window is not None:
            mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        m_new, alpha, p, l = _online_softmax_step(m, l, s, mask[None])
        if multiply_reduce:
            pv = jnp.sum(p[..., None] * v[:, :, None, :, :].astype(jnp.float32), axis=-2)
        else:
            pv = jnp.einsum("hsrk,hskd->hsrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return c + 1, m_new, l, acc * alpha[..., None] + pv

    stats_shape = (num_kv_heads, num_rows, rows)
    init = (jnp.int32(0), jnp.full(stats_shape, MASK_VALUE, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros((*stats_shape, head_dim), jnp.float32))
    if common is not None:
        common_chunks = jnp.minimum(common.num_pages // chunk, num_chunks)  # whole chunks only
        m, l, acc = _common_prefix_attention(q, kv_pages, layout, common.table, common_chunks * chunk, kv_lens > 0,
                                             soft_cap)
        init = (common_chunks, m, l, acc)
    elif sliding_window is not None:  # no row attends a key before its first query's window
        first_key = jnp.min(jnp.where(kv_lens > 0, q_pos[:, 0] - sliding_window + 1, jnp.iinfo(jnp.int32).max))
        init = (jnp.clip(first_key // chunk_tokens, 0, num_chunks), *init[1:])
    # The trip count follows the longest real context of these rows, not the padded width.
    num_live = jnp.minimum(-(-jnp.max(kv_lens) // chunk_tokens), num_chunks)
    _, _, l, acc = jax.lax.while_loop(lambda carry: carry[0] < num_live, body, init)
    return jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)


COMMON_PAGES_PER_CHUNK = 8


def soft_capped(scores: Array, soft_cap: float | None) -> Array:
    """Scores as `cap * tanh(s / cap)` (Gemma's soft-cap); unchanged without a cap."""
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


def _online_softmax_step(m: Array, l: Array, s: Array, mask: Array) -> tuple[Array, Array, Array, Array]:
    """One chunk of scores `s` (masked keys dropped) folded into the running max `m` and sum `l`:
    (new max, rescale factor of the old state, this chunk's unnormalised weights, new sum)."""
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    return m_new, alpha, p, l * alpha + jnp.sum(p, axis=-1)


def _common_prefix_attention(
    q: Float[Array, "Hkv S R D"],
    kv_pages: Float[Array, "2 Hkv P page D"],
    layout: KVLayout,
    pages: Int[Array, "W"],
    num_pages: Int[Array, ""],
    live_rows: Array,  # [S] bool: rows with a context (padding rows attend to nothing)
    soft_cap: float | None = None,
) -> tuple[Float[Array, "Hkv S R"], Float[Array, "Hkv S R"], Float[Array, "Hkv S R D"]]:
    """Online-softmax state (max, sum, weighted V) of every query row over the first `num_pages` of `pages`.

    Those pages are gathered once per step (not once per sequence) and every row of the batch
    attends to them in one matmul per KV head; no causal mask is needed since they precede every query.
    """
    num_kv_heads, num_rows, rows, head_dim = q.shape
    page_size = layout.geometry(kv_pages.shape)[2]
    chunk = min(COMMON_PAGES_PER_CHUNK, pages.shape[0])
    pages = jnp.pad(pages, (0, -pages.shape[0] % chunk))
    chunk_tokens = chunk * page_size
    flat_q = q.reshape(num_kv_heads, num_rows * rows, head_dim)
    live = jnp.repeat(live_rows, rows)  # [S * R]

    def body(carry: tuple[Array, Array, Array, Array]) -> tuple[Array, Array, Array, Array]:
        c, m, l, acc = carry
        idx = jax.lax.dynamic_slice_in_dim(pages, c * chunk, chunk)
        k, v = layout.take_pages(kv_pages, idx)
        k = k.reshape(num_kv_heads, chunk_tokens, head_dim)  # [Hkv, chunk_tokens, D] each
        v = v.reshape(num_kv_heads, chunk_tokens, head_dim)
        s = soft_capped(jnp.einsum("hnd,hkd->hnk", flat_q, k, preferred_element_type=jnp.float32), soft_cap)
        k_pos = c * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)
        mask = live[:, None] & (k_pos < num_pages * page_size)[None, :]
        m_new, alpha, p, l = _online_softmax_step(m, l, s, mask[None])
        pv = jnp.einsum("hnk,hkd->hnd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return c + 1, m_new, l, acc * alpha[..., None] + pv

    shape = (num_kv_heads, num_rows * rows)
    init = (jnp.int32(0), jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32))
    _, m, l, acc = jax.lax.while_loop(lambda carry: carry[0] * chunk < num_pages, body, init)
    return (m.reshape(num_kv_heads, num_rows, rows), l.reshape(num_kv_heads, num_rows, rows),
            acc.reshape(num_kv_heads, num_rows, rows, head_dim))
