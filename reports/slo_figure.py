"""The SLO figure: the share of requests in time, and goodput, against offered load.

One picture serves both ways of finding a capacity: a sweep's grid of rates and
``kvsim capacity``'s search. The target attainment is a horizontal line; where a line last
stays on or above it is that system's capacity, marked and named in the legend.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from reports.style import legend, new_figure
from sim.slo import judged_attainment


def attainment_figure(lines: list[tuple[str, dict[str, Any], pd.DataFrame]], x: str,
                      slo: dict[str, Any], capacities: dict[str, float | None], *,
                      title: str) -> Figure:
    """Attainment as ``slo`` judges it (top) and goodput (bottom) against ``x`` (offered
    requests/s), one line per ``(label, matplotlib style, rows)``, each rows' summaries
    sorted by ``x``; ``capacities`` by label (None: none on the axis)."""
    target = float(slo.get("attainment", 0.9))
    fig, axes = new_figure(2, 1, height=3.0 if len(lines) <= 5 else 3.4, sharex=True)
    for label, style, part in lines:
        part = part.sort_values(x)
        capacity = capacities.get(label)
        shown = f"{label} ({f'capacity {capacity:.3g}' if capacity else 'none in range'})"
        axes[0].plot(part[x], judged_attainment(part, slo) * 100, markersize=4, label=shown,
                     **style)
        axes[1].plot(part[x], part["goodput_req_s"], markersize=4, label=shown, **style)
        if capacity:
            for ax in axes:
                ax.axvline(capacity, color=style["color"], linestyle="--", linewidth=0.8,
                           alpha=0.8)
    axes[0].axhline(target * 100, color="#555555", linestyle=":", linewidth=1.0)
    axes[0].annotate(f"target {target:.0%}", (0, target * 100), xycoords=("axes fraction",
                     "data"), textcoords="offset points", xytext=(4, 3), fontsize=8,
                     color="#555555")
    axes[0].set_ylabel("requests within SLO (%)" if slo.get("judge", "requests") == "requests"
                       else "requests within the tightest bound (%)")
    axes[0].set_ylim(-3, 103)
    axes[1].set_ylabel("goodput (req/s within SLO)")
    axes[1].set_xlabel("offered load (requests/s)")
    legend(axes[0], len(lines))
    axes[0].set_title(title, loc="left", fontsize=11)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.kvsim_data = {"capacities": pd.Series(capacities, dtype=float)}  # type: ignore[attr-defined]
    return fig
