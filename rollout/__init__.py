"""jax-rollout public API."""
