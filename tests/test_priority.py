"""Scheduling by priority (vLLM's ``--scheduling-policy priority``): the waiting request
with the best priority (lowest value, then earliest arrival) is seated first, and when memory
runs short the running request with the worst priority (latest arrival among equals) is
preempted. Priorities come from the trace, drawn from a mix or read from a column."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reports.run_figures import latency_cdfs
from sim.engine import run_scenario
from sim.memory import PagedAllocator
from sim.metrics import format_summary, labelled_sweep_table, sweep_metrics
from sim.scenario import ScenarioError, SchedulerConfig, scenario_from_dict
from sim.scheduler import Request, Scheduler, WaitingLine
from sim.trace_stats import trace_stats
from workloads import TraceImportError, TraceWorkload, WorkloadError, build_trace
from workloads.spec import SyntheticWorkload
from workloads.trace import Trace


def trace_of(priorities: list[int], prompt_len: int = 32, output_len: int = 8) -> Trace:
    count = len(priorities)
    return Trace.from_columns(arrival_s=np.arange(count, dtype=float),
                              prompt_len=np.full(count, prompt_len),
                              output_len=np.full(count, output_len),
                              priority=np.array(priorities))


def test_the_waiting_line_orders_by_priority_then_arrival():
    trace = trace_of([1, 0, 1, 0])
    # A request stands in one line at a time (its ticket is its place there): each line
    # gets requests of its own.
    lines = {"fcfs": WaitingLine("fcfs"), "priority": WaitingLine("priority")}
    requests = {name: [Request(trace, i, float(i)) for i in range(4)] for name in lines}
    fcfs, by_priority = lines["fcfs"], lines["priority"]
    for name, line in lines.items():
        for request in requests[name]:
            line.arrive(request)
    assert [fcfs.pop().index for _ in range(4)] == [0, 1, 2, 3]
    assert [by_priority.pop().index for _ in range(4)] == [1, 3, 0, 2]
    # A preempted request goes back to the front under FCFS, to its place by priority.
    for name, line in lines.items():
        for request in requests[name][1:]:
            line.arrive(request)
        line.readmit(requests[name][0])
        assert len(line) == 4 and line
    assert fcfs.head() is requests["fcfs"][0]
    assert [by_priority.pop().index for _ in range(4)] == [1, 3, 0, 2]
    assert not by_priority


@given(st.lists(st.tuples(st.sampled_from(["arrive", "readmit", "pop"]),
                          st.integers(-2, 2)), max_size=60))
@settings(max_examples=200, deadline=None, derandomize=True)
def test_the_line_by_priority_always_seats_the_best_waiting(operations):
    """Whatever arrives, returns or leaves, the head is the waiting request with the lowest
    (priority, arrival, index); first come, first served keeps arrivals in order behind
    whoever returned to the front."""
    priorities = [level for _, level in operations]
    trace = trace_of(priorities or [0])
    by_priority, fcfs = WaitingLine("priority"), WaitingLine("fcfs")
    waiting: list[Request] = []
    model: list[Request] = []  # FCFS: the deque, as a list
    taken: list[Request] = []
    # The FCFS line's own request of each index (a request stands in one line at a time).
    twin: dict[int, Request] = {}
    for index, (operation, _) in enumerate(operations):
        if operation == "pop" and waiting:
            best = min(waiting, key=lambda r: (r.priority, r.arrival_s, r.index))
            assert by_priority.head() is best and by_priority.pop() is best
            waiting.remove(best)
            assert fcfs.pop() is model.pop(0)
            taken.append(best)
        elif operation == "readmit" and taken:
            again = taken.pop()
            by_priority.readmit(again)
            waiting.append(again)
            fcfs.readmit(twin[again.index])
            model.insert(0, twin[again.index])
        elif operation != "pop":
            request = Request(trace, index, float(index))
            by_priority.arrive(request)
            waiting.append(request)
            twin[index] = Request(trace, index, float(index))
            fcfs.arrive(twin[index])
            model.append(twin[index])
        assert len(by_priority) == len(waiting) == len(fcfs)
        assert sorted(r.index for r in by_priority.requests()) == sorted(r.index for r in waiting)
        assert fcfs.requests() == model


def test_the_worst_priority_is_preempted_and_the_best_seated_first():
    # A pool of 6 blocks of 16: three 30-token prompts fill it; growth preempts.
    trace = trace_of([1, 0, 2, 0, 1], prompt_len=30, output_len=40)
    allocator = PagedAllocator(num_blocks=6, block_size=16, enable_prefix_caching=False,
                               watermark=0.0)
    sched = Scheduler(allocator, SchedulerConfig(policy="priority", max_num_seqs=3))
    requests = [Request(trace, i, float(i)) for i in range(5)]
    for request in requests:
        assert sched.add(request)
    clock = 0.0
    victims = []
    while (sched.running or sched.waiting) and clock < 1000:
        before = {r.index: r.preemptions for r in requests}
        batch = sched.schedule(clock)
        if clock == 0:
            # Seated by priority, then arrival: 1 and 3 (priority 0), then 0 (priority 1).
            assert sorted(r.index for r, _, _ in batch.prefill) == [0, 1, 3]
        preempted = [r for r in requests if r.preemptions > before[r.index]]
        for victim in preempted:
            # No request still running has a worse priority than the victim's.
            assert all((r.priority, r.arrival_s) < (victim.priority, victim.arrival_s)
                       for r in sched.running.values())
        victims += preempted
        clock += 1.0
        sched.finish_step(batch, clock)
    assert {v.priority for v in victims} >= {1, 2}
    assert all(r.finished_s > 0 for r in requests)
    assert requests[1].preemptions == 0  # the best priority, the earliest arrival


@pytest.mark.parametrize("short_of", ["memory", "seats"])
@pytest.mark.parametrize("priority_preemption", [False, True])
def test_priority_preemption_takes_a_worse_requests_place(short_of, priority_preemption):
    # Two batch requests (priority 1) hold the pool (6 blocks: 3 each) or both seats; an
    # interactive one (priority 0) arrives. vLLM v1 lets it wait; with priority preemption
    # (vLLM v0) the latest batch request makes way at once.
    trace = trace_of([1, 1, 0], prompt_len=40, output_len=8)
    blocks, seats = (6, 8) if short_of == "memory" else (20, 2)
    allocator = PagedAllocator(num_blocks=blocks, block_size=16, enable_prefix_caching=False,
                               watermark=0.0)
    sched = Scheduler(allocator, SchedulerConfig(policy="priority", max_num_seqs=seats,
                                                 priority_preemption=priority_preemption))
    requests = [Request(trace, i, float(i)) for i in range(3)]
    sched.add(requests[0])
    sched.add(requests[1])
    sched.finish_step(sched.schedule(0.0), 1.0)
    assert len(sched.running) == 2
    sched.add(requests[2])
    batch = sched.schedule(1.0)
    seated = [r.index for r in sched.running.values()]
    if priority_preemption:
        assert seated == [0, 2] and batch.preempted == 1 and requests[1].preemptions == 1
        assert sched.waiting.head() is requests[1]
    else:
        assert seated == [0, 1] and batch.preempted == 0 and sched.head_blocked
    sched.finish_step(batch, 2.0)
    clock = 2.0
    while sched.running or sched.waiting:
        clock += 1.0
        sched.finish_step(sched.schedule(clock), clock)
    assert all(r.finished_s > 0 for r in requests)


def scenario(policy: str, **scheduler) -> dict:
    """Interactive (priority 0, a fifth) and batch requests on a pool that cannot hold them
    all: Llama-2-7B with 1.5 GiB of paged KV, arrivals faster than it serves."""
    return {
        "name": "priority", "model": "llama-2-7b", "memory": {"kv_memory_gib": 1.5},
        "workload": {"arrival": {"process": "poisson", "rate": 20},
                     "prompt_len": {"dist": "uniform", "low": 100, "high": 500},
                     "output_len": {"dist": "uniform", "low": 50, "high": 400},
                     "priorities": {0: 0.2, 1: 0.8}},
        "systems": [{"name": policy, "allocator": {"kind": "paged", "block_size": 16},
                     "scheduler": {"policy": policy, **scheduler}}],
        "stop": {"num_requests": 150}, "seed": 3, "slo": {"ttft_s": 2.0},
    }


def test_priority_serves_the_first_class_first_and_preempts_the_other():
    runs = {policy: run_scenario(scenario_from_dict(scenario(policy))).systems[policy]
            for policy in ("fcfs", "priority")}
    fcfs, priority = runs["fcfs"].summary, runs["priority"].summary
    # The same trace: the same classes in both runs.
    assert fcfs["priority_0_requests"] == priority["priority_0_requests"] > 15
    assert fcfs["priority_0_requests"] + fcfs["priority_1_requests"] == 150
    # Under FCFS both classes wait alike; by priority the first waits far less ...
    assert priority["priority_0_ttft_p99_s"] < fcfs["priority_0_ttft_p99_s"] / 3
    assert priority["priority_0_slo_attainment"] > fcfs["priority_0_slo_attainment"]
    # ... and the other pays: it waits longer and takes most preemptions (the first class
    # is preempted only when no request of the other is running).
    assert priority["priority_1_ttft_p50_s"] > fcfs["priority_1_ttft_p50_s"]

    def preempted_share(summary: dict, level: int) -> float:
        return summary[f"priority_{level}_preemptions"] / summary[f"priority_{level}_requests"]

    assert preempted_share(priority, 0) < preempted_share(fcfs, 0)
    assert preempted_share(priority, 0) < preempted_share(priority, 1) / 1.5
    requests = runs["priority"].requests
    assert requests.groupby("priority")["preemptions"].sum().to_dict() == {
        0: priority["priority_0_preemptions"], 1: priority["priority_1_preemptions"]}
    # Each class's longest token gaps, of its requests served.
    for level, part in requests[requests["finished_s"].notna()].groupby("priority"):
        assert priority[f"priority_{level}_max_itl_p99_s"] == pytest.approx(
            float(np.percentile(part["max_itl_s"].dropna(), 99)), rel=1e-12)


def test_per_priority_rows_in_the_summary_and_the_sweep_table():
    result = run_scenario(scenario_from_dict(scenario("priority")))
    summaries = {name: run.summary for name, run in result.systems.items()}
    text = format_summary(summaries)
    for label in ("priority 0: TTFT p99 (s)", "priority 1: requests within SLO",
                  "priority 1: preemptions"):
        assert label in text
    import pandas as pd

    table = pd.DataFrame([{"system": "priority", **summaries["priority"]}])
    metrics = sweep_metrics(table, ["throughput_tok_s"])
    assert metrics == ["throughput_tok_s", "priority_0_ttft_p99_s", "priority_0_slo_attainment",
                       "priority_1_ttft_p99_s", "priority_1_slo_attainment"]
    shown = labelled_sweep_table(table, metrics)
    assert "priority 0: TTFT p99 (s)" in shown.columns
    # The run report's latency distributions: a line per level.
    ttft = latency_cdfs(result).kvsim_data["TTFT (s)"]
    assert list(ttft.columns) == ["priority, priority 0", "priority, priority 1"]
    assert ttft.count().sum() == summaries["priority"]["completed"]
    # One level only: no per-priority rows at all.
    single = scenario("fcfs")
    del single["workload"]["priorities"]
    plain = run_scenario(scenario_from_dict(single)).systems["fcfs"].summary
    assert not any(key.startswith("priority_") for key in plain)
    assert "priority 0" not in format_summary({"fcfs": plain})


def test_drawn_priorities_follow_the_mix_and_change_nothing_else():
    spec = {"arrival": {"process": "poisson", "rate": 5},
            "prompt_len": {"dist": "uniform", "low": 10, "high": 100},
            "output_len": {"dist": "uniform", "low": 10, "high": 100}}
    plain = build_trace(SyntheticWorkload(**spec), seed=4, max_model_len=4096,
                        num_requests=4000)
    mixed = build_trace(SyntheticWorkload(**spec, priorities={0: 1, 3: 3}), seed=4,
                        max_model_len=4096, num_requests=4000)
    assert (plain.priority == 0).all()
    assert set(np.unique(mixed.priority)) == {0, 3}
    assert (mixed.priority == 0).mean() == pytest.approx(0.25, abs=0.03)
    frame, frame_mixed = plain.to_frame(), mixed.to_frame()
    assert frame.drop(columns="priority").equals(frame_mixed.drop(columns="priority"))
    again = build_trace(SyntheticWorkload(**spec, priorities={0: 1, 3: 3}), seed=4,
                        max_model_len=4096, num_requests=4000)
    assert (again.priority == mixed.priority).all()
    stats = trace_stats(mixed)
    assert stats["priority_0_share"] == (mixed.priority == 0).mean()
    assert stats["priority_0_share"] + stats["priority_3_share"] == 1
    assert not any(key.startswith("priority_") for key in trace_stats(plain))


def test_a_session_keeps_one_priority():
    spec = SyntheticWorkload(
        arrival={"process": "poisson", "rate": 2},
        prompt_len={"dist": "uniform", "low": 10, "high": 50},
        output_len={"dist": "uniform", "low": 10, "high": 50},
        sessions={"turns": {"dist": "uniform", "low": 2, "high": 5}},
        priorities={0: 1, 1: 1})
    trace = build_trace(spec, seed=0, max_model_len=4096, num_requests=300)
    per_session = trace.to_frame().groupby("session_id")["priority"].nunique()
    assert (per_session == 1).all()
    assert trace.to_frame().groupby("session_id")["priority"].first().nunique() == 2


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.csv"
    path.write_text(text)
    return path


def test_a_trace_column_gives_priorities(tmp_path):
    columns = {"arrival": "t", "prompt_len": "in", "output_len": "out", "priority": "prio"}
    path = write(tmp_path, "t,in,out,prio\n0,10,5,2\n1,20,5,-1\n")
    trace = build_trace(TraceWorkload(path=str(path), format="csv", columns=columns), seed=0,
                        max_model_len=4096)
    assert trace.priority.tolist() == [2, -1]
    bad = write(tmp_path, "t,in,out,prio\n0,10,5,2\n1,20,5,high\n")
    with pytest.raises(TraceImportError, match=r"p.csv:3: column 'prio': expected an integer, "
                                               r"got 'high'"):
        build_trace(TraceWorkload(path=str(bad), format="csv", columns=columns), seed=0,
                    max_model_len=4096)
    missing = write(tmp_path, "t,in,out\n0,10,5\n")
    with pytest.raises(TraceImportError, match="missing column 'prio'"):
        build_trace(TraceWorkload(path=str(missing), format="csv", columns=columns), seed=0,
                    max_model_len=4096)
    with pytest.raises(ValueError, match=r"give priorities or columns\.priority, not both"):
        TraceWorkload(path=str(path), format="csv", columns=columns, priorities={0: 1})


@pytest.mark.parametrize(("change", "message"), [
    ({"systems": [{"name": "s", "allocator": {"kind": "paged"},
                   "scheduler": {"policy": "priority",
                                 "preemption_victim": "fewest_generated"}}]},
     "preemption_victim applies to policy fcfs only"),
    ({"systems": [{"name": "s", "allocator": {"kind": "paged"},
                   "scheduler": {"policy": "lifo"}}]}, "scheduler.policy"),
    ({"systems": [{"name": "s", "allocator": {"kind": "paged"},
                   "scheduler": {"priority_preemption": True}}]},
     "priority_preemption needs policy: priority"),
])
def test_bad_settings_are_one_line_errors(change, message):
    data = {**scenario("fcfs"), **change}
    with pytest.raises(ScenarioError) as err:
        scenario_from_dict(data)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("mix", [{}, {0: 0}, {0: -1}])
def test_a_bad_priority_mix_is_refused(mix):
    data = scenario("fcfs")
    data["workload"]["priorities"] = mix
    with pytest.raises(ScenarioError, match=r"workload\.priorities"):
        scenario_from_dict(data)


def test_objectives_may_judge_some_levels_only():
    data = scenario("priority")
    data["slo"] = {"ttft_s": 2.0, "priorities": [0]}
    run = run_scenario(scenario_from_dict(data)).systems["priority"]
    summary, requests = run.summary, run.requests
    # Attainment and goodput are those of priority 0; each level still shows its own share.
    assert summary["slo_attainment"] == summary["priority_0_slo_attainment"] > 0.9
    assert summary["priority_1_slo_attainment"] < 0.5
    interactive = requests[requests["priority"] == 0]
    in_time = ((interactive["first_token_s"] - interactive["arrival_s"]) <= 2.0).sum()
    assert summary["goodput_req_s"] == pytest.approx(in_time / summary["makespan_s"])
    from sim.slo import describe_slo

    assert describe_slo(data["slo"]) == "TTFT ≤ 2 s for 90% of priority 0 requests"
    assert describe_slo({**data["slo"], "judge": "percentiles", "attainment": 0.99}) == (
        "p99 TTFT ≤ 2 s of priority 0 requests")
    data["slo"]["priorities"] = [7]
    with pytest.raises(WorkloadError, match=r"slo\.priorities: no request has priority 7; "
                                            r"the trace's levels: 0, 1"):
        run_scenario(scenario_from_dict(data))
