"""The engine end to end: the seed's numbers, the main scenario's claim, timing, the API."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import sim
from sim.engine import MEMORY_COLUMNS, _RowBuffer, build_timing, memory_summary, run_scenario
from sim.memory import TAXONOMY, final_kv_tokens
from sim.presets import SizingError, lookup_gpu, lookup_model
from sim.results import rejection_note, saturation_note
from sim.scenario import ScenarioError, load_scenario, scenario_from_dict
from sim.timing import Calibration, CalibrationError, roofline

ROOT = Path(__file__).resolve().parents[1]


def small(**overrides) -> dict:
    data = {
        "name": "small",
        "memory": {"kv_memory_gib": 3},
        "workload": {"arrival": {"process": "poisson", "rate": 40},
                     "prompt_len": {"dist": "uniform", "low": 20, "high": 300},
                     "output_len": {"dist": "uniform", "low": 5, "high": 200}},
        "systems": [{"name": "contiguous", "allocator": {"kind": "contiguous"}},
                    {"name": "paged", "allocator": {"kind": "paged"}}],
        "stop": {"num_requests": 80},
    }
    data.update(overrides)
    return data


def test_seed_scenario_numbers():
    result = sim.run(ROOT / "scenarios/seed_63_percent.yaml")
    contiguous = result.systems["contiguous-4096"].summary
    paged = result.systems["paged-16"].summary
    assert contiguous["capacity_slots"] == 32_768
    assert round(contiguous["internal_at_finish_frac"] * 100, 1) == 63.4
    assert round(contiguous["internal_frac_of_allocated"] * 100, 1) == 63.4
    assert round(paged["internal_at_finish_frac"] * 100, 2) == 0.27
    assert contiguous["completed"] == paged["completed"] == 8
    assert contiguous["peak_batch"] == paged["peak_batch"] == 8


def test_main_scenario_paged_ahead():
    result = sim.run(ROOT / "scenarios/paged_vs_contiguous.yaml")
    paged = result.systems["paged-16"].summary
    for name in ("contiguous-max", "contiguous-req"):
        contiguous = result.systems[name].summary
        assert paged["throughput_tok_s"] > 1.1 * contiguous["throughput_tok_s"]
        assert paged["mean_batch"] > 2 * contiguous["mean_batch"]
        assert paged["waste_frac"] < contiguous["waste_frac"] / 10
        assert paged["ttft_p50_s"] < contiguous["ttft_p50_s"]


def test_queue_at_last_arrival_and_the_saturation_note():
    heavy = run_scenario(scenario_from_dict(small()))
    light = run_scenario(scenario_from_dict(small(
        workload={"arrival": {"process": "poisson", "rate": 0.5},
                  "prompt_len": {"dist": "uniform", "low": 20, "high": 300},
                  "output_len": {"dist": "uniform", "low": 5, "high": 200}})))
    assert saturation_note({n: r.summary for n, r in light.systems.items()}) is None
    run = heavy.systems["contiguous"]
    requests = run.requests  # queued at the last arrival: arrived by then, not yet seated
    t = requests["arrival_s"].max()
    queued = ((requests["arrival_s"] <= t) & ~(requests["admitted_s"] <= t)).sum()
    assert run.summary["waiting_at_last_arrival"] == queued >= 10
    # Requests turned away on arrival (longer than the pool's 1,024 tokens) never queue.
    refused = run_scenario(scenario_from_dict(small(
        memory={"kv_memory_gib": 0.5},
        workload={"arrival": {"process": "poisson", "rate": 40},
                  "prompt_len": {"dist": "uniform", "low": 20, "high": 1500},
                  "output_len": {"dist": "uniform", "low": 5, "high": 200}},
        systems=[{"name": "paged", "allocator": {"kind": "paged"}}]))).systems["paged"]
    requests = refused.requests
    t = requests["arrival_s"].max()
    arrived = (requests["arrival_s"] <= t) & ~(requests["admitted_s"] <= t)
    assert requests["rejected"].sum() > 0 and (arrived & requests["rejected"]).sum() > 0
    assert refused.summary["waiting_at_last_arrival"] == (arrived & ~requests["rejected"]).sum()
    note = saturation_note({n: r.summary for n, r in heavy.systems.items()})
    assert note is not None and f"contiguous {queued:,}" in note


@pytest.mark.parametrize("replicas", [1, 3])
def test_taxonomy_sums_to_pool_in_every_sample(replicas):
    # Several replicas: the summary's fractions are one replica's pool, on average.
    result = run_scenario(scenario_from_dict(small(engine={"replicas": replicas})))
    for run in result.systems.values():
        memory = run.memory
        assert len(memory) > 10
        totals = memory[list(TAXONOMY)].sum(axis=1)
        assert (totals == run.summary["capacity_slots"]).all()
        assert (memory[list(MEMORY_COLUMNS)] >= 0).all().all()
        fractions = sum(run.summary[f"{c}_frac"] for c in TAXONOMY)
        assert fractions == pytest.approx(1.0)


def test_request_larger_than_pool_is_rejected_and_counted():
    data = small(memory={"kv_memory_gib": 0.2})  # 409 slots: the contiguous 4096 never fits
    data["workload"]["prompt_len"] = {"dist": "uniform", "low": 20, "high": 600}
    result = run_scenario(scenario_from_dict(data))
    contiguous = result.systems["contiguous"]
    assert contiguous.summary["rejected"] == 80 and contiguous.summary["completed"] == 0
    paged = result.systems["paged"]
    too_big = final_kv_tokens(paged.requests["prompt_len"], paged.requests["output_len"]) > 400
    assert too_big.any()
    assert (paged.requests["rejected"] == too_big).all()
    assert paged.summary["completed"] == 80 - too_big.sum()
    note = rejection_note({n: r.summary for n, r in result.systems.items()})
    assert note == (f"rejected as larger than the whole KV pool: contiguous 80 of 80, paged "
                    f"{too_big.sum()} of 80; throughput and latency count only the requests "
                    "that were served")
    assert rejection_note({"paged": {**paged.summary, "rejected": 0}}) is None


def test_roofline_coefficients():
    model, gpu = lookup_model("llama-2-7b"), lookup_gpu("a100-80g")
    timing = roofline(model, gpu, step_overhead_s=0.0)
    assert timing.a == pytest.approx(6.74e9 * 2 / 2039e9)
    assert timing.c == pytest.approx(524_288 / 2039e9)
    assert timing.b == pytest.approx(2 * 6.74e9 / 312e12)
    assert timing.rho(None) == 1.0
    assert timing.rho(16) == pytest.approx(1 + 2.0 / 16)


def test_calibration_file_changes_step_times(tmp_path):
    base = scenario_from_dict(small())
    roof = build_timing(base, tmp_path)
    calibration = Calibration(model="llama-2-7b", device="test", coefficients={
        "a": roof.a * 2, "b": roof.b * 2, "c": roof.c * 2, "d": roof.d * 2, "e": roof.e * 2},
        rho={8: 1.5, 64: 1.0}, fit={})
    calibration.dump(tmp_path / "cal.yaml")
    loaded = Calibration.load(tmp_path / "cal.yaml")
    assert loaded == calibration
    scenario = scenario_from_dict(small(timing={"calibration": "cal.yaml"}))
    timing = build_timing(scenario, tmp_path)
    # Kernel times from the file, plus the engine's per-step CPU overhead (default 1 ms).
    overhead = scenario.timing.step_overhead_s
    assert overhead == 1e-3
    assert timing.step_time(10, 1000, 50, 2500, 1.0) == pytest.approx(
        2 * roof.step_time(10, 1000, 50, 2500, 1.0) + overhead)
    bare = build_timing(scenario_from_dict(small(timing={"calibration": "cal.yaml",
                                                         "step_overhead_s": 0})), tmp_path)
    assert bare.step_time(10, 1000, 50, 2500, 1.0) == pytest.approx(
        2 * roof.step_time(10, 1000, 50, 2500, 1.0))
    assert timing.rho(8) == 1.5 and timing.rho(64) == 1.0
    assert timing.rho(16) == pytest.approx(1.5 - 0.5 / 3)  # log2-interpolated
    slow = run_scenario(scenario, tmp_path).systems["paged"]
    fast = run_scenario(base, tmp_path).systems["paged"]
    steps = slow.steps
    expected = [timing.step_time(b, c, p, 0, timing.rho(16)) for b, c, p in
                zip(steps["decode_seqs"], steps["context_tokens"], steps["prefill_tokens"],
                    strict=True)]
    single = steps["steps"] == 1
    prefill_free = steps["prefill_tokens"] == 0
    mask = (single & prefill_free).to_numpy()
    assert mask.sum() > 5
    assert np.allclose(steps["duration_s"].to_numpy()[mask], np.array(expected)[mask])
    assert slow.summary["makespan_s"] > fast.summary["makespan_s"]


def test_a_calibration_for_another_model_is_refused(tmp_path):
    Calibration(model="llama-2-13b", device="test", coefficients=dict.fromkeys("abcde", 1e-4),
                rho={}, fit={}).dump(tmp_path / "cal.yaml")
    scenario = scenario_from_dict(small(timing={"calibration": "cal.yaml"}))
    with pytest.raises(CalibrationError, match="calibrated for 'llama-2-13b', but the scenario "
                       "runs 'llama-2-7b'"):
        build_timing(scenario, tmp_path)
    (tmp_path / "nomodel.yaml").write_text("kvsim_calibration: 1\ncoefficients: "
                                           "{a: 1, b: 1, c: 1, d: 1, e: 1}\n")
    with pytest.raises(CalibrationError, match="model: expected the model preset"):
        Calibration.load(tmp_path / "nomodel.yaml")


@pytest.mark.parametrize(("text", "expected"), [
    # A NaN or infinite coefficient would make every step NaN or endless, not an error.
    ("coefficients: {a: .nan, b: 1, c: 1, d: 1, e: 1}",
     "coefficients.a: expected a finite number >= 0, got nan"),
    ("coefficients: {a: 1, b: .inf, c: 1, d: 1, e: 1}",
     "coefficients.b: expected a finite number >= 0, got inf"),
    ("coefficients: {a: 1, b: 1, c: true, d: 1, e: 1}",
     "coefficients.c: expected a finite number >= 0, got True"),
    ("coefficients: {a: 1, b: 1, c: 1, d: 1, e: 1}\nrho: {true: 1.1}",
     "rho: expected a mapping block_size (a whole number >= 1) -> factor"),
    ("coefficients: {a: 1, b: 1, c: 1, d: 1, e: 1}\nrho: {16: .inf}",
     "rho: expected a mapping block_size (a whole number >= 1) -> factor"),
    ("coefficients: {a: 1, b: 1, c: 1, d: 1, e: 1}\nfit: held out",
     "fit: expected a mapping of figures (mape, max_error, ...) -> numbers"),
])
def test_a_calibration_with_a_bad_number_names_it(tmp_path, text, expected):
    path = tmp_path / "cal.yaml"
    path.write_text(f"kvsim_calibration: 1\nmodel: llama-2-7b\n{text}\n")
    with pytest.raises(CalibrationError) as error:
        Calibration.load(path)
    assert str(error.value).startswith(f"{path}: {expected}")


def test_a_run_whose_steps_take_years_is_refused():
    # A quadrillion parameters on a GPU of a GFLOP/s, each within its bounds: a step takes
    # years, and the clock would reach where a float no longer adds a step. Refused, naming
    # the system.
    gpu = {"name": "abacus", "memory_gib": 80, "hbm_bandwidth_gbps": 2000, "peak_tflops": 1e-3}
    model = {"name": "vast", "num_layers": 32, "num_heads": 32, "head_dim": 128,
             "num_params": 1e15, "max_model_len": 4096}
    with pytest.raises(SizingError, match=r"^system 'contiguous': the run's clock reached "
                       r"\S+ s, past 1,000,000,000 s \(31 years\)"):
        run_scenario(scenario_from_dict(small(gpu=gpu, model=model)))
    # Past the bounds, a rate or a size would make a step take no time or for ever.
    for field, value, bound in (("memory_gib", 1e-300, "greater than or equal to 0.001"),
                                ("memory_gib", 1e300, "less than or equal to 1099511627776"),
                                ("peak_tflops", 1e-300, "greater than or equal to 0.001"),
                                ("hbm_bandwidth_gbps", 1e300,
                                 "less than or equal to 1000000000000")):
        with pytest.raises(ScenarioError, match=f"gpu.{field}: Input should be {bound}"):
            scenario_from_dict(small(gpu={**gpu, field: value}))
    for field, value in (("num_heads", 10**20), ("num_params", 1e300)):
        with pytest.raises(ScenarioError, match=f"model.{field}: Input should be less than"):
            scenario_from_dict(small(model={**model, field: value}))


def test_python_api_returns_dataframes(tmp_path):
    result = sim.run(small(), out=tmp_path / "run", seed=5)
    paged = result.systems["paged"]
    assert isinstance(paged.requests, pd.DataFrame)
    assert {"arrival_s", "admitted_s", "first_token_s", "finished_s", "preemptions",
            "prefix_hit_tokens", "recomputed_tokens"} <= set(paged.requests.columns)
    assert (paged.requests["first_token_s"] >= paged.requests["arrival_s"]).all()
    assert (paged.requests["finished_s"] >= paged.requests["first_token_s"]).all()
    assert result.scenario["seed"] == 5
    assert (tmp_path / "run" / "summary.json").is_file()
    frame = result.summary_frame()
    assert list(frame.columns) == ["contiguous", "paged"]


def test_shipped_scenarios_validate():
    # As kvsim validate: the scenario, its memory line and its notes.
    paths = sorted((ROOT / "scenarios").rglob("*.yaml"))
    assert len(paths) >= 7
    for path in paths:
        scenario = load_scenario(path)
        assert memory_summary(scenario).startswith("memory: ")
        assert all(isinstance(note, str) for note in scenario.setting_notes())


def test_a_scenario_saved_and_read_again_is_the_same_scenario():
    # Sweeps and capacity searches hand each run the scenario as saved (model_dump), so
    # reading it back must neither refuse it nor change a default resolved from the rest.
    from sim.sweep import load_sweep_points

    scenarios = [load_scenario(path) for path in sorted((ROOT / "scenarios").rglob("*.yaml"))]
    for path in sorted((ROOT / "scenarios" / "sweeps").glob("*.yaml")):
        scenarios += [scenario_from_dict(point.scenario)
                      for point in load_sweep_points(path)[1]]
    predicted = small(systems=[{"name": "guess", "allocator": {"kind": "contiguous",
                                                                "reserve_policy": "predicted"},
                                "predictor": {"source": "trace"}}])
    scenarios.append(scenario_from_dict(predicted))
    for scenario in scenarios:
        saved = scenario.model_dump(mode="json")
        again = scenario_from_dict(saved, scenario.name)
        assert again == scenario and again.model_dump(mode="json") == saved, scenario.name


def test_preemption_and_recompute_under_pressure():
    data = small(memory={"kv_memory_gib": 0.15})
    data["systems"] = [{"name": "paged", "allocator": {"kind": "paged", "watermark": 0},
                        "scheduler": {"preemption_victim": "fewest_generated"}}]
    data["engine"] = {"debug_invariants": True}
    run = run_scenario(scenario_from_dict(data)).systems["paged"]
    assert run.summary["preemptions"] > 0
    assert run.summary["recomputed_tokens"] > 0
    assert run.summary["completed"] + run.summary["rejected"] == 80


def test_hit_rate_counts_first_admissions_only():
    """A preempted request finding its own blocks again is counted apart (vLLM v1's
    preempted_queries): the hit rate is that of prompts as they first arrive."""
    data = small(memory={"kv_memory_gib": 0.15})
    data["systems"] = [{"name": "paged", "allocator": {"kind": "paged", "watermark": 0,
                                                        "prefix_caching": True}}]
    run = run_scenario(scenario_from_dict(data)).systems["paged"]
    requests = run.requests[run.requests["admitted_s"].notna()]
    assert run.summary["preemptions"] > 0
    # The workload shares no prefixes: first admissions find nothing ...
    assert run.summary["prefix_hit_rate"] == requests["prefix_hit_tokens"].sum() == 0
    # ... but victims find some of the blocks they left behind.
    assert 0 < run.summary["preempted_hit_rate"] <= 1
    memory = run.memory.groupby("replica")[["hit_tokens", "lookup_tokens"]].last()
    assert memory["lookup_tokens"].sum() == requests["prompt_len"].sum()


def test_samples_that_exactly_fit_an_empty_pool_are_served():
    # Two samples of a 40-token prompt and 2 output tokens in 4 blocks of 16: the prompt's
    # three blocks (the last half full, shared at the fork) and the one copy of it that the
    # first decode step makes, the last sample writing into the original. Counting a copy
    # for each sample preempted the request in an empty pool for ever.
    from sim.memory import PagedAllocator
    from sim.scenario import SchedulerConfig
    from sim.scheduler import Request, Scheduler
    from workloads.trace import Trace

    trace = Trace.from_columns(arrival_s=np.zeros(1), prompt_len=np.array([40]),
                               output_len=np.array([2]), n=np.array([2]))
    allocator = PagedAllocator(4, 16, enable_prefix_caching=False)
    sched = Scheduler(allocator, SchedulerConfig(), debug=True)
    request = Request(trace, 0, 0.0)
    assert sched.fits_ever(request) and sched.add(request)
    batch = sched.schedule(0.0)
    assert not batch.empty and batch.preempted == 0
    assert sched.finish_step(batch, 1.0) == [] and request.num_seqs == 2
    batch = sched.schedule(1.0)
    assert batch.preempted == 0 and batch.decode_seqs == 2
    assert allocator.num_cow_copies == 1 and allocator.num_free_blocks == 0
    assert sched.finish_step(batch, 2.0) == [request]


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 1000])
def test_row_buffer_chunks_make_the_frame_built_at_once(chunk_rows):
    columns = ["replica", "time_s", "tokens", "rejected"]
    rows = [(i % 2, i * 0.25, 10 * i, i % 3 == 0) for i in range(10)]
    buffer = _RowBuffer(columns, {"rejected": bool}, chunk_rows=chunk_rows)
    for row in rows:
        buffer.append(row)
    expected = pd.DataFrame(rows, columns=columns).astype(
        {"replica": np.int64, "time_s": float, "tokens": np.int64, "rejected": bool})
    pd.testing.assert_frame_equal(buffer.frame(), expected)
    assert buffer.frame() is buffer.frame()  # the chunks are joined once
    empty = _RowBuffer(columns, {"rejected": bool}).frame()
    assert len(empty) == 0 and list(empty.dtypes) == list(expected.dtypes)


def test_a_price_on_the_gpus_puts_one_on_the_tokens():
    from sim.metrics import format_summary

    data = {"name": "cost", "memory": {"kv_memory_gib": 2},
            "parallel": {"tensor_parallel_size": 2}, "engine": {"replicas": 2},
            "workload": {"arrival": {"process": "poisson", "rate": 20},
                         "prompt_len": {"dist": "uniform", "low": 20, "high": 300},
                         "output_len": {"dist": "uniform", "low": 5, "high": 150}},
            "systems": [{"name": "paged", "allocator": {"kind": "paged"}}],
            "stop": {"num_requests": 100}}
    unpriced = run_scenario(scenario_from_dict(data)).systems["paged"].summary
    assert unpriced["usd_per_million_tokens"] is None
    assert "GPU cost" not in format_summary({"paged": unpriced})
    priced = run_scenario(scenario_from_dict({**data, "cost": {"usd_per_gpu_hour": 3.6}}))
    run = priced.systems["paged"]
    # Four GPUs at a dollar a thousand seconds each, over the output tokens they served.
    requests = run.requests
    makespan = requests["finished_s"].max() - requests["arrival_s"].min()
    tokens = (requests["output_len"] * requests["n"]).sum()
    assert run.summary["gpus"] == 4
    assert run.summary["usd_per_million_tokens"] == pytest.approx(
        4 * 3.6 / 3600 * makespan / tokens * 1e6)
    assert "GPU cost per million output tokens (USD)" in format_summary({"paged": run.summary})
    # Pricing changes nothing else.
    assert {k: v for k, v in run.summary.items() if k != "usd_per_million_tokens"} == {
        k: v for k, v in unpriced.items() if k != "usd_per_million_tokens"}
