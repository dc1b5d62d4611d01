"""The summary metrics as people read them: a label and a format for each.

One list serves every place a run's summary is shown — the table ``kvsim run`` prints, the
report's summary table and the sweep report's results — so a metric reads the same in all.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

SUMMARY_ROWS: list[tuple[str, str, str]] = [
    # (summary key, label, format)
    ("completed", "requests completed", "{:,.0f}"),
    ("rejected", "requests rejected", "{:,.0f}"),
    ("shed", "requests turned away (line full)", "{:,.0f}"),
    ("abandoned", "requests abandoned (client time-out)", "{:,.0f}"),
    ("abandoned_seated", "of them aborted while seated", "{:,.0f}"),
    ("abandoned_output_tokens", "output tokens generated in vain", "{:,.0f}"),
    ("retries", "retries (after a time-out or shed)", "{:,.0f}"),
    ("throughput_tok_s", "output throughput (tok/s)", "{:,.1f}"),
    ("throughput_tok_s_per_gpu", "output throughput per GPU (tok/s)", "{:,.1f}"),
    ("throughput_req_s", "request throughput (req/s)", "{:,.2f}"),
    ("usd_per_million_tokens", "GPU cost per million output tokens (USD)", "{:,.2f}"),
    ("mean_batch", "mean decode batch", "{:,.1f}"),
    ("peak_batch", "peak decode batch", "{:,.0f}"),
    ("mean_draft_tokens", "drafts a decode step verifies (mean K)", "{:,.2f}"),
    ("waiting_at_last_arrival", "queue at last arrival", "{:,.0f}"),
    ("ttft_p50_s", "TTFT p50 (s)", "{:,.3f}"),
    ("ttft_p99_s", "TTFT p99 (s)", "{:,.3f}"),
    ("tpot_p50_s", "TPOT p50 (ms)", "ms"),
    ("itl_p99_s", "ITL p99 (ms)", "ms"),
    ("max_itl_p99_s", "longest token gap p99 (s)", "{:,.3f}"),
    ("e2e_p90_s", "E2E p90 (s)", "{:,.2f}"),
    ("slo_attainment", "requests within SLO", "%"),
    ("slo_tightest_attainment", "requests within tightest bound", "%"),
    ("goodput_req_s", "goodput (req/s within SLO)", "{:,.2f}"),
    ("token_frac", "KV pool holding tokens", "%"),
    ("state_frac", "KV pool holding states (part of tokens)", "%"),
    ("waste_frac", "waste (of memory in use)", "%"),
    ("internal_frac_of_allocated", "internal frag. (of allocated)", "%"),
    ("internal_at_finish_frac", "internal frag. at completion", "%2"),
    ("external_frac", "external frag. (of pool)", "%"),
    ("duplicate_frac", "duplicate prefix slots (of pool)", "%"),
    ("prefix_hit_rate", "prefix-cache hit rate", "%"),
    ("host_hit_rate", "prefix hits from host memory", "%"),
    ("replica_imbalance", "replica imbalance (max/mean requests)", "{:,.2f}"),
    ("rank_wait_frac", "rank time waiting on slower ranks", "%"),
    ("pipeline_bubble_frac", "pipeline stage time idle (bubbles)", "%"),
    ("reserve_holds", "times the decode reserve held the line", "{:,.0f}"),
    ("preemptions", "preemptions", "{:,.0f}"),
    ("swap_preemptions", "preemptions by swap", "{:,.0f}"),
    ("reservation_overflows", "preemptions: outgrew a predicted reservation", "{:,.0f}"),
    ("recomputed_tokens", "recomputed tokens", "{:,.0f}"),
    ("discarded_output_tokens", "output tokens thrown away (forks started over)", "{:,.0f}"),
    ("swapped_out_slots", "KV slots swapped out", "{:,.0f}"),
    ("makespan_s", "makespan (s)", "{:,.1f}"),
    # kvsim capacity --sweep: the search's answer, beside the summary of the run at it.
    ("capacity_req_s", "capacity under SLO (req/s)", "{:,.2f}"),
    ("capacity_req_s_per_gpu", "capacity under SLO per GPU (req/s)", "{:,.2f}"),
]


# Per priority level, where a trace has several: summary key ``priority_L_METRIC``, shown as
# "priority L: LABEL".
PRIORITY_ROWS: list[tuple[str, str, str]] = [
    ("requests", "requests", "{:,.0f}"),
    ("ttft_p50_s", "TTFT p50 (s)", "{:,.3f}"),
    ("ttft_p99_s", "TTFT p99 (s)", "{:,.3f}"),
    ("tpot_p50_s", "TPOT p50 (ms)", "ms"),
    ("max_itl_p99_s", "longest token gap p99 (s)", "{:,.3f}"),
    ("e2e_p90_s", "E2E p90 (s)", "{:,.2f}"),
    ("slo_attainment", "requests within SLO", "%"),
    ("preemptions", "preemptions", "{:,.0f}"),
]
# Of those, the ones a sweep's table shows (it is wide enough already).
PRIORITY_SWEEP_METRICS = ("ttft_p99_s", "slo_attainment")
_PRIORITY_KEY = re.compile(r"priority_(-?\d+)_(\w+)")


def priority_levels(keys: Iterable[str]) -> list[int]:
    """The priority levels that summary keys (or table columns) report on, in order."""
    levels = {int(m.group(1)) for key in keys
              if (m := _PRIORITY_KEY.fullmatch(key)) and m.group(2) == "requests"}
    return sorted(levels)


def metric_row(key: str) -> tuple[str, str, str] | None:
    """(key, label, format) of a summary key, a per-priority one included; None if unknown."""
    for row in SUMMARY_ROWS:
        if row[0] == key:
            return row
    match = _PRIORITY_KEY.fullmatch(key)
    if match:
        for metric, label, fmt in PRIORITY_ROWS:
            if metric == match.group(2):
                return key, f"priority {match.group(1)}: {label}", fmt
    return None


def format_metric(value: Any, fmt: str) -> str:
    """One value in ``fmt`` (a format string, or "%", "%2", "ms"); "—" for none or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if fmt == "%":
        return f"{value * 100:.1f}%"
    if fmt == "%2":
        return f"{value * 100:.2f}%"
    if fmt == "ms":
        return f"{value * 1000:.1f}"
    return fmt.format(value)


# Rows that say nothing on one GPU and one replica, and the summary count that makes them
# worth showing once above 1.
ONLY_WHEN_ABOVE_ONE = {"throughput_tok_s_per_gpu": "gpus", "replica_imbalance": "replicas"}
# Rows of a feature most runs do not use: shown only where some system has a value.
ONLY_WHEN_SET = {"shed", "abandoned", "abandoned_seated", "abandoned_output_tokens", "retries",
                 "host_hit_rate", "state_frac", "slo_attainment", "slo_tightest_attainment",
                 "goodput_req_s", "capacity_req_s", "capacity_req_s_per_gpu", "swap_preemptions",
                 "swapped_out_slots", "reservation_overflows", "usd_per_million_tokens",
                 "mean_draft_tokens", "rank_wait_frac", "pipeline_bubble_frac",
                 "discarded_output_tokens", "reserve_holds"}
# A total and its share per GPU, shown beside it where runs use different numbers of GPUs.
PER_GPU = {"throughput_tok_s": "throughput_tok_s_per_gpu",
           "capacity_req_s": "capacity_req_s_per_gpu"}


def summary_rows(summaries: Iterable[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """The rows of :data:`SUMMARY_ROWS` these summaries need: throughput per GPU only where
    some system runs on more than one GPU (else it repeats the throughput), replica
    imbalance only where some system has several replicas, host-cache hits only where some
    system has a host cache, swaps only where some system preempts by swap, SLO attainment
    and goodput only where the scenario sets objectives; then, where the trace has several
    priority levels, :data:`PRIORITY_ROWS` for each."""
    summaries = list(summaries)

    def needed(key: str) -> bool:
        if key in ONLY_WHEN_ABOVE_ONE:
            return any(s.get(ONLY_WHEN_ABOVE_ONE[key], 1) > 1 for s in summaries)
        if key in ONLY_WHEN_SET:
            return any(s.get(key) is not None for s in summaries)
        return True

    rows = [row for row in SUMMARY_ROWS if needed(row[0])]
    for level in priority_levels(key for s in summaries for key in s):
        for metric, _, _ in PRIORITY_ROWS:
            key = f"priority_{level}_{metric}"
            if any(s.get(key) is not None for s in summaries):
                rows.append(metric_row(key))  # type: ignore[arg-type]
    return rows


def format_summary(summaries: dict[str, dict[str, Any]]) -> str:
    """The side-by-side summary table printed after a run."""
    names = list(summaries)
    rows = summary_rows(summaries.values())
    label_width = max(len(label) for _, label, _ in rows) + 2
    widths = [max(len(n), 12) + 2 for n in names]
    lines = ["".ljust(label_width) + "".join(n.rjust(w) for n, w in zip(names, widths,
                                                                       strict=True))]
    lines.append("-" * len(lines[0]))
    for key, label, fmt in rows:
        cells = [format_metric(summaries[n].get(key), fmt).rjust(w)
                 for n, w in zip(names, widths, strict=True)]
        lines.append(label.ljust(label_width) + "".join(cells))
    return "\n".join(lines)


def format_comparison(runs: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Runs side by side, system by system (``runs``: run label -> system -> summary), in
    the rows :func:`format_summary` prints; with two runs, each system's change from the
    first to the second."""
    labels = list(runs)
    systems = list(dict.fromkeys(name for summaries in runs.values() for name in summaries))
    rows = summary_rows(s for summaries in runs.values() for s in summaries.values())
    # Each column: its header and a cell per row.
    columns: list[tuple[str, list[str]]] = []
    for system in systems:
        found = [runs[label].get(system) for label in labels]
        for label, summary in zip(labels, found, strict=True):
            columns.append((f"{label}: {system}", [
                format_metric(summary.get(key), fmt) if summary is not None else "—"
                for key, _, fmt in rows]))
        if len(labels) == 2:
            first, second = found
            columns.append(("change", [
                _change(first.get(key), second.get(key)) if first and second else "—"
                for key, _, _ in rows]))
    label_width = max(len(label) for _, label, _ in rows) + 2
    widths = [max(len(header), 10) + 2 for header, _ in columns]
    lines = ["".ljust(label_width) + "".join(
        header.rjust(w) for (header, _), w in zip(columns, widths, strict=True))]
    lines.append("-" * len(lines[0]))
    for index, (_, label, _) in enumerate(rows):
        lines.append(label.ljust(label_width) + "".join(
            cells[index].rjust(w) for (_, cells), w in zip(columns, widths, strict=True)))
    return "\n".join(lines)


def _change(first: Any, second: Any) -> str:
    """``second`` against ``first`` in percent ("—" where either is no number, or the
    first is 0 and the second not)."""
    numbers = [v for v in (first, second) if isinstance(v, int | float) and not isinstance(
        v, bool) and not math.isnan(v)]
    if len(numbers) < 2:
        return "—"
    if first == second:
        return "0.0%"
    if first == 0:
        return "—"
    return f"{(second - first) / abs(first) * 100:+.1f}%"


def gpu_counts_differ(table: pd.DataFrame) -> bool:
    """Whether a sweep's runs use different numbers of GPUs (tensor parallelism, replicas);
    results written before GPUs were counted have no such column."""
    return "gpus" in table and table["gpus"].nunique() > 1


def sweep_metrics(table: pd.DataFrame, metrics: Sequence[str]) -> list[str]:
    """``metrics``, each total of :data:`PER_GPU` followed by its share per GPU wherever the
    runs use different numbers of GPUs, since a bigger engine's total says nothing about
    what each GPU sustains; a feature's metrics (:data:`ONLY_WHEN_SET`) only where some run
    has them."""
    shown = [m for m in metrics
             if m not in ONLY_WHEN_SET or (m in table and table[m].notna().any())]
    for level in priority_levels(table.columns):
        shown += [key for metric in PRIORITY_SWEEP_METRICS
                  if (key := f"priority_{level}_{metric}") in table and table[key].notna().any()]
    if gpu_counts_differ(table):
        for total, per_gpu in PER_GPU.items():
            if total in shown:
                shown.insert(shown.index(total) + 1, per_gpu)
    return shown


def labelled_sweep_means(table: pd.DataFrame, metrics: Sequence[str]) -> pd.DataFrame:
    """A sweep's finished runs averaged over seeds, one row per point and system, with
    ``metrics`` (as :func:`sweep_metrics` extends them) labelled and formatted as in a run's
    summary."""
    keys = [c for c in table.columns if c.startswith("param:")] + ["system"]
    done = table[table["status"] == "ok"]
    shown = sweep_metrics(done, metrics)
    # dropna=False: a field swept to null (off) is a row of its own, not dropped.
    means = done.groupby(keys, sort=False, dropna=False)[shown].mean().reset_index()
    return labelled_sweep_table(means, shown)


def labelled_sweep_table(table: pd.DataFrame, metrics: Iterable[str],
                         keep: Sequence[str] = ("system",)) -> pd.DataFrame:
    """Sweep results as people read them: the swept fields without their ``param:`` prefix
    (a null as the sweep file wrote it), the ``keep`` columns, then each metric under its
    summary label in its format."""
    import pandas as pd

    shown = pd.DataFrame({c.removeprefix("param:"): _as_written(table[c])
                          for c in table.columns if c.startswith("param:")})
    for column in keep:
        shown[column] = table[column].to_numpy()
    for metric in (m for m in metrics if m in table):
        _, label, fmt = metric_row(metric)  # type: ignore[misc]
        shown[label] = [format_metric(v, fmt) for v in table[metric]]
    return shown


def _as_written(values: pd.Series) -> list[Any]:
    """A swept number's values as the sweep file gave them: a null, which made the column
    float, as ``null`` (not NaN), and the whole numbers beside it without a ``.0``."""
    if values.dtype.kind != "f" or not values.isna().any():
        return list(values.to_numpy())
    return ["null" if math.isnan(v) else int(v) if float(v).is_integer() else v
            for v in values]
