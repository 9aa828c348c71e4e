"""Device-side token sampling and logprobs for one engine step.

This file owns turning a batch of S logits rows into sampled tokens: per-row temperature, top-k,
top-p, min-p, suppressed ids, per-row randomness, and the logprobs returned to the caller (the
sampled token's and the top-K alternatives), for the static `mode` the host chose
(`runner.sampling_rows.choose_mode`). The blocked reductions and the noise live in
`runner.sampler_blocks`, the kept set of top-k / top-p / min-p in `runner.sampler_filters`.

Order of operations (as vLLM): the logits processors (`runner.logits_processors`: allowed ids, bad
words, bias, penalties; only when `SamplingInputs.adjust` is given), suppression, temperature scaling,
top-k, top-p, min-p, then a Gumbel-max draw from the processed distribution.

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

Randomness is keyed per row by (seed, sample index, position) (`runner.sampler_blocks`): a row's
token never depends on the other rows, the batch order, or whether the batch ran in "random" or
"filtered" mode (a row without filters gets the same token in both).

Rejection sampling (`draft_ids` given, speculative decoding's optional mode): a row with a draft
token d (a deterministic n-gram draft, so the draft distribution q is one-hot at d) keeps d with
probability min(1, p(d) / q(d)) = p(d), drawn from a uniform (key folded with 1), and
otherwise draws from norm(max(0, p - q)) = p without d, with the row's usual noise. The token is
then distributed exactly as p; greedy rows keep their argmax (accepting d only if it is the argmax).

Logprobs (per row, chosen by `SamplingInputs.processed`):
- raw: `log_softmax` of the model's logits as given (neither processors nor suppression apply).
- processed: `log_softmax` of the distribution actually sampled from (after the processors,
  suppression, temperature and filtering; filtered-out tokens are -inf). For a greedy row this is the
  filtered distribution at temperature 1 (top-k/top-p/min-p applied to the suppressed logits).
Rows in `SamplingInputs.as_logits` report those logits themselves instead of log-probabilities. Each
row's `ranks` entry is 1 + the number of tokens above the sampled one in its mode (vLLM's rank).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from runner import row_sum
from runner.logits_processors import apply_processors
from runner.sampler_blocks import (Suppressed, argmax_blocks, argmax_last, block_view, draw, race_from_blocks, row_bits,
                                   row_keys, suppress)
from runner.sampler_filters import NUM_CANDIDATES, filter_mask, filtered_draw, processed_for_logprobs
from runner.sampling_rows import GREEDY_EPS, SAMPLER_MODES, Mode
from runner.step_padding import SamplingInputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """Sampled tokens and their logprobs (in each row's logprobs mode), and the sampling record."""

    token_ids: Int[Array, "S"]
    logprobs: Float[Array, "S"]  # logprob of the sampled token in the row's logprobs mode
    top_ids: Int[Array, "S K"]  # K = num_top_logprobs (static, may be 0); descending logprob
    top_logprobs: Float[Array, "S K"]
    # The sampling record (`num_kept` > 0; None otherwise): log of the mass the suppression and filters
    # kept of softmax(logits / T), the kept set's size, and its `num_kept` most likely ids (-1 past the set).
    kept_logmass: Float[Array, "S"] | None = None
    kept_counts: Int[Array, "S"] | None = None
    kept_ids: Int[Array, "S M"] | None = None
    ranks: Int[Array, "S"] | None = None  # 1 + tokens scoring above the sampled one (0 where no logprob was asked)
    # each token's experts per routed-experts layer (`record_routing`; per token of the step, not per row)
    routed_experts: Int[Array, "T L k"] | None = None


def kept_record(raw: Float[Array, "S V"], base: Float[Array, "S V"], inputs: SamplingInputs, greedy: Bool[Array, "S"], divisor: Float[Array, "S"],
                *, filtered: bool, num_kept: int, num_candidates: int = NUM_CANDIDATES
                ) -> tuple[Float[Array, "S"], Int[Array, "S"], Int[Array, "S M"]]:
    """Each row's kept set under the distribution it samples from (suppression, then top-k / top-p / min-p
    when `filtered`; a greedy row's at temperature 1, as its processed logprobs): (log of its mass under
    softmax(raw / T), its size, its `num_kept` most likely ids padded with -1). A trainer recovers the
    processed logprob of token t as `log_softmax(logits / T)[t] - kept_logmass`. `base`: `raw` after the
    logits processors (only ones that mask tokens out may be on when a record is asked for)."""
    scaled = suppress(base, inputs.suppress_ids) / divisor[:, None]
    if filtered:
        scaled = jnp.where(filter_mask(scaled, inputs, greedy, num_candidates), scaled, -jnp.inf)
    log_mass = jax.nn.logsumexp(scaled, axis=1) - jax.nn.logsumexp(raw / divisor[:, None], axis=1)
    counts = jnp.sum(scaled > -jnp.inf, axis=1).astype(jnp.int32)
    _, ids = lax.top_k(scaled, num_kept)
    ids = jnp.where(jnp.arange(num_kept)[None, :] < counts[:, None], ids, -1).astype(jnp.int32)
    return log_mass, counts, ids


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
    blocks = block_view(raw) / divisor[:, None, None]
    suppressed = Suppressed.of(inputs.suppress_ids, vocab)
    own = suppressed.own_blocks(blocks)
    block_max = suppressed.correct(jnp.max(blocks, axis=2), jnp.max(own, axis=2))
    row_max = jnp.max(block_max, axis=1)
    shift = row_max[:, None, None]
    block_sum = suppressed.correct(jnp.sum(jnp.exp(blocks - shift), axis=2), jnp.sum(jnp.exp(own - shift), axis=2))
    drawn = race_from_blocks(blocks, row_bits(inputs), suppressed)
    token_ids = jnp.where(greedy, argmax_blocks(blocks, block_max, suppressed), drawn)
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
    accept_keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(row_keys(inputs))
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(accept_keys)
    is_draft = lax.broadcasted_iota(jnp.int32, processed.shape, 1) == d[:, None]
    residual = jnp.where(has_draft[:, None] & is_draft, -jnp.inf, processed)
    empty = jnp.all(residual == -jnp.inf, axis=1)  # p(d) = 1: d is always kept
    accept = has_draft & ((jnp.log(u) < log_p_draft) | empty)
    drawn = draw(jnp.where(empty[:, None], processed, residual), inputs)
    return jnp.where(accept, d, drawn)


def _token_logprob(logits: Float[Array, "S V"], token_ids: Int[Array, "S"]) -> Float[Array, "S"]:
    """log_softmax(logits)[row, token] without materializing the full log_softmax."""
    picked = jnp.take_along_axis(logits, token_ids[:, None], axis=1)[:, 0]
    return picked - row_sum.logsumexp(logits)


@functools.partial(jax.jit, static_argnames=("mode", "num_top_logprobs", "num_candidates", "num_kept"))
def sample(
    logits: Float[Array, "S V"],
    inputs: SamplingInputs,
    *,
    mode: Mode,
    num_top_logprobs: int = 0,
    num_candidates: int = NUM_CANDIDATES,
    num_kept: int = 0,
) -> SamplerOutput:
    """Sample one token per row and return its logprob (and top-K alternatives) in the row's mode.

    `mode` (static): "greedy" = argmax everywhere, no randomness; "random" = temperature only, no
    filtering and no sort; "filtered" = temperature + top-k + top-p + min-p (see the module doc).
    Rows with temperature 0 are argmax in every mode. Filters are ignored outside "filtered".
    `num_candidates` (static): "filtered" first filters the top-C logits of each row and falls back
    to sorting whole rows only when some row's kept set may extend past them (same result).
    `num_kept` (static) > 0: also the sampling record (`kept_record`) of every row.
    `inputs.adjust`: the rows' logits processors (`runner.logits_processors`), applied before all of it.
    """
    if mode not in SAMPLER_MODES:
        raise ValueError(f"unknown sampling mode {mode!r}; expected one of {SAMPLER_MODES}")
    raw = logits.astype(jnp.float32)
    base = raw if inputs.adjust is None else apply_processors(raw, inputs.adjust)
    out = _sample(raw, base, inputs, mode=mode, num_top_logprobs=num_top_logprobs, num_candidates=num_candidates)
    if num_kept == 0:
        return out
    temperature = inputs.temperature.astype(jnp.float32)
    greedy = temperature < GREEDY_EPS
    log_mass, counts, ids = kept_record(raw, base, inputs, greedy, jnp.where(greedy, 1.0, temperature),
                                        filtered=mode == "filtered", num_kept=num_kept, num_candidates=num_candidates)
    return dataclasses.replace(out, kept_logmass=log_mass, kept_counts=counts, kept_ids=ids)


def _rank(values: Float[Array, "S V"], picked: Float[Array, "S"]) -> Int[Array, "S"]:
    """1 + how many tokens of each row score above its sampled one (vLLM's `Logprob.rank`)."""
    return 1 + jnp.sum(values > picked[:, None], axis=1).astype(jnp.int32)


def _sample(raw: Float[Array, "S V"], base: Float[Array, "S V"], inputs: SamplingInputs, *, mode: Mode,
            num_top_logprobs: int, num_candidates: int) -> SamplerOutput:
    """`sample` without the sampling record: tokens from `base` (the processed logits before
    temperature), raw logprobs from `raw`."""
    num_rows, vocab = raw.shape
    temperature = inputs.temperature.astype(jnp.float32)
    greedy = temperature < GREEDY_EPS
    divisor = jnp.where(greedy, 1.0, temperature)
    want_processed = inputs.processed.astype(jnp.bool_)
    no_top_ids, no_top_logprobs = jnp.zeros((num_rows, 0), jnp.int32), jnp.zeros((num_rows, 0), jnp.float32)
    no_ranks = jnp.zeros(num_rows, jnp.int32)
    fast = inputs.draft_ids is None and inputs.as_logits is None and num_top_logprobs == 0
    if mode == "random" and fast:
        token_ids, processed_logprobs = _sample_random(base, inputs, divisor, greedy)

        def raw_logprob_and_rank() -> tuple[Float[Array, "S"], Int[Array, "S"]]:
            raw_logprobs = _token_logprob(raw, token_ids)
            scaled = suppress(base, inputs.suppress_ids) / divisor[:, None]
            chosen = jnp.where(want_processed[:, None], scaled, raw)
            return raw_logprobs, _rank(chosen, jnp.take_along_axis(chosen, token_ids[:, None], axis=1)[:, 0])

        wants = jnp.bool_(True) if inputs.want_logprob is None else jnp.any(inputs.want_logprob)
        raw_logprobs, ranks = lax.cond(wants, raw_logprob_and_rank, lambda: (jnp.zeros(num_rows, jnp.float32), no_ranks))
        token_logprobs = jnp.where(want_processed, processed_logprobs, raw_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=token_logprobs, top_ids=no_top_ids,
                             top_logprobs=no_top_logprobs, ranks=ranks)
    if mode == "greedy":  # suppression without a copy of the logits unless a logprob needs them
        token_ids = argmax_last(base, inputs.suppress_ids)
        processed_fn = functools.partial(suppress, base, inputs.suppress_ids)
    elif mode == "filtered" and inputs.draft_ids is None:
        scaled = suppress(base, inputs.suppress_ids) / divisor[:, None]
        token_ids = jnp.where(greedy, argmax_last(scaled), filtered_draw(scaled, inputs, num_candidates))
        processed_fn = functools.partial(processed_for_logprobs, scaled, inputs, greedy, num_candidates)
    else:
        scaled = suppress(base, inputs.suppress_ids) / divisor[:, None]
        if mode == "filtered":
            processed = jnp.where(filter_mask(scaled, inputs, greedy, num_candidates), scaled, -jnp.inf)
        else:
            processed = scaled
        drawn = draw(processed, inputs) if inputs.draft_ids is None else _verify_drafts(processed, inputs)
        token_ids = jnp.where(greedy, argmax_last(processed), drawn)
        processed_fn = lambda: processed  # noqa: E731

    def chosen_values() -> tuple[Float[Array, "S V"], Float[Array, "S"], Float[Array, "S"], Int[Array, "S"]]:
        """Each row's logits in its mode, the sampled token's logit, its logprob, its rank."""
        chosen = jnp.where(want_processed[:, None], processed_fn(), raw)
        picked = jnp.take_along_axis(chosen, token_ids[:, None], axis=1)[:, 0]
        # the sampled token's logprob by one formula with or without alternatives: a row's bits do not
        # depend on whether another row of the step asked for top logprobs
        return chosen, picked, picked - row_sum.logsumexp(chosen), _rank(chosen, picked)

    if num_top_logprobs > 0:
        chosen, picked, token_logprobs, ranks = chosen_values()
        top_logprobs, top_ids = lax.top_k(row_sum.log_softmax(chosen), min(num_top_logprobs, vocab))
        top_ids = top_ids.astype(jnp.int32)
        if inputs.as_logits is not None:
            logits_rows = inputs.as_logits[:, None]
            top_logprobs = jnp.where(logits_rows, jnp.take_along_axis(chosen, top_ids, axis=1), top_logprobs)
            token_logprobs = jnp.where(inputs.as_logits, picked, token_logprobs)
    else:
        def logprob_and_rank() -> tuple[Float[Array, "S"], Int[Array, "S"]]:
            _, picked, logprob, ranks = chosen_values()
            return (logprob if inputs.as_logits is None else jnp.where(inputs.as_logits, picked, logprob)), ranks

        if inputs.want_logprob is None:
            token_logprobs, ranks = logprob_and_rank()
        else:
            token_logprobs, ranks = lax.cond(jnp.any(inputs.want_logprob), logprob_and_rank,
                                             lambda: (jnp.zeros(num_rows, jnp.float32), no_ranks))
        top_ids, top_logprobs = no_top_ids, no_top_logprobs
    return SamplerOutput(token_ids=token_ids, logprobs=token_logprobs, top_ids=top_ids, top_logprobs=top_logprobs,
                         ranks=ranks)
