"""Streaming clients who give up on a first token (``workload.ttft_timeout_s``): wherever the
request is when the deadline passes — waiting, seated while its prompt is read, or
preempted before its first token — it is abandoned at exactly that moment, and a seated one
is aborted at the step boundary after, its KV freed (its computed prompt blocks left to the
prefix cache). A first token that comes as the client gives up comes too late."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from conftest import kvsim_in_process as kvsim

from sim.engine import run_scenario
from sim.metrics import format_summary
from sim.results import run_notes
from sim.scenario import scenario_from_dict

# One 3,000-token prompt, read in one step of about 0.145 s on Llama-2-7B (A100).
LONG_PROMPT = {
    "name": "long-prompt", "model": "llama-2-7b", "memory": {"kv_memory_gib": 8},
    "workload": {"arrival": {"process": "constant", "rate": 1},
                 "prompt_len": {"dist": "constant", "value": 3000},
                 "output_len": {"dist": "constant", "value": 20},
                 "ttft_timeout_s": 0.1},
    "systems": [{"name": "s", "allocator": {"kind": "paged"}}],
    "stop": {"num_requests": 1},
    "engine": {"debug_invariants": True},
}


def run(data: dict) -> pd.DataFrame:
    return run_scenario(scenario_from_dict(data)).systems["s"]


def with_workload(**fields: object) -> dict:
    return {**LONG_PROMPT, "workload": {**LONG_PROMPT["workload"], **fields}}


@pytest.mark.parametrize("allocator", [{"kind": "paged"}, {"kind": "contiguous"}])
@pytest.mark.parametrize("samples", [1, 3])
def test_a_prompt_read_past_the_deadline_is_aborted_at_the_deadline(allocator, samples):
    data = with_workload(sampling={"n": samples})
    data["systems"] = [{"name": "s", "allocator": allocator}]
    result = run(data)
    request = result.requests.iloc[0]
    step_s = result.steps["duration_s"].iloc[0]
    assert step_s > 0.1  # the prompt's one step ends after the client has gone
    # Seated at once, its prompt read (and its samples forked) by a step that ends after
    # the deadline: the first token comes too late, and the client gave up at 0.1 s.
    assert request["admitted_s"] == 0.0
    assert request["abandoned_s"] == 0.1
    assert math.isnan(request["first_token_s"]) and math.isnan(request["finished_s"])
    assert len(result.steps) == 1  # nothing decodes for it afterwards
    summary = result.summary
    assert (summary["completed"], summary["abandoned"], summary["abandoned_seated"]) == (
        0, 1, 1)


def test_a_first_token_in_time_is_served():
    result = run(with_workload(ttft_timeout_s=1.0))
    request = result.requests.iloc[0]
    assert request["first_token_s"] == pytest.approx(result.steps["duration_s"].iloc[0])
    assert request["finished_s"] > request["first_token_s"]
    assert math.isnan(request["abandoned_s"])
    assert (result.summary["abandoned"], result.summary["abandoned_seated"]) == (0, 0)


def test_a_first_token_given_just_as_the_client_gives_up_comes_too_late():
    step_s = run(with_workload(ttft_timeout_s=1.0)).steps["duration_s"].iloc[0]
    request = run(with_workload(ttft_timeout_s=step_s)).requests.iloc[0]
    assert request["abandoned_s"] == step_s and math.isnan(request["first_token_s"])


def test_a_retry_finds_the_aborted_prompt_in_the_prefix_cache():
    # The aborted prompt's full blocks stay cached when its KV is freed: the client's
    # second try (sent as the first gave up, seated when the step ends) reads only the
    # last partial block and gets its first token in time.
    data = with_workload(retry={"max_retries": 1, "backoff_s": 0, "jitter": 0})
    result = run(data)
    request = result.requests.iloc[0]
    assert request["attempts"] == 2
    assert request["prefix_hit_tokens"] == 3000 // 16 * 16
    assert math.isnan(request["abandoned_s"]) and request["finished_s"] > 0
    step_s = result.steps["duration_s"].iloc[0]
    assert request["admitted_s"] == pytest.approx(step_s)  # (of the last try)
    assert request["first_token_s"] - 0.1 < 0.1  # from the second try's own start
    assert result.summary["retries"] == 1


def test_an_abort_frees_the_seat_and_memory_at_the_step_boundary_after():
    # Chunked prefill 256 tokens a step, one seat: the first prompt takes 12 steps, and its
    # client leaves after 0.1 s; the second request, which arrived meanwhile, is seated at
    # the first step boundary after that.
    data = with_workload(arrival={"process": "constant", "rate": 20})
    data["systems"] = [{"name": "s", "allocator": {"kind": "paged"},
                        "scheduler": {"chunked_prefill": True, "max_num_batched_tokens": 256,
                                      "max_num_seqs": 1}}]
    data["stop"] = {"num_requests": 2}
    result = run(data)
    first, second = result.requests.iloc[0], result.requests.iloc[1]
    assert first["abandoned_s"] == 0.1 and first["admitted_s"] == 0.0
    ends = (result.steps["time_s"] + result.steps["duration_s"]).to_numpy()
    boundary = ends[ends >= 0.1].min()
    assert second["admitted_s"] == boundary
    # It cannot be read in time either (due at 0.15 s, 12 steps to read): aborted likewise.
    assert second["abandoned_s"] == second["arrival_s"] + 0.1
    assert result.summary["abandoned_seated"] == 2


@pytest.mark.parametrize("mode", ["jump", "step"])
def test_a_request_never_seated_is_given_up_at_its_deadline(mode):
    # Four requests 10 ms apart, one seat held for tens of seconds by the first.
    from test_queue_timeout import ONE_SEAT

    workload = {**ONE_SEAT["workload"], "queue_timeout_s": None, "ttft_timeout_s": 1.5}
    data = {**ONE_SEAT, "workload": workload, "engine": {"mode": mode}}
    requests = run_scenario(scenario_from_dict(data)).systems["paged"].requests
    assert requests["finished_s"].notna().tolist() == [True, False, False, False]
    gone = requests.iloc[1:]
    assert (gone["abandoned_s"] == gone["arrival_s"] + 1.5).all()
    assert gone["admitted_s"].isna().all()


def test_both_timeouts_the_sooner_deadline_counts():
    # A seat within 0.05 s (given: seated at once) and a first token within 0.1 s (not).
    request = run(with_workload(queue_timeout_s=0.05)).requests.iloc[0]
    assert request["abandoned_s"] == 0.1
    # Unseated, the queue's time-out comes first.
    data = with_workload(queue_timeout_s=0.05, arrival={"process": "constant", "rate": 100})
    data["systems"] = [{"name": "s", "allocator": {"kind": "paged"},
                        "scheduler": {"max_num_seqs": 1}}]
    data["stop"] = {"num_requests": 2}
    second = run(data).requests.iloc[1]
    assert second["abandoned_s"] == pytest.approx(second["arrival_s"] + 0.05)
    assert math.isnan(second["admitted_s"])


def test_a_request_preempted_before_its_first_token_still_times_out():
    # Per-chunk prompt memory (vLLM v1) in a pool too small for every prompt seated: a
    # later chunk preempts the latest seated, which goes back to the line without a first
    # token and is given up there when its client's patience runs out.
    data = {"name": "preempted", "model": "llama-2-7b", "memory": {"kv_memory_gib": 0.5},
            "workload": {"arrival": {"process": "constant", "rate": 1000},
                         "prompt_len": {"dist": "constant", "value": 600},
                         "output_len": {"dist": "constant", "value": 50},
                         "ttft_timeout_s": 0.3},
            "systems": [{"name": "s", "allocator": {"kind": "paged", "watermark": 0.0},
                         "scheduler": {"chunked_prefill": True, "max_num_batched_tokens": 64,
                                       "prefill_allocation": "per_chunk"}}],
            "stop": {"num_requests": 12}, "engine": {"debug_invariants": True}}
    requests = run(data).requests
    gone = requests[requests["abandoned_s"].notna() & (requests["preemptions"] > 0)]
    assert len(gone) > 0
    assert gone["first_token_s"].isna().all()
    assert (gone["abandoned_s"] == gone["arrival_s"] + 0.3).all()
    answered = requests[requests["first_token_s"].notna()]
    assert (answered["first_token_s"] - answered["arrival_s"] < 0.3).all()


def test_a_prefill_replica_aborts_and_hands_nothing_over():
    data = {"name": "split", "model": "llama-2-7b", "gpu": "h100-80g",
            "workload": {"arrival": {"process": "poisson", "rate": 40},
                         "prompt_len": {"dist": "uniform", "low": 500, "high": 3000},
                         "output_len": {"dist": "uniform", "low": 20, "high": 200},
                         "ttft_timeout_s": 0.4},
            "systems": [{"name": "s", "allocator": {"kind": "paged"}}],
            "engine": {"replicas": 2, "disaggregation": {"prefill_replicas": 1}},
            "stop": {"num_requests": 200}}
    tables = {}
    for mode in ("jump", "step"):
        data["engine"]["mode"] = mode
        tables[mode] = run(data).requests
    requests = tables["jump"]
    gone = requests[requests["abandoned_s"].notna()]
    assert (gone["admitted_s"].notna()).any()  # some while their prompts were read
    assert (gone["decode_replica"] == -1).all() and gone["first_token_s"].isna().all()
    served = requests[requests["finished_s"].notna()]
    assert (served["decode_replica"] >= 0).all()
    assert len(gone) + len(served) == len(requests)
    pd.testing.assert_frame_equal(tables["jump"], tables["step"])


@pytest.mark.parametrize("seed", [0, 2, 6, 10])  # cache_aware, kv_aware, least_loaded
def test_replicas_behind_a_router_abort_alike_in_both_modes(seed):
    from test_queue_timeout import routed_under_pressure

    # Longer prompts, read in chunks: some are seated when their clients give up.
    data = routed_under_pressure(seed)
    workload = data["workload"]
    workload["ttft_timeout_s"] = 4 * workload.pop("queue_timeout_s")
    workload["prompt_len"] = {"dist": "uniform", "low": 100, "high": 280}
    workload["retry"] = {"max_retries": 1, "backoff_s": 0.02}
    data["systems"][0]["scheduler"].update(chunked_prefill=True, max_num_batched_tokens=32)
    tables = {}
    for mode in ("jump", "step"):
        data["engine"]["mode"] = mode
        tables[mode] = run(data).requests
    gone = tables["jump"]["abandoned_s"].notna()
    assert (gone & tables["jump"]["admitted_s"].notna()).any()
    pd.testing.assert_frame_equal(tables["jump"], tables["step"])


def test_a_pipeline_aborts_as_one_engine_does():
    from test_queue_timeout import pipelined

    data = pipelined(ttft_timeout_s=0.5)  # prompts read 256 tokens a step
    data["systems"] = [{"name": "s", "allocator": {"kind": "paged"},
                        "scheduler": {"max_num_seqs": 16, "chunked_prefill": True,
                                      "max_num_batched_tokens": 256}}]
    runs = {mode: run({**data, "engine": {"mode": mode, "debug_invariants": True}}).requests
            for mode in ("jump", "step")}
    requests = runs["jump"]
    gone = requests[requests["abandoned_s"].notna()]
    assert (gone["admitted_s"].notna()).any()
    assert (gone["abandoned_s"] == gone["arrival_s"] + 0.5).all()
    assert (requests["finished_s"].notna() | requests["abandoned_s"].notna()).all()
    pd.testing.assert_frame_equal(requests, runs["step"])


def test_the_summary_and_note_say_how_many_were_aborted_while_seated():
    result = run(LONG_PROMPT)
    table = format_summary({"s": result.summary})
    assert any(line.startswith("of them aborted while seated") and line.split()[-1] == "1"
               for line in table.splitlines())
    notes = [n for n in run_notes({"s": result.summary}) if n.startswith("abandoned")]
    assert notes == ["abandoned by clients who timed out: s 1 of 1, of them aborted while "
                     "seated, their prompts read in vain: s 1; they count against the SLO, "
                     "while throughput and latency percentiles are of the requests served"]
    # A seat alone waited for: no such row.
    seat_only = with_workload(ttft_timeout_s=None, queue_timeout_s=0.1)
    summary = run(seat_only).summary
    assert summary["abandoned_seated"] is None
    assert "aborted while seated" not in format_summary({"s": summary})


@pytest.mark.parametrize("value", ["0", "-2", "abc"])
def test_a_ttft_timeout_must_be_a_positive_number(tmp_path, value):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nworkload: {arrival: {process: poisson, rate: 1}, "
                    "prompt_len: {dist: constant, value: 10}, "
                    f"output_len: {{dist: constant, value: 10}}, ttft_timeout_s: {value}}}\n"
                    "systems: [{name: p, allocator: {kind: paged}}]\n")
    proc = kvsim("validate", str(path))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "ttft_timeout_s" in proc.stderr


# (The line's own deadlines: test_queue_timeout's property test covers both.)


def test_a_prompt_the_budget_leaves_out_of_steps_is_aborted_all_the_same(tmp_path):
    # Fourteen short prompts and a long one, 64 tokens a step. The short ones decode with
    # four drafts each (70 tokens a step), so from the second step on the long prompt,
    # seated in the first, gets no budget at all: its client's deadline passes while it
    # waits for a chunk, and it is aborted at the step boundary after, seat and memory
    # freed, though no step reads it.
    rows = ["t,p,o"] + ["0,3,400"] * 14 + ["0,500,10"]
    (tmp_path / "trace.csv").write_text("\n".join(rows) + "\n")
    data = {"name": "starved", "model": "llama-2-7b", "memory": {"kv_memory_gib": 4},
            "workload": {"kind": "trace", "path": "trace.csv", "format": "csv",
                         "columns": {"arrival": "t", "prompt_len": "p", "output_len": "o"},
                         "ttft_timeout_s": 0.2},
            "systems": [{"name": "s", "allocator": {"kind": "paged"},
                         "scheduler": {"chunked_prefill": True, "max_num_batched_tokens": 64},
                         "speculative": {"method": "ngram", "num_speculative_tokens": 4,
                                         "mean_acceptance_length": 2}}],
            "stop": {"num_requests": 15}, "engine": {"debug_invariants": True}}
    result = run_scenario(scenario_from_dict(data), base_dir=tmp_path).systems["s"]
    long_prompt = result.requests.iloc[14]
    assert long_prompt["admitted_s"] == 0.0 and long_prompt["abandoned_s"] == 0.2
    steps = result.steps
    ends = steps["time_s"] + steps["duration_s"]
    assert (steps.loc[ends <= 0.2, "prefill_tokens"].iloc[1:] == 0).all()  # starved
    # (A step's count of requests running is at its end.)
    assert (steps.loc[ends < 0.2, "running"] == 15).all()
    assert steps.loc[ends >= 0.2, "running"].iloc[0] == 14
    assert result.requests.drop(index=14)["finished_s"].notna().all()
