"""Step programs called as compiled executables, stored on disk so a second process skips tracing and lowering.

JAX's persistent compilation cache removes XLA's compile from a second start, but JAX still traces and
lowers every program to compute the cache key: on SmolLM2 ~0.7 s of each step program's ~0.9 s. A
`StoredProgram` looks its executables up by a key computed without tracing (the code version, the
program's identity, its static arguments and the shapes of its inputs), loads a serialized executable
from an `ExecutableStore` on a miss, and only compiles (`lower().compile()`: see below for how such a
compile avoids JAX's persistent cache) when none is stored.

The key covers everything the compiled program depends on: a hash of this package's source files
(Python and C++ kernels), the jax / jaxlib / flax versions, XLA_FLAGS, the CPU's feature flags, the
model's graph definition (structure and config), the shapes, dtypes and shardings of every input and
the static arguments. Editing the engine's code changes the key: a stale executable is never called.
Stored files are pickles read back with `pickle` (as JAX's own cache): only point the store at a
folder you trust.

Only fresh compiles are stored: an XLA:CPU executable that was itself loaded (from JAX's persistent
cache) serializes without some of its kernels ("Function bitcast_gather_fusion not found" when the
next process runs it). A store compile therefore runs with JAX's persistent cache switched off (a
process-wide setting, off only while store compiles run) and with its own `compiler_options` (XLA's
default of `xla_embed_ir_in_executable`, given explicitly), so jit's in-memory cache cannot hand back
an executable some other compile loaded; a per-thread count of JAX's cache-hit event checks it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import jax
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache

logger = logging.getLogger(__name__)

_SOURCE_SUFFIXES = (".py", ".cc", ".h")
# XLA's default value, given explicitly: a store compile is its own entry in jit's in-memory cache
STORE_COMPILER_OPTIONS = {"xla_embed_ir_in_executable": False}


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of what decides a compiled program besides its inputs: this package's sources, the JAX
    stack's versions, XLA_FLAGS and the CPU's feature flags (an executable is machine code)."""
    digest = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(p for p in root.rglob("*") if p.suffix in _SOURCE_SUFFIXES):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    import flax
    import jaxlib

    digest.update(f"{jax.__version__}|{jaxlib.__version__}|{flax.__version__}|{os.environ.get('XLA_FLAGS', '')}"
                  .encode())
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        digest.update(next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
                      .encode())
    return digest.hexdigest()


def describe_arrays(tree: object) -> str:
    """Shapes, dtypes and layouts of a pytree's arrays (part of a program's identity); equivalent shardings
    (one device as `SingleDeviceSharding` or as a one-device mesh) are described alike."""
    leaves, treedef = jax.tree.flatten(tree)
    return f"{treedef}|" + ";".join(f"{x.shape}:{x.dtype}:{_layout(x)}" for x in leaves)


def _layout(x: object) -> str:
    sharding = getattr(x, "sharding", None)
    if sharding is None:  # a host (numpy) array
        return "host"
    devices = sorted(d.id for d in sharding.device_set)
    return f"{devices}:" + ("replicated" if sharding.is_fully_replicated else str(sharding.spec))


@functools.lru_cache(maxsize=None)
def open_store(directory: str) -> ExecutableStore:
    """The process's store for `directory` (shared by every runner, so engines of one structure built one
    after another reuse each other's executables); `open_store.cache_clear()` lets them go."""
    return ExecutableStore(directory)


class ExecutableStore:
    """Serialized executables in one folder, one file per key (unreadable files count as missing), and
    the ones this process has loaded or compiled."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.loaded: dict[str, jax.stages.Compiled] = {}

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.exe")

    def load(self, key: str, devices: Sequence[jax.Device]) -> jax.stages.Compiled | None:
        """The executable stored under `key`, loaded onto `devices` (the program's device assignment)."""
        if key in self.loaded:
            return self.loaded[key]
        path = self._path(key)
        if not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                 backend=devices[0].client,
                                                                 execution_devices=list(devices))
        except Exception as e:  # a truncated or foreign file: compile again and overwrite it
            logger.warning("could not load the stored executable %s (%s: %s); compiling it again", path,
                           type(e).__name__, e)
            return None
        self.loaded[key] = compiled
        return compiled

    def save(self, key: str, compiled: jax.stages.Compiled) -> None:
        """Store `compiled` under `key` (written to a temporary file and renamed: concurrent writers and
        readers never see half a file)."""
        self.loaded[key] = compiled
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:  # e.g. a backend without executable serialization
            logger.warning("cannot serialize a step program (%s: %s); it will be compiled in every process",
                           type(e).__name__, e)
            return
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, self._path(key))


def abstract_put(x: object, sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct:
    """`x`'s shape and dtype with `sharding`: what an abstract runner holds instead of an array."""
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=sharding)


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """One program an abstract runner compiled: its name, static arguments and the executable."""

    name: str
    static: tuple[tuple[str, object], ...]
    input_shapes: str  # the varying inputs' shapes and dtypes (`describe_arrays`)
    compiled: jax.stages.Compiled


class StoredProgram:
    """One jitted program of one runner, called through compiled executables looked up per (static
    arguments, input shapes).

    The first `num_fixed` positional arguments (parameters, caches) keep their shapes, dtypes and
    shardings from call to call: they enter the key through `identity`, which the runner sets again
    whenever they may have changed (`set_identity`); only the other arguments are inspected per call.
    """

    def __init__(self, jitted: Callable[..., object], name: str, num_fixed: int, devices: Sequence[jax.Device],
                 store: ExecutableStore | None, abstract: bool = False) -> None:
        """`abstract`: the arguments are `jax.ShapeDtypeStruct`s; a call compiles (once per key), records
        the program in `compiled_programs` and returns the outputs' shapes, running nothing."""
        self.jitted = jitted
        self.name = name
        self.num_fixed = num_fixed
        self.devices = tuple(devices)
        self.store = store
        self.identity = ""
        self.num_loaded = 0  # executables read from the store (the rest were compiled)
        self._compiled: dict[tuple[object, ...], jax.stages.Compiled] = {}
        self.abstract = abstract
        self.compiled_programs: list[CompiledProgram] = []

    def set_identity(self, graph: str, fixed_args: Sequence[object]) -> None:
        """What the program is besides its varying inputs: the model graph and the fixed arguments."""
        self.identity = hashlib.sha256(f"{self.name}|{graph}|{describe_arrays(list(fixed_args))}".encode()).hexdigest()

    def __call__(self, *args: object, **static: object) -> object:
        leaves, treedef = jax.tree.flatten(args[self.num_fixed:])
        key = (self.identity, tuple(sorted(static.items())), treedef,
               tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self._load_or_compile(key, args, static)
            if self.abstract:
                self.compiled_programs.append(CompiledProgram(self.name, key[1], describe_arrays(list(args[self.num_fixed:])),
                                                              compiled))
        return compiled.out_info if self.abstract else compiled(*args)

    def working_bytes(self) -> int:
        """The largest temporary memory one of the programs compiled or loaded so far needs, plus their code,
        per device (`Compiled.memory_analysis`; a backend that does not report one counts 0)."""
        temp = code = 0
        for compiled in self._compiled.values():
            analysis = compiled.memory_analysis()
            if analysis is not None:
                temp = max(temp, int(analysis.temp_size_in_bytes))
                code += int(analysis.generated_code_size_in_bytes)
        return temp + code

    def _load_or_compile(self, key: tuple[object, ...], args: tuple[object, ...],
                         static: dict[str, object]) -> jax.stages.Compiled:
        if self.store is None:
            return self.jitted.lower(*args, **static).compile()
        varying = describe_arrays(list(args[self.num_fixed:]))
        disk_key = hashlib.sha256(f"{code_version()}|{key[0]}|{key[1]}|{varying}".encode()).hexdigest()
        compiled = self.store.load(disk_key, self.devices)
        if compiled is not None:
            self.num_loaded += 1
            return compiled
        lowered = self.jitted.lower(*args, **static)
        hits = _persistent_cache_hits()
        with _persistent_cache_off():
            compiled = lowered.compile(compiler_options=STORE_COMPILER_OPTIONS)
        if _persistent_cache_hits() == hits:  # compiled here, not loaded: safe to serialize
            self.store.save(disk_key, compiled)
        else:  # another thread switched JAX's cache back on too early (cannot happen through this module)
            logger.warning("%s was loaded from JAX's persistent cache; not stored", self.name)
        return compiled


class _CacheSwitch:
    """JAX's persistent cache off while any store compile of the process runs (a count under a lock:
    compiles in several threads overlap). The setting is process-wide: a compile in another thread
    meanwhile neither reads nor writes the cache (only slower), which is why it is off only this long."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.was_on = False

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        with self.lock:
            if self.depth == 0:
                self.was_on = bool(jax.config.jax_enable_compilation_cache)
                if self.was_on:
                    _set_persistent_cache(False)
            self.depth += 1
        try:
            yield
        finally:
            with self.lock:
                self.depth -= 1
                if self.depth == 0 and self.was_on:
                    _set_persistent_cache(True)


def _set_persistent_cache(on: bool) -> None:
    jax.config.update("jax_enable_compilation_cache", on)
    compilation_cache.reset_cache()  # JAX decides once whether the cache is used: decide again


@functools.lru_cache(maxsize=1)
def _cache_switch() -> _CacheSwitch:
    return _CacheSwitch()


def _persistent_cache_off() -> contextlib.AbstractContextManager[None]:
    return _cache_switch().off()


class _CacheHits(threading.local):
    """Hits of JAX's persistent cache per thread (a compile reports its hit in its own thread)."""

    count = 0


@functools.lru_cache(maxsize=1)
def _thread_hits() -> _CacheHits:
    hits = _CacheHits()

    def on_event(name: str, **kwargs: object) -> None:
        if name == "/jax/compilation_cache/cache_hits":
            hits.count += 1

    jax.monitoring.register_event_listener(on_event)
    return hits


def _persistent_cache_hits() -> int:
    """Hits of JAX's persistent cache in this thread so far."""
    return _thread_hits().count
