"""Request traces: synthetic generators and importers of public trace formats."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from workloads.distributions import MAX_TIME_S, draw_priorities
from workloads.importers import TraceImportError, builtin_traces, import_trace
from workloads.spec import MAX_REQUESTS, SyntheticWorkload, TraceWorkload, Workload
from workloads.synthetic import WorkloadError, generate
from workloads.trace import Trace, TraceError

__all__ = [
    "SyntheticWorkload",
    "Trace",
    "TraceError",
    "TraceImportError",
    "TraceWorkload",
    "Workload",
    "WorkloadError",
    "build_trace",
    "builtin_traces",
]


def build_trace(
    workload: SyntheticWorkload | TraceWorkload,
    *,
    seed: int,
    max_model_len: int,
    num_requests: int | None = None,
    duration_s: float | None = None,
    base_dir: Path = Path(),
) -> Trace:
    """The trace a scenario's workload section describes, cut to its stop condition.

    ``num_requests`` keeps the first N requests; ``duration_s`` keeps those arriving before it
    (requests that wait on another keep their place after it). A synthetic open-loop workload
    bounded by duration alone is drawn in growing batches until it passes ``duration_s``.
    """
    if isinstance(workload, TraceWorkload):
        trace = import_trace(workload, base_dir, max_model_len, seed)
    elif num_requests is not None:
        trace = generate(workload, num_requests, seed, max_model_len, base_dir)
    else:
        if duration_s is None:
            raise WorkloadError("a synthetic workload needs stop.num_requests or "
                                "stop.duration_s")
        if workload.arrival.process == "closed_loop":
            raise WorkloadError("a closed_loop workload needs stop.num_requests")
        count = 1024
        while True:
            trace = generate(workload, count, seed, max_model_len, base_dir)
            if trace.arrival_s[-1] > duration_s or count > MAX_REQUESTS:
                break
            count *= 4
    if isinstance(workload, SyntheticWorkload):
        trace.notes.extend(workload.length_notes(base_dir))
    if workload.priorities is not None:
        trace = dataclasses.replace(trace, priority=draw_priorities(
            workload.priorities, trace.session_id, seed))
    if num_requests is not None:
        trace = trace.head(num_requests)
    if duration_s is not None:
        trace = trace.head(int((trace.arrival_s <= duration_s).sum()))
    if len(trace) == 0:
        raise WorkloadError("the stop condition leaves no requests")
    if trace.arrival_s.max() > MAX_TIME_S:
        raise WorkloadError(f"the last request arrives {trace.arrival_s.max():.3g} s in, past "
                            f"{MAX_TIME_S:,.0f} s (31 years), where the simulated clock stops "
                            "resolving steps: give a higher rate, a faster trace speed or "
                            "fewer requests")
    return trace
