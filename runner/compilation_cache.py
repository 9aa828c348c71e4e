"""JAX's persistent compilation cache for the engine's step programs, so that a second process (the
next training run, a restarted server) loads its compiled programs instead of compiling them again.

The cache is process-wide (a JAX setting). `enable_compilation_cache` turns it on for a folder unless
the process already uses one (`JAX_COMPILATION_CACHE_DIR` or `jax.config`): then that one is kept.
"""

from __future__ import annotations

import logging
import os

import jax

logger = logging.getLogger(__name__)

MIN_COMPILE_SECONDS = 0.1  # programs quicker to compile than this are not written to the cache


def default_cache_dir() -> str:
    """`$XDG_CACHE_HOME/jax-rollout/xla` (`~/.cache/jax-rollout/xla` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jax-rollout", "xla")


def executables_dir(cache_dir: str) -> str | None:
    """Where the step programs' serialized executables go (`runner.executable_store`): a folder inside
    the compilation cache's; None for a cache that is not a local folder (e.g. `gs://...`)."""
    return None if "://" in cache_dir else os.path.join(cache_dir, "executables")


def enable_compilation_cache(directory: str) -> str:
    """Use `directory` as JAX's persistent compilation cache (created if missing); returns the folder in
    use (a folder the process had configured before wins)."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        if os.path.abspath(current) != os.path.abspath(directory):
            logger.info("keeping the process's compilation cache %s (not %s)", current, directory)
        return current
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()  # re-read the setting even if something was compiled before
    return directory
