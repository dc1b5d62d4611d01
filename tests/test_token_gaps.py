"""Each request's longest wait between two of its tokens (``max_itl_s``): a step's length
while it decodes, and, where it stops decoding, the whole wait until its next token —
preempted (the line, the recompute or the swap back in), handed to a decode replica, or
regenerating what its client had (a fork group started over); and the ITL, every token a
served client received after its first, once. Checked against the token times the step
table gives, stepping and jumping alike."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_engine_equality import random_scenario

from sim.engine import run_scenario
from sim.metrics import format_summary
from sim.scenario import scenario_from_dict


def step_ends(steps: pd.DataFrame) -> np.ndarray:
    """When each step of a step-by-step run ended, in order."""
    assert (steps["steps"] == 1).all(), "one row a step"
    return (steps["time_s"] + steps["duration_s"]).to_numpy()


def preempted_and_back(steps: pd.DataFrame) -> tuple[int, int]:
    """The step that preempted the one request preempted, and the step that seated it again
    (the next that reads a prompt: a recompute, or the last tokens' KV after a swap back
    in), which gives it its next token."""
    preempted = int(np.flatnonzero(steps["preempted"].to_numpy())[0])
    return preempted, preempted + int(np.flatnonzero(
        steps["prefill_tokens"].to_numpy()[preempted:])[0])


def received_before(ends: np.ndarray, first_token_s: float, preempted: int) -> np.ndarray:
    """When a preempted request's client had its tokens before the preemption: its first,
    and one at the end of every step after it, to the one before the preemption's."""
    return np.concatenate([[first_token_s],
                           ends[(ends > first_token_s) & (ends <= ends[preempted - 1])]])


def longest_gap(times: np.ndarray) -> float:
    return float(np.diff(np.sort(times)).max())


def two_requests(tmp_path: Path, outputs: tuple[int, int] = (400, 400),
                 kv_memory_gib: float = 0.4, **scheduler: object) -> dict:
    """Two requests of 100-token prompts seated together in 0.4 GiB of Llama-2-7B's KV (819
    tokens) that cannot both grow to their 500: the later one is preempted once, and
    seated again when the other one's memory is free."""
    rows = "".join(f"0,100,{output}\n" for output in outputs)
    (tmp_path / "trace.csv").write_text("t,p,o\n" + rows)
    return {"name": "two", "model": "llama-2-7b", "memory": {"kv_memory_gib": kv_memory_gib},
            "workload": {"kind": "trace", "path": "trace.csv", "format": "csv",
                         "columns": {"arrival": "t", "prompt_len": "p", "output_len": "o"}},
            "systems": [{"name": "s", "allocator": {"kind": "paged"},
                         "scheduler": scheduler}],
            "stop": {"num_requests": 2}, "engine": {"mode": "step", "debug_invariants": True}}


@pytest.mark.parametrize("scheduler", [{}, {"preemption_mode": "swap", "swap_space_gib": 1}],
                         ids=["recompute", "swap"])
def test_a_preempted_request_waits_from_its_last_token_to_its_next(tmp_path, scheduler):
    result = run_scenario(scenario_from_dict(two_requests(tmp_path, **scheduler)),
                          base_dir=tmp_path).systems["s"]
    requests, steps = result.requests, result.steps
    ends = step_ends(steps)
    assert requests["preemptions"].tolist() == [0, 1]
    preempted, back = preempted_and_back(steps)
    first, other = requests.iloc[1], requests.iloc[0]
    # It had a token at the end of every step from its first to the one before the
    # preemption, and of every step from its seating again to its last.
    times = np.concatenate([received_before(ends, first["first_token_s"], preempted),
                            ends[back:]])
    assert times[-1] == first["finished_s"]
    assert first["max_itl_s"] == pytest.approx(longest_gap(times), rel=1e-12)
    assert first["max_itl_s"] == pytest.approx(ends[back] - ends[preempted - 1], rel=1e-12)
    assert first["max_itl_s"] > 20 * steps["duration_s"].median()  # the wait is no step
    # The other decoded in every step after its first token: its longest wait is a step's
    # (under swap, the step that copies the victim out is the longest).
    mine = ends[(ends > other["first_token_s"]) & (ends <= other["finished_s"])]
    assert other["max_itl_s"] == pytest.approx(
        longest_gap(np.concatenate([[other["first_token_s"]], mine])), rel=1e-12)
    if scheduler:
        assert other["max_itl_s"] == steps["duration_s"].iloc[preempted]
        assert steps["swapped_slots"].iloc[preempted] > 0


def busy_scenario(mode: str) -> dict:
    """Chunked prefills of long prompts beside decodes, 1 GiB of KV under preemption."""
    return {"name": "busy", "model": "llama-2-7b", "memory": {"kv_memory_gib": 1.0},
            "workload": {"arrival": {"process": "poisson", "rate": 30},
                         "prompt_len": {"dist": "lognormal", "mean": 300, "sigma": 1,
                                        "max": 1500},
                         "output_len": {"dist": "uniform", "low": 1, "high": 300}},
            "systems": [{"name": "s", "allocator": {"kind": "paged"},
                         "scheduler": {"chunked_prefill": True,
                                       "max_num_batched_tokens": 512}}],
            "stop": {"num_requests": 150}, "seed": 3,
            "engine": {"mode": mode, "debug_invariants": mode == "step"}}


def test_a_request_never_preempted_waits_a_step_at_most_and_jumps_agree():
    runs = {mode: run_scenario(scenario_from_dict(busy_scenario(mode))).systems["s"]
            for mode in ("step", "jump")}
    requests = runs["step"].requests
    pd.testing.assert_frame_equal(runs["jump"].requests, requests)
    assert runs["jump"].summary["max_itl_p99_s"] == runs["step"].summary["max_itl_p99_s"]
    ends = step_ends(runs["step"].steps)
    assert requests["preemptions"].sum() > 0
    # Two tokens or more: a gap; one token (or none), none to report.
    assert requests["max_itl_s"].isna().tolist() == (requests["output_len"] < 2).tolist()
    steady = requests[(requests["preemptions"] == 0) & (requests["output_len"] > 1)]
    assert len(steady) > 50
    for row in steady.itertuples():
        # A token at its first token's step and at the end of every step to its last.
        mine = ends[(ends > row.first_token_s) & (ends <= row.finished_s)]
        assert row.max_itl_s == pytest.approx(
            longest_gap(np.concatenate([[row.first_token_s], mine])), rel=1e-12)
    # Every wait of a request that never left the batch is one step, a prompt's chunk and
    # the decodes beside it.
    durations = runs["step"].steps["duration_s"].to_numpy()
    assert all(np.isclose(durations, gap, rtol=1e-12, atol=0).any()
               for gap in steady["max_itl_s"])
    # The summary's percentiles are of the requests served.
    served = requests.loc[requests["finished_s"].notna(), "max_itl_s"].dropna()
    assert runs["step"].summary["max_itl_p99_s"] == pytest.approx(
        float(np.percentile(served, 99)), rel=1e-12)
    assert "longest token gap p99 (s)" in format_summary({"s": runs["step"].summary})
    # One sample a request: nothing forks, nothing to throw away.
    assert runs["step"].summary["discarded_output_tokens"] is None
    assert "thrown away" not in format_summary({"s": runs["step"].summary})


def test_a_decode_replica_counts_the_wait_since_the_prefill_replicas_token():
    # One request: every step of the decode replica is one of its tokens.
    data = {"name": "split", "model": "llama-2-7b", "memory": {"kv_memory_gib": 8},
            "engine": {"replicas": 2, "mode": "step",
                       "disaggregation": {"prefill_replicas": 1, "kv_transfer_gbps": 1,
                                          "kv_transfer_latency_s": 0.05}},
            "workload": {"arrival": {"process": "constant", "rate": 1},
                         "prompt_len": {"dist": "constant", "value": 2000},
                         "output_len": {"dist": "constant", "value": 30}},
            "systems": [{"name": "s", "allocator": {"kind": "paged"}}],
            "stop": {"num_requests": 1}}
    result = run_scenario(scenario_from_dict(data)).systems["s"]
    request = result.requests.iloc[0]
    steps = result.steps
    decode = step_ends(steps[steps["replica"] == 1])
    assert len(decode) == 29  # the other 29 tokens
    # The KV's 1 GB/s transfer and its latency come between the first token and the next.
    assert decode[0] - request["first_token_s"] > 0.05 + 2000 * 512 * 1024 / 1e9 / 2
    assert request["max_itl_s"] == pytest.approx(
        longest_gap(np.concatenate([[request["first_token_s"]], decode])), rel=1e-12)
    assert request["max_itl_s"] == pytest.approx(decode[0] - request["first_token_s"],
                                                 rel=1e-12)


def itl_of(waits_s: np.ndarray, tokens: np.ndarray) -> dict[str, float]:
    """ITL as vLLM's benchmark reports it, from each wait and the tokens that waited it:
    their mean and nearest-rank percentiles, to the microsecond."""
    every = np.repeat(np.floor(np.asarray(waits_s) * 1e6 + 0.5), tokens) / 1e6
    p50, p90, p99 = np.percentile(every, [50, 90, 99], method="inverted_cdf")
    return {"itl_mean_s": every.mean(), "itl_p50_s": p50, "itl_p90_s": p90, "itl_p99_s": p99}


def test_itl_counts_every_token_by_its_wait_as_vllms_benchmark_does():
    # A pool that preempts nobody: each step's wait, once for every request decoding in it.
    data = busy_scenario("step")
    data["memory"] = {"kv_memory_gib": 40}
    runs = {}
    for mode in ("step", "jump"):
        data["engine"]["mode"] = mode
        runs[mode] = run_scenario(scenario_from_dict(data)).systems["s"]
    summary, steps = runs["step"].summary, runs["step"].steps
    assert runs["step"].requests["preemptions"].sum() == 0
    ends = step_ends(steps)
    decoding = steps["decode_seqs"].to_numpy()[1:]
    expected = itl_of(np.diff(ends)[decoding > 0], decoding[decoding > 0])
    for key, value in expected.items():
        assert summary[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
        assert runs["jump"].summary[key] == summary[key], key
    # As many tokens as the requests had after their first.
    requests = runs["step"].requests
    assert decoding.sum() == (requests["output_len"] - 1).sum()
    # Chunks of 512 tokens beside the decodes: the tail is a prompt's chunk.
    assert summary["itl_p99_s"] > 1.5 * summary["itl_p50_s"]


def test_a_preempted_requests_wait_is_one_token_of_the_itl(tmp_path):
    result = run_scenario(scenario_from_dict(two_requests(tmp_path)),
                          base_dir=tmp_path).systems["s"]
    steps = result.steps
    ends = step_ends(steps)
    victim = result.requests.iloc[1]
    decoding = steps["decode_seqs"].to_numpy()[1:]
    waits = np.append(np.diff(ends)[decoding > 0], victim["max_itl_s"])
    tokens = np.append(decoding[decoding > 0], 1)
    assert tokens.sum() == (result.requests["output_len"] - 1).sum()
    expected = itl_of(waits, tokens)
    for key, value in expected.items():
        assert result.summary[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("timeout", [{"e2e_timeout_s": 4.0}, {"itl_timeout_s": 0.038}],
                         ids=["e2e", "itl"])
def test_itl_counts_the_tokens_of_requests_served_alone(timeout):
    # As `vllm bench serve` counts ITL over its successful requests: the tokens a client
    # received before it gave up mid-answer are out. No preemption: a request served had a
    # token at its first token's step and at the end of every step to its last.
    data = busy_scenario("step")
    data["memory"] = {"kv_memory_gib": 40}
    data["workload"].update(timeout)
    runs = {}
    for mode in ("step", "jump"):
        data["engine"]["mode"] = mode
        runs[mode] = run_scenario(scenario_from_dict(data)).systems["s"]
    result = runs["step"]
    requests, summary = result.requests, result.summary
    assert requests["preemptions"].sum() == 0
    assert summary["abandoned_seated"] >= 10 and summary["abandoned_output_tokens"] > 0
    ends = step_ends(result.steps)
    waits = [np.diff(np.concatenate([[row.first_token_s],
                                     ends[(ends > row.first_token_s) & (ends <= row.finished_s)]]))
             for row in requests[requests["finished_s"].notna()].itertuples()]
    every = np.concatenate(waits)
    assert len(every) == (requests.loc[requests["finished_s"].notna(), "output_len"] - 1).sum()
    expected = itl_of(every, np.ones(len(every), dtype=int))
    for key, value in expected.items():
        assert summary[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
        assert runs["jump"].summary[key] == summary[key], key


def test_a_request_given_up_after_its_preemption_takes_its_tokens_out_of_the_itl(tmp_path):
    # The later request is preempted, seated again when the other finishes, and given up
    # before its last token: the ITL is the other's alone, its wait before the preemption,
    # its wait for the recompute and its tokens after all out.
    data = two_requests(tmp_path)
    whole = run_scenario(scenario_from_dict(data), base_dir=tmp_path).systems["s"]
    victim = whole.requests.iloc[1]
    data["workload"]["e2e_timeout_s"] = float(victim["finished_s"]) - 0.3
    result = run_scenario(scenario_from_dict(data), base_dir=tmp_path).systems["s"]
    requests = result.requests
    assert requests["preemptions"].tolist() == [0, 1]
    assert requests["abandoned_s"].notna().tolist() == [False, True]
    # Seated again after the other finished, and cut off before its last token.
    assert requests["abandoned_s"].iloc[1] > requests["finished_s"].iloc[0] + 0.1
    assert 0 < result.summary["abandoned_output_tokens"] < 400
    served = requests.iloc[0]
    ends = step_ends(result.steps)
    every = np.diff(np.concatenate([[served["first_token_s"]],
                                    ends[(ends > served["first_token_s"])
                                         & (ends <= served["finished_s"])]]))
    expected = itl_of(every, np.ones(len(every), dtype=int))
    for key, value in expected.items():
        assert result.summary[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def restarted_fork_group(tmp_path: Path, mode: str) -> dict:
    """Two requests of two forked samples that cannot both grow to their 300 tokens: the
    later group is preempted once, and starts over in the same step (its prompt is cached,
    and the blocks its samples had generated into are free)."""
    data = two_requests(tmp_path, (200, 200))
    data["workload"]["sampling"] = {"n": 2}
    data["engine"]["mode"] = mode
    return data


def test_a_fork_group_started_over_gives_its_client_only_the_tokens_it_had_not_had(tmp_path):
    # Its client had k tokens when the group was preempted; the group regenerates them
    # from its prompt, and the client's next token is the k + 1st: its wait runs from its
    # k-th, and the k regenerated are not counted again.
    runs = {mode: run_scenario(scenario_from_dict(restarted_fork_group(tmp_path, mode)),
                               base_dir=tmp_path).systems["s"] for mode in ("step", "jump")}
    result = runs["step"]
    pd.testing.assert_frame_equal(runs["jump"].requests, result.requests)
    requests, steps = result.requests, result.steps
    ends = step_ends(steps)
    assert requests["preemptions"].tolist() == [0, 1]
    preempted, back = preempted_and_back(steps)
    other, victim = requests.iloc[0], requests.iloc[1]
    before = received_before(ends, victim["first_token_s"], preempted)
    had = len(before)
    assert 20 < had < 199
    # Seated again at step `back` (the preemption's), whose end gives it its first token
    # again, and each later step one more: the k + 1st at the end of step back + k.
    after = ends[back + had:]
    assert after[0] > ends[back + had - 1]
    times = np.concatenate([before, after])
    assert len(times) == 200 and times[-1] == victim["finished_s"]
    # Both samples' first k tokens were thrown away, and generated again.
    assert result.summary["discarded_output_tokens"] == 2 * had
    assert "output tokens thrown away (forks started over)" in format_summary(
        {"s": result.summary})
    assert victim["max_itl_s"] == pytest.approx(ends[back + had] - ends[preempted - 1],
                                                rel=1e-12)
    assert victim["max_itl_s"] == pytest.approx(longest_gap(times), rel=1e-12)
    # The ITL: every token of each client after its first, once, by its own wait.
    mine = ends[(ends > other["first_token_s"]) & (ends <= other["finished_s"])]
    waits = np.concatenate([np.diff(times),
                            np.diff(np.concatenate([[other["first_token_s"]], mine]))])
    assert len(waits) == (requests["output_len"] - 1).sum()
    expected = itl_of(waits, np.ones(len(waits), dtype=int))
    for key, value in expected.items():
        assert result.summary[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
        assert runs["jump"].summary[key] == result.summary[key], key


def test_a_client_of_a_fork_group_started_over_gives_up_a_wait_after_its_last_token(
        tmp_path):
    # Regenerating what its client has gives that client nothing: with a next token due
    # within 0.5 s, it gives up 0.5 s after the last token it had before the preemption.
    data = restarted_fork_group(tmp_path, "step")
    whole = run_scenario(scenario_from_dict(data), base_dir=tmp_path).systems["s"]
    assert whole.requests["max_itl_s"].iloc[1] > 1.0
    data["workload"]["itl_timeout_s"] = 0.5
    result = run_scenario(scenario_from_dict(data), base_dir=tmp_path).systems["s"]
    requests, ends = result.requests, step_ends(result.steps)
    assert requests["abandoned_s"].notna().tolist() == [False, True]
    preempted, back = preempted_and_back(result.steps)
    assert requests["abandoned_s"].iloc[1] == pytest.approx(ends[preempted - 1] + 0.5,
                                                            rel=1e-12)
    # Seated again at once, it was regenerating when its client left, after the other
    # had finished: stepping that long from its seating gave the client nothing.
    assert requests["preemptions"].iloc[1] == 1
    assert requests["abandoned_s"].iloc[1] > requests["finished_s"].iloc[0]
    # In vain: both samples' tokens, those its client had and those regenerated since (by
    # the step in which it left, too).
    had = len(received_before(ends, requests["first_token_s"].iloc[1], preempted))
    regenerated = int((ends[back:] < requests["abandoned_s"].iloc[1]).sum()) + 1
    assert 0 < regenerated < had
    assert result.summary["abandoned_output_tokens"] == 2 * (had + regenerated)
    assert result.summary["discarded_output_tokens"] == 2 * had
    data["engine"]["mode"] = "jump"
    jumped = run_scenario(scenario_from_dict(data), base_dir=tmp_path).systems["s"]
    pd.testing.assert_frame_equal(jumped.requests, requests)


# Drawn scenarios (tests/test_engine_equality.py) whose fork groups start over: with and
# without clients who give up (a seat, a first token, the answer, a next token), some
# swapping where the swap space has room.
RESTARTING_SEEDS = (34, 47, 163, 223, 287, 311, 403, 405, 544, 619, 691, 783)


def test_the_itl_counts_each_token_a_served_client_received_after_its_first_once(
        itl_token_counts):
    # However often its group started over, and whatever its client had before.
    discarded = 0
    for seed in RESTARTING_SEEDS:
        data = random_scenario(seed)
        assert data["workload"]["sampling"].get("n", 1) > 1
        result = run_scenario(scenario_from_dict(data)).systems["s"]
        served = result.requests[result.requests["finished_s"].notna()]
        assert itl_token_counts[-1] == (served["output_len"] - 1).sum(), seed
        discarded += result.summary["discarded_output_tokens"]
    assert discarded > 10_000  # (the draws still restart groups)
