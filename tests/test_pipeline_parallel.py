"""Pipeline parallelism: the layers split into stages on GPUs of their own, a batch passing
stage to stage and as many batches in flight as stages (vLLM's --pipeline-parallel-size)."""

from __future__ import annotations

import copy

import pandas as pd
import pytest

from sim.engine import memory_summary, run_scenario, scenario_pool_slots
from sim.presets import kv_pool_slots, lookup_gpu, lookup_model
from sim.scenario import ScenarioError, scenario_from_dict
from sim.sweep import config_key, expand
from sim.timing import pipeline_hop_s_per_token

L70 = lookup_model("llama-2-70b")
H100 = lookup_gpu("h100-80g")

# Stages that hand activations on for (next to) nothing, and steps without CPU time: what
# is left of a pass is its stages' computing.
FREE_LINKS = {"pipeline_link_gbps": 1e12, "allreduce_latency_s": 0.0}


def scenario(parallel: dict, **overrides) -> dict:
    data = {
        "name": "pp", "model": "llama-2-70b", "gpu": "h100-80g", "parallel": parallel,
        "workload": {"arrival": {"process": "poisson", "rate": 20},
                     "prompt_len": {"dist": "uniform", "low": 50, "high": 600},
                     "output_len": {"dist": "uniform", "low": 5, "high": 120}},
        "systems": [{"name": "paged", "allocator": {"kind": "paged", "block_size": 16}}],
        "stop": {"num_requests": 80},
    }
    data.update(overrides)
    return data


def lone_request(parallel: dict) -> dict:
    return scenario(parallel, timing={"step_overhead_s": 0.0}, workload={
        "arrival": {"process": "poisson", "rate": 1},
        "prompt_len": {"dist": "constant", "value": 500},
        "output_len": {"dist": "constant", "value": 40}}, stop={"num_requests": 1})


def test_stages_split_the_layers_as_vllm_does():
    # Evenly, the remainder one each to the stages before the last (vLLM's get_pp_indices).
    assert L70.pipeline_stage_layers(1) == [80]
    assert L70.pipeline_stage_layers(2) == [40, 40]
    assert L70.pipeline_stage_layers(3) == [27, 27, 26]
    v3 = lookup_model("deepseek-v3")
    assert v3.pipeline_stage_layers(2) == [31, 30]
    assert v3.pipeline_stage_layers(4) == [15, 15, 16, 15]


def test_the_heaviest_stage_sets_the_pool():
    # Eight GPUs hold the same bytes a token whether they split heads or layers.
    assert kv_pool_slots(L70, H100, tensor_parallel_size=4, pipeline_parallel_size=2) == (
        kv_pool_slots(L70, H100, tensor_parallel_size=8))
    # Three stages of 27, 27 and 26 layers: a first stage's GPU holds 27/80 of the weights
    # and 27/80 of a token's KV.
    share = 27 / 80
    usable = H100.memory_bytes * 0.9
    expected = int((usable - L70.weight_bytes / 4 * share)
                   // (L70.kv_bytes_per_token_per_gpu(4) * share))
    assert kv_pool_slots(L70, H100, tensor_parallel_size=4,
                         pipeline_parallel_size=3) == expected
    # An explicit KV size is the engine's, all its GPUs together, however they split.
    assert kv_pool_slots(L70, H100, kv_memory_gib=40, tensor_parallel_size=2,
                         pipeline_parallel_size=4) == (
        kv_pool_slots(L70, H100, kv_memory_gib=40, tensor_parallel_size=8))


def test_weights_no_stage_holds_say_so():
    with pytest.raises(ValueError, match=r"llama-2-70b weights \(a 2-stage pipeline's heaviest "
                       r"stage's\) \(64\.2 GiB\) do not fit .* use more pipeline stages"):
        kv_pool_slots(L70, lookup_gpu("a100-40g"), pipeline_parallel_size=2)


def test_the_memory_line_names_the_stages():
    line = memory_summary(scenario_from_dict(scenario(
        {"tensor_parallel_size": 4, "pipeline_parallel_size": 3})))
    assert "3 pipeline stages of 4 × h100-80g (27/27/26 layers; the figures a GPU are the " \
           "heaviest stage's): weights 10.8 GiB a GPU" in line
    assert f"GPU KV cache size {kv_pool_slots(L70, H100, tensor_parallel_size=4, pipeline_parallel_size=3):,} tokens" in line  # noqa: E501


def test_activations_cross_nvlink_on_a_board_and_the_network_beyond():
    per_token = 2 * L70.hidden_size * L70.dtype_bytes  # hidden state and residual
    assert pipeline_hop_s_per_token(L70, H100, 4, 2) == pytest.approx(
        per_token / 4 / H100.interconnect_bytes_per_s)
    assert pipeline_hop_s_per_token(L70, H100, 8, 2) == pytest.approx(per_token / 8 / 50e9)
    assert pipeline_hop_s_per_token(L70, H100, 8, 2, link_gbps=25) == pytest.approx(
        per_token / 8 / 25e9)


def test_a_lone_request_takes_as_long_as_on_one_stage():
    # One batch in flight: each token passes every stage in turn, so with free links a
    # request's times are those of the stages' tensor-parallel group doing all the layers.
    alone = run_scenario(scenario_from_dict(lone_request(
        {"tensor_parallel_size": 4, "allreduce_latency_s": 0.0}))).systems["paged"]
    staged = run_scenario(scenario_from_dict(lone_request(
        {"tensor_parallel_size": 4, "pipeline_parallel_size": 2, **FREE_LINKS}
    ))).systems["paged"]
    for column in ("first_token_s", "finished_s"):
        assert staged.requests[column].iloc[0] == pytest.approx(
            alone.requests[column].iloc[0], rel=1e-9)
    # Half of each stage's time idle: the other stage has the one batch.
    assert staged.summary["pipeline_bubble_frac"] == pytest.approx(0.5, abs=1e-6)
    assert alone.summary["pipeline_bubble_frac"] is None
    # Links that take time lengthen every pass by a hop.
    slow = lone_request({"tensor_parallel_size": 4, "pipeline_parallel_size": 2,
                         "pipeline_link_gbps": 1.0, "allreduce_latency_s": 0.0})
    slowed = run_scenario(scenario_from_dict(slow)).systems["paged"]
    hop_s = 2 * L70.hidden_size * 2 / 4 / 1e9  # a decode step's one token
    tpot = (slowed.requests["finished_s"] - slowed.requests["first_token_s"]).iloc[0] / 39
    alone_tpot = (alone.requests["finished_s"] - alone.requests["first_token_s"]).iloc[0] / 39
    assert tpot == pytest.approx(alone_tpot + hop_s, rel=1e-6)


def test_batches_in_flight_fill_the_stages_under_load():
    busy = scenario({"tensor_parallel_size": 4, "pipeline_parallel_size": 2, **FREE_LINKS},
                    workload={"arrival": {"process": "poisson", "rate": 400},
                              "prompt_len": {"dist": "uniform", "low": 50, "high": 300},
                              "output_len": {"dist": "uniform", "low": 100, "high": 300}},
                    stop={"num_requests": 200}, timing={"step_overhead_s": 0.0})
    run = run_scenario(scenario_from_dict(busy)).systems["paged"]
    # Two batches in flight most of the time: the stages idle only while filling and
    # draining, and at batches of unequal shares.
    assert run.summary["pipeline_bubble_frac"] < 0.15
    steps = run.steps
    overlap = (steps["time_s"].shift(-1) < steps["time_s"] + steps["duration_s"]).mean()
    assert overlap > 0.9  # the next batch left before this one came out
    assert run.summary["completed"] == 200


def test_max_num_seqs_counts_every_batch_in_flight():
    data = scenario({"tensor_parallel_size": 4, "pipeline_parallel_size": 4},
                    workload={"arrival": {"process": "poisson", "rate": 500},
                              "prompt_len": {"dist": "uniform", "low": 50, "high": 100},
                              "output_len": {"dist": "uniform", "low": 50, "high": 100}})
    data["systems"][0]["scheduler"] = {"max_num_seqs": 12}
    run = run_scenario(scenario_from_dict(data)).systems["paged"]
    assert run.steps["running"].max() == 12  # all four batches together, never more
    assert run.steps["decode_seqs"].max() < 12


@pytest.mark.parametrize("allocator", [
    {"kind": "paged", "block_size": 16, "prefix_caching": True},
    {"kind": "contiguous", "reserve_policy": "oracle"},
])
def test_stages_keep_the_memory_taxonomy_and_repeat_exactly(allocator):
    data = scenario({"tensor_parallel_size": 4, "pipeline_parallel_size": 3},
                    workload={"arrival": {"process": "poisson", "rate": 60},
                              "prompt_len": {"dist": "uniform", "low": 50, "high": 900},
                              "output_len": {"dist": "uniform", "low": 5, "high": 300},
                              "prefix_groups": {"groups": 2, "length": 64, "fraction": 0.6}},
                    memory={"kv_memory_gib": 0.6},  # short of memory: preemptions
                    engine={"debug_invariants": True}, stop={"num_requests": 150})
    data["systems"] = [{"name": "s", "allocator": allocator}]
    first = run_scenario(scenario_from_dict(data)).systems["s"]
    data["engine"]["mode"] = "step"  # (stages step one batch at a time in either mode)
    again = run_scenario(scenario_from_dict(data)).systems["s"]
    pd.testing.assert_frame_equal(first.requests, again.requests)
    pd.testing.assert_frame_equal(first.memory, again.memory)
    assert first.summary["completed"] == 150
    assert first.summary["preemptions"] > 0 or allocator["kind"] == "contiguous"
    memory = first.memory
    parts = memory[["token", "reserved", "internal", "external", "cached", "free"]].sum(axis=1)
    assert (parts == first.summary["capacity_slots"]).all()
    assert (memory["token"] >= 0).all() and (memory["reserved"] >= 0).all()


def test_replicas_of_pipelines_are_routed_and_finish():
    data = scenario({"tensor_parallel_size": 4, "pipeline_parallel_size": 2},
                    engine={"replicas": 2, "router": {"policy": "least_loaded"}})
    run = run_scenario(scenario_from_dict(data)).systems["paged"]
    assert run.summary["completed"] == 80 and run.summary["gpus"] == 16
    assert set(run.requests["replica"]) == {0, 1}


@pytest.mark.parametrize(("changes", "words"), [
    ({"parallel": {"pipeline_parallel_size": 81}},
     r"pipeline_parallel_size 81: llama-2-70b has 80 layers, fewer than the stages"),
    ({"model": "deepseek-v3", "gpu": "h200-141g",
      "parallel": {"pipeline_parallel_size": 2, "data_parallel_size": 2}},
     r"pipeline_parallel_size 2 with data_parallel_size 2: pipeline stages of data-parallel "
     r"ranks are not modelled"),
    ({"gpu": {"name": "g", "memory_gib": 80, "hbm_bandwidth_gbps": 3000, "peak_tflops": 900},
      "parallel": {"pipeline_parallel_size": 2}},
     r"sending activations from stage to stage needs pipeline_link_gbps or "
     r"gpu\.interconnect_gbps"),
    ({"parallel": {"tensor_parallel_size": 16, "pipeline_parallel_size": 2}},
     r"at most 8 GPUs a pipeline stage"),
    ({"engine": {"replicas": 3, "disaggregation": {"prefill_replicas": 1}}},
     r"parallel\.pipeline_parallel_size 2: pipeline stages under engine\.disaggregation are "
     r"not modelled"),
    ({"systems": [{"name": "s", "allocator": {"kind": "paged"},
                   "scheduler": {"preemption_mode": "swap"}}]},
     r"system 's': preemption by swap \(scheduler.preemption_mode\) is not modelled with "
     r"pipeline stages"),
    ({"systems": [{"name": "s", "allocator": {"kind": "paged", "host_cache_gib": 10}}]},
     r"system 's': a host tier \(allocator\.host_cache_gib\) is not modelled with pipeline"),
    ({"systems": [{"name": "s", "allocator": {"kind": "paged"},
                   "speculative": {"method": "ngram", "num_speculative_tokens": 2,
                                   "acceptance_rate": 0.5}}]},
     r"system 's': speculative decoding is not modelled with pipeline stages"),
])
def test_what_stages_do_not_model_is_refused_in_one_line(changes, words):
    data = scenario({"tensor_parallel_size": 4, "pipeline_parallel_size": 2})
    data.update(changes)
    with pytest.raises(ScenarioError, match=words):
        scenario_from_dict(data)


def test_a_link_for_one_stage_is_noted():
    notes = scenario_from_dict(scenario({"tensor_parallel_size": 8,
                                         "pipeline_link_gbps": 25})).setting_notes()
    assert any("pipeline_link_gbps changes nothing here" in note for note in notes)


def test_sweeps_keyed_before_stages_keep_their_keys():
    point = expand(dict(scenario({"tensor_parallel_size": 4}),
                        sweep={"grid": {"workload.arrival.rate": [1]}}), "x.yaml")[0]
    assert point.scenario["parallel"]["pipeline_parallel_size"] == 1
    older = copy.deepcopy(point.scenario)
    del older["parallel"]["pipeline_parallel_size"]
    assert config_key(older) == point.key
    staged = copy.deepcopy(point.scenario)
    staged["parallel"]["pipeline_parallel_size"] = 2
    assert config_key(staged) != point.key


def test_a_pipeline_counts_all_its_gpus():
    data = scenario_from_dict(scenario({"tensor_parallel_size": 4, "pipeline_parallel_size": 2},
                                       engine={"replicas": 3}))
    assert data.gpus == 24 and data.parallel.stage_gpus == 4
    assert scenario_pool_slots(data) == kv_pool_slots(L70, H100, tensor_parallel_size=8)


def test_weights_no_board_holds_are_told_the_stages_that_hold_them():
    with pytest.raises(ValueError, match=r"no tensor-parallel group of at most 8 h100-80g GPUs "
                       r"\(one board\) holds them: split the layers over boards as 2 pipeline "
                       r"stages \(parallel: \{tensor_parallel_size: 8, pipeline_parallel_size: "
                       r"2\}\)"):
        kv_pool_slots(lookup_model("deepseek-v3"), H100)
    # Which then leave room for KV.
    assert kv_pool_slots(lookup_model("deepseek-v3"), H100, tensor_parallel_size=8,
                         pipeline_parallel_size=2) > 0
