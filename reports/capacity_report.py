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
from matplotlib.figure import Figure

from reports.html import img_tag, made_by_text, render_html, save_figure
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
            lines.append((label, {"color": system_color(i), "marker": _MARKERS[j % len(_MARKERS)]},
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


def _having(keys: tuple[str, ...], data: Any) -> Any:
    """``data`` (a table's columns, a mapping's keys), if it has ``keys``; else a KeyError
    naming the first it lacks, which :func:`~sim.results.read_back` tells as a damaged file."""
    lacking = [key for key in keys if key not in data]
    if lacking:
        raise KeyError(lacking[0])
    return data


# title, lead, sections, notes, and the kvsim builds that computed the results, in words
Page = tuple[str, str, list[tuple[str, str]], list[str], str]


def write_capacity_report(path: Path) -> Path:
    """Redraw a capacity folder's figures (PNG, SVG) and write ``path/report.html``; a file
    missing or damaged is a :class:`~sim.results.RunFolderError` naming it."""
    from sim.results import read_scenario

    if (path / SWEEP_TABLE).is_file():
        title, lead, sections, notes, made_by = _sweep_page(path)
    else:
        title, lead, sections, notes, made_by = _search_page(path)
    scenario = read_scenario(path) if (path / SCENARIO_FILE).is_file() else {}
    out = path / "report.html"
    out.write_text(render_html(title, sections, scenario, notes, lead, made_by=made_by))
    return out


def _sweep_page(path: Path) -> Page:
    """``kvsim capacity --sweep``'s figures (drawn into ``path/figures``) and table."""
    from reports.sweep_report import builds_in_words, capacity_figures
    from sim.metrics import labelled_sweep_means
    from sim.results import read_back

    table = read_back(path, SWEEP_TABLE, lambda file: _having(
        ("system", "status", "error"), pd.read_parquet(file)))
    fields = [c.removeprefix("param:") for c in table.columns if c.startswith("param:")]
    sections = []
    if (table["status"] == "ok").any():  # (with every point failed, only their errors)
        for name, fig in capacity_figures(table, fields).items():
            png = save_figure(fig, path / "figures", name)
            sections.append((name.replace("_", " "), img_tag(png, name)))
        shown = labelled_sweep_means(table, capacity_metrics(table))
        sections.append(("Capacities", "<div class='wide'>"
                         + shown.to_html(index=False, border=0) + "</div>"))
    failed = table[table["status"] != "ok"]
    return (f"kvsim capacity --sweep: {path.name}",
            "The highest load each system serves within the SLO at each point of the sweep.",
            sections, [f"failed: {error}" for error in failed["error"].unique()],
            ", ".join(builds_in_words(table)))


def _search_page(path: Path) -> Page:
    """One ``kvsim capacity`` search's figure (drawn into ``path``) and capacities."""
    from sim.results import read_back

    found = read_back(path, CAPACITY_FILE, lambda file: _made_by_checked(_having(
        ("scenario", "slo", "systems"), json.loads(file.read_text()))))
    probes = read_back(path, PROBES_FILE, lambda file: _having(
        ("system", "seed", "offered_req_s"), pd.read_csv(file)))
    png = save_figure(capacity_figure(probes, found), path, "capacity")
    rows = []
    for system, answer in found["systems"].items():
        row = {"system": system, "capacity (req/s)": _req_s(answer["capacity_req_s"])}
        if "by_seed" in answer:  # several seeds: the median, and their range
            row["over seeds"] = (f"{_req_s(answer['capacity_req_s_min'])} to "
                                 f"{_req_s(answer['capacity_req_s_max'])}")
        rows.append(row)
    sections = [("Within SLO against load", img_tag(png, "capacity")),
                ("Capacities", pd.DataFrame(rows).to_html(index=False, border=0))]
    return (f"kvsim capacity: {found['scenario']}",
            f"The highest load each system serves with {describe_slo(found['slo'])}, "
            f"{found.get('knob', 'the load')} searched.", sections, [],
            made_by_text(found.get("made_by")))


def _made_by_checked(found: dict[str, Any]) -> dict[str, Any]:
    """A search's answer whose record of the kvsim that made it is sound (or absent)."""
    from sim.results import checked_made_by

    checked_made_by(found.get("made_by"))
    return found


def _req_s(value: float | None) -> str:
    """A capacity as the page shows it."""
    return "none in range" if value is None else f"{value:,.4g}"
