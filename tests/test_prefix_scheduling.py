"""Longest prefix match first (``scheduler.policy: lpm``): the waiting line ranked by the
prompt tokens each request finds in the prefix cache now, as SGLang's ``--schedule-policy
lpm`` ranks it; SGLang's other orders of its line: a walk down the cache's tree
(``dfs_weight``), a shuffle (``random``), and the longest max_tokens first (``lof``)."""

from __future__ import annotations

import random

import numpy as np
import pandas as pd
import pytest

from sim.engine import run_scenario
from sim.memory import PagedAllocator
from sim.scenario import ScenarioError, SchedulerConfig, scenario_from_dict
from sim.scheduler import Request, Scheduler, WaitingLine
from workloads.trace import UNIQUE_SEGMENT_BASE, Trace

GROUP_A, GROUP_B = 1, 2


def grouped(groups: list[int], prefix: int | list[int] = 64, own: int | list[int] = 20,
            output: int = 4) -> Trace:
    """A burst of requests, each a ``prefix``-token system prompt of its group and ``own``
    tokens of its own (one count for all, or one each)."""
    count = len(groups)
    owns = np.broadcast_to(np.asarray(own), count)
    prefixes = np.broadcast_to(np.asarray(prefix), count)
    ids = [seg for i, group in enumerate(groups) for seg in (group, UNIQUE_SEGMENT_BASE + i)]
    return Trace.from_columns(
        arrival_s=np.zeros(count), prompt_len=prefixes + owns,
        output_len=np.full(count, output),
        seg_offsets=np.arange(0, 2 * count + 1, 2), seg_ids=np.array(ids, dtype=np.int64),
        seg_lens=np.column_stack([prefixes, owns]).ravel())


def seating_order(groups: list[int], first: int = 1, prefix: int | list[int] = 64,
                  line_seed: str = "", **config) -> list[int]:
    """One seat: the ``first`` requests run first, one after the other, the rest wait
    behind them; the order they finish in."""
    trace = grouped(groups, prefix)
    allocator = PagedAllocator(num_blocks=64, block_size=16)
    sched = Scheduler(allocator, SchedulerConfig(max_num_seqs=1, **config), debug=True,
                      line_seed=line_seed)
    requests = [Request(trace, i, 0.0) for i in range(len(groups))]
    clock = 0.0
    order = []
    for request in requests[:first]:
        assert sched.add(request)
        while request.admitted_s < 0:
            order += [r.index for r in sched.finish_step(sched.schedule(clock), clock + 1.0)]
            clock += 1.0
    for request in requests[first:]:
        assert sched.add(request)
    while sched.running or sched.waiting:
        batch = sched.schedule(clock)
        clock += 1.0
        order += [r.index for r in sched.finish_step(batch, clock)]
    return order


def test_the_line_seats_whoever_finds_most_of_its_prompt_cached():
    groups = [GROUP_A, GROUP_B, GROUP_A, GROUP_B, GROUP_A]
    assert seating_order(groups) == [0, 1, 2, 3, 4]
    # Request 0 left group A's prompt cached: A's requests go first, then B's (1 warmed
    # B's, but 4 still ties with 3, and the earlier goes first).
    assert seating_order(groups, policy="lpm") == [0, 2, 4, 1, 3]
    assert seating_order(groups, policy="lpm", max_lpm_queue_size=0) == [0, 2, 4, 1, 3]
    # Four waiting past a limit of three: first come, first served (1, of group B), then by
    # prefix, where every group is cached now: in their order.
    assert seating_order(groups, policy="lpm", max_lpm_queue_size=3) == [0, 1, 2, 3, 4]
    assert seating_order(groups, policy="lpm", max_lpm_queue_size=4) == [0, 2, 4, 1, 3]


def test_without_a_prefix_cache_the_line_is_first_come_first_served():
    groups = [GROUP_A, GROUP_B, GROUP_A, GROUP_B, GROUP_A]
    trace = grouped(groups)
    allocator = PagedAllocator(num_blocks=64, block_size=16, enable_prefix_caching=False)
    sched = Scheduler(allocator, SchedulerConfig(policy="lpm"))
    assert sched.waiting.by_prefix and not sched.waiting.may_be_passed()
    assert sched.waiting.prefix_tokens is None
    for i in range(len(groups)):
        sched.add(Request(trace, i, 0.0))
    assert [sched.waiting.pop().index for _ in groups] == [0, 1, 2, 3, 4]


def test_the_line_is_ranked_stably_and_left_alone_past_the_limit():
    trace = grouped([GROUP_A] * 5)
    requests = [Request(trace, i, 0.0) for i in range(5)]
    cached = {0: 0, 1: 64, 2: 32, 3: 128, 4: 0}
    line = WaitingLine("lpm", max_lpm_queue_size=3)
    line.prefix_tokens = lambda request: cached[request.index]
    for request in requests[:3]:
        line.arrive(request)
    line.rank()
    assert [r.index for r in line.requests()] == [1, 2, 0]
    # Equals keep the order they had (SGLang sorts its list in place, stably).
    cached.update({0: 64, 2: 64})
    line.rank()
    assert [r.index for r in line.requests()] == [1, 2, 0]
    # Five waiting, past the limit: the order of the last ranking, then the arrivals.
    line.arrive(requests[3])
    line.arrive(requests[4])
    assert not line.ranks()
    line.rank()
    assert [line.pop().index for _ in range(2)] == [1, 2]
    assert line.ranks()  # three again: ranked, the last arrival first
    line.rank()
    assert [line.pop().index for _ in range(3)] == [3, 0, 4]


def test_a_full_batch_ranks_nobody():
    # As SGLang's scheduler, which ranks its line only with a seat to fill: request 0 holds
    # the only seat while 1 (group B) and 2 (group A, cached) wait; 3 then arrives, past the
    # limit of two, and the line is still in the order they came.
    trace = grouped([GROUP_A, GROUP_B, GROUP_A, GROUP_B])
    allocator = PagedAllocator(num_blocks=64, block_size=16)
    sched = Scheduler(allocator, SchedulerConfig(max_num_seqs=1, policy="lpm",
                                                 max_lpm_queue_size=2))
    requests = [Request(trace, i, 0.0) for i in range(4)]
    sched.add(requests[0])
    sched.finish_step(sched.schedule(0.0), 1.0)
    sched.add(requests[1])
    sched.add(requests[2])
    sched.finish_step(sched.schedule(1.0), 2.0)
    sched.add(requests[3])
    clock, order = 2.0, []
    while sched.running or sched.waiting:
        order += [r.index for r in sched.finish_step(sched.schedule(clock), clock + 1.0)]
        clock += 1.0
    assert order == [0, 1, 2, 3]


def blocked_behind_a_long_prompt(max_lpm_queue_size: int) -> tuple[Scheduler, list[Request]]:
    """Request 0 decodes and keeps group A's prompt cached; request 1 (group B) waits,
    far too long for the pool left; request 2 (group A, short) is about to arrive."""
    trace = grouped([GROUP_A, GROUP_B, GROUP_A], own=[400, 900, 20], output=50)
    allocator = PagedAllocator(num_blocks=70, block_size=16)  # 1 needs 61 of the 41 left
    sched = Scheduler(allocator, SchedulerConfig(policy="lpm",
                                                 max_lpm_queue_size=max_lpm_queue_size))
    requests = [Request(trace, i, 0.0) for i in range(3)]
    sched.add(requests[0])
    sched.finish_step(sched.schedule(0.0), 1.0)
    sched.add(requests[1])
    sched.finish_step(sched.schedule(1.0), 2.0)
    assert requests[1].admitted_s == -1.0
    assert sched.fast_step_ready()  # nothing could be seated: pure decode may run on
    return sched, requests


def test_an_arrival_ranked_first_is_seated_during_decode():
    sched, requests = blocked_behind_a_long_prompt(128)
    sched.add(requests[2])
    assert not sched.fast_step_ready()  # the next ranking puts it first: try it
    sched.finish_step(sched.schedule(2.0), 3.0)
    assert requests[2].admitted_s == 2.0 and requests[1].admitted_s == -1.0


def test_an_arrival_past_the_limit_waits_behind_the_blocked_head():
    sched, requests = blocked_behind_a_long_prompt(1)
    sched.add(requests[2])
    assert sched.fast_step_ready()  # two waiting, past the limit: nobody is ranked
    sched.finish_step(sched.schedule(2.0), 3.0)
    assert requests[2].admitted_s == requests[1].admitted_s == -1.0


def many_groups(policy: str, kind: str = "paged", **allocator) -> dict:
    """40 system prompts of 1,536 tokens, 12 requests a second: more than a 12 GiB pool
    keeps cached, and more than first come, first served sustains."""
    return {"name": "groups", "model": "llama-2-7b", "memory": {"kv_memory_gib": 12},
            "workload": {"arrival": {"process": "poisson", "rate": 12},
                         "prompt_len": {"dist": "uniform", "low": 32, "high": 256},
                         "output_len": {"dist": "uniform", "low": 16, "high": 128},
                         "prefix_groups": {"groups": 40, "length": 1536, "fraction": 1.0}},
            "systems": [{"name": "s", "allocator": {"kind": kind, **allocator},
                         "scheduler": {"policy": policy}}],
            "stop": {"num_requests": 2000}}


@pytest.mark.parametrize("policy", ["lpm", "dfs_weight"])
def test_seating_cached_prompts_first_raises_hits_and_throughput(policy):
    runs = {p: run_scenario(scenario_from_dict(many_groups(p))).systems["s"]
            for p in ("fcfs", policy)}
    fcfs, ranked = runs["fcfs"].summary, runs[policy].summary
    assert ranked["completed"] == fcfs["completed"] == 2000
    # lpm: 70 % against 56 %, 891 tok/s against 739
    assert ranked["prefix_hit_rate"] > fcfs["prefix_hit_rate"] + 0.1
    assert ranked["throughput_tok_s"] > 1.15 * fcfs["throughput_tok_s"]
    assert ranked["ttft_p50_s"] < fcfs["ttft_p50_s"]
    # Seated out of arrival order: some request waits for one that came after it.
    seated = runs[policy].requests.sort_values("arrival_s")["admitted_s"].to_numpy()
    assert (np.diff(seated) < 0).any()
    assert (np.diff(runs["fcfs"].requests.sort_values("arrival_s")["admitted_s"]
                    .to_numpy()) >= 0).all()


@pytest.mark.parametrize("policy", ["lpm", "dfs_weight"])
@pytest.mark.parametrize("allocator", [{"kind": "contiguous"},
                                       {"kind": "paged", "prefix_caching": False}],
                         ids=["contiguous", "paged without a cache"])
def test_a_cache_aware_line_without_a_prefix_cache_changes_nothing(allocator, policy):
    allocator = dict(allocator)  # (shared by the parameters' cases)
    kind = allocator.pop("kind")
    runs = [run_scenario(scenario_from_dict(many_groups(p, kind, **allocator)))
            for p in ("fcfs", policy)]
    assert runs[0].systems["s"].requests.equals(runs[1].systems["s"].requests)
    parsed = scenario_from_dict(many_groups(policy, kind, **allocator))
    assert parsed.setting_notes() == [f"system 's': scheduler.policy {policy} is first come, "
                                      "first served here: its memory has no prefix cache to "
                                      "rank the line by"]


def test_a_queue_limit_without_lpm_is_refused():
    data = many_groups("fcfs")
    data["systems"][0]["scheduler"]["max_lpm_queue_size"] = 16
    with pytest.raises(ScenarioError, match=r"systems\[0\]\.scheduler: max_lpm_queue_size "
                                            r"needs policy: lpm"):
        scenario_from_dict(data)
    data["systems"][0]["scheduler"]["max_lpm_queue_size"] = -1
    data["systems"][0]["scheduler"]["policy"] = "lpm"
    with pytest.raises(ScenarioError, match=r"max_lpm_queue_size: Input should be greater "
                                            r"than or equal to 0"):
        scenario_from_dict(data)


def crowded_groups(seed: int) -> dict:
    """A small pool, a few shared prompts and a line by prefix, drawn by ``seed``: where
    a block crossing during a run of decode steps may evict what ranked the head first, and
    an arrival may outrank it."""
    rng = random.Random(seed)
    data = many_groups("lpm")
    data["seed"] = seed
    data["stop"]["num_requests"] = rng.choice([60, 150])
    data["memory"]["kv_memory_gib"] = rng.choice([0.25, 0.5, 1.0])
    workload = data["workload"]
    workload["arrival"]["rate"] = rng.choice([10, 40, 200])
    workload["prefix_groups"] = {"groups": rng.choice([2, 4, 8]),
                                 "length": rng.choice([48, 128, 400]),
                                 "fraction": rng.choice([0.5, 0.8, 1.0])}
    workload["prompt_len"] = {"dist": "uniform", "low": 8, "high": rng.choice([40, 300])}
    workload["output_len"] = {"dist": "uniform", "low": 1, "high": rng.choice([60, 300])}
    system = data["systems"][0]
    system["scheduler"].update(max_lpm_queue_size=rng.choice([0, 4, 128]),
                               max_num_seqs=rng.choice([4, 16, 256]),
                               chunked_prefill=rng.random() < 0.3)
    system["allocator"].update(block_size=rng.choice([4, 16]),
                               eviction=rng.choice(["lru", "fifo", "lfu"]))
    return data


# Seeds 5 and 12 seat another head after an eviction, 62 after an arrival: stepping tries
# them there, and so must a jump.
@pytest.mark.parametrize("seed", [*range(13), 62])
def test_jump_equals_step_where_evictions_and_arrivals_reorder_the_line(seed):
    data = crowded_groups(seed)
    tables = {}
    for mode in ("jump", "step"):
        data["engine"] = {"mode": mode, "debug_invariants": mode == "step"}
        tables[mode] = run_scenario(scenario_from_dict(data)).systems["s"]
    pd.testing.assert_frame_equal(tables["jump"].requests, tables["step"].requests)
    assert len(tables["jump"].steps) < len(tables["step"].steps)


# ---------------------------------------------------------------- dfs_weight and random
def test_the_walk_down_the_cache_tree_seats_the_biggest_cached_group_first():
    # Two system prompts cached, A's of 128 tokens, B's of 32 (requests 0 and 1 read
    # them); then one more of A waits, and three of B. Longest prefix match seats A's
    # first (more of its prompt is cached); the walk, B's three, the heavier branch.
    groups = [GROUP_A, GROUP_B, GROUP_A, GROUP_B, GROUP_B, GROUP_B]
    prefixes = [128, 32, 128, 32, 32, 32]
    assert seating_order(groups, first=2, prefix=prefixes) == [0, 1, 2, 3, 4, 5]
    assert seating_order(groups, first=2, prefix=prefixes, policy="lpm") == [0, 1, 2, 3, 4, 5]
    assert seating_order(groups, first=2, prefix=prefixes,
                         policy="dfs_weight") == [0, 1, 3, 4, 5, 2]


def test_the_walk_takes_the_heavier_child_first_and_a_blocks_own_requests_last():
    trace = grouped([GROUP_A] * 8)
    requests = [Request(trace, i, 0.0) for i in range(8)]
    # Paths down the tree (block hashes): a with children b (two requests) and e (one),
    # c with child d; request 0 finds nothing cached, 7 as much as 6 but its own way.
    paths = {0: [], 1: [10, 11], 2: [10], 3: [30], 4: [10, 11], 5: [30, 31], 6: [10, 12],
             7: [40]}
    line = WaitingLine("dfs_weight")
    line.cached_path = lambda request: paths[request.index]
    for request in requests:
        line.arrive(request)
    assert line.ranks() and line.may_be_passed()
    line.rank()
    # a (4 requests): b's two in the line's order, e's, then a's own; c (2): d's, c's
    # own; f (1); then whoever hangs from the root.
    assert [r.index for r in line.requests()] == [1, 4, 6, 2, 5, 3, 7, 0]
    # Ties between children go in the order the line met them (not by hash: 20 < 90).
    paths.update({1: [90], 4: [90], 6: [90, 91], 2: [20], 5: [20, 21], 3: [20]})
    line.rank()
    assert [r.index for r in line.requests()] == [6, 1, 4, 5, 2, 3, 7, 0]


def test_a_random_line_is_shuffled_each_round_the_same_way_for_a_seed():
    trace = grouped([GROUP_A] * 12)

    def rounds(seed: str) -> list[list[int]]:
        line = WaitingLine("random", seed=seed)
        for i in range(12):
            line.arrive(Request(trace, i, 0.0))
        assert line.ranks() and line.reshuffles()
        orders = []
        for _ in range(3):
            line.rank()
            orders.append([r.index for r in line.requests()])
        return orders

    first = rounds("0 0")
    assert first == rounds("0 0")  # the same draws for the same seed
    assert first != rounds("1 0")
    assert all(sorted(order) == list(range(12)) for order in first)
    assert first[0] != list(range(12)) and first[0] != first[1] != first[2]
    # Seated in a shuffled order, one seat at a time, each round drawing anew.
    groups = [GROUP_A, GROUP_B] * 4
    orders = {seed: seating_order(groups, policy="random", line_seed=seed)
              for seed in ("0 0", "1 0", "2 0")}
    assert all(order[0] == 0 and sorted(order) == list(range(8)) for order in orders.values())
    assert len({tuple(order) for order in orders.values()}) == 3
    assert seating_order(groups, policy="random", line_seed="1 0") == orders["1 0"]


def test_a_random_line_is_the_same_for_a_seed_and_another_for_another():
    data = many_groups("random")
    data["stop"]["num_requests"] = 300
    runs = [run_scenario(scenario_from_dict({**data, "seed": seed})).systems["s"].requests
            for seed in (0, 0)]
    pd.testing.assert_frame_equal(runs[0], runs[1])
    # Seated out of arrival order.
    seated = runs[0].sort_values("arrival_s")["admitted_s"].to_numpy()
    assert (np.diff(seated) < 0).any()
    # Another seed draws other shuffles of the same trace (the workload's own draws are
    # the same: its seed is the scenario's, so compare with a shuffle of the line alone).
    other = run_scenario(scenario_from_dict({**data, "seed": 1})).systems["s"].requests
    assert not other.equals(runs[0])


@pytest.mark.parametrize("policy", ["dfs_weight", "random"])
@pytest.mark.parametrize("seed", range(1, 5))  # (seed 0's 150 requests take seconds)
def test_jump_equals_step_for_the_other_orders(policy, seed):
    data = crowded_groups(seed)
    scheduler = data["systems"][0]["scheduler"]
    scheduler["policy"] = policy
    del scheduler["max_lpm_queue_size"]
    tables = {}
    for mode in ("jump", "step"):
        data["engine"] = {"mode": mode, "debug_invariants": mode == "step"}
        tables[mode] = run_scenario(scenario_from_dict(data)).systems["s"]
    pd.testing.assert_frame_equal(tables["jump"].requests, tables["step"].requests)
    assert len(tables["jump"].steps) <= len(tables["step"].steps)


def test_the_longest_output_first_line_sorts_by_max_tokens_stably(tmp_path):
    trace = Trace.from_columns(arrival_s=np.zeros(5), prompt_len=np.full(5, 10),
                               output_len=np.full(5, 3), max_tokens=np.array([5, 50, 20, 50, 3]))
    line = WaitingLine("lof")
    requests = [Request(trace, i, 0.0) for i in range(5)]
    for request in requests:
        line.arrive(request)
    assert line.ranks() and line.may_be_passed() and not line.reshuffles()
    line.rank()
    assert [r.index for r in line.requests()] == [1, 3, 2, 0, 4]
    # Seated, then preempted, a request goes back to the front: first among its equals.
    assert [line.pop().index for _ in range(2)] == [1, 3]
    line.readmit(requests[3])
    line.arrive(requests[1])
    line.rank()
    assert [r.index for r in line.requests()] == [3, 1, 2, 0, 4]
    # One seat, four requests of a trace's own max_tokens: seated by it, most first.
    (tmp_path / "t.csv").write_text("t,p,o,m\n0,50,8,8\n0,50,8,400\n0,50,8,30\n0,50,8,900\n")
    data = {"name": "lof", "model": "llama-2-7b", "memory": {"kv_memory_gib": 1},
            "workload": {"kind": "trace", "path": "t.csv", "format": "csv",
                         "columns": {"arrival": "t", "prompt_len": "p", "output_len": "o",
                                     "max_tokens": "m"}},
            "systems": [{"name": "s", "allocator": {"kind": "paged"},
                         "scheduler": {"policy": "lof", "max_num_seqs": 1}}],
            "stop": {"num_requests": 4}}
    for mode in ("jump", "step"):
        data["engine"] = {"mode": mode}
        seated = run_scenario(scenario_from_dict(data), base_dir=tmp_path).systems["s"]
        assert seated.requests.sort_values("admitted_s")["request"].tolist() == [3, 1, 2, 0]
    # A synthetic workload gives every request the same max_tokens: said so.
    notes = scenario_from_dict(many_groups("lof")).setting_notes()
    assert notes == ["system 's': scheduler.policy lof orders by each request's max_tokens, "
                     "which a synthetic workload gives all alike but where the context limit "
                     "cuts it (nearly first come, first served); a trace's columns.max_tokens "
                     "gives each its own"]
