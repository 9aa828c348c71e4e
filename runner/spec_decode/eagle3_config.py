"""`Eagle3Config`: how the engine drafts with an EAGLE-3 head (host-side, no JAX import)."""

from __future__ import annotations

import dataclasses

VERIFICATION_MODES = ("exact", "rejection")
# Draft-verify steps per device call by default: on the 2-core CPU at B=1 (R1, k=3) 8 steps per call
# measured 1.18x plain decoding where 1 step per call measured 1.07x (median of 3; 1.30x vs 1.11x in
# another run; bench_spec.py --verify-steps 1,8, README).
DEFAULT_VERIFY_STEPS = 8


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
    # Up to this many draft-verify steps per device call, acceptance decided on the device (exact
    # replay only); the host sees the batch once per call. 1 = one step per call. None:
    # DEFAULT_VERIFY_STEPS with exact replay and min_confidence 0, else 1 (README, "EAGLE-3").
    num_verify_steps: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"Eagle3Config.path must be the head's checkpoint directory, got {self.path!r}")
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"Eagle3Config.k must be an integer >= 1, got {self.k!r}")
        if self.verification not in VERIFICATION_MODES:
            raise ValueError(f"Eagle3Config.verification must be 'exact' or 'rejection', got {self.verification!r}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"Eagle3Config.min_confidence is a probability in [0, 1], got {self.min_confidence!r}")
        if self.num_verify_steps is None:  # resolved here, so the engine reads one number
            steps = DEFAULT_VERIFY_STEPS if self.verification == "exact" and self.min_confidence == 0 else 1
            object.__setattr__(self, "num_verify_steps", steps)
        if not isinstance(self.num_verify_steps, int) or not 1 <= self.num_verify_steps <= 64:
            raise ValueError(f"Eagle3Config.num_verify_steps must be an integer in [1, 64], got {self.num_verify_steps!r}")
        if self.num_verify_steps > 1 and (self.verification != "exact" or self.min_confidence > 0):
            raise ValueError("Eagle3Config.num_verify_steps > 1 runs exact-replay verification only, always verifying: "
                             "use verification='exact' and min_confidence=0, or num_verify_steps=1")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise ValueError(f"Eagle3Config.aux_layer_ids needs 3 layer ids, got {self.aux_layer_ids!r}")
