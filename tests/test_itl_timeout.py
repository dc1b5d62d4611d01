"""Streaming clients who give up on a next token (``workload.itl_timeout_s``): once a request
has had a token, its client disconnects if no other comes that long after it — preempted
(waiting in the line, or read again), handed to a decode replica, or stalled behind a step
that long. It is abandoned at exactly that moment; a seated one is aborted at the step
boundary after, and a token that comes just as the client gives up comes too late."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import kvsim_in_process as kvsim
from test_token_gaps import step_ends, two_requests

from sim.engine import run_scenario
from sim.scenario import ScenarioError, scenario_from_dict


def run_both(data: dict, base_dir: Path | None = None) -> pd.DataFrame:
    """The system's result, stepping; jumping gives the same requests and summary."""
    results = {}
    for mode in ("jump", "step"):
        data["engine"] = {**data.get("engine", {}), "mode": mode,
                          "debug_invariants": mode == "step"}
        results[mode] = run_scenario(scenario_from_dict(data), base_dir=base_dir).systems["s"]
    pd.testing.assert_frame_equal(results["jump"].requests, results["step"].requests)
    for key in ("abandoned", "abandoned_seated", "abandoned_output_tokens", "retries"):
        assert results["jump"].summary[key] == results["step"].summary[key], key
    return results["step"]


@pytest.mark.parametrize("timeout_s", [0.5, 2.0])
def test_a_preempted_request_is_given_up_while_it_waits_for_memory(tmp_path, timeout_s):
    # Given up after its 0.78 s wait for the other's memory; or, with longer answers in a
    # larger pool, waiting 1.1 s, and decoding 3.5 s after it is seated again.
    data = (two_requests(tmp_path) if timeout_s < 1 else
            two_requests(tmp_path, outputs=(600, 900), kv_memory_gib=0.55))
    data["workload"]["itl_timeout_s"] = timeout_s
    result = run_both(data, tmp_path)
    requests, steps = result.requests, result.steps
    ends = step_ends(steps)
    preempted = int(np.flatnonzero(steps["preempted"].to_numpy())[0])
    other, victim = requests.iloc[0], requests.iloc[1]
    assert math.isnan(other["abandoned_s"]) and other["finished_s"] > 0
    # Its last token came at the end of the step before its preemption.
    last_token_s = ends[preempted - 1]
    summary = result.summary
    if timeout_s == 0.5:
        assert victim["abandoned_s"] == last_token_s + 0.5
        assert math.isnan(victim["finished_s"]) and victim["first_token_s"] > 0
        assert (summary["abandoned"], summary["abandoned_seated"]) == (1, 1)
        # Every token generated for it was generated in vain: one a step up to then.
        generated = int(((ends > victim["first_token_s"]) & (ends <= last_token_s)).sum()) + 1
        assert summary["abandoned_output_tokens"] == generated
        # Nobody is seated again: the steps after are the other's alone.
        assert (steps["prefill_tokens"].to_numpy()[preempted:] == 0).all()
    else:
        assert math.isnan(victim["abandoned_s"])
        assert 1.0 < victim["max_itl_s"] < 2.0
        # Decoding, it owes its client nothing: it had a token each step until its last,
        # long after its last wait would have timed out.
        assert victim["finished_s"] > last_token_s + victim["max_itl_s"] + 2.0
        assert (summary["abandoned"], summary["abandoned_seated"]) == (0, 0)
        assert summary["abandoned_output_tokens"] == 0


def stall_scenario(tmp_path: Path, **scheduler: object) -> dict:
    """One request decoding alone, then a 3,000-token prompt read in one step of about
    0.15 s (Llama-2-7B on an A100): the decoding one's client waits that long for a token."""
    (tmp_path / "trace.csv").write_text("t,p,o\n0,50,400\n0.5,3000,20\n")
    return {"name": "stall", "model": "llama-2-7b", "memory": {"kv_memory_gib": 8},
            "workload": {"kind": "trace", "path": "trace.csv", "format": "csv",
                         "columns": {"arrival": "t", "prompt_len": "p", "output_len": "o"},
                         "itl_timeout_s": 0.1},
            "systems": [{"name": "s", "allocator": {"kind": "paged"},
                         "scheduler": scheduler}],
            "stop": {"num_requests": 2}}


def test_a_step_longer_than_the_timeout_loses_every_request_decoding_in_it(tmp_path):
    result = run_both(stall_scenario(tmp_path), tmp_path)
    requests, steps = result.requests, result.steps
    ends = step_ends(steps)
    long_step = int(np.flatnonzero(steps["prefill_tokens"].to_numpy() == 3000)[0])
    assert steps["duration_s"].iloc[long_step] > 0.1 and steps["decode_seqs"].iloc[
        long_step] == 1
    decoding, reading = requests.iloc[0], requests.iloc[1]
    # Its last token came at the end of the step before; its client left 0.1 s later, in
    # the middle of the long step, and the step's end aborted it.
    assert decoding["abandoned_s"] == ends[long_step - 1] + 0.1
    assert math.isnan(decoding["finished_s"])
    assert steps["decode_seqs"].iloc[long_step + 1] == 1  # the prompt just read, alone
    assert reading["finished_s"] > 0 and math.isnan(reading["abandoned_s"])
    assert reading["max_itl_s"] <= 0.1


def test_a_first_token_from_a_prefill_batch_starts_its_clients_wait(tmp_path):
    # SGLang's steps read the waiting prompts first: the first request's first token comes
    # at the end of its prefill batch, and the second's prefill batch (about 0.15 s) keeps
    # it from a second for longer than the client waits.
    data = stall_scenario(tmp_path, batching="prefill_first", max_num_batched_tokens=3000)
    (tmp_path / "trace.csv").write_text("t,p,o\n0,3000,20\n0,3000,20\n")
    result = run_both(data, tmp_path)
    requests, steps = result.requests, result.steps
    ends = step_ends(steps)
    assert steps["prefill_tokens"].tolist()[:2] == [3000, 3000]
    assert steps["decode_seqs"].tolist()[:2] == [0, 0] and steps["duration_s"].iloc[1] > 0.1
    first, second = requests.iloc[0], requests.iloc[1]
    assert first["first_token_s"] == ends[0]
    # Its client left 0.1 s after that token, in the middle of the other's prefill batch,
    # whose end aborted it; the other is served.
    assert first["abandoned_s"] == ends[0] + 0.1 and math.isnan(first["finished_s"])
    assert second["finished_s"] > 0 and second["max_itl_s"] <= 0.1
    assert result.summary["abandoned_seated"] == 1


def test_samples_fanned_out_whose_first_tokens_prefill_batches_gave_stall_together():
    # Two requests of two samples, each sample a request of its own. The first's samples
    # give its stream their first tokens at the ends of their prefill batches (the second
    # finds the prompt cached, and reads its last partial block); then the other request's
    # prompt (0.145 s) keeps both from a second token for longer than the client waits.
    data = {"name": "fan", "model": "llama-2-7b", "memory": {"kv_memory_gib": 8},
            "workload": {"arrival": {"process": "poisson", "rate": 1000.0},
                         "prompt_len": {"dist": "constant", "value": 3000},
                         "output_len": {"dist": "constant", "value": 20},
                         "sampling": {"n": 2}, "itl_timeout_s": 0.1},
            "systems": [{"name": "s", "allocator": {"kind": "paged"},
                         "scheduler": {"batching": "prefill_first",
                                       "max_num_batched_tokens": 3000,
                                       "parallel_sampling": "fan_out"}}],
            "stop": {"num_requests": 2}}
    result = run_both(data)
    ends = step_ends(result.steps)
    assert result.steps["prefill_tokens"].tolist()[:4] == [3000, 8, 3000, 8]
    first, other = result.requests.iloc[0], result.requests.iloc[1]
    # Its client gave up 0.1 s after the stream's last token, the second sample's first.
    assert first["first_token_s"] == ends[0]
    assert first["abandoned_s"] == ends[1] + 0.1 and math.isnan(first["finished_s"])
    assert other["finished_s"] > 0 and math.isnan(other["abandoned_s"])


def test_chunked_prefill_keeps_the_steps_under_the_timeout(tmp_path):
    result = run_both(stall_scenario(tmp_path, chunked_prefill=True,
                                     max_num_batched_tokens=512), tmp_path)
    requests = result.requests
    assert requests["abandoned_s"].isna().all()
    assert (requests["max_itl_s"] <= 0.1).all()
    assert result.summary["abandoned"] == 0


@pytest.mark.parametrize("timeout_s", [0.5, 2.0])
def test_a_decode_replica_loses_a_request_whose_kv_comes_too_late(timeout_s):
    # The KV of 2,000 tokens takes about a second at 1 GB/s.
    data = {"name": "split", "model": "llama-2-7b", "memory": {"kv_memory_gib": 8},
            "engine": {"replicas": 2,
                       "disaggregation": {"prefill_replicas": 1, "kv_transfer_gbps": 1}},
            "workload": {"arrival": {"process": "constant", "rate": 1},
                         "prompt_len": {"dist": "constant", "value": 2000},
                         "output_len": {"dist": "constant", "value": 30},
                         "itl_timeout_s": timeout_s},
            "systems": [{"name": "s", "allocator": {"kind": "paged"}}],
            "stop": {"num_requests": 1}}
    result = run_both(data)
    request = result.requests.iloc[0]
    if timeout_s < 1:
        assert request["abandoned_s"] == request["first_token_s"] + timeout_s
        assert math.isnan(request["finished_s"])
        assert (result.steps["replica"] == 0).all()  # the decode replica never ran it
    else:
        assert math.isnan(request["abandoned_s"])
        assert 1 < request["max_itl_s"] < 2


def test_clients_who_give_up_on_a_next_token_try_again(tmp_path):
    data = two_requests(tmp_path)
    data["workload"].update(itl_timeout_s=0.5, retry={"max_retries": 1, "backoff_s": 0.0})
    result = run_both(data, tmp_path)
    victim = result.requests.iloc[1]
    # Sent again at once, as a new request: its latencies still count from the first try.
    assert victim["attempts"] == 2 and victim["arrival_s"] == 0.0
    assert victim["finished_s"] > 0 and math.isnan(victim["abandoned_s"])
    assert result.summary["retries"] == 1


@pytest.mark.parametrize("value", [0, -1, "soon"])
def test_a_bad_timeout_is_refused_in_one_line(tmp_path, value):
    data = two_requests(tmp_path)
    data["workload"]["itl_timeout_s"] = value
    with pytest.raises(ScenarioError) as error:
        scenario_from_dict(data, "s.yaml")
    assert "workload.itl_timeout_s" in str(error.value)
    assert "\n" not in str(error.value)
    outcome = kvsim("run", "scenarios/paged_vs_contiguous.yaml", "--set",
                    f"workload.itl_timeout_s={value}")
    assert outcome.returncode == 2
    assert outcome.stderr.count("\n") == 1 and "itl_timeout_s" in outcome.stderr
