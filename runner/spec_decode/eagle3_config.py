"""`Eagle3Config`: how the engine drafts with an EAGLE-3 head (host-side, no JAX import)."""

from __future__ import annotations

import dataclasses

VERIFICATION_MODES = ("exact", "rejection")


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Draft `k` tokens per step with the EAGLE-3 head saved at `path` (published HF layout)."""

    path: str
    k: int = 3
    auto_disable: bool = True  # skip drafting in steps where measured times say plain decoding is faster
    verification: str = "exact"  # as in NgramConfig: "exact" replay or "rejection" sampling
    aux_layer_ids: tuple[int, ...] | None = None  # override the checkpoint's (default (2, L // 2, L - 3))
    # Skip verification in a step where the head's first draft has a probability below this for every
    # sequence: that step decodes plainly in the same program (0 = always verify, the default: on the
    # 2-core CPU, B=1, 0.3 and 0.5 measured no better than 0, README "Skipping verification").
    min_confidence: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"Eagle3Config.path must be the head's checkpoint directory, got {self.path!r}")
        if self.k < 1:
            raise ValueError(f"Eagle3Config.k must be >= 1, got {self.k}")
        if self.verification not in VERIFICATION_MODES:
            raise ValueError(f"Eagle3Config.verification must be 'exact' or 'rejection', got {self.verification!r}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"Eagle3Config.min_confidence is a probability in [0, 1], got {self.min_confidence!r}")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise ValueError(f"Eagle3Config.aux_layer_ids needs 3 layer ids, got {self.aux_layer_ids!r}")
