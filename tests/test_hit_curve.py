"""Prefix-cache hit rate against cache size: one pass of stack distances against a block-by-
block LRU cache, a hand-worked trace, the simulator itself, and the command."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import kvsim_in_process

from reports.hit_curve_figure import hit_curve_figure
from sim.api import load, run
from sim.engine import scenario_pool_slots, scenario_trace
from sim.hit_curve import _request_blocks, hit_curve
from workloads import build_trace
from workloads.spec import SyntheticWorkload
from workloads.trace import Trace

ROOT = Path(__file__).resolve().parents[1]


def lru_hit_tokens(trace: Trace, block_size: int, capacity_blocks: int) -> int:
    """The definition, block by block: an LRU cache of ``capacity_blocks``; each request
    looks its prompt up from block 0 to the first miss (never the last token's block), then
    caches every full block it wrote, deepest first."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for i in range(len(trace)):
        hashes, _ = _request_blocks(trace, i, block_size)
        for block_hash in hashes[:(int(trace.prompt_len[i]) - 1) // block_size]:
            if block_hash not in cache:
                break
            hits += 1
        for block_hash in reversed(hashes):
            cache[block_hash] = None
            cache.move_to_end(block_hash)
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
    return hits * block_size


def sharing_workload(samples: int, sessions: bool) -> SyntheticWorkload:
    spec: dict = {
        "arrival": {"process": "poisson", "rate": 5},
        "prompt_len": {"dist": "lognormal", "mean": 120, "p99": 600, "max": 800},
        "output_len": {"dist": "lognormal", "mean": 40, "p99": 200, "max": 300},
        "prefix_groups": {"groups": 6, "length": 100, "fraction": 0.7, "zipf_s": 1.0},
        "sampling": {"n": samples},
    }
    if sessions:  # later turns hold earlier prompts and answers
        spec["sessions"] = {"turns": {"dist": "uniform", "low": 1, "high": 4}}
    return SyntheticWorkload.model_validate(spec)


@pytest.mark.parametrize(("samples", "sessions"), [(1, False), (3, False), (2, True)])
def test_every_cache_size_matches_a_block_by_block_lru(samples, sessions):
    for seed in range(3):
        trace = build_trace(sharing_workload(samples, sessions), seed=seed, max_model_len=4096,
                            num_requests=120)
        for block_size in (4, 16):
            curve = hit_curve(trace, block_size)
            assert curve.max_hit_rate > 0.2  # the workload shares: the check has hits to find
            for capacity in (0, 3, 20, 60, 150, 400, 1000, 10**6):
                assert curve.hit_tokens(capacity * block_size) == lru_hit_tokens(
                    trace, block_size, capacity), (seed, block_size, capacity)


def hand_trace() -> Trace:
    """Two prompts behind one 64-token text S, one without it, S again with a short
    question, and a request too short to fill a block."""
    shared = 1 << 50
    frame = pd.DataFrame({
        "arrival_s": [0.0, 1.0, 2.0, 3.0, 4.0],
        "prompt_len": [84, 84, 40, 69, 5],
        "output_len": [10, 10, 8, 11, 3],
        "segments": [f"{shared}:64 {1 << 52}:20", f"{shared}:64 {(1 << 52) + 1}:20",
                     f"{(1 << 52) + 2}:40", f"{shared}:64 {(1 << 52) + 3}:5",
                     f"{(1 << 52) + 4}:5"],
    })
    frame["max_tokens"] = frame["output_len"]
    return Trace.from_frame(frame)


def test_a_hand_worked_trace():
    # A request's KV is its prompt and all its output but the last token. Request 0 (84 + 9)
    # caches S's four blocks and its own fifth, deepest first: S's block k is then k blocks
    # deep, so request 1 finds min(4, C) of them. Request 2 (2 full blocks of its own:
    # 40 + 7 tokens) pushes them 2 deeper, so request 3 (which looks up 4 blocks: 68 // 16,
    # and writes no block of its own: 69 + 10 = 79 tokens) finds clip(C - 2, 0, 4).
    # Lookups: 84 + 84 + 40 + 69 + 5 prompt tokens.
    curve = hit_curve(hand_trace(), 16)
    assert curve.prompt_tokens == 282
    assert curve.working_set_blocks == 5 + 1 + 2 + 0
    for capacity in range(12):
        expected = 16 * (min(4, capacity) + min(max(capacity - 2, 0), 4))
        assert curve.hit_tokens(16 * capacity) == expected, capacity
    assert curve.hit_tokens(16 * 2 + 15) == 32  # a partial block caches nothing more
    assert curve.max_hit_rate == pytest.approx(128 / 282)
    assert curve.saturation_tokens == 6 * 16
    assert curve.tokens_for(0.5) == 3 * 16  # 64 of 128 tokens: 2 blocks find 32, 3 find 64
    assert curve.tokens_for(1.0) == curve.saturation_tokens


def test_the_simulator_finds_what_the_curve_says_when_requests_come_one_at_a_time():
    # At 0.05 requests a second nothing overlaps: the simulated pool is the curve's cache,
    # but for vLLM details the curve leaves out (a recomputed last block, partial blocks).
    for gib in (1, 4):
        scenario, _ = load({
            "name": "one-at-a-time", "model": "llama-3-8b", "gpu": "a100-80g",
            "memory": {"kv_memory_gib": gib},
            "workload": {
                "arrival": {"process": "poisson", "rate": 0.05},
                "prompt_len": {"dist": "lognormal", "mean": 200, "p99": 1500, "max": 2000},
                "output_len": {"dist": "lognormal", "mean": 120, "p99": 600, "max": 800},
                "prefix_groups": {"groups": 64, "length": 2000, "fraction": 0.9,
                                  "zipf_s": 0.5}},
            "systems": [{"name": "paged-16", "allocator": {"kind": "paged", "block_size": 16}}],
            "stop": {"num_requests": 1500}})
        predicted = hit_curve(scenario_trace(scenario, ROOT), 16).hit_rate(
            scenario_pool_slots(scenario))
        simulated = run(scenario).systems["paged-16"].summary["prefix_hit_rate"]
        assert predicted > 0.05
        assert simulated == pytest.approx(predicted, abs=0.005), gib


def test_the_figure_draws_every_curve_rising():
    trace = build_trace(sharing_workload(1, True), seed=0, max_model_len=4096,
                        num_requests=120)
    curves = {"bs 4": hit_curve(trace, 4), "bs 16": hit_curve(trace, 16)}
    fig = hit_curve_figure(curves, kv_bytes_per_token=131072, marks={"pool": 4096})
    table = fig.kvsim_data
    for label, curve in curves.items():
        assert (np.diff(table[label]) >= 0).all()
        assert table[label].iloc[-1] == pytest.approx(curve.max_hit_rate)
    assert fig.axes[0].get_xlabel() == "cache size (GiB of KV)"


def test_the_command(tmp_path):
    scenario = ROOT / "scenarios/sweeps/host_cache.yaml"
    plot = tmp_path / "curve.png"
    proc = kvsim_in_process("trace", "hit-curve", str(scenario), "--set",
                            "systems[paged-16].allocator.host_cache_gib=8", "--set",
                            "stop.num_requests=400", "--plot", str(plot), "--quiet")
    assert proc.returncode == 0, proc.stderr
    loaded, _ = load(scenario, overrides={"systems[paged-16].allocator.host_cache_gib": 8,
                                          "stop.num_requests": 400})
    curve = hit_curve(scenario_trace(loaded, scenario.parent), 16)
    pool = scenario_pool_slots(loaded)
    host = 8 * 1024**3 // loaded.model_spec().kv_bytes_per_token
    assert (f"GPU KV pool: {pool:,} tokens (4.00 GiB): {curve.hit_rate(pool):.1%}"
            in proc.stdout)
    assert (f"paged-16: pool + 8 GiB host tier: {pool + host:,} tokens (12.00 GiB): "
            f"{curve.hit_rate(pool + host):.1%}" in proc.stdout)
    assert plot.stat().st_size > 10_000
    bad = kvsim_in_process("trace", "hit-curve", str(scenario), "--plot",
                           str(tmp_path / "curve.txt"), "--quiet")
    assert bad.returncode == 2
    assert bad.stderr.strip() == (f"kvsim: error: {tmp_path / 'curve.txt'}: expected a .png, "
                                  ".svg or .pdf figure file")
    bad = kvsim_in_process("trace", "hit-curve", "builtin:azure_llm_2023_code.csv",
                           "--model", "llama-9", "--quiet")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "unknown model 'llama-9'" in bad.stderr
    # Azure's traces say nothing of content: nothing is ever found again.
    proc = kvsim_in_process("trace", "hit-curve", "builtin:azure_llm_2023_code.csv", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "no cache size finds anything" in proc.stdout
