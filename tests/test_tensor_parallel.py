"""Tensor parallelism: the pool per GPU, the roofline's split and all-reduces, the scenario's
checks, the engine's per-GPU figures and the sweep figures that keep GPU counts apart."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import kvsim_in_process

from reports.run_figures import memory_over_time
from reports.sweep_report import sweep_figures
from sim.engine import build_timing, run_scenario
from sim.metrics import format_summary, sweep_metrics
from sim.presets import GIB, GpuSpec, SizingError, kv_pool_slots, lookup_gpu, lookup_model
from sim.scenario import ScenarioError, scenario_from_dict
from sim.sweep import run_sweep
from sim.timing import Calibration, CalibrationError, roofline

ROOT = Path(__file__).resolve().parents[1]
LLAMA_70B = lookup_model("llama-2-70b")  # 80 layers, 64 heads, 8 KV heads, head_dim 128
A100 = lookup_gpu("a100-80g")


def scenario(tp: int, **overrides) -> dict:
    data = {
        "name": "tp",
        "model": "llama-2-70b",
        "gpu": "a100-80g",
        "parallel": {"tensor_parallel_size": tp},
        "workload": {"arrival": {"process": "poisson", "rate": 8},
                     "prompt_len": {"dist": "uniform", "low": 50, "high": 1500},
                     "output_len": {"dist": "uniform", "low": 20, "high": 400}},
        "systems": [{"name": "contiguous", "allocator": {"kind": "contiguous"}},
                    {"name": "paged", "allocator": {"kind": "paged"}}],
        "stop": {"num_requests": 150},
    }
    data.update(overrides)
    return data


def test_kv_heads_split_then_replicate():
    assert [LLAMA_70B.kv_heads_per_gpu(tp) for tp in (1, 2, 4, 8, 16, 32)] == [
        8, 4, 2, 1, 1, 1]
    # 2 × layers × heads × head_dim × fp16: 8 heads → 327,680 B; one head → 40,960 B.
    assert LLAMA_70B.kv_bytes_per_token_per_gpu(1) == LLAMA_70B.kv_bytes_per_token == 327_680
    assert LLAMA_70B.kv_bytes_per_token_per_gpu(8) == LLAMA_70B.kv_bytes_per_token_per_gpu(16)
    assert LLAMA_70B.kv_bytes_per_token_per_gpu(8) == 40_960
    assert LLAMA_70B.tensor_parallel_problem(8) is None
    assert LLAMA_70B.tensor_parallel_problem(16) is None  # 8 KV heads replicated twice
    assert "64 attention heads do not divide over 3 GPUs" in LLAMA_70B.tensor_parallel_problem(3)
    llama_7b = lookup_model("llama-2-7b")  # 32 heads, 32 KV heads
    assert llama_7b.tensor_parallel_problem(64) == (
        "llama-2-7b's 32 attention heads do not divide over 64 GPUs")


def test_pool_per_gpu_under_tensor_parallelism():
    # One GPU's memory × 0.9 − its half of the weights, over its half of the KV heads.
    expected = int((A100.memory_bytes * 0.9 - 68.98e9 * 2 / 2) // (2 * 80 * 4 * 128 * 2))
    assert kv_pool_slots(LLAMA_70B, A100, tensor_parallel_size=2) == expected == 50_838
    slots = [kv_pool_slots(LLAMA_70B, A100, tensor_parallel_size=tp) for tp in (2, 4, 8)]
    assert slots[0] < slots[1] < slots[2]
    # An explicit pool is the engine's, all GPUs together: while KV heads divide evenly, the
    # slot count does not depend on how many GPUs share it; replication costs slots.
    explicit = [kv_pool_slots(LLAMA_70B, A100, kv_memory_gib=10, tensor_parallel_size=tp)
                for tp in (1, 2, 4, 8, 16)]
    assert explicit[:4] == [10 * GIB // 327_680] * 4
    assert explicit[4] == explicit[3] // 2
    # A single GPU of either model was sized the same way before tensor parallelism existed.
    llama_7b = lookup_model("llama-2-7b")
    assert kv_pool_slots(llama_7b, A100) == int(
        (A100.memory_bytes * 0.9 - 6.74e9 * 2) // 524_288)


def test_weights_that_do_not_fit_say_how_many_gpus_would():
    with pytest.raises(SizingError, match=r"llama-2-70b weights \(128\.5 GiB\) do not fit in 90% "
                       r"of a100-80g \(72\.0 GiB\): no KV pool left; shard them over 2 GPUs "
                       r"\(parallel\.tensor_parallel_size: 2\)"):
        kv_pool_slots(LLAMA_70B, A100)
    a100_40 = lookup_gpu("a100-40g")
    with pytest.raises(SizingError, match=r"weights \(1/2 of them\) .* over 4 GPUs"):
        kv_pool_slots(LLAMA_70B, a100_40, tensor_parallel_size=2)
    # The fewest GPUs that also split the heads evenly: three 24 GiB GPUs would hold
    # Qwen3-30B-A3B's 56.8 GiB of weights, but its 32 heads need four.
    small = GpuSpec("24g", 24 * 1024**3, 300e9, 121e12, 100e9)
    with pytest.raises(SizingError, match=r"shard them over 4 GPUs"):
        kv_pool_slots(lookup_model("qwen3-30b-a3b"), small)
    # DeepSeek-V3 (625 GiB in FP8) needs 9 A100-80G, which its 128 heads round to 16: more
    # than one 8-GPU board: two boards as pipeline stages hold it.
    with pytest.raises(SizingError, match=r"no tensor-parallel group of at most 8 a100-80g GPUs "
                       r"\(one board\) holds them: split the layers over boards as 2 "
                       r"pipeline stages .*, choose a GPU with more memory"):
        kv_pool_slots(lookup_model("deepseek-v3"), A100)
    assert kv_pool_slots(lookup_model("deepseek-v3"), lookup_gpu("h200-141g"),
                         tensor_parallel_size=8) > 0
    with pytest.raises(SizingError, match="do not divide over 3 GPUs"):
        kv_pool_slots(LLAMA_70B, A100, tensor_parallel_size=3)


def test_roofline_splits_work_and_adds_two_allreduces_per_layer():
    one = roofline(lookup_model("llama-2-7b"), A100)
    assert one.a == 6.74e9 * 2 / 2039e9 + 1e-3  # unchanged without tensor parallelism
    assert one.b == one.d == 2 * 6.74e9 / 312e12
    four = roofline(LLAMA_70B, A100, tensor_parallel_size=4, allreduce_latency_s=20e-6)
    allreduces = 2 * 80
    ring_bytes = 2 * 3 / 4 * 8192 * 2  # 2(N−1)/N of hidden × fp16 per token, per all-reduce
    assert four.a == pytest.approx(68.98e9 * 2 / 4 / 2039e9 + 1e-3 + allreduces * 20e-6)
    assert four.b == pytest.approx(2 * 68.98e9 / 4 / 312e12 + allreduces * ring_bytes / 300e9)
    assert four.d == four.b
    assert four.c == pytest.approx(2 * 80 * 2 * 128 * 2 / 2039e9)
    assert four.e == pytest.approx(2 * 80 * 8192 / 4 / 312e12)
    assert four.source == "roofline(llama-2-70b, 4 × a100-80g)"
    eight = roofline(LLAMA_70B, A100, tensor_parallel_size=8)
    # More GPUs: a faster decode step, but not 2× faster (all-reduces, replicated KV heads).
    step4 = four.step_time(64, 64 * 1000, 0, 0, 1.0)
    step8 = eight.step_time(64, 64 * 1000, 0, 0, 1.0)
    assert step4 / 2 < step8 < step4


def test_gpu_presets_trade_bandwidth_for_flops_and_nvlink_for_pcie():
    llama = lookup_model("llama-3.1-70b")
    h100, h20, l40s = (lookup_gpu(name) for name in ("h100-80g", "h20-96g", "l40s-48g"))
    on_h100, on_h20 = (roofline(llama, gpu, tensor_parallel_size=4) for gpu in (h100, h20))
    # The H20 reads faster than the H100 (4.0 against 3.35 TB/s) and multiplies 989/148 times
    # slower: a decode step of one sequence, which reads the weights, comes sooner; one of
    # 256, or a prefill of 8,192 tokens, which multiply, much later.
    assert on_h20.c == pytest.approx(on_h100.c * 3.35 / 4.0)
    assert on_h20.a < on_h100.a
    assert on_h20.step_time(1, 2000, 0, 0, 1.0) < on_h100.step_time(1, 2000, 0, 0, 1.0)
    for decode_seqs, prefill_tokens in ((256, 0), (0, 8192)):
        steps = [gpu.step_time(decode_seqs, decode_seqs * 2000, prefill_tokens, 0, 1.0)
                 for gpu in (on_h100, on_h20)]
        assert steps[1] > 2 * steps[0]
    # The L40S's GPUs all-reduce over PCIe, 32 GB/s a way: the same all-reduced bytes a token
    # cost 14 times NVLink's 450.
    ring_bytes = 2 * 80 * 2 * 3 / 4 * 8192 * 2  # 160 all-reduces of 2(N−1)/N × hidden × fp16
    on_l40s = roofline(llama, l40s, tensor_parallel_size=4)
    assert on_l40s.b - 2 * llama.num_params / 4 / 362e12 == pytest.approx(ring_bytes / 32e9)
    assert on_h100.b - 2 * llama.num_params / 4 / 989e12 == pytest.approx(ring_bytes / 450e9)
    with pytest.raises(ScenarioError, match=r"tensor_parallel_size 16: PCIe joins 8 l40s-48g "
                                            r"GPUs \(one server\) and the simulator models no "
                                            r"network between servers"):
        scenario_from_dict(scenario(16, gpu="l40s-48g"))
    with pytest.raises(SizingError, match=r"at most 8 l40s-48g GPUs \(one server\)"):
        kv_pool_slots(lookup_model("llama-3.1-405b"), l40s, tensor_parallel_size=8)


def test_scenario_checks_the_split(tmp_path):
    def error(data: dict) -> str:
        with pytest.raises(ScenarioError) as info:
            scenario_from_dict(data, "x.yaml")
        return str(info.value)

    assert error(scenario(3)) == ("x.yaml: parallel: tensor_parallel_size 3: llama-2-70b's 64 "
                                  "attention heads do not divide over 3 GPUs")
    assert error(scenario(16)).startswith(
        "x.yaml: parallel: tensor_parallel_size 16: NVLink joins 8 a100-80g GPUs (one board)")
    explicit_gpu = {"name": "mine", "memory_gib": 80, "hbm_bandwidth_gbps": 2000,
                    "peak_tflops": 300}
    assert error(scenario(2, gpu=explicit_gpu)) == (
        "x.yaml: parallel: tensor_parallel_size 2: the all-reduces need gpu.interconnect_gbps "
        "(GPU-to-GPU GB/s, one direction)")
    assert error(scenario(0)).startswith("x.yaml: parallel.tensor_parallel_size: Input should "
                                         "be greater than 0")
    # An explicit GPU with its link may go beyond one board.
    wide = scenario_from_dict(scenario(16, gpu={**explicit_gpu, "interconnect_gbps": 50}))
    assert wide.gpu_spec().interconnect_bytes_per_s == 50e9
    assert build_timing(wide, tmp_path).source == "roofline(llama-2-70b, 16 × mine)"


def test_engine_reports_gpus_and_throughput_per_gpu(tmp_path):
    results = {tp: run_scenario(scenario_from_dict(scenario(tp, engine={"replicas": 8 // tp})),
                                tmp_path).systems["paged"].summary for tp in (2, 8)}
    for tp, summary in results.items():
        assert summary["gpus"] == 8 and summary["replicas"] == 8 // tp
        assert summary["throughput_tok_s_per_gpu"] == pytest.approx(
            summary["throughput_tok_s"] / 8)
        assert summary["capacity_slots"] == kv_pool_slots(
            LLAMA_70B, A100, tensor_parallel_size=tp) // 16 * 16
        assert summary["completed"] == 150
    # One 8-GPU engine steps faster than each 2-GPU one: lower latency at this light load.
    assert results[8]["tpot_p50_s"] < results[2]["tpot_p50_s"]
    # The printed table shows throughput per GPU only where it differs from the total.
    table = format_summary({"tp2": results[2], "tp8": results[8]})
    (row,) = [line for line in table.splitlines() if line.startswith("output throughput per")]
    assert row.split()[-2:] == [f"{results[tp]['throughput_tok_s_per_gpu']:,.1f}" for tp in (2, 8)]
    single = run_scenario(scenario_from_dict(scenario(1, model="llama-2-7b")), tmp_path)
    assert single.systems["paged"].summary["gpus"] == 1
    assert "per GPU" not in format_summary({n: r.summary for n, r in single.systems.items()})


def test_memory_figure_shows_one_gpu_of_the_group(tmp_path):
    result = run_scenario(scenario_from_dict(scenario(4)), tmp_path)
    fig = memory_over_time(result)
    paged = next(ax for ax in fig.axes if ax.get_title(loc="left").startswith("paged"))
    assert paged.get_ylabel() == "KV memory per GPU (GiB, 1 of 4)"
    # The pool's top is what one GPU keeps for KV: 90 % of it less a quarter of the weights.
    per_gpu_kv_gib = (A100.memory_bytes * 0.9 - 68.98e9 * 2 / 4) / GIB
    assert paged.get_ylim()[1] == pytest.approx(per_gpu_kv_gib, rel=1e-4)


def test_a_calibration_records_its_gpu_count(tmp_path):
    calibration = Calibration(model="llama-2-70b", device="test",
                              coefficients=dict.fromkeys("abcde", 1e-5), rho={}, fit={},
                              tensor_parallel_size=4)
    calibration.dump(tmp_path / "cal.yaml")
    assert Calibration.load(tmp_path / "cal.yaml") == calibration
    matching = scenario_from_dict(scenario(4, timing={"calibration": "cal.yaml"}))
    assert build_timing(matching, tmp_path).a == pytest.approx(1e-5 + 1e-3)
    other = scenario_from_dict(scenario(2, timing={"calibration": "cal.yaml"}))
    with pytest.raises(CalibrationError, match="tensor_parallel_size: calibrated on 4 GPU"):
        build_timing(other, tmp_path)
    (tmp_path / "bad.yaml").write_text((tmp_path / "cal.yaml").read_text().replace(
        "tensor_parallel_size: 4", "tensor_parallel_size: four"))
    with pytest.raises(CalibrationError, match="tensor_parallel_size: expected a whole number"):
        Calibration.load(tmp_path / "bad.yaml")
    # Files written before the field existed are single-GPU timings.
    (tmp_path / "old.yaml").write_text("\n".join(
        line for line in (tmp_path / "cal.yaml").read_text().splitlines()
        if not line.startswith("tensor_parallel_size")))
    assert Calibration.load(tmp_path / "old.yaml").tensor_parallel_size == 1


def test_too_large_a_model_fails_in_one_line_with_the_fix(tmp_path):
    data = scenario(1)
    del data["parallel"]
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = kvsim_in_process("run", str(path), "--out", str(tmp_path / "out"), "--quiet",
                            "--no-report")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert "shard them over 2 GPUs (parallel.tensor_parallel_size: 2)" in proc.stderr


def test_shipped_tensor_parallel_sweep_keeps_gpu_counts_apart(tmp_path):
    outcome = run_sweep(ROOT / "scenarios" / "sweeps" / "tensor_parallel_70b.yaml",
                        out_dir=tmp_path / "tp", jobs=2, quick=True)
    assert outcome.failed == 0
    table = outcome.table
    assert set(table["gpus"]) == {8}  # every row: 8 GPUs, split differently
    assert sweep_metrics(table, ["throughput_tok_s"]) == ["throughput_tok_s"]
    mixed = table.assign(gpus=table["param:parallel.tensor_parallel_size"])
    assert sweep_metrics(mixed, ["throughput_tok_s", "waste_frac"]) == [
        "throughput_tok_s", "throughput_tok_s_per_gpu", "waste_frac"]
    # The paper's point, on 70B: where KV memory is scarce (2 GPUs an engine), paged memory
    # serves far more than contiguous max-length reservation at the highest offered load.
    top = table[table["param:workload.arrival.rate"] == table[
        "param:workload.arrival.rate"].max()]
    tp2 = top[top["param:parallel.tensor_parallel_size"] == 2].set_index("system")
    assert tp2.loc["paged-16", "throughput_tok_s"] > 2 * tp2.loc["contiguous-max",
                                                                 "throughput_tok_s"]
    figures = sweep_figures(outcome.out_dir)
    # One line per system and engine shape, never averaged over engine shapes.
    rate = figures["rate_sweep"]
    knees = rate.kvsim_data["knees"]
    assert len(knees) == 2 * 3
    assert "paged-16, replicas=4, tensor_parallel_size=2" in knees.index
    lines = [line for line in rate.axes[0].get_lines() if not line.get_label().startswith("_")]
    paged_tp2 = next(line for line in lines
                     if line.get_label().startswith("paged-16, replicas=4,"))
    expected = (table[(table["system"] == "paged-16")
                      & (table["param:parallel.tensor_parallel_size"] == 2)]
                .sort_values("param:workload.arrival.rate")["throughput_tok_s"])
    assert np.allclose(paged_tp2.get_ydata(), expected)
    # The zipped pair gets one figure, its ticks naming both values.
    assert "throughput_vs_engine_replicas" in figures
    assert not any("tensor_parallel_size" in name for name in figures)
    ax = figures["throughput_vs_engine_replicas"].axes[0]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["1\ntensor_parallel_size=8", "2\ntensor_parallel_size=4",
                     "4\ntensor_parallel_size=2"]
    series = figures["throughput_vs_engine_replicas"].kvsim_data["series"]
    assert set(series.columns) >= {"system", "param:workload.arrival.rate",
                                   "param:engine.replicas"}
