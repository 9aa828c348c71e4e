"""KV block allocation with reference counts and a prefix cache (plain Python, no JAX).

A block holds `block_size` consecutive tokens' K/V. A full block is identified by a hash chained
over its tokens and all tokens before it; once its K/V has been scheduled for computation it is
registered, and any later sequence whose prefix hashes the same shares it (ref-counted) instead
of recomputing. Freed blocks keep their hash until reused, so prefixes survive across calls.
"""

from __future__ import annotations

import collections

from rollout.sequence import Sequence


class Block:
    """One KV block's bookkeeping."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


def chain_hash(prev: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block given the hash of the prefix before it."""
    return hash((prev, token_ids))


class BlockManager:
    """Allocates KV blocks to sequences and shares identical full prefix blocks between them."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: collections.deque[int] = collections.deque(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.num_cache_hit_tokens = 0
        self.num_cache_queried_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free(self) -> Block:
        block = self.blocks[self.free_ids.popleft()]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Ids of registered blocks matching the sequence's leading full blocks (never its last token)."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []
        hits: list[int] = []
        prev: int | None = None
        # The block holding the last token is always recomputed: its logits are needed.
        for i in range((seq.num_tokens - 1) // self.block_size):
            ids = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            prev = chain_hash(prev, ids)
            block_id = self.hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != ids:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._cached_prefix(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_needed(seq.num_tokens) - len(hits) + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table, "sequence already holds blocks"
        hits = self._cached_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_ids.remove(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(self.blocks_needed(seq.num_tokens) - len(hits)):
            seq.block_table.append(self._take_free().block_id)
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        self.num_cache_hit_tokens += seq.num_cached_tokens
        self.num_cache_queried_tokens += seq.num_tokens

    def deallocate(self, seq: Sequence) -> None:
        """Release a sequence's blocks (most recent first, so older prefixes stay cached longest)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_tokens + num_new_tokens) - len(seq.block_table)
        return need <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for `num_new_tokens` more tokens beyond the sequence's current ones."""
        while len(seq.block_table) < self.blocks_needed(seq.num_tokens + num_new_tokens):
            seq.block_table.append(self._take_free().block_id)

    def register_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the full blocks among the first `num_tokens` tokens for prefix sharing."""
        if not self.enable_prefix_caching:
            return
        prev: int | None = None
        for i in range(num_tokens // self.block_size):
            ids = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            prev = chain_hash(prev, ids)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = prev, ids
                self.hash_to_block.setdefault(prev, block.block_id)

    def invalidate_prefix_cache(self) -> None:
        """Forget every cached prefix (after a weight update its K/V is stale)."""
        self.hash_to_block.clear()
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
