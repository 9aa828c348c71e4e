"""Blocked reductions over a batch of logits rows, and the per-id noise of the sampler's draws.

A row of V logits is seen as ceil(V / 128) blocks of 128 ids (the last padded with -inf). Argmax,
the Gumbel-max draw and the top-k candidates (`runner.sampler_filters`) reduce every block first and
then recompute one or a few blocks, so no full-size temporary (a copy with suppressed ids at -inf, a
noisy copy) is ever written: on XLA:CPU every such pass over 64 x 49152 float32 logits costs ~3-4 ms.

Randomness: row i has key `fold_in(fold_in(key(seed), sample_index), position)`; two 32-bit words
drawn from it seed a counter-based hash that gives every vocabulary id its own uniform, and the
token is `argmax(processed + Gumbel noise)`. A row's token depends only on its own logits, settings,
seed, sample index and position: never on the other rows, the batch order, or the sampler mode.

Why Gumbel-max and not one uniform through the CDF: the same request must sample the same tokens
whatever shape of step computed its logits (alone or batched, plain or speculative verification),
and those logits differ in the last bits (XLA:CPU's one-row GEMV and its GEMMs round differently).
An inverse-CDF draw changes token whenever the uniform falls between a boundary's two roundings,
and every one of the ~49k boundaries counts: on SmolLM2 about one token in 500 departed (tail
tokens). Gumbel-max changes token only when the two best noisy logits tie within the rounding
(~1e-6 per token). The hash (two murmur3 finalizer rounds) instead of `jax.random` per id: threefry
Gumbels for 64 x 49152 logits cost ~75 ms per step on CPU, the hash ~8 ms in all.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt32

from runner.step_padding import SamplingInputs


BLOCK = 128  # sampling and argmax scan per-block sums / maxima, then one block


def block_view(x: Float[Array, "S V"]) -> Float[Array, "S NB 128"]:
    """Rows as `BLOCK`-wide blocks, the last one padded with -inf (a view when V divides evenly)."""
    num_rows, vocab = x.shape
    num_blocks = -(-vocab // BLOCK)
    return jnp.pad(x, ((0, 0), (0, num_blocks * BLOCK - vocab)), constant_values=-jnp.inf).reshape(
        num_rows, num_blocks, BLOCK
    )


def block_token_ids(block_ids: Int[Array, "... B"]) -> Int[Array, "... B 128"]:
    """Token ids held by blocks `block_ids`."""
    return (block_ids * BLOCK)[..., None] + jnp.arange(BLOCK, dtype=jnp.int32)


@dataclasses.dataclass(frozen=True)
class Suppressed:
    """Where each row's suppressed ids fall in its blocks, so per-block reductions can be corrected
    from those blocks alone instead of from a copy of the logits with -inf written in."""

    ids: Int[Array, "S M"]  # suppressed ids, -1 = none (out-of-range ids dropped)
    hit_blocks: Int[Array, "S M"]  # block of each id; num_blocks for none (dropped by `correct`)
    num_blocks: int

    @classmethod
    def of(cls, suppress_ids: Int[Array, "S M"], vocab: int) -> Suppressed:
        num_blocks = -(-vocab // BLOCK)
        ids = jnp.where((suppress_ids >= 0) & (suppress_ids < vocab), suppress_ids, -1).astype(jnp.int32)
        return cls(ids=ids, hit_blocks=jnp.where(ids >= 0, ids // BLOCK, num_blocks), num_blocks=num_blocks)

    def mask(self, values: Float[Array, "S B 128"], block_ids: Int[Array, "S B"]) -> Float[Array, "S B 128"]:
        """`values` of the blocks `block_ids` with this row's suppressed ids set to -inf."""
        hit = jnp.any(block_token_ids(block_ids)[..., None] == self.ids[:, None, None, :], axis=-1)
        return jnp.where(hit, -jnp.inf, values)

    def own_blocks(self, blocks: Float[Array, "S NB 128"]) -> Float[Array, "S M 128"]:
        """The (masked) block holding each suppressed id."""
        safe = jnp.minimum(self.hit_blocks, self.num_blocks - 1)
        return self.mask(jnp.take_along_axis(blocks, safe[..., None], axis=1), safe)

    def correct(self, per_block: Float[Array, "S NB"], own: Float[Array, "S M"]) -> Float[Array, "S NB"]:
        """`per_block` with the suppressed ids' blocks replaced by `own` (their masked reductions)."""
        rows = jnp.broadcast_to(jnp.arange(per_block.shape[0])[:, None], self.hit_blocks.shape)
        return per_block.at[rows, self.hit_blocks].set(own, mode="drop")


def argmax_blocks(
    blocks: Float[Array, "S NB 128"], block_max: Float[Array, "S NB"], suppressed: Suppressed | None
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
            x = suppress(x.reshape(-1, vocab), suppress_ids.reshape(-1, suppress_ids.shape[-1])).reshape(x.shape)
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    blocks = block_view(x.reshape(-1, vocab))
    block_max = jnp.max(blocks, axis=-1)
    suppressed = None
    if suppress_ids is not None:
        suppressed = Suppressed.of(suppress_ids.reshape(-1, suppress_ids.shape[-1]), vocab)
        block_max = suppressed.correct(block_max, jnp.max(suppressed.own_blocks(blocks), axis=-1))
    return argmax_blocks(blocks, block_max, suppressed).reshape(lead)


def suppress(logits: Float[Array, "S V"], suppress_ids: Int[Array, "S M"]) -> Float[Array, "S V"]:
    """Set the suppressed ids of each row to -inf (-1 entries, and any out of range, are ignored)."""
    num_rows, vocab = logits.shape
    if suppress_ids.shape[1] == 0:
        return logits
    ids = jnp.where((suppress_ids >= 0) & (suppress_ids < vocab), suppress_ids, vocab)
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], ids.shape)
    return logits.at[rows, ids].set(-jnp.inf, mode="drop")


def row_keys(inputs: SamplingInputs) -> jax.Array:
    """One PRNG key per row: fold_in(fold_in(key(seed), sample_index), position)."""

    def one(seed: jax.Array, index: jax.Array, pos: jax.Array) -> jax.Array:
        key = jax.random.key(seed)
        return jax.random.fold_in(jax.random.fold_in(key, index), pos)

    return jax.vmap(one)(inputs.seeds, inputs.sample_index, inputs.positions)


def row_bits(inputs: SamplingInputs) -> UInt32[Array, "S 2"]:
    """Each row's two 32-bit words seeding its per-id noise."""
    return jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint32))(row_keys(inputs))


def _mix32(x: UInt32[Array, "..."]) -> UInt32[Array, "..."]:
    """murmur3's 32-bit finalizer (a bijection that spreads every input bit over the output)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def gumbel(bits: UInt32[Array, "S 2"], token_ids: Int[Array, "S_or_1 ..."]) -> Float[Array, "S ..."]:
    """Standard Gumbel noise of each (row, token id): a pure function of the row's bits and the id
    (`token_ids` per row, or one leading axis of 1 shared by every row)."""
    row = (bits.shape[0],) + (1,) * (token_ids.ndim - 1)
    h = _mix32((token_ids.astype(jnp.uint32) * jnp.uint32(0x9E3779B9)) ^ bits[:, 0].reshape(row))
    h = _mix32(h + bits[:, 1].reshape(row))
    u = ((h >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1): 24 bits, never 0 or 1
    return -jnp.log(-jnp.log(u))


def race_from_blocks(
    blocks: Float[Array, "S NB 128"], bits: UInt32[Array, "S 2"], suppressed: Suppressed | None
) -> Int[Array, "S"]:
    """`argmax(x + Gumbel noise)` over each row (suppressed ids excluded): a draw from softmax(x).

    The noisy logits are only reduced per block, then the winning block is recomputed, so no
    noisy copy of the logits is written.
    """
    num_blocks = blocks.shape[1]
    block_max = jnp.max(blocks + gumbel(bits, block_token_ids(jnp.arange(num_blocks, dtype=jnp.int32)[None])), axis=2)
    if suppressed is not None:
        own_ids = block_token_ids(jnp.minimum(suppressed.hit_blocks, num_blocks - 1))
        block_max = suppressed.correct(block_max, jnp.max(suppressed.own_blocks(blocks) + gumbel(bits, own_ids), axis=2))
    block = jnp.argmax(block_max, axis=1).astype(jnp.int32)
    inner = jnp.take_along_axis(blocks, block[:, None, None], axis=1)
    if suppressed is not None:
        inner = suppressed.mask(inner, block[:, None])
    noisy = inner[:, 0] + gumbel(bits, block_token_ids(block[:, None])[:, 0])
    return block * BLOCK + first_argmax(noisy)


def first_argmax(x: Float[Array, "S N"]) -> Int[Array, "S"]:
    """`jnp.argmax(x, axis=1)` (first index of the maximum; NaN counts as the maximum) as two plain
    reductions: the row maximum, then the least index holding it. XLA:CPU emits argmax as a scalar
    (value, index) reduce, which also computed the fused Gumbel noise's two logs one id at a time (~15 ns
    per id: a quarter of a tiny model's B=256 decode step); plain reductions vectorise, and `x`, read by
    both, is computed once."""
    top = jnp.max(x, axis=1, keepdims=True)  # XLA:CPU's fused max does not always propagate NaN: asked apart
    hit = jnp.where(jnp.any(jnp.isnan(x), axis=1, keepdims=True), jnp.isnan(x), x == top)
    return jnp.min(jnp.where(hit, jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[1]), axis=1)


def draw(processed: Float[Array, "S V"], inputs: SamplingInputs) -> Int[Array, "S"]:
    """Draw one token per row from softmax(processed) with the row's own noise (Gumbel-max)."""
    return race_from_blocks(block_view(processed), row_bits(inputs), None)
