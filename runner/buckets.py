"""Shape buckets: the finite set of padded step shapes, so every program can be compiled ahead."""

from __future__ import annotations

import dataclasses


def pow2_buckets(minimum: int, maximum: int) -> tuple[int, ...]:
    """Powers of two from `minimum` up to the first one >= `maximum` (capped at `maximum`)."""
    sizes, b = [], max(1, minimum)
    while b < maximum:
        sizes.append(b)
        b *= 2
    sizes.append(maximum)
    return tuple(sorted(set(sizes)))


def pick(buckets: tuple[int, ...], n: int) -> int:
    """The smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class BucketConfig:
    """Bucket sizes for decode (sequences) and prefill (tokens).

    Context needs no bucket: `page_indices` is always `max_pages_per_seq` wide, and attention walks
    it only up to the step's longest real context (a dynamic trip count), so its cost follows the
    live context while one program serves every length.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_pages_per_seq: int
    min_seqs: int = 1  # XLA:CPU runs a 1-row decode ~3x faster than an 8-row one: no padding up
    min_tokens: int = 32
    query_block: int = 32  # prefill queries are attended in pieces of at most this many tokens
    verify_rows: int = 0  # rows of one sequence's verification step (k + 1): exact buckets s * (k + 1)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.query_block:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= {self.query_block}")

    @property
    def seq_buckets(self) -> tuple[int, ...]:
        return pow2_buckets(min(self.min_seqs, self.max_num_seqs), self.max_num_seqs)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        return pow2_buckets(min(self.min_tokens, self.max_num_batched_tokens), self.max_num_batched_tokens)

    @property
    def page_buckets(self) -> tuple[int, ...]:
        return (self.max_pages_per_seq,)

    @property
    def verify_buckets(self) -> tuple[int, ...]:
        """Token (= sampled row) counts of speculative verification steps: the sequence and token buckets,
        plus every sequence bucket times k + 1 (full drafts fill them exactly: 8 sequences of k = 4 take
        40 rows, not 64; the LM head and sampler cost per row)."""
        exact = set()
        if self.verify_rows > 0:
            exact = {s * self.verify_rows for s in self.seq_buckets if s * self.verify_rows <= self.max_num_batched_tokens}
        return tuple(sorted(set(self.seq_buckets) | set(self.token_buckets) | exact))

    def verify_plain_rows(self, num_tokens: int) -> int:
        """Sequences per replica that a verification step of `num_tokens` rows can decode plainly
        instead (`Eagle3Config.min_confidence`): those whose full drafts fill the bucket."""
        return min(pick(self.seq_buckets, max(1, num_tokens // max(1, self.verify_rows))), self.prefill_rows(num_tokens))

    def prefill_rows(self, num_tokens: int) -> int:
        """Sampling rows of a prefill step of `num_tokens` (padded) tokens."""
        return pick(self.seq_buckets, min(self.max_num_seqs, num_tokens))

    def prefill_pieces(self, num_tokens: int) -> int:
        """Attention rows (query pieces) of a prefill step: enough for any split of its sequences."""
        return -(-num_tokens // self.query_block) + self.prefill_rows(num_tokens)
