"""What a weight update does to the samples in flight: their K/V recomputed under the new weights, or
their policy lag (versions since they began) bounded by aborting or recomputing them. Plain Python over
the scheduler's queues."""

from __future__ import annotations

from rollout.scheduler import Scheduler
from rollout.sequence import Sequence


def recompute_running(scheduler: Scheduler, version: int | None) -> None:
    """Free every running sequence's K/V (computed under weights just replaced) to recompute it under
    `version`, from which its policy lag counts."""
    for seq in sorted(scheduler.running, key=lambda s: -s.arrival):
        scheduler.preempt(seq, count=False)
        seq.admitted_version = version


def bound_lag(scheduler: Scheduler, version: int, max_lag: int, recompute: bool) -> tuple[list[Sequence], int]:
    """Samples that began more than `max_lag` versions before `version` (None counts as 0) are aborted,
    or (`recompute`) recomputed under the weights in force from now; returns (the aborted ones, how many
    were recomputed). A sample not begun yet starts its lag now."""
    aborted, recomputed = [], 0
    for seq in [s for s in [*scheduler.running, *scheduler.waiting] if not s.is_finished]:
        if not seq.num_output_tokens and seq not in scheduler.running:
            seq.admitted_version = version
        if version - (seq.admitted_version or 0) <= max_lag:
            continue
        if recompute:
            if seq in scheduler.running:
                scheduler.preempt(seq, count=False)
            seq.admitted_version = version
            recomputed += 1
        else:
            scheduler.abort([seq])
            aborted.append(seq)
    return aborted, recomputed
