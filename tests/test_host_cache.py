"""The host-memory tier: blocks the GPU evicts go down, prefix hits load them back up, and
the step pays the PCIe transfer instead of the prefill."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sim.engine import build_timing, host_memory, run_scenario
from sim.memory import PagedAllocator, SeqSpec
from sim.memory.host_cache import HostCache
from sim.metrics import format_summary
from sim.presets import GIB, lookup_gpu, lookup_model
from sim.scenario import ScenarioError, scenario_from_dict


def test_host_cache_keeps_the_most_recent_blocks():
    host = HostCache(capacity_blocks=2)
    host.offer(1)
    host.offer(2)
    host.load(1)  # read back: stays, now the most recent
    host.offer(3)  # full: 2 goes
    assert host.ordered() == [1, 3] and 2 not in host
    host.offer(1)  # already here: refreshed, not written twice
    assert host.ordered() == [3, 1]
    assert (host.num_offloaded, host.num_loaded, host.num_dropped) == (3, 1, 1)
    with pytest.raises(ValueError, match="at least one block"):
        HostCache(0)


def spec(seq_id: int, text: int, prompt_len: int) -> SeqSpec:
    return SeqSpec(seq_id, ((text, prompt_len + 1),), prompt_len, prompt_len + 1,
                   prompt_len + 1)


@pytest.mark.parametrize("host_blocks", [0, 3, 8])
def test_an_evicted_prompt_comes_back_from_host_memory(host_blocks):
    allocator = PagedAllocator(6, 4, host_cache_blocks=host_blocks)
    assert allocator.admit(spec(0, 1, 13)) == 0  # 13 tokens: 3 full blocks and one more
    assert allocator.append(0, 13)
    allocator.free(0)  # its 3 full blocks stay cached on the GPU
    assert allocator.lookup(spec(9, 1, 13)) == 12
    assert allocator.admit(spec(1, 2, 21)) == 0  # 21 slots: all 6 blocks, the cached 3 too
    allocator.free(1)
    assert allocator.pool.num_evictions == 3
    again = allocator.admit(spec(2, 1, 13))
    if not host_blocks:
        assert again == 0 and allocator.last_loaded_tokens == 0
        return
    # Everything but the prompt's last token (always recomputed, as on the GPU).
    assert again == 12 and allocator.last_loaded_tokens == 12
    assert allocator.num_tokens(2) == 12 and allocator.host.num_loaded == 3
    allocator.check_invariants()  # loaded blocks are full, hashed and in the GPU cache map
    assert allocator.snapshot().token == 12
    assert allocator.lookup(spec(3, 1, 13)) == 12  # now a GPU hit: nothing more to load
    assert allocator.admit(spec(3, 1, 13)) == 12 and allocator.last_loaded_tokens == 0


def test_host_cache_needs_the_prefix_cache():
    with pytest.raises(ValueError, match="needs prefix caching"):
        PagedAllocator(6, 4, enable_prefix_caching=False, host_cache_blocks=4)


def scenario(host_cache_gib: float = 0, **gpu) -> dict:
    # Many shared system prompts, a pool that holds a few of them: the GPU keeps evicting.
    return {
        "name": "host",
        "model": "llama-3-8b",
        "gpu": gpu or "a100-80g",
        "memory": {"kv_memory_gib": 0.5},
        "workload": {"arrival": {"process": "poisson", "rate": 30},
                     "prompt_len": {"dist": "uniform", "low": 20, "high": 200},
                     "output_len": {"dist": "uniform", "low": 5, "high": 60},
                     "prefix_groups": {"groups": 20, "length": 1000, "fraction": 1.0,
                                       "zipf_s": 0.0}},
        "systems": [{"name": "paged", "allocator": {"kind": "paged",
                                                    "host_cache_gib": host_cache_gib}}],
        "stop": {"num_requests": 300},
    }


def test_host_tier_turns_recompute_into_loads():
    base = run_scenario(scenario_from_dict(scenario())).systems["paged"]
    tiered_scenario = scenario_from_dict(scenario(8))
    tiered = run_scenario(tiered_scenario).systems["paged"]
    assert base.summary["host_hit_rate"] is None and base.summary["host_loaded_tokens"] == 0
    assert tiered.summary["host_hit_rate"] > 0.3
    assert tiered.summary["prefix_hit_rate"] > base.summary["prefix_hit_rate"] + 0.3
    assert tiered.steps["prefill_tokens"].sum() < base.steps["prefill_tokens"].sum() / 2
    assert tiered.summary["host_loaded_tokens"] == tiered.steps["loaded_tokens"].sum()
    # 8 GiB of host memory at Llama-3-8B's 128 KiB per token; 128 KiB over 32 GB/s a token.
    slots, swap_slots, load_s = host_memory(tiered_scenario, tiered_scenario.systems[0])
    per_token = lookup_model("llama-3-8b").kv_bytes_per_token
    assert slots == 8 * GIB // per_token
    assert swap_slots == 0  # it preempts by recompute
    assert load_s == per_token / lookup_gpu("a100-80g").host_link_bytes_per_s
    # Steps that loaded blocks took the transfer longer than their shape alone: the rest
    # of the step time is the prefill's quadratic term, e·Σ chunk·(history + chunk) ≥ 0,
    # with history (cached and loaded tokens) under 1,200 here.
    timing = build_timing(tiered_scenario, Path())
    loads = tiered.steps[(tiered.steps["steps"] == 1) & (tiered.steps["loaded_tokens"] > 0)]
    assert len(loads) > 5
    shape = (timing.a + timing.b * loads["decode_seqs"]
             + timing.rho(16) * timing.c * loads["context_tokens"]
             + timing.d * loads["prefill_tokens"])
    rest = loads["duration_s"] - shape - loads["loaded_tokens"] * load_s
    prefill = loads["prefill_tokens"]
    assert (rest >= -1e-12).all()
    assert (rest <= timing.e * prefill * (prefill + 1200)).all()
    assert (loads["loaded_tokens"] * load_s > timing.e * prefill * (prefill + 1200)).all()


def test_a_drafters_kv_takes_its_share_of_host_memory_too():
    # An EAGLE layer caches what one of Llama-3-8B's 32 layers does, in every slot: a host
    # slot keeps it too, so 8 GiB hold 32/33 as many tokens, each 33/32 as long to load.
    data = scenario(8)
    data["systems"][0]["scheduler"] = {"preemption_mode": "swap", "swap_space_gib": 4}
    plain = scenario_from_dict(data)
    data["systems"][0]["speculative"] = {"method": "eagle", "num_speculative_tokens": 2,
                                         "acceptance_rate": 0.7}
    drafted = scenario_from_dict(data)
    per_token = lookup_model("llama-3-8b").kv_bytes_per_token
    (cache, swap, load_s), (drafted_cache, drafted_swap, drafted_load_s) = (
        host_memory(s, s.systems[0]) for s in (plain, drafted))
    assert (cache, swap) == (8 * GIB // per_token, 4 * GIB // per_token)
    assert (drafted_cache, drafted_swap) == (8 * GIB // (per_token * 33 // 32),
                                             4 * GIB // (per_token * 33 // 32))
    assert drafted_load_s == pytest.approx(load_s * 33 / 32, rel=1e-12)


def test_host_tier_settings_are_checked():
    with pytest.raises(ScenarioError, match=r"systems\[0\].allocator: host_cache_gib needs "
                       r"prefix_caching: true"):
        data = scenario(4)
        data["systems"][0]["allocator"]["prefix_caching"] = False
        scenario_from_dict(data)
    explicit = {"name": "mine", "memory_gib": 80, "hbm_bandwidth_gbps": 2000, "peak_tflops": 300}
    with pytest.raises(ScenarioError, match=r"systems: system 'paged': a host cache needs "
                       r"gpu.host_link_gbps"):
        scenario_from_dict(scenario(4, **explicit))
    linked = scenario_from_dict(scenario(4, **explicit, host_link_gbps=25))
    assert host_memory(linked, linked.systems[0])[2] == pytest.approx(
        lookup_model("llama-3-8b").kv_bytes_per_token / 25e9)


def test_the_summary_shows_host_hits_only_with_a_host_tier():
    plain = run_scenario(scenario_from_dict(scenario())).systems["paged"].summary
    tiered = run_scenario(scenario_from_dict(scenario(8))).systems["paged"].summary
    assert "host memory" not in format_summary({"plain": plain})
    (row,) = [line for line in format_summary({"plain": plain, "tiered": tiered}).splitlines()
              if line.startswith("prefix hits from host memory")]
    assert row.split()[-2:] == ["—", f"{tiered['host_hit_rate'] * 100:.1f}%"]


def test_layerwise_loads_hide_under_the_computation():
    from sim.timing import with_transfer

    # 32 layers, computation 10 ms: a 4 ms load shows only its first layer's eighth of a ms;
    # a 40 ms load hides all but the last layer's computation.
    assert with_transfer(0.010, 0.004, 0) == pytest.approx(0.014)
    assert with_transfer(0.010, 0.004, 32) == pytest.approx(0.010 + 0.004 / 32)
    assert with_transfer(0.010, 0.040, 32) == pytest.approx(0.040 + 0.010 / 32)
    data = scenario(8)
    data["systems"].append({"name": "layerwise", "allocator": {
        "kind": "paged", "host_cache_gib": 8, "host_load": "layerwise"}})
    tiered_scenario = scenario_from_dict(data)
    runs = run_scenario(tiered_scenario).systems
    *_, load_s = host_memory(tiered_scenario, tiered_scenario.systems[1])
    timing = build_timing(tiered_scenario, Path())
    steps = runs["layerwise"].steps
    loads = steps[(steps["steps"] == 1) & (steps["loaded_tokens"] > 0)]
    assert len(loads) > 5
    shape = (timing.a + timing.b * loads["decode_seqs"]
             + timing.rho(16) * timing.c * loads["context_tokens"]
             + timing.d * loads["prefill_tokens"])
    transfer = loads["loaded_tokens"] * load_s
    # At least the longer of the two, and shorter than one after the other.
    assert (loads["duration_s"] >= np.maximum(shape, transfer) - 1e-12).all()
    assert (loads["duration_s"] < shape + transfer).all()
    serial = runs["paged"].summary
    assert runs["layerwise"].summary["makespan_s"] <= serial["makespan_s"]
    assert runs["layerwise"].summary["host_loaded_tokens"] > 0
