"""Shared helpers for the `examples/bench_*.py` benchmarks (see `docs/benchmarks.md`).

- `cpu_settings()`: the CPU knobs in effect (XLA_FLAGS, thread counts, tcmalloc via LD_PRELOAD),
  so that a printed figure says what it was measured under;
- `RssSampler`: peak resident set size over a region (a background thread polling psutil), next
  to `peak_rss_bytes()`, the process high-water mark from `getrusage`;
- `measure_bandwidth()` / `measure_matmul_flops()` / `roofline_tokens_per_s()`: the machine's
  physical limit for decode, measured in the same run as the benchmark;
- `timed_median()`: one untimed warm-up, then the median wall time of N repeats;
- `print_table()` / `json_line()`: the output conventions (one line per run, one final JSON line);
- `code_at()` / `run_worker()`: the engine's code at another git revision (a temporary worktree) measured
  in its own process on the same workload, for benchmarks that compare two commits (`--compare REF`).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

# The workload's physical limit (WORKLOAD.md, "The physical limit"): SmolLM2-135M, float32.
WEIGHT_BYTES_PER_STEP = 0.54e9  # decode reads every weight once per step
FLOPS_PER_TOKEN = 0.27e9  # ~2 x 135M parameters


# ---- settings --------------------------------------------------------------------------------
def cpu_settings(torch_module: Any = None) -> dict[str, Any]:
    """The CPU settings in effect: env knobs, usable cores, tcmalloc, torch threads (if imported)."""
    ld_preload = os.environ.get("LD_PRELOAD", "")
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count()
    out: dict[str, Any] = {
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", ""),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
        "LD_PRELOAD": ld_preload,
        "tcmalloc_preloaded": "tcmalloc" in ld_preload,
    }
    if torch_module is not None:
        out["torch_num_threads"] = torch_module.get_num_threads()
        out["torch_num_interop_threads"] = torch_module.get_num_interop_threads()
    return out


# ---- memory ----------------------------------------------------------------------------------
def peak_rss_bytes() -> int:
    """The process's RSS high-water mark since start (getrusage; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class RssSampler:
    """`with RssSampler() as s: ...` -> `s.peak` is the largest RSS seen during the block (bytes)."""

    def __init__(self, interval_s: float = 0.02) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak = 0

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            self._stop.wait(self._interval)

    def __enter__(self) -> "RssSampler":
        self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


# ---- the machine's limits --------------------------------------------------------------------
def _best_of(fn: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> dict[str, float]:
    """Memory bandwidth in bytes/s, best of `repeats`, on arrays well beyond the caches.

    Two measurements: a numpy copy (STREAM "copy" convention: read + write = 2 x nbytes, one
    thread) and a jitted JAX sum (read-only, XLA's threads: closer to how decode streams the
    weights). `bandwidth` is the larger, so the roofline is an upper bound, not flattering.
    """
    import jax
    import jax.numpy as jnp

    n = nbytes // 4
    src = np.ones(n, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages
    copy_s = _best_of(lambda: np.copyto(dst, src), repeats)
    del dst
    x = jnp.asarray(src)
    del src
    total = jax.jit(lambda a: jnp.sum(a))
    total(x).block_until_ready()
    read_s = _best_of(lambda: total(x).block_until_ready(), repeats)
    del x
    copy_bw, read_bw = 2 * nbytes / copy_s, nbytes / read_s
    return {"numpy_copy_Bps": copy_bw, "jax_read_Bps": read_bw, "bandwidth": max(copy_bw, read_bw)}


def measure_matmul_flops(shapes: Sequence[tuple[int, int, int]] = ((64, 576, 1536), (512, 576, 1536), (1024, 1024, 1024)),
                         repeats: int = 5, dtype: str = "float32") -> dict[str, float]:
    """Matmul FLOP/s of jitted `[M, K] @ [K, N]` in `dtype` (model-shaped: hidden 576, MLP 1536), best
    of `repeats` per shape; `flops` is the largest (again an upper bound). On an accelerator a
    4096^3 product joins the shapes (the small ones are launch-bound there)."""
    import jax
    import jax.numpy as jnp

    out: dict[str, float] = {}
    rng = np.random.default_rng(0)
    mm = jax.jit(jnp.matmul)
    if jax.default_backend() != "cpu":
        shapes = (*shapes, (4096, 4096, 4096))
    for m, k, n in shapes:
        a = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32), dtype=dtype)
        b = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32), dtype=dtype)
        mm(a, b).block_until_ready()
        reps = max(repeats, int(2e9 // (2 * m * k * n)))  # at least ~2 GFLOP per measurement
        s = _best_of(lambda: mm(a, b).block_until_ready(), reps)
        out[f"matmul_{m}x{k}x{n}_flops"] = 2 * m * k * n / s
    out["flops"] = max(out.values())
    return out


def roofline_tokens_per_s(batch: int, bandwidth: float, flops: float, weight_bytes: float = WEIGHT_BYTES_PER_STEP,
                          flops_per_token: float = FLOPS_PER_TOKEN) -> float:
    """Upper bound on decode tokens/s at batch size `batch`: min(memory bound, compute bound);
    `weight_bytes` read per step (half of the float32 figure in bfloat16)."""
    return min(bandwidth / weight_bytes * batch, flops / flops_per_token)


def accelerator_peak_bytes() -> int | None:
    """Peak bytes in use on JAX's first device since start, where the backend reports it (GPU, TPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def r1_prompt(i: int) -> str:
    """Workload R1's prompt i (docs/benchmarks.md)."""
    return f"Question {i}: Write a short paragraph about the number {i} and why it is interesting. Answer:"


def r2_prompt(i: int) -> str:
    """Workload R2's prompt i: `Task i.`, a ~300-token preamble of rules, then R1's prompt i."""
    preamble = " ".join(f"Rule {k}: answer briefly, show each step, and check the arithmetic." for k in range(1, 25))
    return f"Task {i}. {preamble} {r1_prompt(i)}"


# ---- timing ----------------------------------------------------------------------------------
def timed_median(fn: Callable[[], Any], repeats: int, *, before_each: Callable[[], None] | None = None,
                 warmup: bool = True) -> tuple[float, list[float], Any, int]:
    """Run `fn` once untimed (warm-up), then `repeats` timed times.

    `before_each` runs (untimed) before every call, e.g. to clear a cache. Returns
    (median seconds, all seconds, the last result, peak RSS bytes over the timed calls).
    """
    if warmup:
        if before_each is not None:
            before_each()
        fn()
    times: list[float] = []
    result = None
    peak = 0
    for _ in range(repeats):
        if before_each is not None:
            before_each()
        with RssSampler() as rss:
            t0 = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - t0)
        peak = max(peak, rss.peak)
    return statistics.median(times), times, result, peak


# ---- output ----------------------------------------------------------------------------------
def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f} MiB"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain left-aligned text table."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for j, r in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


def json_line(obj: dict[str, Any], path: str | None = None) -> str:
    """One compact JSON line (printed by the caller); also written to `path` if given."""
    line = json.dumps(obj, separators=(",", ":"), default=float)
    if path:
        with open(path, "w") as f:
            f.write(line + "\n")
    return line


# ---- two commits -----------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit_of(root: str = ROOT) -> str:
    return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


@contextlib.contextmanager
def code_at(ref: str | None) -> Iterator[str | None]:
    """The project's code at git revision `ref` as a folder (a temporary `git worktree`, removed after);
    None for None."""
    if ref is None:
        yield None
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "ref")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", root, ref], check=True, capture_output=True)
        try:
            yield root
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", root], capture_output=True)


def run_worker(script: str, code_root: str, argv: Sequence[str]) -> dict[str, Any]:
    """Run `script --worker --code-root code_root argv` in its own process (it imports the engine from
    `code_root`) and return the JSON object its last output line holds."""
    cmd = [sys.executable, script, "--worker", "--code-root", code_root, *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def use_code(code_root: str) -> None:
    """Import the engine (and the tests' helpers) from `code_root` in a worker process."""
    sys.path[:0] = [code_root, os.path.join(code_root, "tests")]
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
