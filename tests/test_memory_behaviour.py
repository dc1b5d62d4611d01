"""Allocator mechanics: external fragmentation, eviction order per policy, copy-on-write."""

from __future__ import annotations

import pytest
from conftest import make_spec

from sim.memory import AllocatorError, ContiguousAllocator, PagedAllocator, SeqSpec


def test_external_fragmentation_refuses_then_coalesces():
    alloc = ContiguousAllocator(100, max_model_len=100, reserve_policy="oracle")
    for i, size in enumerate([30, 30, 30]):
        assert alloc.admit(make_spec(i, 10, size)) == 0
    alloc.free(0)  # holes: [0,30) and [90,100): 40 free in all
    big = make_spec(9, 10, 35)
    snap = alloc.snapshot(waiting=big)
    assert snap.free + snap.external == 40
    assert snap.external == 40  # no extent can take 35
    assert alloc.admit(big) is None
    alloc.check_invariants()
    alloc.free(1)  # [0,60) coalesces
    assert alloc.free_extents == [(0, 60), (90, 10)]
    assert alloc.snapshot(waiting=big).external == 10
    assert alloc.admit(big) == 0
    assert alloc.extent(9) == (0, 35)
    alloc.check_invariants()


def test_best_fit_picks_the_smallest_hole():
    for placement, expected_start in (("first_fit", 0), ("best_fit", 50)):
        alloc = ContiguousAllocator(100, max_model_len=100, reserve_policy="oracle",
                                    placement=placement)
        for i, size in enumerate([40, 10, 20, 30]):
            alloc.admit(make_spec(i, 5, size))
        alloc.free(0)
        alloc.free(2)  # holes of 40 at 0 and 20 at 50
        alloc.admit(make_spec(7, 5, 15))
        assert alloc.extent(7)[0] == expected_start
        alloc.check_invariants()


@pytest.mark.parametrize(
    ("policy", "final", "expected"),
    [
        ("max_model_len", 1500, 4096),
        ("request_max", 1500, 2000),
        ("pow2", 1500, 2048),
        ("pow2", 1024, 1024),
        ("oracle", 1500, 1500),
    ],
)
def test_reservation_policies(policy, final, expected):
    alloc = ContiguousAllocator(10_000, max_model_len=4096, reserve_policy=policy)
    alloc.admit(make_spec(0, 100, final, max_len=2000))
    assert alloc.extent(0)[1] == expected


def finish(paged, spec):
    assert paged.admit(spec) is not None
    paged.append(spec.seq_id, spec.final_len - paged.num_tokens(spec.seq_id))
    paged.free(spec.seq_id)


def test_lru_evicts_deepest_block_of_least_recently_freed_first():
    paged = PagedAllocator(8, 4, eviction="lru")
    finish(paged, make_spec(0, 12, 12))  # blocks 0,1,2 cached, freed first
    finish(paged, make_spec(1, 8, 8))  # blocks 3,4
    order = [b.block_id for b in paged.pool.evictable.ordered()]
    assert order == [2, 1, 0, 4, 3]
    # Fill the 3 unhashed blocks, then each new block evicts in that order.
    paged.admit(make_spec(2, 12, 12))
    assert paged.pool.num_evictions == 0
    paged.admit(make_spec(3, 8, 8))
    assert paged.block_table(3) == [2, 1]
    assert paged.pool.num_evictions == 2
    paged.check_invariants()


def test_unhashed_blocks_are_reused_before_cached_ones():
    paged = PagedAllocator(4, 4)
    finish(paged, make_spec(0, 8, 8))  # two full, hashed blocks -> cached
    paged.admit(make_spec(1, 3, 3))  # takes an unhashed block
    paged.append(1, 3)
    paged.free(1)  # partial block: back to the unhashed list
    assert paged.pool.num_cached_free == 2
    paged.admit(make_spec(2, 8, 8))
    assert paged.pool.num_evictions == 0
    assert paged.lookup(make_spec(3, 8, 8, prefix=())) == 0


def shared_prefix_spec(seq_id, prefix_id, length=8):
    return make_spec(seq_id, length + 4, length + 4, prefix=((prefix_id, length),))


def test_lfu_keeps_the_most_reused_blocks():
    paged = PagedAllocator(12, 4, eviction="lfu")
    finish(paged, shared_prefix_spec(0, 1))  # prefix 1 blocks used once
    for i in range(1, 4):
        finish(paged, shared_prefix_spec(10 + i, 2))  # prefix 2 blocks used three times
    ordered = paged.pool.evictable.ordered()
    counts = [b.acquire_count for b in ordered]
    assert counts == sorted(counts)
    assert ordered[-1].acquire_count == 3


def test_fifo_evicts_oldest_content_first_regardless_of_reuse():
    paged = PagedAllocator(12, 4, eviction="fifo")
    finish(paged, shared_prefix_spec(0, 1))
    finish(paged, shared_prefix_spec(1, 2))
    finish(paged, shared_prefix_spec(2, 1))  # reuses prefix 1: FIFO does not care
    victims = paged.pool.evictable.ordered()
    assert [b.cached_seq for b in victims] == sorted(b.cached_seq for b in victims)
    assert victims[0].acquire_count == 2  # the oldest block is the reused prefix-1 block 0


def test_sharing_aware_keeps_concurrently_shared_prefixes():
    # Prefix 1 is shared by three live requests at once; prefix 2 is reused three times, one
    # request at a time (LFU would rank them equal); private tails are isolated and cold.
    results = {}
    for policy in ("sharing_aware", "lru"):
        paged = PagedAllocator(40, 4, eviction=policy)
        specs = [shared_prefix_spec(i, 1) for i in range(3)]
        for spec in specs:
            paged.admit(spec)
            paged.append(spec.seq_id, spec.final_len - paged.num_tokens(spec.seq_id))
        for spec in specs:
            paged.free(spec.seq_id)
        for i in range(3):
            finish(paged, shared_prefix_spec(10 + i, 2))
        last = paged.pool.evictable.ordered()[-2:]
        results[policy] = {b.peak_ref_cnt for b in last}
    assert results["sharing_aware"] == {3}
    assert results["lru"] == {1}


def test_copy_on_write_after_fork_mid_block():
    paged = PagedAllocator(10, 4)
    parent = make_spec(0, 6, 10)
    paged.admit(parent)
    paged.append(0, 6)  # blocks: [full, 2/4]
    child = SeqSpec(1, ((10_000, 6), (555, 4)), 6, 10, 10)  # same prompt, own output
    assert paged.fork(0, child)
    shared_tail = paged.block_table(0)[1]
    assert paged.pool.blocks[shared_tail].ref_cnt == 2
    paged.check_invariants()
    assert paged.append(0, 1)
    assert paged.num_cow_copies == 1
    assert paged.block_table(0)[1] != shared_tail
    assert paged.pool.blocks[shared_tail].ref_cnt == 1
    assert paged.append(1, 1)
    assert paged.num_cow_copies == 1  # the child now owns the original alone
    assert paged.block_table(1)[1] == shared_tail
    assert paged.pool.blocks[paged.block_table(0)[0]].ref_cnt == 2  # full block still shared
    snap = paged.snapshot()
    assert snap.token == 4 + 3 + 3
    paged.check_invariants()


@pytest.mark.parametrize("samples", [2, 3])
def test_samples_sharing_a_tail_need_one_copy_fewer_than_they_are(samples):
    # A 40-token prompt fills two 16-token blocks and half a third, which every sample
    # shares after the fork. Writing the first generated token copies that block for all
    # samples but the last, which keeps it: a pool of 3 + (samples - 1) blocks holds them
    # exactly (found by a stress run: counting a copy for every sample preempted such a
    # request in an empty pool, again and again).
    paged = PagedAllocator(3 + samples - 1, 16, enable_prefix_caching=False)
    assert paged.admit(SeqSpec(0, ((10_000, 40), (500, 1)), 40, 41, 41)) == 0
    paged.append(0, 40)
    for sample in range(1, samples):
        assert paged.fork(0, SeqSpec(sample, ((10_000, 40), (500 + sample, 1)), 40, 41, 41))
    seq_ids = list(range(samples))
    assert paged.max_uniform_append(seq_ids, 1) == 1
    for seq_id in seq_ids:
        assert paged.append(seq_id, 1)
    assert paged.num_cow_copies == samples - 1 and paged.pool.num_free == 0
    paged.check_invariants()
    # Another holder outside the set: then every sample here must copy.
    paged = PagedAllocator(3 + samples - 1, 16, enable_prefix_caching=False)
    paged.admit(SeqSpec(0, ((10_000, 40), (500, 1)), 40, 41, 41))
    paged.append(0, 40)
    for sample in range(1, samples + 1):
        paged.fork(0, SeqSpec(sample, ((10_000, 40), (500 + sample, 1)), 40, 41, 41))
    assert paged.max_uniform_append(list(range(1, samples + 1)), 1) == 0


def test_contract_errors_are_explicit():
    paged = PagedAllocator(10, 4)
    with pytest.raises(AllocatorError, match="unknown sequence 3"):
        paged.append(3, 1)
    paged.admit(make_spec(0, 4, 6))
    with pytest.raises(AllocatorError, match="past its final length"):
        paged.append(0, 7)
    with pytest.raises(AllocatorError, match="already admitted"):
        paged.admit(make_spec(0, 4, 6))
