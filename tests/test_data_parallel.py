"""Data-parallel ranks of a mixture of experts: each rank its own KV cache and batch, the
routed experts spread over every rank's GPUs (vLLM's --data-parallel-size, with or without
--enable-expert-parallel)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from sim.engine import build_timing, memory_summary, run_scenario, scenario_pool_slots
from sim.presets import GIB, kv_pool_slots, lookup_gpu, lookup_model
from sim.scenario import ScenarioError, scenario_from_dict
from sim.timing import roofline

V3 = lookup_model("deepseek-v3")
H200 = lookup_gpu("h200-141g")


# Prompts long enough that a prefill chunk stalls the decodes beside it, read in chunks.
LONG_PROMPTS = {"arrival": {"process": "poisson", "rate": 30},
                "prompt_len": {"dist": "uniform", "low": 2000, "high": 6000},
                "output_len": {"dist": "uniform", "low": 50, "high": 200}}
CHUNKED = [{"name": "paged", "allocator": {"kind": "paged", "block_size": 64},
            "scheduler": {"chunked_prefill": True}}]


def scenario(parallel: dict, model: str = "deepseek-v3", **overrides) -> dict:
    data = {
        "name": "dp", "model": model, "gpu": "h200-141g", "parallel": parallel,
        "workload": {"arrival": {"process": "poisson", "rate": 40},
                     "prompt_len": {"dist": "uniform", "low": 50, "high": 400},
                     "output_len": {"dist": "uniform", "low": 5, "high": 60}},
        "systems": [{"name": "paged", "allocator": {"kind": "paged", "block_size": 64}}],
        "stop": {"num_requests": 60},
    }
    data.update(overrides)
    return data


def test_a_rank_holds_the_dense_weights_and_its_share_of_the_experts():
    experts = V3.routed_expert_bytes
    dense = V3.weight_bytes - experts
    assert V3.num_dense_layers == 3 and V3.moe_layers == 58
    assert V3.weight_bytes_per_gpu(8) == V3.weight_bytes / 8  # tensor parallel alone
    assert V3.weight_bytes_per_gpu(1, 8) == pytest.approx(dense + experts / 8)
    assert V3.weight_bytes_per_gpu(2, 8) == pytest.approx(dense / 2 + experts / 8)
    usable = H200.memory_bytes * 0.9
    per_token = V3.kv_bytes_per_token_per_gpu(1)
    rank = kv_pool_slots(V3, H200, data_parallel_size=8)
    assert rank == int((usable - dense - experts / 8) // per_token)
    # Tensor parallelism keeps the whole latent on every GPU: 8 GPUs hold one pool; eight
    # ranks hold eight, each a little smaller (a rank's GPU keeps all the dense weights).
    engine = kv_pool_slots(V3, H200, tensor_parallel_size=8)
    assert engine == int((usable - V3.weight_bytes / 8) // per_token)
    assert 0.5 * engine < rank < engine and 8 * rank > 5 * engine


def test_the_weights_that_do_not_fit_say_how_they_are_split():
    small = lookup_gpu("h100-80g")
    with pytest.raises(ValueError, match=r"1/1 of the dense ones, 1/4 of the experts\) "
                       r"\(167.8 GiB\) do not fit .*; spread the experts over 6 ranks "
                       r"\(parallel.data_parallel_size: 6\)"):
        kv_pool_slots(V3, H200, data_parallel_size=4)
    with pytest.raises(ValueError, match=r"no 8 GPUs of one board hold the dense weights "
                       r"and 1/8 of the experts"):
        kv_pool_slots(V3, small, data_parallel_size=8)


def test_the_roofline_of_a_rank_reads_its_experts_for_every_ranks_tokens():
    tp1 = roofline(V3, H200)
    dp = roofline(V3, H200, data_parallel_size=8, expert_parallel=True)
    bandwidth = H200.hbm_bandwidth_bytes_per_s
    assert dp.expert_s == pytest.approx(V3.routed_expert_bytes / 8 / bandwidth)
    assert dp.expert_batch_ranks == 8
    # The experts a step of one token reads are those of 8 tokens (one a rank), of 1/8 of
    # the experts, plus the dispatch and combine's latencies.
    latency = 2 * V3.moe_layers * 10e-6
    read_of_8 = tp1.expert_s * (1 - (1 - V3.expert_share) ** 8)
    dense_s = (V3.weight_bytes - V3.routed_expert_bytes) / bandwidth
    assert dp.fixed_s(1) == pytest.approx(dense_s + 1e-3 + latency + read_of_8 / 8)
    # A token goes out to its 8 experts' GPUs and back in each of the 58 MoE layers, 7/8 of
    # them off the GPU; without expert parallelism, to all 8 ranks (as many here).
    link = H200.interconnect_bytes_per_s
    sent = 2 * 58 * 8 * 7 / 8 * V3.hidden_size * 2
    assert dp.b - tp1.b == pytest.approx(sent / link)
    gathered = roofline(V3, H200, data_parallel_size=4)
    assert gathered.b - tp1.b == pytest.approx(2 * 58 * 4 * 3 / 4 * V3.hidden_size * 2 / link)
    # Expert parallelism within one tensor-parallel group: the MLP's all-reduce gives way to
    # the dispatch and combine in the MoE layers; the experts' weights are split the same.
    tp8 = roofline(V3, H200, tensor_parallel_size=8)
    ep8 = roofline(V3, H200, tensor_parallel_size=8, expert_parallel=True)
    assert ep8.a - tp8.a == pytest.approx(58 * 10e-6)  # 58 all-reduces out, 116 latencies in
    assert ep8.expert_s == tp8.expert_s and ep8.expert_batch_ranks == 1
    allreduce = 2 * 7 / 8 * V3.hidden_size * 2 / link
    assert ep8.b - tp8.b == pytest.approx(58 * (2 * 8 * 7 / 8 / 8 * V3.hidden_size * 2 / link
                                                - allreduce))


def test_mla_attention_on_one_gpu_is_bound_by_its_flops():
    # DeepSeek-V3's 128 heads each read the 576-element latent: on one GPU 4·61·128·576 FLOP
    # a context token take longer than its 68.6 KiB; split 8 ways, the bytes bound it.
    flops = 4 * 61 * 128 * 576
    assert roofline(V3, H200).c == pytest.approx(flops / H200.peak_flops)
    assert flops / H200.peak_flops > V3.kv_bytes_per_token / H200.hbm_bandwidth_bytes_per_s
    assert roofline(V3, H200, tensor_parallel_size=8).c == (
        V3.kv_bytes_per_token / H200.hbm_bandwidth_bytes_per_s)
    llama = lookup_model("llama-3-8b")
    assert roofline(llama, H200).c == llama.kv_bytes_per_token / H200.hbm_bandwidth_bytes_per_s


@pytest.mark.parametrize("parallel, words", [
    ({"data_parallel_size": 2}, "data_parallel_size 2: llama-2-7b is dense"),
    ({"expert_parallel": True}, "expert_parallel: llama-2-7b is dense"),
])
def test_a_dense_model_has_no_experts_to_spread(parallel, words):
    with pytest.raises(ScenarioError, match=words):
        scenario_from_dict(scenario(parallel, model="llama-2-7b"))


def test_ranks_beyond_one_board_are_refused():
    with pytest.raises(ScenarioError, match=r"data_parallel_size 8 × tensor_parallel_size 2: "
                       r"NVLink joins 8"):
        scenario_from_dict(scenario({"data_parallel_size": 8, "tensor_parallel_size": 2}))
    gpu = {"name": "x", "memory_gib": 141, "hbm_bandwidth_gbps": 4800, "peak_tflops": 989}
    with pytest.raises(ScenarioError, match=r"all-reduces and expert dispatches need "
                       r"gpu\.interconnect_gbps"):
        scenario_from_dict(scenario({"data_parallel_size": 2}, gpu=gpu))


def test_what_is_not_modelled_with_ranks_is_refused_in_one_line():
    with pytest.raises(ScenarioError, match=r"timing\.calibration: a calibration times one "
                       r"tensor-parallel group"):
        scenario_from_dict(scenario({"expert_parallel": True, "tensor_parallel_size": 8},
                                    timing={"calibration": "c.yaml"}))


def test_expert_parallel_on_one_gpu_is_noted_as_changing_nothing():
    notes = scenario_from_dict(scenario({"expert_parallel": True})).setting_notes()
    assert any("parallel.expert_parallel changes nothing here" in n for n in notes)
    assert roofline(V3, H200, expert_parallel=True) == roofline(V3, H200)


def test_each_rank_runs_as_an_engine_of_its_own_balanced_by_load():
    ranks = scenario_from_dict(scenario({"data_parallel_size": 8, "expert_parallel": True}))
    assert ranks.ranks == 8 and ranks.engine.router.policy == "vllm_dp"
    result = run_scenario(ranks).systems["paged"]
    summary = result.summary
    assert summary["replicas"] == 8 and summary["gpus"] == 8
    assert scenario_pool_slots(ranks) == kv_pool_slots(V3, H200, data_parallel_size=8)
    assert summary["capacity_slots"] == scenario_pool_slots(ranks) // 64 * 64
    assert set(result.requests["replica"]) == set(range(8))
    # The default is vLLM's balancer, exactly; round robin, when asked, routes otherwise.
    explicit = run_scenario(scenario_from_dict(scenario(
        {"data_parallel_size": 8, "expert_parallel": True},
        engine={"router": {"policy": "vllm_dp"}}))).systems["paged"]
    pd.testing.assert_frame_equal(result.requests, explicit.requests)
    in_turn = run_scenario(scenario_from_dict(scenario(
        {"data_parallel_size": 8, "expert_parallel": True},
        engine={"router": {"policy": "round_robin"}}))).systems["paged"]
    assert (in_turn.requests["replica"] == in_turn.requests["request"] % 8).all()
    assert not in_turn.requests["replica"].equals(result.requests["replica"])
    # The default is written into the scenario: it stays when a sweep or a capacity search
    # saves the scenario and reads it again; a policy given stays as given.
    again = scenario_from_dict(ranks.model_dump(mode="json"))
    assert again.engine.router.policy == "vllm_dp"
    assert scenario_from_dict(scenario({"data_parallel_size": 2}, engine={
        "router": {"policy": "round_robin"}})).engine.router.policy == "round_robin"
    assert scenario_from_dict(scenario({})).engine.router.policy == "round_robin"
    # Two engines of eight ranks: sixteen ranks, sixteen GPUs.
    two = scenario_from_dict(scenario({"data_parallel_size": 8}, engine={"replicas": 2}))
    assert two.ranks == 16 and run_scenario(two).systems["paged"].summary["gpus"] == 16


def test_the_memory_line_speaks_of_ranks():
    line = memory_summary(scenario_from_dict(scenario({"data_parallel_size": 8,
                                                       "expert_parallel": True})))
    rank_gib = V3.weight_bytes_per_gpu(1, 8) / GIB
    assert line.startswith(f"memory: deepseek-v3 on 8 data-parallel ranks of h200-141g "
                           f"(experts whole over 8 GPUs): weights {rank_gib:.1f} GiB a GPU")
    assert "tokens a rank of 68.6 KiB a GPU" in line


def test_ranks_pay_for_their_dense_weights_and_gain_batch_room():
    # At a load that fills one TP8 engine's pool, eight ranks hold more requests at once.
    work = {"arrival": {"process": "poisson", "rate": 400},
            "prompt_len": {"dist": "constant", "value": 6000},
            "output_len": {"dist": "constant", "value": 400}}
    kwargs = {"workload": work, "stop": {"num_requests": 800},
              "systems": [{"name": "paged", "allocator": {"kind": "paged", "block_size": 64},
                           "scheduler": {"max_num_seqs": 1024,
                                         "max_num_batched_tokens": 16384,
                                         "chunked_prefill": True}}]}
    tp = run_scenario(scenario_from_dict(scenario({"tensor_parallel_size": 8}, **kwargs)))
    dp = run_scenario(scenario_from_dict(scenario({"data_parallel_size": 8,
                                                   "expert_parallel": True}, **kwargs)))
    tp_sum, dp_sum = tp.systems["paged"].summary, dp.systems["paged"].summary
    # The TP engine's batch is what its pool holds; the ranks' together, five times that.
    assert tp_sum["preemptions"] > 0 and tp_sum["peak_batch"] < 1024
    assert 8 * dp_sum["peak_batch"] > 5 * tp_sum["peak_batch"]
    assert dp_sum["throughput_tok_s"] > tp_sum["throughput_tok_s"]
    timing = build_timing(scenario_from_dict(scenario({"data_parallel_size": 8,
                                                       "expert_parallel": True})), Path())
    assert timing.source == "roofline(deepseek-v3, 8 ranks of h200-141g, expert parallel)"


def test_a_round_lasts_as_long_as_its_slowest_rank_and_reads_every_ranks_experts():
    dp = roofline(V3, H200, data_parallel_size=8, expert_parallel=True)
    # V3's FP8 experts multiply on the H200's FP8 tensor cores (1,979 TFLOP/s).
    assert dp.expert_flops_s == pytest.approx(
        2 * V3.routed_expert_params * V3.expert_share / 1979e12)
    # Eight ranks of as many tokens each: the round is the step of balanced ranks.
    assert dp.step_time(40, 9000, 0, 0, 1.0, round_tokens=8 * 40) == pytest.approx(
        dp.step_time(40, 9000, 0, 0, 1.0))
    # A prefill of 8192 tokens beside seven idle ranks: its GPU computes its experts' share
    # of those tokens (1/8 of their expert FLOPs), and reads the experts they choose.
    alone = dp.step_time(0, 0, 8192, 0, 1.0, round_tokens=8192)
    balanced = dp.step_time(0, 0, 8192, 0, 1.0)
    assert balanced - alone == pytest.approx(
        dp.expert_flops_s * 8192 * 7 / 8 + dp.fixed_s(8192) - dp.fixed_s(8192, 8192))
    assert dp.fixed_s(1, 8) == dp.fixed_s(1)


def test_ranks_step_together_at_the_pace_of_the_slowest(tmp_path):
    # A long answer on rank 0; later, a long prompt on rank 1, read in one step.
    rows = [(0.0, 100, 1000), (1.0, 6000, 2)]
    pd.DataFrame(rows, columns=["t", "prompt", "output"]).to_csv(tmp_path / "t.csv",
                                                                   index=False)
    trace = {"kind": "trace", "path": str(tmp_path / "t.csv"), "format": "csv",
             "columns": {"arrival": "t", "prompt_len": "prompt", "output_len": "output"}}
    data = scenario({"data_parallel_size": 2, "expert_parallel": True}, "deepseek-v2-lite",
                    workload=trace, engine={"router": {"policy": "round_robin"}})
    ranks = scenario_from_dict(data)
    run = run_scenario(ranks).systems["paged"]
    steps = run.steps
    assert set(steps["replica"]) == {0, 1}
    # Every step of a round, on whichever rank, lasts the round.
    assert (steps.groupby("time_s")["duration_s"].nunique() == 1).all()
    prefill = steps[steps["prefill_tokens"] == 6000]
    assert len(prefill) == 1
    beside = steps[(steps["time_s"] == prefill["time_s"].iloc[0]) & (steps["replica"] == 0)]
    assert beside["decode_seqs"].tolist() == [1]
    decodes = steps[(steps["replica"] == 0) & (steps["prefill_tokens"] == 0)]
    assert beside["duration_s"].iloc[0] > 10 * decodes["duration_s"].median()
    # A decode beside an idle rank: the idle rank pads to its one token (CUDA graphs), so
    # the experts read are those of two tokens.
    timing = build_timing(ranks, Path())
    lone = decodes[decodes["time_s"] < 1.0].iloc[-1]
    assert lone["duration_s"] == pytest.approx(timing.step_time(
        1, int(lone["context_tokens"]), 0, 0, timing.rho(64), round_tokens=2), rel=1e-12)
    # That round: the prefill's step, its GPU computing half the experts' FLOPs of the
    # round's 6001 tokens (no CUDA graph runs so many, so nothing pads).
    assert beside["duration_s"].iloc[0] == pytest.approx(timing.step_time(
        0, 0, 6000, 6000 * 6000, timing.rho(64), round_tokens=6001), rel=1e-12)
    # Rank 0 waited out the prefill, less its own step; rank 1 its two steps' share.
    waited = beside["duration_s"].iloc[0] - timing.step_time(
        1, int(beside["context_tokens"].iloc[0]), 0, 0, timing.rho(64), round_tokens=6001)
    busy = steps["duration_s"].sum()
    assert waited / busy < run.summary["rank_wait_frac"] < 2 * waited / busy
    # The answer's tokens come slower than on a rank of its own.
    solo = pd.DataFrame(rows[:1], columns=["t", "prompt", "output"])
    solo.to_csv(tmp_path / "t.csv", index=False)
    alone = run_scenario(scenario_from_dict(data)).systems["paged"]
    assert alone.summary["rank_wait_frac"] == 0.0
    assert run.requests["finished_s"].iloc[0] > alone.requests["finished_s"].iloc[0] + waited
    tp = run_scenario(scenario_from_dict(scenario({"tensor_parallel_size": 2},
                                                  "deepseek-v2-lite", workload=trace)))
    assert tp.systems["paged"].summary["rank_wait_frac"] is None


def test_prefill_and_decode_engines_of_ranks_each_step_together():
    # Two engines of four ranks: one reads the prompts, the other decodes; against both
    # colocated, the decodes no longer wait out prefill chunks.
    split = scenario({"data_parallel_size": 4, "expert_parallel": True}, "deepseek-v2-lite",
                     workload=LONG_PROMPTS, systems=CHUNKED, stop={"num_requests": 150},
                     engine={"replicas": 2, "disaggregation": {"prefill_replicas": 1}})
    ranks = scenario_from_dict(split)
    assert ranks.ranks == 8 and ranks.prefill_ranks == 4
    run = run_scenario(ranks).systems["paged"]
    summary, requests, steps = run.summary, run.requests, run.steps
    assert summary["prefill_replicas"] == 4 and summary["gpus"] == 8
    assert not requests["rejected"].any()
    assert set(requests["replica"]) == set(range(4))  # routed among the prefill ranks
    assert set(requests["decode_replica"]) == set(range(4, 8))
    # Each engine's ranks step in rounds of their own: a round's steps last alike.
    for engine in (steps["replica"] < 4, steps["replica"] >= 4):
        assert (steps[engine].groupby("time_s")["duration_s"].nunique() == 1).all()
    assert steps[steps["replica"] >= 4]["prefill_tokens"].max() <= 8  # first tokens' KV
    colocated = dict(split, engine={"replicas": 2})
    together = run_scenario(scenario_from_dict(colocated)).systems["paged"].summary
    assert summary["tpot_p50_s"] < 0.9 * together["tpot_p50_s"]
    assert summary["rank_wait_frac"] < together["rank_wait_frac"]


def test_a_prefill_rank_short_of_memory_sits_rounds_out_until_its_kv_is_sent(tmp_path):
    # Prefill ranks 0 and 1 (round robin), pools of 24 blocks of 64 and a slow link: rank 0
    # holds prompt 0's KV (16 blocks) until it is sent, so prompt 2 waits; rank 1 reads its
    # short prompts meanwhile.
    rows = [(0.0, 1000, 5), (0.02, 100, 5), (0.04, 1000, 5), (0.06, 100, 5)]
    pd.DataFrame(rows, columns=["t", "prompt", "output"]).to_csv(tmp_path / "t.csv",
                                                                   index=False)
    data = scenario({"data_parallel_size": 2, "expert_parallel": True}, "deepseek-v2-lite",
                    workload={"kind": "trace", "path": str(tmp_path / "t.csv"),
                              "format": "csv", "columns": {"arrival": "t",
                                                           "prompt_len": "prompt",
                                                           "output_len": "output"}},
                    memory={"kv_memory_gib": 0.045},
                    systems=[{"name": "paged",
                              "allocator": {"kind": "paged", "block_size": 64,
                                            "watermark": 0}}],
                    engine={"replicas": 2, "router": {"policy": "round_robin"},
                            "debug_invariants": True,
                            "disaggregation": {"prefill_replicas": 1,
                                               "kv_transfer_gbps": 0.1,
                                               "kv_transfer_latency_s": 0.0}})
    ranks = scenario_from_dict(data)
    assert scenario_pool_slots(ranks) // 64 == 24
    run = run_scenario(ranks).systems["paged"]
    first, short, second, later = run.requests.itertuples()
    assert run.summary["completed"] == 4
    assert [first.replica, short.replica, second.replica, later.replica] == [0, 1, 0, 1]
    sent_s = first.first_token_s + 1000 * lookup_model("deepseek-v2-lite").kv_bytes_per_token \
        / 0.1e9
    assert second.admitted_s == pytest.approx(sent_s)
    # Rank 1 read its second prompt while rank 0 waited with nothing it could run.
    assert later.first_token_s < second.admitted_s
    prefill = run.steps[run.steps["replica"] < 2]
    assert prefill[prefill["time_s"] == later.admitted_s]["replica"].tolist() == [1]


def test_the_busiest_gpus_experts_set_the_pace():
    even = roofline(V3, H200, data_parallel_size=8, expert_parallel=True)
    assert roofline(V3, H200, data_parallel_size=8, expert_parallel=True,
                    expert_load_imbalance=1.0) == even
    hot = roofline(V3, H200, data_parallel_size=8, expert_parallel=True,
                   expert_load_imbalance=1.5)
    assert hot.source.endswith("expert parallel, expert load 1.5× the mean)")
    # Its experts compute half as much again, receive half as many tokens again, and are
    # chosen half as often again; the dense part is the same.
    assert hot.expert_flops_s == pytest.approx(1.5 * even.expert_flops_s)
    link = H200.interconnect_bytes_per_s
    sent = 2 * 58 * 8 * 7 / 8 * V3.hidden_size * 2 / link
    assert hot.b - even.b == pytest.approx(even.expert_flops_s / 2 + sent / 2)
    assert hot.d == hot.b and hot.a == even.a and hot.c == even.c
    assert hot.expert_share == pytest.approx(1.5 * V3.expert_share)
    assert hot.fixed_s(1) > even.fixed_s(1)
    # In a round, its share of the round's tokens' expert FLOPs is 1.5 / 8 of them.
    assert hot.step_time(0, 0, 8192, 0, 1.0, round_tokens=8192) - hot.step_time(
        0, 0, 8192, 0, 1.0) == pytest.approx(
        hot.expert_flops_s * (8192 / 8 - 8192) + hot.fixed_s(8192, 8192) - hot.fixed_s(8192))
    # Experts split evenly over the GPUs (no expert parallelism) have no busiest GPU.
    assert roofline(V3, H200, data_parallel_size=8, expert_load_imbalance=1.5) == roofline(
        V3, H200, data_parallel_size=8)


def test_an_expert_load_beyond_reason_is_refused_and_an_idle_one_noted():
    with pytest.raises(ScenarioError, match=r"parallel: expert_load_imbalance 9: the busiest "
                       r"GPU holds at most all the routed tokens, 8 times the mean over 8 GPUs"):
        scenario_from_dict(scenario({"data_parallel_size": 8, "expert_parallel": True,
                                     "expert_load_imbalance": 9}))
    with pytest.raises(ScenarioError, match=r"expert_load_imbalance: Input should be greater "
                       r"than or equal to 1"):
        scenario_from_dict(scenario({"data_parallel_size": 8, "expert_load_imbalance": 0.5}))
    notes = scenario_from_dict(scenario({"data_parallel_size": 8,
                                         "expert_load_imbalance": 1.3})).setting_notes()
    assert any("parallel.expert_load_imbalance changes nothing here" in n for n in notes)
    # In a run, an uneven load slows every rank's steps.
    runs = [run_scenario(scenario_from_dict(scenario(
        {"data_parallel_size": 8, "expert_parallel": True, "expert_load_imbalance": load})))
        .systems["paged"].summary for load in (1.0, 2.0)]
    assert runs[1]["tpot_p50_s"] > runs[0]["tpot_p50_s"]


def test_a_tensor_parallel_prefill_engine_beside_decode_ranks():
    # A prefill engine of tensor parallelism 2 reads prompts on two GPUs; a decode engine of
    # two ranks holds twice the requests. Requests go to the one prefill engine; the
    # decode ranks step together.
    split = {"prefill_replicas": 1, "prefill_parallel": {"tensor_parallel_size": 2}}
    data = scenario({"data_parallel_size": 2, "expert_parallel": True}, "deepseek-v2-lite",
                    workload=LONG_PROMPTS, systems=CHUNKED, stop={"num_requests": 100},
                    engine={"replicas": 2, "disaggregation": split})
    parsed = scenario_from_dict(data)
    assert (parsed.ranks, parsed.prefill_ranks, parsed.gpus) == (3, 1, 4)
    assert parsed.engine.router.policy == "round_robin"  # one prefill engine to route to
    run = run_scenario(parsed).systems["paged"]
    requests, steps = run.requests, run.steps
    assert not requests["rejected"].any() and set(requests["replica"]) == {0}
    assert set(requests["decode_replica"]) == {1, 2}
    decoding = steps[steps["replica"] >= 1]
    assert (decoding.groupby("time_s")["duration_s"].nunique() == 1).all()
    assert run.summary["gpus"] == 4 and run.summary["rank_wait_frac"] is not None
    memory = sum(run.summary[f"{c}_frac"] for c in ("token", "reserved", "internal",
                                                     "external", "cached", "free"))
    assert memory == pytest.approx(1.0)
    # Prefill ranks are balanced as vLLM balances them; decode ranks do not route.
    ranked = dict(split, prefill_parallel={"data_parallel_size": 2, "expert_parallel": True})
    flipped = scenario({"tensor_parallel_size": 2}, "deepseek-v2-lite",
                       engine={"replicas": 2, "disaggregation": ranked})
    assert scenario_from_dict(flipped).engine.router.policy == "vllm_dp"
