"""An fp8 KV cache (vLLM's --kv-cache-dtype): half the bytes per token of a 16-bit model."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.engine import build_timing, host_memory, run_scenario
from sim.presets import GIB, kv_pool_slots
from sim.scenario import ScenarioError, scenario_from_dict
from sim.timing import Calibration, CalibrationError


def scenario(kv_cache_dtype: str = "auto", **extra) -> dict:
    memory = {"kv_cache_dtype": kv_cache_dtype, **extra.pop("memory", {})}
    return {
        "name": "kv-dtype", "model": "llama-2-7b", "gpu": "a100-80g", "memory": memory,
        "workload": {"arrival": {"process": "poisson", "rate": 8},
                     "prompt_len": {"dist": "lognormal", "mean": 400, "sigma": 0.6,
                                    "max": 2000},
                     "output_len": {"dist": "lognormal", "mean": 200, "sigma": 0.6,
                                    "max": 800}},
        "systems": [{"name": "contiguous", "allocator": {"kind": "contiguous"}},
                    {"name": "paged", "allocator": {"kind": "paged",
                                                    "host_cache_gib": 2}}],
        "stop": {"num_requests": 200},
        **extra,
    }


@pytest.mark.parametrize("fp8", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_halves_the_bytes_of_a_token_and_nothing_else(fp8):
    auto = scenario_from_dict(scenario()).model_spec()
    narrow = scenario_from_dict(scenario(fp8)).model_spec()
    # Llama-2-7B: 2 × 32 layers × 32 heads × 128 × 2 bytes = 0.5 MiB a token in fp16.
    assert auto.kv_bytes_per_token == 524_288
    assert narrow.kv_bytes_per_token == 262_144
    assert narrow.weight_bytes == auto.weight_bytes
    gpu = scenario_from_dict(scenario()).gpu_spec()
    # The pool: an explicit size holds exactly twice the tokens; GPU memory less weights,
    # twice give or take the rounding down of each.
    assert (kv_pool_slots(narrow, gpu, kv_memory_gib=8)
            == 2 * kv_pool_slots(auto, gpu, kv_memory_gib=8) == 8 * GIB // 262_144)
    pool_bytes = gpu.memory_bytes * 0.9 - auto.weight_bytes
    assert kv_pool_slots(narrow, gpu) == int(pool_bytes // 262_144)
    # Decode attention reads half the bytes; weights, FLOPs and prefill stay as they were.
    auto_timing = build_timing(scenario_from_dict(scenario()), Path())
    narrow_timing = build_timing(scenario_from_dict(scenario(fp8)), Path())
    assert narrow_timing.c == pytest.approx(auto_timing.c / 2)
    for coefficient in "abde":
        assert getattr(narrow_timing, coefficient) == getattr(auto_timing, coefficient)
    # A host tier holds twice the tokens and loads each in half the time.
    paged = scenario_from_dict(scenario()).systems[1]
    (auto_slots, _, auto_load_s), (narrow_slots, _, narrow_load_s) = (
        host_memory(scenario_from_dict(scenario(d)), paged) for d in ("auto", fp8))
    assert narrow_slots == 2 * auto_slots
    assert narrow_load_s == pytest.approx(auto_load_s / 2)


def test_twice_the_tokens_in_the_same_memory_serve_more():
    runs = {dtype: run_scenario(scenario_from_dict(scenario(dtype, memory={
        "kv_memory_gib": 4}))).systems for dtype in ("auto", "fp8")}
    for system in ("contiguous", "paged"):
        auto, fp8 = (runs[d][system].summary for d in ("auto", "fp8"))
        assert fp8["capacity_slots"] == 2 * auto["capacity_slots"]
        assert fp8["mean_batch"] > auto["mean_batch"]
        assert fp8["throughput_tok_s"] > auto["throughput_tok_s"]


def test_a_calibration_is_for_one_kv_dtype(tmp_path):
    calibration = Calibration(model="llama-2-7b", device="test",
                              coefficients=dict.fromkeys("abcde", 1e-5), rho={}, fit={})
    calibration.dump(tmp_path / "cal.yaml")
    loaded = Calibration.load(tmp_path / "cal.yaml")
    assert loaded == calibration and loaded.kv_cache_dtype == "auto"
    timing = {"timing": {"calibration": "cal.yaml"}}
    assert build_timing(scenario_from_dict(scenario(**timing)), tmp_path).c == 1e-5
    with pytest.raises(CalibrationError, match=r"kv_cache_dtype: timed with kv_cache_dtype "
                       r"auto, but the scenario's memory.kv_cache_dtype is fp8, "):
        build_timing(scenario_from_dict(scenario("fp8", **timing)), tmp_path)
    # fp8 timings serve every one-byte format, and only those.
    Calibration(**{**calibration.__dict__, "kv_cache_dtype": "fp8_e4m3"}).dump(
        tmp_path / "cal.yaml")
    assert build_timing(scenario_from_dict(scenario("fp8_e5m2", **timing)), tmp_path).c == 1e-5
    with pytest.raises(CalibrationError, match="timed with kv_cache_dtype fp8_e4m3,"):
        build_timing(scenario_from_dict(scenario(**timing)), tmp_path)
    (tmp_path / "bad.yaml").write_text((tmp_path / "cal.yaml").read_text().replace(
        "kv_cache_dtype: fp8_e4m3", "kv_cache_dtype: int4"))
    with pytest.raises(CalibrationError, match=r"kv_cache_dtype: expected one of auto, fp8, "
                       r"fp8_e4m3, fp8_e5m2, got 'int4'"):
        Calibration.load(tmp_path / "bad.yaml")


def test_an_unknown_kv_dtype_is_refused_in_one_line():
    with pytest.raises(ScenarioError) as error:
        scenario_from_dict(scenario("int8"), "s.yaml")
    message = str(error.value)
    assert message.startswith("s.yaml: memory.kv_cache_dtype: Input should be 'auto', 'fp8'")
    assert "\n" not in message
