"""Routers: SGLang's cache-aware rule, Dynamo's KV cost and shortest queue, learned only from
the past, the same in jump and step mode, and what they do to a shared-prefix workload."""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from itertools import pairwise
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import kvsim_in_process

from sim.engine import MEMORY_COLUMNS, run_scenario, scenario_trace
from sim.metrics import format_summary
from sim.results import RunResult
from sim.router import ApproximateTree, CacheEvents, Router, prefix_chain
from sim.scenario import ScenarioError, scenario_from_dict


def routed(replicas: int, policy: str, *, seed: int = 0, requests: int = 400,
           rate: float = 40, **router) -> dict:
    return {
        "name": f"route-{policy}",
        "model": "llama-2-7b",
        "memory": {"kv_memory_gib": 1.5},
        "workload": {
            "arrival": {"process": "poisson", "rate": rate},
            "prompt_len": {"dist": "lognormal", "mean": 150, "sigma": 1, "max": 1500},
            "output_len": {"dist": "uniform", "low": 10, "high": 300},
            "prefix_groups": {"groups": 12, "length": 600, "fraction": 0.9, "zipf_s": 0.3},
        },
        "systems": [{"name": "paged", "allocator": {"kind": "paged"}}],
        "stop": {"num_requests": requests},
        "seed": seed,
        "engine": {"replicas": replicas, "router": {"policy": policy, **router}},
    }


def test_prefix_chain_and_tree():
    a = prefix_chain([(1, 100), (2, 50), (3, 10)])
    b = prefix_chain([(1, 100), (2, 50), (4, 10)])
    assert [k for k, _ in a[:2]] == [k for k, _ in b[:2]] and a[2][0] != b[2][0]
    assert prefix_chain([(2, 50)])[0][0] != a[1][0]  # a key names the whole prefix
    tree = ApproximateTree(capacity=200)
    tree.insert(a)
    assert tree.size == 160 and tree.match(b) == 150 and tree.match(a) == 160
    tree.insert(prefix_chain([(9, 100)]))  # 260 > 200: least recently sent out first,
    assert tree.size == 200 and tree.match(a) == tree.match(b) == 100  # leaves before roots
    assert tree.match(prefix_chain([(9, 100)])) == 100
    tree.insert(prefix_chain([(1, 100), (5, 80)]))  # touches [1] and evicts [9], then a's root
    assert tree.match(a) == 100 and tree.match(prefix_chain([(9, 100)])) == 0


def test_a_tree_with_a_time_to_live_forgets_what_was_not_sent_for_that_long():
    # Dynamo's router without KV events: a prefix is believed cached for ttl_s after it was
    # last sent, however much was sent since (it knows nothing of the pool's size).
    a, b = prefix_chain([(1, 100), (2, 50)]), prefix_chain([(1, 100), (3, 70)])
    tree = ApproximateTree(None, ttl_s=120.0)
    tree.insert(a, 0.0)
    tree.insert(b, 50.0)  # sends [1] again: its clock restarts
    tree.insert(prefix_chain([(9, 10**9)]), 60.0)  # no capacity to overflow
    assert tree.size == 100 + 50 + 70 + 10**9
    tree.expire(119.9)
    assert tree.match(a) == 150
    tree.expire(120.0)  # a's leaf, last sent at 0, is forgotten; the rest stay
    assert tree.match(a) == 100 and tree.match(b) == 170 and tree.size == 170 + 10**9
    tree.expire(180.0)
    assert tree.size == 0 and tree.match(b) == 0


def test_kv_aware_believes_a_prefix_cached_for_its_time_to_live():
    first = [(1, 600), (7, 100)]
    for ttl_s, later in ((120.0, 0), (1000.0, 1)):
        # A 100-token pool: SGLang's memory would not keep 700 tokens, Dynamo's does.
        router = Router("kv_aware", 2, cache_slots=100, ttl_s=ttl_s)
        router.assign(1, first, request=0)
        router.prefilled(0, 1, 1.0)
        router.finished(0, 1, 5.0)
        assert router.route(119.0, first, 700) == 1  # still believed cached there
        # Sent at 0 and not since: forgotten at 120 s, when both replicas cost the same
        # and the first wins; a longer time to live keeps it.
        assert router.route(121.0, first, 700) == later
    # A session's later turn, sent at its arrival, restarts the clock.
    router = Router("kv_aware", 2, cache_slots=100)
    router.assign(1, first, request=0)
    router.finished(0, 1, 5.0)
    router.expect(1, 1, 100.0, first)
    router.finished(1, 1, 110.0)
    assert router.route(200.0, first, 700) == 1
    assert router.route(221.0, first, 700) == 0
    # Sent at 221 (the last route's time), then believed cached until 341.
    router.assign(1, first, request=2)  # routed at 221
    router.finished(2, 1, 230.0)
    assert router.route(340.0, first, 700) == 1
    assert router.route(341.0, first, 700) == 0
    # A later turn arriving when its prefix is forgotten queues its whole prompt there.
    router = Router("kv_aware", 2, cache_slots=100)
    router.assign(1, first, request=0)
    router.prefilled(0, 1, 1.0)
    router.finished(0, 1, 5.0)
    router.expect(1, 1, 200.0, first)
    router.route(201.0, first, 700)
    assert router.prefill_tokens == [0, 700]


def test_kv_events_tell_kv_aware_what_each_replica_caches_and_when():
    # Two replicas, 4-token blocks; prompt A (12 tokens) is looked up through its blocks 0
    # and 1 (never the block of its last token). Both replicas logged A's blocks as stored,
    # and replica 0 its block 1 as removed at 1.0.
    prompt = [(7, 12)]
    caches = CacheEvents([deque(), deque()], 4)
    first, second = caches.block_hashes(prompt)
    logs = ([(0.5, first, True), (0.5, second, True), (1.0, second, False)],
            [(0.8, first, True), (0.8, second, True)])

    def route_at(now_s: float, events: bool, interval_s: float = 0.0) -> int:
        router = Router("kv_aware", 2, cache_slots=1000, track_prefill_tokens=False,
                        stats_interval_s=interval_s)
        if events:
            caches = CacheEvents([deque(log) for log in logs], 4)
            router.watch_caches(caches)
        router.route(0.0, prompt, 12)
        router.assign(0, prompt, 0)  # sent to replica 0, and finished there
        router.finished(0, 0, 0.1)
        return router.route(now_s, prompt, 12)

    # Without events the router believes replica 0 holds A, whatever happened there.
    assert [route_at(t, events=False) for t in (0.9, 1.0, 2.0)] == [0, 0, 0]
    # With them: both hold 8 tokens at 0.9 (a tie: the first); an event at the very time
    # of the arrival is not yet known; after it, replica 1 holds more.
    assert [route_at(t, events=True) for t in (0.9, 1.0, 2.0)] == [0, 0, 1]
    # Reported every second, the removal at 1.0 (just after the report at 1.0) is known at
    # 2.0, not at 1.9, when fresh events have told of it long before.
    assert route_at(1.9, events=True) == 1
    assert [route_at(t, events=True, interval_s=1.0) for t in (1.9, 2.0)] == [0, 1]
    caches.held[1] = {second}  # a prompt's cached run starts at its first block
    assert caches.cached_tokens(1, [first, second]) == 0


def test_kv_events_route_by_the_replicas_real_caches_in_the_engine():
    # Pools too small for the 12 shared prefixes: the belief of a router without events
    # (what it sent for 120 s) outlives what the pools hold, the KV events do not, so the
    # two route differently; with events too, jumping routes exactly as stepping.
    data = routed(3, "kv_aware", requests=300, rate=60, kv_events=True)
    data["memory"]["kv_memory_gib"] = 0.5
    runs = {}
    for mode in ("jump", "step"):
        data["engine"]["mode"] = mode
        runs[mode] = run_scenario(scenario_from_dict(data)).systems["paged"]
    pd.testing.assert_frame_equal(runs["jump"].requests, runs["step"].requests)
    del data["engine"]["router"]["kv_events"]
    believed = run_scenario(scenario_from_dict(data)).systems["paged"]
    assert (believed.requests["replica"] != runs["jump"].requests["replica"]).any()


def test_router_rules():
    chain = [(1, 600), (7, 100)]
    router = Router("cache_aware", 3, cache_slots=10_000, balance_abs_threshold=2)
    # Nothing cached anywhere: the replica caching least (ties: the first).
    assert router.route(0.0, chain, 700) == 0
    router.assign(0, chain, request=0)
    # 600 of 650 tokens cached on replica 0: over the 0.5 threshold, so there.
    assert router.route(1.0, [(1, 600), (8, 50)], 650) == 0
    router.assign(0, [(1, 600), (8, 50)], request=1)
    # A prompt mostly its own: below the threshold, the replica caching least.
    assert router.route(2.0, [(1, 600), (9, 2000)], 2600) == 1
    router.assign(1, [(1, 600), (9, 2000)], request=2)
    # Replica 0 holds 2 running requests, replica 2 none: 2 - 0 is not > 2, still balanced.
    assert router.route(3.0, chain, 700) == 0
    router.assign(0, chain, request=3)
    # 3 against 0: imbalanced, so the least loaded, whatever the cache says.
    assert router.route(4.0, chain, 700) == 2
    router.assign(2, chain, request=4)
    # A finish counts only once its time has passed, never before; of two replicas that
    # hold the prompt, the less loaded.
    for request in range(3):
        router.finished(request, 0, 10.0)
    assert router.route(10.0, chain, 700) == 2 and router.load == [3, 1, 1]
    router.assign(2, chain, request=5)
    assert router.route(10.5, chain, 700) == 0 and router.load == [0, 1, 2]
    shortest = Router("least_loaded", 2, cache_slots=10_000)
    shortest.assign(0, chain, request=6)
    assert shortest.route(0.0, chain, 700) == 1


def send(router: Router, replica: int, chain: list[tuple[int, int]], request: int,
         taken_s: float) -> None:
    """Route ``request`` to ``replica``, whose engine takes it in at ``taken_s``."""
    router.assign(replica, chain, request)
    router.taken_in(request, replica, taken_s)


def test_vllm_dp_weighs_a_waiting_request_four_times_a_running_one():
    chain = [(1, 100)]
    router = Router("vllm_dp", 3, cache_slots=10_000)
    assert router.route(0.0, chain, 100) == 0  # all alike: the first
    for request, replica in ((0, 0), (1, 0), (2, 0), (3, 1)):
        send(router, replica, chain, request, 0.0)
    # Replica 0 runs three (seated at 1.0), replica 1 has one waiting: 3 against 4.
    for request in range(3):
        router.admitted(request, 0, 1.0)
    assert router.route(1.0, chain, 100) == 2  # (a seating counts only once it is past)
    send(router, 2, chain, 4, 1.0)
    router.admitted(4, 2, 1.5)
    # Now 3 against 4 against 1: replica 2, seated, though it holds as many as replica 1.
    assert router.route(2.0, chain, 100) == 2 and router.waiting == [0, 1, 0]
    send(router, 2, chain, 5, 2.0)
    # 3, 4, 1 + 4 (sent: waiting in the front end's copy; taken in: heard at the next 2.0+)
    assert router.route(2.0, chain, 100) == 0
    # A request finished unseated (one token, or a prefill replica's) waits no more; a
    # session's later turn waits from its intake on.
    router.finished(3, 1, 3.0)
    router.expect(6, 1, 3.5, chain)
    router.taken_in(6, 1, 3.5)
    router.route(3.2, chain, 100)
    assert router.waiting == [0, 0, 1] and router.load == [3, 0, 2]
    router.route(4.0, chain, 100)
    assert router.waiting == [0, 1, 1] and router.load == [3, 1, 2]
    # One waiting request weighs as four running: 4 running against 1 waiting is a tie
    # (the first wins), 5 running against it is not.
    weighed = Router("vllm_dp", 3, cache_slots=10_000)
    for request, replica in enumerate([0] * 4 + [1] + [2] * 5):
        send(weighed, replica, chain, request, 0.0)
        if replica != 1:
            weighed.admitted(request, replica, 0.0)
    assert weighed.route(1.0, chain, 100) == 0
    weighed.finished(0, 0, 1.0)
    send(weighed, 2, chain, 10, 1.0)
    weighed.admitted(10, 2, 1.0)
    assert weighed.route(2.0, chain, 100) == 0  # 3, 4, 6
    send(weighed, 0, chain, 11, 2.0)
    weighed.admitted(11, 0, 2.0)
    send(weighed, 0, chain, 12, 2.0)
    weighed.admitted(12, 0, 2.0)
    assert weighed.route(3.0, chain, 100) == 1  # 5, 4, 6
    # A preempted request waits again, as vLLM puts it back in its waiting queue, until it
    # is seated again.
    again = Router("vllm_dp", 2, cache_slots=10_000)
    for request, replica in ((0, 0), (1, 1), (2, 1)):
        send(again, replica, chain, request, 0.0)
        again.admitted(request, replica, 0.0)
    assert again.route(0.5, chain, 100) == 0  # 1 running against 2
    again.preempted(0, 0, 1.0)
    assert again.route(1.5, chain, 100) == 1 and again.waiting == [1, 0]  # 4 against 2
    again.admitted(0, 0, 2.0)
    assert again.route(2.5, chain, 100) == 0 and again.waiting == [0, 0]


def test_vllm_dp_2026_spreads_a_burst_and_rotates_its_scan():
    # vLLM's balancer since July 2026: waiting + running, a request the front end sent since
    # the last publication waiting; ties to the first from a scan start that moves on by one
    # at each route, so that replicas alike after a publication are not taken in one order.
    chain = [(1, 100)]
    router = Router("vllm_dp_2026", 3, cache_slots=10_000, stats_interval_s=0.1)
    picks = []
    for request in range(4):
        picks.append(router.route(0.01 * (request + 1), chain, 100))
        send(router, picks[-1], chain, request, 0.01 * (request + 1))
    assert picks == [0, 1, 2, 0] and router.inflight == [[2, 1, 1]]
    # Every answer ends at 0.05: the front end sees it at once, the counts at 0.1.
    for request, replica in enumerate(picks):
        router.finished(request, replica, 0.05)
    router.route(0.06, chain, 100)
    assert router.inflight == [[0, 0, 0]] and router.load == [0, 0, 0]
    assert router._sent_since == [[2, 1, 1]]  # (counted as waiting until published)
    # Published: all alike, the scan starting at replica 2 now (0 under vllm_dp).
    assert router.route(0.15, chain, 100) == 2
    assert router.route(0.16, chain, 100) == 0  # (nothing sent: alike still, one further)
    old = Router("vllm_dp", 3, cache_slots=10_000, stats_interval_s=0.1)
    assert [old.route(t, chain, 100) for t in (0.15, 0.16)] == [0, 0]


def test_vllm_dp_2026_never_counts_fewer_than_a_front_end_has_in_flight():
    # With several front ends, each counts the requests it sent a replica and has not seen
    # finish, times the number of front ends, as the least that replica holds: here front
    # end 0 sent 3 to replica 0 and front end 1 sent 4 to replica 1, all seated and
    # published. vllm_dp would send both front ends' next request to replica 0 (3 < 4).
    chain = [(1, 100)]
    router = Router("vllm_dp_2026", 2, cache_slots=10_000, stats_interval_s=1.0,
                    front_ends=2)
    for request, (front_end, replica) in enumerate([(0, 0)] * 3 + [(1, 1)] * 4):
        router.front_end = front_end
        send(router, replica, chain, request, 0.5)
        router.admitted(request, replica, 0.5)
    assert router.inflight == [[3, 0], [0, 4]]
    picks: dict[int, set[int]] = {0: set(), 1: set()}
    for tick in range(20):  # routes only, sending nothing: each front end's view stays
        replica = router.route(1.1 + 0.01 * tick, chain, 100)
        picks[router.front_end].add(replica)
    assert router.load == [3, 4] and router.waiting == [0, 0]
    # Front end 0: max(2 × 3, 3) = 6 against 4; front end 1: 3 against max(2 × 4, 4) = 8.
    assert picks == {0: {1}, 1: {0}}


def test_vllm_dp_2026_keeps_new_requests_from_a_full_cache_with_a_queue():
    # While requests wait on a replica, its score grows by waiting × 6 × how far its KV cache
    # usage is over a half, as last reported: 1 waiting at 90 % scores 1 + 2.4 = 3.4, more
    # than 2 waiting at 40 %.
    chain = [(1, 100)]
    router = Router("vllm_dp_2026", 2, cache_slots=10_000, stats_interval_s=0.0)
    logs: list[deque[tuple[float, float]]] = [deque([(0.0, 0.9)]), deque([(0.0, 0.4)])]
    router.watch_usage(logs)
    for request, replica in enumerate([0, 1, 1]):
        send(router, replica, chain, request, 0.0)
    assert router.route(1.0, chain, 100) == 1
    assert router.usage is not None and router.usage.usage == [0.9, 0.4]
    # Replica 0 reports 55 % at 2.0 (1 + 0.3 = 1.3 against 2), heard once that is past.
    logs[0].append((2.0, 0.55))
    assert router.route(2.0, chain, 100) == 1
    assert router.route(2.01, chain, 100) == 0
    # Nobody waiting: no penalty however full (1 running at 100 % against 2 waiting).
    logs[0].append((3.0, 1.0))
    router.admitted(0, 0, 3.0)
    assert router.route(3.5, chain, 100) == 0
    assert Router("vllm_dp", 2, cache_slots=10_000).reads_usage is False


class UsageKeepingRouter(Router):
    """A router that keeps the replicas' usage logs it was given (read nothing of them:
    reports every 10⁶ s)."""

    last: UsageKeepingRouter

    def watch_usage(self, logs: list[deque[tuple[float, float]]]) -> None:
        UsageKeepingRouter.last = self
        self.logs = logs
        super().watch_usage(logs)


def test_each_replica_logs_its_kv_cache_usage_at_the_step_ends_that_change_it(monkeypatch):
    monkeypatch.setattr("sim.engine.Router", UsageKeepingRouter)
    data = routed(2, "vllm_dp_2026", requests=200, rate=60, stats_interval_s=1e6)
    logs = {}
    for mode in ("jump", "step"):
        data["engine"]["mode"] = mode
        run = run_scenario(scenario_from_dict(data)).systems["paged"]
        logs[mode] = [list(log) for log in UsageKeepingRouter.last.logs]
    assert logs["jump"] == logs["step"]  # runs of decode steps log as steps do
    for replica, log in enumerate(logs["step"]):
        ends = run.steps[run.steps["replica"] == replica]
        step_ends = (ends["time_s"] + ends["duration_s"]).to_numpy()
        times, usage = [t for t, _ in log], [u for _, u in log]
        assert len(log) > 20 and times == sorted(times) and len(set(times)) == len(times)
        assert all(abs(step_ends - t).min() < 1e-9 for t in times)  # at step ends only
        assert all(a != b for a, b in pairwise(usage))  # on changes
        # Full at times; empty at the end, a cached block no request holds counting free.
        assert max(usage) > 0.9 and usage[-1] == 0.0 and min(usage[:-1]) > 0


def test_a_router_hears_from_the_replicas_only_when_they_report():
    # vLLM's coordinator publishes its ranks' counts every 100 ms: a seating or a finish
    # reaches the front end at the first publication after it, while each request the
    # front end sends it counts at once, as waiting.
    chain = [(1, 100)]
    for interval_s, replica in ((0.0, 0), (0.1, 1)):
        router = Router("vllm_dp", 2, cache_slots=10_000, stats_interval_s=interval_s)
        assert router.route(0.0, chain, 100) == 0
        send(router, 0, chain, 0, 0.0)
        router.admitted(0, 0, 0.0)
        router.finished(0, 0, 0.01)
        # Fresh, replica 0 is empty again; 100 ms apart, request 0 still waits there.
        assert router.route(0.05, chain, 100) == replica
        send(router, replica, chain, 1, 0.05)
        router.admitted(1, replica, 0.25)
        router.route(0.29, chain, 100)
        assert router.waiting == [0, replica]  # (stale: the seating is not published yet)
        router.route(0.3, chain, 100)  # (0.3 falls short of 3 × 0.1 in float arithmetic)
        assert router.load == [1 - replica, replica] and router.waiting == [0, 0]
    # A stale router counts each send: between publications it deals arrivals out by the
    # old counts plus what it sent since, never all to the replica that looked emptiest.
    stale = Router("least_loaded", 3, cache_slots=10_000, stats_interval_s=1.0)
    for request in range(3):
        stale.assign(0, chain, request)
        stale.finished(request, 0, 0.1)
    picks = []
    for request in range(3, 9):
        picks.append(stale.route(0.5, chain, 100))
        stale.assign(picks[-1], chain, request)
    assert picks == [1, 2, 1, 2, 1, 2]  # replica 0 still counts 3 until the next report
    assert stale.route(1.0, chain, 100) == 0  # then 0 against 3 and 3


def test_kv_aware_router_prices_prefill_and_tokens_in_flight():
    # Dynamo's cost: overlap_score_weight x the prompt tokens a replica lacks in cache, plus
    # the prompt tokens it would hold in flight, a prefix shared there counted once (the
    # prompts a replica has yet to prefill left out here; the next test adds them).
    first, second = [(1, 600), (7, 100)], [(1, 600), (8, 50)]
    router = Router("kv_aware", 3, cache_slots=10_000, track_prefill_tokens=False)
    assert router.route(0.0, first, 700) == 0  # all alike: the first
    router.assign(0, first, request=0)
    assert router.active_tokens == [700, 0, 0]
    # Replica 0: 50 to compute + 700 in flight + 50 more (its 600 already there) = 800;
    # replica 1: 650 + 0 + 650 = 1,300.
    assert router.route(1.0, second, 650) == 0
    # With weight 0 only the load counts: 750 against 650.
    balancer = Router("kv_aware", 3, cache_slots=10_000, overlap_score_weight=0.0,
                      track_prefill_tokens=False)
    balancer.assign(0, first, request=0)
    assert balancer.route(1.0, second, 650) == 1
    router.assign(0, second, request=1)
    assert router.active_tokens == [750, 0, 0]  # the shared 600 once
    # A finish counts once its time has passed; the 600 stay while request 1 holds them.
    router.finished(0, 0, 10.0)
    router.route(10.0, first, 700)
    assert router.active_tokens == [750, 0, 0]
    router.route(10.5, first, 700)
    assert router.active_tokens == [650, 0, 0]
    router.finished(1, 0, 11.0)
    # A session's later turn loads its replica from its arrival on.
    router.expect(5, 2, 20.0, first)
    assert router.route(19.0, first, 700) == 0  # cached there, and nothing in flight now
    assert router.active_tokens == [0, 0, 0] and router.load == [0, 0, 0]
    # At 20.5 replica 2 holds the turn's 700 (and caches it): 0 + 700 + 0 against
    # replica 0's 0 + 0 + 700; a tie goes to the first.
    assert router.route(20.5, first, 700) == 0 and router.active_tokens == [0, 0, 700]
    router.finished(5, 2, 30.0)
    router.route(31.0, first, 700)
    assert router.active_tokens == [0, 0, 0]


def test_kv_aware_router_counts_prompts_yet_to_prefill():
    # Dynamo's default: a replica's prefill cost also holds the prompt tokens it has yet to
    # prefill, each counted at what its cache lacked when sent there, until the first token.
    first, second = [(1, 600), (7, 100)], [(1, 600), (8, 50)]
    router = Router("kv_aware", 3, cache_slots=10_000)
    router.assign(0, first, request=0)
    assert router.prefill_tokens == [700, 0, 0]
    # Replica 0: (700 queued + 50) + 750 in flight = 1,500; replica 1: 650 + 650 = 1,300.
    assert router.route(1.0, second, 650) == 1
    router.assign(1, second, request=1)
    assert router.prefill_tokens == [700, 650, 0]
    # Request 0's first token at 2.0 empties replica 0's queue, from then on only: at 2.0
    # replica 0 still costs 1,500, replica 1 (650 queued + 0) + 650 = 1,300, as replica 2.
    router.prefilled(0, 0, 2.0)
    assert router.route(2.0, second, 650) == 1 and router.prefill_tokens == [700, 650, 0]
    # After it, replica 0 costs 50 + 750 = 800.
    assert router.route(2.5, second, 650) == 0 and router.prefill_tokens == [0, 650, 0]
    router.assign(0, second, request=2)
    assert router.prefill_tokens == [50, 650, 0]  # only what replica 0 lacked: 50
    # A finish clears a prompt whose first token was never told (or came after it).
    router.finished(1, 1, 3.0)
    router.finished(0, 0, 3.0)
    router.route(3.5, first, 700)
    assert router.prefill_tokens == [50, 0, 0] and router.active_tokens == [650, 0, 0]
    # A session's later turn queues its prompt from its arrival on, less what is cached.
    router.expect(5, 1, 4.0, first)
    router.route(4.5, first, 700)
    assert router.prefill_tokens == [50, 100, 0]  # 700 less the 600 replica 1 holds


def test_kv_aware_router_temperature_draws_by_softmax_of_scaled_costs():
    # For a 1-token prompt, replica 0 costs 2, replica 1 (500 in flight, prefilled) 502,
    # replica 2 (500 in flight, 500 queued) 1,002: scaled to 0, 0.5 and 1, at temperature 1
    # they are drawn in proportion to 1, e^-0.5 and e^-1.
    def router(temperature: float, seed: int = 0) -> Router:
        r = Router("kv_aware", 3, cache_slots=10_000, temperature=temperature, seed=seed)
        r.assign(1, [(11, 500)], request=100)
        r.prefilled(100, 1, 0.0)
        r.assign(2, [(12, 500)], request=101)
        return r
    chain = [(13, 1)]
    warm = router(1.0)
    draws = Counter(warm.route(1.0 + t, chain, 1) for t in range(6000))
    weights = [1, math.exp(-0.5), math.exp(-1)]
    for replica, weight in enumerate(weights):
        expected = 6000 * weight / sum(weights)
        assert abs(draws[replica] - expected) < 4 * math.sqrt(expected), draws
    # Colder is greedier; at 0 (the default) always the cheapest.
    cold = router(0.05)
    assert Counter(cold.route(1.0 + t, chain, 1) for t in range(2000))[0] > 1990
    greedy = router(0.0)
    assert {greedy.route(1.0 + t, chain, 1) for t in range(50)} == {0}
    # Equal costs: every replica alike.
    even = Router("kv_aware", 2, cache_slots=10_000, temperature=0.1)
    assert min(Counter(even.route(float(t), chain, 1) for t in range(2000)).values()) > 900
    # The draws repeat with the seed and change with it.
    runs = []
    for seed in (3, 3, 4):
        seeded = router(1.0, seed)
        runs.append([seeded.route(1.0 + t, chain, 1) for t in range(40)])
    assert runs[0] == runs[1] != runs[2]


@pytest.mark.parametrize("policy", ["least_loaded", "vllm_dp", "vllm_dp_2026", "cache_aware",
                                    "kv_aware"])
@pytest.mark.parametrize("seed", range(6))
def test_routing_is_the_same_in_jump_and_step_mode(policy, seed):
    rng = random.Random(seed)
    drawn: dict[str, float] = {}
    if policy == "kv_aware":  # a draw, a time to live shorter than the run, or KV events
        drawn = ({"temperature": 0.5} if seed % 2 else {"ttl_s": 2.0} if seed % 3
                 else {"kv_events": True})
    data = routed(rng.choice([2, 3]), policy, seed=seed, requests=150,
                  rate=rng.choice([10, 60]), balance_abs_threshold=rng.choice([0, 3, 32]),
                  **drawn)
    if rng.random() < 0.5:  # session turns stay with their conversation's replica
        data["workload"]["sessions"] = {"turns": {"dist": "uniform", "low": 1, "high": 4},
                                        "think_time_s": 0.5}
    tables = {}
    for mode in ("jump", "step"):
        data["engine"]["mode"] = mode
        tables[mode] = run_scenario(scenario_from_dict(data)).systems["paged"]
    pd.testing.assert_frame_equal(tables["jump"].requests, tables["step"].requests)
    assert tables["jump"].requests["replica"].nunique() > 1


def test_one_replica_routes_like_round_robin():
    results = {policy: run_scenario(scenario_from_dict(
        routed(1, policy, requests=120))).systems["paged"] for policy in (
        "round_robin", "least_loaded", "cache_aware", "kv_aware")}
    for policy in ("least_loaded", "cache_aware", "kv_aware"):
        pd.testing.assert_frame_equal(results[policy].requests,
                                      results["round_robin"].requests)


def test_cache_aware_routing_raises_the_hit_rate():
    summaries = {policy: run_scenario(scenario_from_dict(routed(4, policy))).systems[
        "paged"].summary for policy in ("round_robin", "least_loaded", "cache_aware",
                                        "kv_aware")}
    # Each prefix group kept on few replicas is cached there, not on all four.
    for policy in ("cache_aware", "kv_aware"):
        assert summaries[policy]["prefix_hit_rate"] > (
            summaries["round_robin"]["prefix_hit_rate"] + 0.1)
    assert summaries["round_robin"]["replica_imbalance"] == pytest.approx(1.0)
    for summary in summaries.values():
        assert summary["completed"] == 400 and summary["replicas"] == 4
        assert 1.0 <= summary["replica_imbalance"] < 4.0
    table = format_summary(summaries)
    assert "replica imbalance (max/mean requests)" in table


def test_a_weight_of_zero_balances_load_alone():
    # Not the default weight of 1 (a null weight means 1; zero is a weight of its own).
    runs = {weight: run_scenario(scenario_from_dict(routed(
        4, "kv_aware", requests=200, overlap_score_weight=weight))).systems["paged"]
        for weight in (None, 1.0, 0.0)}
    pd.testing.assert_frame_equal(runs[None].requests, runs[1.0].requests)
    assert (runs[0.0].requests["replica"] != runs[1.0].requests["replica"]).any()
    assert runs[0.0].summary["prefix_hit_rate"] < runs[1.0].summary["prefix_hit_rate"]


def test_kv_aware_defaults_are_dynamos_and_its_draws_repeat():
    # Null settings mean Dynamo's defaults: queued prompts counted, the cheapest replica,
    # prefixes believed cached for 120 s.
    def run(**router):
        return run_scenario(scenario_from_dict(routed(
            4, "kv_aware", requests=200, rate=60, **router))).systems["paged"].requests
    default = run()
    pd.testing.assert_frame_equal(default, run(track_prefill_tokens=True, temperature=0.0,
                                               ttl_s=120.0))
    for changed in ({"track_prefill_tokens": False}, {"ttl_s": 0.5}):
        assert (run(**changed)["replica"] != default["replica"]).any()
    # A temperature draws, the same draws on every run of the scenario and seed.
    drawn = run(temperature=1.0)
    assert (drawn["replica"] != default["replica"]).any()
    pd.testing.assert_frame_equal(drawn, run(temperature=1.0))


@pytest.mark.parametrize("tight", [False, True])
def test_kv_aware_routes_by_what_it_was_told_and_when(tight):
    # Replayed on a bare router, the run's own record (where each request went, when its
    # first token came, when it finished) gives back every routing decision: the engine
    # tells the router those facts, each at its time, and nothing else. Tight: small pools
    # and prompts read chunk by chunk, so that many requests are preempted, some right
    # after their first token: a prompt of two whole chunks (16 whole blocks) leaves no
    # room in its last step to seat a newer request, so it is the newest when the next
    # step, which writes its first token's KV, finds no block for it.
    data = routed(3, "kv_aware", requests=300, rate=40, temperature=0.3)
    data["workload"]["output_len"] = {"dist": "uniform", "low": 100, "high": 600}
    data["memory"]["kv_memory_gib"] = 0.75 if tight else 40
    if tight:
        data["workload"]["prompt_len"] = {"dist": "constant", "value": 256}
        del data["workload"]["prefix_groups"]
        data["systems"][0]["scheduler"] = {"chunked_prefill": True,
                                           "max_num_batched_tokens": 128,
                                           "prefill_allocation": "per_chunk"}
    scenario = scenario_from_dict(data)
    result = run_scenario(scenario).systems["paged"]
    requests = result.requests.sort_values("request")
    trace = scenario_trace(scenario, Path())
    router = Router("kv_aware", 3, cache_slots=result.summary["capacity_slots"],
                    temperature=0.3, seed=scenario.seed)
    lengths = trace.column_lists()["prompt_len"]
    for row in requests.itertuples():
        segments = trace.prompt_segments(row.request)
        assert router.route(row.arrival_s, segments, lengths[row.request]) == row.replica
        if row.rejected:  # a prompt no pool could hold: routed, never run
            continue
        router.assign(row.replica, segments, row.request)
        router.prefilled(row.request, row.replica, row.first_token_s)
        router.finished(row.request, row.replica, row.finished_s)
    assert requests["replica"].nunique() == 3
    assert (result.summary["preemptions"] > 20) == tight


def test_settings_that_change_nothing_are_noted(tmp_path):
    # Valid (a sweep may set them at some points only), but said, so that nobody reads two
    # identical runs as a finding.
    data = routed(1, "kv_aware")
    data["systems"].append({"name": "contiguous", "allocator": {"kind": "contiguous"},
                            "scheduler": {"chunked_prefill": True,
                                          "prefill_allocation": "per_chunk"}})
    data["systems"][0]["scheduler"] = {"prefill_allocation": "per_chunk"}
    assert scenario_from_dict(data).idle_settings() == [
        "engine.router.policy kv_aware changes nothing here: one replica takes every new "
        "request",
        "system 'paged': prefill_allocation per_chunk changes nothing without "
        "chunked_prefill (a prompt is one chunk)",
        "system 'contiguous': prefill_allocation per_chunk changes nothing for a contiguous "
        "reservation (placed whole)"]
    data["engine"]["replicas"] = 3
    data["engine"]["disaggregation"] = {"prefill_replicas": 2}  # two to route between
    data["systems"] = data["systems"][:1]
    data["systems"][0]["scheduler"] = {"chunked_prefill": True,
                                       "prefill_allocation": "per_chunk"}
    assert scenario_from_dict(data).idle_settings() == []
    data["engine"]["disaggregation"] = {"prefill_replicas": 1}
    assert len(scenario_from_dict(data).idle_settings()) == 1
    # Round robin heeds no report (a sweep over policies may give every point one interval).
    data["engine"]["router"] = {"policy": "round_robin", "stats_interval_s": 0.5}
    assert scenario_from_dict(data).idle_settings() == [
        "engine.router.stats_interval_s changes nothing here: round_robin heeds nothing the "
        "replicas report"]
    data["engine"]["router"]["stats_interval_s"] = 0
    assert scenario_from_dict(data).idle_settings() == []
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(routed(1, "cache_aware")))
    proc = kvsim_in_process("validate", str(path))
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[-1] == ("note: engine.router.policy cache_aware changes "
                                           "nothing here: one replica takes every new request")


def test_settings_other_settings_leave_idle_are_noted():
    # Each setting away from its default where another one leaves it nothing to do; the
    # same after a round trip through the scenario's dump (as --seed and sweeps make).
    data = routed(2, "kv_aware")
    data["engine"]["router"].update(cache_threshold=0.9, balance_abs_threshold=4)
    data["memory"] = {"kv_memory_gib": 2, "gpu_memory_utilization": 0.5}
    data["systems"] = [{"name": "paged", "allocator": {
        "kind": "paged", "prefix_caching": False, "eviction": "lfu", "host_load": "layerwise",
        "hybrid_kv_cache": False}, "scheduler": {"swap_space_gib": 8}}]
    expected = [
        "engine.router.cache_threshold changes nothing here: it is SGLang's router's (policy "
        "cache_aware), not kv_aware's",
        "engine.router.balance_abs_threshold changes nothing here: it is SGLang's router's "
        "(policy cache_aware), not kv_aware's",
        "memory.gpu_memory_utilization changes nothing here: memory.kv_memory_gib sizes the "
        "KV pool",
        "system 'paged': scheduler.swap_space_gib changes nothing without preemption_mode "
        "swap or swap_groups (preemption recomputes)",
        "system 'paged': allocator.eviction changes nothing without prefix_caching (no block "
        "stays cached to evict)",
        "system 'paged': allocator.host_load changes nothing without host_cache_gib (nothing "
        "is loaded from host memory)",
        "system 'paged': allocator.hybrid_kv_cache changes nothing for llama-2-7b, whose "
        "layers all attend to every token"]
    scenario = scenario_from_dict(data)
    assert scenario.idle_settings() == expected
    assert scenario_from_dict(scenario.model_dump()).idle_settings() == expected
    # One decode replica takes every handover, however the handovers are placed.
    split = {**data, "engine": {"replicas": 2, "disaggregation": {
        "prefill_replicas": 1, "decode_router": "least_loaded"}}}
    split["systems"] = [{"name": "paged", "allocator": {"kind": "paged"}}]
    assert ("engine.disaggregation.decode_router least_loaded changes nothing here: one "
            "decode replica takes every request handed over"
            in scenario_from_dict(split).idle_settings())
    split["engine"]["replicas"] = 3
    assert not any("decode_router" in note
                   for note in scenario_from_dict(split).idle_settings())
    # Where they do something, or stay at their defaults, nothing is said.
    data["engine"]["router"]["policy"] = "cache_aware"
    data["memory"] = {"kv_memory_gib": 2}
    data["systems"] = [{"name": "paged", "allocator": {
        "kind": "paged", "eviction": "lfu", "host_cache_gib": 1, "host_load": "layerwise"},
        "scheduler": {"preemption_mode": "swap", "swap_space_gib": 8}}]
    assert scenario_from_dict(data).idle_settings() == []


def test_router_settings_are_checked():
    refused = [
        ("sticky", {}, r"engine.router.policy: Input should be 'round_robin', 'least_loaded', "
                       r"'vllm_dp', 'vllm_dp_2026', 'cache_aware' or 'kv_aware'"),
        ("cache_aware", {"overlap_score_weight": 2},
         r"engine.router: overlap_score_weight is for policy kv_aware, not cache_aware"),
        ("kv_aware", {"overlap_score_weight": -1},
         r"engine.router.overlap_score_weight: Input should be greater than or equal to 0"),
        ("cache_aware", {"cache_threshold": 1.5},
         r"engine.router.cache_threshold: Input should be less than or equal to 1"),
        *(("least_loaded", {name: value},
           rf"engine.router: {name} is for policy kv_aware, not least_loaded")
          for name, value in (("temperature", 0.5), ("track_prefill_tokens", False),
                              ("ttl_s", 60), ("kv_events", True))),
        ("kv_aware", {"temperature": -0.5},
         r"engine.router.temperature: Input should be greater than or equal to 0"),
        ("kv_aware", {"ttl_s": 0}, r"engine.router.ttl_s: Input should be greater than 0"),
        ("kv_aware", {"ttl_s": 60, "kv_events": True},
         r"engine.router: ttl_s is how long a router without kv_events believes"),
        ("kv_aware", {"kv_events": "often"},
         r"engine.router.kv_events: Input should be a valid boolean"),
        ("vllm_dp", {"stats_interval_s": -0.1},
         r"engine.router.stats_interval_s: Input should be greater than or equal to 0"),
        ("least_loaded", {"front_ends": 2},
         r"engine.router: front_ends is for policies vllm_dp and vllm_dp_2026 \(vLLM's API "
         r"servers\), not least_loaded"),
        ("vllm_dp", {"front_ends": 0},
         r"engine.router.front_ends: Input should be greater than 0"),
    ]
    for policy, settings, message in refused:
        with pytest.raises(ScenarioError, match=message):
            scenario_from_dict(routed(2, policy, **settings))
    assert [scenario_from_dict(routed(2, policy)).engine.router.report_interval_s
            for policy in ("vllm_dp", "vllm_dp_2026", "least_loaded", "cache_aware",
                           "kv_aware")] == [
        0.1, 0.1, 0.0, 0.0, 0.0]  # vLLM's coordinator; the others see each answer pass
    assert scenario_from_dict(routed(2, "vllm_dp", stats_interval_s=0)).engine.router \
        .report_interval_s == 0.0
    hybrid = routed(2, "kv_aware", kv_events=True)
    hybrid["model"] = "mistral-7b-v0.1"
    with pytest.raises(ScenarioError, match=r"engine.router.kv_events is not modelled with "
                       r"the hybrid KV cache manager"):
        scenario_from_dict(hybrid)
    # An infinite weight would make every cost NaN and route by accident: refused, as is
    # any infinite number in a scenario.
    with pytest.raises(ScenarioError, match=r"engine.router.overlap_score_weight: Input "
                       r"should be a finite number"):
        scenario_from_dict(routed(2, "kv_aware", overlap_score_weight=float("inf")))
    with pytest.raises(ScenarioError, match=r"workload.arrival.rate: Input should be a "
                       r"finite number"):
        data = routed(2, "kv_aware")
        data["workload"]["arrival"]["rate"] = float("nan")
        scenario_from_dict(data)


def test_the_report_shows_each_replica_only_when_there_are_several(tmp_path):
    from reports.html import write_report
    from reports.run_figures import replica_balance
    from sim.results import write_run

    result = run_scenario(scenario_from_dict(routed(3, "cache_aware", requests=200)))
    fig = replica_balance(result)
    data = fig.kvsim_data
    assert list(data["replica"]) == [0, 1, 2]
    requests = result.systems["paged"].requests
    assert data["requests"].sum() == (~requests["rejected"]).sum() == 200
    assert list(data["requests"]) == list(requests["replica"].value_counts().sort_index())
    assert ((data["hit_rate_pct"] >= 0) & (data["hit_rate_pct"] <= 100)).all()
    # The replicas' hits and lookups add up to the run's prefix-cache hit rate.
    memory = result.systems["paged"].memory.groupby("replica")[["hit_tokens",
                                                                "lookup_tokens"]].last()
    assert memory["hit_tokens"].sum() / memory["lookup_tokens"].sum() == pytest.approx(
        result.systems["paged"].summary["prefix_hit_rate"])
    write_run(result, tmp_path / "three")
    assert write_report(tmp_path / "three").read_text().count("<img ") == 6
    assert replica_balance(run_scenario(scenario_from_dict(routed(1, "round_robin",
                                                                  requests=50)))) is None


class RecordingRouter(Router):
    """The real router, keeping a log of the intakes, seatings and preemptions the engine
    reports to it (the last one built is ``RecordingRouter.last``)."""

    last: RecordingRouter | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.moves: list[tuple[float, int, bool]] = []  # (time, request, seated)
        self.front_end_of: dict[int, int] = {}  # request -> the front end that routed it
        self.taken: dict[int, float] = {}  # request -> when its engine took it in
        RecordingRouter.last = self

    def taken_in(self, request: int, replica: int, taken_s: float) -> None:
        self.taken[request] = taken_s
        super().taken_in(request, replica, taken_s)

    def assign(self, replica: int, segments, request: int) -> None:
        self.front_end_of[request] = self.front_end
        super().assign(replica, segments, request)

    def admitted(self, request: int, replica: int, admitted_s: float) -> None:
        self.moves.append((admitted_s, request, True))
        super().admitted(request, replica, admitted_s)

    def preempted(self, request: int, replica: int, preempted_s: float) -> None:
        self.moves.append((preempted_s, request, False))
        super().preempted(request, replica, preempted_s)


def recorded_run(policy: str, stats_interval_s: float | None, front_ends: int,
                 monkeypatch: pytest.MonkeyPatch, kv_memory_gib: float | None = None
                 ) -> tuple[dict, RunResult, dict[int, list[tuple[float, bool]]],
                            dict[int, float]]:
    """A step run of three replicas behind ``policy`` with few seats (queues wait): its
    scenario, its result, the seatings (True) and preemptions (False) the router was told
    of, (when, which) by request, and when each request's engine took it in: on arrival
    if idle, else at the end of the step under way (checked)."""
    monkeypatch.setattr("sim.engine.Router", RecordingRouter)
    data = routed(3, policy, requests=300, rate=60)
    if kv_memory_gib is not None:
        data["memory"]["kv_memory_gib"] = kv_memory_gib
    data["systems"][0]["scheduler"] = {"max_num_seqs": 8}
    data["engine"]["mode"] = "step"
    data["engine"]["router"]["front_ends"] = front_ends
    if stats_interval_s is not None:
        data["engine"]["router"]["stats_interval_s"] = stats_interval_s
    run = run_scenario(scenario_from_dict(data)).systems["paged"]
    moves: dict[int, list[tuple[float, bool]]] = {}
    assert RecordingRouter.last is not None
    for move_s, request, seated in RecordingRouter.last.moves:
        moves.setdefault(request, []).append((move_s, seated))
    taken = RecordingRouter.last.taken
    ends = {r: np.sort((steps["time_s"] + steps["duration_s"]).to_numpy())
            for r, steps in run.steps.groupby("replica")}
    late = 0
    for row in run.requests.itertuples():
        taken_s = taken[row.request]
        assert row.arrival_s <= taken_s <= row.admitted_s
        if taken_s > row.arrival_s:  # the first step end after the arrival
            first = ends[row.replica][np.searchsorted(ends[row.replica], row.arrival_s)]
            assert taken_s == pytest.approx(first, abs=1e-12)
            late += 1
    assert late > 100
    return data, run, moves, taken


@pytest.mark.parametrize("stats_interval_s, front_ends", [(0.0, 1), (None, 1), (None, 4)])
def test_vllm_dp_routes_each_request_by_the_queues_it_could_know(stats_interval_s,
                                                                  front_ends, monkeypatch):
    # Replayed from the results: at each arrival, every replica's requests routed before it
    # and not finished, those waiting (not yet seated, or preempted and not seated again)
    # counted four times; the lowest score wins, ties to the first. A small pool and few
    # seats keep queues waiting and preempt. By default the router knows an intake, a
    # seating, a preemption or a finish only from the coordinator's last publication, at a
    # multiple of 100 ms; what it routed since it counts at once, front_ends times (vLLM's
    # local increment), and a request routed before the publication but taken in after it
    # not at all. With several front ends, each knows the others' routes from the
    # publications alone, and breaks ties from its share of the replicas.
    data, run, moves, taken = recorded_run("vllm_dp", stats_interval_s, front_ends,
                                           monkeypatch)
    requests = run.requests.sort_values(["arrival_s", "request"], kind="stable")
    assert not requests["rejected"].any()
    # The engine told the router of every seating and preemption the results show, each at
    # the end of its step, as vLLM's engines publish their counts after each step.
    assert requests["preemptions"].sum() > 20
    step_end_s = {(step.replica, step.time_s): step.time_s + step.duration_s
                  for step in run.steps.itertuples()}
    for row in requests.itertuples():
        told = moves[row.request]
        assert told[0][1] and told[0][0] == pytest.approx(
            step_end_s[(row.replica, row.admitted_s)], abs=1e-12)
        assert sum(not seated for _, seated in told) == row.preemptions
    front_end_of = RecordingRouter.last.front_end_of
    assert len(set(front_end_of.values())) == front_ends
    # (request, replica, arrival, finished) routed so far
    seen: list[tuple[int, int, float, float]] = []
    waited = stale = requeued = guessed = unheard = 0
    for row in requests.itertuples():
        t = row.arrival_s
        known_s = t if stats_interval_s == 0.0 else math.floor(t / 0.1) * 0.1
        mine = front_end_of[row.request]
        scores = [0] * 3
        for request, replica, arrival, finished in seen:
            if arrival >= known_s:
                # Routed since the last publication: by this front end, counted as it
                # guesses the others route too; by another, not known yet.
                if front_end_of[request] == mine:
                    scores[replica] += 4 * front_ends
                    guessed += 1
                continue
            if taken[request] >= known_s:  # in transit at the publication: in no count
                unheard += finished >= known_s
                continue
            if finished >= known_s:
                heard = [seated for move_s, seated in moves[request] if move_s < known_s]
                waits = not heard or not heard[-1]
                scores[replica] += 4 if waits else 1
                waited += waits
                requeued += waits and bool(heard)
                stale += finished < t
        start = 3 * mine // front_ends  # (0 with one front end: ties to the first)
        order = sorted(range(3), key=lambda r: (scores[r], (r - start) % 3))
        assert row.replica == order[0], row.request
        seen.append((row.request, row.replica, t, row.finished_s))
    assert (stale > 50) == (stats_interval_s is None)  # finishes not yet heard of counted
    assert requeued > 20  # preempted requests counted as waiting again
    assert waited > 100  # queues did wait: the weight was put to the test
    assert (guessed > 100) == (stats_interval_s is None)
    assert unheard > 20  # (at any interval: in transit, a request is in no count)
    counted = run_scenario(scenario_from_dict(
        dict(data, engine={**data["engine"], "router": {"policy": "least_loaded"}})))
    assert not counted.systems["paged"].requests["replica"].equals(run.requests["replica"])


@pytest.mark.parametrize("stats_interval_s, front_ends", [(0.0, 1), (None, 1), (None, 4)])
def test_vllm_dp_2026_routes_each_request_by_what_its_front_end_could_know(
        stats_interval_s, front_ends, monkeypatch):
    # Replayed from the results, in a pool that is never half full (no KV penalty; the
    # unit test above has it): at each arrival, each replica's waiting + running as last
    # published (requests taken in before the publication, seatings heard by then), plus the
    # front end's own sends since counted front_ends times as waiting; never under
    # front_ends × its own requests there whose answers have not ended yet; the lowest wins,
    # ties to the first from the front end's share of the replicas, one further at each of
    # its routes.
    _, run, heard, taken = recorded_run("vllm_dp_2026", stats_interval_s, front_ends,
                                        monkeypatch, kv_memory_gib=40)
    memory = run.memory
    held = memory["token"] + memory["reserved"] + memory["internal"]
    assert (held / memory[list(MEMORY_COLUMNS[:-1])].sum(axis=1)).max() < 0.5
    front_end_of = RecordingRouter.last.front_end_of
    requests = run.requests.sort_values(["arrival_s", "request"], kind="stable")
    assert not requests["rejected"].any() and requests["finished_s"].notna().all()
    seen: list[tuple[int, int, float, float]] = []  # (request, replica, arrival, finished)
    routes = [0] * front_ends
    floored = bumped = waited = 0
    for row in requests.itertuples():
        t = row.arrival_s
        known_s = t if stats_interval_s == 0.0 else math.floor(t / 0.1) * 0.1
        mine = front_end_of[row.request]
        total, inflight = [0] * 3, [0] * 3
        for request, replica, arrival, finished in seen:
            if front_end_of[request] == mine and finished >= t:
                inflight[replica] += 1  # (its answer has not ended yet)
            if arrival >= known_s:  # sent since the publication
                if front_end_of[request] == mine:
                    total[replica] += front_ends
                    bumped += 1
            elif taken[request] < known_s <= finished:  # published, not finished by then
                total[replica] += 1
                moves = [seated for move_s, seated in heard[request] if move_s < known_s]
                waited += not moves or not moves[-1]
        scores = [max(front_ends * inflight[r], total[r]) for r in range(3)]
        floored += any(front_ends * inflight[r] > total[r] for r in range(3))
        start = (3 * mine // front_ends + routes[mine]) % 3
        routes[mine] += 1
        order = sorted(range(3), key=lambda r: (scores[r], (r - start) % 3))
        assert row.replica == order[0], row.request
        seen.append((row.request, row.replica, t, row.finished_s))
    assert (bumped > 100) == (stats_interval_s is None) and waited > 100
    # The floor decided where counts were low: requests in transit, with several front ends
    # the others' sends.
    assert floored > 20
