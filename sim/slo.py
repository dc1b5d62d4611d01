"""Service-level objectives: which requests were served in time, and the goodput they make.

A serving system is judged like a delivery service: not by parcels moved per hour, but by
parcels delivered *on time*. Each request is checked against the scenario's bounds
(:class:`sim.scenario.SloConfig`): time to first token, time per output token after it, and
end to end. The share of requests that meet all of them is the *attainment*; the rate at
which they complete is the *goodput* (vLLM's ``benchmark_serving --goodput``). A request
that was turned away, or never finished, was not on time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from sim.scenario import SloConfig

# Summary keys, None where the scenario sets no objectives (shown "—", like a hit rate
# without a prefix cache), so every run's summary has the same keys.
SLO_KEYS = ("slo_attainment", "goodput_req_s", "slo_ttft_attainment", "slo_tpot_attainment",
            "slo_e2e_attainment")


def latencies(requests: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per-request TTFT, TPOT and E2E latency in seconds (NaN where the request never got
    there; TPOT 0 for a single output token, which has no gap to miss)."""
    arrival = requests["arrival_s"].to_numpy(dtype=float)
    # Times not reached are NaN in a run's table, -1 in the summary's copy of it.
    first, finished = (np.where(times >= 0, times, np.nan) for times in (
        requests["first_token_s"].to_numpy(dtype=float),
        requests["finished_s"].to_numpy(dtype=float)))
    gaps = requests["output_len"].to_numpy(dtype=float) - 1
    tpot = np.where(gaps > 0, (finished - first) / np.maximum(gaps, 1), 0.0)
    tpot[np.isnan(finished)] = np.nan
    return {"ttft": first - arrival, "tpot": tpot, "e2e": finished - arrival}


def in_time(requests: pd.DataFrame, slo: SloConfig) -> dict[str, np.ndarray]:
    """For each bound the scenario gives, whether each request met it (NaN compares False,
    so unfinished and rejected requests miss), and ``"all"``: whether it met every one."""
    measured = latencies(requests)
    met = {name: measured[name] <= bound
           for name, bound in (("ttft", slo.ttft_s), ("tpot", slo.tpot_s), ("e2e", slo.e2e_s))
           if bound is not None}
    met["all"] = np.logical_and.reduce(list(met.values()))
    return met


def slo_summary(requests: pd.DataFrame, makespan_s: float, slo: SloConfig | None
                ) -> dict[str, Any]:
    """The summary's SLO metrics: attainment (of all requests, rejected ones included),
    goodput in requests per second, and the attainment of each bound alone, which tells
    which one a system misses."""
    if slo is None:
        return dict.fromkeys(SLO_KEYS)
    met = in_time(requests, slo)
    count = max(len(requests), 1)
    share = {name: float(flags.sum()) / count for name, flags in met.items()}
    return {"slo_attainment": share["all"],
            "goodput_req_s": float(met["all"].sum()) / makespan_s,
            **{f"slo_{name}_attainment": share.get(name) for name in ("ttft", "tpot", "e2e")}}
