"""One look for every figure: colour-blind-safe palettes, units, sizes.

The taxonomy categories keep the same colour in every figure (Okabe–Ito palette, safe for
the common forms of colour blindness); systems are told apart with Paul Tol's "bright"
scheme, which is safe too and distinct from the taxonomy colours' roles.
"""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

# SVG element ids come from a random salt unless one is set: fixed, so that the same run
# draws byte-identical files.
matplotlib.rcParams["svg.hashsalt"] = "kvsim"

TAXONOMY_COLORS: dict[str, str] = {
    "token": "#0072B2",  # blue: live KV
    "reserved": "#56B4E9",  # sky blue: will be written
    "internal": "#E69F00",  # orange: never written
    "external": "#D55E00",  # vermillion: free but unusable
    "cached": "#009E73",  # green: reusable prefix
    "free": "#DDDDDD",  # light grey
}
TAXONOMY_LABELS: dict[str, str] = {
    "token": "token (live KV)",
    "reserved": "reserved (to be written)",
    "internal": "internal fragmentation",
    "external": "external fragmentation",
    "cached": "cached prefix (evictable)",
    "free": "free",
}
SYSTEM_COLORS = ["#4477AA", "#EE6677", "#228833", "#CCBB44", "#66CCEE", "#AA3377",
                 "#BBBBBB"]


def system_color(index: int) -> str:
    return SYSTEM_COLORS[index % len(SYSTEM_COLORS)]


def new_figure(rows: int = 1, cols: int = 1, *, width: float = 9.0, height: float = 3.2,
               sharex: bool = False) -> tuple[Figure, list]:
    """A figure with ``rows × cols`` axes (always returned as a flat list)."""
    fig, axes = plt.subplots(rows, cols, figsize=(width, height * rows), sharex=sharex,
                             squeeze=False, layout="constrained")
    return fig, list(axes.flat)


def legend(ax: Any, entries: int) -> None:
    """A few lines: a legend inside the axes; more: two columns under the figure, where
    they cover no data."""
    if entries <= 5:
        inner_legend(ax)
    else:
        ax.figure.legend(*ax.get_legend_handles_labels(), loc="outside lower center",
                         ncols=2, fontsize=8, frameon=False)


def inner_legend(ax: Any) -> None:
    """A legend inside the axes, if anything drawn there is labelled (a run that served no
    request draws no line)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, frameon=False)


def close(fig: Figure) -> None:
    plt.close(fig)
