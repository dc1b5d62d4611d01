"""A narrower KV cache: fp8 (vLLM's --kv-cache-dtype), half the bytes per token of a 16-bit
model; FP4 (SGLang's fp4_e2m1, TensorRT-LLM's NVFP4), 4.5 bits an element with its scales."""

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
                       r"fp8_e4m3, fp8_e5m2, fp4_e2m1, nvfp4, got 'int4'"):
        Calibration.load(tmp_path / "bad.yaml")


def test_an_unknown_kv_dtype_is_refused_in_one_line():
    with pytest.raises(ScenarioError) as error:
        scenario_from_dict(scenario("int8"), "s.yaml")
    message = str(error.value)
    assert message.startswith("s.yaml: memory.kv_cache_dtype: Input should be 'auto', 'fp8'")
    assert "\n" not in message


@pytest.mark.parametrize("fp4", ["fp4_e2m1", "nvfp4"])
def test_fp4_stores_four_and_a_half_bits_an_element_on_blackwell(fp4):
    on_b200 = {"gpu": "b200-180g"}
    auto = scenario_from_dict(scenario(**on_b200)).model_spec()
    narrow = scenario_from_dict(scenario(fp4, **on_b200)).model_spec()
    # 4 bits a value and an 8-bit scale a block of 16: 2 × 32 × 4,096 × 0.5625 bytes.
    assert narrow.kv_bytes_per_token == 147_456 == auto.kv_bytes_per_token * 9 // 32
    gpu = scenario_from_dict(scenario(**on_b200)).gpu_spec()
    assert kv_pool_slots(narrow, gpu, kv_memory_gib=9) == 9 * GIB // 147_456
    auto_timing = build_timing(scenario_from_dict(scenario(**on_b200)), Path())
    narrow_timing = build_timing(scenario_from_dict(scenario(fp4, **on_b200)), Path())
    assert narrow_timing.c == pytest.approx(auto_timing.c * 9 / 32)
    for coefficient in "abde":
        assert getattr(narrow_timing, coefficient) == getattr(auto_timing, coefficient)
    # vAttention's pages hold whole tokens of one layer's K (4,096 elements, 2,304 bytes).
    assert narrow.tokens_per_page(2 * 1024 * 1024, 1) == 910
    # MLA's latent (576 elements) scales in blocks of 16 too.
    mla = scenario_from_dict(scenario(fp4, **on_b200, model="deepseek-v2-lite")).model_spec()
    assert mla.kv_bytes_per_token == 27 * 576 * 9 // 16


def test_fp4_is_refused_where_no_kernel_reads_it():
    with pytest.raises(ScenarioError) as error:
        scenario_from_dict(scenario("fp4_e2m1"), "s.yaml")
    assert str(error.value) == (
        "s.yaml: memory.kv_cache_dtype: fp4_e2m1 is read by attention kernels of GPUs with FP4 "
        "tensor cores (Blackwell) only; a100-80g has none (an explicit gpu states "
        "peak_fp4_tflops)")
    explicit = {"name": "mine", "memory_gib": 80, "hbm_bandwidth_gbps": 2000,
                "peak_tflops": 300, "host_link_gbps": 64}
    with pytest.raises(ScenarioError, match="mine has none"):
        scenario_from_dict(scenario("nvfp4", gpu=explicit))
    fp4_gpu = {**explicit, "peak_fp4_tflops": 2400}
    assert scenario_from_dict(scenario("nvfp4", gpu=fp4_gpu)).model_spec().kv_element_bytes == (
        0.5625)
    odd = {"name": "odd", "num_layers": 4, "num_heads": 8, "num_kv_heads": 8, "head_dim": 72,
           "num_params": 1e9, "max_model_len": 4096}
    with pytest.raises(ScenarioError, match=r"nvfp4 scales blocks of 16 elements of a head; "
                                            r"odd's head_dim 72 is not a multiple of 16"):
        scenario_from_dict(scenario("nvfp4", gpu=fp4_gpu, model=odd))


def test_each_narrower_cache_serves_more_where_memory_binds():
    runs = {}
    for dtype in ("auto", "fp8", "nvfp4"):
        data = scenario(dtype, gpu="b200-180g", memory={"kv_memory_gib": 1})
        data["workload"]["arrival"]["rate"] = 40  # more than any of the pools seats
        runs[dtype] = run_scenario(scenario_from_dict(data)).systems["paged"].summary
    # Whole 16-token blocks of 147,456-byte tokens (0.5 MiB ones before).
    assert runs["auto"]["capacity_slots"] == GIB // 524_288
    assert runs["nvfp4"]["capacity_slots"] == GIB // 147_456 // 16 * 16
    assert runs["auto"]["mean_batch"] < runs["fp8"]["mean_batch"] < runs["nvfp4"]["mean_batch"]
    assert (runs["auto"]["throughput_tok_s"] < runs["fp8"]["throughput_tok_s"]
            < runs["nvfp4"]["throughput_tok_s"])
