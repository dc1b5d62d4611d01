"""Clients who give up (``workload.queue_timeout_s``): a request not seated that long after
it arrived leaves the queue unserved, at exactly that moment, and counts as abandoned; a
request seated once is never given up; a session goes on after an abandoned turn as after
a served one. Clients who try again (``workload.retry``): after a back-off, each try timed
out as the first, only the last recorded, latencies counted from the first."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import kvsim_in_process as kvsim
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine import run_scenario, scenario_trace
from sim.metrics import format_summary
from sim.results import run_notes
from sim.scenario import ScenarioError, scenario_from_dict
from sim.scheduler import Request, WaitingLine
from workloads.trace import Trace

ONE_SEAT = {
    "name": "one-seat", "model": "llama-2-7b", "memory": {"kv_memory_gib": 4},
    # Four requests 10 ms apart; the first runs for thousands of steps (tens of seconds).
    "workload": {"arrival": {"process": "constant", "rate": 100},
                 "prompt_len": {"dist": "constant", "value": 100},
                 "output_len": {"dist": "constant", "value": 2000},
                 "queue_timeout_s": 1.5},
    "systems": [{"name": "paged", "allocator": {"kind": "paged"},
                 "scheduler": {"max_num_seqs": 1}}],
    "stop": {"num_requests": 4},
    "slo": {"ttft_s": 2.0},
}


@pytest.mark.parametrize("mode", ["jump", "step"])
def test_requests_left_waiting_are_given_up_at_their_deadline(mode):
    data = {**ONE_SEAT, "engine": {"mode": mode}}
    run = run_scenario(scenario_from_dict(data)).systems["paged"]
    requests = run.requests
    # The first is seated at once and served; the other three wait behind it for far longer
    # than 1.5 s and are given up exactly 1.5 s after each arrived, never seated.
    assert requests["finished_s"].notna().tolist() == [True, False, False, False]
    gone = requests.iloc[1:]
    assert (gone["abandoned_s"] == gone["arrival_s"] + 1.5).all()
    assert gone[["admitted_s", "first_token_s"]].isna().all().all()
    assert math.isnan(requests["abandoned_s"].iloc[0])
    summary = run.summary
    assert (summary["completed"], summary["abandoned"], summary["rejected"]) == (1, 3, 0)
    assert summary["slo_attainment"] == 0.25  # an abandoned request misses the SLO
    # At the last arrival (30 ms) all three still wait: none has run out of patience yet.
    assert summary["waiting_at_last_arrival"] == 3
    # The makespan ends with the request served, not with the last one given up.
    assert summary["makespan_s"] == requests["finished_s"].iloc[0]


def test_without_a_timeout_every_request_waits_its_turn():
    data = {**ONE_SEAT, "workload": {**ONE_SEAT["workload"], "queue_timeout_s": None}}
    run = run_scenario(scenario_from_dict(data)).systems["paged"]
    assert run.requests["finished_s"].notna().all()
    assert run.requests["abandoned_s"].isna().all()
    assert run.summary["abandoned"] is None  # not "0": no client ever gives up here
    assert "abandoned" not in format_summary({"paged": run.summary})
    assert not any("abandoned" in note for note in run_notes({"paged": run.summary}))


def test_the_summary_and_notes_say_how_many_were_given_up():
    run = run_scenario(scenario_from_dict(ONE_SEAT)).systems["paged"]
    table = format_summary({"paged": run.summary})
    assert any(line.startswith("requests abandoned (client time-out)") and
               line.split()[-1] == "3" for line in table.splitlines())
    notes = [n for n in run_notes({"paged": run.summary}) if n.startswith("abandoned")]
    assert notes == ["abandoned by clients who timed out: "
                     "paged 3 of 4; they count against the SLO, while throughput and latency "
                     "percentiles are of the requests served"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_preempted_request_is_never_given_up(policy):
    # A pool that holds about three of these requests at their full length, eight of them
    # seated at once: growth preempts the latest seated, who then wait far longer than the
    # timeout to be seated again (at the front of the line, or in their place by priority),
    # and are served all the same.
    data = {"name": "preempted", "model": "llama-2-7b", "memory": {"kv_memory_gib": 1.5},
            "workload": {"arrival": {"process": "constant", "rate": 1000},
                         "prompt_len": {"dist": "constant", "value": 200},
                         "output_len": {"dist": "constant", "value": 800},
                         "queue_timeout_s": 0.05},
            "systems": [{"name": "paged", "allocator": {"kind": "paged", "watermark": 0.0},
                         "scheduler": {"policy": policy}}],
            "stop": {"num_requests": 8}}
    requests = run_scenario(scenario_from_dict(data)).systems["paged"].requests
    preempted = requests[requests["preemptions"] > 0]
    assert len(preempted) > 0
    assert preempted["finished_s"].notna().all() and preempted["abandoned_s"].isna().all()
    assert (preempted["finished_s"] - preempted["arrival_s"]).min() > 0.05


@pytest.mark.parametrize("value", [0, -1.5])
def test_a_timeout_must_be_positive(tmp_path, value):
    data = {**ONE_SEAT, "workload": {**ONE_SEAT["workload"], "queue_timeout_s": value}}
    with pytest.raises(ScenarioError, match=r"workload\.synthetic\.queue_timeout_s|"
                                            r"workload.*queue_timeout_s"):
        scenario_from_dict(data)
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nworkload: {{arrival: {{process: poisson, rate: 1}}, "
                    f"prompt_len: {{dist: constant, value: 10}}, "
                    f"output_len: {{dist: constant, value: 10}}, queue_timeout_s: {value}}}\n"
                    "systems: [{name: p, allocator: {kind: paged}}]\n")
    proc = kvsim("validate", str(path))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "queue_timeout_s" in proc.stderr
    assert "greater than 0" in proc.stderr


def pipelined(**timeouts: float) -> dict:
    """Two pipeline stages, 16 seats, more load than they hold: clients with ``timeouts``
    (workload fields) give up."""
    return {"name": "pp", "model": "llama-2-13b", "gpu": "a100-80g",
            "parallel": {"pipeline_parallel_size": 2},
            "workload": {"arrival": {"process": "poisson", "rate": 60},
                         "prompt_len": {"dist": "lognormal", "mean": 300, "sigma": 0.8,
                                        "max": 2000},
                         "output_len": {"dist": "uniform", "low": 50, "high": 600},
                         **timeouts},
            "systems": [{"name": "paged", "allocator": {"kind": "paged"},
                         "scheduler": {"max_num_seqs": 16}}],
            "stop": {"num_requests": 300}}


def test_a_pipeline_gives_up_requests_as_one_engine_does():
    data = pipelined(queue_timeout_s=0.5)
    runs = {mode: run_scenario(scenario_from_dict({**data, "engine": {"mode": mode}}))
            .systems["paged"].requests for mode in ("jump", "step")}
    requests = runs["jump"]
    gone = requests[requests["abandoned_s"].notna()]
    assert len(gone) > 0 and gone["admitted_s"].isna().all()
    assert (gone["abandoned_s"] == gone["arrival_s"] + 0.5).all()
    assert (requests["finished_s"].notna() | requests["abandoned_s"].notna()).all()
    assert requests.equals(runs["step"])


# --------------------------------------------------------------- the line itself
ORDERS = ["fcfs", "priority", "shortest_predicted"]


@given(order=st.sampled_from(ORDERS),
       timeouts=st.sampled_from([(1.0, None, None), (None, 1.0, None), (1.0, 1.5, None),
                                 (1.5, 1.0, None), (None, None, 1.0), (1.0, None, 1.5),
                                 (None, 0.5, 1.25), (1.5, 1.0, 0.75)]),
       operations=st.lists(st.tuples(st.sampled_from(["arrive", "pop", "token", "readmit",
                                                      "wait"]),
                                     st.integers(0, 3)), max_size=80))
@settings(max_examples=300, deadline=None, derandomize=True)
def test_the_line_lets_go_exactly_those_past_their_deadline(order, timeouts, operations):
    """Whatever arrives, is seated, gets its first token or not, returns after a preemption
    or waits: ``expire`` takes out exactly the requests whose deadline has come — never
    seated past the seat's time-out (``queue_timeout_s``), without a first token past the
    first token's (``ttft_timeout_s``), or past the whole answer's (``e2e_timeout_s``),
    whatever they had — wherever they stand, each given up at its deadline; the others
    keep their order, and the head is the one the order says."""
    queue_s, ttft_s, e2e_s = timeouts
    count = sum(1 for op, _ in operations if op == "arrive") or 1
    trace = Trace.from_columns(arrival_s=np.zeros(count), prompt_len=np.full(count, 20),
                               output_len=np.full(count, 50),
                               priority=np.array([v for op, v in operations
                                                  if op == "arrive"] or [0]))
    line = WaitingLine(order, timeout_s=queue_s, ttft_timeout_s=ttft_s, e2e_timeout_s=e2e_s)
    model: list[Request] = []  # FCFS: the deque as a list; else the set waiting
    seated: list[Request] = []
    now = 0.0
    arrived = 0

    def key(r: Request) -> tuple:
        if order == "priority":
            return (r.priority, r.arrival_s, r.index)
        return (max(r.predicted_output - r.gen_sync, 1), r.arrival_s, r.index)

    def deadline(r: Request) -> float:
        due = [r.arrival_s + ttft_s] if ttft_s is not None and r.first_token_s < 0 else []
        if queue_s is not None and r.admitted_s < 0:
            due.append(r.arrival_s + queue_s)
        if e2e_s is not None:
            due.append(r.arrival_s + e2e_s)
        return min(due, default=math.inf)

    for operation, value in operations:
        if operation == "arrive":
            request = Request(trace, arrived, now)
            request.predicted_output = 10 * value + 1
            arrived += 1
            line.arrive(request)
            model.append(request)
        elif operation == "pop" and model:
            expected = model[0] if order == "fcfs" else min(model, key=key)
            assert line.head() is expected and line.pop() is expected
            model.remove(expected)
            expected.admitted_s = now  # the scheduler marks it seated
            seated.append(expected)
        elif operation == "token" and seated:
            seated[value % len(seated)].first_token_s = now
        elif operation == "readmit" and seated:
            again = seated.pop(value % len(seated))
            line.readmit(again)
            model.insert(0, again)
        elif operation == "wait":
            now += 0.25 * value
            due = [r for r in model if deadline(r) <= now]
            gone = line.expire(now)
            assert sorted(r.index for r in gone) == sorted(r.index for r in due)
            assert all(r.abandoned_s == deadline(r) for r in gone)
            model = [r for r in model if r not in due]
        assert len(line) == len(model)
        if order == "fcfs":
            assert line.requests() == model
        else:
            assert sorted(r.index for r in line.requests()) == sorted(r.index for r in model)
        assert line.next_timeout_s() == min(map(deadline, model), default=math.inf)


@pytest.mark.parametrize("order", ["priority", "shortest_predicted"])
def test_requests_given_up_deep_in_an_ordered_line_are_not_kept(order):
    # Lasting overload: every second 50 requests arrive and one, the best placed, is
    # seated; the rest time out after 2 s, most of them far from the head. Their entries
    # must not pile up in the line's heaps (each keeps its request alive).
    arrivals = 50 * 200
    trace = Trace.from_columns(arrival_s=np.repeat(np.arange(200.0), 50),
                               prompt_len=np.full(arrivals, 20),
                               output_len=np.full(arrivals, 50),
                               priority=np.arange(arrivals) % 7)
    line = WaitingLine(order, timeout_s=2.0, max_wait_s=5.0 if order != "priority" else None)
    index, seated, gone = 0, 0, 0
    for second in range(200):
        now = float(second)
        line.clock = now
        gone += len(line.expire(now))
        for _ in range(50):
            request = Request(trace, index, now)
            request.predicted_output = 1 + index % 13
            line.arrive(request)
            index += 1
        head = line.head()
        assert line.pop() is head
        head.admitted_s = now
        seated += 1
        assert len(line._heap) <= 2 * len(line) + 64 + 50
    assert seated + gone + len(line) == arrivals
    assert gone > arrivals * 0.9


def routed_under_pressure(seed: int) -> dict:
    """Replicas behind a router, a pool small enough to preempt, clients quick to give up:
    a request may arrive and give up within one run of decode steps behind a head that
    waits for memory, and the router must learn of it when stepping would tell it."""
    rng = random.Random(seed)
    return {
        "name": f"routed-{seed}", "model": "llama-2-7b",
        "memory": {"kv_memory_gib": rng.choice([0.15, 0.25, 0.4])},
        "workload": {"arrival": {"process": "poisson", "rate": rng.choice([5, 20, 60])},
                     "prompt_len": {"dist": "uniform", "low": 20, "high": 300},
                     "output_len": {"dist": "uniform", "low": 50, "high": 800},
                     "queue_timeout_s": rng.choice([0.01, 0.05, 0.2])},
        "systems": [{"name": "s", "allocator": {"kind": "paged", "watermark": 0.0},
                     "scheduler": {"max_num_seqs": rng.choice([2, 8, 64])}}],
        "engine": {"replicas": rng.choice([2, 3]),
                   "router": {"policy": rng.choice(["least_loaded", "cache_aware",
                                                    "kv_aware"])}},
        "stop": {"num_requests": 150}, "seed": seed}


@pytest.mark.parametrize("seed", [3, 6, 7, 8, 9, 10])
def test_a_router_learns_of_retries_as_stepping_tells_it(seed):
    data = routed_under_pressure(seed)
    data["workload"]["retry"] = {"max_retries": 2, "backoff_s": 0.02}
    tables = {}
    for mode in ("jump", "step"):
        data["engine"]["mode"] = mode
        tables[mode] = run_scenario(scenario_from_dict(data)).systems["s"].requests
    assert (tables["jump"]["attempts"] > 1).any()
    pd.testing.assert_frame_equal(tables["jump"], tables["step"])


@pytest.mark.parametrize("seed", [3, 6, 7, 8, 9, 10])
def test_a_router_learns_of_clients_giving_up_as_stepping_tells_it(seed):
    data = routed_under_pressure(seed)
    tables = {}
    for mode in ("jump", "step"):
        data["engine"]["mode"] = mode
        tables[mode] = run_scenario(scenario_from_dict(data)).systems["s"].requests
    assert tables["jump"]["abandoned_s"].notna().any()
    assert tables["jump"]["preemptions"].sum() > 0
    pd.testing.assert_frame_equal(tables["jump"], tables["step"])


# --------------------------------------------------------------- clients who try again
def test_a_client_tries_again_after_each_time_out_with_a_longer_back_off():
    data = {**ONE_SEAT, "workload": {**ONE_SEAT["workload"],
                                     "retry": {"max_retries": 2, "backoff_s": 0.25,
                                               "jitter": 0}}}
    run = run_scenario(scenario_from_dict(data)).systems["paged"]
    requests = run.requests
    gone = requests.iloc[1:]
    # Three tries of 1.5 s each, 0.25 s and then 0.5 s apart; times count from the first.
    assert gone["attempts"].tolist() == [3, 3, 3]
    assert np.allclose(gone["abandoned_s"], gone["arrival_s"] + 3 * 1.5 + 0.25 + 0.5,
                       rtol=0, atol=1e-12)
    assert gone[["admitted_s", "first_token_s"]].isna().all().all()
    assert requests["attempts"].iloc[0] == 1
    assert (run.summary["abandoned"], run.summary["retries"]) == (3, 6)
    assert "retries (after a time-out or shed)" in format_summary({"paged": run.summary})


def test_a_retry_that_is_seated_is_served_and_timed_from_the_first_try():
    # The first request holds the only seat for about 2 s; the others time out after
    # 0.5 s, try again after 1 s, time out again, and try a third time 2 s later, when the
    # seat is free: served then, their TTFT counted from when they first arrived.
    data = {**ONE_SEAT, "workload": {**ONE_SEAT["workload"], "queue_timeout_s": 0.5,
                                     "output_len": {"dist": "constant", "value": 150},
                                     "retry": {"max_retries": 5, "backoff_s": 1.0,
                                               "jitter": 0}}}
    run = run_scenario(scenario_from_dict(data)).systems["paged"]
    requests = run.requests
    assert requests["finished_s"].notna().all() and requests["abandoned_s"].isna().all()
    retried = requests[requests["attempts"] > 1]
    assert len(retried) >= 2
    for _, row in retried.iterrows():
        tries = int(row["attempts"])
        last_try_s = row["arrival_s"] + 0.5 * (tries - 1) + sum(
            min(1.0 * 2 ** k, 8.0) for k in range(tries - 1))
        assert row["admitted_s"] >= last_try_s - 1e-12
        assert row["admitted_s"] < last_try_s + 0.5  # within that try's patience
    ttft = requests["first_token_s"] - requests["arrival_s"]
    assert (ttft[requests["attempts"] > 1] > 1.5).all()
    assert run.summary["retries"] == int((requests["attempts"] - 1).sum())


def test_the_back_off_doubles_up_to_its_cap_less_its_jitter():
    from workloads.spec import Retry

    retry = Retry(max_retries=6, backoff_s=0.5, max_backoff_s=3.0)
    assert [retry.delay_s(k, 0.0) for k in range(1, 7)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert retry.delay_s(4, 0.5) == 3.0 * (1 - 0.25 * 0.5)  # the OpenAI client's jitter
    assert Retry(jitter=0).delay_s(2, 0.9) == 1.0


def test_jitter_spreads_retries_the_same_way_every_run():
    # Three clients give up 10 ms apart; without jitter they come back 10 ms apart, with
    # it each waits 75 to 100 % of its back-off, drawn by its own (seeded) draw.
    def first_retry_gaps(jitter: float) -> list[float]:
        data = {**ONE_SEAT, "workload": {**ONE_SEAT["workload"], "retry": {
            "max_retries": 1, "backoff_s": 2.0, "jitter": jitter}}}
        requests = run_scenario(scenario_from_dict(data)).systems["paged"].requests.iloc[1:]
        # Given up twice: 1.5 s, the back-off, 1.5 s again.
        return (requests["abandoned_s"] - requests["arrival_s"] - 3.0).tolist()

    assert first_retry_gaps(0.0) == pytest.approx([2.0] * 3, abs=1e-12)
    jittered = first_retry_gaps(0.25)
    assert all(1.5 <= gap <= 2.0 for gap in jittered)
    assert len({round(gap, 9) for gap in jittered}) == 3
    assert first_retry_gaps(0.25) == jittered


def test_a_retry_needs_a_time_out_or_a_bounded_line(tmp_path):
    data = {**ONE_SEAT, "workload": {**ONE_SEAT["workload"], "queue_timeout_s": None,
                                     "retry": {"max_retries": 2}}}
    with pytest.raises(ScenarioError, match=r"workload\.retry: a client retries a request "
                                            r"it gave up on or that was turned away; give "
                                            r"workload\.queue_timeout_s, ttft_timeout_s, "
                                            r"e2e_timeout_s or itl_timeout_s"):
        scenario_from_dict(data)
    # A deadline for the first token will do, or one for the whole answer.
    for field in ("ttft_timeout_s", "e2e_timeout_s"):
        timed = {**data, "workload": {**data["workload"], field: 2.0}}
        assert scenario_from_dict(timed).workload.retry is not None
    # Or a system whose full line turns requests away.
    bounded = {**data, "systems": [{**data["systems"][0],
                                    "scheduler": {"max_queued_requests": 8}}]}
    assert scenario_from_dict(bounded).workload.retry is not None
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nworkload: {arrival: {process: poisson, rate: 1}, "
                    "prompt_len: {dist: constant, value: 10}, "
                    "output_len: {dist: constant, value: 10}, retry: {max_retries: 2}}\n"
                    "systems: [{name: p, allocator: {kind: paged}}]\nstop: {num_requests: 2}\n")
    proc = kvsim("validate", str(path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "or a system's scheduler.max_queued_requests" in proc.stderr


@pytest.mark.parametrize("retry", [None, {"max_retries": 1, "backoff_s": 0.1}])
def test_a_user_goes_on_after_the_last_try(retry):
    # Closed loop: three users, one seat. A user sends the next request its think time
    # after the one before ended: served, or given up (after its last try, where clients
    # retry; never after a try in between).
    data = {"name": "users", "model": "llama-2-7b", "memory": {"kv_memory_gib": 4},
            "workload": {"arrival": {"process": "closed_loop", "users": 3,
                                     "think_time_s": 0.25},
                         "prompt_len": {"dist": "constant", "value": 100},
                         "output_len": {"dist": "constant", "value": 300},
                         "queue_timeout_s": 0.5, "retry": retry},
            "systems": [{"name": "paged", "allocator": {"kind": "paged"},
                         "scheduler": {"max_num_seqs": 1}}],
            "stop": {"num_requests": 30}}
    scenario = scenario_from_dict(data)
    trace = scenario_trace(scenario, Path())
    requests = run_scenario(scenario).systems["paged"].requests.set_index("request")
    assert len(requests) == 30  # every user's every request ran, served or given up
    assert (requests["attempts"] == (2 if retry else 1)).any()
    after = trace.after
    followed_abandoned = 0
    for index in np.flatnonzero(after >= 0).tolist():
        parent = int(after[index])
        done_s = requests.at[parent, "finished_s"]
        if math.isnan(done_s):
            done_s = requests.at[parent, "abandoned_s"]
            followed_abandoned += 1
        assert requests.at[index, "arrival_s"] == pytest.approx(
            done_s + trace.think_s[index], abs=1e-12)
    assert followed_abandoned >= 3


def test_the_latency_figure_levels_off_at_the_share_served():
    from reports.run_figures import latency_cdfs

    result = run_scenario(scenario_from_dict(ONE_SEAT))  # one request of four served
    fig = latency_cdfs(result)
    ttft, tpot, e2e, gap = (ax.get_lines()[0].get_ydata() for ax in fig.axes)
    assert ttft[-1] == e2e[-1] == 0.25
    assert tpot[-1] == gap[-1] == 1.0  # of the requests served that have a gap
