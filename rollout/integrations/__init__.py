"""Adapters that plug the engine into other RL frameworks (each imported only when used)."""
