"""Counting XLA compilations, so a trainer, the engine's tests and its benchmarks can assert that none
happened (a repeated sync, an engine step after warm-up).

JAX records `/jax/core/compile/backend_compile_duration` once per backend compilation, a load from its
persistent compilation cache included (both go through `compile_or_get_cached`).

    with CompileCounter() as cc:
        weight_sync.apply(plan, src, state)
    assert cc.count == 0
"""

from __future__ import annotations

import threading

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class _ProcessCounter:
    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name: str, duration: float, **kwargs: object) -> None:
        if name == COMPILE_EVENT:
            with self._lock:
                self.count += 1


_counter: _ProcessCounter | None = None


def num_compilations() -> int:
    """Backend compilations so far in this process (every thread); counting starts at the first call."""
    global _counter
    if _counter is None:
        _counter = _ProcessCounter()
    return _counter.count


class CompileCounter:
    """Context manager: `count` is the number of backend compilations while it is (or was) active."""

    def __init__(self) -> None:
        self._start: int | None = None
        self._end: int | None = None

    @property
    def count(self) -> int:
        if self._start is None:
            return 0
        return (self._end if self._end is not None else num_compilations()) - self._start

    def __enter__(self) -> "CompileCounter":
        self._start, self._end = num_compilations(), None
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = num_compilations()
