"""A request's n samples as vLLM v1 runs them (``scheduler.parallel_sampling: fan_out``):
requests of their own that share the prompt through the prefix cache, gathered back into
their request's row; against forks that share its blocks (``fork``, the default)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim.engine import read_workload_files, run_scenario, scenario_trace
from sim.results import run_notes
from sim.scenario import ScenarioError, scenario_from_dict
from workloads import Trace, TraceError, WorkloadError


def rollouts(**workload: object) -> dict:
    """Eight samples a prompt, more than 4 GiB of Llama-2-7B's KV holds at this rate."""
    return {"name": "rollouts", "model": "llama-2-7b", "memory": {"kv_memory_gib": 4},
            "workload": {"arrival": {"process": "poisson", "rate": 2},
                         "prompt_len": {"dist": "lognormal", "mean": 300, "sigma": 0.5,
                                        "max": 1200},
                         "output_len": {"dist": "uniform", "low": 20, "high": 400},
                         "sampling": {"n": 8}, **workload},
            "systems": [{"name": "fork", "allocator": {"kind": "paged"}},
                        {"name": "fan_out", "allocator": {"kind": "paged"},
                         "scheduler": {"parallel_sampling": "fan_out"}}],
            "stop": {"num_requests": 60}, "seed": 4}


def test_a_trace_fans_out_into_one_request_a_sample():
    trace = Trace.from_columns(
        arrival_s=np.array([0.0, 1.0, 2.0]), prompt_len=np.array([10, 20, 5 + 20 + 4]),
        output_len=np.array([3, 4, 5]), n=np.array([1, 3, 2]), priority=np.array([0, 2, 1]))
    samples, request_of = trace.fan_out()
    assert request_of.tolist() == [0, 1, 1, 1, 2, 2]
    assert samples.n.tolist() == [1] * 6
    assert samples.arrival_s.tolist() == [0.0, 1.0, 1.0, 1.0, 2.0, 2.0]
    assert samples.priority.tolist() == [0, 2, 2, 2, 1, 1]
    # The samples of a request read the same prompt, and each writes its own answer.
    assert samples.prompt_segments(1) == samples.prompt_segments(3) == trace.prompt_segments(1)
    assert samples.prompt_segments(4) == trace.prompt_segments(2)
    assert samples.total_tokens() == trace.total_tokens() + 2 * 20 + 1 * 29
    # A request that continues one of one sample continues that sample.
    chat = Trace.from_columns(
        arrival_s=np.zeros(3), prompt_len=np.array([10, 10, 10 + 3 + 4]),
        output_len=np.array([3, 2, 2]), n=np.array([1, 2, 2]),
        context_parent=np.array([-1, -1, 0]),
        seg_offsets=np.array([0, 1, 2, 3]), seg_ids=np.array([7, 8, 9]),
        seg_lens=np.array([10, 10, 4]))
    samples, request_of = chat.fan_out()
    assert samples.context_parent.tolist() == [-1, -1, -1, 0, 0]
    assert samples.prompt_segments(4) == chat.prompt_segments(2)
    # One that continues one of several samples cannot say which.
    with pytest.raises(TraceError, match=r"request 2: context_parent names request 1, of 2 "
                                         r"samples: which one it follows is unknown"):
        Trace.from_columns(
            arrival_s=np.zeros(3), prompt_len=np.array([10, 10, 10 + 2 + 4]),
            output_len=np.array([3, 2, 2]), n=np.array([1, 2, 1]),
            context_parent=np.array([-1, -1, 1]), seg_offsets=np.array([0, 1, 2, 3]),
            seg_ids=np.array([7, 8, 9]), seg_lens=np.array([10, 10, 4])).fan_out()


def replayed(tmp_path: Path, rows: str, n: int, scheduler: dict | None = None,
             kv_memory_gib: float = 1, **workload: object) -> dict:
    """Llama-2-7B in ``kv_memory_gib`` replaying ``rows`` ("arrival,prompt,output" lines)
    of ``n`` samples each, written to a table in ``tmp_path``, on one system ``fan_out``
    with ``scheduler``'s settings besides."""
    (tmp_path / "t.csv").write_text("t,p,o\n" + rows)
    return {"name": "replayed", "model": "llama-2-7b", "memory": {"kv_memory_gib": kv_memory_gib},
            "workload": {"kind": "trace", "path": "t.csv", "format": "csv",
                         "columns": {"arrival": "t", "prompt_len": "p", "output_len": "o"},
                         "sampling": {"n": n}, **workload},
            "systems": [{"name": "fan_out", "allocator": {"kind": "paged"},
                         "scheduler": {"parallel_sampling": "fan_out", **(scheduler or {})}}],
            "stop": {"num_requests": rows.count("\n")}}


def test_fanned_out_samples_share_the_prompt_through_the_prefix_cache(tmp_path):
    # One request of four samples, a 100-token prompt: six full blocks and a partial one.
    data = replayed(tmp_path, "0,100,10\n", n=4)
    data["systems"] = [{"name": "fork", "allocator": {"kind": "paged"}}, *data["systems"],
                       {"name": "fan_out-nocache",
                        "allocator": {"kind": "paged", "prefix_caching": False},
                        "scheduler": {"parallel_sampling": "fan_out"}}]
    data["engine"] = {"mode": "step", "debug_invariants": True}
    runs = run_scenario(scenario_from_dict(data), base_dir=tmp_path).systems
    rows = {name: run.requests.iloc[0] for name, run in runs.items()}
    # Forks share the prompt's blocks; three of the four samples find its 96 tokens of full
    # blocks cached (the first sample put them there as it was seated); without a cache
    # each reads the whole prompt.
    assert rows["fork"]["prefix_hit_tokens"] == 0
    assert rows["fan_out"]["prefix_hit_tokens"] == 3 * 96
    assert rows["fan_out-nocache"]["prefix_hit_tokens"] == 0
    for row in rows.values():
        assert row["n"] == 4 and row["finished_s"] > row["first_token_s"] > 0
    steps = {name: run.steps for name, run in runs.items()}
    assert steps["fork"]["prefill_tokens"].sum() == 100
    assert steps["fan_out"]["prefill_tokens"].sum() == 100 + 3 * 4
    assert steps["fan_out-nocache"]["prefill_tokens"].sum() == 4 * 100
    # Every sample generates its own ten tokens.
    assert all(run.summary["throughput_tok_s"] * run.summary["makespan_s"]
               == pytest.approx(40) for run in runs.values())


def test_a_requests_row_gathers_its_samples_rows(tmp_path):
    # The samples, written out as a trace of their own and replayed one request each,
    # run exactly as the fanned-out system runs them: gathered, their rows are its rows.
    data = rollouts()
    scenario = scenario_from_dict(data)
    samples, request_of = scenario_trace(scenario, tmp_path).fan_out()
    samples.to_frame().to_csv(tmp_path / "samples.csv", index=False)
    replay = rollouts()
    replay["workload"] = {"kind": "trace", "path": "samples.csv", "format": "kvsim"}
    replay["systems"] = [{"name": "one_each", "allocator": {"kind": "paged"}}]
    replay["stop"] = {"num_requests": len(samples)}
    one_each = run_scenario(scenario_from_dict(replay), base_dir=tmp_path)
    fanned = run_scenario(scenario).systems["fan_out"].requests
    rows = one_each.systems["one_each"].requests.assign(request=lambda r: request_of[r.request])
    groups = rows.groupby("request")
    assert fanned["request"].tolist() == list(range(60))
    assert fanned["n"].eq(8).all()
    assert fanned["admitted_s"].tolist() == groups["admitted_s"].min().tolist()
    assert fanned["first_token_s"].tolist() == groups["first_token_s"].min().tolist()
    assert fanned["finished_s"].tolist() == groups["finished_s"].max().tolist()
    for column in ("preemptions", "prefix_hit_tokens", "recomputed_tokens",
                   "allocated_at_finish"):
        assert fanned[column].tolist() == groups[column].sum().tolist(), column
    assert fanned["max_itl_s"].tolist() == groups["max_itl_s"].max().tolist()
    assert fanned["preemptions"].sum() > 0  # (memory is short: samples were preempted)
    assert list(fanned.columns) == list(one_each.systems["one_each"].requests.columns)
    assert fanned.dtypes.equals(one_each.systems["one_each"].requests.dtypes)


def test_fanned_out_samples_outrun_forks_that_restart_together():
    data = rollouts()
    data["stop"]["num_requests"] = 150  # past what 4 GiB sustains
    runs = run_scenario(scenario_from_dict(data)).systems
    fork, fan_out = runs["fork"].summary, runs["fan_out"].summary
    assert fork["completed"] == fan_out["completed"] == 150
    # A preempted fork group starts over, all its samples, their answers thrown away and
    # generated again step by step; a sample alone loses its own, and reads it again with
    # its prompt (135,865 tokens recomputed against 268,574 of prompts and 203,008 of
    # answers thrown away; 2,483 tok/s against 1,684).
    assert fan_out["recomputed_tokens"] < 0.6 * fork["recomputed_tokens"]
    assert fork["discarded_output_tokens"] > 0.5 * fork["recomputed_tokens"]
    assert fan_out["discarded_output_tokens"] is None
    # The run says so, and what keeps the answers instead.
    thrown = [note for note in run_notes({"fork": fork, "fan_out": fan_out})
              if "started over" in note]
    assert thrown == [
        "preempted groups of forked samples started over, their answers thrown away and "
        f"generated again (output tokens): fork {fork['discarded_output_tokens']:,}; "
        "scheduler.preemption_mode: swap_groups swaps a group whole instead (vLLM v0's "
        "default), and parallel_sampling: fan_out preempts samples alone (vLLM v1)"]
    assert fan_out["throughput_tok_s"] > 1.3 * fork["throughput_tok_s"]
    assert fan_out["ttft_p50_s"] < fork["ttft_p50_s"]
    # Seven samples of eight find the prompt's full blocks cached by the first.
    assert fan_out["prefix_hit_rate"] > 0.8 > fork["prefix_hit_rate"]


def test_samples_past_the_simulated_requests_are_refused_before_they_are_drawn():
    # A trillion samples of 21 requests would take 153 TiB to lay out; refused in one line.
    data = rollouts(sampling={"n": 10**12})
    data["systems"] = data["systems"][1:]
    data["stop"]["num_requests"] = 21
    with pytest.raises(WorkloadError, match=r"^systems\[fan_out\]\.scheduler\.parallel_sampling: "
                       r"fan_out: 21 requests of up to 1,000,000,000,000 samples make "
                       r"21,000,000,000,000 requests of their own, past the 50,000,000 "
                       "simulated"):
        run_scenario(scenario_from_dict(data))


def test_one_sample_a_request_runs_alike_either_way():
    data = rollouts(sampling={"n": 1})
    runs = run_scenario(scenario_from_dict(data)).systems
    pd.testing.assert_frame_equal(runs["fork"].requests, runs["fan_out"].requests)


def fanned_out_both_ways(data: dict, base_dir: Path = Path()) -> dict:
    """The fan_out system of ``data`` (its files in ``base_dir``) run stepping (its
    invariants checked) and jumping, by mode; the two request tables are the same."""
    runs = {}
    for mode in ("step", "jump"):
        data["engine"] = {**data.get("engine", {}), "mode": mode,
                          "debug_invariants": mode == "step"}
        runs[mode] = run_scenario(scenario_from_dict(data), base_dir).systems["fan_out"]
    pd.testing.assert_frame_equal(runs["jump"].requests, runs["step"].requests)
    return runs


@pytest.mark.parametrize("seed", range(3))
def test_jump_equals_step_with_samples_fanned_out(seed):
    data = rollouts()
    data["seed"] = seed
    data["systems"] = data["systems"][1:]
    fanned_out_both_ways(data)


def test_samples_fanned_out_cross_a_prefill_decode_split():
    data = rollouts()
    data["systems"] = data["systems"][1:]
    data["engine"] = {"replicas": 2, "disaggregation": {"prefill_replicas": 1}}
    run = run_scenario(scenario_from_dict(data)).systems["fan_out"]
    assert run.summary["completed"] == 60
    assert (run.requests["decode_replica"] == 1).all()
    data["systems"].append({"name": "fork", "allocator": {"kind": "paged"}})
    with pytest.raises(ScenarioError, match="or samples that are requests of their own"):
        scenario_from_dict(data)


def two_requests_of_three_samples(tmp_path, engine: dict, apart_s: float = 0.0
                                  ) -> pd.DataFrame:
    """The steps of two requests of three samples, ``apart_s`` apart (prompts of 100
    tokens, their own), on the engine's replicas, fanned out."""
    data = replayed(tmp_path, f"0,100,10\n{apart_s},100,10\n", n=3)
    data["engine"] = {"mode": "step", **engine}
    run = run_scenario(scenario_from_dict(data), base_dir=tmp_path).systems["fan_out"]
    assert run.summary["completed"] == 2
    return run.steps


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "cache_aware", "kv_aware"])
def test_a_balancer_sends_each_engine_a_request_whole(policy, tmp_path):
    # A balancer in front of the engines routes a request, n samples and all: its engine
    # fans it out, and two samples of three find the prompt's full blocks cached there.
    steps = two_requests_of_three_samples(
        tmp_path, {"replicas": 2, "router": {"policy": policy}})
    seated = steps.groupby("replica")["prefill_requests"].sum()
    assert seated.to_dict() == {0: 3, 1: 3}
    assert steps.groupby("replica")["prefill_tokens"].sum().to_dict() == {
        0: 100 + 2 * 4, 1: 100 + 2 * 4}


def test_vllms_balancer_places_each_sample_on_a_rank(tmp_path):
    # vLLM's front end fans the request out first and balances each sample over its
    # data-parallel ranks: the samples of a request spread, each reading its prompt.
    steps = two_requests_of_three_samples(
        tmp_path, {"replicas": 2, "router": {"policy": "vllm_dp"}})
    seated = steps.groupby("replica")["prefill_requests"].sum()
    assert seated.to_dict() == {0: 3, 1: 3}
    assert steps["prefill_tokens"].sum() > 2 * (100 + 2 * 4)


@pytest.mark.parametrize("decode_router", ["round_robin", "least_loaded"])
def test_the_samples_of_a_request_decode_on_one_replica(decode_router, tmp_path):
    # Handed over from the prefill replica, the samples of a request go on together: one
    # request at a time, a decode replica decodes all three.
    steps = two_requests_of_three_samples(tmp_path, {"replicas": 3, "disaggregation": {
        "prefill_replicas": 1, "decode_router": decode_router}}, apart_s=5.0)
    decoding = steps[steps["replica"] > 0]
    assert decoding["decode_seqs"].max() == 3
    assert decoding.groupby("replica")["decode_seqs"].max().isin([0, 3]).all()


@pytest.mark.parametrize(("workload", "message"), [
    ({"sampling": {"beam_width": 4}}, "beam search (workload.sampling.beam_width) keeps its "
                                      "beams together"),
])
def test_what_fanned_out_samples_do_not_model_is_refused(workload, message):
    with pytest.raises(ScenarioError, match=r"system 'fan_out': scheduler.parallel_sampling: "
                                            r"fan_out.*" + message.replace("(", r"\(")
                       .replace(")", r"\)").replace(".", r"\.")):
        scenario_from_dict(rollouts(**workload))


def test_fanned_out_single_samples_run_with_what_samples_do_not_model(tmp_path):
    # One sample a request fans out to itself: a client's time-outs apply as to any
    # request, and the two systems agree.
    data = rollouts(sampling={"n": 1}, ttft_timeout_s=1.0, retry={})
    data["workload"]["arrival"]["rate"] = 20
    data["memory"]["kv_memory_gib"] = 1
    runs = run_scenario(scenario_from_dict(data)).systems
    assert runs["fork"].summary["abandoned"] > 0 and runs["fork"].summary["retries"] > 0
    pd.testing.assert_frame_equal(runs["fork"].requests, runs["fan_out"].requests)
    # A trace table's own n is told when the table is read, by validate as by run.
    data = rollouts()
    data["stop"] = {"num_requests": 6}
    scenario_trace(scenario_from_dict(data), tmp_path).to_frame().to_csv(
        tmp_path / "eight.csv", index=False)
    data["workload"] = {"kind": "trace", "path": "eight.csv", "format": "kvsim",
                        "itl_timeout_s": 5.0}
    data["engine"] = {"replicas": 2, "router": {"policy": "vllm_dp"}}
    scenario = scenario_from_dict(data)  # its n is the table's
    message = (r"^systems\[fan_out\]\.scheduler\.parallel_sampling: fan_out: request 0 of "
               r".*eight\.csv has 8 samples: not modelled with a client's wait for a next "
               r"token \(itl_timeout_s\) where vLLM's balancer places each sample")
    with pytest.raises(WorkloadError, match=message):
        read_workload_files(scenario, tmp_path)
    with pytest.raises(WorkloadError, match=message):
        run_scenario(scenario, base_dir=tmp_path)


def test_a_session_that_continues_one_of_several_samples_is_refused(tmp_path):
    data = rollouts(sessions={"turns": {"dist": "constant", "value": 2},
                              "think_time_s": 1.0})
    with pytest.raises(ScenarioError, match=r"a session's next turn \(a closed-loop user's "
                                            r"next request\) follows one request"):
        scenario_from_dict(data)
    # A trace table says so when it is read: its rows name the requests they follow.
    data["systems"] = data["systems"][:1]
    forked = scenario_from_dict(data)
    scenario_trace(forked, tmp_path).to_frame().to_csv(tmp_path / "chat.csv", index=False)
    data = rollouts()
    data["workload"] = {"kind": "trace", "path": "chat.csv", "format": "kvsim"}
    with pytest.raises(WorkloadError, match=r"^systems\[fan_out\]\.scheduler\.parallel_sampling: "
                       r"fan_out: request \d+: after names request \d+, of 8 samples: which one "
                       r"it follows is unknown"):
        run_scenario(scenario_from_dict(data), base_dir=tmp_path)


def test_more_samples_than_a_request_runs_together_are_refused_as_forks(tmp_path):
    # A request's sequences are numbered request × 256 + sample: forks stop at 256, samples
    # that are requests of their own do not.
    data = rollouts(sampling={"n": 300})
    with pytest.raises(ScenarioError, match=r"workload\.sampling\.n: at most 256 samples of "
                                            r"one request run together \(got 300, forked by "
                                            r"system 'fork'\)"):
        scenario_from_dict(data)
    with pytest.raises(ScenarioError, match=r"workload\.sampling\.beam_width: at most 256 "
                                            r"beams \(got 257\)"):
        scenario_from_dict(rollouts(sampling={"beam_width": 257}))
    data["systems"] = data["systems"][1:]
    data["stop"] = {"num_requests": 2}
    fanned = run_scenario(scenario_from_dict(data)).systems["fan_out"]
    assert fanned.requests["n"].tolist() == [300, 300]
    assert fanned.summary["completed"] == 2
    # A trace table's own: refused when a forking system runs it.
    data["stop"] = {"num_requests": 2}
    scenario_trace(scenario_from_dict(data), tmp_path).to_frame().to_csv(
        tmp_path / "many.csv", index=False)
    data["workload"] = {"kind": "trace", "path": "many.csv", "format": "kvsim"}
    data["systems"] = [{"name": "fork", "allocator": {"kind": "paged"}}]
    with pytest.raises(WorkloadError, match=r"^systems\[fork\]\.scheduler\.parallel_sampling: "
                       r"fork: request 0 of .*many\.csv has 300 samples; at most 256 run "
                       r"together"):
        run_scenario(scenario_from_dict(data), base_dir=tmp_path)


def test_a_clients_deadline_for_the_whole_answer_gives_up_all_its_samples(tmp_path):
    # Two samples of 300 tokens in 0.2 GiB: both are seated, one is preempted and finishes
    # after the other, past the 3.5 s the client waits for the whole answer. The request is
    # given up: every token generated for it was generated in vain, the finished sample's
    # too, and the ITL, of the requests served, has none.
    data = replayed(tmp_path, "0,100,300\n", n=2, kv_memory_gib=0.2, e2e_timeout_s=3.5)
    data["engine"] = {"mode": "step", "debug_invariants": True}
    result = run_scenario(scenario_from_dict(data), base_dir=tmp_path).systems["fan_out"]
    row, steps, summary = result.requests.iloc[0], result.steps, result.summary
    assert row["preemptions"] == 1 and row["abandoned_s"] == 3.5 and pd.isna(row["finished_s"])
    # One sample was done long before: it alone ran at the end.
    assert steps["decode_seqs"].iloc[-1] == 1 and steps["running"].iloc[-1] == 0
    generated = steps["decode_seqs"].sum() + steps["prefill_requests"].sum()
    assert summary["abandoned_output_tokens"] == generated > 300
    assert np.isnan(summary["itl_p50_s"])


def test_samples_given_up_together_keep_the_itl_to_the_requests_served(itl_token_counts):
    counted = itl_token_counts
    # (At 6 s some requests given up have samples that finished in time.)
    data = rollouts(e2e_timeout_s=6)
    data["systems"] = data["systems"][1:]
    runs = fanned_out_both_ways(data)
    assert counted[0] == counted[1]
    rows = runs["step"].requests
    gone, served = rows[rows["abandoned_s"].notna()], rows[rows["finished_s"].notna()]
    assert len(gone) > 5 and len(served) > 10 and len(gone) + len(served) == 60
    # Each sample's deadline is the request's.
    np.testing.assert_allclose(gone["abandoned_s"], gone["arrival_s"] + 6, rtol=0, atol=1e-9)
    assert (served["finished_s"] - served["arrival_s"] < 6).all()
    # Every token of a served request's samples after each one's first, once.
    assert counted[-1] == (served["n"] * (served["output_len"] - 1)).sum()


@pytest.mark.parametrize("timeout", ["queue_timeout_s", "ttft_timeout_s"])
def test_a_client_waits_for_a_seat_or_a_first_token_of_any_sample(timeout, tmp_path):
    # One seat: the first request's first sample is seated at once, its second only when
    # the first is done, some 2.5 s later, past the client's 1 s: the client has had a seat
    # and a first token, and waits on for the whole answer. The second request, arriving at
    # 0.5 s behind it, has neither by 1.5 s: its client gives up on both samples then.
    data = replayed(tmp_path, "0,100,300\n0.5,100,300\n", n=2, scheduler={"max_num_seqs": 1},
                    **{timeout: 1.0})
    run = fanned_out_both_ways(data, tmp_path)["step"]
    served, gone = run.requests.iloc[0], run.requests.iloc[1]
    assert served["admitted_s"] == 0 and served["first_token_s"] < 1.0
    assert served["finished_s"] > 2.0 and pd.isna(served["abandoned_s"])
    assert served["prefix_hit_tokens"] == 96  # the second sample, seated late, hit the first
    assert gone["abandoned_s"] == 1.5 and pd.isna(gone["admitted_s"])
    assert pd.isna(gone["first_token_s"]) and pd.isna(gone["finished_s"])
    assert run.summary["abandoned"] == 1 and run.summary["completed"] == 1
    assert run.steps["prefill_requests"].sum() == 2  # the samples of the first request


def test_samples_on_ranks_of_their_own_keep_to_their_own_seat_and_first_token():
    # vLLM's balancer places each sample on a data-parallel rank: a client's wait for one
    # of any of them is refused there, the engines stepping apart, as is its sending them
    # all again.
    data = rollouts(ttft_timeout_s=30)
    data["engine"] = {"replicas": 2, "router": {"policy": "vllm_dp"}}
    with pytest.raises(ScenarioError, match=r"fan_out \(workload\.sampling\.n: 8\): not "
                       r"modelled with a client's wait for a seat or a first token "
                       r"\(queue_timeout_s, ttft_timeout_s\) where vLLM's balancer places "
                       r"each sample on a data-parallel rank of its own"):
        scenario_from_dict(data)
    again = rollouts(e2e_timeout_s=30, retry={})
    again["engine"] = data["engine"]
    with pytest.raises(ScenarioError, match=r"not modelled with retries of answers given up "
                       r"\(workload\.retry with e2e_timeout_s\) where vLLM's balancer"):
        scenario_from_dict(again)
    data["engine"]["router"]["policy"] = "least_loaded"  # a request whole to one engine
    assert scenario_from_dict(data).engine.router.policy == "least_loaded"


@pytest.mark.parametrize("engine_config", [{}, {"replicas": 2},
                                           {"replicas": 3, "router": {"policy": "least_loaded"}}])
def test_a_client_sends_all_its_samples_again_together(engine_config, sample_rows):
    # A client who gave up on a seat sends the request again, every sample at once (one
    # back-off of the client's), to one replica (the next in turn, or where the balancer
    # sends the request): each sample's rows, before they are gathered, say so.
    rows = sample_rows
    data = rollouts(queue_timeout_s=1.5, retry={"max_retries": 3})
    data["workload"]["arrival"]["rate"] = 4 * max(1, engine_config.get("replicas", 1))
    data["systems"] = data["systems"][1:]
    runs = {}
    for mode in ("step", "jump"):
        data["engine"] = {"mode": mode, **engine_config}
        runs[mode] = run_scenario(scenario_from_dict(data)).systems["fan_out"]
    pd.testing.assert_frame_equal(runs["jump"].requests, runs["step"].requests)
    samples = rows[0].groupby("of")
    assert runs["step"].summary["retries"] >= 5
    for column in ("attempts", "abandoned_s", "replica"):
        assert samples[column].nunique(dropna=False).eq(1).all(), column
    assert samples["admitted_s"].count().isin([0, 8]).all()  # all seated in the end, or none


@pytest.mark.parametrize("policy", ["round_robin", "vllm_dp"])
def test_a_full_line_turns_a_request_away_whole(policy, tmp_path):
    # A line of one: the first request's first sample finds it empty, and its samples
    # follow it in (past the bound: the line turns requests away, not samples); the second
    # request finds two waiting, and is turned away whole. (With one engine to send them
    # to, vLLM's balancer keeps the samples together too.)
    data = replayed(tmp_path, "0,100,50\n0.1,100,50\n", n=3,
                    scheduler={"max_num_seqs": 1, "max_queued_requests": 1})
    data["engine"] = {"router": {"policy": policy}}
    run = fanned_out_both_ways(data, tmp_path)["step"]
    served, shed = run.requests.iloc[0], run.requests.iloc[1]
    assert not served["shed"] and served["finished_s"] > 0
    assert shed["shed"] and pd.isna(shed["admitted_s"])
    assert run.summary["shed"] == 1 and run.summary["completed"] == 1
    assert run.steps["prefill_requests"].sum() == 3  # the first request's samples alone
    # A client who tries again at once: its first sample's next try arrives before the
    # second sample's first; each follows the first sample of its own try, away again.
    data["workload"]["retry"] = {"max_retries": 2, "backoff_s": 0.0}
    run = fanned_out_both_ways(data, tmp_path)["step"]
    shed = run.requests.iloc[1]
    assert shed["shed"] and shed["attempts"] == 3 and pd.isna(shed["admitted_s"])
    assert run.summary["retries"] == 2
    assert run.steps["prefill_requests"].sum() == 3
    # Where vLLM's balancer spreads the samples over ranks, refused.
    data["engine"] = {"replicas": 2, "router": {"policy": "vllm_dp"}}
    with pytest.raises(ScenarioError, match=r"not modelled with a bounded line "
                                            r"\(scheduler\.max_queued_requests\) where vLLM's "
                                            r"balancer places each sample"):
        scenario_from_dict(data)


@pytest.mark.parametrize("seed", range(6))
def test_random_clients_keep_the_samples_of_a_request_together(seed, sample_rows):
    # Random scenarios of requests of 2 to 5 samples kept together by a balancer in front
    # of the engines, with clients who wait for a seat, a first token, a next token or the
    # whole answer of any of them and try again, and lines that may turn requests away,
    # more than 2 GiB serve: jumping equals stepping, and the samples of each request share
    # their tries, their replica, and their fate (those not done, when they were given up).
    rng = random.Random(seed)
    allocator = rng.choice([{"kind": "paged", "block_size": rng.choice([4, 16])},
                            {"kind": "contiguous", "reserve_policy": "request_max"}])
    data = {"name": f"random-{seed}", "model": "llama-2-7b", "memory": {"kv_memory_gib": 2},
            "workload": {"arrival": {"process": "poisson", "rate": 80},
                         "prompt_len": {"dist": "lognormal", "mean": 200, "sigma": 1,
                                        "max": 1000},
                         "output_len": {"dist": "uniform", "low": 10, "high": 200},
                         "sampling": {"n": rng.randint(2, 5)},
                         rng.choice(["queue_timeout_s", "ttft_timeout_s"]):
                             rng.choice([0.05, 0.3]),
                         "retry": {"max_retries": 2, "backoff_s": rng.choice([0.0, 0.05])}},
            "systems": [{"name": "s", "allocator": allocator, "scheduler": {
                "parallel_sampling": "fan_out", "chunked_prefill": rng.random() < 0.5,
                "max_queued_requests": rng.choice([2, 8, 64])}}],
            "engine": {"replicas": rng.choice([1, 2, 3]), "router": {"policy": rng.choice(
                ["round_robin", "least_loaded", "cache_aware", "kv_aware"])}},
            "stop": {"num_requests": 80}, "seed": seed}
    for timeout, patience_s in (("itl_timeout_s", 0.05), ("e2e_timeout_s", 2.0)):
        if rng.random() < 0.5:
            data["workload"][timeout] = patience_s
    tables = {}
    for mode in ("step", "jump"):
        data["engine"].update(mode=mode, debug_invariants=mode == "step")
        tables[mode] = run_scenario(scenario_from_dict(data)).systems["s"].requests
    pd.testing.assert_frame_equal(tables["jump"], tables["step"])
    rows = sample_rows[0]
    samples = rows.groupby("of")
    for column in ("attempts", "shed", "replica"):
        assert samples[column].nunique(dropna=False).eq(1).all(), column
    undone = rows[rows["finished_s"].isna()].groupby("of")
    assert undone["abandoned_s"].nunique(dropna=False).eq(1).all()
    done = tables["step"]
    assert (done["finished_s"].notna() | done["shed"] | done["abandoned_s"].notna()).all()
    assert done["attempts"].max() > 1 and done["finished_s"].notna().any()


def test_a_client_who_gives_up_on_a_whole_answer_sends_every_sample_again(
        itl_token_counts, sample_rows):
    # 6 s for the whole answer, then again after a back-off, twice at most: each time the
    # client gives up, it sends every sample again, those done in time too, their tokens
    # in vain with the others'. Every token generated is the answer of a request served or
    # in vain, and the ITL counts those of the requests served alone.
    data = rollouts(e2e_timeout_s=6, retry={"max_retries": 2, "backoff_s": 0.5})
    data["systems"] = data["systems"][1:]
    run = fanned_out_both_ways(data)["step"]
    rows, steps, summary = run.requests, run.steps, run.summary
    samples = sample_rows[0].groupby("of")
    assert samples["attempts"].nunique().eq(1).all()
    assert summary["retries"] > 10 and (rows["attempts"] == 3).any()
    served = rows[rows["finished_s"].notna()]
    assert len(served) + summary["abandoned"] == 60 and summary["abandoned"] > 5
    answered = (served["n"] * served["output_len"]).sum()
    generated = steps["decode_seqs"].sum() + steps["prefill_requests"].sum()
    assert answered + summary["abandoned_output_tokens"] == generated
    assert itl_token_counts[0] == itl_token_counts[1] == (
        served["n"] * (served["output_len"] - 1)).sum()
    # Served in the end, some within 6 s of a try that was not their first.
    retried = served[served["attempts"] > 1]
    assert len(retried) > 3 and (retried["finished_s"] - retried["arrival_s"] > 6).all()


def test_a_client_waits_for_a_next_token_of_any_sample(tmp_path):
    # Two samples of 300 tokens in 0.2 GiB, a client who waits a second at most for a next
    # token: one sample, preempted, waits 1.2 s for a seat while the other decodes. Its own
    # tokens stop (its longest gap, as each sample's, is past the second), but the request's
    # stream flows: the client waits on, and has the whole answer.
    data = replayed(tmp_path, "0,100,300\n", n=2, kv_memory_gib=0.2, itl_timeout_s=1.0)
    row = fanned_out_both_ways(data, tmp_path)["step"].requests.iloc[0]
    assert row["preemptions"] == 1 and row["max_itl_s"] > 1.0
    assert row["finished_s"] > 3 and pd.isna(row["abandoned_s"])
    # One seat, a prompt of 4,000 tokens read again by the second sample (no prefix cache)
    # after the first is done, in a 0.19 s step: nothing comes for 0.1 s after the first
    # one's last token, and the client gives up on the request then, the first sample's
    # tokens in vain and the second's prompt read for nothing.
    data = replayed(tmp_path, "0,4000,50\n", n=2, scheduler={"max_num_seqs": 1},
                    kv_memory_gib=4, itl_timeout_s=0.1)
    data["systems"][0]["allocator"]["prefix_caching"] = False
    run = fanned_out_both_ways(data, tmp_path)["step"]
    row, steps = run.requests.iloc[0], run.steps
    first_done_s = steps["time_s"].iloc[-1]  # the second sample's prompt starts then
    assert steps["prefill_tokens"].iloc[-1] == 4000 and steps["duration_s"].iloc[-1] > 0.1
    assert row["abandoned_s"] == pytest.approx(first_done_s + 0.1, abs=1e-12)
    assert pd.isna(row["finished_s"]) and run.summary["abandoned"] == 1
    assert run.summary["abandoned_output_tokens"] >= 50


@pytest.mark.parametrize(("change", "where"), [
    ({"engine": {"replicas": 2, "router": {"policy": "vllm_dp"}}},
     "where vLLM's balancer places each sample on a data-parallel rank of its own"),
    ({"engine": {"replicas": 2, "disaggregation": {"prefill_replicas": 1}}},
     "across a prefill/decode split"),
    ({"parallel": {"pipeline_parallel_size": 2}}, "with pipeline stages"),
])
def test_a_wait_for_a_next_token_of_samples_on_engines_apart_is_refused(change, where):
    data = {**rollouts(itl_timeout_s=30), **change}
    data["systems"] = data["systems"][1:]
    with pytest.raises(ScenarioError, match=r"not modelled with a client's wait for a next "
                       r"token \(itl_timeout_s\) " + re.escape(where)):
        scenario_from_dict(data)


@pytest.mark.parametrize("router", [{"policy": "least_loaded"},
                                    {"policy": "cache_aware", "balance_abs_threshold": 0}])
def test_a_balancer_counts_a_request_once_whatever_its_samples(router, tmp_path):
    # A balancer in front of the engines counts the requests it sent (SGLang's router, its
    # running requests by worker): four samples of one request load their engine as one
    # request does. The third request goes to the first engine as to the second, 1 against
    # 1, and to the first of equals, not away from four.
    (tmp_path / "t.csv").write_text("arrival_s,prompt_len,output_len,n\n"
                                    "0,100,200,4\n0.001,100,200,1\n0.002,100,200,1\n")
    data = {"name": "loads", "model": "llama-2-7b", "memory": {"kv_memory_gib": 2},
            "workload": {"kind": "trace", "path": "t.csv", "format": "kvsim"},
            "engine": {"replicas": 2, "router": router},
            "systems": [{"name": "fan_out", "allocator": {"kind": "paged"},
                         "scheduler": {"parallel_sampling": "fan_out"}}],
            "stop": {"num_requests": 3}}
    rows = fanned_out_both_ways(data, tmp_path)["step"].requests
    assert rows["replica"].tolist() == [0, 1, 0]
    assert rows["finished_s"].notna().all()
