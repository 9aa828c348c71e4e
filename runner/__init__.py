"""Device side of jax-rollout: models, checkpoint loading, paged KV cache, attention, sampling.

`runner.load_model(path | None, dtype=...)` -> (Flax NNX model, ModelConfig); None = the embedded
SmolLM2-135M-Instruct.
"""

from __future__ import annotations


def __getattr__(name: str) -> object:
    if name == "load_model":
        from runner.models.loader import load_model
        return load_model
    raise AttributeError(f"module 'runner' has no attribute {name!r}")
