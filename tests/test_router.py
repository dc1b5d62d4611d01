"""Routers: SGLang's cache-aware rule, Dynamo's KV cost and shortest queue, learned only from
the past, the same in jump and step mode, and what they do to a shared-prefix workload."""

from __future__ import annotations

import random

import pandas as pd
import pytest
import yaml
from conftest import kvsim_in_process

from sim.engine import run_scenario
from sim.metrics import format_summary
from sim.router import ApproximateTree, Router, prefix_chain
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


def test_kv_aware_router_prices_prefill_and_tokens_in_flight():
    # Dynamo's cost: overlap_score_weight x the prompt tokens a replica lacks in cache, plus
    # the prompt tokens it would hold in flight, a prefix shared there counted once.
    first, second = [(1, 600), (7, 100)], [(1, 600), (8, 50)]
    router = Router("kv_aware", 3, cache_slots=10_000)
    assert router.route(0.0, first, 700) == 0  # all alike: the first
    router.assign(0, first, request=0)
    assert router.active_tokens == [700, 0, 0]
    # Replica 0: 50 to compute + 700 in flight + 50 more (its 600 already there) = 800;
    # replica 1: 650 + 0 + 650 = 1,300.
    assert router.route(1.0, second, 650) == 0
    # With weight 0 only the load counts: 750 against 650.
    balancer = Router("kv_aware", 3, cache_slots=10_000, overlap_score_weight=0.0)
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


@pytest.mark.parametrize("policy", ["least_loaded", "cache_aware", "kv_aware"])
@pytest.mark.parametrize("seed", range(6))
def test_routing_is_the_same_in_jump_and_step_mode(policy, seed):
    rng = random.Random(seed)
    data = routed(rng.choice([2, 3]), policy, seed=seed, requests=150,
                  rate=rng.choice([10, 60]), balance_abs_threshold=rng.choice([0, 3, 32]))
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
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(routed(1, "cache_aware")))
    proc = kvsim_in_process("validate", str(path))
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[-1] == ("note: engine.router.policy cache_aware changes "
                                           "nothing here: one replica takes every new request")


def test_router_settings_are_checked():
    with pytest.raises(ScenarioError, match=r"engine.router.policy: Input should be "
                       r"'round_robin', 'least_loaded', 'cache_aware' or 'kv_aware'"):
        scenario_from_dict(routed(2, "sticky"))
    with pytest.raises(ScenarioError, match=r"engine.router: overlap_score_weight is for "
                       r"policy kv_aware, not cache_aware"):
        scenario_from_dict(routed(2, "cache_aware", overlap_score_weight=2))
    with pytest.raises(ScenarioError, match=r"engine.router.overlap_score_weight: Input "
                       r"should be greater than or equal to 0"):
        scenario_from_dict(routed(2, "kv_aware", overlap_score_weight=-1))
    with pytest.raises(ScenarioError, match=r"engine.router.cache_threshold: Input should be "
                       r"less than or equal to 1"):
        scenario_from_dict(routed(2, "cache_aware", cache_threshold=1.5))


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
