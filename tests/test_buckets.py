"""Shape buckets (`runner.buckets`): pure Python, no JAX."""

from __future__ import annotations

from runner.buckets import BucketConfig, pick, pow2_buckets


def test_pow2_buckets_cap_at_the_maximum() -> None:
    assert pow2_buckets(1, 8) == (1, 2, 4, 8)
    assert pow2_buckets(32, 100) == (32, 64, 100)
    assert pick((1, 2, 4, 8), 3) == 4


def test_verify_buckets_fit_full_drafts_of_each_sequence_bucket() -> None:
    bk = BucketConfig(max_num_seqs=8, max_num_batched_tokens=128, max_pages_per_seq=16, verify_rows=5)
    # 8 sequences with k = 4 full drafts are 40 rows: an exact bucket instead of 64
    assert pick(bk.verify_buckets, 40) == 40
    assert pick(bk.verify_buckets, 5) == 5 and pick(bk.verify_buckets, 10) == 10
    assert pick(bk.verify_buckets, 21) == 32
    assert set(bk.verify_buckets) >= {1, 2, 4, 8, 32, 64, 128}
    assert max(bk.verify_buckets) == 128  # never above the token budget
    plain = BucketConfig(max_num_seqs=8, max_num_batched_tokens=128, max_pages_per_seq=16)
    assert set(plain.verify_buckets) == {1, 2, 4, 8, 32, 64, 128}
