"""Figures of a sweep: metric against swept field per system, the saturation knee, the
block-size trade-off, hit rate against pool size per eviction policy.

Every figure averages over seeds (bars show the min–max range) and attaches its table as
``fig.kvsim_data``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from matplotlib.figure import Figure

from reports.html import img_tag, render_html, save_figure
from reports.style import new_figure, system_color
from sim.results import read_back, read_table

KNEE_FRACTION = 0.9  # saturated once achieved req/s falls below 90 % of the offered rate

METRIC_LABELS = {
    "throughput_tok_s": "output throughput (tokens/s)",
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
}


class SweepReportError(ValueError):
    """A figure that cannot be drawn from this sweep (unknown field or metric)."""


def load_sweep(sweep_dir: Path) -> tuple[pd.DataFrame, dict]:
    info = read_back(sweep_dir, "sweep.json", lambda p: dict(json.loads(p.read_text())))
    table = read_back(sweep_dir, "results.parquet", read_table)
    return table[table["status"] == "ok"].copy(), info


def _param(table: pd.DataFrame, field: str) -> str:
    column = f"param:{field}"
    if column not in table:
        fields = [c.removeprefix("param:") for c in table.columns if c.startswith("param:")]
        raise SweepReportError(f"--x {field}: not a swept field; swept: {', '.join(fields)}")
    return column


def _aggregate(table: pd.DataFrame, x: str, y: str, by: str = "system") -> pd.DataFrame:
    grouped = table.groupby([by, x], sort=False)[y]
    return grouped.agg(["mean", "min", "max"]).reset_index()


def metric_vs_field(table: pd.DataFrame, field: str, metric: str, *,
                    by: str = "system", logx: bool | None = None) -> Figure:
    """``metric`` against swept ``field``, one line per system (or per ``by`` column)."""
    x = _param(table, field)
    if metric not in table:
        raise SweepReportError(f"--y {metric}: not a summary metric; e.g. "
                               f"{', '.join(list(METRIC_LABELS)[:6])}")
    data = _aggregate(table, x, metric, by)
    fig, (ax,) = new_figure(1, 1, height=3.6)
    for i, (name, part) in enumerate(data.groupby(by, sort=False)):
        part = part.sort_values(x)
        xs = part[x].to_numpy(dtype=float)
        ax.errorbar(xs, part["mean"], yerr=[part["mean"] - part["min"],
                                            part["max"] - part["mean"]],
                    marker="o", markersize=4, capsize=2, color=system_color(i), label=str(name))
    values = data[x].to_numpy(dtype=float)
    if logx if logx is not None else (values.min() > 0 and values.max() / values.min() >= 16):
        ax.set_xscale("log", base=2)
    ax.set_xlabel(field)
    ax.set_ylabel(METRIC_LABELS.get(metric, metric))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(f"{METRIC_LABELS.get(metric, metric)} against {field}", loc="left",
                 fontsize=11)
    fig.kvsim_data = {"series": data}  # type: ignore[attr-defined]
    return fig


def saturation_knee(part: pd.DataFrame, rate_column: str) -> float | None:
    """The highest offered rate still served at ≥ 90 % of itself (None if none is)."""
    served = part[part["throughput_req_s"] >= KNEE_FRACTION * part[rate_column]]
    return float(served[rate_column].max()) if len(served) else None


def rate_figure(table: pd.DataFrame, field: str = "workload.arrival.rate") -> Figure:
    """Throughput and p90 latency against request rate, each system's knee marked."""
    x = _param(table, field)
    fig, axes = new_figure(2, 1, height=3.0, sharex=True)
    knees = {}
    labels: dict[float, tuple[float, int]] = {}  # knee -> (lowest label anchor, labels there)
    for i, (name, part) in enumerate(table.groupby("system", sort=False)):
        mean = part.groupby(x).mean(numeric_only=True).reset_index().sort_values(x)
        color = system_color(i)
        axes[0].plot(mean[x], mean["throughput_tok_s"], marker="o", markersize=4, color=color,
                     label=name)
        axes[1].plot(mean[x], mean["e2e_p90_s"], marker="o", markersize=4, color=color,
                     label=name)
        knee = saturation_knee(mean, x)
        knees[name] = knee
        if knee is not None:
            for ax in axes:
                ax.axvline(knee, color=color, linestyle="--", linewidth=0.8, alpha=0.8)
            y = float(mean.loc[mean[x] == knee, "throughput_tok_s"].iloc[0])
            # Labels of systems that saturate at the same rate stack instead of overprinting.
            anchor, stacked = labels.get(knee, (y, 0))
            y = min(y, anchor)
            labels[knee] = (y, stacked + 1)
            axes[0].annotate(f"knee {knee:g}", (knee, y), textcoords="offset points",
                             xytext=(4, -12 - 10 * stacked), fontsize=7, color=color)
    axes[0].set_ylabel("output throughput (tokens/s)")
    axes[1].set_ylabel("E2E latency p90 (s)")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("offered load (requests/s)")
    axes[0].legend(fontsize=8, frameon=False)
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


def _rho_for(sweep_dir: Path, table: pd.DataFrame, sizes: list[int]) -> dict[int, float]:
    from sim.engine import build_timing
    from sim.scenario import scenario_from_dict

    key = table["key"].iloc[0]
    resolved = yaml.safe_load((sweep_dir / "runs" / key / "scenario.yaml").read_text())
    info = json.loads((sweep_dir / "sweep.json").read_text())
    timing = build_timing(scenario_from_dict(resolved), Path(info["scenario"]).parent)
    return {s: timing.rho(s) for s in sizes}


def sweep_figures(sweep_dir: Path, x: str | None = None,
                  y: str | None = None) -> dict[str, Figure]:
    """The figures that fit this sweep's swept fields (and ``--x``/``--y`` if given)."""
    table, info = load_sweep(sweep_dir)
    fields = info["params"]
    figures: dict[str, Figure] = {}
    if x or y:
        field = x or fields[0]
        figures[f"{y or 'throughput_tok_s'}_vs_{field}"] = metric_vs_field(
            table, field, y or "throughput_tok_s")
        return figures
    rate = next((f for f in fields if f.endswith("arrival.rate")), None)
    block = next((f for f in fields if f.endswith("allocator.block_size")), None)
    pool = next((f for f in fields if f.endswith("kv_memory_gib")), None)
    policy = next((f for f in fields if f.endswith("allocator.eviction")), None)
    if rate:
        figures["rate_sweep"] = rate_figure(table, rate)
    if block:
        sizes = sorted(int(v) for v in table[f"param:{block}"].unique())
        figures["block_size_tradeoff"] = block_size_figure(table, block,
                                                           _rho_for(sweep_dir, table, sizes))
    if pool and policy:
        figures["eviction_pressure"] = eviction_figure(table, pool, policy)
    for field in fields:
        if field in (rate, block) or (field in (pool, policy) and pool and policy):
            continue
        numeric = pd.to_numeric(table[f"param:{field}"], errors="coerce").notna().all()
        if numeric:
            slug = field.replace(".", "_").replace("[", "_").replace("]", "")
            figures[f"throughput_vs_{slug}"] = metric_vs_field(table, field,
                                                               "throughput_tok_s")
            figures[f"waste_vs_{slug}"] = metric_vs_field(table, field, "waste_frac")
    return figures


TABLE_METRICS = ["throughput_tok_s", "e2e_p90_s", "waste_frac", "internal_frac_of_allocated",
                 "prefix_hit_rate", "preemptions"]


def _results_html(table: pd.DataFrame) -> str:
    """One row per run: the swept values, then the metrics labelled and formatted as in the
    run summary ("—" where a metric does not apply or the run failed)."""
    from sim.metrics import labelled_sweep_table

    keep = ["system", "seed"] + (["status"] if (table["status"] != "ok").any() else [])
    return labelled_sweep_table(table, TABLE_METRICS, keep).to_html(index=False, border=0)


def write_sweep_report(sweep_dir: Path, x: str | None = None, y: str | None = None) -> Path:
    """Figures into ``sweep_dir/figures`` and ``sweep_dir/report.html``."""
    table, info = load_sweep(sweep_dir)
    sections = []
    for name, fig in sweep_figures(sweep_dir, x, y).items():
        png = save_figure(fig, sweep_dir / "figures", name)
        sections.append((name.replace("_", " "), img_tag(png, name)))
    sections.append(("Results", f"<div class='wide'>{_results_html(table)}</div>"))
    scenario = yaml.safe_load(Path(info["scenario"]).read_text()) if Path(
        info["scenario"]).is_file() else {"name": sweep_dir.name}
    page = render_html(f"kvsim sweep: {scenario.get('name', sweep_dir.name)}", sections,
                       scenario, [f"{info['points']} runs"
                                  + (" (--quick)" if info.get("quick") else "")])
    out = sweep_dir / "report.html"
    out.write_text(page)
    return out
