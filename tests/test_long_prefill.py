"""vLLM's --long-prefill-token-threshold: the most prompt tokens one request reads in a step.

Hand-worked steps of a scheduler, the refusals and the note, the engine stepping and jumping
alike, and what the cap buys on a load of long prompts: steps no longer than a capped chunk,
so decoding requests wait less between tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from sim.api import run
from sim.memory import PagedAllocator
from sim.scenario import ScenarioError, SchedulerConfig, scenario_from_dict
from sim.scheduler import Request, Scheduler
from workloads.trace import Trace


def step_by_step(threshold: int | None) -> tuple[list[list[tuple[str, int, int]]], list[float]]:
    """Two prompts, A of 50 tokens and B of 30, both arriving at 0 with 2 tokens to
    generate, in 64-token steps (a step a second): each step's prefill chunks (name, tokens,
    tokens read before), and the first-token times of A and B."""
    trace = Trace.from_columns(arrival_s=np.zeros(2), prompt_len=np.array([50, 30]),
                               output_len=np.array([2, 2]))
    config = SchedulerConfig(chunked_prefill=True, max_num_batched_tokens=64,
                             long_prefill_token_threshold=threshold)
    sched = Scheduler(PagedAllocator(100, 16, watermark=0.0), config, debug=True)
    a, b = (Request(trace, i, 0.0) for i in range(2))
    assert sched.add(a) and sched.add(b)
    names = {id(a): "A", id(b): "B"}
    chunks = []
    clock = 0.0
    while (sched.running or sched.waiting) and clock < 20:
        batch = sched.schedule(clock)
        chunks.append([(names[id(r)], chunk, before) for r, chunk, before in batch.prefill])
        clock += 1.0
        sched.finish_step(batch, clock)
    return chunks, [a.first_token_s, b.first_token_s]


def test_a_capped_prompt_leaves_the_rest_of_the_budget_to_the_next():
    # Uncapped, A takes 50 of the 64 tokens and B the 14 left: A's first token after one
    # step, B's after two.
    chunks, first = step_by_step(None)
    assert chunks[:2] == [[("A", 50, 0), ("B", 14, 0)], [("B", 16, 14)]]
    assert first == [1.0, 2.0]
    # Capped at 20, each reads 20 a step beside the other: B is done in two steps (20, 10),
    # A in three (20, 20, 10), the step its rest shares with B's first decode.
    chunks, first = step_by_step(20)
    assert chunks[:3] == [[("A", 20, 0), ("B", 20, 0)], [("A", 20, 20), ("B", 10, 20)],
                          [("A", 10, 40)]]
    assert first == [3.0, 2.0]
    # A cap the budget never reaches changes nothing, nor does 0, vLLM's "no cap".
    assert step_by_step(64) == step_by_step(0) == step_by_step(None)


BASE = {"name": "t", "model": "llama-3.1-8b", "gpu": "h100-80g",
        "workload": {"arrival": {"process": "poisson", "rate": 4},
                     "prompt_len": {"dist": "lognormal", "mean": 1500, "p99": 12000,
                                    "max": 14000},
                     "output_len": {"dist": "uniform", "low": 20, "high": 200}},
        "max_model_len": 16384,
        "systems": [{"name": "s", "allocator": {"kind": "paged"},
                     "scheduler": {"chunked_prefill": True,
                                   "long_prefill_token_threshold": 512}}],
        "stop": {"num_requests": 150}}


def with_scheduler(**scheduler) -> dict:
    """BASE with its system's scheduler settings changed."""
    system = BASE["systems"][0]
    return {**BASE, "systems": [{**system, "scheduler": {**system["scheduler"], **scheduler}}]}


@pytest.mark.parametrize("system, message", [
    ({"scheduler": {"long_prefill_token_threshold": 512}},
     "long_prefill_token_threshold needs chunked_prefill: true"),
    ({"scheduler": {"chunked_prefill": True, "long_prefill_token_threshold": 3},
      "speculative": {"method": "ngram", "num_speculative_tokens": 3,
                      "mean_acceptance_length": 2.0}},
     "long_prefill_token_threshold: 3 is fewer than the 4 tokens a decode step reads"),
    ({"scheduler": {"chunked_prefill": True, "long_prefill_token_threshold": -1}},
     "long_prefill_token_threshold: Input should be greater than or equal to 0"),
])
def test_a_cap_that_cannot_work_is_refused_in_one_line(system, message):
    data = {**BASE, "systems": [{"name": "s", "allocator": {"kind": "paged"}, **system}]}
    with pytest.raises(ScenarioError) as refused:
        scenario_from_dict(data, "x.yaml")
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_cap_past_the_budget_is_noted_as_changing_nothing():
    scenario = scenario_from_dict(with_scheduler(long_prefill_token_threshold=8192))
    assert any("long_prefill_token_threshold 8,192 changes nothing" in note
               for note in scenario.setting_notes())
    scenario = scenario_from_dict(with_scheduler(long_prefill_token_threshold=8191))
    assert not any("long_prefill_token_threshold" in note for note in scenario.setting_notes())


def test_capped_chunks_keep_steps_short_and_tokens_coming():
    capped = run(BASE).systems["s"]
    uncapped = run(BASE, overrides={
        "systems[s].scheduler.long_prefill_token_threshold": None}).systems["s"]
    # No step reads more than the cap of each prompt it reads, where uncapped one prompt
    # may take what decoding leaves of the step's 8,192.
    steps = capped.steps
    assert (steps["prefill_tokens"] <= 512 * steps["prefill_requests"]).all()
    assert (steps["prefill_requests"] > 1).any()  # several prompts read beside each other
    assert uncapped.steps["prefill_tokens"].max() > 8000
    longest = {name: (result.steps["duration_s"] / result.steps["steps"]).max()
               for name, result in (("capped", capped), ("uncapped", uncapped))}
    assert longest["capped"] < longest["uncapped"] / 3
    # Shorter steps: decoding requests wait less between tokens, and every request is done.
    assert capped.summary["itl_p99_s"] < uncapped.summary["itl_p99_s"]
    assert capped.summary["max_itl_p99_s"] < uncapped.summary["max_itl_p99_s"]
    assert capped.summary["completed"] == uncapped.summary["completed"] == 150


@pytest.mark.parametrize("threshold", [1, 48, 100])
def test_a_state_cache_reads_capped_chunks_to_its_block_boundaries(threshold):
    # Mode align cuts chunks to end on its 64-token blocks: a cap of 100 reads a block a
    # step; one below a block (48) goes on to the boundary (48, 16, 48, 16, ...), a state
    # kept at each; a cap of 1 reads a token a step. The engine stepping and jumping agree.
    from test_state_space import SHARED

    data = {**SHARED, "systems": [{**SHARED["systems"][0], "scheduler": {
        **SHARED["systems"][0]["scheduler"], "long_prefill_token_threshold": threshold}}]}
    steps = run(data).systems["s"].steps
    chunks = steps[steps["prefill_tokens"] > 0]["prefill_tokens"].tolist()
    if threshold == 100:
        assert chunks[:18] == [64] * 17 + [12]
    elif threshold == 48:
        assert chunks[:4] == [48, 16, 48, 16]
    assert (steps["prefill_tokens"] <= threshold * steps["prefill_requests"]).all()
    jumped = run(data, overrides={"engine.mode": "jump",
                                  "engine.debug_invariants": False}).systems["s"]
    assert jumped.requests.equals(run(data).systems["s"].requests)


@pytest.mark.parametrize("command", ["validate", "run", "capacity"])
def test_contiguous_forks_beside_capped_chunks_are_refused_in_one_line(tmp_path, command):
    # A forked request's samples find their contiguous extents when its prompt's last chunk
    # is read; capped chunks leave budget to seat others meanwhile, who may take that room.
    # Each command refuses it before running, as any workload's samples, and leaves no
    # empty output folder behind.
    from conftest import kvsim_in_process

    data = {**BASE, "model": "llama-2-7b", "gpu": "a100-80g", "max_model_len": 4096,
            "workload": {**BASE["workload"], "sampling": {"n": 2},
                         "prompt_len": {"dist": "constant", "value": 600}},
            "systems": [{"name": "c", "allocator": {"kind": "contiguous"},
                         "scheduler": {"chunked_prefill": True,
                                       "long_prefill_token_threshold": 64}}]}
    path = tmp_path / "fork.yaml"
    path.write_text(yaml.safe_dump(data))
    arguments = {"validate": [], "run": ["-o", str(tmp_path / "out"), "--quiet"],
                 "capacity": ["--ttft-s", "1", "-o", str(tmp_path / "out"), "--quiet"]}[command]
    outcome = kvsim_in_process(command, str(path), *arguments)
    assert outcome.returncode == 2 and outcome.stderr.count("\n") == 1
    assert "fork: request 0 of synthetic has 2 samples, whose contiguous extents" in (
        outcome.stderr)
    assert not (tmp_path / "out").exists()
    # Fanned out, each sample a request of its own (vLLM v1's way), it runs.
    data["systems"][0]["scheduler"]["parallel_sampling"] = "fan_out"
    path.write_text(yaml.safe_dump(data))
    assert kvsim_in_process("validate", str(path)).returncode == 0
