"""Device side of jax-rollout: models, checkpoint loading, paged KV cache, attention, sampling."""
