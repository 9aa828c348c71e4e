"""Counting XLA compilations, so tests and benchmarks can assert that none happened."""

from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"


class _Counter:
    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name: str, duration: float, **kwargs: object) -> None:
        if name == _EVENT:
            with self._lock:
                self.count += 1


_counter: _Counter | None = None


def num_compilations() -> int:
    """Backend compilations so far in this process, loads from the persistent compilation cache included
    (JAX records both as one event); counting starts at the first call."""
    global _counter
    if _counter is None:
        _counter = _Counter()
    return _counter.count
