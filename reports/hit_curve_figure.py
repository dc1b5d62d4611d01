"""The figure of ``kvsim trace hit-curve``: prefix-cache hit rate against cache size.

One line per trace, on a logarithmic size axis; a scenario's pools (and host tiers) are
marked where the simulator's own cache sits on the curve. The plotted table is attached as
``fig.kvsim_data``, as every kvsim figure's is.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from reports.style import new_figure, system_color
from sim.hit_curve import HitCurve
from sim.presets import GIB


def curve_sizes(curves: list[HitCurve], points: int = 200) -> np.ndarray:
    """Cache sizes (tokens) that span every curve up to past its saturation, over 16
    doublings at most (from one block where the curves saturate sooner)."""
    largest = max(max(c.saturation_tokens, c.block_size) for c in curves) * 2
    smallest = max(min(c.block_size for c in curves), largest >> 16)
    return np.unique(np.geomspace(smallest, largest, points).astype(np.int64))


def hit_curve_figure(curves: dict[str, HitCurve], kv_bytes_per_token: int | None = None,
                     marks: dict[str, int] | None = None) -> Figure:
    """Hit rate against cache size for each labelled curve; ``marks`` are labelled sizes
    (tokens) drawn as vertical lines. With ``kv_bytes_per_token`` the size axis is in GiB."""
    fig, (ax,) = new_figure(width=7.0, height=4.0)
    sizes = curve_sizes(list(curves.values()))
    scale = kv_bytes_per_token / GIB if kv_bytes_per_token else 1.0
    table = pd.DataFrame({"cache_tokens": sizes})
    for index, (label, curve) in enumerate(curves.items()):
        rates = np.array([curve.hit_rate(int(size)) for size in sizes])
        table[label] = rates
        ax.plot(sizes * scale, rates, color=system_color(index), label=label)
    for index, (label, tokens) in enumerate((marks or {}).items()):
        ax.axvline(tokens * scale, color="0.4", linestyle=("--", ":", "-.")[index % 3],
                   linewidth=1, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("cache size (GiB of KV)" if kv_bytes_per_token else "cache size (tokens)")
    ax.set_ylabel("prefix-cache hit rate")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title("Prefix-cache hit rate against cache size (LRU, requests one at a time)",
                 fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    fig.kvsim_data = table  # type: ignore[attr-defined]
    return fig
