"""Figures and a page for the folders ``kvsim capacity`` writes, drawn from what they hold.

A capacity search is a surveyor's field book: the answer (``capacity.json``) and every run
that led to it (``probes.csv``); a search of each point of a sweep, one table of answers
(``capacity.parquet``). They hold enough to draw the map again, so ``kvsim report`` on such
a folder redraws its figures and writes ``report.html`` without running anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from matplotlib.figure import Figure

from reports.html import img_tag, render_html, save_figure
from reports.slo_figure import attainment_figure
from reports.style import system_color
from sim.slo import describe_slo

CAPACITY_FILE = "capacity.json"  # one search's answer: each system's capacity
PROBES_FILE = "probes.csv"  # every run of that search, its summary
SWEEP_TABLE = "capacity.parquet"  # kvsim capacity --sweep: each point's answer, a row
SCENARIO_FILE = "scenario.yaml"  # the scenario searched (with --sweep, its base and sweep)
# The columns of a capacity table worth showing, in this order (the run at each capacity's).
CAPACITY_TABLE_METRICS = ("capacity_req_s", "slo_attainment", "slo_tightest_attainment",
                          "ttft_p99_s", "tpot_p50_s", "throughput_tok_s",
                          "usd_per_million_tokens", "rank_wait_frac",
                          "pipeline_bubble_frac")
_MARKERS = "os^Dv<>p*h"  # one a seed, where a system was searched under several


def is_capacity_folder(path: Path) -> bool:
    """Whether ``path`` holds what ``kvsim capacity`` (or ``--sweep``) wrote."""
    return (path / SWEEP_TABLE).is_file() or (
        (path / CAPACITY_FILE).is_file() and (path / PROBES_FILE).is_file())


def capacity_figure(probes: pd.DataFrame, found: dict[str, Any]) -> Figure:
    """Requests within SLO and goodput against offered load, a line per system (per system
    and seed where several seeds were searched), each capacity marked: ``probes`` is every
    run's summary, ``found`` what ``capacity.json`` holds."""
    lines, capacities = [], {}
    for i, system in enumerate(pd.unique(probes["system"])):
        runs = probes[probes["system"] == system]
        seeds = list(pd.unique(runs["seed"]))
        answer = found["systems"][system]
        for j, seed in enumerate(seeds):
            label = system if len(seeds) == 1 else f"{system}, seed {seed}"
            capacities[label] = (answer["by_seed"][str(seed)] if "by_seed" in answer
                                 else answer)["capacity_req_s"]
            lines.append((label, {"color": system_color(i), "marker": _MARKERS[j % 10]},
                          runs[runs["seed"] == seed]))
    slo = found["slo"]
    return attainment_figure(lines, "offered_req_s", slo, capacities,
                             title=f"{found['scenario']}: within SLO ({describe_slo(slo)})")


def capacity_metrics(table: pd.DataFrame) -> list[str]:
    """The columns of a capacity sweep's table to show: the capacity, then the run at it."""
    metrics = list(CAPACITY_TABLE_METRICS)
    if "slo_max_itl_attainment" in table and table["slo_max_itl_attainment"].notna().any():
        # Objectives that bound the longest wait between tokens: show that wait.
        metrics.insert(metrics.index("tpot_p50_s") + 1, "max_itl_p99_s")
    return metrics


def _with(columns: tuple[str, ...], frame: pd.DataFrame) -> pd.DataFrame:
    """``frame``, if it has ``columns`` (a KeyError naming the first it lacks, if not)."""
    for column in columns:
        if column not in frame:
            raise KeyError(column)
    return frame


def _answer(path: Path) -> dict[str, Any]:
    """``capacity.json``, checked for what the figure reads."""
    answer = json.loads(path.read_text())
    lacking = [key for key in ("scenario", "slo", "systems") if key not in answer]
    if lacking:
        raise KeyError(lacking[0])
    return answer


def write_capacity_report(path: Path) -> Path:
    """Redraw a capacity folder's figures (PNG, SVG) and write ``path/report.html``; a file
    missing or damaged is a :class:`~sim.results.RunFolderError` naming it."""
    from reports.sweep_report import capacity_figures
    from sim.metrics import labelled_sweep_means
    from sim.results import read_back

    sections = []
    if (path / SWEEP_TABLE).is_file():
        table = read_back(path, SWEEP_TABLE, lambda file: _with(
            ("system", "status", "error"), pd.read_parquet(file)))
        fields = [c.removeprefix("param:") for c in table.columns if c.startswith("param:")]
        done = table[table["status"] == "ok"]
        if len(done):  # (with every point failed, only their errors)
            for name, fig in capacity_figures(table, fields).items():
                png = save_figure(fig, path / "figures", name)
                sections.append((name.replace("_", " "), img_tag(png, name)))
            shown = labelled_sweep_means(table, capacity_metrics(table))
            sections.append(("Capacities", "<div class='wide'>"
                             + shown.to_html(index=False, border=0) + "</div>"))
        failed = table[table["status"] != "ok"]
        notes = [f"failed: {error}" for error in failed["error"].unique()]
        title = f"kvsim capacity --sweep: {path.name}"
        lead = "The highest load each system serves within the SLO at each point of the sweep."
    else:
        found = read_back(path, CAPACITY_FILE, _answer)
        probes = read_back(path, PROBES_FILE, lambda file: _with(
            ("system", "seed", "offered_req_s"), pd.read_csv(file)))
        png = save_figure(capacity_figure(probes, found), path, "capacity")
        sections.append(("Within SLO against load", img_tag(png, "capacity")))
        rows = []
        for system, answer in found["systems"].items():
            row = {"system": system, "capacity (req/s)": _req_s(answer["capacity_req_s"])}
            if "by_seed" in answer:  # several seeds: the median, and their range
                row["over seeds"] = (f"{_req_s(answer['capacity_req_s_min'])} to "
                                     f"{_req_s(answer['capacity_req_s_max'])}")
            rows.append(row)
        sections.append(("Capacities", pd.DataFrame(rows).to_html(index=False, border=0)))
        notes = []
        title = f"kvsim capacity: {found['scenario']}"
        lead = (f"The highest load each system serves with {describe_slo(found['slo'])}, "
                f"{found.get('knob', 'the load')} searched.")
    scenario = (read_back(path, SCENARIO_FILE, lambda file: dict(yaml.safe_load(
        file.read_text()))) if (path / SCENARIO_FILE).is_file() else {})
    out = path / "report.html"
    out.write_text(render_html(title, sections, scenario, notes, lead))
    return out


def _req_s(value: float | None) -> str:
    """A capacity as the page shows it."""
    return "none in range" if value is None else f"{value:,.4g}"
