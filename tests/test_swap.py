"""Preemption by swap: a victim's KV is parked in host memory and copied back when it is
seated again, instead of being recomputed; a victim that does not fit the swap space is
still recomputed. A group of forked samples is swapped whole, its prompt's shared blocks
once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_token_gaps import two_requests

from sim.engine import build_timing, host_memory, run_scenario
from sim.metrics import format_summary
from sim.presets import GIB, lookup_gpu, lookup_model
from sim.results import run_notes
from sim.scenario import ScenarioError, scenario_from_dict


def scenario(swap_space_gib: float = 4.0, prefix_caching: bool = False, **workload) -> dict:
    """Llama-2-7B with 1 GiB of paged KV (about 2,000 tokens) under far more decode than
    fits: requests are preempted again and again. (Contiguous extents are reserved whole at
    admission and never grow, so they are never preempted for memory.)"""
    allocator = {"kind": "paged", "block_size": 16, "prefix_caching": prefix_caching}
    return {
        "name": "swap", "model": "llama-2-7b", "memory": {"kv_memory_gib": 1.0},
        "workload": {"arrival": {"process": "poisson", "rate": 50},
                     "prompt_len": {"dist": "uniform", "low": 100, "high": 400},
                     "output_len": {"dist": "uniform", "low": 100, "high": 600},
                     **workload},
        "systems": [
            {"name": "recompute", "allocator": allocator},
            {"name": "swap", "allocator": allocator,
             "scheduler": {"preemption_mode": "swap", "swap_space_gib": swap_space_gib}},
        ],
        "stop": {"num_requests": 80}, "seed": 1,
    }


def test_swap_copies_instead_of_recomputing():
    runs = run_scenario(scenario_from_dict(scenario())).systems
    recompute, swap = runs["recompute"], runs["swap"]
    assert recompute.summary["recomputed_tokens"] > 10_000
    assert recompute.summary["swap_preemptions"] is None
    summary = swap.summary
    # With room to spare every preemption swaps, and nothing is computed twice ...
    assert summary["preemptions"] > 20
    assert summary["swap_preemptions"] == summary["preemptions"]
    assert summary["recomputed_tokens"] == 0
    # ... but the token each seating needs to produce the next: the prompts, plus one token
    # per swap-in (all the KV but the last token's comes back).
    requests = swap.requests
    assert swap.steps["prefill_tokens"].sum() == (requests["prompt_len"].sum()
                                                  + summary["swap_preemptions"])
    # Without a prefix cache whatever went out comes back, in whole 16-token blocks.
    assert summary["swapped_out_slots"] == summary["swapped_in_slots"] > 0
    assert summary["swapped_out_slots"] % 16 == 0
    assert swap.steps["swapped_slots"].sum() == 2 * summary["swapped_out_slots"]
    # Each request's output is the same: it resumes where it was.
    pd.testing.assert_series_equal(requests["output_len"], recompute.requests["output_len"])


def test_a_swap_costs_its_copy_over_the_host_link():
    data = scenario()
    swap_scenario = scenario_from_dict(data)
    steps = run_scenario(swap_scenario).systems["swap"].steps
    _, swap_slots, s_per_token = host_memory(swap_scenario, swap_scenario.systems[1])
    per_token = lookup_model("llama-2-7b").kv_bytes_per_token
    assert swap_slots == 4 * GIB // per_token
    assert s_per_token == per_token / lookup_gpu("a100-80g").host_link_bytes_per_s
    timing = build_timing(swap_scenario, Path())
    # Steps that only decode and swap: the step time plus the copy, exactly. vLLM v0 copies
    # a block's K and V of each of its 32 layers apart: 64 copies a block, 5 us to issue
    # each, longer than a 16-token copy's 128 KiB take over the link (4.1 us).
    copies = steps[(steps["steps"] == 1) & (steps["swapped_slots"] > 0)
                   & (steps["prefill_tokens"] == 0)]
    assert len(copies) > 5
    issue_s = 5e-6 * 32 * 2 / 16  # a slot's share of its block's copies
    assert issue_s > s_per_token
    expected = [timing.step_time(int(seqs), int(context), 0, 0, timing.rho(16))
                + slots * issue_s for seqs, context, slots in
                zip(copies["decode_seqs"], copies["context_tokens"], copies["swapped_slots"],
                    strict=True)]
    np.testing.assert_allclose(copies["duration_s"], expected, rtol=1e-12)
    # Without the cost of issuing copies, the bytes alone.
    data["systems"][1]["scheduler"]["swap_copy_overhead_s"] = 0
    steps = run_scenario(scenario_from_dict(data)).systems["swap"].steps
    copies = steps[(steps["steps"] == 1) & (steps["swapped_slots"] > 0)
                   & (steps["prefill_tokens"] == 0)]
    expected = [timing.step_time(int(seqs), int(context), 0, 0, timing.rho(16))
                + slots * s_per_token for seqs, context, slots in
                zip(copies["decode_seqs"], copies["context_tokens"], copies["swapped_slots"],
                    strict=True)]
    np.testing.assert_allclose(copies["duration_s"], expected, rtol=1e-12)


def test_small_blocks_are_slow_to_swap():
    # The PagedAttention paper's microbenchmark (its Fig. 19a): a copy a block, layer and K
    # or V, so a token of small blocks swaps at the rate copies are issued, far below the
    # link's; from blocks of 32 tokens on, the bytes take longer than issuing their copies.
    link_s = 524288 / 32e9  # Llama-2-7B's 512 KiB a token over the A100's 32 GB/s
    for block_size, slot_s in ((1, 5e-6 * 64), (4, 5e-6 * 16), (32, link_s), (64, link_s)):
        data = scenario()
        data["systems"][1]["allocator"]["block_size"] = block_size
        swap_scenario = scenario_from_dict(data)
        steps = run_scenario(swap_scenario).systems["swap"].steps
        timing = build_timing(swap_scenario, Path())
        copies = steps[(steps["steps"] == 1) & (steps["swapped_slots"] > 0)
                       & (steps["prefill_tokens"] == 0)]
        assert len(copies) > 3, block_size
        expected = [timing.step_time(int(seqs), int(context), 0, 0, timing.rho(block_size))
                    + slots * slot_s for seqs, context, slots in
                    zip(copies["decode_seqs"], copies["context_tokens"],
                        copies["swapped_slots"], strict=True)]
        np.testing.assert_allclose(copies["duration_s"], expected, rtol=1e-12)


def test_a_full_swap_space_falls_back_to_recompute():
    # Less than one token of swap space: every preemption recomputes, and the run is the
    # recompute run exactly.
    runs = run_scenario(scenario_from_dict(scenario(swap_space_gib=1e-4))).systems
    assert runs["swap"].summary["swap_preemptions"] == 0
    pd.testing.assert_frame_equal(runs["swap"].requests, runs["recompute"].requests)
    # Room for a few: some swap, the rest recompute, and the space is never overdrawn
    # (engine.debug_invariants checks what parked requests hold after every step).
    data = scenario(swap_space_gib=0.3)
    data["engine"] = {"mode": "step", "debug_invariants": True}
    summary = run_scenario(scenario_from_dict(data)).systems["swap"].summary
    assert 0 < summary["swap_preemptions"] < summary["preemptions"]
    assert summary["recomputed_tokens"] > 0


def test_swap_with_a_prefix_cache_copies_back_only_what_it_lost():
    runs = run_scenario(scenario_from_dict(scenario(
        prefix_caching=True, prefix_groups={"groups": 2, "length": 96, "fraction": 1.0}
    ))).systems
    summary = runs["swap"].summary
    assert summary["swap_preemptions"] > 10
    # Blocks still cached on the GPU when a request comes back need no copy.
    assert summary["swapped_in_slots"] < summary["swapped_out_slots"]
    assert summary["recomputed_tokens"] == 0


def test_a_group_of_samples_is_swapped_whole_and_comes_back_as_it_was():
    # As vLLM v0 preempted a request of several samples: every sample's KV goes out and
    # comes back, so none of the answers is thrown away; recomputing, the group starts over.
    runs = {}
    for mode in ("step", "jump"):
        data = scenario(sampling={"n": 2})
        data["engine"] = {"mode": mode, "debug_invariants": mode == "step"}
        runs[mode] = run_scenario(scenario_from_dict(data)).systems
    recompute, swap = runs["step"]["recompute"].summary, runs["step"]["swap"]
    pd.testing.assert_frame_equal(runs["jump"]["swap"].requests, swap.requests)
    summary = swap.summary
    assert summary["preemptions"] > 10
    assert summary["swap_preemptions"] == summary["preemptions"]
    assert summary["recomputed_tokens"] == summary["discarded_output_tokens"] == 0
    assert recompute["discarded_output_tokens"] > 10_000
    # Without a prefix cache the blocks that went out come back; each seating reads the
    # prompts or, swapped in, the group's last tokens (one a sample, each a token of work).
    assert summary["swapped_out_slots"] == summary["swapped_in_slots"] > 0
    assert swap.steps["prefill_tokens"].sum() == (swap.requests["prompt_len"].sum()
                                                  + 2 * summary["swap_preemptions"])
    assert summary["throughput_tok_s"] > recompute["throughput_tok_s"]
    # A group the swap space cannot hold starts over, and the run says why.
    data = scenario(swap_space_gib=0.3, sampling={"n": 2})
    summaries = {name: run.summary
                 for name, run in run_scenario(scenario_from_dict(data)).systems.items()}
    assert 0 < summaries["swap"]["swap_preemptions"] < summaries["swap"]["preemptions"]
    thrown = summaries["swap"]["discarded_output_tokens"]
    assert thrown > 0
    assert (f"swap {thrown:,} (its swap space full)" in run_notes(summaries)[-1]
            and "swap_groups swaps a group" in run_notes(summaries)[-1])
    assert run_notes({"swap": summaries["swap"]})[-1].endswith("(its swap space full)")


def test_a_group_swapped_back_in_reads_a_token_per_sample_within_the_budget():
    # As vLLM v0 resumed a swapped group: its n samples each decode their last token, n
    # tokens of the step's budget and of its work (with that token's history each).
    data = scenario(sampling={"n": 4})
    data["engine"] = {"mode": "step", "debug_invariants": True}
    for system in data["systems"]:
        system.setdefault("scheduler", {}).update(
            max_num_batched_tokens=256, chunked_prefill=True, max_num_seqs=64)
    swap = run_scenario(scenario_from_dict(data)).systems["swap"]
    swaps = swap.summary["swap_preemptions"]
    assert swaps > 10
    steps, requests = swap.steps, swap.requests
    served = requests[~requests["rejected"]]  # (some groups never fit the pool)
    assert steps["prefill_tokens"].sum() == served["prompt_len"].sum() + 4 * swaps
    work = steps["decode_seqs"] + steps["prefill_tokens"]
    assert work.max() == 256


@pytest.mark.parametrize("sampling", [{"n": 1}, {"n": 2}])
def test_swap_groups_swaps_a_group_and_recomputes_a_request_alone(sampling):
    # vLLM v0's default: a group of samples (or beams), which it cannot recompute, is
    # swapped; a request of one sequence is recomputed.
    data = scenario(sampling=sampling)
    runs = run_scenario(scenario_from_dict(data)).systems
    data["systems"][1]["scheduler"]["preemption_mode"] = "swap_groups"
    groups = run_scenario(scenario_from_dict(data)).systems["swap"]
    alike = runs["swap"] if sampling["n"] > 1 else runs["recompute"]
    pd.testing.assert_frame_equal(groups.requests, alike.requests)
    assert groups.summary["preemptions"] > 10
    swaps = groups.summary["swap_preemptions"]
    assert swaps == (groups.summary["preemptions"] if sampling["n"] > 1 else 0)


def test_a_contiguous_group_outgrowing_its_predicted_extents_is_swapped_whole():
    # Contiguous samples share nothing: each comes back into an extent of its own, one
    # slot past its tokens at least (the next step's), the prediction doubled.
    def data(mode: str, scheduler: dict) -> dict:
        return {"name": "c", "model": "llama-2-7b", "memory": {"kv_memory_gib": 1.0},
                "workload": {"arrival": {"process": "poisson", "rate": 20},
                             "prompt_len": {"dist": "uniform", "low": 100, "high": 400},
                             "output_len": {"dist": "uniform", "low": 50, "high": 600},
                             "sampling": {"n": 2}},
                "systems": [{"name": "s", "allocator": {"kind": "contiguous",
                                                         "reserve_policy": "predicted"},
                             "predictor": {"sigma": 1.0}, "scheduler": scheduler}],
                "stop": {"num_requests": 50}, "seed": 1,
                "engine": {"mode": mode, "debug_invariants": mode == "step"}}

    swap = {"preemption_mode": "swap", "swap_space_gib": 4}
    runs = {mode: run_scenario(scenario_from_dict(data(mode, swap))).systems["s"]
            for mode in ("step", "jump")}
    pd.testing.assert_frame_equal(runs["jump"].requests, runs["step"].requests)
    summary = runs["step"].summary
    assert summary["swap_preemptions"] == summary["preemptions"] == summary[
        "reservation_overflows"] > 5
    assert summary["recomputed_tokens"] == summary["discarded_output_tokens"] == 0
    assert summary["swapped_out_slots"] == summary["swapped_in_slots"] > 0
    restarted = run_scenario(scenario_from_dict(data("jump", {}))).systems["s"].summary
    assert restarted["discarded_output_tokens"] > 5_000
    assert summary["throughput_tok_s"] > restarted["throughput_tok_s"]


def test_a_group_swapped_out_holds_its_shared_blocks_once(tmp_path):
    # Two requests of a 100-token prompt and two samples of 200 tokens in 0.4 GiB: the later
    # is swapped out with k tokens of each sample: the prompt's 6 full blocks, which both
    # samples share, and each one's own 15 - 6 (its copy of the partial block among them).
    data = two_requests(tmp_path, (200, 200), preemption_mode="swap", swap_space_gib=1)
    data["workload"]["sampling"] = {"n": 2}
    result = run_scenario(scenario_from_dict(data), base_dir=tmp_path).systems["s"]
    steps, summary = result.steps, result.summary
    assert summary["swap_preemptions"] == summary["preemptions"] == 1
    preempted = int(np.flatnonzero(steps["preempted"].to_numpy())[0])
    had = int(steps["decode_seqs"].iloc[1:preempted].gt(0).sum()) + 1  # tokens of each
    tokens = 100 + had - 1  # KV of each: all but its last token's
    blocks = 6 + 2 * (-(-tokens // 16) - 6)
    assert summary["swapped_out_slots"] == 16 * blocks
    # Seated again, its prompt's full blocks still cached: only the samples' own come back.
    assert summary["swapped_in_slots"] == 16 * (blocks - 6)
    assert summary["discarded_output_tokens"] == 0


def test_the_summary_shows_swaps_only_where_a_system_swaps():
    data = scenario()
    runs = run_scenario(scenario_from_dict(data)).systems
    both = format_summary({name: run.summary for name, run in runs.items()})
    assert "preemptions by swap" in both and "KV slots swapped out" in both
    alone = format_summary({"recompute": runs["recompute"].summary})
    assert "swap" not in alone


def test_swap_settings_are_checked():
    data = scenario()
    data["systems"][1]["scheduler"]["swap_space_gib"] = 0
    with pytest.raises(ScenarioError, match=r"swap_space_gib: .*greater than 0"):
        scenario_from_dict(data)
    data = scenario()
    data["systems"][1]["scheduler"]["preemption_mode"] = "offload"
    with pytest.raises(ScenarioError, match=r"preemption_mode: .*'recompute', 'swap' or "
                                            r"'swap_groups' \(got 'offload'\)"):
        scenario_from_dict(data)
    data = scenario()
    data["gpu"] = {"name": "mine", "memory_gib": 80, "hbm_bandwidth_gbps": 2000,
                   "peak_tflops": 300}
    with pytest.raises(ScenarioError, match=r"system 'swap': preemption_mode swap needs "
                       r"gpu.host_link_gbps"):
        scenario_from_dict(data)
