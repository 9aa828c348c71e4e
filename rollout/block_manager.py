"""KV block allocation with reference counts and a prefix cache (plain Python, no JAX).

A block holds `block_size` consecutive tokens' K/V. A full block is identified by a hash chained
over its tokens and all tokens before it; once its K/V has been scheduled for computation it is
registered, and any later sequence whose prefix hashes the same shares it (ref-counted) instead
of recomputing. Freed blocks keep their hash until reused, so prefixes survive across calls.

With data parallelism the blocks are split into `num_replicas` equal pools (replica r owns ids
`[r * blocks_per_replica, (r + 1) * blocks_per_replica)`, the part of the KV cache on its devices);
a sequence only ever holds blocks of its own replica (`seq.replica`), and prefixes are shared
within a replica.
"""

from __future__ import annotations

import collections

from rollout.routing_record import RoutingRecord
from rollout.sequence import Sequence


class Block:
    """One KV block's bookkeeping."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.stale = False  # K/V from weights replaced since (held by a running sequence): never published


def chain_hash(prev: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block given the hash of the prefix before it."""
    return hash((prev, token_ids))


class BlockManager:
    """Allocates KV blocks to sequences and shares identical full prefix blocks between them."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 num_replicas: int = 1) -> None:
        if num_blocks < 1 or block_size < 1 or num_replicas < 1:
            raise ValueError(f"need num_blocks >= 1, block_size >= 1 and num_replicas >= 1, got {num_blocks}, "
                             f"{block_size}, {num_replicas}")
        if num_blocks % num_replicas:
            raise ValueError(f"{num_blocks} blocks do not split evenly over {num_replicas} data replicas")
        self.block_size = block_size
        self.routing: RoutingRecord | None = None  # the routed-experts record (set by the engine when it records)
        self.num_replicas = num_replicas
        self.blocks_per_replica = num_blocks // num_replicas
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_pools: list[collections.deque[int]] = [
            collections.deque(range(r * self.blocks_per_replica, (r + 1) * self.blocks_per_replica))
            for r in range(num_replicas)]
        self.hash_to_block: dict[tuple[int, int], int] = {}  # (replica, chained hash) -> block id
        self.enable_prefix_caching = enable_prefix_caching
        self.num_cache_hit_tokens = 0
        self.num_cache_queried_tokens = 0

    @property
    def free_ids(self) -> list[int]:
        """Every free block id, all replicas."""
        return [b for pool in self.free_pools for b in pool]

    @property
    def num_free_blocks(self) -> int:
        return sum(len(pool) for pool in self.free_pools)

    def num_free(self, replica: int) -> int:
        return len(self.free_pools[replica])

    def replica_of(self, block_id: int) -> int:
        return block_id // self.blocks_per_replica

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free(self, replica: int) -> Block:
        block = self.blocks[self.free_pools[replica].popleft()]
        key = (replica, block.hash)
        if block.hash is not None and self.hash_to_block.get(key) == block.block_id:
            del self.hash_to_block[key]
        block.hash, block.token_ids, block.ref_count, block.stale = None, (), 1, False
        return block

    def _cached_prefix(self, seq: Sequence, replica: int | None = None) -> list[int]:
        """Ids of registered blocks of `replica` (default: the sequence's) matching its leading full blocks
        (never its last token)."""
        replica = seq.replica if replica is None else replica
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []
        hits: list[int] = []
        prev: int | None = None
        # The block holding the last token is always recomputed: its logits are needed.
        for i in range((seq.num_tokens - 1) // self.block_size):
            ids = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            prev = chain_hash(prev, ids)
            block_id = self.hash_to_block.get((replica, prev))
            if block_id is None or self.blocks[block_id].token_ids != ids:
                break
            hits.append(block_id)
        return hits

    def num_cached_blocks(self, seq: Sequence, replica: int) -> int:
        """How many of the sequence's leading blocks `replica` already holds (to place it)."""
        return len(self._cached_prefix(seq, replica))

    def can_allocate(self, seq: Sequence, replica: int | None = None) -> bool:
        replica = seq.replica if replica is None else replica
        hits = self._cached_prefix(seq, replica)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_needed(seq.num_tokens) - len(hits) + revived <= self.num_free(replica)

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table, "sequence already holds blocks"
        hits = self._cached_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_pools[seq.replica].remove(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(self.blocks_needed(seq.num_tokens) - len(hits)):
            seq.block_table.append(self._take_free(seq.replica).block_id)
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        self.num_cache_hit_tokens += seq.num_cached_tokens
        self.num_cache_queried_tokens += seq.num_tokens

    def deallocate(self, seq: Sequence) -> None:
        """Release a sequence's blocks (most recent first, so older prefixes stay cached longest); a
        finished sequence first takes its computed tokens' routed experts (`routing`, when recorded)."""
        if self.routing is not None and seq.is_finished:
            seq.out.routed_experts = self.routing.read(seq.block_table, seq.num_computed_tokens)
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_pools[self.replica_of(block_id)].append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_tokens + num_new_tokens) - len(seq.block_table)
        return need <= self.num_free(seq.replica)

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for `num_new_tokens` more tokens beyond the sequence's current ones."""
        while len(seq.block_table) < self.blocks_needed(seq.num_tokens + num_new_tokens):
            seq.block_table.append(self._take_free(seq.replica).block_id)

    def register_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the full blocks among the first `num_tokens` tokens for prefix sharing."""
        if not self.enable_prefix_caching:
            return
        prev: int | None = None
        for i in range(num_tokens // self.block_size):
            ids = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            prev = chain_hash(prev, ids)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and not block.stale:
                block.hash, block.token_ids = prev, ids
                self.hash_to_block.setdefault((seq.replica, prev), block.block_id)

    def invalidate_prefix_cache(self) -> None:
        """Forget every cached prefix (after a weight update its K/V is stale); blocks that running
        sequences hold are never published again (their K/V came from the old weights)."""
        self.hash_to_block.clear()
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
            block.stale = block.ref_count > 0
