"""Tests for rollout/scheduler.py and rollout/block_manager.py: plain Python, no JAX.

The scheduler is driven by hand: `simulate` plays the part of `rollout/output_processor.py`
(bump `num_computed_tokens`, append a sampled token once a sequence's pending tokens are all
computed, mark the prompt prefilled, finish at `max_tokens`).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from rollout.block_manager import BlockManager
from rollout.sampling_params import SamplingParams
from rollout.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from rollout.sequence import Sequence, SequenceStatus

_ids = iter(range(10**9))


def make_seq(prompt: list[int], *, request_id: int | None = None, sample_index: int = 0, max_tokens: int = 4,
             prompt_logprobs: int | None = None, arrival: int | None = None) -> Sequence:
    n = next(_ids)
    rid = n if request_id is None else request_id
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    return Sequence(seq_id=n, request_id=rid, sample_index=sample_index, prompt_ids=list(prompt), params=params,
                    seed=0, arrival=n if arrival is None else arrival)


def simulate(sched: Scheduler, batch: ScheduledBatch, token: int = 7) -> list[Sequence]:
    """What OutputProcessor.process does, minus the device: returns the sequences that finished."""
    finished = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens < seq.num_tokens:
            continue
        if seq.num_output_tokens == 0:
            sched.mark_prefilled(seq)
        seq.token_ids.append(token)
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq)
            finished.append(seq)
    return finished


def make_scheduler(num_blocks: int = 64, block_size: int = 4, *, max_num_seqs: int = 8, budget: int = 64,
                   max_model_len: int = 128, prefix_caching: bool = True) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), bm)


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[ScheduledBatch]:
    batches = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return batches
        batch = sched.schedule()
        assert batch.seqs, "scheduler made no progress"
        batches.append(batch)
        simulate(sched, batch)
    raise AssertionError("did not finish")


def check_block_invariants(bm: BlockManager, seqs: list[Sequence]) -> None:
    """Every block's ref count equals the number of live block tables holding it; free list = ref 0."""
    held: dict[int, int] = {}
    for s in seqs:
        for b in s.block_table:
            held[b] = held.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == held.get(block.block_id, 0), block.block_id
    assert sorted(bm.free_ids) == sorted(b.block_id for b in bm.blocks if b.ref_count == 0)
    assert len(set(bm.free_ids)) == len(bm.free_ids)


def test_no_jax_import() -> None:
    code = ("import sys, rollout.scheduler, rollout.block_manager, rollout.sequence; "
            "assert 'jax' not in sys.modules, 'scheduler/block manager import JAX'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- block manager ----------------------------------------------------------------------------

def test_allocate_and_free_ref_counts() -> None:
    bm = BlockManager(10, 4)
    a = make_seq(list(range(10)))  # 3 blocks
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.block_table) == 3 and len(set(a.block_table)) == 3
    assert bm.num_free_blocks == 7
    assert all(bm.blocks[b].ref_count == 1 for b in a.block_table)
    check_block_invariants(bm, [a])
    bm.deallocate(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert bm.num_free_blocks == 10
    check_block_invariants(bm, [])


def test_can_allocate_and_append() -> None:
    bm = BlockManager(3, 4, enable_prefix_caching=False)
    big = make_seq(list(range(13)))  # needs 4 blocks
    assert not bm.can_allocate(big)
    a = make_seq(list(range(8)))  # exactly 2 blocks
    bm.allocate(a)
    assert len(a.block_table) == 2
    assert bm.can_append(a, 0)  # the 8th token's slot is already there
    a.token_ids.append(1)  # 9 tokens: needs a third block
    assert bm.can_append(a, 0)
    bm.append(a, 0)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 0
    a.token_ids += [1, 2, 3, 4]  # 13 tokens: a fourth block, none free
    assert not bm.can_append(a, 0)
    check_block_invariants(bm, [a])


def test_prefix_cache_shares_identical_full_blocks() -> None:
    bm = BlockManager(32, 4)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    a = make_seq(prompt)
    bm.allocate(a)
    assert a.num_computed_tokens == 0
    bm.register_computed(a, len(prompt))
    b = make_seq(prompt)
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 1]
    assert bm.num_cache_hit_tokens == 8 and bm.num_cache_queried_tokens == 20
    check_block_invariants(bm, [a, b])

    # A prefix that diverges in the second block shares only the first; one that diverges in the first
    # shares nothing even if later blocks are equal (the hash is chained).
    c = make_seq(prompt[:4] + [0] * 6)
    bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0]
    d = make_seq([0] * 4 + prompt[4:])
    bm.allocate(d)
    assert d.num_cached_tokens == 0
    check_block_invariants(bm, [a, b, c, d])


def test_prefix_cache_last_block_always_recomputed() -> None:
    bm = BlockManager(32, 4)
    prompt = list(range(8))  # exactly two full blocks
    a = make_seq(prompt)
    bm.allocate(a)
    bm.register_computed(a, 8)
    b = make_seq(prompt)
    bm.allocate(b)
    # The block holding the last prompt token is recomputed (its logits are needed).
    assert b.num_cached_tokens == 4 and b.num_computed_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    # A one-block prompt never hits.
    e = make_seq(prompt[:4])
    bm.allocate(e)
    assert e.num_cached_tokens == 0


def test_prefix_cache_survives_free_and_invalidate() -> None:
    bm = BlockManager(8, 4)
    prompt = list(range(50, 59))  # 9 tokens, 3 blocks, 2 shareable
    a = make_seq(prompt)
    bm.allocate(a)
    bm.register_computed(a, 9)
    bm.deallocate(a)
    assert bm.num_free_blocks == 8
    b = make_seq(prompt)
    assert bm.can_allocate(b)
    bm.allocate(b)  # revives the freed (still hashed) blocks
    assert b.num_cached_tokens == 8
    assert bm.num_free_blocks == 5
    check_block_invariants(bm, [b])
    bm.deallocate(b)
    bm.invalidate_prefix_cache()
    c = make_seq(prompt)
    bm.allocate(c)
    assert c.num_cached_tokens == 0
    check_block_invariants(bm, [c])


def test_revived_blocks_count_against_free_space() -> None:
    bm = BlockManager(4, 4)
    prompt = list(range(9))  # 3 blocks, 2 shareable
    a = make_seq(prompt)
    bm.allocate(a)
    bm.register_computed(a, 9)
    bm.deallocate(a)
    filler = make_seq(list(range(200, 204)))  # takes one of the 4 free blocks (not a hashed one)
    bm.allocate(filler)
    b = make_seq(prompt)
    # 3 free blocks; b needs 3, two of them revived from the free list: it fits exactly.
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and bm.num_free_blocks == 0
    check_block_invariants(bm, [filler, b])


def test_prefix_cache_off_and_prompt_logprobs_never_hit() -> None:
    prompt = list(range(12))
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    a = make_seq(prompt)
    bm.allocate(a)
    bm.register_computed(a, 12)
    b = make_seq(prompt)
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    bm = BlockManager(16, 4)
    a = make_seq(prompt)
    bm.allocate(a)
    bm.register_computed(a, 12)
    c = make_seq(prompt, prompt_logprobs=1)  # needs the logits of every prompt position
    bm.allocate(c)
    assert c.num_cached_tokens == 0


# ---- scheduler --------------------------------------------------------------------------------

def test_continuous_batching_under_seq_and_token_budgets() -> None:
    sched = make_scheduler(max_num_seqs=3, budget=32)
    seqs = [make_seq([i] * (5 + 3 * i), max_tokens=2 + i % 3) for i in range(8)]
    for s in seqs:
        sched.add(s)
    batches = []
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch.seqs
        assert len(batch.seqs) <= 3 and len(sched.running) <= 3
        assert batch.num_tokens <= 32
        assert all(n >= 1 for n in batch.num_new_tokens)
        if batch.kind == "decode_loop":
            assert batch.num_new_tokens == [1] * len(batch.seqs)
        check_block_invariants(sched.block_manager, sched.running)
        batches.append(batch)
        simulate(sched, batch)
    assert all(s.is_finished and s.num_output_tokens == s.params.max_tokens for s in seqs)
    # More requests than max_num_seqs: later ones were admitted while earlier ones were still running.
    first_step_of = {}
    for k, b in enumerate(batches):
        for s in b.seqs:
            first_step_of.setdefault(s.seq_id, k)
    assert first_step_of[seqs[3].seq_id] > 0
    # Admission is FIFO.
    order = sorted(seqs, key=lambda s: first_step_of[s.seq_id])
    assert [s.seq_id for s in order] == [s.seq_id for s in seqs]
    assert sched.block_manager.num_free_blocks == len(sched.block_manager.blocks)


def test_waiting_queue_when_max_num_seqs_reached() -> None:
    sched = make_scheduler(max_num_seqs=2, budget=64)
    seqs = [make_seq([1, 2, 3], max_tokens=3) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.kind == "ragged" and batch.seqs == seqs[:2]
    assert list(sched.waiting) == seqs[2:]
    simulate(sched, batch)
    for _ in range(2):  # two decodes finish the first two
        batch = sched.schedule()
        assert batch.kind == "decode_loop" and batch.seqs == seqs[:2]
        simulate(sched, batch)
    assert seqs[0].is_finished and seqs[1].is_finished
    batch = sched.schedule()
    assert batch.kind == "ragged" and batch.seqs == seqs[2:]


def test_an_arriving_prompt_shares_the_step_of_running_decodes() -> None:
    """vLLM v1's order: every running decode gets its one token first, then a prompt's chunk fills the rest
    of the token budget, in one ragged step; once no prompt waits, a decode loop of up to
    `num_scheduler_steps` tokens per sequence runs. The decodes never stall behind the prompt."""
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(4, 16, 128, num_scheduler_steps=8), bm)
    a, b = make_seq([1, 2, 3], max_tokens=30), make_seq([4, 5, 6, 7], max_tokens=30)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.kind == "ragged" and batch.seqs == [a, b] and batch.num_new_tokens == [3, 4]
    simulate(sched, batch)
    batch = sched.schedule()
    assert batch.kind == "decode_loop" and batch.seqs == [a, b] and batch.num_new_tokens == [8, 8]
    for seq in batch.seqs:  # (what a decode loop's eight tokens do)
        seq.num_computed_tokens += 8
        seq.token_ids += [7] * 8
    long = make_seq(list(range(40)), max_tokens=2)
    sched.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        batch = sched.schedule()
        assert batch.kind == "ragged" and batch.seqs[:2] == [a, b] and batch.num_new_tokens[:2] == [1, 1]
        assert batch.seqs[2:] == [long] and batch.num_tokens <= 16
        chunks.append(batch.num_new_tokens[2])
        before = a.num_output_tokens
        simulate(sched, batch)
        assert a.num_output_tokens == before + 1  # every step decodes the running sequences
    assert chunks == [14, 14, 12]
    batch = sched.schedule()
    assert batch.kind == "decode_loop" and batch.seqs == [a, b, long] and batch.num_new_tokens == [8, 8, 1]


def test_speculation_interleaves_a_decode_step_after_each_ragged_one() -> None:
    """Drafts are made only in decode steps: with `interleave_decodes` (speculation), arriving prompts
    alternate with decode steps of the running sequences instead of keeping every step ragged."""
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(8, 64, 128, interleave_decodes=True), bm)
    a = make_seq([1, 2, 3], max_tokens=30)
    sched.add(a)
    simulate(sched, sched.schedule())
    kinds = []
    for i in range(6):
        sched.add(make_seq([9, i], max_tokens=30))  # a prompt arrives before every step
        batch = sched.schedule()
        kinds.append(batch.kind)
        assert a in batch.seqs  # the running sequence decodes in every step
        simulate(sched, batch)
    assert kinds == ["decode_loop", "ragged"] * 3  # (the first step after `a`'s own prefill decodes)


def test_decodes_take_the_token_budget_first() -> None:
    sched = make_scheduler(max_num_seqs=8, budget=32)
    running = [make_seq([i, i + 1], max_tokens=20) for i in range(3)]
    for seq in running:
        sched.add(seq)
    simulate(sched, sched.schedule())
    prompt = make_seq(list(range(100)), max_tokens=2)
    sched.add(prompt)
    batch = sched.schedule()
    assert batch.kind == "ragged" and batch.seqs == [*running, prompt] and batch.num_new_tokens == [1, 1, 1, 29]


def test_chunked_prefill_of_long_prompt() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4, budget=16)
    long = make_seq(list(range(50)), max_tokens=2)
    short = make_seq([9, 9, 9], max_tokens=2)
    sched.add(long)
    sched.add(short)
    chunks = []
    while long.num_output_tokens == 0:
        batch = sched.schedule()
        assert batch.kind == "ragged" and batch.num_tokens <= 16
        assert long in batch.seqs
        chunks.append(batch.num_new_tokens[batch.seqs.index(long)])
        before = long.num_tokens
        simulate(sched, batch)
        if long.num_computed_tokens < 50:
            assert long.num_tokens == before  # nothing sampled mid-prompt
    assert chunks == [16, 16, 16, 2]
    assert sum(chunks) == 50
    # The short prompt waited for budget (admitted only once a step had room left).
    assert short.num_output_tokens == 1
    run_to_completion(sched)
    assert long.is_finished and short.is_finished


def test_chunked_prefill_is_registered_for_prefix_sharing_chunk_by_chunk() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4, budget=8)
    a = make_seq(list(range(20)), max_tokens=1)
    sched.add(a)
    batch = sched.schedule()
    assert batch.num_new_tokens == [8]
    bm = sched.block_manager
    assert sum(1 for b in a.block_table if bm.blocks[b].hash is not None) == 2


def test_preemption_frees_newest_and_requeues_at_head() -> None:
    # 4 blocks of 4 tokens; two 7-token prompts take 2 blocks each.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, budget=64, prefix_caching=False)
    old = make_seq(list(range(7)), max_tokens=6)
    new = make_seq(list(range(10, 17)), max_tokens=6)
    queued = make_seq([5, 5], max_tokens=1)
    for s in (old, new, queued):
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == [old, new]
    simulate(sched, batch)  # both have 8 tokens now: still 2 blocks each
    batch = sched.schedule()
    assert batch.kind == "decode_loop" and batch.seqs == [old, new]
    simulate(sched, batch)  # 9 tokens each: a third block each, one is free
    assert sched.num_preemptions == 0
    batch = sched.schedule()
    assert sched.num_preemptions == 1
    assert batch.seqs == [old]
    assert new.status == SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert new.num_preemptions == 1
    assert sched.waiting[0] is new and list(sched.waiting) == [new, queued]
    assert len(old.block_table) == 3
    check_block_invariants(sched.block_manager, [old])
    # Its generated tokens are kept and recomputed later.
    assert new.num_output_tokens == 2
    simulate(sched, batch)
    # Until `old` finishes, `new` cannot come back (needs 3 blocks) and `queued` must not jump ahead.
    while not old.is_finished:
        batch = sched.schedule()
        assert queued not in batch.seqs and new not in batch.seqs
        simulate(sched, batch)
    batch = sched.schedule()
    assert batch.kind == "ragged" and batch.seqs[0] is new
    assert batch.num_new_tokens[0] == new.num_tokens  # full recompute: prompt + 2 generated
    run_to_completion(sched)
    assert new.is_finished and new.num_output_tokens == 6 and queued.is_finished
    assert sched.block_manager.num_free_blocks == 4


def test_single_sequence_that_cannot_fit_raises() -> None:
    sched = make_scheduler(num_blocks=2, block_size=4, max_num_seqs=1, budget=64, max_model_len=32,
                           prefix_caching=False)
    s = make_seq(list(range(7)), max_tokens=10)
    sched.add(s)
    simulate(sched, sched.schedule())
    with pytest.raises(RuntimeError, match="KV cache"):
        for _ in range(3):
            simulate(sched, sched.schedule())


def test_n_samples_share_the_prompt_blocks_of_sample_zero_in_the_same_step() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4, budget=64)
    prompt = list(range(30, 40))  # 10 tokens: 2 shareable blocks
    siblings = [make_seq(prompt, request_id=77, sample_index=i, max_tokens=3) for i in range(3)]
    other = make_seq([1, 2, 3], max_tokens=3)
    for s in siblings + [other]:
        sched.add(s)
    batch = sched.schedule()
    # Sample 0's whole prompt is computed in this step, so its siblings join the same step and
    # compute only their last (partial) block: K/V is written before attention reads it.
    assert batch.seqs == siblings + [other]
    assert batch.num_new_tokens == [10, 2, 2, 3]
    first = siblings[0].block_table
    for s in siblings[1:]:
        assert s.block_table[:2] == first[:2] and s.block_table[2] != first[2]
        assert s.num_cached_tokens == 8
    bm = sched.block_manager
    assert [bm.blocks[b].ref_count for b in first[:2]] == [3, 3]
    check_block_invariants(bm, sched.running)
    simulate(sched, batch)
    run_to_completion(sched)
    assert all(s.is_finished for s in siblings)


def test_n_samples_wait_while_sample_zero_prompt_is_chunked() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4, budget=8)
    prompt = list(range(30, 42))  # 12 tokens > budget 8: sample 0 is chunked
    siblings = [make_seq(prompt, request_id=78, sample_index=i, max_tokens=3) for i in range(2)]
    for s in siblings:
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == [siblings[0]] and batch.num_new_tokens == [8]
    assert list(sched.waiting) == [siblings[1]]
    simulate(sched, batch)
    batch = sched.schedule()
    assert siblings[0] in batch.seqs
    simulate(sched, batch)
    run_to_completion(sched)
    assert all(s.is_finished for s in siblings)
    bm = sched.block_manager
    sched.forget_request(78)
    assert bm.num_free_blocks == 32


def make_dp_scheduler(num_replicas: int, blocks_per_replica: int, *, max_num_seqs: int = 4, budget: int = 64
                      ) -> Scheduler:
    bm = BlockManager(num_replicas * blocks_per_replica, 4, num_replicas=num_replicas)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 128, num_replicas=num_replicas), bm)


def test_data_parallel_replicas_hold_only_their_own_blocks() -> None:
    sched = make_dp_scheduler(2, 16)
    bm = sched.block_manager
    seqs = [make_seq(list(range(100 + 10 * i, 106 + 10 * i)), max_tokens=6) for i in range(6)]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()
    assert sorted(s.replica for s in first.seqs) == [0, 0, 0, 1, 1, 1]  # least loaded replica first
    live = list(first.seqs)
    simulate(sched, first)
    while sched.has_unfinished():
        for s in live:
            assert all(bm.replica_of(b) == s.replica for b in s.block_table), (s.replica, s.block_table)
        check_block_invariants(bm, [s for s in live if s.status == SequenceStatus.RUNNING])
        simulate(sched, sched.schedule())
    assert bm.num_free_blocks == 32


def test_data_parallel_budgets_are_per_replica() -> None:
    sched = make_dp_scheduler(2, 32, max_num_seqs=2, budget=8)
    for i in range(5):
        sched.add(make_seq(list(range(10 * i, 10 * i + 8))))
    batch = sched.schedule()
    per_replica = {r: sum(n for s, n in zip(batch.seqs, batch.num_new_tokens) if s.replica == r) for r in (0, 1)}
    assert per_replica == {0: 8, 1: 8}  # each replica's token budget, not one shared budget
    while sched.has_unfinished():
        batch = sched.schedule()
        for r in (0, 1):
            assert sum(1 for s in sched.running if s.replica == r) <= 2
        simulate(sched, batch)


def test_data_parallel_siblings_go_where_the_prompt_is_cached() -> None:
    sched = make_dp_scheduler(2, 32, max_num_seqs=8)
    prompt = list(range(40, 53))  # 3 full blocks + 1 token
    sched.add(make_seq([1, 2, 3, 4, 5]))  # keeps replica 0 busier
    samples = [make_seq(prompt, request_id=999, sample_index=i, max_tokens=3) for i in range(4)]
    for s in samples:
        sched.add(s)
    simulate(sched, sched.schedule())  # sample 0's prompt goes to the emptier replica 1
    assert samples[0].replica == 1
    batch = sched.schedule()
    siblings = [s for s in batch.seqs if s in samples[1:]]
    assert len(siblings) == 3 and all(s.replica == 1 and s.num_cached_tokens == 12 for s in siblings)


def test_data_parallel_preemption_stays_within_the_replica() -> None:
    sched = make_dp_scheduler(2, 6, max_num_seqs=4, budget=64)  # 6 blocks of 4 per replica
    seqs = [make_seq(list(range(10 * i, 10 * i + 7)), max_tokens=12) for i in range(4)]
    for s in seqs:
        sched.add(s)
    finished = run_to_completion(sched)
    assert finished  # everything completes
    assert sched.num_preemptions > 0
    assert all(s.is_finished and s.num_output_tokens == 12 for s in seqs)
