"""Prefill/decode disaggregation: prefill replicas give the first token, decode replicas the
rest, the KV travelling between them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from reports.run_figures import memory_over_time, replica_balance
from sim.engine import (
    MAX_POOL_BLOCKS,
    build_timing,
    check_pools,
    memory_summary,
    run_scenario,
    scenario_pool_slots,
)
from sim.presets import SizingError, lookup_model
from sim.scenario import ScenarioError, scenario_from_dict

ROOT = Path(__file__).resolve().parents[1]


def scenario(prefill_replicas: int = 2, replicas: int = 4, **split) -> dict:
    return {
        "name": "split", "model": "llama-2-7b", "gpu": "a100-80g",
        "memory": {"kv_memory_gib": 8},
        "engine": {"replicas": replicas,
                   "disaggregation": {"prefill_replicas": prefill_replicas, **split}},
        "workload": {"arrival": {"process": "poisson", "rate": 10},
                     "prompt_len": {"dist": "lognormal", "mean": 800, "sigma": 0.7,
                                    "max": 3000},
                     "output_len": {"dist": "uniform", "low": 1, "high": 200},
                     "prefix_groups": {"groups": 3, "length": 256, "fraction": 0.5}},
        "systems": [{"name": "paged", "allocator": {"kind": "paged"}},
                    {"name": "contiguous", "allocator": {"kind": "contiguous",
                                                         "reserve_policy": "request_max"}}],
        "stop": {"num_requests": 300},
    }


def test_prefill_replicas_give_the_first_token_and_decode_replicas_the_rest():
    data = scenario(kv_transfer_gbps=10, kv_transfer_latency_s=0.005)
    parsed = scenario_from_dict(data)
    result = run_scenario(parsed)
    a = build_timing(parsed, Path()).a
    per_token_s = lookup_model("llama-2-7b").kv_bytes_per_token / 10e9
    for run in result.systems.values():
        requests, steps = run.requests, run.steps
        assert run.summary["preemptions"] == 0  # ample memory: every count below is exact
        assert set(requests["replica"]) == {0, 1}  # new requests go to prefill replicas
        single = requests["output_len"] == 1
        # One output token is all a prefill replica gives: nothing to hand over.
        assert (requests.loc[single, "decode_replica"] == -1).all()
        assert (requests.loc[single, "finished_s"] == requests.loc[single, "first_token_s"]
                ).all()
        rest = requests[~single]
        assert (rest["decode_replica"] == 2 + rest["request"] % 2).all()
        # The KV travels (latency + bytes / bandwidth), then each later token takes a step.
        earliest = (rest["first_token_s"] + 0.005 + rest["prompt_len"] * per_token_s
                    + (rest["output_len"] - 1) * a)
        assert (rest["finished_s"] >= earliest - 1e-9).all()
        # Prefill replicas never decode; decode replicas compute one token per handover
        # (the first token's own KV), never a prompt.
        prefill_steps = steps[steps["replica"] < 2]
        decode_steps = steps[steps["replica"] >= 2]
        assert (prefill_steps["decode_seqs"] == 0).all()
        assert decode_steps["prefill_tokens"].sum() == len(rest)
        assert prefill_steps["prefill_tokens"].sum() == (
            requests["prompt_len"].sum() - requests["prefix_hit_tokens"].sum())
        # Prefix hits count where prompts are read: at prefill replicas only.
        decode_memory = run.memory[run.memory["replica"] >= 2]
        assert (decode_memory["lookup_tokens"] == 0).all()
        assert run.summary["prefill_replicas"] == 2
        assert run.summary["replica_imbalance"] == pytest.approx(1.0, abs=0.01)


def test_the_transfer_is_what_the_link_makes_it():
    def e2e_minus_ttft(**split) -> pd.Series:
        run = run_scenario(scenario_from_dict(scenario(**split))).systems["paged"]
        many = run.requests[run.requests["output_len"] > 1]
        return many["finished_s"] - many["first_token_s"]

    slow = e2e_minus_ttft(kv_transfer_gbps=1, kv_transfer_latency_s=0.0)
    fast = e2e_minus_ttft(kv_transfer_gbps=100, kv_transfer_latency_s=0.0)
    late = e2e_minus_ttft(kv_transfer_gbps=100, kv_transfer_latency_s=1.0)
    assert slow.mean() > fast.mean() + 0.1  # 800 tokens × 0.5 MiB at 1 GB/s: 0.4 s
    assert (late >= 1.0).all()


@pytest.mark.parametrize("kv_transfer", ["after_prefill", "layerwise"])
def test_a_layerwise_transfer_runs_under_the_prefill(kv_transfer):
    # One request on a slow link, one prefill and one decode replica: the decode replica's
    # first step starts when the KV has arrived.
    data = scenario(prefill_replicas=1, replicas=2, kv_transfer_gbps=1,
                    kv_transfer_latency_s=0.002, kv_transfer=kv_transfer)
    data["workload"]["prompt_len"] = {"dist": "constant", "value": 1000}
    data["workload"]["output_len"] = {"dist": "constant", "value": 20}
    data["stop"] = {"num_requests": 1}
    run = run_scenario(scenario_from_dict(data)).systems["paged"]
    steps = run.steps
    prefill = steps[steps["replica"] == 0].iloc[0]
    compute_s = prefill["duration_s"]
    transfer_s = 1000 * lookup_model("llama-2-7b").kv_bytes_per_token / 1e9  # 0.52 s
    layers = 32
    sent_s = (max(compute_s, transfer_s) + min(compute_s, transfer_s) / layers
              if kv_transfer == "layerwise" else compute_s + transfer_s)
    first_decode_step = steps[steps["replica"] == 1]["time_s"].min()
    assert first_decode_step == pytest.approx(prefill["time_s"] + sent_s + 0.002)
    assert run.requests["first_token_s"].iloc[0] == pytest.approx(prefill["time_s"] + compute_s)


@pytest.mark.parametrize("kv_transfer", ["after_prefill", "layerwise"])
def test_a_prefill_replica_holds_the_kv_until_it_is_sent(kv_transfer):
    # Two 1,000-token prompts, a pool that holds one (1,536 slots), a slow link (0.52 s
    # each): the second prompt is read only once the first one's KV has left.
    data = scenario(prefill_replicas=1, replicas=2, kv_transfer_gbps=1,
                    kv_transfer_latency_s=0.0, kv_transfer=kv_transfer)
    data["memory"] = {"kv_memory_gib": 0.75}
    data["workload"].update(arrival={"process": "constant", "rate": 50},
                            prompt_len={"dist": "constant", "value": 1000},
                            output_len={"dist": "constant", "value": 20})
    del data["workload"]["prefix_groups"]
    data["systems"] = [{"name": "paged", "allocator": {"kind": "paged", "watermark": 0}}]
    data["stop"] = {"num_requests": 2}
    data["engine"]["debug_invariants"] = True
    run = run_scenario(scenario_from_dict(data)).systems["paged"]
    first, second = run.requests.itertuples()
    prefill = run.steps[run.steps["replica"] == 0]
    compute_s = prefill["duration_s"].iloc[0]
    transfer_s = 1000 * lookup_model("llama-2-7b").kv_bytes_per_token / 1e9
    sent_s = first.admitted_s + (compute_s + transfer_s if kv_transfer == "after_prefill"
                                 else transfer_s + compute_s / 32)
    assert second.arrival_s < first.first_token_s < sent_s
    assert second.admitted_s == pytest.approx(sent_s)
    assert prefill["time_s"].iloc[1] == pytest.approx(sent_s)
    assert run.summary["completed"] == 2


def test_a_split_needs_a_decode_replica_and_one_sample():
    with pytest.raises(ScenarioError, match=r"engine: disaggregation.prefill_replicas \(2\) "
                       r"must leave decode replicas among engine.replicas \(2\)"):
        scenario_from_dict(scenario(2, replicas=2), "s.yaml")
    data = scenario()
    data["workload"]["sampling"] = {"n": 2}
    with pytest.raises(ScenarioError, match="one sample per request"):
        scenario_from_dict(data, "s.yaml")


def test_sessions_and_routers_stay_exact_across_the_split():
    # A session's next turn is released by the decode replica that finished the last one,
    # and read by the prefill replica that holds its conversation.
    data = scenario(1, replicas=3)
    data["workload"]["sessions"] = {"turns": {"dist": "uniform", "low": 2, "high": 4},
                                    "think_time_s": 0.5}
    data["engine"]["router"] = {"policy": "cache_aware"}
    tables = {}
    for mode in ("jump", "step"):
        data["engine"]["mode"] = mode
        tables[mode] = run_scenario(scenario_from_dict(data)).systems
    for name in ("paged", "contiguous"):
        pd.testing.assert_frame_equal(tables["jump"][name].requests,
                                      tables["step"][name].requests)
        requests = tables["jump"][name].requests
        assert (requests["replica"] == 0).all()
        assert set(requests.loc[requests["output_len"] > 1, "decode_replica"]) == {1, 2}


def test_figures_show_decode_replicas_for_decoding():
    result = run_scenario(scenario_from_dict(scenario()))
    memory = memory_over_time(result)
    assert "(replica 2, decode)" in memory.axes[0].get_title(loc="left")
    balance = replica_balance(result)
    assert balance is not None
    served = balance.kvsim_data.pivot_table(index="replica", columns="system",
                                            values="requests")
    requests = result.systems["paged"].requests
    handed_over = requests[requests["output_len"] > 1]
    assert served.loc[2, "paged"] + served.loc[3, "paged"] == len(handed_over)
    assert served.loc[0, "paged"] + served.loc[1, "paged"] == len(requests)
    assert np.isnan(balance.kvsim_data.set_index(["system", "replica"]).loc[
        ("paged", 2), "ttft_p50_s"])


def test_a_decode_replica_takes_the_network_copy_not_its_host_tier():
    # Small pools that keep evicting shared prompts to host memory; a light load, so that
    # no decode replica preempts (a preempted request recomputes there, host hits and all).
    data = scenario()
    data["memory"] = {"kv_memory_gib": 2}
    data["workload"]["arrival"]["rate"] = 0.5
    data["workload"]["prefix_groups"] = {"groups": 16, "length": 512, "fraction": 1.0}
    data["systems"] = [{"name": "paged", "allocator": {"kind": "paged", "host_cache_gib": 4}}]
    run = run_scenario(scenario_from_dict(data)).systems["paged"]
    steps = run.steps
    assert run.summary["preemptions"] == 0
    assert steps.loc[steps["replica"] < 2, "loaded_tokens"].sum() > 0  # prefill: host hits
    assert (steps.loc[steps["replica"] >= 2, "loaded_tokens"] == 0).all()
    assert 0 < run.summary["host_hit_rate"] <= run.summary["prefix_hit_rate"] <= 1


def test_least_loaded_decode_placement_spreads_what_round_robin_piles_up(tmp_path):
    # Long answers at even indices, short ones at odd: in turn by index, one of the two
    # decode replicas gets every long answer.
    rows = [(0.05 * i, 300, 600 if i % 2 == 0 else 10) for i in range(200)]
    pd.DataFrame(rows, columns=["t", "prompt", "output"]).to_csv(tmp_path / "t.csv",
                                                                   index=False)
    data = scenario(prefill_replicas=1, replicas=3)
    data["workload"] = {"kind": "trace", "path": str(tmp_path / "t.csv"), "format": "csv",
                        "columns": {"arrival": "t", "prompt_len": "prompt",
                                    "output_len": "output"}}
    data["systems"] = data["systems"][:1]
    runs = {}
    for router in ("round_robin", "least_loaded"):
        data["engine"]["disaggregation"]["decode_router"] = router
        runs[router] = run_scenario(scenario_from_dict(data)).systems["paged"]
    piled = runs["round_robin"].requests
    assert (piled["decode_replica"] == 1 + piled["request"] % 2).all()
    spread = runs["least_loaded"].requests
    tokens = {router: run.requests.groupby("decode_replica")["output_len"].sum()
              for router, run in runs.items()}
    assert tokens["round_robin"].max() > 20 * tokens["round_robin"].min()
    assert tokens["least_loaded"].max() < 2 * tokens["least_loaded"].min()
    assert set(spread["decode_replica"]) == {1, 2}
    # Half the decode work on each replica: the long answers finish sooner.
    assert (runs["least_loaded"].summary["e2e_p90_s"]
            < 0.8 * runs["round_robin"].summary["e2e_p90_s"])


def test_a_request_no_pool_could_hold_is_turned_away_on_arrival():
    # As colocated: its prompt is never read, nor its first token given.
    data = scenario(prefill_replicas=1, replicas=2)
    data["memory"] = {"kv_memory_gib": 0.5}  # 1,024 tokens of Llama-2-7B
    data["workload"]["output_len"] = {"dist": "uniform", "low": 1, "high": 900}
    data["workload"]["prompt_len"] = {"dist": "uniform", "low": 50, "high": 400}
    for run in run_scenario(scenario_from_dict(data)).systems.values():
        requests = run.requests
        rejected = requests[requests["rejected"]]
        assert len(rejected) > 5
        assert rejected["first_token_s"].isna().all()
        assert (rejected["decode_replica"] == -1).all() and (rejected["replica"] == 0).all()
        # Prefill replicas only ever read the prompts of requests that were served.
        prefill_tokens = run.steps.loc[run.steps["replica"] == 0, "prefill_tokens"].sum()
        assert prefill_tokens <= requests.loc[~requests["rejected"], "prompt_len"].sum()


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_sliding_layer_sends_and_keeps_only_the_window_the_first_decode_step_sees(hybrid):
    # Half of 32 layers slide over 100 tokens. A 1,000-token prompt's first decode step, at
    # token 1000, sees from token 901 on: under the hybrid manager the sliding layers send,
    # and the decode replica holds, blocks 56 on (tokens 896 to 999) alone; every layer
    # keeps every token without it.
    data = scenario(prefill_replicas=1, replicas=2, kv_transfer_gbps=1,
                    kv_transfer_latency_s=0.0)
    data["model"] = {"name": "half-sliding", "num_layers": 32, "num_heads": 32,
                     "head_dim": 128, "num_params": 6.74e9, "max_model_len": 4096,
                     "sliding_window": 100, "num_sliding_layers": 16}
    data["workload"]["prompt_len"] = {"dist": "constant", "value": 1000}
    data["workload"]["output_len"] = {"dist": "constant", "value": 20}
    del data["workload"]["prefix_groups"]
    data["systems"] = [{"name": "paged", "allocator": {"kind": "paged",
                                                       "hybrid_kv_cache": hybrid},
                        "scheduler": {"chunked_prefill": True,
                                      "max_num_batched_tokens": 256}}]
    data["stop"] = {"num_requests": 1}
    data["engine"]["debug_invariants"] = True
    run = run_scenario(scenario_from_dict(data)).systems["paged"]
    steps = run.steps
    prefill = steps[steps["replica"] == 0].iloc[-1]  # the prompt's last chunk
    per_token_s = 32 * 2 * 32 * 128 * 2 / 1e9  # every layer's K and V of a token, at 1 GB/s
    sent_tokens = 1000 - 896 / 2 if hybrid else 1000
    first_decode_step = steps[steps["replica"] == 1]["time_s"].min()
    assert first_decode_step == pytest.approx(
        prefill["time_s"] + prefill["duration_s"] + sent_tokens * per_token_s)
    # The decode replica's first step writes the first token's KV: it holds the prompt and
    # that token in the full group, and from token 896 on in the sliding one, whose blocks
    # before were never there (nothing of them is cached).
    decode_memory = run.memory[run.memory["replica"] == 1].iloc[0]
    assert decode_memory["token"] == (1001 + (1001 - 896) if hybrid else 1001)
    assert decode_memory["cached"] == 0
    assert run.summary["completed"] == 1


def test_gpt_oss_split_seats_more_where_the_windows_are_all_a_decode_replica_keeps():
    # The shipped sweep's two prefill and two decode replicas at 18 requests/s (README):
    # every layer keeping every token, the decode replicas seat half as many requests and
    # miss the TPOT bound; the hybrid manager's windows meet it.
    from sim.api import load, run

    scenario, _ = load(ROOT / "scenarios" / "sweeps" / "gpt_oss_disaggregation.yaml",
                       overrides={"engine.disaggregation": {"prefill_replicas": 2},
                                  "workload.arrival.rate": 18, "stop.num_requests": 300})
    systems = run(scenario).systems
    hybrid, flat = systems["hybrid"].summary, systems["all-layers"].summary
    assert hybrid["slo_attainment"] >= 0.99 > flat["slo_attainment"] + 0.05
    assert flat["slo_ttft_attainment"] == hybrid["slo_ttft_attainment"] == 1.0
    assert hybrid["peak_running"] > 1.5 * flat["peak_running"]


def test_prefill_replicas_may_spread_over_gpus_otherwise():
    # One prompt, a prefill replica of two GPUs and a decode replica of one: the prefill
    # step splits the work in two; its two GPUs send half the KV each, which the decode GPU
    # receives whole, so the transfer takes as long as from one GPU.
    def run(prefill_parallel=None):
        data = scenario(prefill_replicas=1, replicas=2, kv_transfer_gbps=1,
                        kv_transfer_latency_s=0.002)
        if prefill_parallel:
            data["engine"]["disaggregation"]["prefill_parallel"] = prefill_parallel
        data["workload"]["prompt_len"] = {"dist": "constant", "value": 1000}
        data["workload"]["output_len"] = {"dist": "constant", "value": 20}
        data["stop"] = {"num_requests": 1}
        parsed = scenario_from_dict(data)
        return parsed, run_scenario(parsed).systems["paged"]
    parsed, spread = run({"tensor_parallel_size": 2})
    _, alike = run()
    assert parsed.gpus == 3 and parsed.ranks == 2 and spread.summary["gpus"] == 3
    assert "; prefill replicas: llama-2-7b on 2 × a100-80g: " in memory_summary(parsed)
    steps = spread.steps
    prefill = steps[steps["replica"] == 0].iloc[0]
    assert prefill["duration_s"] < 0.6 * alike.steps["duration_s"].iloc[0]
    transfer_s = 1000 * lookup_model("llama-2-7b").kv_bytes_per_token / 1e9
    first_decode_step = steps[steps["replica"] == 1]["time_s"].min()
    assert first_decode_step == pytest.approx(prefill["time_s"] + prefill["duration_s"]
                                              + transfer_s + 0.002)
    # The summary's pool is the decode replica's.
    assert spread.summary["capacity_slots"] == alike.summary["capacity_slots"]


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "output"), [(1, 2, 20), (2, 1, 2000)])
def test_a_request_either_pool_cannot_hold_is_turned_away_unread(tmp_path, prefill_tp,
                                                                  decode_tp, output):
    # On 16 GiB GPUs Llama-2-7B's weights leave one GPU a small pool (about 3,700 tokens)
    # and two, which split them, a large one. A 5,000-token prompt does not fit a prefill
    # replica of one GPU; a request of 5,000 tokens in all does not fit a decode replica of
    # one, so the prefill replica of two turns it away before reading its prompt.
    rows = [(0.0, 5000 - output, output), (0.1, 500, 20)]
    pd.DataFrame(rows, columns=["t", "prompt", "output"]).to_csv(tmp_path / "t.csv",
                                                               index=False)
    data = scenario(prefill_replicas=1, replicas=2,
                    prefill_parallel={"tensor_parallel_size": prefill_tp})
    data["gpu"] = {"name": "small", "memory_gib": 16, "hbm_bandwidth_gbps": 1000,
                   "peak_tflops": 300, "interconnect_gbps": 300}
    data["parallel"] = {"tensor_parallel_size": decode_tp}
    del data["memory"]
    data["systems"] = [{"name": "paged", "allocator": {"kind": "paged", "watermark": 0}}]
    data["workload"] = {"kind": "trace", "format": "csv", "path": "t.csv",
                        "columns": {"arrival": "t", "prompt_len": "prompt",
                                    "output_len": "output"}}
    parsed = scenario_from_dict(data)
    small, large = sorted([scenario_pool_slots(parsed),
                           scenario_pool_slots(parsed.prefill_view())])
    assert small < 4000 and large > 20_000
    run = run_scenario(parsed, tmp_path).systems["paged"]
    requests = run.requests
    assert requests["rejected"].tolist() == [True, False]
    assert np.isnan(requests["first_token_s"].iloc[0])  # its prompt never read
    assert run.steps[run.steps["replica"] == 0]["prefill_tokens"].sum() == 500
    assert run.summary["capacity_slots"] == scenario_pool_slots(parsed) // 16 * 16
    assert run.summary["gpus"] == prefill_tp + decode_tp


def test_prefill_parallelism_is_checked_as_the_scenarios_is():
    with pytest.raises(ScenarioError, match=r"engine\.disaggregation\.prefill_parallel: "
                       r"data_parallel_size 2: llama-2-7b is dense"):
        scenario_from_dict(scenario(prefill_parallel={"data_parallel_size": 2}))
    with pytest.raises(ScenarioError, match=r"engine\.disaggregation\.prefill_parallel: "
                       r"tensor_parallel_size 3: "):
        scenario_from_dict(scenario(prefill_parallel={"tensor_parallel_size": 3}))


def test_every_replicas_pool_counts_towards_the_simulated_blocks():
    # Prefill replicas of two GPUs hold more than twice the decode replicas' pool (one set
    # of weights over two GPUs); the cap is on the blocks of all of them, which the
    # simulator holds at once.
    def checked(prefill_replicas: int, decode_replicas: int) -> tuple[int, int]:
        data = scenario(prefill_replicas=prefill_replicas,
                        replicas=prefill_replicas + decode_replicas,
                        prefill_parallel={"tensor_parallel_size": 2})
        data["systems"] = data["systems"][:1]
        del data["memory"]  # pools from the GPUs' memory
        parsed = scenario_from_dict(data)
        return check_pools(parsed, parsed.systems[0])
    decode_slots, prefill_slots = checked(1, 1)
    assert (prefill_slots // 16, decode_slots // 16) == (16_825, 7_609)
    assert MAX_POOL_BLOCKS - 1_000 * 16_825 - 2_198 * 7_609 == 4_850
    checked(1_000, 2_198)
    with pytest.raises(SizingError, match=(
            r"^engine.replicas: system 'paged' would hold 33,557,191 blocks over its 1,000 "
            r"prefill replicas, 16,825 each, and 2,199 decode replicas, 7,609 each; at most "
            r"33,554,432 are simulated in all: give fewer replicas, a smaller pool or a larger "
            r"block size$")):
        checked(1_000, 2_199)
