"""N-gram prompt lookup: propose the tokens that followed the latest earlier match of the last n tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    """Draft `k` tokens by matching the last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`."""

    k: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    auto_disable: bool = True  # skip drafting in steps where measured times say plain decoding is faster
    # "exact": replay the target's own per-position draw (outputs bit-identical to plain decoding);
    # "rejection": accept a draft with probability p(draft), else draw from p without it (lossless
    # in distribution; accepts more often when sampling, different tokens than plain decoding).
    verification: str = "exact"

    def __post_init__(self) -> None:
        if self.verification not in ("exact", "rejection"):
            raise ValueError(f"NgramConfig.verification must be 'exact' or 'rejection', got {self.verification!r}")
        if not all(isinstance(v, int) for v in (self.k, self.prompt_lookup_min, self.prompt_lookup_max)):
            raise ValueError("NgramConfig.k, prompt_lookup_min and prompt_lookup_max must be integers, got "
                             f"{self.k!r}, {self.prompt_lookup_min!r}, {self.prompt_lookup_max!r}")
        if self.k < 1:
            raise ValueError(f"NgramConfig.k must be >= 1, got {self.k}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("NgramConfig needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")


def propose_ngram(token_ids: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to `k` draft tokens for one sequence (empty when no earlier n-gram matches its tail).

    Vectorised over positions: every window of the history is compared at once per n.
    """
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(token_ids[:length - 1], n)  # window i = tokens[i:i+n], followed by i+n
        hits = np.flatnonzero(np.all(windows == token_ids[length - n:], axis=1))
        if hits.size:
            start = hits[-1] + n
            return token_ids[start:start + k]
    return token_ids[:0]


def propose_batch(histories: list[np.ndarray], limits: list[int], config: NgramConfig) -> list[np.ndarray]:
    """Drafts for a batch; `limits[i]` caps sequence i's draft (room left before max_tokens / max_model_len)."""
    return [propose_ngram(h, min(config.k, lim), config.prompt_lookup_min, config.prompt_lookup_max)
            if lim > 0 else h[:0] for h, lim in zip(histories, limits)]
