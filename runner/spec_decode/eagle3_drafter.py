"""`Eagle3Drafter`: the EAGLE-3 head's device state in the engine and its two compiled programs.

- `fill` runs after every target step (prefill, decode, verification) on the target's auxiliary
  hidden states, still on the device: it stores g = fc(aux) of every computed token and the head's
  K/V at p - 1 for every token fed at p. Rejected draft positions get rewritten when the target
  computes those positions again, exactly like the target's own KV.
- `propose` drafts k tokens for a decode batch in one program (`lax.scan` over the head steps).

Both address the head cache with the target's block tables, so preemption, prefix caching and
data-parallel replicas need nothing extra. A cached prefix block shared by sequences that continue
differently keeps the head K/V of one of them at its last position (acceptance can dip there;
outputs never change: verification is exact).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.tree_util import PyTreeDef
from jaxtyping import Array, Float, Int

from runner.buckets import BucketConfig, pick
from runner.kv_cache import KVCacheSpec
from runner.sharding import kv_cache_sharding
from runner.spec_decode.eagle3 import DraftCache, Eagle3Head, draft_paged, fill_cache
from runner.step_inputs import DeviceBatch


@dataclasses.dataclass(frozen=True)
class DraftRequest:
    """One decode batch to draft for (S sequences, host arrays)."""

    last_token_ids: np.ndarray  # [S] token each sequence feeds next, at position c
    positions: np.ndarray  # [S] c - 1
    block_tables: list[list[int]]  # [S][blocks] global block ids
    replicas: np.ndarray | None = None  # [S] data-parallel replica of each sequence


# Tree structures of (head params, head rest, target params, target rest): the jitted programs take
# flat leaf lists, which jit handles ~2x faster per call than `nnx.State`s (see `runner.model_runner`).
TreeDefs = tuple[PyTreeDef, PyTreeDef, PyTreeDef, PyTreeDef]
TargetLeaves = tuple[list[Array], list[Array]]  # the target's params and rest as leaf lists (`ModelRunner`)


def _merge(graphdef: nnx.GraphDef, params_def: PyTreeDef, rest_def: PyTreeDef, params: list[Array],
           rest: list[Array]) -> nnx.Module:
    return nnx.merge(graphdef, jax.tree.unflatten(params_def, params), jax.tree.unflatten(rest_def, rest))


def _per_replica(fn: Callable[..., tuple], num_replicas: int, on_mesh: bool, *args: Array) -> tuple:
    """`fn` over the leading replica axis (no vmap for one replica on one device: the plain program;
    see `runner.step_program` for why a mesh keeps the vmap)."""
    if num_replicas == 1 and not on_mesh:
        return jax.tree.map(lambda x: x[None], fn(*jax.tree.map(lambda x: x[0], args)))
    return jax.vmap(fn)(*args)


CacheShardings = tuple[NamedSharding, NamedSharding]  # (kv, hidden) of the head's cache


def _pinned(cache: DraftCache, shardings: CacheShardings | None) -> DraftCache:
    """The cache in its own layout (XLA's propagation alone handed it back with the head axis replicated)."""
    if shardings is None:
        return cache
    return DraftCache(jax.lax.with_sharding_constraint(cache.kv, shardings[0]),
                      jax.lax.with_sharding_constraint(cache.hidden, shardings[1]))


def _fill(head_gd: nnx.GraphDef, target_gd: nnx.GraphDef, defs: TreeDefs, shardings: CacheShardings | None,
          head_params: list[Array],
          head_rest: list[Array], params: list[Array], rest: list[Array], cache: DraftCache,
          aux: Float[Array, "R T A"], batch: DeviceBatch) -> DraftCache:
    head = _merge(head_gd, defs[0], defs[1], head_params, head_rest)
    target = _merge(target_gd, defs[2], defs[3], params, rest)
    fn = functools.partial(fill_cache, head, target)
    kv, hidden = _per_replica(fn, cache.kv.shape[0], shardings is not None, cache.kv, cache.hidden, aux,
                              batch.token_ids, batch.positions,
                              batch.md.slot_mapping, batch.prev_slot_mapping)
    return _pinned(DraftCache(kv, hidden), shardings)


def _draft(head_gd: nnx.GraphDef, target_gd: nnx.GraphDef, defs: TreeDefs, shardings: CacheShardings | None,
           head_params: list[Array],
           head_rest: list[Array], params: list[Array], rest: list[Array], cache: DraftCache,
           last_token_ids: Int[Array, "R S"], positions: Int[Array, "R S"], page_indices: Int[Array, "R S W"],
           num_seqs: Int[Array, "R 1"], *, num_steps: int) -> tuple[DraftCache, Int[Array, "R S K"]]:
    head = _merge(head_gd, defs[0], defs[1], head_params, head_rest)
    target = _merge(target_gd, defs[2], defs[3], params, rest)
    hidden = cache.hidden

    def fn(kv: Array, hid: Array, tok: Array, pos: Array, pages: Array, n: Array) -> tuple[Array, Array]:
        return draft_paged(head, target, kv, hid, tok, pos, pages, n, num_steps=num_steps)

    kv, drafts = _per_replica(fn, cache.kv.shape[0], shardings is not None, cache.kv, hidden, last_token_ids, positions,
                              page_indices, num_seqs)
    return _pinned(DraftCache(kv, hidden), shardings), drafts


@functools.lru_cache(maxsize=None)
def _compiled(head_gd: nnx.GraphDef, target_gd: nnx.GraphDef, defs: TreeDefs, shardings: CacheShardings | None
              ) -> tuple[Callable[..., DraftCache], Callable[..., tuple]]:
    """The jitted fill and draft programs of one (head, target) structure and cache layout, shared by engines."""
    fill = jax.jit(functools.partial(_fill, head_gd, target_gd, defs, shardings), donate_argnums=(4,))
    draft = jax.jit(functools.partial(_draft, head_gd, target_gd, defs, shardings), static_argnames=("num_steps",),
                    donate_argnums=(4,))
    return fill, draft


class Eagle3Drafter:
    """Owns the head's parameters (replicated), its paged cache, and its compiled programs."""

    def __init__(self, head: Eagle3Head, target_graphdef: nnx.GraphDef, target_defs: tuple[PyTreeDef, PyTreeDef],
                 kv_spec: KVCacheSpec, buckets: BucketConfig, mesh: Mesh) -> None:
        """`target_defs`: tree structures of the target's params and rest `nnx.State`s."""
        cfg = head.config
        graphdef, params, rest = nnx.split(head, nnx.Param, ...)
        replicated = NamedSharding(mesh, PartitionSpec())
        self.graphdef = graphdef
        self.params = jax.device_put(jax.tree.map(lambda x: jnp.array(x, copy=True), params), replicated)
        self.rest = jax.device_put(jax.tree.map(lambda x: jnp.array(x, copy=True), rest), replicated)
        self.aux_layers = tuple(cfg.aux_layer_ids)
        self.kv_spec, self.buckets = kv_spec, buckets
        r, p, page = kv_spec.num_replicas, kv_spec.blocks_per_replica, kv_spec.block_size
        kv_shape = (r, 2, cfg.num_key_value_heads, p, page, cfg.head_dim)
        hidden_shape = (r, p, page, cfg.hidden_size)
        hidden_sharding = NamedSharding(mesh, PartitionSpec("data" if r > 1 else None))
        kv_sharding = kv_cache_sharding(kv_shape, mesh)
        self.cache = DraftCache(
            kv=jax.jit(lambda: jnp.zeros(kv_shape, cfg.dtype), out_shardings=kv_sharding)(),
            hidden=jax.jit(lambda: jnp.zeros(hidden_shape, cfg.dtype), out_shardings=hidden_sharding)())
        self._input_sharding = replicated if r == 1 else NamedSharding(mesh, PartitionSpec("data"))
        defs = (jax.tree.structure(self.params), jax.tree.structure(self.rest), *target_defs)
        shardings = (kv_sharding, hidden_sharding) if mesh.size > 1 else None
        self._fill_fn, self._draft_fn = _compiled(graphdef, target_graphdef, defs, shardings)

    @property
    def head(self) -> Eagle3Head:
        return nnx.merge(self.graphdef, self.params, self.rest)

    def fill(self, target: TargetLeaves, aux: Float[Array, "R T A"], batch: DeviceBatch) -> None:
        """Store what the target step just computed (device arrays in, nothing comes back)."""
        self.cache = self._fill_fn(*self._head_leaves(), *target, self.cache, aux, batch)

    def propose(self, target: TargetLeaves, request: DraftRequest, num_steps: int) -> np.ndarray:
        """`[S, num_steps]` greedy drafts (target ids) in the request's order."""
        inputs, index = self._pad(request)
        inputs = jax.device_put(inputs, self._input_sharding)
        self.cache, drafts = self._draft_fn(*self._head_leaves(), *target, self.cache, *inputs, num_steps=num_steps)
        return np.asarray(jax.device_get(drafts)).reshape(-1, num_steps)[index]

    def _head_leaves(self) -> tuple[list[Array], list[Array]]:
        """The head's parameters as flat leaf lists, taken per call (in-place syncs are seen)."""
        return jax.tree.leaves(self.params), jax.tree.leaves(self.rest)

    def _pad(self, request: DraftRequest) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
        spec = self.kv_spec
        num_replicas, per_replica = spec.num_replicas, spec.blocks_per_replica
        replicas = request.replicas if request.replicas is not None else np.zeros(len(request.positions), np.int64)
        members = [np.flatnonzero(replicas == r) for r in range(num_replicas)]
        rows = pick(self.buckets.seq_buckets, max(1, max(len(m) for m in members)))
        width = self.buckets.page_buckets[-1]
        tokens = np.zeros((num_replicas, rows), np.int32)
        positions = np.zeros((num_replicas, rows), np.int32)
        pages = np.full((num_replicas, rows, width), per_replica, np.int32)  # unused rows: out of range
        num_seqs = np.zeros((num_replicas, 1), np.int32)
        index = np.zeros(len(replicas), np.int64)
        for r, m in enumerate(members):
            num_seqs[r, 0] = len(m)
            for j, s in enumerate(m):
                table = request.block_tables[s][:width]
                pages[r, j, :len(table)] = np.asarray(table, np.int32) - r * per_replica
                tokens[r, j], positions[r, j] = request.last_token_ids[s], request.positions[s]
                index[s] = r * rows + j
        return (tokens, positions, pages, num_seqs), index

    def warmup(self, target: TargetLeaves, num_steps: int) -> int:
        """Compile the draft program of every decode bucket (all writes dropped); returns the count."""
        count = 0
        for n in self.buckets.seq_buckets:
            drop = self.kv_spec.num_blocks  # past every replica's blocks
            request = DraftRequest(np.zeros(n, np.int32), np.zeros(n, np.int32), [[drop]] * n)
            self.propose(target, request, num_steps)
            count += 1
        return count
