"""Contiguous virtual memory backed by physical pages on demand (vAttention): memory as
paged with a page's tokens for a block and no sharing, attention without a block table."""

from __future__ import annotations

import pandas as pd
import pytest

from sim.engine import run_scenario
from sim.presets import MODEL_PRESETS, SizingError
from sim.scenario import ScenarioError, scenario_from_dict


@pytest.mark.parametrize(("model", "page_kib", "tp", "kv_bytes", "tokens"), [
    ("llama-2-7b", 2048, 1, None, 256),   # 32 KV heads × 128 × 2 B = 8 KiB a token a layer
    ("llama-2-7b", 64, 1, None, 8),
    ("llama-2-7b", 2048, 2, None, 512),   # half the heads on each GPU
    ("llama-3-8b", 2048, 1, None, 1024),  # GQA: 8 KV heads, 2 KiB
    ("llama-3-8b", 2048, 1, 1, 2048),     # fp8: one byte an element
])
def test_a_page_holds_one_layers_k_for_this_many_tokens(model, page_kib, tp, kv_bytes, tokens):
    import dataclasses

    spec = dataclasses.replace(MODEL_PRESETS[model], kv_dtype_bytes=kv_bytes)
    assert spec.tokens_per_page(page_kib * 1024, tp) == tokens


def scenario(*systems: dict, model: str = "llama-2-7b", **top) -> dict:
    return {
        "name": "virtual", "model": model, "memory": {"kv_memory_gib": 4},
        "workload": {"arrival": {"process": "poisson", "rate": 40},
                     "prompt_len": {"dist": "lognormal", "mean": 200, "p99": 1500,
                                    "max": 2000},
                     "output_len": {"dist": "lognormal", "mean": 150, "p99": 1000,
                                    "max": 1024}},
        "systems": list(systems), "stop": {"num_requests": 400}, **top,
    }


def test_virtual_memory_is_paged_memory_with_a_pages_tokens_and_no_block_table():
    # 64 KiB pages of Llama-2-7B hold 8 tokens: memory behaves as 8-token blocks without
    # a prefix cache. With no paging overhead in the timing model, the runs are identical.
    virtual = {"name": "v", "allocator": {"kind": "virtual", "page_kib": 64}}
    paged = {"name": "p", "allocator": {"kind": "paged", "block_size": 8,
                                        "prefix_caching": False}}
    same = run_scenario(scenario_from_dict(scenario(virtual, paged,
                                                    timing={"paged_alpha": 0.0})))
    pd.testing.assert_frame_equal(same.systems["v"].requests, same.systems["p"].requests)
    assert same.systems["v"].summary["preemptions"] > 0  # memory was the limit
    # With the default overhead ρ(8) = 1 + 2/8, only the block table pays it.
    timed = run_scenario(scenario_from_dict(scenario(virtual, paged)))
    v, p = timed.systems["v"].summary, timed.systems["p"].summary
    assert v["tpot_p50_s"] < p["tpot_p50_s"]
    assert v["throughput_tok_s"] > p["throughput_tok_s"]


def test_large_pages_waste_what_their_last_page_leaves_unfilled():
    # 2 MB pages of Llama-3-8B (GQA) hold 1,024 tokens: most requests fill a fraction of one.
    systems = [{"name": f"v{kib}", "allocator": {"kind": "virtual", "page_kib": kib}}
               for kib in (64, 2048)]
    result = run_scenario(scenario_from_dict(scenario(*systems, model="llama-3-8b")))
    small, large = (result.systems[n].summary for n in ("v64", "v2048"))
    assert small["internal_frac_of_allocated"] < 0.02
    assert large["internal_frac_of_allocated"] > 0.3
    assert large["throughput_tok_s"] < small["throughput_tok_s"]
    assert small["prefix_hit_rate"] is None  # no sharing between requests' pages


def test_bad_pages_are_one_line_errors():
    huge_heads = {"name": "wide", "num_layers": 2, "num_heads": 64, "num_kv_heads": 64,
                  "head_dim": 128, "num_params": 1e9, "max_model_len": 4096}
    data = scenario({"name": "v", "allocator": {"kind": "virtual", "page_kib": 4}})
    data["model"] = huge_heads  # 16 KiB of K a token a layer: a 4 KiB page holds none
    with pytest.raises(SizingError, match=r"systems\[v\]\.allocator\.page_kib: a 4 KiB page "
                                          r"holds not one token") as err:
        run_scenario(scenario_from_dict(data))
    assert "\n" not in str(err.value)
    tiny = scenario({"name": "v", "allocator": {"kind": "virtual"}}, model="llama-3-8b")
    tiny["memory"] = {"kv_memory_gib": 0.1}  # 800 slots: not one 1,024-token page
    tiny["workload"]["prompt_len"] = {"dist": "constant", "value": 10}
    tiny["workload"]["output_len"] = {"dist": "constant", "value": 10}
    with pytest.raises(SizingError, match=r"smaller than one page \(1024 slots\) of system "
                                          r"'v'"):
        run_scenario(scenario_from_dict(tiny))
    with pytest.raises(ScenarioError, match=r"allocator\.block_size: unknown key"):
        scenario_from_dict(scenario({"name": "v", "allocator": {"kind": "virtual",
                                                                "block_size": 16}}))
