"""Figures of one run: memory over time, waste breakdown, batch and queue, latency, hits,
and the balance between replicas.

Each function takes a :class:`~sim.results.ScenarioResult` and returns a matplotlib figure
(or None when it has nothing to show); the tables it plotted are attached as
``fig.kvsim_data`` so tests and users can check exactly what is drawn.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from reports.style import (
    TAXONOMY_COLORS,
    TAXONOMY_LABELS,
    inner_legend,
    new_figure,
    system_color,
)
from sim.engine import kv_bytes_per_slot
from sim.memory import TAXONOMY
from sim.presets import GIB
from sim.results import ScenarioResult
from sim.scenario import scenario_from_dict
from sim.slo import latencies


def slot_bytes_and_label(result: ScenarioResult, system: str) -> tuple[float, str]:
    """Bytes of one of ``system``'s pool slots on one GPU (:func:`~sim.engine.kv_bytes_per_slot`),
    and the axis label that says so: under tensor parallelism every GPU holds every token's
    slot, with its share of the KV heads."""
    scenario = scenario_from_dict(result.scenario)
    tp = scenario.parallel.tensor_parallel_size
    label = "KV memory (GiB)" if tp == 1 else f"KV memory per GPU (GiB, 1 of {tp})"
    config = next(s for s in scenario.systems if s.name == system)
    return kv_bytes_per_slot(scenario, config), label


def _shown_replica(result: ScenarioResult, decoding: bool) -> tuple[int, str]:
    """The replica a per-replica figure shows, and the title's note saying so: the first
    one, or under prefill/decode disaggregation, for what decoding holds (batch, memory),
    the first decode replica."""
    runs = result.systems.values()
    replicas = max(run.summary.get("replicas", 1) for run in runs)
    split = max(run.summary.get("prefill_replicas", 0) for run in runs)
    index = split if decoding else 0
    if replicas == 1:
        return index, ""
    role = "" if not split else ", decode" if decoding else ", prefill"
    return index, f" (replica {index}{role})"


def _rows_of(frame: pd.DataFrame, replica: int) -> pd.DataFrame:
    return frame[frame["replica"] == replica] if "replica" in frame else frame


# A figure is about a thousand pixels wide: more points than this add nothing to see, and an
# SVG holding every scheduling point of a long run grows to tens of megabytes.
MAX_PLOTTED_POINTS = 1500


def time_binned(frame: pd.DataFrame, columns: list[str],
                max_points: int = MAX_PLOTTED_POINTS) -> pd.DataFrame:
    """``frame[columns]`` against ``time_s``, read as a step function (each row holds until
    the next), reduced to time-weighted means over ``max_points`` equal time bins when it has
    more rows than that; a last row at the end time closes the final bin for a step plot.
    Means keep sums: binned taxonomy categories still add up to the pool."""
    t = frame["time_s"].to_numpy(dtype=float)
    if len(frame) <= max_points or not t[-1] > t[0]:
        return frame[["time_s", *columns]].reset_index(drop=True)
    edges = np.linspace(t[0], t[-1], max_points + 1)
    row = np.searchsorted(t, edges, side="right") - 1  # the row in force at each edge
    widths = np.diff(edges)
    binned = {"time_s": edges}
    for column in columns:
        values = frame[column].to_numpy(dtype=float)
        integral = np.concatenate([[0.0], np.cumsum(values[:-1] * np.diff(t))])
        at_edges = integral[row] + values[row] * (edges - t[row])
        means = np.diff(at_edges) / widths
        binned[column] = np.append(means, means[-1])
    return pd.DataFrame(binned)


def memory_over_time(result: ScenarioResult) -> Figure:
    """Stacked areas of the taxonomy per system (GiB on the left, % of the pool on the right)."""
    names = list(result.systems)
    fig, axes = new_figure(len(names), 1, height=2.8, sharex=True)
    replica, note = _shown_replica(result, decoding=True)
    data = {}
    for ax, name in zip(axes, names, strict=True):
        run = result.systems[name]
        per_token, gib_label = slot_bytes_and_label(result, name)
        memory = time_binned(_rows_of(run.memory, replica), list(TAXONOMY))
        capacity = run.summary["capacity_slots"]
        gib = memory[list(TAXONOMY)] * per_token / GIB
        data[name] = pd.concat([memory["time_s"], gib], axis=1)
        lower = np.zeros(len(memory))
        t = memory["time_s"].to_numpy()
        for category in TAXONOMY:
            upper = lower + gib[category].to_numpy()
            ax.fill_between(t, lower, upper, step="post", color=TAXONOMY_COLORS[category],
                            label=TAXONOMY_LABELS[category], linewidth=0)
            lower = upper
        ax.set_ylabel(gib_label)
        ax.set_ylim(0, capacity * per_token / GIB)
        ax.set_title(f"{name}: KV pool over time{note}",
                     loc="left", fontsize=10)
        pct = ax.secondary_yaxis("right", functions=(
            lambda g, c=capacity, b=per_token: g * GIB / b / c * 100,
            lambda p, c=capacity, b=per_token: p / 100 * c * b / GIB))
        pct.set_ylabel("% of pool")
    axes[-1].set_xlabel("simulated time (s)")
    # Below the axes: constrained layout does not keep an "outside upper" legend clear of
    # the suptitle, and the two overlapped.
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=3,
               fontsize=8, frameon=False)
    fig.suptitle(f"{result.scenario['name']}: KV memory taxonomy over time", fontsize=11)
    fig.kvsim_data = data  # type: ignore[attr-defined]
    return fig


def waste_breakdown(result: ScenarioResult) -> Figure:
    """Time-averaged share of the pool per category, one bar per system (cf. vLLM Fig. 2)."""
    names = list(result.systems)
    table = pd.DataFrame({c: [result.systems[n].summary[f"{c}_frac"] * 100 for n in names]
                          for c in TAXONOMY}, index=names)
    fig, (ax,) = new_figure(1, 1, height=1.6 + 0.6 * len(names))
    left = np.zeros(len(names))
    for category in TAXONOMY:
        values = table[category].to_numpy()
        ax.barh(names, values, left=left, color=TAXONOMY_COLORS[category],
                label=TAXONOMY_LABELS[category], edgecolor="white", linewidth=0.5)
        for y, (x0, v) in enumerate(zip(left, values, strict=True)):
            if v >= 6:
                ax.text(x0 + v / 2, y, f"{v:.0f}%", ha="center", va="center", fontsize=8,
                        color="white" if category in ("token", "external") else "black")
        left += values
    ax.set_xlim(0, 100)
    ax.set_xlabel("time-averaged share of the KV pool (%)")
    ax.invert_yaxis()
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=3,
               fontsize=8, frameon=False)
    ax.set_title(f"{result.scenario['name']}: where the KV memory goes", loc="left",
                 fontsize=11)
    fig.kvsim_data = {"breakdown_pct": table}  # type: ignore[attr-defined]
    return fig


def _drafts_vary(steps: pd.DataFrame) -> bool:
    """Whether a system's decode steps verified different numbers of drafts (K by batch
    size); run folders from before the column have none."""
    if "draft_tokens" not in steps:
        return False
    return steps.loc[steps["decode_seqs"] > 0, "draft_tokens"].nunique() > 1


def _prefill_first(result: ScenarioResult) -> set[str]:
    """The systems that run SGLang's prefill batches (scheduler.batching: prefill_first)."""
    return {system["name"] for system in result.scenario.get("systems", [])
            if (system.get("scheduler") or {}).get("batching") == "prefill_first"}


def _decode_batch_held(steps: pd.DataFrame) -> pd.DataFrame:
    """``steps`` with each prefill batch (a step that reads prompts and decodes nothing)
    holding the decode batch of the step before it: its requests wait to decode on."""
    prefill_batch = (steps["decode_seqs"] == 0) & (steps["prefill_tokens"] > 0)
    held = steps["decode_seqs"].where(~prefill_batch).ffill().fillna(0)
    return steps.assign(decode_seqs=held)


def batch_and_queue(result: ScenarioResult) -> Figure:
    """Decode batch size and waiting-queue length over time, one line per system; and, where
    a system's drafts go by batch size, the drafts its decode steps verified. A system of
    SGLang's prefill batches shows the batch of its decode steps, held through the prefill
    batches between them (which decode nothing)."""
    dynamic = {name for name, run in result.systems.items() if _drafts_vary(run.steps)}
    prefill_first = _prefill_first(result)
    fig, axes = new_figure(3 if dynamic else 2, 1, height=2.6, sharex=True)
    replica, note = _shown_replica(result, decoding=True)
    data = {}
    for i, (name, run) in enumerate(result.systems.items()):
        columns = ["decode_seqs", "waiting", *(["draft_tokens"] if name in dynamic else [])]
        rows = _rows_of(run.steps, replica)
        if name in prefill_first:
            rows = _decode_batch_held(rows)
        steps = time_binned(rows, columns)
        data[name] = steps
        axes[0].step(steps["time_s"], steps["decode_seqs"], where="post",
                     color=system_color(i), label=name, linewidth=1)
        axes[1].step(steps["time_s"], steps["waiting"], where="post", color=system_color(i),
                     label=name, linewidth=1)
        if name in dynamic:
            axes[2].step(steps["time_s"], steps["draft_tokens"], where="post",
                         color=system_color(i), label=name, linewidth=1)
    axes[0].set_ylabel("decode batch (sequences)")
    axes[1].set_ylabel("waiting requests")
    if dynamic:
        axes[2].set_ylabel("drafts a step verifies (K)")
    axes[-1].set_xlabel("simulated time (s)")
    inner_legend(axes[0])
    axes[0].set_title(f"{result.scenario['name']}: batch size and queue length{note}",
                      loc="left", fontsize=11)
    fig.kvsim_data = data  # type: ignore[attr-defined]
    return fig


def latency_cdfs(result: ScenarioResult) -> Figure:
    """CDFs of TTFT, TPOT, end-to-end latency and each request's longest wait between two
    tokens per system (and per priority level, in line styles, where requests have
    several), with the scenario's SLO bounds where it sets them. TTFT and E2E are of every
    request: one never served (rejected, or given up by its client) never gets there, so the
    curve levels off at the share served; TPOT and the longest gap are of those served that
    generated more than one token."""
    fig, axes = new_figure(1, 4, width=14, height=3.2)
    data: dict[str, pd.DataFrame] = {}
    slo = result.scenario.get("slo") or {}
    # (label, latency, unit scale, SLO key); TPOT and the longest gap only where there is a
    # gap between tokens.
    metrics = [("TTFT (s)", "ttft", 1, "ttft_s"), ("TPOT (ms)", "tpot", 1000, "tpot_s"),
               ("E2E latency (s)", "e2e", 1, "e2e_s"),
               ("longest token gap (s)", "max_itl", 1, "max_itl_s")]
    between = ("tpot", "max_itl")
    measured = {name: latencies(run.requests) for name, run in result.systems.items()}
    for ax, (label, kind, scale, bound) in zip(axes, metrics, strict=True):
        columns = {}
        for i, (name, run) in enumerate(result.systems.items()):
            for line, style, chosen in _priority_lines(name, run.requests):
                values = measured[name][kind] * scale
                if kind in between:
                    chosen = chosen & (run.requests["output_len"].to_numpy() > 1)
                values = np.sort(values[chosen & np.isfinite(values)])
                columns[line] = pd.Series(values)
                of = len(values) if kind in between else int(chosen.sum())
                if len(values):
                    ax.plot(values, np.arange(1, len(values) + 1) / of,
                            color=system_color(i), label=line, linewidth=1.2,
                            linestyle=style)
        if slo.get(bound) is not None:
            ax.axvline(slo[bound] * scale, color="#555555", linestyle=":", linewidth=1.0,
                       label="SLO")
        data[label] = pd.DataFrame(columns)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    inner_legend(axes[0])
    fig.suptitle(f"{result.scenario['name']}: latency distributions", fontsize=11)
    fig.kvsim_data = data  # type: ignore[attr-defined]
    return fig


PRIORITY_LINE_STYLES = ["-", "--", ":", "-."]


def _priority_lines(name: str, requests: pd.DataFrame
                    ) -> list[tuple[str, str, np.ndarray]]:
    """A system's requests as lines: all of them, or, where they have several priority
    levels, one line per level (label, line style, which requests)."""
    everyone = np.ones(len(requests), dtype=bool)
    if "priority" not in requests or requests["priority"].nunique() < 2:
        return [(name, "-", everyone)]
    priority = requests["priority"].to_numpy()
    return [(f"{name}, priority {level}", PRIORITY_LINE_STYLES[rank % 4], priority == level)
            for rank, level in enumerate(np.unique(priority).tolist())]


def hits_and_preemptions(result: ScenarioResult, bins: int = 40) -> Figure:
    """Prefix-cache hit rate per time window and cumulative preemptions, per system."""
    fig, axes = new_figure(2, 1, height=2.6, sharex=True)
    replica, note = _shown_replica(result, decoding=False)
    data = {}
    for i, (name, run) in enumerate(result.systems.items()):
        memory = _rows_of(run.memory, replica)
        if memory.empty:
            continue
        edges = np.linspace(memory["time_s"].min(), memory["time_s"].max() + 1e-9, bins + 1)
        idx = np.searchsorted(memory["time_s"].to_numpy(), edges, side="right") - 1
        idx = np.clip(idx, 0, len(memory) - 1)
        hits = memory["hit_tokens"].to_numpy()[idx]
        lookups = memory["lookup_tokens"].to_numpy()[idx]
        d_hits, d_look = np.diff(hits), np.diff(lookups)
        rate = np.where(d_look > 0, d_hits / np.maximum(d_look, 1) * 100, np.nan)
        centers = (edges[:-1] + edges[1:]) / 2
        data[name] = pd.DataFrame({"time_s": centers, "hit_rate_pct": rate,
                                   "preemptions": memory["preemptions"].to_numpy()[idx][1:]})
        if run.summary.get("prefix_hit_rate") is not None:  # None: no prefix cache to plot
            axes[0].plot(centers, rate, marker="o", markersize=2, color=system_color(i),
                         label=name, linewidth=1)
        axes[1].step(memory["time_s"], memory["preemptions"], where="post",
                     color=system_color(i), label=name, linewidth=1)
    if not axes[0].lines:
        axes[0].text(0.5, 0.5, "no system here has a prefix cache", ha="center",
                     va="center", transform=axes[0].transAxes, fontsize=9, color="0.4")
    axes[0].set_ylabel("prefix hit rate (%)")
    axes[0].set_ylim(0, 100)
    axes[1].set_ylabel("preemptions (cumulative)")
    # A count: whole-number ticks from 0 (with none at all, matplotlib would centre on ±0.04).
    axes[1].set_ylim(bottom=0, top=max(axes[1].get_ylim()[1], 1))
    axes[1].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[1].set_xlabel("simulated time (s)")
    inner_legend(axes[1])
    axes[0].set_title(f"{result.scenario['name']}: prefix-cache hits and preemptions{note}",
                      loc="left", fontsize=11)
    fig.kvsim_data = data  # type: ignore[attr-defined]
    return fig


def replica_balance(result: ScenarioResult) -> Figure | None:
    """Per replica: requests served, TTFT p50 and prefix hit rate, bars grouped by system —
    what a router trades (None when every system runs one replica). Under prefill/decode
    disaggregation TTFT and hits belong to prefill replicas, served requests to both."""
    systems = {n: r for n, r in result.systems.items() if r.summary.get("replicas", 1) > 1}
    if not systems:
        return None
    fig, axes = new_figure(1, 3, width=11, height=3.2)
    rows = []
    for name, run in systems.items():
        requests = run.requests
        served = requests[~requests["rejected"]]
        if "shed" in served:  # (a run folder written before lines were bounded)
            served = served[~served["shed"]]
        if "abandoned_s" in served:  # (a run folder written before clients could give up)
            served = served[served["abandoned_s"].isna()]
        ttft = served["first_token_s"] - served["arrival_s"]
        # Each replica's running totals of prompt tokens looked up and hit, at its last sample
        # (every admission counts, re-admissions after a preemption too).
        totals = run.memory.groupby("replica")[["hit_tokens", "lookup_tokens"]].last()
        for replica in range(run.summary["replicas"]):
            mine = served["replica"] == replica  # routed here: its prompt was read here
            # Under disaggregation a decode replica serves what prefill replicas hand over.
            handled = mine | (served["decode_replica"] == replica if "decode_replica" in served
                              else False)
            hit, lookup = (totals.loc[replica] if replica in totals.index else (0, 0))
            rows.append({"system": name, "replica": replica, "requests": int(handled.sum()),
                         "ttft_p50_s": float(ttft[mine].median()) if mine.any() else np.nan,
                         "hit_rate_pct": hit / lookup * 100 if lookup else np.nan})
    data = pd.DataFrame(rows)
    width = 0.8 / len(systems)
    panels = [("requests", "requests served"), ("ttft_p50_s", "TTFT p50 (s)"),
              ("hit_rate_pct", "prefix hit rate (% of prompt tokens)")]
    for ax, (column, label) in zip(axes, panels, strict=True):
        for i, (name, part) in enumerate(data.groupby("system", sort=False)):
            ax.bar(part["replica"] + (i - (len(systems) - 1) / 2) * width, part[column],
                   width=width, color=system_color(list(result.systems).index(name)),
                   label=name)
        ax.set_xlabel("replica")
        ax.set_ylabel(label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3, axis="y")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center",
               ncols=len(systems), fontsize=8, frameon=False)
    fig.suptitle(f"{result.scenario['name']}: load and cache hits per replica", fontsize=11)
    fig.kvsim_data = data  # type: ignore[attr-defined]
    return fig


# Figures of a run folder, in report order; a builder returns None when it has nothing to show.
RUN_FIGURES: dict[str, Callable[[ScenarioResult], Figure | None]] = {
    "memory_over_time": memory_over_time,
    "waste_breakdown": waste_breakdown,
    "batch_and_queue": batch_and_queue,
    "latency_cdfs": latency_cdfs,
    "hits_and_preemptions": hits_and_preemptions,
    "replica_balance": replica_balance,
}
