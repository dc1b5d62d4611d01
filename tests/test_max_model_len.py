"""A context limit below the model's (vLLM's --max-model-len): what a request may reach, and
what a contiguous max_model_len reservation sets aside."""

from __future__ import annotations

import pandas as pd
import pytest

from sim.api import load
from sim.engine import build_allocator, memory_summary, run_scenario, scenario_pool_slots
from sim.memory import ContiguousAllocator
from sim.scenario import ScenarioError, scenario_from_dict


def scenario(**extra) -> dict:
    return {
        "name": "context", "model": "llama-3.1-8b", "gpu": "h100-80g",
        "memory": {"kv_memory_gib": 8},  # 65,536 tokens of 128 KiB
        "workload": {"arrival": {"process": "poisson", "rate": 20},
                     "prompt_len": {"dist": "lognormal", "mean": 500, "sigma": 0.8,
                                    "max": 2000},
                     "output_len": {"dist": "lognormal", "mean": 200, "sigma": 0.8,
                                    "max": 1000}},
        "systems": [{"name": "contiguous-max", "allocator": {"kind": "contiguous"}},
                    {"name": "paged-16", "allocator": {"kind": "paged"}}],
        "stop": {"num_requests": 150},
        **extra,
    }


def test_the_limit_is_what_a_max_model_len_reservation_sets_aside():
    runs = {}
    for limit in (4096, 16384):
        data = scenario_from_dict(scenario(max_model_len=limit))
        assert data.model_spec().max_model_len == limit
        system = data.systems[0]
        alloc = build_allocator(system, scenario_pool_slots(data), limit)
        assert isinstance(alloc, ContiguousAllocator) and alloc.max_model_len == limit
        runs[limit] = run_scenario(data).systems
    # The same requests (none reaches 4,096 tokens), seated 16 or 4 at a time by the
    # contiguous reservation; paging never looks at the limit.
    short, long = runs[4096], runs[16384]
    pd.testing.assert_frame_equal(short["contiguous-max"].requests[["prompt_len", "output_len"]],
                                  long["contiguous-max"].requests[["prompt_len", "output_len"]])
    assert short["contiguous-max"].summary["peak_batch"] == 16
    assert long["contiguous-max"].summary["peak_batch"] == 4
    assert short["contiguous-max"].summary["mean_batch"] > 3 * long["contiguous-max"].summary[
        "mean_batch"]
    assert short["paged-16"].summary == long["paged-16"].summary


def test_requests_are_clipped_to_the_limit_and_the_run_says_how_many():
    clipped = run_scenario(scenario_from_dict(scenario(max_model_len=1024)))
    requests = clipped.systems["paged-16"].requests
    assert (requests["prompt_len"] + requests["output_len"] <= 1024).all()
    assert (requests["prompt_len"] == 1023).any()  # prompts of up to 2,000 tokens, clipped
    # The same draws under the model's own context: what the limit cut.
    whole = run_scenario(scenario_from_dict(scenario()))
    assert whole.trace_notes == []
    drawn = whole.systems["paged-16"].requests
    prompts = int((drawn["prompt_len"] > 1023).sum())
    outputs = int((drawn["output_len"] > 1024 - requests["prompt_len"]).sum())
    assert 0 < prompts < outputs < 150
    assert clipped.trace_notes == [
        f"clipped {prompts} of 150 prompts to the context limit 1,023",
        f"clipped {outputs} of 150 outputs to the room the context limit (1,024 tokens) "
        "leaves after their prompts"]


def test_a_limit_past_the_models_context_is_refused_in_one_line():
    with pytest.raises(ScenarioError) as caught:
        scenario_from_dict(scenario(max_model_len=200_000))
    assert str(caught.value) == (
        "<scenario>: max_model_len: 200,000 exceeds llama-3.1-8b's context of 131,072 tokens; "
        "expected at most that (vLLM refuses a longer --max-model-len too)")


def test_the_memory_line_says_when_vllm_would_refuse_to_start():
    # 65,536 tokens of pool against Llama-3.1's 131,072-token context: not one request.
    whole = memory_summary(scenario_from_dict(scenario()))
    assert "maximum concurrency for 131,072 tokens per request: 0.50x (under 1x: vLLM would " \
           "refuse to start" in whole
    limited, _ = load(scenario(), overrides={"max_model_len": 8192})  # as --set does
    assert "for 8,192 tokens per request: 8.00x" in memory_summary(limited)
    assert "refuse" not in memory_summary(limited)
