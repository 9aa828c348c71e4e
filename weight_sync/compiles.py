"""Count XLA compilations (to assert that repeated syncs, or engine steps, never compile).

Uses `jax.monitoring`'s duration events: jax records `/jax/core/compile/backend_compile_duration`
once per backend compilation (cache misses only; a persistent-cache hit records no such event).

    with CompileCounter() as cc:
        weight_sync.apply(plan, src, state)
    assert cc.count == 0
"""

from __future__ import annotations

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Context manager: `count` is the number of backend compilations while it is active."""

    def __init__(self) -> None:
        self.count = 0

    def _listener(self, event: str, duration: float, **kwargs: object) -> None:
        if event == COMPILE_EVENT:
            self.count += 1

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)
