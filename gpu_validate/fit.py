"""From kernel timings to the simulator's step-time coefficients.

The timing table (one row per measurement, written by the harness as ``timings.csv``) holds
per-layer medians: decode attention for (layout, block_size, batch, context_len) and the
layer's GEMMs for a token count. A decode step of batch B with context C = B·L costs
``layers × (gemm(B) + attention(B, L))``; the fit finds ``a + b·B + c·C`` minimising the
*relative* error (rows weighted by 1/T), holding out every k-th point to report an honest MAPE.
ρ(bs) is the median paged/contiguous attention ratio per block size; ``d`` is the per-token
slope of the GEMMs at prefill sizes; ``e`` (prefill attention, quadratic) is 2·layers·hidden
FLOP per token pair at the best FLOP rate the GEMMs reached.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pandas as pd

from sim.presets import ModelSpec
from sim.timing import Calibration

PREFILL_MIN_TOKENS = 256  # GEMMs at least this wide are compute-bound: they give d


class FitError(ValueError):
    """Timings that cannot be fitted (missing kinds of rows, too few points)."""


@dataclass
class FitResult:
    """Coefficients plus the points they were judged on."""

    calibration: Calibration
    points: pd.DataFrame  # batch, context_tokens, measured_s, predicted_s, held_out


def decode_points(timings: pd.DataFrame, num_layers: int) -> pd.DataFrame:
    """Measured decode-step times: layers × (GEMMs at B + contiguous attention at B, L)."""
    attention = timings[(timings["kind"] == "attention") & (timings["layout"] == "contiguous")]
    gemm = timings[timings["kind"] == "gemm"].set_index("tokens")["time_s"]
    missing = sorted(set(attention["batch"]) - set(gemm.index))
    if missing:
        raise FitError(f"no GEMM timing for batch sizes {missing}")
    points = pd.DataFrame({
        "batch": attention["batch"].to_numpy(),
        "context_tokens": (attention["batch"] * attention["context_len"]).to_numpy(),
        "measured_s": num_layers * (gemm.loc[attention["batch"]].to_numpy()
                                    + attention["time_s"].to_numpy()),
    })
    return points.sort_values(["batch", "context_tokens"]).reset_index(drop=True)


def fit_linear_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on relative error, coefficients ≥ 0: minimise Σ((x·β − y)/y)², β ≥ 0.

    A negative seconds-per-unit is not physical (and a calibration file refuses it), yet noise
    can push a small term below zero, e.g. GEMMs that are flat in batch size. The constrained
    optimum is the unconstrained fit on some subset of the columns, so with three columns every
    subset is tried and the best one whose fit is non-negative wins.
    """
    weighted = x / y[:, None]
    ones = np.ones(len(y))
    best, best_residual = np.zeros(x.shape[1]), float(ones @ ones)
    for size in range(1, x.shape[1] + 1):
        for columns in itertools.combinations(range(x.shape[1]), size):
            part, *_ = np.linalg.lstsq(weighted[:, columns], ones, rcond=None)
            if (part < 0).any():
                continue
            residual = ones - weighted[:, columns] @ part
            if float(residual @ residual) < best_residual - 1e-15:
                best = np.zeros(x.shape[1])
                best[list(columns)] = part
                best_residual = float(residual @ residual)
    return best


def fit_rho(timings: pd.DataFrame) -> dict[int, float]:
    """Median paged/contiguous attention-time ratio per block size."""
    attention = timings[timings["kind"] == "attention"]
    contiguous = attention[attention["layout"] == "contiguous"].set_index(
        ["batch", "context_len"])["time_s"]
    rho: dict[int, float] = {}
    paged = attention[attention["layout"] == "paged"]
    for block_size, part in paged.groupby("block_size"):
        base = contiguous.reindex(pd.MultiIndex.from_frame(part[["batch", "context_len"]]))
        ratios = part["time_s"].to_numpy() / base.to_numpy()
        ratios = ratios[np.isfinite(ratios)]
        if len(ratios):
            rho[int(block_size)] = float(np.median(ratios))
    return rho


REQUIRED_COLUMNS = {"attention": ("layout", "block_size", "batch", "context_len", "time_s"),
                    "gemm": ("tokens", "time_s", "flops")}


def check_timings(timings: pd.DataFrame) -> pd.DataFrame:
    """``timings`` with its numeric columns read as numbers; FitError naming the missing
    column or the first bad row (rows count from 2, as in the CSV file with its header)."""
    if "kind" not in timings:
        raise FitError("no 'kind' column; expected a timings.csv written by gpu_validate")
    for kind, columns in REQUIRED_COLUMNS.items():
        rows = timings[timings["kind"] == kind]
        if rows.empty:
            raise FitError(f"timings have no {kind!r} rows")
        missing = [c for c in columns if c not in timings]
        if missing:
            raise FitError(f"{kind} rows need column(s) {', '.join(missing)}")
        for column in columns:
            if column == "layout":
                continue
            values = pd.to_numeric(rows[column], errors="coerce")
            bad = (~np.isfinite(values.to_numpy(dtype=float)) | (values < 0)
                   | ((values == 0) & (column != "block_size")))
            if bad.any():
                row = int(rows.index[bad][0]) + 2
                raise FitError(f"row {row}: {column} {rows[column][bad].iloc[0]}: expected "
                               "a positive number")
    numeric = {c for columns in REQUIRED_COLUMNS.values() for c in columns} - {"layout"}
    # (A column checked for one kind's rows only: the other kind leaves it empty.)
    return timings.assign(**{c: pd.to_numeric(timings[c], errors="coerce")
                             for c in numeric if c in timings})


def fit_calibration(timings: pd.DataFrame, model: ModelSpec, *, device: str = "",
                    holdout_every: int = 4) -> FitResult:
    """Fit the step-time model and ρ(bs) to ``timings`` (see the module docstring)."""
    timings = check_timings(timings)
    points = decode_points(timings, model.num_layers)
    if len(points) < 4:
        raise FitError(f"need at least 4 decode points, got {len(points)}")
    held_out = np.zeros(len(points), dtype=bool)
    if holdout_every > 1 and len(points) >= 2 * holdout_every:
        held_out[holdout_every - 1::holdout_every] = True
    x = np.column_stack([np.ones(len(points)), points["batch"], points["context_tokens"]])
    y = points["measured_s"].to_numpy()
    a, b, c = fit_linear_relative(x[~held_out], y[~held_out])
    points["predicted_s"] = x @ np.array([a, b, c])
    points["held_out"] = held_out
    errors = np.abs(points["predicted_s"] - y) / y
    judged = errors[held_out] if held_out.any() else errors
    gemm = timings[timings["kind"] == "gemm"]
    wide = gemm[gemm["tokens"] >= PREFILL_MIN_TOKENS]
    if len(wide) >= 2:
        slope = np.polyfit(wide["tokens"].to_numpy(dtype=float),
                           wide["time_s"].to_numpy(), 1)[0]
        if slope <= 0:
            raise FitError(f"GEMM time does not grow with tokens from {PREFILL_MIN_TOKENS} "
                           "tokens up: these timings cannot give a prefill cost")
        d = model.num_layers * float(slope)
    else:
        d = float(b)
    best_flops = float((gemm["flops"] / gemm["time_s"]).max())
    e = 2.0 * model.num_layers * model.attention_dim / best_flops
    calibration = Calibration(
        model=model.name,
        device=device,
        coefficients={"a": float(a), "b": float(b), "c": float(c), "d": d, "e": e},
        rho=fit_rho(timings),
        fit={"mape": float(judged.mean()), "max_error": float(judged.max()),
             "mape_all": float(errors.mean()), "points": len(points),
             "held_out_points": int(held_out.sum())},
    )
    return FitResult(calibration, points)


def plot_fit(result: FitResult, path) -> None:  # type: ignore[no-untyped-def]
    """Measured against predicted step times (held-out points hollow)."""
    from reports.style import close, new_figure

    fig, (ax,) = new_figure(1, 1, width=5.5, height=5.0)
    points = result.points
    for held, style in ((False, {"color": "#0072B2"}),
                        (True, {"facecolors": "none", "edgecolors": "#D55E00"})):
        part = points[points["held_out"] == held]
        ax.scatter(part["measured_s"] * 1e3, part["predicted_s"] * 1e3, s=18,
                   label="held out" if held else "fitted", **style)
    lo = min(points["measured_s"].min(), points["predicted_s"].min()) * 1e3 * 0.8
    hi = max(points["measured_s"].max(), points["predicted_s"].max()) * 1e3 * 1.25
    ax.plot([lo, hi], [lo, hi], color="#888888", linewidth=0.8, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured decode step (ms)")
    ax.set_ylabel("predicted decode step (ms)")
    fit = result.calibration.fit
    ax.set_title(f"{result.calibration.model} on {result.calibration.device or 'device'}: "
                 f"held-out MAPE {fit['mape'] * 100:.1f}%", loc="left", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    fig.savefig(path, dpi=110)
    close(fig)
