"""Clients who wait for the whole answer and give up on it (``workload.e2e_timeout_s``):
wherever the request is when the deadline passes — waiting, reading its prompt, decoding,
or back in the line after a preemption — it is abandoned at exactly that moment; a seated
one is aborted at the step boundary after, its KV freed, and the tokens generated for it
are counted as generated in vain. A last token that comes as the client gives up comes too
late."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from conftest import kvsim_in_process as kvsim

from sim.engine import run_scenario
from sim.metrics import format_summary
from sim.results import RunResult, run_notes
from sim.scenario import scenario_from_dict

# One request of a 100-token prompt and a 400-token answer, about 8 ms a decode step on
# Llama-2-7B (A100): some 3.1 s to answer whole, 2 s given.
LONG_ANSWER = {
    "name": "long-answer", "model": "llama-2-7b", "memory": {"kv_memory_gib": 8},
    "workload": {"arrival": {"process": "constant", "rate": 1},
                 "prompt_len": {"dist": "constant", "value": 100},
                 "output_len": {"dist": "constant", "value": 400},
                 "e2e_timeout_s": 2.0},
    "systems": [{"name": "s", "allocator": {"kind": "paged"}}],
    "stop": {"num_requests": 1},
    "engine": {"debug_invariants": True},
}


def run(data: dict, mode: str = "jump") -> RunResult:
    return run_scenario(scenario_from_dict(
        {**data, "engine": {**data.get("engine", {}), "mode": mode}})).systems["s"]


def with_workload(**fields: object) -> dict:
    return {**LONG_ANSWER, "workload": {**LONG_ANSWER["workload"], **fields}}


def both_modes(data: dict) -> RunResult:
    """``data`` run by jumps, its requests checked equal to those run step by step."""
    runs = {mode: run(data, mode) for mode in ("jump", "step")}
    pd.testing.assert_frame_equal(runs["jump"].requests, runs["step"].requests)
    assert runs["jump"].summary["abandoned_output_tokens"] == (
        runs["step"].summary["abandoned_output_tokens"])
    return runs["jump"]


@pytest.mark.parametrize("mode", ["jump", "step"])
def test_a_request_still_decoding_at_the_deadline_is_aborted_then(mode):
    result = run(LONG_ANSWER, mode)
    request = result.requests.iloc[0]
    # Seated at once, given its first token, then aborted by the first step that ends at
    # or after 2 s: recorded at the deadline, never finished.
    assert request["admitted_s"] == 0.0 and request["first_token_s"] > 0
    assert request["abandoned_s"] == 2.0 and math.isnan(request["finished_s"])
    steps = result.steps
    ends = (steps["time_s"] + steps["duration_s"]).to_numpy()
    assert ends[-1] >= 2.0 > ends[-2]  # (a run of decode steps, by jumps, ends there too)
    assert steps["running"].iloc[-1] == 0  # its seat is free at that boundary
    # Its tokens: the first (its prompt's step) and one a decode step until then.
    decode_steps = int(steps["steps"].sum()) - 1
    summary = result.summary
    assert summary["abandoned_output_tokens"] == 1 + decode_steps
    assert 0 < summary["abandoned_output_tokens"] < 400
    assert (summary["completed"], summary["abandoned"], summary["abandoned_seated"]) == (
        0, 1, 1)


def test_an_answer_in_time_is_served_and_a_last_token_at_the_deadline_is_too_late():
    untimed = run(with_workload(e2e_timeout_s=None)).requests.iloc[0]
    answered_s = untimed["finished_s"]
    served = run(with_workload(e2e_timeout_s=answered_s * 1.001)).requests.iloc[0]
    assert served["finished_s"] == answered_s and math.isnan(served["abandoned_s"])
    for mode in ("jump", "step"):
        late = run(with_workload(e2e_timeout_s=answered_s), mode)
        request = late.requests.iloc[0]
        assert request["abandoned_s"] == answered_s and math.isnan(request["finished_s"])
        # Every token was generated, and none delivered.
        assert late.summary["abandoned_output_tokens"] == 400


def test_a_request_never_seated_is_given_up_at_its_deadline():
    # One seat, held by the first of four requests 0.5 ms apart until it is aborted at the
    # first step boundary past 2 s: the others' clients gave up before it, 2 s after each
    # arrived, in the line.
    data = with_workload(arrival={"process": "constant", "rate": 2000})
    data["systems"] = [{"name": "s", "allocator": {"kind": "paged"},
                        "scheduler": {"max_num_seqs": 1}}]
    data["stop"] = {"num_requests": 4}
    result = both_modes(data)
    requests = result.requests
    assert (requests["abandoned_s"] == requests["arrival_s"] + 2.0).all()
    steps = result.steps
    boundary = (steps["time_s"] + steps["duration_s"]).iloc[-1]
    assert boundary > requests["abandoned_s"].max()  # the seat came free too late
    assert requests["admitted_s"].notna().tolist() == [True, False, False, False]


def test_the_sooner_deadline_counts_whichever_time_out_it_is():
    # A first token within 5 ms (not given: its prompt takes 12 ms) comes before the
    # answer's 2 s; a first token within 1 s (given) leaves the answer's deadline.
    request = run(with_workload(ttft_timeout_s=0.005)).requests.iloc[0]
    assert request["abandoned_s"] == 0.005 and math.isnan(request["first_token_s"])
    request = run(with_workload(ttft_timeout_s=1.0)).requests.iloc[0]
    assert request["abandoned_s"] == 2.0 and request["first_token_s"] > 0


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_request_preempted_mid_answer_times_out_in_the_line(tmp_path, preemption_mode):
    # A pool for two answers, a line by priority: the first request (priority 1) is
    # preempted mid-answer by the stream of priority-0 ones, which keep going ahead of it
    # (under swap, its KV parked in host memory). Its client gives up while it waits; the
    # swap space it held is given back (the step run's debug invariants check it each step).
    rows = ["t,p,o,prio", "0,200,300,1"] + [f"{0.05 + 0.4 * k:.2f},200,300,0"
                                             for k in range(12)]
    (tmp_path / "trace.csv").write_text("\n".join(rows) + "\n")
    data = {"name": "preempted", "model": "llama-2-7b", "memory": {"kv_memory_gib": 0.5},
            "workload": {"kind": "trace", "path": "trace.csv", "format": "csv",
                         "columns": {"arrival": "t", "prompt_len": "p", "output_len": "o",
                                     "priority": "prio"},
                         "e2e_timeout_s": 3.0},
            "systems": [{"name": "s", "allocator": {"kind": "paged"},
                         "scheduler": {"policy": "priority", "swap_space_gib": 1,
                                       "preemption_mode": preemption_mode}}],
            "stop": {"num_requests": 13}, "engine": {"debug_invariants": True}}
    runs = {mode: run_scenario(scenario_from_dict({**data, "engine": {
        "debug_invariants": True, "mode": mode}}), base_dir=tmp_path).systems["s"]
        for mode in ("jump", "step")}
    requests = runs["jump"].requests
    pd.testing.assert_frame_equal(requests, runs["step"].requests)
    first = requests.iloc[0]
    assert first["preemptions"] == 1 and first["first_token_s"] > 0
    assert first["abandoned_s"] == 3.0 and math.isnan(first["finished_s"])
    if preemption_mode == "swap":
        assert runs["jump"].summary["swap_preemptions"] > 0
    gone = requests[requests["abandoned_s"].notna()]
    assert (gone["abandoned_s"] == gone["arrival_s"] + 3.0).all()
    answered = requests[requests["finished_s"].notna()]
    assert len(answered) > 0
    assert (answered["finished_s"] - answered["arrival_s"] < 3.0).all()


def test_a_decode_replica_times_from_the_clients_arrival():
    # Prefill and decode split: the deadline of a request handed over is its client's,
    # counted from when it sent the request, not from when its KV arrived.
    data = {"name": "split", "model": "llama-2-7b", "gpu": "h100-80g",
            "memory": {"kv_memory_gib": 2},
            "workload": {"arrival": {"process": "poisson", "rate": 40},
                         "prompt_len": {"dist": "uniform", "low": 500, "high": 3000},
                         "output_len": {"dist": "uniform", "low": 20, "high": 600},
                         "e2e_timeout_s": 2.5},
            "systems": [{"name": "s", "allocator": {"kind": "paged"}}],
            "engine": {"replicas": 2, "disaggregation": {"prefill_replicas": 1}},
            "stop": {"num_requests": 200}}
    requests = both_modes(data).requests
    gone = requests[requests["abandoned_s"].notna()]
    on_decode = gone[gone["decode_replica"] >= 0]
    assert len(on_decode) > 0 and on_decode["first_token_s"].notna().all()
    assert (gone["abandoned_s"] == gone["arrival_s"] + 2.5).all()
    served = requests[requests["finished_s"].notna()]
    assert (served["finished_s"] - served["arrival_s"] < 2.5).all()


@pytest.mark.parametrize("decode_router", ["round_robin", "least_loaded"])
def test_a_retry_of_an_answer_given_up_goes_back_to_the_prefill_replica(decode_router):
    # Answers too long for the clients' 4 s are aborted on the decode replicas; each client
    # sends its request again to the front door: its prompt is read again on the prefill
    # replica (found there in the prefix cache) and handed over anew.
    data = {"name": "split", "model": "llama-2-7b", "gpu": "h100-80g",
            "workload": {"arrival": {"process": "poisson", "rate": 5},
                         "prompt_len": {"dist": "uniform", "low": 500, "high": 3000},
                         "output_len": {"dist": "uniform", "low": 20, "high": 600},
                         "e2e_timeout_s": 4.0,
                         "retry": {"max_retries": 1, "backoff_s": 0.0}},
            "systems": [{"name": "s", "allocator": {"kind": "paged"}}],
            "engine": {"replicas": 3,
                       "disaggregation": {"prefill_replicas": 1,
                                          "decode_router": decode_router}},
            "stop": {"num_requests": 200}}
    result = both_modes(data)
    requests = result.requests
    retried = requests[requests["attempts"] == 2]
    assert len(retried) > 0 and (retried["replica"] == 0).all()
    assert (retried["prefix_hit_tokens"] > 0).all()
    # No decode replica reads a prompt: it computes a handed-over request's last token.
    steps = result.steps
    on_decode = steps[steps["replica"] > 0]
    assert (on_decode["prefill_tokens"] <= on_decode["prefill_requests"]).all()
    assert (retried["decode_replica"] >= 0).all()
    assert (requests["finished_s"].notna() | requests["abandoned_s"].notna()).all()


@pytest.mark.parametrize("seed", [0, 2, 6, 10])  # cache_aware, kv_aware, least_loaded
def test_replicas_behind_a_router_abort_alike_in_both_modes(seed):
    from test_queue_timeout import routed_under_pressure

    data = routed_under_pressure(seed)
    workload = data["workload"]
    workload["e2e_timeout_s"] = 8 * workload.pop("queue_timeout_s")
    workload["retry"] = {"max_retries": 1, "backoff_s": 0.02}
    requests = both_modes(data).requests
    gone = requests["abandoned_s"].notna()
    assert (gone & requests["first_token_s"].notna()).any()  # some of them while decoding


def test_a_pipeline_aborts_as_one_engine_does():
    from test_queue_timeout import pipelined

    data = pipelined(e2e_timeout_s=1.0)
    data["systems"] = [{**data["systems"][0], "name": "s"}]
    data["engine"] = {"debug_invariants": True}
    requests = both_modes(data).requests
    gone = requests[requests["abandoned_s"].notna()]
    assert gone["first_token_s"].notna().any()
    assert (gone["abandoned_s"] == gone["arrival_s"] + 1.0).all()
    assert (requests["finished_s"].notna() | requests["abandoned_s"].notna()).all()


def test_each_try_s_tokens_count_as_generated_in_vain():
    # Two tries, both aborted after 2 s of decoding: the summary counts both tries' tokens.
    one = run(LONG_ANSWER).summary["abandoned_output_tokens"]
    retried = run(with_workload(retry={"max_retries": 1, "backoff_s": 0, "jitter": 0}))
    request = retried.requests.iloc[0]
    assert request["attempts"] == 2 and request["abandoned_s"] == pytest.approx(4.0)
    # The second try finds its prompt cached, so its first token comes sooner: a token or
    # so more than the first try in its 2 s.
    assert 2 * one <= retried.summary["abandoned_output_tokens"] <= 2 * one + 2
    assert retried.summary["retries"] == 1


def test_a_request_given_up_after_a_first_token_in_time_misses_every_bound():
    data = with_workload()
    data["slo"] = {"ttft_s": 1.0}
    summary = run(data).summary
    assert summary["slo_ttft_attainment"] == 0.0 and summary["slo_attainment"] == 0.0


def test_the_summary_and_note_say_what_was_generated_in_vain():
    result = run(LONG_ANSWER)
    tokens = result.summary["abandoned_output_tokens"]
    table = format_summary({"s": result.summary})
    assert any(line.startswith("output tokens generated in vain")
               and line.split()[-1] == f"{tokens:,}" for line in table.splitlines())
    notes = [n for n in run_notes({"s": result.summary}) if n.startswith("abandoned")]
    assert notes == [f"abandoned by clients who timed out: s 1 of 1, of them aborted while "
                     f"seated, their prompts read in vain: s 1, output tokens generated in "
                     f"vain: s {tokens:,}; they count against the SLO, while throughput and "
                     f"latency percentiles are of the requests served"]
    # Streaming clients alone: no such row.
    summary = run(with_workload(e2e_timeout_s=None, ttft_timeout_s=0.005)).summary
    assert summary["abandoned_output_tokens"] is None
    assert "generated in vain" not in format_summary({"s": summary})


@pytest.mark.parametrize("value", ["0", "-2", "abc", ".inf"])
def test_an_e2e_timeout_must_be_a_positive_number(tmp_path, value):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nworkload: {arrival: {process: poisson, rate: 1}, "
                    "prompt_len: {dist: constant, value: 10}, "
                    f"output_len: {{dist: constant, value: 10}}, e2e_timeout_s: {value}}}\n"
                    "systems: [{name: p, allocator: {kind: paged}}]\n")
    proc = kvsim("validate", str(path))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "e2e_timeout_s" in proc.stderr
