"""Plots, tables and a self-contained HTML report of kvsim runs and sweeps."""

from __future__ import annotations

from pathlib import Path


def write_any_report(path: Path, x: str | None = None, y: str | None = None) -> Path:
    """``report.html`` for a run folder (summary.json) or a sweep folder (sweep.json)."""
    if (path / "sweep.json").is_file():
        from reports.sweep_report import write_sweep_report

        return write_sweep_report(path, x=x, y=y)
    from reports.html import write_report

    return write_report(path)
