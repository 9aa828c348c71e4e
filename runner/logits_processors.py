"""vLLM's logits processors on the device: allowed token ids, bad words, logit bias, and the repetition,
frequency and presence penalties, applied to each sampled row's logits before temperature (vLLM's
order: allowed ids, bad words, bias, then penalties). Raw logprobs never see them.

`LogitsAdjust` holds them per row (a step whose rows use none passes None and compiles none of this).
The output tokens the penalties and bad words read are on the device, so a multi-step decode call
appends each sampled token (`append_outputs`) and its later steps see it. Host arrays: `AdjustRows`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogitsAdjust:
    """Per sampled row (S rows; every id list padded with -1)."""

    allowed_ids: Int[Array, "S A"]  # a row whose first entry is >= 0 may sample only these
    bias_ids: Int[Array, "S B"]
    bias_values: Float[Array, "S B"]
    bad_words: Int[Array, "S W L"]  # each word right-aligned: its last token at L - 1, -1 before its first
    output_ids: Int[Array, "S H"]  # the row's output tokens so far, then room for a call's steps
    num_output: Int[Array, "S"]  # valid entries of `output_ids`
    prompt_ids: Int[Array, "S P"]  # the prompt's distinct tokens (read by the repetition penalty)
    presence: Float[Array, "S"]  # 0 = off
    frequency: Float[Array, "S"]  # 0 = off
    repetition: Float[Array, "S"]  # 1 = off


@dataclasses.dataclass(frozen=True)
class AdjustRows:
    """`LogitsAdjust` as exact-size host arrays, one row per sampled row (built by the engine)."""

    allowed_ids: np.ndarray  # [N, A]
    bias_ids: np.ndarray  # [N, B]
    bias_values: np.ndarray  # [N, B]
    bad_words: np.ndarray  # [N, W, L]
    output_ids: np.ndarray  # [N, H]
    num_output: np.ndarray  # [N]
    prompt_ids: np.ndarray  # [N, P]
    presence: np.ndarray  # [N]
    frequency: np.ndarray  # [N]
    repetition: np.ndarray  # [N]

    def take(self, index: np.ndarray) -> "AdjustRows":
        return AdjustRows(*(getattr(self, f.name)[index] for f in dataclasses.fields(self)))

    def padded(self, rows: int) -> LogitsAdjust:
        """Padded to `rows` rows (padding rows adjust nothing)."""
        def pad(x: np.ndarray, fill: float) -> np.ndarray:
            out = np.full((rows, *x.shape[1:]), fill, x.dtype)
            out[:len(x)] = x
            return out

        return LogitsAdjust(pad(self.allowed_ids, -1), pad(self.bias_ids, -1), pad(self.bias_values, 0),
                            pad(self.bad_words, -1), pad(self.output_ids, -1), pad(self.num_output, 0),
                            pad(self.prompt_ids, -1), pad(self.presence, 0), pad(self.frequency, 0),
                            pad(self.repetition, 1))


def _mask(ids: Int[Array, "S K"], vocab: int) -> Bool[Array, "S V"]:
    """True at each row's ids (-1 entries mark nothing)."""
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.zeros((ids.shape[0], vocab), jnp.bool_).at[rows, jnp.where(ids >= 0, ids, vocab)].set(True, mode="drop")


def banned_by_bad_words(adj: LogitsAdjust) -> Int[Array, "S W"]:
    """Each word's last token where the output so far ends with the rest of the word (-1 elsewhere)."""
    length = adj.bad_words.shape[-1]
    offsets = jnp.arange(length - 1) - (length - 1)  # the last L - 1 outputs, oldest first
    at = adj.num_output[:, None] + offsets[None, :]
    recent = jnp.where(at >= 0, jnp.take_along_axis(adj.output_ids, jnp.maximum(at, 0), axis=1), -2)  # [S, L-1]
    prefix = adj.bad_words[..., :-1]
    match = jnp.all((prefix < 0) | (prefix == recent[:, None, :]), axis=-1)
    last = adj.bad_words[..., -1]
    return jnp.where(match & (last >= 0), last, -1)


def output_counts(adj: LogitsAdjust, vocab: int) -> Float[Array, "S V"]:
    """How often each token occurs in each row's output so far."""
    num_rows, room = adj.output_ids.shape
    valid = (jnp.arange(room)[None, :] < adj.num_output[:, None]) & (adj.output_ids >= 0)
    rows = jnp.arange(num_rows)[:, None]
    return jnp.zeros((num_rows, vocab), jnp.float32).at[rows, jnp.where(valid, adj.output_ids, vocab)].add(
        1.0, mode="drop")


def apply_processors(logits: Float[Array, "S V"], adj: LogitsAdjust) -> Float[Array, "S V"]:
    """The logits every processor of each row has been applied to (vLLM's order)."""
    num_rows, vocab = logits.shape
    x = logits
    restricted = adj.allowed_ids[:, :1] >= 0
    x = jnp.where(restricted & ~_mask(adj.allowed_ids, vocab), -jnp.inf, x)
    x = jnp.where(_mask(banned_by_bad_words(adj), vocab), -jnp.inf, x)
    rows = jnp.arange(num_rows)[:, None]
    x = x.at[rows, jnp.where(adj.bias_ids >= 0, adj.bias_ids, vocab)].add(adj.bias_values, mode="drop")
    counts = output_counts(adj, vocab)
    in_output = counts > 0
    seen = in_output | _mask(adj.prompt_ids, vocab)
    rep = adj.repetition[:, None]
    x = jnp.where(seen & (rep != 1.0), jnp.where(x > 0, x / rep, x * rep), x)
    return x - adj.frequency[:, None] * counts - adj.presence[:, None] * in_output.astype(jnp.float32)


def append_outputs(adj: LogitsAdjust, sampled: Int[Array, "S"], active: Bool[Array, "S"]) -> LogitsAdjust:
    """`adj` after each active row sampled `sampled` (multi-step decode: later steps see it)."""
    at = jnp.arange(adj.output_ids.shape[1])[None, :] == adj.num_output[:, None]
    output_ids = jnp.where(at & active[:, None], sampled[:, None].astype(adj.output_ids.dtype), adj.output_ids)
    return dataclasses.replace(adj, output_ids=output_ids, num_output=adj.num_output + active.astype(jnp.int32))
