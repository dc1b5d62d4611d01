"""Plots, tables and a self-contained HTML report of kvsim runs and sweeps."""

from __future__ import annotations

from pathlib import Path


def write_any_report(path: Path, x: str | None = None, y: str | None = None) -> Path:
    """``report.html`` for a run folder (summary.json), a sweep folder (sweep.json) or a
    folder of ``kvsim capacity`` (capacity.json or capacity.parquet)."""
    if (path / "sweep.json").is_file():
        from reports.sweep_report import write_sweep_report

        return write_sweep_report(path, x=x, y=y)
    from reports.capacity_report import is_capacity_folder, write_capacity_report

    if is_capacity_folder(path) and not (path / "summary.json").is_file():
        return write_capacity_report(path)
    from reports.html import write_report

    return write_report(path)
