"""`Eagle3Drafter`: the EAGLE-3 head's device state in the engine and the calls into its compiled programs
(`runner.spec_decode.eagle3_programs`).

- `fill` runs after every target step that verifies nothing (prefill, plain decode) on the target's
  auxiliary hidden states, still on the device: it stores g = fc(aux) of every computed token and
  the head's K/V at p - 1 for every token fed at p. Rejected draft positions get rewritten when the
  target computes those positions again, exactly like the target's own KV.
- `verify` is a whole speculative step in one program: the head drafts k tokens per sequence
  (`lax.scan` over the head steps), the target verifies them and samples after every position,
  and the fill follows. Only the sampled tokens and the drafts come back to the host.
- `verify_steps` runs several such steps in one device loop (`Eagle3Config.num_verify_steps`).
- `decode_chunk` is multi-step plain decode (the steps auto-disable takes off drafting) with the fill
  after every step.

Both address the head cache with the target's block tables, so preemption, prefix caching and
data-parallel replicas need nothing extra. A cached prefix block shared by sequences that continue
differently keeps the head K/V of one of them at its last position (acceptance can dip there;
outputs never change: verification is exact).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.tree_util import PyTreeDef
from jaxtyping import Array, Bool, Float, Int

from runner.executable_store import ExecutableStore, StoredProgram
from runner.kv_cache import KVCacheSpec
from runner.kv_layout import KVLayout
from runner.models.family import KVCaches
from runner.sampler import SamplerOutput
from runner.sharding import kv_cache_sharding
from runner.spec_decode.eagle3 import DraftCache, Eagle3Head
from runner.spec_decode.eagle3_programs import TargetLeaves, compiled_programs
from runner.step_padding import DeviceBatch


class Eagle3Drafter:
    """Owns the head's parameters (replicated), its paged cache, and its compiled programs."""

    def __init__(self, head: Eagle3Head, target_graphdef: nnx.GraphDef, target_defs: tuple[PyTreeDef, PyTreeDef],
                 kv_spec: KVCacheSpec, mesh: Mesh, target_kv_sharding: NamedSharding | None,
                 store: ExecutableStore | None = None) -> None:
        """`target_defs`: tree structures of the target's params and rest `nnx.State`s;
        `target_kv_sharding`: the layout the target's KV caches are pinned to on a mesh (None: one device);
        `store`: where the compiled programs are stored and loaded (`runner.executable_store`)."""
        cfg = head.config
        graphdef, params, rest = nnx.split(head, nnx.Param, ...)
        replicated = NamedSharding(mesh, PartitionSpec())
        self.graphdef = graphdef
        self.params = jax.device_put(jax.tree.map(lambda x: jnp.array(x, copy=True), params), replicated)
        self.rest = jax.device_put(jax.tree.map(lambda x: jnp.array(x, copy=True), rest), replicated)
        self.aux_layers = tuple(cfg.aux_layer_ids)
        r, p, page = kv_spec.num_replicas, kv_spec.blocks_per_replica, kv_spec.block_size
        kv_shape = (r, 2, cfg.num_key_value_heads, p, page, cfg.head_dim)
        hidden_shape = (r, p, page, cfg.hidden_size)
        hidden_sharding = NamedSharding(mesh, PartitionSpec("data" if r > 1 else None))
        kv_sharding = kv_cache_sharding(kv_shape, KVLayout.cache_axes, mesh)  # (the engine's own layout)
        self.cache = DraftCache(
            kv=jax.jit(lambda: jnp.zeros(kv_shape, cfg.dtype), out_shardings=kv_sharding)(),
            hidden=jax.jit(lambda: jnp.zeros(hidden_shape, cfg.dtype), out_shardings=hidden_sharding)())
        defs = (jax.tree.structure(self.params), jax.tree.structure(self.rest), *target_defs)
        shardings = (kv_sharding, hidden_sharding) if mesh.size > 1 else None
        fill, verify, verify_steps, decode_chunk = compiled_programs(graphdef, target_graphdef, defs, shardings,
                                                                     target_kv_sharding)
        devices = tuple(mesh.devices.flat)
        # fixed arguments: the head's and the target's leaves, the draft cache (fill), the target's caches (rest)
        self._fill_fn = StoredProgram(fill, "eagle3_fill", 5, devices, store)
        self._verify_fn = StoredProgram(verify, "eagle3_verify", 6, devices, store)
        self._verify_steps_fn = StoredProgram(verify_steps, "eagle3_verify_steps", 6, devices, store)
        self._decode_chunk_fn = StoredProgram(decode_chunk, "eagle3_decode_chunk", 6, devices, store)
        self._graph = f"{graphdef!r}|{target_graphdef!r}|{defs}|{shardings}|{target_kv_sharding}"

    def set_identity(self, target: TargetLeaves, kv_caches: KVCaches) -> None:
        """Key the stored programs on the current layouts of the fixed arguments (`StoredProgram`)."""
        head = self._head_leaves()
        self._fill_fn.set_identity(self._graph, (*head, *target, self.cache))
        for program in (self._verify_fn, self._verify_steps_fn, self._decode_chunk_fn):
            program.set_identity(self._graph, (*head, *target, kv_caches, self.cache))

    @property
    def num_loaded(self) -> int:
        """Programs loaded from the executable store (or another engine), not compiled."""
        return sum(p.num_loaded for p in (self._fill_fn, self._verify_fn, self._verify_steps_fn, self._decode_chunk_fn))

    @property
    def head(self) -> Eagle3Head:
        return nnx.merge(self.graphdef, self.params, self.rest)

    def fill(self, target: TargetLeaves, aux: Float[Array, "R T A"], batch: DeviceBatch) -> None:
        """Store what the target step just computed (device arrays in, nothing comes back)."""
        self.cache = self._fill_fn(*self._head_leaves(), *target, self.cache, aux, batch)

    def verify(self, target: TargetLeaves, kv_caches: KVCaches, batch: DeviceBatch, *, num_top: int,
               num_steps: int, plain_rows: int = 0, min_confidence: float = 0.0, num_kept: int = 0
               ) -> tuple[KVCaches, SamplerOutput, Int[Array, "R S K"], Bool[Array, ""]]:
        """Draft `num_steps` tokens per sequence into `batch` (`DeviceBatch.draft_slots`), verify them with
        the target and fill the head's cache, in one program; returns the target's caches, what was
        sampled, the drafts per attention row and whether it verified (device arrays). `plain_rows > 0`
        decodes plainly when every first draft's probability is below `min_confidence` (`_draft_verify`)."""
        kv_caches, self.cache, out, drafts, verified = self._verify_fn(
            *self._head_leaves(), *target, kv_caches, self.cache, batch, np.float32(min_confidence), num_top=num_top,
            aux_layers=self.aux_layers, num_steps=num_steps, plain_rows=plain_rows, num_kept=num_kept)
        return kv_caches, out, drafts, verified

    def verify_steps(self, target: TargetLeaves, kv_caches: KVCaches, batch: DeviceBatch, *, num_top: int,
                     num_steps: int, max_iters: int, num_kept: int = 0
                     ) -> tuple[KVCaches, SamplerOutput, Int[Array, "I R S K"]]:
        """Up to `max_iters` draft-verify-fill steps in one device loop (`_draft_verify_steps`; `batch.chunk`
        says how many each sequence runs); returns the target's caches, every step's sampled rows and drafts."""
        kv_caches, self.cache, out, drafts = self._verify_steps_fn(
            *self._head_leaves(), *target, kv_caches, self.cache, batch, num_top=num_top, aux_layers=self.aux_layers,
            num_steps=num_steps, max_iters=max_iters, num_kept=num_kept)
        return kv_caches, out, drafts

    def decode_chunk(self, target: TargetLeaves, kv_caches: KVCaches, batch: DeviceBatch, *, num_top: int,
                     max_steps: int, num_kept: int = 0) -> tuple[KVCaches, SamplerOutput]:
        """Multi-step plain decode of the target with the head's cache kept current (`_decode_chunk_fill`);
        returns the target's caches and every step's sampled rows `[max_steps, R * N]`."""
        kv_caches, self.cache, out = self._decode_chunk_fn(
            *self._head_leaves(), *target, kv_caches, self.cache, batch, num_top=num_top, aux_layers=self.aux_layers,
            max_steps=max_steps, num_kept=num_kept)
        return kv_caches, out

    def _head_leaves(self) -> tuple[list[Array], list[Array]]:
        """The head's parameters as flat leaf lists, taken per call (in-place syncs are seen)."""
        return jax.tree.leaves(self.params), jax.tree.leaves(self.rest)
