"""How a step's rows sample, on the host: `SamplingRows` (one entry per sampled row), `SamplingRow` (one
sequence's settings as a tuple the engine builds once per sequence, not once per step) and `choose_mode`,
the static sampler variant a step compiles for (numpy; `runner.sampler` is the device side)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np
from jaxtyping import Bool, Float, Int, UInt32

# (temperature, top_k (0 = off), top_p, min_p, seed, sample_index, processed logprobs, wants a logprob,
#  reports logits instead of logprobs)
SamplingRow = tuple[float, int, float, float, int, int, bool, bool, bool]
_DTYPES = (np.float32, np.int32, np.float32, np.float32, np.uint32, np.int32, np.bool_, np.bool_, np.bool_)

Mode = Literal["greedy", "random", "filtered"]
SAMPLER_MODES: tuple[Mode, ...] = ("greedy", "random", "filtered")  # the order a step's `mode` indexes
GREEDY_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)


@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """One entry per sampled row (N: a row per sequence, or per verified token); padded on the device
    side into `runner.step_padding.SamplingInputs`."""

    temperature: Float[np.ndarray, "N"]  # 0 = greedy
    top_k: Int[np.ndarray, "N"]  # 0 = off
    top_p: Float[np.ndarray, "N"]  # 1 = off
    min_p: Float[np.ndarray, "N"]  # 0 = off
    seeds: UInt32[np.ndarray, "N"]
    sample_index: Int[np.ndarray, "N"]  # which of its request's n samples the row's sequence is
    processed: Bool[np.ndarray, "N"]  # logprobs of the processed distribution (else the raw logits')
    want_logprob: Bool[np.ndarray, "N"]  # rows whose sampled token's logprob is returned
    as_logits: Bool[np.ndarray, "N"]  # rows that report logits, not logprobs (`logprobs_mode` *_logits)

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow]) -> "SamplingRows":
        columns = zip(*rows) if rows else ((),) * len(_DTYPES)
        return cls(*(np.array(col, dtype) for col, dtype in zip(columns, _DTYPES)))

    def take(self, index: np.ndarray) -> "SamplingRows":
        """The rows at `index` (a subset, or rows repeated per verified token)."""
        return SamplingRows(*(getattr(self, f.name)[index] for f in dataclasses.fields(self)))

    def __len__(self) -> int:
        return len(self.temperature)


def choose_mode(
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    *,
    processed: np.ndarray | None = None,
    vocab_size: int | None = None,
) -> Mode:
    """Cheapest static mode that is exact for these rows.

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
