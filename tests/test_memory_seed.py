"""The seed's worked example and its other quantitative claims about waste and sharing."""

from __future__ import annotations

import pytest
from conftest import make_spec

from sim.memory import ContiguousAllocator, PagedAllocator
from sim.presets import MIB, kv_pool_slots, lookup_gpu, lookup_model


def fill(allocator, specs):
    for spec in specs:
        assert allocator.admit(spec) is not None
        assert allocator.append(spec.seq_id, spec.final_len)
    allocator.check_invariants()
    return allocator.snapshot()


def test_seed_worked_example_contiguous_4096():
    specs = [make_spec(i, 100, 1500, max_len=4096) for i in range(8)]
    snap = fill(ContiguousAllocator(8 * 4096, max_model_len=4096), specs)
    reserved = snap.token + snap.reserved + snap.internal
    assert reserved == 32_768
    assert snap.token == 12_000
    assert snap.internal == 20_768
    assert round(snap.internal / reserved * 100, 1) == 63.4
    kv = lookup_model("llama-2-7b").kv_bytes_per_token
    assert kv == 524_288  # 0.5 MiB per token
    assert snap.internal * kv / MIB == 10_384


def test_seed_worked_example_paged_16():
    specs = [make_spec(i, 100, 1500, max_len=4096) for i in range(8)]
    paged = PagedAllocator(8 * 94, 16)
    snap = fill(paged, specs)
    assert all(len(paged.block_table(i)) == 94 for i in range(8))
    assert snap.token == 12_000
    assert snap.internal == 32
    assert round(snap.internal / (snap.token + snap.internal) * 100, 2) == 0.27


@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 256])
def test_paged_waste_below_one_block_per_request(block_size):
    specs = [make_spec(i, 7 + i, 100 + 37 * i) for i in range(10)]
    paged = PagedAllocator(10_000, block_size)
    for spec in specs:
        assert paged.admit(spec) is not None
        assert paged.append(spec.seq_id, spec.final_len - 3)  # three tokens still to come
        snap = paged.snapshot()
        assert snap.internal + snap.reserved < block_size * len(paged.live_seq_ids) + 3 * len(
            paged.live_seq_ids
        )
    paged.check_invariants()


def test_contiguous_waste_grows_with_reservation():
    wastes = []
    for limit in (2048, 4096, 8192):
        specs = [make_spec(i, 100, 1500, max_len=limit) for i in range(4)]
        snap = fill(ContiguousAllocator(4 * limit, max_model_len=limit), specs)
        wastes.append(snap.internal)
    assert wastes[0] < wastes[1] < wastes[2]
    assert wastes == [4 * (2048 - 1500), 4 * (4096 - 1500), 4 * (8192 - 1500)]


@pytest.mark.parametrize(
    ("block_size", "prefix_len", "n"), [(16, 64, 5), (16, 512, 8), (32, 96, 3)]
)
def test_shared_prefix_saves_l_times_n_minus_1(block_size, prefix_len, n):
    prefix = ((1, prefix_len),)
    specs = [make_spec(i, prefix_len + 20, prefix_len + 50, prefix=prefix) for i in range(n)]

    def held(enable):
        paged = PagedAllocator(1000, block_size, enable_prefix_caching=enable)
        for spec in specs:
            assert paged.admit(spec) is not None
            assert paged.append(spec.seq_id, spec.prompt_len - paged.num_tokens(spec.seq_id))
        paged.check_invariants()
        return paged.snapshot()

    without, with_cache = held(False), held(True)
    used = lambda s: s.token + s.reserved + s.internal  # noqa: E731
    assert used(without) - used(with_cache) == prefix_len * (n - 1)

    contiguous = ContiguousAllocator(10_000, max_model_len=4096, reserve_policy="oracle")
    for spec in specs:
        contiguous.admit(spec)
        contiguous.append(spec.seq_id, spec.prompt_len)
    snap = contiguous.snapshot()
    assert snap.token == n * (prefix_len + 20)  # every copy held
    assert snap.duplicate == prefix_len * (n - 1)


def test_partial_last_prefix_block_is_not_shared():
    prefix = ((1, 40),)  # 2 full blocks of 16 + 8 tokens
    specs = [make_spec(i, 60, 80, prefix=prefix) for i in range(4)]
    paged = PagedAllocator(1000, 16)
    hits = []
    for spec in specs:
        hits.append(paged.admit(spec))
        paged.append(spec.seq_id, spec.prompt_len - paged.num_tokens(spec.seq_id))
    assert hits == [0, 32, 32, 32]
    tables = [paged.block_table(i) for i in range(4)]
    assert len({t[0] for t in tables}) == 1 and len({t[1] for t in tables}) == 1
    assert len({t[2] for t in tables}) == 4  # the block holding prefix tokens 32..39 is not shared
    paged.check_invariants()


def test_fully_cached_prompt_recomputes_last_token():
    spec_a = make_spec(0, 64, 64, prefix=((7, 64),))
    spec_b = make_spec(1, 64, 70, prefix=((7, 64),))
    paged = PagedAllocator(100, 16)
    paged.admit(spec_a)
    paged.append(0, 64)
    assert paged.admit(spec_b) == 48  # 4 cached blocks, but the last token is recomputed


def test_pool_sizing_from_gpu_and_errors():
    model, gpu = lookup_model("llama-2-7b"), lookup_gpu("a100-80g")
    slots = kv_pool_slots(model, gpu, gpu_memory_utilization=0.9)
    expected = int((81920 * MIB * 0.9 - 6.74e9 * 2) // 524_288)
    assert slots == expected
    assert kv_pool_slots(model, gpu, kv_memory_gib=1) == 2048
    with pytest.raises(ValueError, match="no KV pool left"):
        kv_pool_slots(lookup_model("llama-2-70b"), lookup_gpu("a100-40g"))
    with pytest.raises(ValueError, match="at least one block"):
        PagedAllocator(0, 16)
    with pytest.raises(ValueError, match="block_size must be at least 1, got 0"):
        PagedAllocator(10, 0)
