"""Service-level objectives: which requests were served in time, and the goodput they make.

A serving system is judged like a delivery service: not by parcels moved per hour, but by
parcels delivered *on time*. Each request is checked against the scenario's bounds
(:class:`sim.scenario.SloConfig`): time to first token, time per output token after it, end
to end, and the longest wait between two tokens (a stream that stalls, however fast on
average). The share of requests that meet all of them is the *attainment*; the rate at
which they complete is the *goodput* (vLLM's ``benchmark_serving --goodput``). A request
that was turned away, or never finished, was not on time.

A load is sustained when that share reaches the objective's ``attainment`` (DistServe), or,
judged by percentiles, when each bound alone is met by that share of requests (MLPerf's
"p99 TTFT ≤ 2 s and p99 TPOT ≤ 200 ms"): :func:`judged_attainment` is the share compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import reduce
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from sim.scenario import SloConfig

# Summary keys, None where the scenario sets no objectives (shown "—", like a hit rate
# without a prefix cache), so every run's summary has the same keys; the tightest bound's
# attainment is given only where the objectives are judged by percentiles.
SLO_KEYS = ("slo_attainment", "goodput_req_s", "slo_ttft_attainment", "slo_tpot_attainment",
            "slo_e2e_attainment", "slo_max_itl_attainment", "slo_tightest_attainment")
# (key, as people write it)
BOUNDS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E"), ("max_itl", "longest token gap"))


def latencies(requests: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per-request TTFT, TPOT, E2E latency and longest wait between two tokens (max ITL) in
    seconds (NaN where the request never got there; TPOT and max ITL 0 for a single output
    token, which has no gap to miss)."""
    arrival = requests["arrival_s"].to_numpy(dtype=float)
    # Times not reached are NaN in a run's table, -1 in the summary's copy of it.
    first, finished = (np.where(times >= 0, times, np.nan) for times in (
        requests["first_token_s"].to_numpy(dtype=float),
        requests["finished_s"].to_numpy(dtype=float)))
    gaps = requests["output_len"].to_numpy(dtype=float) - 1
    tpot = np.where(gaps > 0, (finished - first) / np.maximum(gaps, 1), 0.0)
    tpot[np.isnan(finished)] = np.nan
    # (A table written before runs recorded the gaps has none to give.)
    longest = (requests["max_itl_s"].to_numpy(dtype=float) if "max_itl_s" in requests
               else np.full(len(requests), np.nan))
    max_itl = np.where(gaps > 0, longest, 0.0)
    max_itl[np.isnan(finished)] = np.nan
    return {"ttft": first - arrival, "tpot": tpot, "e2e": finished - arrival,
            "max_itl": max_itl}


def in_time(requests: pd.DataFrame, slo: SloConfig) -> dict[str, np.ndarray]:
    """For each bound the scenario gives, whether each request met it, and ``"all"``:
    whether it met every one. A request never answered whole (rejected, or given up by its
    client, even after a first token in time) misses every bound."""
    measured = latencies(requests)
    answered = np.isfinite(measured["e2e"])
    met = {name: (measured[name] <= bound) & answered
           for name, _ in BOUNDS if (bound := getattr(slo, f"{name}_s")) is not None}
    met["all"] = np.logical_and.reduce(list(met.values()))
    return met


def slo_summary(requests: pd.DataFrame, makespan_s: float, slo: SloConfig | None
                ) -> dict[str, Any]:
    """The summary's SLO metrics: attainment (of all requests, rejected ones included),
    goodput in requests per second, and the attainment of each bound alone, which tells
    which one a system misses (and, judged by percentiles, the lowest of those)."""
    if slo is None:
        return dict.fromkeys(SLO_KEYS)
    requests = judged_requests(requests, slo)
    met = in_time(requests, slo)
    count = max(len(requests), 1)
    share = {name: float(flags.sum()) / count for name, flags in met.items()}
    summary: dict[str, Any] = {
        "slo_attainment": share["all"],
        "goodput_req_s": float(met["all"].sum()) / makespan_s,
        **{f"slo_{name}_attainment": share.get(name) for name, _ in BOUNDS}}
    summary["slo_tightest_attainment"] = (
        float(judged_attainment(summary, slo.model_dump())) if slo.judge == "percentiles"
        else None)
    return summary


def judged_requests(requests: pd.DataFrame, slo: SloConfig) -> pd.DataFrame:
    """The requests the objectives judge: all, or those of ``slo.priorities``' levels."""
    if slo.priorities is None:
        return requests
    return requests[requests["priority"].isin(slo.priorities)]


def judged_attainment(values: Mapping[str, Any], slo: Mapping[str, Any]) -> Any:
    """The share that ``slo["attainment"]`` is compared with, from a summary (or a table of
    summaries, column by column): of requests in time, or, judged by percentiles, of
    requests within the bound the fewest of them meet."""
    if slo.get("judge", "requests") == "requests":
        return values["slo_attainment"]
    shares = [values[f"slo_{name}_attainment"] for name, _ in BOUNDS
              if slo.get(f"{name}_s") is not None]
    return reduce(np.minimum, shares)


def describe_slo(slo: Mapping[str, Any]) -> str:
    """``TTFT ≤ 1 s, TPOT ≤ 50 ms for 90% of requests``, or judged by percentiles
    ``p99 TTFT ≤ 2 s, p99 TPOT ≤ 200 ms``, from a scenario's ``slo`` section (``of priority
    0 requests`` where it judges only some levels)."""
    attainment = slo.get("attainment", 0.9)
    percentiles = slo.get("judge", "requests") == "percentiles"
    bounds = []
    for name, label in BOUNDS:
        value = slo.get(f"{name}_s")
        if value is not None:
            shown = f"{value * 1000:g} ms" if value < 1 else f"{value:g} s"
            bounds.append(f"p{attainment * 100:g} {label} ≤ {shown}" if percentiles
                          else f"{label} ≤ {shown}")
    levels = slo.get("priorities")
    of = ("requests" if not levels else
          f"priority {', '.join(str(level) for level in levels)} requests")
    if percentiles:
        return ", ".join(bounds) + ("" if not levels else f" of {of}")
    return ", ".join(bounds) + f" for {attainment:.0%} of {of}"


def describe_attainment(share: float, slo: Mapping[str, Any]) -> str:
    """A judged share in words: ``91.0% within SLO``, or ``98.7% within the tightest bound``."""
    if slo.get("judge", "requests") == "percentiles":
        return f"{share:.1%} within the tightest bound"
    return f"{share:.1%} within SLO"
