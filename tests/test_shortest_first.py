"""Shortest predicted job first: the waiting line ordered by the tokens a length predictor
expects each request still to generate."""

from __future__ import annotations

import numpy as np
import pytest

from sim.engine import run_scenario
from sim.memory import PagedAllocator
from sim.scenario import ScenarioError, SchedulerConfig, scenario_from_dict
from sim.scheduler import Request, Scheduler, WaitingLine
from workloads.trace import Trace


def burst(outputs: list[int]) -> Trace:
    count = len(outputs)
    return Trace.from_columns(arrival_s=np.zeros(count), prompt_len=np.full(count, 20),
                              output_len=np.array(outputs))


def test_the_line_by_length_seats_the_fewest_predicted_tokens_left_first():
    trace = burst([50, 10, 30, 10])
    line = WaitingLine("shortest_predicted")
    requests = [Request(trace, i, 0.0) for i in range(4)]
    for request, guess in zip(requests, [50, 10, 30, 10], strict=True):
        request.predicted_output = guess
        line.arrive(request)
    assert line.may_be_passed() and not line.by_priority
    assert [line.pop().index for _ in range(4)] == [1, 3, 2, 0]  # ties: arrival, index
    # A preempted request is placed by what is left of its guess.
    requests[0].gen_sync = 45
    line.readmit(requests[0])
    line.arrive(requests[2])
    assert line.head() is requests[0]


def test_a_short_arrival_is_seated_before_a_long_head_that_waits():
    # One seat: the long request 0 runs; 1 (long) and 2 (short) wait; 2 is seated next.
    trace = burst([40, 40, 5])
    allocator = PagedAllocator(num_blocks=64, block_size=16, enable_prefix_caching=False)
    sched = Scheduler(allocator, SchedulerConfig(policy="shortest_predicted", max_num_seqs=1),
                      debug=True, predicted_output=[40, 40, 5])
    requests = [Request(trace, i, 0.0) for i in range(3)]
    assert sched.add(requests[0])
    batch = sched.schedule(0.0)
    sched.finish_step(batch, 1.0)
    for request in requests[1:]:
        assert sched.add(request)
    clock, order = 1.0, []
    while sched.running or sched.waiting:
        batch = sched.schedule(clock)
        clock += 1.0
        order += [r.index for r in sched.finish_step(batch, clock)]
    assert order == [0, 2, 1]


def scenario(policy: str, outputs: list[int], **predictor) -> dict:
    system = {"name": "s", "allocator": {"kind": "paged"},
              "scheduler": {"policy": policy, "max_num_seqs": 1}}
    if predictor:
        system["predictor"] = predictor
    return {"name": "sjf", "model": "llama-2-7b", "memory": {"kv_memory_gib": 1},
            "workload": {"kind": "trace", "path": "burst.csv", "format": "csv",
                         "columns": {"arrival": "t", "prompt_len": "in",
                                     "output_len": "out"}},
            "systems": [system], "stop": {"num_requests": len(outputs)}}


@pytest.mark.parametrize(("policy", "expected"), [
    ("fcfs", [0, 1, 2, 3, 4]),
    ("shortest_predicted", [0, 4, 2, 3, 1]),  # 0 is seated before the rest arrive
])
def test_a_burst_is_served_shortest_first_with_a_perfect_predictor(tmp_path, policy,
                                                                    expected):
    outputs = [30, 90, 20, 60, 5]
    rows = "".join(f"{0.001 * i},20,{out}\n" for i, out in enumerate(outputs))
    (tmp_path / "burst.csv").write_text("t,in,out\n" + rows)
    data = scenario(policy, outputs, **({"sigma": 0} if policy != "fcfs" else {}))
    requests = run_scenario(scenario_from_dict(data), tmp_path).systems["s"].requests
    assert requests.sort_values("finished_s")["request"].tolist() == expected


@pytest.fixture(scope="module")
def overloaded():
    """600 requests at 12 req/s, past first come, first served's capacity: first come,
    first served, shortest predicted first, and the same aged at 5 s or by 25 tokens a
    second waited."""
    schedulers = {"fcfs": {}, "sjf": {"policy": "shortest_predicted"},
                  "aged": {"policy": "shortest_predicted", "max_wait_s": 5.0},
                  "linear": {"policy": "shortest_predicted", "aging_tokens_per_s": 25.0}}
    data = {
        "name": "sjf", "model": "llama-2-7b", "gpu": "a100-80g",
        "memory": {"kv_memory_gib": 8},
        "workload": {"arrival": {"process": "poisson", "rate": 12},
                     "prompt_len": {"dist": "lognormal", "mean": 200, "p99": 1500,
                                    "max": 2000},
                     "output_len": {"dist": "lognormal", "mean": 250, "p99": 1500,
                                    "max": 2048}},
        "systems": [{"name": name, "allocator": {"kind": "paged"}, "scheduler": scheduler,
                     **({"predictor": {"sigma": 0.5}} if scheduler else {})}
                    for name, scheduler in schedulers.items()],
        "stop": {"num_requests": 600},
    }
    return data, run_scenario(scenario_from_dict(data))


def waits(result) -> dict:
    """Each system's waits for a first token, per request."""
    return {name: run.requests["first_token_s"] - run.requests["arrival_s"]
            for name, run in result.systems.items()}


def test_shortest_first_trades_the_typical_wait_for_the_longest_ones(overloaded):
    _, result = overloaded
    fcfs, sjf = (result.systems[name].summary for name in ("fcfs", "sjf"))
    assert sjf["ttft_p50_s"] < 0.2 * fcfs["ttft_p50_s"]
    assert sjf["e2e_p50_s"] < fcfs["e2e_p50_s"]
    wait = waits(result)
    assert wait["sjf"].max() > wait["fcfs"].max()  # the longest requests wait longer
    assert sjf["reservation_overflows"] is None  # paged: the guess only orders the line


def test_settings_are_checked_in_one_line():
    data = scenario("fcfs", [1])
    data["systems"][0]["predictor"] = {"sigma": 0.5}
    with pytest.raises(ScenarioError, match="predictor: nothing in this system consults "
                                            "it") as err:
        scenario_from_dict(data)
    assert "\n" not in str(err.value)
    data = scenario("shortest", [1])
    with pytest.raises(ScenarioError, match=r"scheduler\.policy"):
        scenario_from_dict(data)
    # Without a predictor section, the default one (sigma 0.5) orders the line.
    system = scenario_from_dict(scenario("shortest_predicted", [1])).systems[0]
    assert system.uses_predictor and system.length_predictor.sigma == 0.5


def test_aging_seats_a_request_that_waited_long_enough_before_shorter_ones():
    trace = burst([50, 10, 30])
    line = WaitingLine("shortest_predicted", max_wait_s=2.0)
    requests = [Request(trace, i, float(i)) for i in range(3)]  # arrivals 0, 1, 2
    for request, guess in zip(requests, [50, 10, 30], strict=True):
        request.predicted_output = guess
        line.arrive(request)
    line.clock = 1.5
    assert line.head() is requests[1] and line.oldest_due_s() == 2.0
    line.clock = 2.0  # request 0 has waited 2 s: it goes first, then the order by length
    assert [line.pop().index for _ in range(2)] == [0, 1]
    assert len(line) == 1 and line.requests() == [requests[2]]
    assert line.oldest_due_s() == 4.0
    line.clock = 10.0
    assert line.pop() is requests[2] and not line
    # Popped by age, a request is gone from the order by length too: readmitted, it
    # stands once.
    line.readmit(requests[0])
    assert line.requests() == [requests[0]] and len(line) == 1


def test_aging_bounds_the_wait_of_long_requests_and_keeps_most_of_the_gain(overloaded):
    data, result = overloaded
    wait = waits(result)
    assert wait["aged"].max() < wait["sjf"].max()
    ttft = {name: run.summary["ttft_p50_s"] for name, run in result.systems.items()}
    assert ttft["aged"] < 0.5 * ttft["fcfs"]
    bad = dict(data["systems"][0], scheduler={"max_wait_s": 5.0})
    with pytest.raises(ScenarioError, match="max_wait_s needs policy: shortest_predicted"):
        scenario_from_dict({**data, "systems": [bad]})


def test_linear_aging_orders_by_tokens_left_less_a_rate_times_the_wait():
    # Request 0: 500 tokens, arrived at 0; request 1: 300 tokens, at 10 s. Shortest first
    # seats 1 first; at 25 tokens a second, 0 has waited 10 s longer, worth 250 tokens:
    # 500 - 250 < 300, so 0 goes first, whenever the line is looked at.
    trace = burst([500, 300])
    for aging, order in ((0.0, [1, 0]), (25.0, [0, 1]), (15.0, [1, 0])):
        line = WaitingLine("shortest_predicted", aging_tokens_per_s=aging)
        for index, (arrival, guess) in enumerate(((0.0, 500), (10.0, 300))):
            request = Request(trace, index, arrival)
            request.predicted_output = guess
            line.arrive(request)
        assert [line.pop().index for _ in range(2)] == order, aging


def seat_order(aging_tokens_per_s: float | None) -> list[int]:
    """One seat. Request 0 (3 tokens) runs from 0 s; request 1 (100 tokens) arrives at 0 s
    and waits; a short request (5 tokens) arrives every second from 1 s to 30 s, faster than
    they are served. The order in which the requests are seated."""
    outputs = [3, 100] + [5] * 30
    arrivals = [0.0, 0.0] + [float(t) for t in range(1, 31)]
    trace = Trace.from_columns(arrival_s=np.array(arrivals), prompt_len=np.full(32, 20),
                               output_len=np.array(outputs))
    allocator = PagedAllocator(num_blocks=256, block_size=16, enable_prefix_caching=False)
    config = SchedulerConfig(policy="shortest_predicted", max_num_seqs=1,
                             aging_tokens_per_s=aging_tokens_per_s)
    sched = Scheduler(allocator, config, debug=True, predicted_output=outputs)
    requests = [Request(trace, i, arrivals[i]) for i in range(32)]
    clock, arrived, seated = 0.0, 0, []
    while len(seated) < 32:
        assert clock < 1000, "not every request was seated"
        while arrived < 32 and arrivals[arrived] <= clock:
            assert sched.add(requests[arrived])
            arrived += 1
        batch = sched.schedule(clock)
        seated += [r.index for r, _, _ in batch.prefill]
        clock += 1.0
        sched.finish_step(batch, clock)
    return seated


def test_linear_aging_lets_a_long_request_in_once_its_wait_outweighs_its_length():
    # Shortest first seats the long request after every short one, for as long as short
    # ones keep coming. At 10 tokens a second, a short request arriving at t weighs
    # 5 + 10 t against the long one's 100: those arriving after 9.5 s go behind it.
    assert seat_order(None) == [0, *range(2, 32), 1]
    assert seat_order(10.0) == [0, *range(2, 11), 1, *range(11, 32)]
    # At 1 token a second it would take 95 s: longer than the stream lasts.
    assert seat_order(1.0) == seat_order(None)
    bad = {"name": "s", "allocator": {"kind": "paged"},
           "scheduler": {"aging_tokens_per_s": 5.0}}
    with pytest.raises(ScenarioError, match="aging_tokens_per_s needs policy: "
                       "shortest_predicted") as err:
        scenario_from_dict({**scenario("fcfs", [1]), "systems": [bad]})
    assert "\n" not in str(err.value)
