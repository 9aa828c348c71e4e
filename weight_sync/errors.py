"""The one error type of weight_sync: every problem found, listed together."""

from __future__ import annotations

from typing import Sequence


class WeightSyncError(ValueError):
    """A sync (or LoRA merge) that cannot be done; `problems` lists every reason, one per line.

    Raised before anything changes: the target keeps its old weights.
    """

    def __init__(self, problems: Sequence[str], *, header: str = "weight sync refused") -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{header}: {len(self.problems)} problem(s)\n{lines}")
