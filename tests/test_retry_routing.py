"""A client's retry goes through the balancer again, as a new request: round robin sends it
to the next replica in turn after the one that had it, a router places it by what it knows
then (a cache-aware one back to the replica that holds its prompt). Both engine modes place
and serve it alike."""

from __future__ import annotations

import pandas as pd
import pytest

from sim.engine import run_scenario
from sim.results import RunResult
from sim.scenario import scenario_from_dict


def both_modes(data: dict) -> RunResult:
    """The run of ``data`` in jump mode, checked equal to stepping (with invariants)."""
    runs = {mode: run_scenario(scenario_from_dict(
        {**data, "engine": {**data["engine"], "mode": mode,
                            "debug_invariants": mode == "step"}})).systems["s"]
            for mode in ("jump", "step")}
    pd.testing.assert_frame_equal(runs["jump"].requests, runs["step"].requests)
    return runs["jump"]


@pytest.mark.parametrize("split", [False, True])
def test_round_robin_sends_a_retry_to_the_next_replica_in_turn(split):
    # One seat per replica held for a long time, a line of one: many requests are turned
    # away, and each client tries twice more. Open arrivals go round robin (request i to
    # replica i mod 2), each retry to the other replica than the try before (under
    # disaggregation, the other prefill replica).
    data = {"name": "two", "model": "llama-2-7b", "gpu": "h100-80g",
            "memory": {"kv_memory_gib": 4},
            "workload": {"arrival": {"process": "constant", "rate": 100},
                         "prompt_len": {"dist": "constant", "value": 100},
                         "output_len": {"dist": "constant", "value": 2000},
                         "retry": {"max_retries": 2, "backoff_s": 0.05, "jitter": 0}},
            "systems": [{"name": "s", "allocator": {"kind": "paged"},
                         "scheduler": {"max_num_seqs": 1, "max_queued_requests": 1}}],
            "engine": {"replicas": 2}, "stop": {"num_requests": 12}}
    if split:  # long prompts keep the prefill replicas busy; one decode replica
        data["engine"] = {"replicas": 3, "disaggregation": {"prefill_replicas": 2}}
        data["workload"]["prompt_len"]["value"] = 6000
        data["workload"]["output_len"]["value"] = 50
    requests = both_modes(data).requests
    assert (requests["attempts"] > 1).sum() >= 4
    expected = (requests["request"] + requests["attempts"] - 1) % 2
    assert (requests["replica"] == expected).all()


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_a_retry_finds_its_prompt_cached_only_where_the_router_sends_it_back(policy):
    # Clients give up on answers not whole in 4 s, mid-answer, and try once more; every
    # prompt is its own (no shared prefixes), and a pool of 8 GiB keeps what was read.
    data = {"name": "two", "model": "llama-2-7b", "memory": {"kv_memory_gib": 8},
            "workload": {"arrival": {"process": "poisson", "rate": 1},
                         "prompt_len": {"dist": "uniform", "low": 500, "high": 1500},
                         "output_len": {"dist": "uniform", "low": 100, "high": 600},
                         "e2e_timeout_s": 4.0, "retry": {"max_retries": 1}},
            "systems": [{"name": "s", "allocator": {"kind": "paged"}}],
            "engine": {"replicas": 2, "router": {"policy": policy}},
            "stop": {"num_requests": 80}}
    requests = both_modes(data).requests
    retried = requests[requests["attempts"] == 2]
    assert len(retried) >= 20
    hits = retried["prefix_hit_tokens"] > 0
    if policy == "round_robin":  # to the other replica, which never read that prompt
        assert not hits.any()
    else:  # back to the replica that read it, found in its prefix cache
        assert hits.all()


def test_an_idle_replica_takes_a_retry_in_when_it_is_sent(tmp_path):
    # A long answer holds replica 0's one seat; a short one, replica 1's for a moment. The
    # third request waits behind the long answer (the least loaded is a tie: the first),
    # its client gives up on a first token after 1 s and sends it again 0.5 s later: the
    # router sends the retry to replica 1, idle by then, which seats it as it comes, not
    # when replica 0 next looks up from its decoding.
    rows = [(0.0, 100, 3000), (0.01, 100, 5), (0.02, 100, 10)]
    pd.DataFrame(rows, columns=["t", "prompt", "output"]).to_csv(tmp_path / "t.csv",
                                                                   index=False)
    data = {"name": "two", "model": "llama-2-7b", "memory": {"kv_memory_gib": 4},
            "workload": {"kind": "trace", "path": str(tmp_path / "t.csv"), "format": "csv",
                         "columns": {"arrival": "t", "prompt_len": "prompt",
                                     "output_len": "output"},
                         "ttft_timeout_s": 1.0,
                         "retry": {"max_retries": 1, "backoff_s": 0.5, "jitter": 0}},
            "systems": [{"name": "s", "allocator": {"kind": "paged"},
                         "scheduler": {"max_num_seqs": 1}}],
            "engine": {"replicas": 2, "router": {"policy": "least_loaded"}},
            "stop": {"num_requests": 3}}
    retried = both_modes(data).requests.set_index("request").loc[2]
    assert retried["attempts"] == 2 and retried["replica"] == 1
    assert retried["admitted_s"] == pytest.approx(0.02 + 1.0 + 0.5, abs=1e-9)
