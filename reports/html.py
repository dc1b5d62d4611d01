"""A self-contained HTML report of a run folder: figures embedded, tables, scenario, versions.

``report.html`` loads nothing from anywhere — images are inline PNG data — so it can be
mailed or opened offline. The same figures are written beside it as PNG and SVG files.
"""

from __future__ import annotations

import base64
import html
import io
import platform
from importlib import metadata
from pathlib import Path

import yaml
from matplotlib.figure import Figure

from reports.run_figures import RUN_FIGURES
from reports.style import close
from sim import CORE
from sim.provenance import build_id
from sim.results import ScenarioResult, load_run, run_notes

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.2em; margin-top: 2em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
td { white-space: nowrap; }
.wide { overflow-x: auto; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.85em; }
img { max-width: 100%; }
.note { color: #555; }
"""


def save_figure(fig: Figure, folder: Path, name: str) -> bytes:
    """Write ``name``.png and .svg into ``folder``; return the PNG bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    png = buffer.getvalue()
    (folder / f"{name}.png").write_bytes(png)
    fig.savefig(folder / f"{name}.svg", format="svg", metadata={"Date": None})
    close(fig)
    return png


def _versions() -> dict[str, str]:
    """The versions that drew the report (the run may be older: see :func:`made_by_text`)."""
    versions = {"python": platform.python_version()}
    for package in ("kvsim", "numpy", "pandas", "simpy", "matplotlib", "pydantic"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    versions["kvsim"] += f" (build {build_id()})"
    versions["kvsim core"] = CORE.describe()  # identical results either way; speed differs
    return versions


# What a folder written before kvsim recorded its build says of the kvsim that made it.
UNRECORDED_BUILD = "a kvsim from before run folders named their build"


def made_by_text(made_by: dict[str, str] | None) -> str:
    """The kvsim a run folder says computed it, in words."""
    if made_by is None:
        return UNRECORDED_BUILD
    return f"kvsim {made_by['kvsim']} (build {made_by['build']})"


def _summary_table(result: ScenarioResult) -> str:
    from sim.metrics import format_metric, summary_rows

    head = "".join(f"<th>{html.escape(n)}</th>" for n in result.systems)
    rows = []
    for key, label, fmt in summary_rows(r.summary for r in result.systems.values()):
        cells = "".join(f"<td>{format_metric(r.summary.get(key), fmt)}</td>"
                        for r in result.systems.values())
        rows.append(f"<tr><td>{html.escape(label)}</td>{cells}</tr>")
    return f"<table><tr><th>metric</th>{head}</tr>{''.join(rows)}</table>"


def _memory_line(scenario: dict) -> str:
    """The run's memory figures; "" for a run folder this version cannot read them from
    (written by an older kvsim whose scenario fields have changed since)."""
    from sim.engine import memory_summary
    from sim.scenario import scenario_from_dict

    try:
        return memory_summary(scenario_from_dict(scenario))
    except ValueError:
        return ""


def render_html(title: str, sections: list[tuple[str, str]], scenario: dict,
                notes: list[str], lead: str = "", made_by: str = "") -> str:
    """The report page from (heading, HTML body) sections, ``lead`` a line above them;
    ``made_by`` names the kvsim that computed the results, where the page shows some."""
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
             f"</title><style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    if scenario.get("description"):
        parts.append(f"<p>{html.escape(scenario['description'])}</p>")
    if lead:
        parts.append(f"<p>{html.escape(lead)}</p>")
    for note in notes:
        parts.append(f"<p class='note'>note: {html.escape(note)}</p>")
    for heading, body in sections:
        parts.append(f"<h2>{html.escape(heading)}</h2>{body}")
    if scenario:  # (a folder from before it was kept has none to show)
        parts.append("<h2>Resolved scenario</h2><pre>"
                     + html.escape(yaml.safe_dump(scenario, sort_keys=False)) + "</pre>")
    rows = {"results made by": made_by, **_versions()} if made_by else _versions()
    versions = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>"
                       for k, v in rows.items())
    parts.append(f"<h2>Versions</h2><table>{versions}</table></body></html>")
    return "".join(parts)


def img_tag(png: bytes, alt: str) -> str:
    return (f"<img alt='{html.escape(alt)}' "
            f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>")


def write_report(run_dir: Path) -> Path:
    """Figures (PNG, SVG) into ``run_dir/figures`` and ``run_dir/report.html``."""
    result = load_run(run_dir)
    figures = run_dir / "figures"
    sections = [("Summary", _summary_table(result))]
    for name, build in RUN_FIGURES.items():
        figure = build(result)
        if figure is None:
            continue
        png = save_figure(figure, figures, name)
        sections.append((name.replace("_", " ").capitalize(), img_tag(png, name)))
    notes = run_notes({n: r.summary for n, r in result.systems.items()})
    page = render_html(f"kvsim report: {result.scenario['name']}", sections, result.scenario,
                       [*result.trace_notes, *notes], lead=_memory_line(result.scenario),
                       made_by=made_by_text(result.made_by))
    out = run_dir / "report.html"
    out.write_text(page)
    return out
