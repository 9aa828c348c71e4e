"""Device side of jax-rollout: models, checkpoint loading, paged KV cache, attention, the step programs,
sampling, speculative drafting, sharding and kernel backends (docs/architecture.md).

`runner.models.loader.load_model(path | None, dtype=...)` -> (Flax NNX model, ModelConfig); None = the
embedded SmolLM2-135M-Instruct.
"""
