"""The routed-experts record on the host: each KV slot's experts per routed-experts layer, paged like the KV.

A mixture-of-experts engine built with `EngineConfig(record_routed_experts=True)` returns, from every
step, the experts each computed token was routed to; they are written here at the token's KV slot
(block * block_size + offset), so the record of a prompt prefix served from the prefix cache is the
one its K/V was computed with, and a preempted sequence's recomputed tokens overwrite theirs. When a
sequence releases its blocks the record of its computed tokens is read out (`Sequence.routed_experts`),
so a trainer can replay the routing of every token it scores. Plain numpy: testable without JAX.
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Int


class RoutingRecord:
    """`[num_blocks * block_size, num_layers, top_k]` expert ids (int16: up to 32767 experts)."""

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, top_k: int) -> None:
        self.block_size = block_size
        self.experts: Int[np.ndarray, "slots L k"] = np.zeros((num_blocks * block_size, num_layers, top_k), np.int16)

    def slots(self, block_table: list[int], positions: Int[np.ndarray, "n"]) -> Int[np.ndarray, "n"]:
        """KV slots of a sequence's `positions`."""
        table = np.asarray(block_table, np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def write(self, block_table: list[int], start: int, experts: Int[np.ndarray, "n L k"]) -> None:
        """Record the experts of a sequence's tokens at positions `start`, `start + 1`, ...; positions past
        its block table (work of a stopped row) are dropped."""
        n = min(len(experts), len(block_table) * self.block_size - start)
        if n > 0:
            self.experts[self.slots(block_table, np.arange(start, start + n))] = experts[:n]

    def read(self, block_table: list[int], num_tokens: int) -> Int[np.ndarray, "n L k"]:
        """The experts of a sequence's first `num_tokens` positions."""
        return self.experts[self.slots(block_table, np.arange(num_tokens))].astype(np.int32)
