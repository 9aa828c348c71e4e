"""Attention kernels: dense causal attention (training forward) and ragged paged attention (engine).

One layer's cache is `kv_pages [2, kv_heads, pages, page_size, head_dim]`: K at index 0 and V at 1,
each in the `[kv_heads, total_num_pages, page_size, head_dim]` layout of JAX's Pallas
`paged_attention` kernels (`jax.experimental.pallas.ops.gpu.paged_attention` and
`...ops.tpu.paged_attention`), so `kv_pages[0]`, `kv_pages[1]` go to them as they are (decode steps).
JAX's TPU `ragged_paged_attention` kernel wants K and V interleaved per page instead
(`[pages, page, 2 * kv_heads, head_dim]`), so it is not one of the impls.
`ragged_paged_attention` takes queries packed across requests (`kv_lens`, `page_indices`,
`cu_q_lens`, `num_seqs`, as the TPU ragged kernel does). The pure-JAX version here is the reference
and the CPU path: it gathers each request's pages once, a few pages at a time (never a copy of the
context per query token), and its cost follows the step's longest live context, never `max_model_len`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
MULTIPLY_REDUCE_MAX_ROWS = 24  # query rows per (sequence, KV head) up to which scores skip the dot


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where one engine step's tokens live in the paged KV cache (explicit, no global context)."""

    slot_mapping: Int[Array, "T"]  # flat KV slot (page * page_size + offset) of each token; out of range = drop
    kv_lens: Int[Array, "S"]  # context length of each sequence after this step's tokens
    page_indices: Int[Array, "S W"]  # KV pages of each sequence (W = context bucket in pages)
    cu_q_lens: Int[Array, "S+1"]  # start of each sequence's queries in the packed token axis
    num_seqs: Int[Array, "1"]  # number of real sequences (the rest of S is padding)
    # leading pages shared by every real sequence and wholly before each one's first query (cascade); None = 0
    num_common_pages: Int[Array, "1"] | None = None
    max_q_len: int = dataclasses.field(metadata=dict(static=True), default=1)  # static bound on any q_len
    # attend only the first power-of-two count of rows that holds every real one (verification steps,
    # whose row count is bucketed by tokens, not sequences); off under vmap, where a switch runs every branch
    trim_rows: bool = dataclasses.field(metadata=dict(static=True), default=False)
    impl: str = dataclasses.field(metadata=dict(static=True), default="jax")  # one of ATTENTION_IMPLS


ATTENTION_IMPLS = ("jax", "cpu_kernel", "pallas_gpu", "pallas_gpu_interpret", "pallas_tpu", "pallas_tpu_interpret")


def paged_attention(
    queries: Float[Array, "T Hq D"],
    kv_pages: Float[Array, "2 Hkv P page D"],
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> Float[Array, "T Hq D"]:
    """The engine's one attention boundary: `md.impl` picks the kernel.

    A layer with a `sliding_window` (keys more than that many positions back are not attended) or a
    score `soft_cap` (`cap * tanh(s / cap)`, Gemma) runs the pure-JAX version on every impl, and a
    windowed layer without the cascade (its shared prefix may lie outside the window).

    "jax" is the pure-JAX `ragged_paged_attention` (every step, every backend). "cpu_kernel" (the CPU
    backend's) sends steps of at most `runner.backends.cpu.attention.MAX_Q_LEN` queries per sequence or prefill piece with float32
    queries and cache to that C++ kernel, other steps to the pure-JAX version. "pallas_gpu" and
    "pallas_tpu" send decode steps (one query per sequence) to JAX's Pallas `paged_attention` kernel
    for that backend over the same cache (`kv_pages[0]`, `kv_pages[1]`), and every other step to the
    pure-JAX version; the "_interpret" variants run those kernels in Pallas interpret mode (any
    backend; tests). The TPU kernel rounds K and V to bfloat16 inside (exact for a bfloat16 cache).
    """
    if md.impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {md.impl!r}; choose one of {ATTENTION_IMPLS}")
    if sliding_window is not None or soft_cap is not None:
        return ragged_paged_attention(
            queries, kv_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs, sm_scale=sm_scale,
            max_q_len=md.max_q_len, num_common_pages=md.num_common_pages if sliding_window is None else None,
            trim_rows=md.trim_rows, sliding_window=sliding_window, soft_cap=soft_cap)
    if md.impl == "cpu_kernel":  # the CPU backend's C++ kernel (imported only by engines that chose it)
        from runner.backends.cpu.attention import MAX_HEAD_DIM, MAX_Q_LEN, cpu_paged_attention

        if md.max_q_len <= MAX_Q_LEN and queries.dtype == kv_pages.dtype == jnp.float32 and queries.shape[-1] <= MAX_HEAD_DIM:
            return cpu_paged_attention(queries, kv_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
                                       sm_scale=sm_scale)
    elif md.impl != "jax" and md.max_q_len == 1 and queries.shape[0] == md.page_indices.shape[0]:
        return _pallas_decode(queries, kv_pages, md.kv_lens, md.page_indices, sm_scale=sm_scale,
                              platform=md.impl.split("_")[1], interpret=md.impl.endswith("_interpret"))
    return ragged_paged_attention(queries, kv_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
                                  sm_scale=sm_scale, max_q_len=md.max_q_len, num_common_pages=md.num_common_pages,
                                  trim_rows=md.trim_rows)


def _largest_divisor(n: int, options: tuple[int, ...]) -> int:
    return next(d for d in options if n % d == 0)


def _pallas_decode(
    queries: Float[Array, "S Hq D"],
    kv_pages: Float[Array, "2 Hkv P page D"],
    kv_lens: Int[Array, "S"],
    page_indices: Int[Array, "S W"],
    *,
    sm_scale: float,
    platform: str,
    interpret: bool,
) -> Float[Array, "S Hq D"]:
    """One query per sequence through JAX's Pallas `paged_attention` kernel of `platform` ("gpu" | "tpu").

    The TPU kernel DMAs every listed page, so table entries past the cache (padding) are clipped
    into it. Rows without context are zeroed, as the reference does.
    """
    q = (queries.astype(jnp.float32) * sm_scale).astype(queries.dtype)
    pages_per_seq = page_indices.shape[1]
    if platform == "gpu":
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as gpu_paged_attention

        k_splits = _largest_divisor(pages_per_seq, (16, 8, 4, 2, 1))
        per_block = _largest_divisor(pages_per_seq // k_splits, (8, 4, 2, 1))
        out = gpu_paged_attention(q, kv_pages[0], kv_pages[1], page_indices, kv_lens, k_splits=k_splits,
                                  pages_per_compute_block=per_block, interpret=interpret)
    else:
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention

        pages = jnp.clip(page_indices, 0, kv_pages.shape[2] - 1)
        # Interpret mode applies to the pallas calls traced inside this context (so it works under jit).
        with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
            out = tpu_paged_attention(q, kv_pages[0], kv_pages[1], kv_lens, pages,
                                      pages_per_compute_block=_largest_divisor(pages_per_seq, (8, 4, 2, 1)))
    return jnp.where((kv_lens > 0)[:, None, None], out, 0.0).astype(queries.dtype)


def paged_slots(page_indices: Int[Array, "... W"], positions: Int[Array, "..."], page_size: int, num_slots: int,
                valid: Array | bool = True) -> Int[Array, "..."]:
    """The KV slot of each position through its sequence's page table (`page_indices[..., i]`: the block
    holding positions [i * page_size, (i + 1) * page_size)); `num_slots` (a write there is dropped)
    where not `valid`, for a negative position, or past the table."""
    page = positions // page_size
    blocks = jnp.take_along_axis(page_indices, page[..., None], axis=-1, mode="clip")[..., 0]
    ok = valid & (positions >= 0) & (page < page_indices.shape[-1])
    return jnp.where(ok, blocks * page_size + positions % page_size, num_slots)


def write_kv(
    kv_pages: Float[Array, "2 Hkv P page D"],
    k: Float[Array, "T Hkv D"],
    v: Float[Array, "T Hkv D"],
    slot_mapping: Int[Array, "T"],
) -> Float[Array, "2 Hkv P page D"]:
    """Scatter this step's K and V into their slots; out-of-range slots are dropped.

    One scatter of `head_dim` rows indexed by (page, offset), with the K/V and head axes as explicit
    batching dimensions: XLA:CPU updates the cache in place (a scatter along an inner axis made it
    copy the whole cache for a one-token step), and GSPMD partitions it along a head-sharded cache
    with no collective (flattening the head axis into the rows made it all-gather the whole cache
    in every layer of a tensor-parallel step).
    """
    two, num_kv_heads, num_pages, page_size, _ = kv_pages.shape
    in_range = (slot_mapping >= 0) & (slot_mapping < num_pages * page_size)
    page = jnp.where(in_range, slot_mapping // page_size, num_pages)  # past the last page: dropped
    index = jnp.stack([page, slot_mapping % page_size], axis=-1).astype(jnp.int32)  # [T, 2]
    index = jnp.broadcast_to(index, (two, num_kv_heads, *index.shape))
    updates = jnp.stack([k, v]).transpose(0, 2, 1, 3).astype(kv_pages.dtype)  # [2, Hkv, T, D]
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(3,), inserted_window_dims=(2, 3), scatter_dims_to_operand_dims=(2, 3),
        operand_batching_dims=(0, 1), scatter_indices_batching_dims=(0, 1))
    return jax.lax.scatter(kv_pages, index, updates, dims, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


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
) -> Float[Array, "T Hq D"]:
    """Causal attention of packed queries over each sequence's paged context (pure JAX reference).

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
    num_kv_heads = kv_pages.shape[1]
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
    attend = functools.partial(_attend_rows, kv_pages=kv_pages, common=common, pages_per_chunk=pages_per_chunk,
                               sliding_window=sliding_window, soft_cap=soft_cap)

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
    page_size = kv_pages.shape[3]
    chunk = min(pages_per_chunk, pages_per_seq)
    num_chunks = -(-pages_per_seq // chunk)
    page_indices = jnp.pad(page_indices, ((0, 0), (0, num_chunks * chunk - pages_per_seq)))
    chunk_tokens = chunk * page_size

    # The head axis stays a batch axis (not flattened into the page rows): a reshape across it would
    # make GSPMD all-gather a KV-head-sharded cache.
    def gather(idx: Array) -> tuple[Array, Array]:  # [S, chunk] -> [Hkv, S, chunk_tokens, D] each
        k, v = _take_pages(kv_pages, idx.reshape(-1))
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
        s = _soft_capped(s, soft_cap)
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
        m, l, acc = _common_prefix_attention(q, kv_pages, common.table, common_chunks * chunk, kv_lens > 0, soft_cap)
        init = (common_chunks, m, l, acc)
    elif sliding_window is not None:  # no row attends a key before its first query's window
        first_key = jnp.min(jnp.where(kv_lens > 0, q_pos[:, 0] - sliding_window + 1, jnp.iinfo(jnp.int32).max))
        init = (jnp.clip(first_key // chunk_tokens, 0, num_chunks), *init[1:])
    # The trip count follows the longest real context of these rows, not the padded width.
    num_live = jnp.minimum(-(-jnp.max(kv_lens) // chunk_tokens), num_chunks)
    _, _, l, acc = jax.lax.while_loop(lambda carry: carry[0] < num_live, body, init)
    return jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)


COMMON_PAGES_PER_CHUNK = 8


def _take_pages(kv_pages: Float[Array, "2 Hkv P page D"], idx: Int[Array, "N"]
                ) -> tuple[Float[Array, "Hkv N pageD"], Float[Array, "Hkv N pageD"]]:
    """K and V of pages `idx` for every KV head, one contiguous row of `page * D` each.

    K (`kv_pages[0]`) and V are viewed as rows `[Hkv, P, page * D]` (no data moves) and gathered
    with the head axis as an explicit batching dimension of the gather, so each output row is one
    contiguous copy and a KV-head-sharded cache stays sharded. Two layouts measured slower:
    vmapping a take over axis 1 of the whole cache fused a transpose of the whole cache into the
    gather (elementwise index math), and vmapping a take over the heads of `kv_pages[0]` became
    one gather of all heads per page (strided reads) followed by a transposing copy.
    """
    two, num_kv_heads, total_pages, page_size, head_dim = kv_pages.shape
    rows = kv_pages.reshape(two, num_kv_heads, total_pages, page_size * head_dim)
    index = jnp.broadcast_to(idx[None, :, None], (num_kv_heads, idx.shape[0], 1)).astype(jnp.int32)
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(2,), collapsed_slice_dims=(1,), start_index_map=(1,),
                                          operand_batching_dims=(0,), start_indices_batching_dims=(0,))

    def take(head_rows: Array) -> Array:  # [Hkv, P, page * D] -> [Hkv, N, page * D]
        return jax.lax.gather(head_rows, index, dims, slice_sizes=(1, 1, page_size * head_dim),
                              mode=jax.lax.GatherScatterMode.CLIP)

    return take(rows[0]), take(rows[1])


def _soft_capped(scores: Array, soft_cap: float | None) -> Array:
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
    page_size = kv_pages.shape[3]
    chunk = min(COMMON_PAGES_PER_CHUNK, pages.shape[0])
    pages = jnp.pad(pages, (0, -pages.shape[0] % chunk))
    chunk_tokens = chunk * page_size
    flat_q = q.reshape(num_kv_heads, num_rows * rows, head_dim)
    live = jnp.repeat(live_rows, rows)  # [S * R]

    def body(carry: tuple[Array, Array, Array, Array]) -> tuple[Array, Array, Array, Array]:
        c, m, l, acc = carry
        idx = jax.lax.dynamic_slice_in_dim(pages, c * chunk, chunk)
        k, v = _take_pages(kv_pages, idx)
        k = k.reshape(num_kv_heads, chunk_tokens, head_dim)  # [Hkv, chunk_tokens, D] each
        v = v.reshape(num_kv_heads, chunk_tokens, head_dim)
        s = _soft_capped(jnp.einsum("hnd,hkd->hnk", flat_q, k, preferred_element_type=jnp.float32), soft_cap)
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


def causal_attention(
    q: Float[Array, "B S Hq D"],
    k: Float[Array, "B S Hkv D"],
    v: Float[Array, "B S Hkv D"],
    *,
    sm_scale: float,
    attention_mask: Int[Array, "B S"] | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> Float[Array, "B S Hq D"]:
    """Dense causal grouped-query attention over full sequences (the trainer's forward); with a
    `sliding_window`, query i attends keys j > i - window only; `soft_cap` caps the scaled scores."""
    batch, seq, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    qg = q.reshape(batch, seq, num_kv_heads, group, head_dim)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * sm_scale
    scores = _soft_capped(scores, soft_cap)
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))[None]
    if sliding_window is not None:
        mask = mask & ~jnp.tril(jnp.ones((seq, seq), dtype=bool), k=-sliding_window)[None]
    if attention_mask is not None:
        mask = mask & (attention_mask[:, None, :] > 0)
    scores = jnp.where(mask[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(batch, seq, num_q_heads, head_dim)
