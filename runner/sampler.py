"""Device-side token sampling and logprobs for one engine step.

This file owns turning a batch of S logits rows into sampled tokens: per-row temperature, top-k,
top-p, min-p, suppressed ids, per-row randomness, and the logprobs returned to the caller (the
sampled token's and the top-K alternatives). `choose_mode` is the host-side (numpy) choice of the
static `mode` that `sample` is compiled for.

Order of operations (as vLLM): suppression, temperature scaling, top-k, top-p, min-p, then a
Gumbel-max draw from the processed distribution.

- Suppression: `suppress_ids` (-1 = none) get -inf before anything else; they are never sampled
  and have processed logprob -inf.
- Temperature: a row with temperature < `GREEDY_EPS` is greedy (argmax); it is scaled by 1.
- top-k: keep the k largest scaled logits; `top_k` <= 0 or >= V is off. Ties are broken by token
  id (lower id ranks first), so the kept set is always exactly k tokens.
- top-p: on the top-k-renormalized distribution, keep the smallest prefix of the descending order
  (same tie rule) whose cumulative probability is >= top_p; the top token is always kept.
  `top_p` >= 1 is off.
- min-p: keep tokens with p >= min_p * p_max (the ratio does not depend on renormalization, so
  this is the same before or after top-k/top-p). `min_p` <= 0 is off.

How the kept set is found: when every row with top-k has top_k <= 64, those rows rank only their
64 best logits (found in the 64 blocks of 128 ids with the largest maxima) and draw among them (the
noise each id would get in the full row, so the same token); else they build the mask from
`lax.top_k`'s 512 best (a full-row sort only when some row's set may reach past them) and draw over
the masked row. At 64 x 49152, top_k = 50: ~42 -> ~19 ms per `sample` (throwaway timing). Rows
without top-k never build it:
`_kept_draw` tests Gumbel-max candidates against top-p and min-p instead (a full sort of 64 x 49152
logits is ~1 s on CPU; `bench_rollout.py --batch-sizes 64 --top-p 0.95`: 53.8 tok/s with it, 314 without).
Processed logprobs of filtered rows still build the mask (for the rows that ask for them). The two
sum probabilities in different orders, so a token whose mass-before is within float32 rounding of
top_p could be kept by one and not the other (its processed logprob would read -inf); measure-zero
in practice, never seen in the tests.

Randomness: row i has key `fold_in(fold_in(key(seed), sample_index), position)`; two 32-bit words
drawn from it seed a counter-based hash that gives every vocabulary id its own uniform, and the
token is `argmax(processed + Gumbel noise)`. A row's token depends only on its own logits, settings,
seed, sample index and position: never on the other rows, the batch order, or whether the batch ran
in "random" or "filtered" mode (a row without filters gets the same token in both).

Why Gumbel-max and not one uniform through the CDF: the same request must sample the same tokens
whatever shape of step computed its logits (alone or batched, plain or speculative verification),
and those logits differ in the last bits (XLA:CPU's one-row GEMV and its GEMMs round differently).
An inverse-CDF draw changes token whenever the uniform falls between a boundary's two roundings,
and every one of the ~49k boundaries counts: on SmolLM2 about one token in 500 departed (tail
tokens). Gumbel-max changes token only when the two best noisy logits tie within the rounding
(~1e-6 per token). The hash (two murmur3 finalizer rounds) instead of `jax.random` per id: threefry
Gumbels for 64 x 49152 logits cost ~75 ms per step on CPU, the hash ~8 ms in all.

Rejection sampling (`draft_ids` given, speculative decoding's optional mode): a row with a draft
token d (a deterministic n-gram draft, so the draft distribution q is one-hot at d) keeps d with
probability min(1, p(d) / q(d)) = p(d), drawn from a uniform (key folded with 1), and
otherwise draws from norm(max(0, p - q)) = p without d, with the row's usual noise. The token is
then distributed exactly as p; greedy rows keep their argmax (accepting d only if it is the argmax).

Logprobs (per row, chosen by `SamplingInputs.processed`):
- raw: `log_softmax` of the model's logits as given (suppression is NOT applied).
- processed: `log_softmax` of the distribution actually sampled from (after suppression,
  temperature and filtering; filtered-out tokens are -inf). For a greedy row this is the filtered
  distribution at temperature 1 (top-k/top-p/min-p applied to the suppressed logits).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int, UInt32

Mode = Literal["greedy", "random", "filtered"]
MODES: tuple[str, ...] = ("greedy", "random", "filtered")
GREEDY_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)
NUM_CANDIDATES = 512  # "filtered" tries the top-512 logits before sorting whole rows
SMALL_TOP_K = 64  # when every filtered row has 0 < top_k <= this, only its top-64 logits are ranked


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """Sampled tokens and their logprobs (in each row's logprobs mode)."""

    token_ids: Int[Array, "S"]
    logprobs: Float[Array, "S"]  # logprob of the sampled token in the row's logprobs mode
    top_ids: Int[Array, "S K"]  # K = num_top_logprobs (static, may be 0); descending logprob
    top_logprobs: Float[Array, "S K"]


def choose_mode(
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    *,
    processed: np.ndarray | None = None,
    vocab_size: int | None = None,
) -> Mode:
    """Cheapest static mode that is exact for these rows (host side, numpy).

    Filters matter for a row if it samples (temperature > 0) or wants processed logprobs
    (`processed`; None = assume every row does). "greedy" and "random" ignore filters.
    """
    temperature = np.asarray(temperature, np.float32)
    top_k = np.asarray(top_k)
    sampling = temperature >= GREEDY_EPS
    relevant = np.ones_like(sampling) if processed is None else sampling | np.asarray(processed, bool)
    k_on = top_k > 0
    if vocab_size is not None:
        k_on &= top_k < vocab_size
    filt = k_on | (np.asarray(top_p) < 1.0) | (np.asarray(min_p) > 0.0)
    if np.any(filt & relevant):
        return "filtered"
    if np.any(sampling):
        return "random"
    return "greedy"


def _row_keys(inputs: SamplingInputs) -> jax.Array:
    """One PRNG key per row: fold_in(fold_in(key(seed), sample_index), position)."""

    def one(seed: jax.Array, index: jax.Array, pos: jax.Array) -> jax.Array:
        key = jax.random.key(seed)
        return jax.random.fold_in(jax.random.fold_in(key, index), pos)

    return jax.vmap(one)(inputs.seeds, inputs.sample_index, inputs.positions)


BLOCK = 128  # sampling and argmax scan per-block sums / maxima, then one block


def _block_view(x: Float[Array, "S V"]) -> Float[Array, "S NB 128"]:
    """Rows as `BLOCK`-wide blocks, the last one padded with -inf (a view when V divides evenly)."""
    num_rows, vocab = x.shape
    num_blocks = -(-vocab // BLOCK)
    return jnp.pad(x, ((0, 0), (0, num_blocks * BLOCK - vocab)), constant_values=-jnp.inf).reshape(
        num_rows, num_blocks, BLOCK
    )


def _block_token_ids(block_ids: Int[Array, "... B"]) -> Int[Array, "... B 128"]:
    """Token ids held by blocks `block_ids`."""
    return (block_ids * BLOCK)[..., None] + jnp.arange(BLOCK, dtype=jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Suppressed:
    """Where each row's suppressed ids fall in its blocks, so per-block reductions can be corrected
    from those blocks alone instead of from a copy of the logits with -inf written in."""

    ids: Int[Array, "S M"]  # suppressed ids, -1 = none (out-of-range ids dropped)
    hit_blocks: Int[Array, "S M"]  # block of each id; num_blocks for none (dropped by `correct`)
    num_blocks: int

    @classmethod
    def of(cls, suppress_ids: Int[Array, "S M"], vocab: int) -> _Suppressed:
        num_blocks = -(-vocab // BLOCK)
        ids = jnp.where((suppress_ids >= 0) & (suppress_ids < vocab), suppress_ids, -1).astype(jnp.int32)
        return cls(ids=ids, hit_blocks=jnp.where(ids >= 0, ids // BLOCK, num_blocks), num_blocks=num_blocks)

    def mask(self, values: Float[Array, "S B 128"], block_ids: Int[Array, "S B"]) -> Float[Array, "S B 128"]:
        """`values` of the blocks `block_ids` with this row's suppressed ids set to -inf."""
        hit = jnp.any(_block_token_ids(block_ids)[..., None] == self.ids[:, None, None, :], axis=-1)
        return jnp.where(hit, -jnp.inf, values)

    def own_blocks(self, blocks: Float[Array, "S NB 128"]) -> Float[Array, "S M 128"]:
        """The (masked) block holding each suppressed id."""
        safe = jnp.minimum(self.hit_blocks, self.num_blocks - 1)
        return self.mask(jnp.take_along_axis(blocks, safe[..., None], axis=1), safe)

    def correct(self, per_block: Float[Array, "S NB"], own: Float[Array, "S M"]) -> Float[Array, "S NB"]:
        """`per_block` with the suppressed ids' blocks replaced by `own` (their masked reductions)."""
        rows = jnp.broadcast_to(jnp.arange(per_block.shape[0])[:, None], self.hit_blocks.shape)
        return per_block.at[rows, self.hit_blocks].set(own, mode="drop")


def _argmax_blocks(
    blocks: Float[Array, "S NB 128"], block_max: Float[Array, "S NB"], suppressed: _Suppressed | None
) -> Int[Array, "S"]:
    """First index of the row maximum given each block's maximum (suppressed ids excluded)."""
    block = jnp.argmax(block_max, axis=-1).astype(jnp.int32)
    inner = jnp.take_along_axis(blocks, block[:, None, None], axis=1)
    if suppressed is not None:
        inner = suppressed.mask(inner, block[:, None])
    return block * BLOCK + jnp.argmax(inner[:, 0], axis=-1).astype(jnp.int32)


def argmax_last(x: Float[Array, "... V"], suppress_ids: Int[Array, "... M"] | None = None) -> Int[Array, "..."]:
    """`jnp.argmax(x, axis=-1)` (first index of the maximum; NaN counts as the maximum), in two passes;
    with `suppress_ids` (-1 = none), the argmax of `x` with those ids at -inf, without writing a copy.

    XLA:CPU runs argmax as a variadic (value, index) reduce that does not vectorise: ~7 ms for 64 x
    49152 float32 logits, most of a greedy step's sampling. The maximum of each 128-wide block, the
    first block holding the row's maximum, then the first maximum inside it: ~0.3 ms, same answer.
    Suppressed ids only change the maxima of their own blocks, which are recomputed from those blocks
    (a scatter of -inf into the logits would copy all of them first: ~1 ms at 64 x 49152).
    """
    *lead, vocab = x.shape
    if vocab <= BLOCK or not jnp.issubdtype(x.dtype, jnp.floating):  # the -inf padding needs floats
        if suppress_ids is not None:
            x = _suppress(x.reshape(-1, vocab), suppress_ids.reshape(-1, suppress_ids.shape[-1])).reshape(x.shape)
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    blocks = _block_view(x.reshape(-1, vocab))
    block_max = jnp.max(blocks, axis=-1)
    suppressed = None
    if suppress_ids is not None:
        suppressed = _Suppressed.of(suppress_ids.reshape(-1, suppress_ids.shape[-1]), vocab)
        block_max = suppressed.correct(block_max, jnp.max(suppressed.own_blocks(blocks), axis=-1))
    return _argmax_blocks(blocks, block_max, suppressed).reshape(lead)


def _row_bits(inputs: SamplingInputs) -> UInt32[Array, "S 2"]:
    """Each row's two 32-bit words seeding its per-id noise."""
    return jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint32))(_row_keys(inputs))


def _mix32(x: UInt32[Array, "..."]) -> UInt32[Array, "..."]:
    """murmur3's 32-bit finalizer (a bijection that spreads every input bit over the output)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _gumbel(bits: UInt32[Array, "S 2"], token_ids: Int[Array, "S_or_1 ..."]) -> Float[Array, "S ..."]:
    """Standard Gumbel noise of each (row, token id): a pure function of the row's bits and the id
    (`token_ids` per row, or one leading axis of 1 shared by every row)."""
    row = (bits.shape[0],) + (1,) * (token_ids.ndim - 1)
    h = _mix32((token_ids.astype(jnp.uint32) * jnp.uint32(0x9E3779B9)) ^ bits[:, 0].reshape(row))
    h = _mix32(h + bits[:, 1].reshape(row))
    u = ((h >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1): 24 bits, never 0 or 1
    return -jnp.log(-jnp.log(u))


def _race_from_blocks(
    blocks: Float[Array, "S NB 128"], bits: UInt32[Array, "S 2"], suppressed: _Suppressed | None
) -> Int[Array, "S"]:
    """`argmax(x + Gumbel noise)` over each row (suppressed ids excluded): a draw from softmax(x).

    The noisy logits are only reduced per block, then the winning block is recomputed, so no
    noisy copy of the logits is written.
    """
    num_blocks = blocks.shape[1]
    block_max = jnp.max(blocks + _gumbel(bits, _block_token_ids(jnp.arange(num_blocks, dtype=jnp.int32)[None])), axis=2)
    if suppressed is not None:
        own_ids = _block_token_ids(jnp.minimum(suppressed.hit_blocks, num_blocks - 1))
        block_max = suppressed.correct(block_max, jnp.max(suppressed.own_blocks(blocks) + _gumbel(bits, own_ids), axis=2))
    block = jnp.argmax(block_max, axis=1).astype(jnp.int32)
    inner = jnp.take_along_axis(blocks, block[:, None, None], axis=1)
    if suppressed is not None:
        inner = suppressed.mask(inner, block[:, None])
    noisy = inner[:, 0] + _gumbel(bits, _block_token_ids(block[:, None])[:, 0])
    return block * BLOCK + jnp.argmax(noisy, axis=1).astype(jnp.int32)


def _draw(processed: Float[Array, "S V"], inputs: SamplingInputs) -> Int[Array, "S"]:
    """Draw one token per row from softmax(processed) with the row's own noise (Gumbel-max)."""
    return _race_from_blocks(_block_view(processed), _row_bits(inputs), None)


def _sample_random(
    raw: Float[Array, "S V"], inputs: SamplingInputs, divisor: Float[Array, "S"], greedy: Bool[Array, "S"]
) -> tuple[Int[Array, "S"], Float[Array, "S"]]:
    """"random" mode without materialising the processed logits: tokens and their processed logprobs.

    The processed logits `suppress(raw) / divisor` are only ever read through per-block reductions
    (maximum, sum of exp) of `raw / divisor`, corrected in the blocks holding suppressed ids, and the
    one block each row draws from. Every full pass over the logits is then a fused read: ~3 ms at
    64 x 49152 on 2 cores, where materialising the suppressed, scaled and exponentiated copies and
    the log-sum-exp's select took ~15 ms more. The processed log-sum-exp falls out of the same sums.
    """
    vocab = raw.shape[1]
    blocks = _block_view(raw) / divisor[:, None, None]
    suppressed = _Suppressed.of(inputs.suppress_ids, vocab)
    own = suppressed.own_blocks(blocks)
    block_max = suppressed.correct(jnp.max(blocks, axis=2), jnp.max(own, axis=2))
    row_max = jnp.max(block_max, axis=1)
    shift = row_max[:, None, None]
    block_sum = suppressed.correct(jnp.sum(jnp.exp(blocks - shift), axis=2), jnp.sum(jnp.exp(own - shift), axis=2))
    drawn = _race_from_blocks(blocks, _row_bits(inputs), suppressed)
    token_ids = jnp.where(greedy, _argmax_blocks(blocks, block_max, suppressed), drawn)
    # From `blocks` itself: XLA:CPU turns the division into a multiply by 1 / divisor, and a separately
    # divided logit can sit an ulp of x / T above `row_max` (a positive logprob at low temperature).
    picked = jnp.take_along_axis(blocks.reshape(blocks.shape[0], -1), token_ids[:, None], axis=1)[:, 0]
    return token_ids, picked - row_max - jnp.log(jnp.sum(block_sum, axis=1))


def _verify_drafts(processed: Float[Array, "S V"], inputs: SamplingInputs) -> Int[Array, "S"]:
    """Rejection sampling of each row's draft token against the processed distribution (see module doc).

    Rows without a draft get the plain draw (their residual is the processed distribution itself),
    so one draw serves every row.
    """
    num_rows, vocab = processed.shape
    draft = inputs.draft_ids.astype(jnp.int32)
    has_draft = (draft >= 0) & (draft < vocab)
    d = jnp.clip(draft, 0, vocab - 1)
    log_p_draft = jnp.take_along_axis(processed, d[:, None], axis=1)[:, 0] - jax.nn.logsumexp(processed, axis=1)
    accept_keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(_row_keys(inputs))
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(accept_keys)
    is_draft = lax.broadcasted_iota(jnp.int32, processed.shape, 1) == d[:, None]
    residual = jnp.where(has_draft[:, None] & is_draft, -jnp.inf, processed)
    empty = jnp.all(residual == -jnp.inf, axis=1)  # p(d) = 1: d is always kept
    accept = has_draft & ((jnp.log(u) < log_p_draft) | empty)
    drawn = _draw(jnp.where(empty[:, None], processed, residual), inputs)
    return jnp.where(accept, d, drawn)


def _suppress(logits: Float[Array, "S V"], suppress_ids: Int[Array, "S M"]) -> Float[Array, "S V"]:
    """Set the suppressed ids of each row to -inf (-1 entries, and any out of range, are ignored)."""
    num_rows, vocab = logits.shape
    if suppress_ids.shape[1] == 0:
        return logits
    ids = jnp.where((suppress_ids >= 0) & (suppress_ids < vocab), suppress_ids, vocab)
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], ids.shape)
    return logits.at[rows, ids].set(-jnp.inf, mode="drop")


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


def _sorted_filter_mask(scaled: Float[Array, "S V"], inputs: SamplingInputs) -> Bool[Array, "S V"]:
    """Tokens kept by top-k, top-p, min-p: one stable descending sort of each whole row."""
    num_rows, vocab = scaled.shape
    iota = lax.broadcasted_iota(jnp.int32, (num_rows, vocab), 1)
    neg_sorted, order = lax.sort((-scaled, iota), dimension=1, num_keys=1, is_stable=True)
    desc = -neg_sorted  # descending; ties by ascending token id
    top_k = inputs.top_k.astype(jnp.int32)
    in_k = iota < jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)[:, None]
    log_norm = jax.nn.logsumexp(jnp.where(in_k, desc - desc[:, :1], -jnp.inf), axis=1)
    return _scatter_rows(_prefix_keep(desc, log_norm, inputs, vocab), order, vocab)


def _top_candidates(scaled: Float[Array, "S V"], num_candidates: int) -> tuple[Float[Array, "S C"], Int[Array, "S C"]]:
    """The `num_candidates` largest logits of each row and their ids: descending, ties by ascending id.

    The C best lie in the C blocks with the largest maxima (ties by block index: a block ranked after
    C others holds nothing that outranks all of their maxima), so when those are a small part of the
    row `lax.top_k` runs over them alone, gathered in ascending block order to keep the id tie rule
    (~6x fewer values at C = 64 over 49152 ids). Ids past the vocabulary (the -inf padding of the last
    block) can appear only in a row with fewer than C finite logits.
    """
    num_rows = scaled.shape[0]
    blocks = _block_view(scaled)
    if 4 * num_candidates <= blocks.shape[1]:
        _, chosen = lax.top_k(jnp.max(blocks, axis=2), num_candidates)
        chosen = jnp.sort(chosen.astype(jnp.int32), axis=1)
        values = jnp.take_along_axis(blocks, chosen[..., None], axis=1).reshape(num_rows, -1)
        desc, at = lax.top_k(values, num_candidates)
        ids = jnp.take_along_axis(_block_token_ids(chosen).reshape(num_rows, -1), at, axis=1)
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


def _candidate_filter_mask(
    scaled: Float[Array, "S V"], inputs: SamplingInputs, needs_filter: Bool[Array, "S"], num_candidates: int
) -> tuple[Bool[Array, "S V"], Bool[Array, "S"]]:
    """The same mask from only the `num_candidates` largest logits of each row (no sort).

    Also returns, per row, whether that is provably exact: the row needs no filter, top-k <= C, or
    the last candidate is already filtered out (so every later token is too).
    """
    num_rows, vocab = scaled.shape
    desc, ids = _top_candidates(scaled, num_candidates)
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


def _filter_mask(
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
    has_filter = _top_k_active(inputs, vocab) | (inputs.top_p < 1.0) | (inputs.min_p > 0.0)
    needs_filter = has_filter & (~greedy | inputs.processed.astype(jnp.bool_))
    if num_candidates >= vocab:
        return _sorted_filter_mask(scaled, inputs)

    def general() -> Bool[Array, "S V"]:
        mask, exact = _candidate_filter_mask(scaled, inputs, needs_filter, num_candidates)
        return lax.cond(jnp.all(exact), lambda: mask, lambda: _sorted_filter_mask(scaled, inputs))

    if num_candidates <= SMALL_TOP_K:
        return general()
    small_k = _top_k_active(inputs, vocab) & (inputs.top_k <= SMALL_TOP_K)
    return lax.cond(jnp.all(small_k | ~needs_filter),
                    lambda: _candidate_filter_mask(scaled, inputs, needs_filter, SMALL_TOP_K)[0], general)


def _top_k_active(inputs: SamplingInputs, vocab: int) -> Bool[Array, "S"]:
    top_k = inputs.top_k.astype(jnp.int32)
    return (top_k > 0) & (top_k < vocab)


def _without_filters(inputs: SamplingInputs, rows: Bool[Array, "S"]) -> SamplingInputs:
    """`inputs` with every filter of `rows` switched off."""
    return dataclasses.replace(inputs, top_k=jnp.where(rows, 0, inputs.top_k), top_p=jnp.where(rows, 1.0, inputs.top_p),
                               min_p=jnp.where(rows, 0.0, inputs.min_p))


def _kept_draw(scaled: Float[Array, "S V"], inputs: SamplingInputs) -> Int[Array, "S"]:
    """Gumbel-max over each row's top-p / min-p kept set, found without sorting (top-k is ignored).

    The kept set is a prefix of the descending order (ties by token id). Draw c = argmax(x + noise)
    over the candidates (at first every id passing min-p) and test it: kept when the mass ranked
    before it is below top_p (one masked sum). A rejected c is outside the prefix, and so is every id
    ranked after it: the next round draws among the ids ranked before c. The winner is exactly the
    Gumbel-max over the kept set (the same token as masking the kept set first), in ~1 + (1 - top_p)
    rounds per row; a full-row sort costs ~1 s at 64 x 49152 on CPU.
    """
    blocks = _block_view(scaled)
    num_rows, num_blocks, _ = blocks.shape
    ids = _block_token_ids(jnp.arange(num_blocks, dtype=jnp.int32)[None])  # [1, NB, 128]
    row_max = jnp.max(blocks, axis=(1, 2))
    ratio = jnp.exp(blocks - row_max[:, None, None])  # p / p_max, as `_prefix_keep` computes it
    total = jnp.sum(ratio, axis=(1, 2))
    min_p, top_p = inputs.min_p.astype(jnp.float32), inputs.top_p.astype(jnp.float32)
    passes_min_p = (ratio >= min_p[:, None, None]) | (min_p <= 0.0)[:, None, None]
    noisy = jnp.where(passes_min_p, blocks + _gumbel(_row_bits(inputs), ids), -jnp.inf)

    def ranked_before(x: Array, token: Array) -> Array:  # [S] bound -> [S, NB, 128] ids ranked before it
        x, token = x[:, None, None], token[:, None, None]
        return (blocks > x) | ((blocks == x) & (ids < token))

    def round_(state: tuple[Array, Array, Array, Array]) -> tuple[Array, Array, Array, Array]:
        bound_x, bound_id, token, done = state
        candidates = jnp.where(ranked_before(bound_x, bound_id), noisy, -jnp.inf)
        block_max = jnp.max(candidates, axis=2)
        c = _argmax_blocks(candidates, block_max, None)
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


def _filtered_draw(scaled: Float[Array, "S V"], inputs: SamplingInputs, num_candidates: int) -> Int[Array, "S"]:
    """"filtered" mode's draw: rows with top-k go through the kept-set mask (`_filter_mask`, built on
    `lax.top_k`), the others through `_kept_draw`; each row's token depends only on its own settings."""
    vocab = scaled.shape[1]
    with_k = _top_k_active(inputs, vocab)
    drawn = lax.cond(jnp.all(with_k), lambda: jnp.zeros(with_k.shape, jnp.int32),
                     lambda: _kept_draw(scaled, _without_filters(inputs, with_k)))

    only_k = _without_filters(inputs, ~with_k)

    def masked_draw() -> Int[Array, "S"]:
        no_greedy = jnp.zeros(with_k.shape, jnp.bool_)
        return _draw(jnp.where(_filter_mask(scaled, only_k, no_greedy, num_candidates), scaled, -jnp.inf), inputs)

    def top_k_draw() -> Int[Array, "S"]:
        if num_candidates <= SMALL_TOP_K:
            return masked_draw()
        all_small = jnp.all(~with_k | (inputs.top_k <= SMALL_TOP_K))
        return lax.cond(all_small, lambda: _small_top_k_draw(scaled, only_k), masked_draw)

    return jnp.where(with_k, lax.cond(jnp.any(with_k), top_k_draw, lambda: drawn), drawn)


def _small_top_k_draw(scaled: Float[Array, "S V"], inputs: SamplingInputs) -> Int[Array, "S"]:
    """Gumbel-max over the kept set of rows with 0 < top_k <= `SMALL_TOP_K` (other rows: unspecified)
    from their `SMALL_TOP_K` best logits alone: each id gets the noise `_draw` gives it and ties go
    to the lowest id, so the token is the one drawn over the masked row, without writing that row."""
    vocab = scaled.shape[1]
    desc, ids = _top_candidates(scaled, min(SMALL_TOP_K, vocab))
    keep = _prefix_keep(desc, _top_k_log_norm(desc, inputs.top_k), inputs, vocab)
    noisy = jnp.where(keep, desc + _gumbel(_row_bits(inputs), ids), -jnp.inf)
    best = jnp.max(noisy, axis=1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(noisy == best, ids, vocab), axis=1), vocab - 1)  # NaN rows: in range


def _processed_for_logprobs(scaled: Float[Array, "S V"], inputs: SamplingInputs, greedy: Bool[Array, "S"],
                            num_candidates: int) -> Float[Array, "S V"]:
    """The processed logits (filtered-out ids at -inf) where processed logprobs are wanted; rows that
    want raw ones are left unfiltered, so they never force the full-row sort."""
    vocab = scaled.shape[1]
    wanted = inputs.processed.astype(jnp.bool_)
    if inputs.want_logprob is not None:
        wanted &= inputs.want_logprob
    has_filter = _top_k_active(inputs, vocab) | (inputs.top_p < 1.0) | (inputs.min_p > 0.0)
    only = _without_filters(inputs, ~wanted)
    return lax.cond(jnp.any(wanted & has_filter),
                    lambda: jnp.where(_filter_mask(scaled, only, greedy, num_candidates), scaled, -jnp.inf),
                    lambda: scaled)


def _token_logprob(logits: Float[Array, "S V"], token_ids: Int[Array, "S"]) -> Float[Array, "S"]:
    """log_softmax(logits)[row, token] without materializing the full log_softmax."""
    picked = jnp.take_along_axis(logits, token_ids[:, None], axis=1)[:, 0]
    return picked - jax.nn.logsumexp(logits, axis=1)


@functools.partial(jax.jit, static_argnames=("mode", "num_top_logprobs", "num_candidates"))
def sample(
    logits: Float[Array, "S V"],
    inputs: SamplingInputs,
    *,
    mode: Mode,
    num_top_logprobs: int = 0,
    num_candidates: int = NUM_CANDIDATES,
) -> SamplerOutput:
    """Sample one token per row and return its logprob (and top-K alternatives) in the row's mode.

    `mode` (static): "greedy" = argmax everywhere, no randomness; "random" = temperature only, no
    filtering and no sort; "filtered" = temperature + top-k + top-p + min-p (see the module doc).
    Rows with temperature 0 are argmax in every mode. Filters are ignored outside "filtered".
    `num_candidates` (static): "filtered" first filters the top-C logits of each row and falls back
    to sorting whole rows only when some row's kept set may extend past them (same result).
    """
    if mode not in MODES:
        raise ValueError(f"unknown sampling mode {mode!r}; expected one of {MODES}")
    raw = logits.astype(jnp.float32)
    num_rows, vocab = raw.shape
    temperature = inputs.temperature.astype(jnp.float32)
    greedy = temperature < GREEDY_EPS
    divisor = jnp.where(greedy, 1.0, temperature)
    want_processed = inputs.processed.astype(jnp.bool_)
    no_top_ids, no_top_logprobs = jnp.zeros((num_rows, 0), jnp.int32), jnp.zeros((num_rows, 0), jnp.float32)
    if mode == "random" and inputs.draft_ids is None and num_top_logprobs == 0:
        token_ids, processed_logprobs = _sample_random(raw, inputs, divisor, greedy)
        wants_raw = ~want_processed if inputs.want_logprob is None else inputs.want_logprob & ~want_processed
        raw_logprobs = lax.cond(
            jnp.any(wants_raw), lambda: _token_logprob(raw, token_ids), lambda: jnp.zeros(num_rows, jnp.float32)
        )
        token_logprobs = jnp.where(want_processed, processed_logprobs, raw_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=token_logprobs, top_ids=no_top_ids,
                             top_logprobs=no_top_logprobs)
    if mode == "greedy":  # suppression without a copy of the logits unless a logprob needs them
        token_ids = argmax_last(raw, inputs.suppress_ids)
        processed_fn = functools.partial(_suppress, raw, inputs.suppress_ids)
    elif mode == "filtered" and inputs.draft_ids is None:
        scaled = _suppress(raw, inputs.suppress_ids) / divisor[:, None]
        token_ids = jnp.where(greedy, argmax_last(scaled), _filtered_draw(scaled, inputs, num_candidates))
        processed_fn = functools.partial(_processed_for_logprobs, scaled, inputs, greedy, num_candidates)
    else:
        scaled = _suppress(raw, inputs.suppress_ids) / divisor[:, None]
        if mode == "filtered":
            processed = jnp.where(_filter_mask(scaled, inputs, greedy, num_candidates), scaled, -jnp.inf)
        else:
            processed = scaled
        drawn = _draw(processed, inputs) if inputs.draft_ids is None else _verify_drafts(processed, inputs)
        token_ids = jnp.where(greedy, argmax_last(processed), drawn)
        processed_fn = lambda: processed  # noqa: E731

    if num_top_logprobs > 0:
        chosen = jnp.where(
            want_processed[:, None], jax.nn.log_softmax(processed_fn(), axis=1), jax.nn.log_softmax(raw, axis=1)
        )
        token_logprobs = jnp.take_along_axis(chosen, token_ids[:, None], axis=1)[:, 0]
        top_logprobs, top_ids = lax.top_k(chosen, min(num_top_logprobs, vocab))
        top_ids = top_ids.astype(jnp.int32)
    else:
        # One log-sum-exp over each row's chosen logits (not one per kind, then a select).
        def logprob() -> Float[Array, "S"]:
            return _token_logprob(jnp.where(want_processed[:, None], processed_fn(), raw), token_ids)

        if inputs.want_logprob is None:
            token_logprobs = logprob()
        else:
            token_logprobs = lax.cond(jnp.any(inputs.want_logprob), logprob, lambda: jnp.zeros(num_rows, jnp.float32))
        top_ids, top_logprobs = no_top_ids, no_top_logprobs
    return SamplerOutput(
        token_ids=token_ids, logprobs=token_logprobs, top_ids=top_ids, top_logprobs=top_logprobs
    )
