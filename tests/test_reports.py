"""Figures show the right series with units; report.html embeds them and loads no URL."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from reports.html import write_report
from reports.run_figures import (
    MAX_PLOTTED_POINTS,
    batch_and_queue,
    hits_and_preemptions,
    latency_cdfs,
    memory_over_time,
    time_binned,
    waste_breakdown,
)
from reports.style import TAXONOMY_COLORS, close
from sim.api import run
from sim.memory import TAXONOMY
from sim.results import HANDOVER_COLUMNS, TABLE_COLUMNS, load_run, saturation_note

SCENARIO = {
    "name": "report-test",
    "memory": {"kv_memory_gib": 1.5},
    "workload": {"arrival": {"process": "poisson", "rate": 30},
                 "prompt_len": {"dist": "uniform", "low": 20, "high": 300},
                 "output_len": {"dist": "uniform", "low": 5, "high": 150, "max": 150},
                 "prefix_groups": {"groups": 2, "length": 64, "fraction": 0.6}},
    "systems": [{"name": "contiguous", "allocator": {"kind": "contiguous",
                                                     "reserve_policy": "request_max"}},
                {"name": "paged", "allocator": {"kind": "paged"}}],
    "stop": {"num_requests": 120},
}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    res = run(SCENARIO, out=out)
    res.out = out
    return res


def test_memory_figure_stacks_every_category_in_gib(result):
    fig = memory_over_time(result)
    axes = [a for a in fig.axes if a.get_ylabel() == "KV memory (GiB)"]
    assert len(axes) == 2
    assert axes[0].get_title(loc="left").startswith("contiguous")
    assert axes[-1].get_xlabel() == "simulated time (s)"
    collections = axes[1].collections
    assert len(collections) == len(TAXONOMY)
    for coll, category in zip(collections, TAXONOMY, strict=True):
        assert np.allclose(coll.get_facecolor()[0][:3],
                           tuple(int(TAXONOMY_COLORS[category][i:i + 2], 16) / 255
                                 for i in (1, 3, 5)))
    data = fig.kvsim_data["paged"]
    pool_gib = result.systems["paged"].summary["capacity_slots"] * 524_288 / 1024**3
    assert np.allclose(data[list(TAXONOMY)].sum(axis=1), pool_gib)
    assert all(a.child_axes[0].get_ylabel() == "% of pool" for a in axes)
    legend_texts = {t.get_text() for t in fig.legends[0].get_texts()}
    assert "internal fragmentation" in legend_texts and "cached prefix (evictable)" in legend_texts
    close(fig)


def test_waste_bars_match_the_summary(result):
    fig = waste_breakdown(result)
    table = fig.kvsim_data["breakdown_pct"]
    for name in ("contiguous", "paged"):
        assert table.loc[name].sum() == pytest.approx(100)
        assert table.loc[name, "internal"] == pytest.approx(
            result.systems[name].summary["internal_frac"] * 100)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "time-averaged share of the KV pool (%)"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["contiguous", "paged"]
    assert len(ax.patches) == 2 * len(TAXONOMY)
    close(fig)


def test_batch_latency_and_hit_figures(result):
    fig = batch_and_queue(result)
    assert [a.get_ylabel() for a in fig.axes] == ["decode batch (sequences)", "waiting requests"]
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["contiguous", "paged"]
    steps = result.systems["paged"].steps
    assert np.array_equal(lines[1].get_ydata(), steps["decode_seqs"].to_numpy())
    close(fig)
    fig = latency_cdfs(result)
    assert [a.get_xlabel() for a in fig.axes] == ["TTFT (s)", "TPOT (ms)", "E2E latency (s)",
                                                  "longest token gap (s)"]
    ttft = fig.kvsim_data["TTFT (s)"]["paged"].dropna().to_numpy()
    requests = result.systems["paged"].requests
    assert np.allclose(ttft, np.sort(requests["first_token_s"] - requests["arrival_s"]))
    assert fig.axes[0].get_lines()[0].get_ydata()[-1] == 1.0
    close(fig)
    fig = hits_and_preemptions(result)
    data = fig.kvsim_data["paged"]
    assert np.nanmax(data["hit_rate_pct"]) > 0
    assert np.all(np.nan_to_num(fig.kvsim_data["contiguous"]["hit_rate_pct"]) == 0)
    assert fig.axes[0].get_ylabel() == "prefix hit rate (%)"
    # Contiguous memory has no prefix cache: no hit-rate line (its rate is "—", not 0 %).
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["paged"]
    assert result.systems["contiguous"].summary["prefix_hit_rate"] is None
    assert fig.axes[1].get_ylim()[0] == 0
    ticks = fig.axes[1].get_yticks()
    assert np.array_equal(ticks, np.round(ticks))  # preemptions are counted in whole numbers
    close(fig)


def test_figure_titles_and_legends_do_not_overlap(result):
    for make in (memory_over_time, waste_breakdown, latency_cdfs):
        fig = make(result)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        titles = [t for t in (fig._suptitle, *(a.title for a in fig.axes),
                              *(a._left_title for a in fig.axes)) if t and t.get_text()]
        legends = fig.legends + [a.get_legend() for a in fig.axes if a.get_legend()]
        assert titles and legends
        for title in titles:
            for legend in legends:
                assert not title.get_window_extent(renderer).overlaps(
                    legend.get_window_extent(renderer)), (make.__name__, title.get_text())
        close(fig)


def test_report_html_embeds_every_figure_offline(result):
    report = write_report(result.out)
    text = report.read_text()
    assert text.count("<img ") == 5
    assert len(re.findall(r"src='data:image/png;base64,", text)) == 5
    assert not re.search(r"(src|href)=['\"]?(https?:)?//", text)
    assert "url(" not in text and "@import" not in text
    assert "Resolved scenario" in text and "report-test" in text and "matplotlib" in text
    # How memory divides: 1.5 GiB of Llama-2-7B's 0.5 MiB tokens.
    assert ("GPU KV cache size 3,072 tokens of 512.0 KiB; maximum concurrency for 4,096 "
            "tokens per request: 0.75x") in text
    queued = [r.summary["waiting_at_last_arrival"] for r in result.systems.values()]
    assert max(queued) >= 10  # 30 req/s outruns this small pool: the report must say so
    assert saturation_note({n: r.summary for n, r in result.systems.items()}) in text
    for name in ("memory_over_time", "waste_breakdown", "latency_cdfs"):
        assert (result.out / "figures" / f"{name}.png").stat().st_size > 1000
        assert (result.out / "figures" / f"{name}.svg").is_file()


def test_time_binning_keeps_time_weighted_means_and_sums():
    rng = np.random.default_rng(3)
    n = 20_000
    t = np.cumsum(rng.exponential(0.01, n))
    a = rng.integers(0, 1000, n).astype(float)
    frame = pd.DataFrame({"time_s": t, "a": a, "b": 5000 - a})
    short = frame.iloc[:100]
    assert time_binned(short, ["a", "b"]).equals(short[["time_s", "a", "b"]])
    binned = time_binned(frame, ["a", "b"], max_points=400)
    assert len(binned) == 401 and binned["time_s"].iloc[[0, -1]].tolist() == [t[0], t[-1]]
    assert np.allclose(binned["a"] + binned["b"], 5000)  # categories still fill the pool
    # Each bin's mean against a brute-force integral of the step function on a fine grid.
    grid = np.linspace(t[0], t[-1], 4_000_001)
    sampled = a[np.searchsorted(t, grid, side="right") - 1]
    brute = sampled[:-1].reshape(400, -1).mean(axis=1)
    assert np.allclose(binned["a"].to_numpy()[:-1], brute, rtol=0, atol=1)  # row means: ~100 off


def test_long_runs_are_drawn_from_at_most_max_plotted_points(result, tmp_path):
    paged = result.systems["paged"]
    long = pd.concat([paged.memory.assign(time_s=paged.memory["time_s"] + k * 1e3)
                      for k in range(40)], ignore_index=True)
    assert len(long) > MAX_PLOTTED_POINTS
    paged.memory, original = long, paged.memory
    try:
        fig = memory_over_time(result)
    finally:
        paged.memory = original
    assert len(fig.kvsim_data["paged"]) == MAX_PLOTTED_POINTS + 1
    fig.savefig(tmp_path / "m.svg")
    assert (tmp_path / "m.svg").stat().st_size < 5_000_000
    close(fig)


def test_drafts_by_batch_size_get_a_panel_of_their_own(tmp_path):
    # K by batch size: a third panel, the drafts each decode step verified, for the systems
    # whose K varies (a fixed K, or none, draws nothing there).
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "acceptance_rate": 0.6}
    data = {**SCENARIO, "systems": [
        {"name": "plain", "allocator": {"kind": "paged"}},
        {"name": "fixed", "allocator": {"kind": "paged"}, "speculative": speculative},
        {"name": "dynamic", "allocator": {"kind": "paged"}, "speculative": {
            **speculative, "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 500, 1]]}},
    ], "engine": {"mode": "step"}}
    res = run(data, out=tmp_path)
    fig = batch_and_queue(res)
    assert [a.get_ylabel() for a in fig.axes] == [
        "decode batch (sequences)", "waiting requests", "drafts a step verifies (K)"]
    (line,) = fig.axes[2].get_lines()
    assert line.get_label() == "dynamic" and set(line.get_ydata()) == {1, 3}
    steps = res.systems["dynamic"].steps
    assert np.array_equal(line.get_ydata(), steps["draft_tokens"].to_numpy())
    assert fig.axes[2].get_xlabel() == "simulated time (s)" and not fig.axes[1].get_xlabel()
    close(fig)
    # A run folder from before the column: two panels, as ever.
    old = res.systems["dynamic"]
    old.steps = old.steps.drop(columns="draft_tokens")
    fig = batch_and_queue(res)
    assert len(fig.axes) == 2
    close(fig)


def test_figures_from_replica_0_say_so(result, tmp_path):
    two = run({**SCENARIO, "engine": {"replicas": 2}}, out=tmp_path)
    for make in (memory_over_time, batch_and_queue, hits_and_preemptions):
        for res, note in ((result, False), (two, True)):
            fig = make(res)
            titles = [a.get_title(loc="left") for a in fig.axes if a.get_title(loc="left")]
            assert titles and all(t.endswith(" (replica 0)") == note for t in titles), titles
            close(fig)


def test_a_sweep_figure_draws_a_metric_in_its_labels_unit():
    # TPOT is kept in seconds and labelled in ms, as the summary table shows it: the axis
    # must show ms too (it once drew 0.005 under "TPOT p50 (ms)").
    from reports.sweep_report import metric_vs_field

    table = pd.DataFrame({"param:workload.arrival.rate": [1, 2, 1, 2],
                          "system": ["a", "a", "b", "b"], "seed": [0] * 4,
                          "tpot_p50_s": [0.005, 0.010, 0.004, 0.020],
                          "throughput_tok_s": [100.0, 200.0, 90.0, 150.0]})
    fig = metric_vs_field(table, "workload.arrival.rate", "tpot_p50_s")
    (ax,) = fig.axes
    assert ax.get_ylabel() == "TPOT p50 (ms)"
    drawn = sorted({tuple(line.get_ydata()) for line in ax.get_lines()})
    assert drawn == [(4.0, 20.0), (5.0, 10.0)]
    # A metric in its own unit is drawn as it is.
    fig = metric_vs_field(table, "workload.arrival.rate", "throughput_tok_s")
    drawn = sorted({tuple(line.get_ydata()) for line in fig.axes[0].get_lines()})
    assert drawn == [(90.0, 150.0), (100.0, 200.0)]


def test_a_sweep_figure_leaves_out_lines_with_no_value():
    # Requests abandoned are null where clients wait for ever: those lines draw nothing
    # and must not stand in the legend as if they did.
    from reports.sweep_report import metric_vs_field

    table = pd.DataFrame({"param:workload.arrival.rate": [1, 2] * 4,
                          "param:workload.e2e_timeout_s": [None] * 4 + [30.0] * 4,
                          "system": ["a", "a", "b", "b"] * 2, "seed": [0] * 8,
                          "abandoned": [None] * 4 + [0.0, 5.0, 0.0, 9.0]})
    fig = metric_vs_field(table, "workload.arrival.rate", "abandoned")
    (ax,) = fig.axes
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    # (A whole number of seconds reads as one, though nulls made the column float.)
    assert labels == ["a, e2e_timeout_s=30", "b, e2e_timeout_s=30"]
    close(fig)


def _pool_top_gib(scenario: dict, tmp_path) -> dict[str, float]:
    """Each system's pool top in the memory figure, GiB."""
    fig = memory_over_time(run(scenario, out=tmp_path))
    tops = {ax.get_title(loc="left").split(":")[0]: ax.get_ylim()[1] for ax in fig.axes
            if ax.get_ylabel().startswith("KV memory")}
    close(fig)
    return tops


SMALL_RUN = {"workload": {"arrival": {"process": "poisson", "rate": 5},
                          "prompt_len": {"dist": "uniform", "low": 100, "high": 400},
                          "output_len": {"dist": "uniform", "low": 5, "high": 40, "max": 40}},
             "max_model_len": 4096, "stop": {"num_requests": 6}}


@pytest.mark.parametrize("model, tp, systems", [
    # A drafter's KV sits in every slot beside the target's (one layer in 33 here).
    ("llama-2-7b", 1, [
        {"name": "paged-eagle", "allocator": {"kind": "paged"},
         "speculative": {"method": "eagle", "num_speculative_tokens": 2,
                         "acceptance_rate": 0.7}},
        {"name": "contiguous-eagle", "allocator": {"kind": "contiguous"},
         "speculative": {"method": "eagle", "num_speculative_tokens": 2,
                         "acceptance_rate": 0.7}}]),
    # An MTP layer joins a state-space hybrid's groups: a slot spans 13 layers, not 12.
    ("qwen3-next-80b-a3b", 2, [
        {"name": "paged", "allocator": {"kind": "paged"},
         "scheduler": {"chunked_prefill": True}},
        {"name": "paged-mtp", "allocator": {"kind": "paged"},
         "scheduler": {"chunked_prefill": True},
         "speculative": {"method": "mtp", "num_speculative_tokens": 2,
                         "acceptance_rate": 0.7}},
        {"name": "contiguous-mtp", "allocator": {"kind": "contiguous",
                                                 "reserve_policy": "request_max"},
         "speculative": {"method": "mtp", "num_speculative_tokens": 2,
                         "acceptance_rate": 0.7}}]),
    # An EAGLE-3 layer joins a sliding-window model's groups under the hybrid manager.
    ("gpt-oss-20b", 1, [
        {"name": "hybrid-eagle3", "allocator": {"kind": "paged", "hybrid_kv_cache": True},
         "speculative": {"method": "eagle3", "num_speculative_tokens": 3,
                         "acceptance_rate": 0.7}}]),
])
def test_the_memory_figures_pool_is_the_memory_kv_takes(model, tp, systems, tmp_path):
    # However a slot is laid out (a drafter's layers beside the target's, one group's layers
    # under the hybrid manager), the figure's pool is the KV memory given, less at most
    # what the last block could not fill (one GPU's share of it under tensor parallelism).
    gib = 6.0
    scenario = {**SMALL_RUN, "name": "pool-top", "model": model, "gpu": "h200-141g",
                "parallel": {"tensor_parallel_size": tp},
                "memory": {"kv_memory_gib": gib}, "systems": systems}
    tops = _pool_top_gib(scenario, tmp_path)
    assert set(tops) == {s["name"] for s in systems}
    for name, top in tops.items():
        assert gib / tp * 0.99 <= top <= gib / tp, name


def test_the_readme_describes_every_column_of_a_run_folders_tables(result):
    # The tables read back have the columns results.py defines, in that order, and the
    # README's data dictionary names each of them.
    back = load_run(result.out)
    for system in back.systems.values():
        for table, columns in TABLE_COLUMNS.items():
            assert tuple(getattr(system, table).columns) == columns
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("### The tables of a run folder", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", section))
    documented = [*HANDOVER_COLUMNS, *(c for columns in TABLE_COLUMNS.values() for c in columns)]
    assert [column for column in documented if column not in named] == []
