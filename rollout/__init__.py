"""jax-rollout public API: `Engine`, `AsyncEngine`, `SamplingParams`, outputs, `Trajectory`, `load_tokenizer`, `NgramConfig`, `Eagle3Config`,
`SharedWeightsDeleted`.

Names are imported lazily so that the host-side scheduler and block manager stay importable
(and testable) without JAX.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "rollout.engine",
    "AsyncEngine": "rollout.async_engine",
    "EngineConfig": "rollout.engine_config",
    "EngineStats": "rollout.engine_config",
    "SamplingParams": "rollout.sampling_params",
    "RequestOutput": "rollout.outputs",
    "CompletionOutput": "rollout.outputs",
    "TokenLogprob": "rollout.outputs",
    "RolloutBatch": "rollout.outputs",
    "Trajectory": "rollout.trajectory",
    "Tokenizer": "rollout.tokenizer",
    "load_tokenizer": "rollout.tokenizer",
    "NgramConfig": "runner.spec_decode.ngram",
    "Eagle3Config": "runner.spec_decode.eagle3_config",
    "SharedWeightsDeleted": "runner.device_weights",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rollout' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
