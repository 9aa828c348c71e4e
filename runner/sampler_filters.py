"""The kept set of top-k, top-p and min-p, and "filtered" mode's draw restricted to it.

Semantics (as vLLM): top-k keeps the k largest scaled logits, ties ranked by token id (lower id
first), so the set is always exactly k tokens; top-p keeps the smallest prefix of the descending
order of the top-k-renormalized distribution whose cumulative probability reaches top_p (the top
token always kept); min-p keeps p >= min_p * p_max. The kept set is always a prefix of the
descending order.

How it is found: when every row with top-k has top_k <= 64, those rows rank only their 64 best
logits (found in the 64 blocks of 128 ids with the largest maxima) and draw among them (the noise
each id would get in the full row, so the same token); else they build the mask from `lax.top_k`'s
512 best (a full-row sort only when some row's set may reach past them) and draw over the masked
row. At 64 x 49152, top_k = 50: ~42 -> ~19 ms per `sample` (throwaway timing). Rows without top-k
never build it: `_kept_draw` tests Gumbel-max candidates against top-p and min-p instead (a full
sort of 64 x 49152 logits is ~1 s on CPU; `bench_rollout.py --batch-sizes 64 --top-p 0.95`: 53.8
tok/s with it, 314 without). Processed logprobs of filtered rows still build the mask (for the rows
that ask for them). The two sum probabilities in different orders, so a token whose mass-before is
within float32 rounding of top_p could be kept by one and not the other (its processed logprob
would read -inf); measure-zero in practice, never seen in the tests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from runner.sampler_blocks import BLOCK, argmax_blocks, block_token_ids, block_view, draw, gumbel, row_bits
from runner.step_padding import SamplingInputs


NUM_CANDIDATES = 512  # "filtered" tries the top-512 logits before sorting whole rows


SMALL_TOP_K = 64  # when every filtered row has 0 < top_k <= this, only its top-64 logits are ranked


def top_k_active(inputs: SamplingInputs, vocab: int) -> Bool[Array, "S"]:
    top_k = inputs.top_k.astype(jnp.int32)
    return (top_k > 0) & (top_k < vocab)


def without_filters(inputs: SamplingInputs, rows: Bool[Array, "S"]) -> SamplingInputs:
    """`inputs` with every filter of `rows` switched off."""
    return dataclasses.replace(inputs, top_k=jnp.where(rows, 0, inputs.top_k), top_p=jnp.where(rows, 1.0, inputs.top_p),
                               min_p=jnp.where(rows, 0.0, inputs.min_p))


def _prefix_keep(
    desc: Float[Array, "S C"], log_norm: Float[Array, "S"], inputs: SamplingInputs, vocab: int
) -> Bool[Array, "S C"]:
    """top-k, top-p, min-p on a descending prefix of each row (ties already ordered by token id).

    `log_norm` is log(sum exp(l - l_max)) over the top-k set (the top-p normalizer).
    """
    rank = lax.broadcasted_iota(jnp.int32, desc.shape, 1)
    top_k = inputs.top_k.astype(jnp.int32)
    k_eff = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    keep = rank < k_eff[:, None]

    # top-p on the top-k-renormalized distribution.
    ratio = jnp.exp(desc - desc[:, :1])  # p_i / p_max
    ratio = jnp.where(keep & ~jnp.isnan(ratio), ratio, 0.0)  # nan only if a whole row is -inf
    probs = ratio / jnp.exp(log_norm)[:, None]
    cum = jnp.cumsum(probs, axis=1)
    before = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=1)
    top_p = inputs.top_p.astype(jnp.float32)[:, None]
    keep &= (before < top_p) | (top_p >= 1.0) | (rank == 0)

    # min-p: p_i >= min_p * p_max  <=>  exp(l_i - l_max) >= min_p.
    min_p = inputs.min_p.astype(jnp.float32)[:, None]
    keep &= (ratio >= min_p) | (min_p <= 0.0)
    return keep


def _scatter_rows(keep: Bool[Array, "S C"], ids: Int[Array, "S C"], vocab: int) -> Bool[Array, "S V"]:
    """Vocabulary-order mask that is True at ids[r, c] where keep[r, c]."""
    rows = lax.broadcasted_iota(jnp.int32, ids.shape, 0)
    return jnp.zeros((ids.shape[0], vocab), jnp.bool_).at[rows, ids].set(keep, unique_indices=True, mode="drop")


def sorted_filter_mask(scaled: Float[Array, "S V"], inputs: SamplingInputs) -> Bool[Array, "S V"]:
    """Tokens kept by top-k, top-p, min-p: one stable descending sort of each whole row."""
    num_rows, vocab = scaled.shape
    iota = lax.broadcasted_iota(jnp.int32, (num_rows, vocab), 1)
    neg_sorted, order = lax.sort((-scaled, iota), dimension=1, num_keys=1, is_stable=True)
    desc = -neg_sorted  # descending; ties by ascending token id
    top_k = inputs.top_k.astype(jnp.int32)
    in_k = iota < jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)[:, None]
    log_norm = jax.nn.logsumexp(jnp.where(in_k, desc - desc[:, :1], -jnp.inf), axis=1)
    return _scatter_rows(_prefix_keep(desc, log_norm, inputs, vocab), order, vocab)


def top_candidates(scaled: Float[Array, "S V"], num_candidates: int) -> tuple[Float[Array, "S C"], Int[Array, "S C"]]:
    """The `num_candidates` largest logits of each row and their ids: descending, ties by ascending id.

    The C best lie in the C blocks with the largest maxima (ties by block index: a block ranked after
    C others holds nothing that outranks all of their maxima), so when those are a small part of the
    row `lax.top_k` runs over them alone, gathered in ascending block order to keep the id tie rule
    (~6x fewer values at C = 64 over 49152 ids). Ids past the vocabulary (the -inf padding of the last
    block) can appear only in a row with fewer than C finite logits.
    """
    num_rows = scaled.shape[0]
    blocks = block_view(scaled)
    if 4 * num_candidates <= blocks.shape[1]:
        _, chosen = lax.top_k(jnp.max(blocks, axis=2), num_candidates)
        chosen = jnp.sort(chosen.astype(jnp.int32), axis=1)
        values = jnp.take_along_axis(blocks, chosen[..., None], axis=1).reshape(num_rows, -1)
        desc, at = lax.top_k(values, num_candidates)
        ids = jnp.take_along_axis(block_token_ids(chosen).reshape(num_rows, -1), at, axis=1)
    else:
        desc, ids = lax.top_k(scaled, num_candidates)
    # The barrier stops XLA:CPU from turning top_k + slice back into a full sort. One barrier per
    # output: a barrier over the (values, ids) tuple crashes XLA's SPMD partitioner when the logits
    # are sharded over a mesh.
    return lax.optimization_barrier(desc), lax.optimization_barrier(ids.astype(jnp.int32))


def _top_k_log_norm(desc: Float[Array, "S C"], top_k: Int[Array, "S"]) -> Float[Array, "S"]:
    """log(sum exp(l - l_max)) over the first `top_k` of each descending row (top-p's normalizer)."""
    rank = lax.broadcasted_iota(jnp.int32, desc.shape, 1)
    return jax.nn.logsumexp(jnp.where(rank < top_k[:, None], desc - desc[:, :1], -jnp.inf), axis=1)


def candidate_filter_mask(
    scaled: Float[Array, "S V"], inputs: SamplingInputs, needs_filter: Bool[Array, "S"], num_candidates: int
) -> tuple[Bool[Array, "S V"], Bool[Array, "S"]]:
    """The same mask from only the `num_candidates` largest logits of each row (no sort).

    Also returns, per row, whether that is provably exact: the row needs no filter, top-k <= C, or
    the last candidate is already filtered out (so every later token is too).
    """
    num_rows, vocab = scaled.shape
    desc, ids = top_candidates(scaled, num_candidates)
    row_max = desc[:, :1]
    top_k = inputs.top_k.astype(jnp.int32)
    k_off = (top_k <= 0) | (top_k >= vocab)
    k_small = ~k_off & (top_k <= num_candidates)
    log_norm_k = _top_k_log_norm(desc, top_k)
    log_norm = lax.cond(  # the whole-row normalizer (a pass over the logits) only if a row needs it
        jnp.all(k_small | ~needs_filter), lambda: log_norm_k,
        lambda: jnp.where(k_small, log_norm_k, jax.nn.logsumexp(scaled - row_max, axis=1)))
    keep = _prefix_keep(desc, log_norm, inputs, vocab)

    # Filters are monotone in rank: once rank C-1 is dropped, every later rank is too (provided
    # the top-p normalizer above is the true one: top-k off, small, or top-p off).
    normalizer_ok = k_off | k_small | (inputs.top_p >= 1.0)
    exact = ~needs_filter | k_small | (normalizer_ok & ~keep[:, -1])
    mask = jnp.where(needs_filter[:, None], _scatter_rows(keep, ids, vocab), True)
    return mask, exact


def filter_mask(
    scaled: Float[Array, "S V"], inputs: SamplingInputs, greedy: Bool[Array, "S"], num_candidates: int
) -> Bool[Array, "S V"]:
    """Tokens kept by top-k, then top-p, then min-p (ties ranked by token id).

    When every row that filters has 0 < top_k <= `SMALL_TOP_K`, its kept set lies in its top
    `SMALL_TOP_K` logits (exact, no fallback). Otherwise tries the top-`num_candidates` shortcut; if
    any row's kept set may reach past it, the whole batch falls back to one full sort per row
    (`lax.cond`, so only one branch runs). Greedy rows that want raw logprobs skip filtering (their
    argmax is always kept anyway).
    """
    vocab = scaled.shape[1]
    has_filter = top_k_active(inputs, vocab) | (inputs.top_p < 1.0) | (inputs.min_p > 0.0)
    needs_filter = has_filter & (~greedy | inputs.processed.astype(jnp.bool_))
    if num_candidates >= vocab:
        return sorted_filter_mask(scaled, inputs)

    def general() -> Bool[Array, "S V"]:
        mask, exact = candidate_filter_mask(scaled, inputs, needs_filter, num_candidates)
        return lax.cond(jnp.all(exact), lambda: mask, lambda: sorted_filter_mask(scaled, inputs))

    if num_candidates <= SMALL_TOP_K:
        return general()
    small_k = top_k_active(inputs, vocab) & (inputs.top_k <= SMALL_TOP_K)
    return lax.cond(jnp.all(small_k | ~needs_filter),
                    lambda: candidate_filter_mask(scaled, inputs, needs_filter, SMALL_TOP_K)[0], general)


def _kept_draw(scaled: Float[Array, "S V"], inputs: SamplingInputs) -> Int[Array, "S"]:
    """Gumbel-max over each row's top-p / min-p kept set, found without sorting (top-k is ignored).

    The kept set is a prefix of the descending order (ties by token id). Draw c = argmax(x + noise)
    over the candidates (at first every id passing min-p) and test it: kept when the mass ranked
    before it is below top_p (one masked sum). A rejected c is outside the prefix, and so is every id
    ranked after it: the next round draws among the ids ranked before c. The winner is exactly the
    Gumbel-max over the kept set (the same token as masking the kept set first), in ~1 + (1 - top_p)
    rounds per row; a full-row sort costs ~1 s at 64 x 49152 on CPU.
    """
    blocks = block_view(scaled)
    num_rows, num_blocks, _ = blocks.shape
    ids = block_token_ids(jnp.arange(num_blocks, dtype=jnp.int32)[None])  # [1, NB, 128]
    row_max = jnp.max(blocks, axis=(1, 2))
    ratio = jnp.exp(blocks - row_max[:, None, None])  # p / p_max, as `_prefix_keep` computes it
    total = jnp.sum(ratio, axis=(1, 2))
    min_p, top_p = inputs.min_p.astype(jnp.float32), inputs.top_p.astype(jnp.float32)
    passes_min_p = (ratio >= min_p[:, None, None]) | (min_p <= 0.0)[:, None, None]
    noisy = jnp.where(passes_min_p, blocks + gumbel(row_bits(inputs), ids), -jnp.inf)

    def ranked_before(x: Array, token: Array) -> Array:  # [S] bound -> [S, NB, 128] ids ranked before it
        x, token = x[:, None, None], token[:, None, None]
        return (blocks > x) | ((blocks == x) & (ids < token))

    def round_(state: tuple[Array, Array, Array, Array]) -> tuple[Array, Array, Array, Array]:
        bound_x, bound_id, token, done = state
        candidates = jnp.where(ranked_before(bound_x, bound_id), noisy, -jnp.inf)
        block_max = jnp.max(candidates, axis=2)
        c = argmax_blocks(candidates, block_max, None)
        x_c = jnp.take_along_axis(blocks.reshape(num_rows, -1), c[:, None], axis=1)[:, 0]
        before = ranked_before(x_c, c)
        mass_before = jnp.sum(jnp.where(before, ratio, 0.0), axis=(1, 2)) / total
        first = ~jnp.any(before, axis=(1, 2))
        no_candidate = ~(jnp.max(block_max, axis=1) > -jnp.inf)  # only with NaN logits: stop, never loop
        kept = (top_p >= 1.0) | (mass_before < top_p) | first | no_candidate
        token = jnp.where(done, token, c)
        return jnp.where(kept, bound_x, x_c), jnp.where(kept, bound_id, c), token, done | kept

    init = (jnp.full(num_rows, -jnp.inf, jnp.float32), jnp.full(num_rows, num_blocks * BLOCK, jnp.int32),
            jnp.zeros(num_rows, jnp.int32), jnp.zeros(num_rows, jnp.bool_))
    return lax.while_loop(lambda state: ~jnp.all(state[3]), round_, init)[2]


def filtered_draw(scaled: Float[Array, "S V"], inputs: SamplingInputs, num_candidates: int) -> Int[Array, "S"]:
    """"filtered" mode's draw: rows with top-k go through the kept-set mask (`filter_mask`, built on
    `lax.top_k`), the others through `_kept_draw`; each row's token depends only on its own settings."""
    vocab = scaled.shape[1]
    with_k = top_k_active(inputs, vocab)
    drawn = lax.cond(jnp.all(with_k), lambda: jnp.zeros(with_k.shape, jnp.int32),
                     lambda: _kept_draw(scaled, without_filters(inputs, with_k)))

    only_k = without_filters(inputs, ~with_k)

    def masked_draw() -> Int[Array, "S"]:
        no_greedy = jnp.zeros(with_k.shape, jnp.bool_)
        return draw(jnp.where(filter_mask(scaled, only_k, no_greedy, num_candidates), scaled, -jnp.inf), inputs)

    def top_k_draw() -> Int[Array, "S"]:
        if num_candidates <= SMALL_TOP_K:
            return masked_draw()
        all_small = jnp.all(~with_k | (inputs.top_k <= SMALL_TOP_K))
        return lax.cond(all_small, lambda: _small_top_k_draw(scaled, only_k), masked_draw)

    return jnp.where(with_k, lax.cond(jnp.any(with_k), top_k_draw, lambda: drawn), drawn)


def _small_top_k_draw(scaled: Float[Array, "S V"], inputs: SamplingInputs) -> Int[Array, "S"]:
    """Gumbel-max over the kept set of rows with 0 < top_k <= `SMALL_TOP_K` (other rows: unspecified)
    from their `SMALL_TOP_K` best logits alone: each id gets the noise `draw` gives it and ties go
    to the lowest id, so the token is the one drawn over the masked row, without writing that row."""
    vocab = scaled.shape[1]
    desc, ids = top_candidates(scaled, min(SMALL_TOP_K, vocab))
    keep = _prefix_keep(desc, _top_k_log_norm(desc, inputs.top_k), inputs, vocab)
    noisy = jnp.where(keep, desc + gumbel(row_bits(inputs), ids), -jnp.inf)
    best = jnp.max(noisy, axis=1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(noisy == best, ids, vocab), axis=1), vocab - 1)  # NaN rows: in range


def processed_for_logprobs(scaled: Float[Array, "S V"], inputs: SamplingInputs, greedy: Bool[Array, "S"],
                            num_candidates: int) -> Float[Array, "S V"]:
    """The processed logits (filtered-out ids at -inf) where processed logprobs are wanted; rows that
    want raw ones are left unfiltered, so they never force the full-row sort."""
    vocab = scaled.shape[1]
    wanted = inputs.processed.astype(jnp.bool_)
    if inputs.want_logprob is not None:
        wanted &= inputs.want_logprob
    has_filter = top_k_active(inputs, vocab) | (inputs.top_p < 1.0) | (inputs.min_p > 0.0)
    only = without_filters(inputs, ~wanted)
    return lax.cond(jnp.any(wanted & has_filter),
                    lambda: jnp.where(filter_mask(scaled, only, greedy, num_candidates), scaled, -jnp.inf),
                    lambda: scaled)
