"""`Eagle3Config`: how the engine drafts with an EAGLE-3 head (host-side, no JAX import)."""

from __future__ import annotations

import dataclasses

VERIFICATION_MODES = ("exact", "rejection")
CPU_MIN_CONFIDENCE = 0.5  # R1 prompts 0..7, B=1, k=3, slow hour: 1.10x at 0, 1.19x at 0.5; faster hour 1.01x vs 0.99x (README)


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Draft `k` tokens per step with the EAGLE-3 head saved at `path` (published HF layout)."""

    path: str
    k: int = 3
    auto_disable: bool = True  # skip drafting in steps where measured times say plain decoding is faster
    verification: str = "exact"  # as in NgramConfig: "exact" replay or "rejection" sampling
    aux_layer_ids: tuple[int, ...] | None = None  # override the checkpoint's (default (2, L // 2, L - 3))
    # Skip verification in a step where the head's first draft has a probability below this for every
    # sequence: that step decodes plainly in the same program (0 = always verify). Pays where a
    # verification step costs much more than a plain one (XLA:CPU at small batches, README).
    # None: CPU_MIN_CONFIDENCE on a CPU device, 0 on accelerators (`resolved_min_confidence`).
    min_confidence: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"Eagle3Config.path must be the head's checkpoint directory, got {self.path!r}")
        if self.k < 1:
            raise ValueError(f"Eagle3Config.k must be >= 1, got {self.k}")
        if self.verification not in VERIFICATION_MODES:
            raise ValueError(f"Eagle3Config.verification must be 'exact' or 'rejection', got {self.verification!r}")
        if self.min_confidence is not None and not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"Eagle3Config.min_confidence is a probability in [0, 1], got {self.min_confidence!r}")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise ValueError(f"Eagle3Config.aux_layer_ids needs 3 layer ids, got {self.aux_layer_ids!r}")

    def resolved_min_confidence(self, platform: str) -> float:
        """`min_confidence`, or its default for a device `platform` ("cpu", "gpu", "tpu")."""
        if self.min_confidence is not None:
            return self.min_confidence
        return CPU_MIN_CONFIDENCE if platform == "cpu" else 0.0
