"""A bounded waiting line (``scheduler.max_queued_requests``): a request that arrives when
that many wait for a seat is turned away at once (shed), never seated, counted apart from
the requests rejected as too large and missing every SLO; a client with ``workload.retry``
sends it again after its back-off. Requests already taken in — preempted ones back in the
line, requests a prefill replica hands to a decode replica — are never shed."""

from __future__ import annotations

import pandas as pd
import pytest
from conftest import kvsim_in_process as kvsim

from sim.engine import run_scenario
from sim.metrics import format_summary
from sim.results import RunResult, run_notes
from sim.scenario import scenario_from_dict

# Six requests 10 ms apart, one seat held for tens of seconds by the first; at most two
# wait behind it.
ONE_SEAT = {
    "name": "one-seat", "model": "llama-2-7b", "memory": {"kv_memory_gib": 4},
    "workload": {"arrival": {"process": "constant", "rate": 100},
                 "prompt_len": {"dist": "constant", "value": 100},
                 "output_len": {"dist": "constant", "value": 2000}},
    "systems": [{"name": "s", "allocator": {"kind": "paged"},
                 "scheduler": {"max_num_seqs": 1, "max_queued_requests": 2}}],
    "stop": {"num_requests": 6},
    "slo": {"ttft_s": 600.0},
}


def run(data: dict, mode: str = "jump") -> RunResult:
    return run_scenario(scenario_from_dict(
        {**data, "engine": {**data.get("engine", {}), "mode": mode,
                            "debug_invariants": mode == "step"}})).systems["s"]


@pytest.mark.parametrize("mode", ["jump", "step"])
def test_an_arrival_that_finds_the_line_full_is_turned_away_at_once(mode):
    result = run(ONE_SEAT, mode)
    requests = result.requests
    # The first is seated, the next two wait (and are served in turn), the rest are shed.
    assert requests["shed"].tolist() == [False, False, False, True, True, True]
    shed = requests[requests["shed"]]
    assert shed["admitted_s"].isna().all() and shed["finished_s"].isna().all()
    assert shed["abandoned_s"].isna().all() and not shed["rejected"].any()
    assert requests.loc[~requests["shed"], "finished_s"].notna().all()
    summary = result.summary
    assert (summary["shed"], summary["completed"], summary["rejected"]) == (3, 3, 0)
    # Shed requests miss the SLO however lax, and never count as waiting.
    assert summary["slo_attainment"] == 0.5
    assert summary["waiting_at_last_arrival"] == 2


def test_without_a_bound_every_request_waits_its_turn():
    data = {**ONE_SEAT, "systems": [{"name": "s", "allocator": {"kind": "paged"},
                                     "scheduler": {"max_num_seqs": 1}}]}
    result = run(data)
    assert not result.requests["shed"].any()
    assert result.summary["shed"] is None  # (shown "—": no bound to be shed by)
    assert "turned away" not in format_summary({"s": result.summary})


def test_the_summary_and_note_say_how_many_were_turned_away():
    summary = run(ONE_SEAT).summary
    table = format_summary({"s": summary})
    assert any(line.startswith("requests turned away (line full)")
               and line.split()[-1] == "3" for line in table.splitlines())
    notes = [n for n in run_notes({"s": summary}) if n.startswith("turned away")]
    assert notes == ["turned away by a full waiting line: s 3 of 6; they count against the "
                     "SLO, while throughput and latency percentiles are of the requests "
                     "served"]


@pytest.mark.parametrize("mode", ["jump", "step"])
def test_a_client_turned_away_tries_again_after_its_back_off(mode):
    # No time-out at all: the retries follow the 503s alone. Each back-off is 1 s, then
    # 2 s; the line stays full for tens of seconds, so every retry is shed too.
    data = {**ONE_SEAT, "workload": {**ONE_SEAT["workload"],
                                     "retry": {"max_retries": 2, "backoff_s": 1.0,
                                               "jitter": 0}}}
    requests = run(data, mode).requests
    shed = requests[requests["shed"]]
    assert len(shed) == 3 and (shed["attempts"] == 3).all()
    # Latencies count from the first try: its arrival is kept.
    assert shed["arrival_s"].tolist() == pytest.approx([0.03, 0.04, 0.05])
    assert run(data, mode).summary["retries"] == 6


def test_a_retry_may_find_room_and_be_served():
    # A short first request: the line has room again when the shed clients come back.
    rows = {**ONE_SEAT["workload"], "output_len": {"dist": "constant", "value": 20},
            "retry": {"max_retries": 1, "backoff_s": 1.0, "jitter": 0}}
    requests = run({**ONE_SEAT, "workload": rows}).requests
    assert not requests["shed"].any()  # (the last try's outcome)
    assert requests["finished_s"].notna().all()
    assert (requests["attempts"] == [1, 1, 1, 2, 2, 2]).all()
    retried = requests[requests["attempts"] == 2]
    assert (retried["admitted_s"] >= retried["arrival_s"] + 1.0).all()


def test_a_decode_replica_takes_every_request_handed_over():
    # Split prefill and decode, a line of four on each replica: only the prefill replica,
    # where clients' requests arrive, turns any away. (A pool of 24 GiB, room for every
    # request the decode replica runs, keeps the step run's checks of it short.)
    data = {"name": "split", "model": "llama-2-7b", "gpu": "h100-80g",
            "memory": {"kv_memory_gib": 24},
            "workload": {"arrival": {"process": "poisson", "rate": 60},
                         "prompt_len": {"dist": "uniform", "low": 500, "high": 3000},
                         "output_len": {"dist": "uniform", "low": 200, "high": 800}},
            "systems": [{"name": "s", "allocator": {"kind": "paged"},
                         "scheduler": {"max_queued_requests": 4, "max_num_seqs": 16}}],
            "engine": {"replicas": 2, "disaggregation": {"prefill_replicas": 1}},
            "stop": {"num_requests": 300}}
    runs = {mode: run(data, mode) for mode in ("jump", "step")}
    requests = runs["jump"].requests
    pd.testing.assert_frame_equal(requests, runs["step"].requests)
    shed = requests[requests["shed"]]
    assert len(shed) > 0 and (shed["decode_replica"] == -1).all()
    served = requests[~requests["shed"]]
    assert served["finished_s"].notna().all() and (served["decode_replica"] == 1).all()
    assert requests["preemptions"].sum() == 0
    # The decode replica's line grew past four: it sheds nothing handed over.
    decode = runs["step"].steps
    assert decode.loc[decode["replica"] == 1, "waiting"].max() > 4


@pytest.mark.parametrize("seed", [0, 3, 6, 10])  # cache_aware, kv_aware, least_loaded
def test_replicas_behind_a_router_shed_alike_in_both_modes(seed):
    from test_queue_timeout import routed_under_pressure

    data = routed_under_pressure(seed)
    data["workload"].pop("queue_timeout_s")
    data["workload"]["retry"] = {"max_retries": 1, "backoff_s": 0.02}
    data["systems"][0]["scheduler"]["max_queued_requests"] = 2
    runs = {mode: run(data, mode) for mode in ("jump", "step")}
    pd.testing.assert_frame_equal(runs["jump"].requests, runs["step"].requests)
    assert runs["jump"].summary["retries"] > 0


def test_a_preempted_request_back_in_the_line_is_never_shed(tmp_path):
    # A small pool and a line of one: requests preempted mid-answer go back to the line
    # however long it is, and the line then holds more than its bound.
    data = {"name": "preempted", "model": "llama-2-7b", "memory": {"kv_memory_gib": 0.5},
            "workload": {"arrival": {"process": "constant", "rate": 50},
                         "prompt_len": {"dist": "constant", "value": 200},
                         "output_len": {"dist": "constant", "value": 400}},
            "systems": [{"name": "s", "allocator": {"kind": "paged"},
                         "scheduler": {"max_queued_requests": 1}}],
            "stop": {"num_requests": 30}}
    result = run(data, "step")
    requests = result.requests
    assert requests["preemptions"].sum() > 0
    preempted = requests[requests["preemptions"] > 0]
    assert preempted["finished_s"].notna().all()
    assert result.steps["waiting"].max() > 1


@pytest.mark.parametrize("value", ["0", "-2", "abc", "1.5"])
def test_the_bound_must_be_a_positive_whole_number(tmp_path, value):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nworkload: {arrival: {process: poisson, rate: 1}, "
                    "prompt_len: {dist: constant, value: 10}, "
                    "output_len: {dist: constant, value: 10}}\n"
                    "systems: [{name: p, allocator: {kind: paged}, "
                    f"scheduler: {{max_queued_requests: {value}}}}}]\nstop: {{num_requests: 2}}\n")
    proc = kvsim("validate", str(path))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "max_queued_requests" in proc.stderr
