"""Figures of a sweep: metric against swept field per system, the saturation knee, the
block-size trade-off, hit rate against pool size per eviction policy, bars for a field of
names and for each layout of ``sweep.layouts``, requests within SLO against rate, each
priority level's latency and attainment against rate, and capacity under SLO per point.

Every figure averages over seeds (bars show the min–max range) and attaches its table as
``fig.kvsim_data``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from reports.html import UNRECORDED_BUILD, img_tag, render_html, save_figure
from reports.slo_figure import attainment_figure
from reports.style import legend, new_figure, system_color
from sim.metrics import PER_GPU, gpu_counts_differ, metric_row, priority_levels
from sim.results import read_back, read_table
from sim.slo import describe_slo, judged_attainment
from sim.sweep import LAYOUT_PATHS, describe_layout

KNEE_FRACTION = 0.9  # saturated once achieved req/s falls below 90 % of the offered rate

METRIC_LABELS = {
    "throughput_tok_s": "output throughput (tokens/s)",
    "throughput_tok_s_per_gpu": "output throughput per GPU (tokens/s)",
    "throughput_req_s": "request throughput (req/s)",
    "e2e_p90_s": "E2E latency p90 (s)",
    "ttft_p90_s": "TTFT p90 (s)",
    "waste_frac": "waste (share of memory in use)",
    "internal_frac_of_allocated": "internal fragmentation (share of allocated)",
    "prefix_hit_rate": "prefix hit rate",
    "recomputed_tokens": "recomputed prefill tokens",
    "mean_batch": "mean decode batch (sequences)",
    "duplicate_frac": "duplicate slots (share of pool)",
    "token_frac": "share of pool holding tokens",
    "state_frac": "share of pool holding states",
    "slo_attainment": "requests within SLO (share)",
    "capacity_req_s": "capacity under SLO (requests/s)",
    "capacity_req_s_per_gpu": "capacity under SLO per GPU (requests/s)",
    "goodput_req_s": "goodput (req/s within SLO)",
}


def metric_label(metric: str) -> str:
    """How a figure's axis names a summary metric (per-priority ones included)."""
    row = metric_row(metric)
    return METRIC_LABELS.get(metric) or (row[1] if row else metric)


def metric_scale(metric: str) -> float:
    """What a metric's values are multiplied by on an axis its label names: 1000 for a
    time in seconds that the label (as the summary table) gives in ms, else 1."""
    row = metric_row(metric)
    return 1000.0 if row is not None and row[2] == "ms" else 1.0


class SweepReportError(ValueError):
    """A figure that cannot be drawn from this sweep (unknown field or metric)."""


def load_sweep(sweep_dir: Path, ok_only: bool = True) -> tuple[pd.DataFrame, dict]:
    """A sweep folder's results (those of the runs that finished, unless not ``ok_only``)
    and its ``sweep.json``."""
    info = read_back(sweep_dir, "sweep.json", lambda p: dict(json.loads(p.read_text())))
    table = read_back(sweep_dir, "results.parquet", read_table)
    return (table[table["status"] == "ok"].copy() if ok_only else table), info


def _param(table: pd.DataFrame, field: str) -> str:
    column = f"param:{field}"
    if column not in table:
        fields = [c.removeprefix("param:") for c in table.columns if c.startswith("param:")]
        raise SweepReportError(f"--x {field}: not a swept field; swept: {', '.join(fields)}")
    return column


def _other_swept(table: pd.DataFrame, *fields_shown: str) -> list[str]:
    """Swept columns that vary but are not on the figure's axes: each combination of their
    values is a line of its own, never averaged into one (seeds still are). A column zipped
    with a shown one (one value per value of it) is no other dimension."""
    shown = [c for c in fields_shown if c in table]
    return [c for c in table.columns if c.startswith("param:") and c not in shown
            and _varies(table[c]) and not any(_follows(table, c, s) for s in shown)]


def _varies(column: pd.Series) -> bool:
    """Whether a swept column takes more than one value, null (a setting left out) being
    one of them."""
    return column.nunique(dropna=False) > 1


def _follows(table: pd.DataFrame, column: str, leader: str) -> bool:
    """Whether ``column`` takes one value for each value of ``leader`` (zipped with it)."""
    return bool((table.groupby(leader, sort=False, dropna=False)[column].nunique(
        dropna=False) <= 1).all())


def _named(column: str, value: Any) -> list[str]:
    """``field=value`` for a legend or a tick, or nothing for a setting left out. (A whole
    number reads as one: a column with nulls holds its integers as floats.)"""
    if pd.isna(value):
        return []
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return [f"{_short(column)}={value}"]


def _short(column: str) -> str:
    """A swept column as a legend or tick names it: its last field (``block_size``)."""
    return column.removeprefix("param:").rsplit(".", 1)[-1]


LINE_STYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P"]


def _series(table: pd.DataFrame, by: str, others: list[str]
            ) -> list[tuple[str, dict[str, Any], pd.DataFrame]]:
    """One line per ``by`` value and combination of ``others``: its label, its matplotlib
    style (colour for ``by``, line style and marker for the rest) and its rows."""
    colours = {v: i for i, v in enumerate(pd.unique(table[by]))}
    combos: dict[tuple, int] = {}
    lines = []
    for key, part in table.groupby([by, *others], sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        name, rest = key[0], key[1:]
        # Fields zipped together under one name (each system's sigma) are named once.
        named = [n for c, v in zip(others, rest, strict=True) for n in _named(c, v)]
        style_index = combos.setdefault(tuple(named), len(combos))  # (a null is no key)
        label = ", ".join(dict.fromkeys([str(name), *named]))
        # One system: colours tell the other fields' values apart instead.
        colour = colours[name] if len(colours) > 1 else style_index
        style = {"color": system_color(colour),
                 "linestyle": LINE_STYLES[style_index % len(LINE_STYLES)],
                 "marker": MARKERS[style_index % len(MARKERS)]}
        lines.append((label, style, part))
    return lines


def per_gpu_where_counts_differ(table: pd.DataFrame, metric: str = "throughput_tok_s") -> str:
    """``metric``'s share per GPU where the runs use different numbers of GPUs, else it."""
    return PER_GPU[metric] if gpu_counts_differ(table) else metric


def metric_vs_field(table: pd.DataFrame, field: str, metric: str, *,
                    by: str = "system", logx: bool | None = None) -> Figure:
    """``metric`` against swept ``field``, one line per system (or per ``by`` column) and
    combination of the other swept fields that vary."""
    x = _param(table, field)
    if metric not in table:
        raise SweepReportError(f"--y {metric}: not a summary metric; e.g. "
                               f"{', '.join(list(METRIC_LABELS)[:6])}")
    others = _other_swept(table, x, by)
    data = table.groupby([by, *others, x], sort=False, dropna=False)[metric].agg(
        ["mean", "min", "max"]).reset_index()
    scale = metric_scale(metric)  # (the series keeps the metric's own unit)
    # A line with no value anywhere (a metric of a feature its runs leave off: requests
    # abandoned where clients wait for ever) would be a legend entry with nothing drawn.
    lines = [line for line in _series(data, by, others) if line[2]["mean"].notna().any()]
    fig, (ax,) = new_figure(1, 1, height=3.6 if len(lines) <= 5 else 4.6)
    for label, style, part in lines:
        part = part.sort_values(x)
        xs = part[x].to_numpy(dtype=float)
        mean = part["mean"] * scale
        ax.errorbar(xs, mean, yerr=[mean - part["min"] * scale,
                                    part["max"] * scale - mean],
                    markersize=4, capsize=2, label=label, **style)
    values = data[x].to_numpy(dtype=float)
    if logx if logx is not None else (values.min() > 0 and values.max() / values.min() >= 16):
        ax.set_xscale("log", base=2)
    # Fields zipped with x move with it: each tick names their values too.
    partners = [c for c in table.columns if c.startswith("param:") and c != x
                and _varies(table[c]) and _follows(table, c, x)]
    if partners:
        ticks = table.drop_duplicates(x).sort_values(x)
        ax.set_xticks(ticks[x].to_numpy(dtype=float), [
            "\n".join([f"{row[x]:g}"] + [n for c in partners for n in _named(c, row[c])])
            for _, row in ticks.iterrows()])
    ax.set_xlabel(field)
    ax.set_ylabel(metric_label(metric))
    ax.grid(alpha=0.3)
    legend(ax, len(lines))
    ax.set_title(f"{metric_label(metric)} against {field}", loc="left", fontsize=11)
    fig.kvsim_data = {"series": data}  # type: ignore[attr-defined]
    return fig


def saturation_knee(part: pd.DataFrame, rate_column: str) -> float | None:
    """The highest offered rate still served at ≥ 90 % of itself (None if none is)."""
    served = part[part["throughput_req_s"] >= KNEE_FRACTION * part[rate_column]]
    return float(served[rate_column].max()) if len(served) else None


def rate_figure(table: pd.DataFrame, field: str = "workload.arrival.rate") -> Figure:
    """Throughput and p90 latency against request rate, each line's knee marked (one line
    per system and combination of the other swept fields)."""
    x = _param(table, field)
    throughput = per_gpu_where_counts_differ(table)
    lines = _series(table, "system", _other_swept(table, x, "system"))
    fig, axes = new_figure(2, 1, height=3.0 if len(lines) <= 5 else 3.4, sharex=True)
    knees = {}
    for label, style, part in lines:
        mean = part.groupby(x).mean(numeric_only=True).reset_index().sort_values(x)
        knee = saturation_knee(mean, x)
        knees[label] = knee
        # The knee goes into the legend: many lines often share one, and labels by the
        # points would overprint.
        shown = f"{label} ({f'knee {knee:g}' if knee is not None else 'saturated at every rate'})"
        axes[0].plot(mean[x], mean[throughput], markersize=4, label=shown, **style)
        axes[1].plot(mean[x], mean["e2e_p90_s"], markersize=4, label=shown, **style)
        if knee is not None:
            for ax in axes:
                ax.axvline(knee, color=style["color"], linestyle="--", linewidth=0.8,
                           alpha=0.8)
    axes[0].set_ylabel(METRIC_LABELS[throughput])
    axes[1].set_ylabel("E2E latency p90 (s)")
    axes[1].set_yscale("log")
    # 20, not 2×10¹; minor ticks labelled at 2 and 5 only, where they do not crowd.
    axes[1].yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axes[1].yaxis.set_minor_formatter(FuncFormatter(
        lambda value, _: f"{value:g}" if f"{value:e}"[0] in "25" else ""))
    axes[1].set_xlabel("offered load (requests/s)")
    legend(axes[0], len(lines))
    axes[0].set_title("Throughput and latency against load (dashed: saturation knee)",
                      loc="left", fontsize=11)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.kvsim_data = {"knees": pd.Series(knees, dtype=float)}  # type: ignore[attr-defined]
    return fig


def block_size_figure(table: pd.DataFrame, field: str, rho: dict[int, float]) -> Figure:
    """Internal waste against paging overhead over block size, and the throughput knee."""
    x = _param(table, field)
    mean = table.groupby(x).mean(numeric_only=True).reset_index().sort_values(x)
    sizes = mean[x].to_numpy(dtype=int)
    overhead = np.array([(rho[int(s)] - 1) * 100 for s in sizes])
    waste = mean["internal_at_finish_frac"].to_numpy() * 100
    fig, axes = new_figure(2, 1, height=3.0, sharex=True)
    axes[0].plot(sizes, waste, marker="o", color="#E69F00",
                 label="internal fragmentation at completion (% of allocated)")
    axes[0].plot(sizes, overhead, marker="s", color="#CC79A7",
                 label="paged-attention overhead ρ(bs) − 1 (% of attention time)")
    axes[0].set_ylabel("%")
    axes[0].legend(fontsize=8, frameon=False)
    axes[1].plot(sizes, mean["throughput_tok_s"], marker="o", color="#0072B2")
    best = int(sizes[int(np.argmax(mean["throughput_tok_s"].to_numpy()))])
    axes[1].axvline(best, color="#0072B2", linestyle="--", linewidth=0.8)
    axes[1].annotate(f"best: {best}", (best, mean["throughput_tok_s"].max()),
                     textcoords="offset points", xytext=(4, -12), fontsize=8)
    axes[1].set_ylabel("output throughput (tokens/s)")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("block size (tokens)")
    axes[0].set_title("Block size: fragmentation against table/kernel overhead", loc="left",
                      fontsize=11)
    for ax in axes:
        ax.grid(alpha=0.3)
    data = pd.DataFrame({"block_size": sizes, "internal_waste_pct": waste,
                         "overhead_pct": overhead,
                         "throughput_tok_s": mean["throughput_tok_s"].to_numpy()})
    fig.kvsim_data = {"tradeoff": data, "best_block_size": best}  # type: ignore[attr-defined]
    return fig


def eviction_figure(table: pd.DataFrame, pool_field: str, policy_field: str) -> Figure:
    """Hit rate and recomputed tokens against pool size, one line per eviction policy."""
    x, by = _param(table, pool_field), _param(table, policy_field)
    fig, axes = new_figure(2, 1, height=3.0, sharex=True)
    data = table.groupby([by, x]).mean(numeric_only=True).reset_index()
    for i, (policy, part) in enumerate(data.groupby(by, sort=False)):
        part = part.sort_values(x)
        axes[0].plot(part[x], part["prefix_hit_rate"] * 100, marker="o", markersize=4,
                     color=system_color(i), label=str(policy))
        axes[1].plot(part[x], part["recomputed_tokens"], marker="o", markersize=4,
                     color=system_color(i), label=str(policy))
    axes[0].set_ylabel("prefix hit rate (%)")
    axes[1].set_ylabel("recomputed prefill tokens")
    axes[1].set_xlabel("KV pool (GiB)")
    axes[0].legend(title="eviction", fontsize=8, frameon=False)
    axes[0].set_title("Eviction under memory pressure", loc="left", fontsize=11)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.kvsim_data = {"series": data[[by, x, "prefix_hit_rate", "recomputed_tokens"]]}  # type: ignore[attr-defined]
    return fig


def _first_run_scenario(sweep_dir: Path, table: pd.DataFrame) -> dict[str, Any]:
    """The resolved scenario of the sweep's first run (what every point shares)."""
    key = table["key"].iloc[0]
    return dict(yaml.safe_load((sweep_dir / "runs" / key / "scenario.yaml").read_text()))


def _rho_for(sweep_dir: Path, table: pd.DataFrame, sizes: list[int]) -> dict[int, float]:
    from sim.engine import build_timing
    from sim.scenario import scenario_from_dict

    info = json.loads((sweep_dir / "sweep.json").read_text())
    timing = build_timing(scenario_from_dict(_first_run_scenario(sweep_dir, table)),
                          Path(info["scenario"]).parent)
    return {s: timing.rho(s) for s in sizes}


def capacity_on_grid(part: pd.DataFrame, rate_column: str, slo: dict[str, Any]
                     ) -> float | None:
    """The highest offered rate below which every rate on the grid meets ``slo`` (its
    attainment, judged as it says; None if even the lowest rate does not)."""
    part = part.sort_values(rate_column)
    target = float(slo.get("attainment", 0.9))
    misses = np.asarray(judged_attainment(part, slo), dtype=float) < target
    holding = part[rate_column].to_numpy(dtype=float)[:misses.argmax() if misses.any()
                                                       else len(part)]
    return float(holding[-1]) if len(holding) else None


def slo_figure(table: pd.DataFrame, field: str, slo: dict[str, Any]) -> Figure:
    """SLO attainment and goodput against request rate, each line's capacity on the grid
    marked (one line per system and combination of the other swept fields)."""
    x = _param(table, field)
    lines, capacities = [], {}
    for label, style, part in _series(table, "system", _other_swept(table, x, "system")):
        mean = part.groupby(x).mean(numeric_only=True).reset_index()
        capacities[label] = capacity_on_grid(mean, x, slo)
        lines.append((label, style, mean))
    return attainment_figure(lines, x, slo, capacities,
                             title=f"Within SLO ({describe_slo(slo)}) against load")


def priority_figure(table: pd.DataFrame, field: str) -> Figure:
    """Each priority level's TTFT p99 and, with objectives, its share within them against
    request rate: what scheduling by priority buys one class and costs the others (one colour
    per system and combination of the other swept fields, one line style per level)."""
    x = _param(table, field)
    levels = priority_levels(table.columns)
    with_slo = any(f"priority_{level}_slo_attainment" in table for level in levels)
    fig, axes = new_figure(2 if with_slo else 1, 1, height=3.0, sharex=True)
    axes = list(np.atleast_1d(axes))
    lines = _series(table, "system", _other_swept(table, x, "system"))
    series = []
    for label, style, part in lines:
        mean = part.groupby(x).mean(numeric_only=True).reset_index().sort_values(x)
        for rank, level in enumerate(levels):
            shown = {**style, "linestyle": LINE_STYLES[rank % len(LINE_STYLES)],
                     "marker": MARKERS[rank % len(MARKERS)]}
            name = f"{label}, priority {level}"
            axes[0].plot(mean[x], mean[f"priority_{level}_ttft_p99_s"], markersize=4,
                         label=name, **shown)
            if with_slo:
                axes[1].plot(mean[x], mean[f"priority_{level}_slo_attainment"] * 100,
                             markersize=4, label=name, **shown)
            series.append(pd.DataFrame({
                "line": name, "rate": mean[x],
                "ttft_p99_s": mean[f"priority_{level}_ttft_p99_s"],
                **({"slo_attainment": mean[f"priority_{level}_slo_attainment"]}
                   if with_slo else {})}))
    axes[0].set_ylabel("TTFT p99 (s)")
    axes[0].set_yscale("log")
    axes[0].yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    if with_slo:
        axes[1].set_ylabel("within SLO (%)")
        axes[1].set_ylim(-3, 103)
    axes[-1].set_xlabel("offered load (requests/s)")
    legend(axes[0], len(lines) * len(levels))
    axes[0].set_title("Per priority level against load", loc="left", fontsize=11)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.kvsim_data = {"series": pd.concat(series, ignore_index=True)}  # type: ignore[attr-defined]
    return fig


def sweep_figures(sweep_dir: Path, x: str | None = None,
                  y: str | None = None) -> dict[str, Figure]:
    """The figures that fit this sweep's swept fields (and ``--x``/``--y`` if given)."""
    table, info = load_sweep(sweep_dir)
    fields = info["params"]
    figures: dict[str, Figure] = {}
    if table.empty:  # every run failed: nothing to draw (the report lists their errors)
        return figures
    if x or y:
        field = x or fields[0]
        figures[f"{y or 'throughput_tok_s'}_vs_{field}"] = metric_vs_field(
            table, field, y or "throughput_tok_s")
        return figures
    rate = next((f for f in fields if f.endswith("arrival.rate")), None)
    block = next((f for f in fields if f.endswith("allocator.block_size")), None)
    pool = next((f for f in fields if f.endswith("kv_memory_gib")), None)
    policy = next((f for f in fields if f.endswith("allocator.eviction")), None)
    # The block-size and eviction figures average over everything but their own fields, so
    # they are drawn only when nothing else varies; otherwise the generic figures separate it.
    if block and _other_swept(table, f"param:{block}"):
        block = None
    if pool and policy and _other_swept(table, f"param:{pool}", f"param:{policy}"):
        pool = policy = None
    if rate:
        figures["rate_sweep"] = rate_figure(table, rate)
        slo = _first_run_scenario(sweep_dir, table).get("slo")
        if slo and "slo_attainment" in table:
            figures["slo_attainment"] = slo_figure(table, rate, slo)
        if priority_levels(table.columns):
            figures["priority_levels"] = priority_figure(table, rate)
    if block:
        sizes = sorted(int(v) for v in table[f"param:{block}"].unique())
        figures["block_size_tradeoff"] = block_size_figure(table, block,
                                                           _rho_for(sweep_dir, table, sizes))
    if pool and policy:
        figures["eviction_pressure"] = eviction_figure(table, pool, policy)
    throughput = per_gpu_where_counts_differ(table)
    if laid_out(table, fields):
        return {"by_layout": layout_figure(table, fields, [throughput, "e2e_p90_s"] + (
            ["slo_attainment"] if "slo_attainment" in table
            and table["slo_attainment"].notna().any() else []))}
    drawn = [f for f in (rate, block) if f] + ([pool, policy] if pool and policy else [])
    for field, slug in numeric_fields_left(table, fields, drawn):
        figures[f"throughput_vs_{slug}"] = metric_vs_field(table, field, throughput)
        figures[f"waste_vs_{slug}"] = metric_vs_field(table, field, "waste_frac")
    # A field of names or sections gets bars, when nothing else varies to be averaged away.
    metrics = [throughput] + (["slo_attainment"] if "slo_attainment" in table
                              and table["slo_attainment"].notna().any() else [])
    figures.update(category_figures(table, fields, drawn, metrics))
    return figures


def numeric_fields_left(table: pd.DataFrame, fields: list[str], drawn: list[str],
                        numeric: bool = True) -> list[tuple[str, str]]:
    """The numeric (or, with ``numeric`` False, the other) swept ``fields`` not yet on a
    figure's axis (``drawn``) nor zipped with one, which would only draw the same figure
    again; each with a slug for file names."""
    taken = [f"param:{f}" for f in drawn]
    left = []
    for field in fields:
        column = f"param:{field}"
        if field in drawn or any(_follows(table, column, d) for d in taken):
            continue
        taken.append(column)
        if _numeric(table[column]) == numeric:
            left.append((field, field.replace(".", "_").replace("[", "_").replace("]", "")))
    return left


def category_figures(table: pd.DataFrame, fields: list[str], drawn: list[str],
                     metrics: list[str], prefix: str = "") -> dict[str, Figure]:
    """Bars for the swept fields that are not numbers (a policy, a dtype, a section
    switched on or off, or a number some runs leave out), when nothing else varies to be
    averaged away: one bar group per value, or per combination where several vary (a
    policy zipped with a setting only one policy takes), named after the first field."""
    left = numeric_fields_left(table, fields, drawn, numeric=False)
    varying = [(field, slug) for field, slug in left if _varies(table[f"param:{field}"])]
    columns = [f"param:{field}" for field, _ in varying]
    if not varying or _other_swept(table, *columns):
        return {}
    field, slug = varying[0]
    return {f"{prefix}by_{slug}": category_figure(table, field, metrics, columns[1:])}


# Characters of tick labels a figure's width holds in a row at font size 8, with room
# between them: more, and a bar chart lists its values down the side instead.
LABEL_ROW_CHARS = 120


def category_figure(table: pd.DataFrame, field: str, metrics: list[str],
                    others: list[str] | None = None) -> Figure:
    """``metrics`` for each value of a swept field that is not a number (a policy, a dtype,
    a section switched on or off), or each combination of it and the swept ``others``
    columns, bars grouped by system; seeds averaged."""
    x = _param(table, field)
    others = others or []
    data = table.groupby([x, *others, "system"], sort=False, dropna=False)[metrics].mean(
    ).reset_index()
    # A bar group per combination, named by its values (a setting left out is not named).
    data["value"] = ["\n".join([str(row[x])] + [n for c in others for n in _named(c, row[c])])
                     for _, row in data.iterrows()]
    values = list(pd.unique(data["value"]))
    longest = max(len(line) for value in values for line in value.split("\n"))
    if len(values) * (longest + 2) > LABEL_ROW_CHARS:  # names side by side would overlap
        data["value"] = data["value"].str.replace("\n", ", ")
        values = [value.replace("\n", ", ") for value in values]
        fig, axes = new_figure(1, len(metrics), height=0.35 * len(values) + 1.2)
        for ax, metric in zip(axes, metrics, strict=True):
            _bars_by_system(ax, data, "value", values, metric, horizontal=True)
            ax.set_xlabel(metric_label(metric))
            ax.grid(alpha=0.3, axis="x")
            ax.invert_yaxis()  # (the first value at the top, as it reads)
        axes[0].set_yticks(np.arange(len(values)), values, fontsize=8)
        for ax in axes[1:]:
            ax.set_yticks(np.arange(len(values)), [])
    else:
        fig, axes = new_figure(len(metrics), 1, height=2.8, sharex=True)
        for ax, metric in zip(axes, metrics, strict=True):
            _bars_by_system(ax, data, "value", values, metric)
            ax.set_ylabel(metric_label(metric))
            ax.grid(alpha=0.3, axis="y")
        axes[-1].set_xticks(np.arange(len(values)), [str(v) for v in values], fontsize=8)
        axes[-1].set_xlabel(field)
    axes[0].legend(fontsize=8, frameon=False)
    axes[0].set_title(f"Each value of {field}", loc="left", fontsize=11)
    fig.kvsim_data = {"series": data}  # type: ignore[attr-defined]
    return fig


def _bars_by_system(ax: Any, data: pd.DataFrame, key: str, order: list[Any], metric: str,
                    horizontal: bool = False) -> None:
    """``metric`` of ``data`` as a bar for each ``key`` value in ``order``, one bar of a
    group per system (upright, or across with ``horizontal``)."""
    systems = list(pd.unique(data["system"]))
    size = 0.8 / len(systems)
    for i, system in enumerate(systems):
        part = data[data["system"] == system].set_index(key).reindex(order)
        at = np.arange(len(order)) + (i - (len(systems) - 1) / 2) * size
        if horizontal:
            ax.barh(at, part[metric], height=size, color=system_color(i), label=system)
        else:
            ax.bar(at, part[metric], width=size, color=system_color(i), label=system)


def capacity_figures(table: pd.DataFrame, fields: list[str]) -> dict[str, Figure]:
    """``kvsim capacity --sweep``: capacity under SLO (per GPU where the GPU counts differ)
    against each numeric swept field, a line per system and other swept values; for a sweep
    of layouts alone, a bar for each layout instead."""
    metric = per_gpu_where_counts_differ(table, "capacity_req_s")
    done = table[table["status"] == "ok"]
    if laid_out(done, fields):
        return {"capacity_by_layout": layout_figure(done, fields, [metric])}
    figures = {f"capacity_vs_{slug}": metric_vs_field(done, field, metric)
               for field, slug in numeric_fields_left(done, fields, [])}
    figures.update(category_figures(done, fields, [], [metric], prefix="capacity_"))
    return figures


def laid_out(table: pd.DataFrame, fields: list[str]) -> bool:
    """Whether the swept fields are a ``sweep.layouts``' (two of its paths or more) and
    names beside them alone (a GPU, a model: see :func:`_layout_companions`), no number
    varying otherwise: its points are best read as a list of layouts, not as axes."""
    paths = [f for f in fields if f in LAYOUT_PATHS]
    shown = [f"param:{f}" for f in (*paths, *_layout_companions(table, fields))]
    return len(paths) >= 2 and not _other_swept(table, *shown)


def _layout_companions(table: pd.DataFrame, fields: list[str]) -> list[str]:
    """The swept fields beside a ``sweep.layouts`` that are names, not numbers (a GPU, a
    model), and vary: each of their values has layouts of its own."""
    return [f for f in fields if f not in LAYOUT_PATHS and _varies(table[f"param:{f}"])
            and not _numeric(table[f"param:{f}"])]


def _numeric(column: pd.Series) -> bool:
    """Whether a swept column holds numbers only (not names, sections, or settings left
    out)."""
    return bool(pd.to_numeric(column, errors="coerce").notna().all())


def layout_figure(table: pd.DataFrame, fields: list[str], metrics: list[str]) -> Figure:
    """``metrics`` for each layout of a ``sweep.layouts`` (``2 engines × 2 stages × TP 4``),
    or each layout of each GPU (model...) swept beside it (``h100-80g: 2 engines × TP 4``),
    the best first, bars grouped by system; seeds averaged."""
    companions = [f"param:{f}" for f in _layout_companions(table, fields)]
    columns = [f"param:{f}" for f in fields if f in LAYOUT_PATHS]
    data = table.groupby([*companions, *columns, "system"], sort=False)[metrics].mean(
    ).reset_index()
    data["layout"] = ["".join(f"{row[c]}: " for c in companions)
                      + describe_layout({c.removeprefix("param:"): row[c] for c in columns})
                      for _, row in data.iterrows()]
    order = list(data.groupby("layout", sort=False)[metrics[0]].max().sort_values().index)
    fig, axes = new_figure(1, len(metrics), height=0.35 * len(order) + 1.2)
    for ax, metric in zip(axes, metrics, strict=True):
        _bars_by_system(ax, data, "layout", order, metric, horizontal=True)
        ax.set_xlabel(metric_label(metric))
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(np.arange(len(order)), order, fontsize=8)
    for ax in axes[1:]:
        ax.set_yticks(np.arange(len(order)), [])
    axes[0].legend(fontsize=8, frameon=False, loc="lower right")
    each = " and ".join([*(_short(c) for c in companions), "layout"])
    axes[0].set_title(f"Each {each}, the best at the top", loc="left", fontsize=11)
    fig.kvsim_data = {"series": data}  # type: ignore[attr-defined]
    return fig


TABLE_METRICS = ["throughput_tok_s", "e2e_p90_s", "slo_attainment", "slo_tightest_attainment",
                 "goodput_req_s", "shed", "abandoned", "abandoned_seated",
                 "abandoned_output_tokens", "waste_frac",
                 "internal_frac_of_allocated", "prefix_hit_rate", "preemptions",
                 "swap_preemptions", "reservation_overflows"]


def _results_html(table: pd.DataFrame) -> str:
    """One row per run: the swept values, then the metrics labelled and formatted as in the
    run summary ("—" where a metric does not apply or the run failed)."""
    from sim.metrics import labelled_sweep_table, sweep_metrics

    keep = ["system", "seed"] + (["status", "error"] if (table["status"] != "ok").any()
                                 else [])
    return labelled_sweep_table(table, sweep_metrics(table, TABLE_METRICS), keep).to_html(
        index=False, border=0)


def builds_in_words(table: pd.DataFrame) -> list[str]:
    """The kvsim builds that made a sweep's runs, in words (a table of a kvsim from before
    the build column has none)."""
    if "build" not in table:
        return []
    return sorted(UNRECORDED_BUILD if pd.isna(build)
                  else f"kvsim build {build}" for build in table["build"].drop_duplicates())


def write_sweep_report(sweep_dir: Path, x: str | None = None, y: str | None = None) -> Path:
    """Figures into ``sweep_dir/figures`` and ``sweep_dir/report.html``."""
    every_run, info = load_sweep(sweep_dir, ok_only=False)  # the failed ones too
    sections = []
    for name, fig in sweep_figures(sweep_dir, x, y).items():
        png = save_figure(fig, sweep_dir / "figures", name)
        sections.append((name.replace("_", " "), img_tag(png, name)))
    sections.append(("Results", f"<div class='wide'>{_results_html(every_run)}</div>"))
    scenario = yaml.safe_load(Path(info["scenario"]).read_text()) if Path(
        info["scenario"]).is_file() else {"name": sweep_dir.name}
    builds = builds_in_words(every_run)
    notes = [f"{info['points']} runs" + (" (--quick)" if info.get("quick") else "")]
    if len(builds) > 1:
        notes.append(f"these runs were made by {len(builds)} kvsim builds (the build column "
                     "of results.parquet names each run's; kvsim sweep --rerun-older runs "
                     "those of another build than the one running it again)")
    page = render_html(f"kvsim sweep: {scenario.get('name', sweep_dir.name)}", sections,
                       scenario, notes, made_by=", ".join(builds))
    out = sweep_dir / "report.html"
    out.write_text(page)
    return out
