"""What a run leaves behind: tables per system, a summary, and a run folder on disk.

Layout of a run folder::

    RUN/scenario.yaml            the resolved scenario (every default filled in)
    RUN/summary.json             {system name: summary metrics}, the trace's notes, and
                                 the kvsim that made them (``sim.provenance``)
    RUN/SYSTEM/requests.parquet  one row per request
    RUN/SYSTEM/memory.parquet    the memory taxonomy over time (slots)
    RUN/SYSTEM/steps.parquet     one row per scheduling point (a jump covers several steps)

Files are written to a temporary name and renamed, so a killed run never leaves a torn file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import yaml

from sim import provenance
from sim.memory import TAXONOMY, MemorySnapshot, final_kv_tokens
from sim.scenario import MAX_REPLICAS
from sim.slo import in_time, latencies, slo_summary

if TYPE_CHECKING:
    from sim.scenario import SloConfig

LATENCY_PERCENTILES = (50, 90, 99)

# The columns of a system's tables, in their order: the engine writes these, and a folder
# read back must have them (a table edited, or written by another kvsim, is refused by name).
REQUEST_COLUMNS = (
    "request", "arrival_s", "admitted_s", "first_token_s", "finished_s", "prompt_len",
    "output_len", "n", "priority", "preemptions", "prefix_hit_tokens", "recomputed_tokens",
    "rejected", "shed", "abandoned_s", "attempts", "replica", "allocated_at_finish",
    "max_itl_s")
HANDOVER_COLUMNS = ("decode_replica",)  # requests, past a prefill/decode split
MEMORY_COLUMNS = MemorySnapshot._fields  # the taxonomy, then duplicate
MEMORY_TABLE_COLUMNS = ("replica", "time_s", *MEMORY_COLUMNS, "running", "waiting",
                        "decode_seqs", "preemptions", "hit_tokens", "lookup_tokens")
STEP_COLUMNS = ("replica", "time_s", "duration_s", "steps", "decode_seqs", "draft_tokens",
                "context_tokens", "prefill_tokens", "prefill_requests", "loaded_tokens",
                "swapped_slots", "preempted", "running", "waiting")
TABLE_COLUMNS = {"requests": REQUEST_COLUMNS, "memory": MEMORY_TABLE_COLUMNS,
                 "steps": STEP_COLUMNS}


@dataclass
class RunResult:
    """One system's results on one trace."""

    system: str
    requests: pd.DataFrame
    memory: pd.DataFrame
    steps: pd.DataFrame
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass
class ScenarioResult:
    """Every system of a scenario, on the same trace."""

    scenario: dict[str, Any]
    systems: dict[str, RunResult]
    trace_notes: list[str] = field(default_factory=list)
    # The kvsim that computed it (None: a folder written before kvsim kept it).
    made_by: dict[str, str] | None = field(default_factory=provenance.made_by)

    def summary_frame(self) -> pd.DataFrame:
        """One column per system, one row per summary metric."""
        return pd.DataFrame({name: r.summary for name, r in self.systems.items()})


def _percentiles(values: np.ndarray, name: str) -> dict[str, float]:
    values = values[np.isfinite(values)]
    out = {}
    for p in LATENCY_PERCENTILES:
        out[f"{name}_p{p}_s"] = float(np.percentile(values, p)) if len(values) else math.nan
    return out


def token_wait_summary(waits_us: dict[int, int]) -> dict[str, float]:
    """ITL as vLLM's benchmark reports it, from every token received after another (counts
    by the wait in microseconds): the mean and the percentiles, each the shortest wait that
    many of the tokens waited at most (NaN without any)."""
    if not waits_us:
        return {"itl_mean_s": math.nan,
                **{f"itl_p{p}_s": math.nan for p in LATENCY_PERCENTILES}}
    keys = np.array(sorted(waits_us), dtype=np.int64)
    counts = np.array([waits_us[key] for key in keys.tolist()], dtype=np.int64)
    cumulative = np.cumsum(counts)
    total = int(cumulative[-1])
    out = {"itl_mean_s": float((keys * counts).sum()) / total / 1e6}
    for p in LATENCY_PERCENTILES:
        rank = max(1, math.ceil(p / 100 * total))  # nearest rank
        out[f"itl_p{p}_s"] = int(keys[np.searchsorted(cumulative, rank)]) / 1e6
    return out


def _waiting_at(requests: pd.DataFrame, time_s: float) -> int:
    """Requests arrived by ``time_s`` and not yet seated (every replica's; not those turned
    away on arrival, rejected or shed, nor those their clients had given up by then): how
    far arrivals had outrun the server when they stopped. (From the requests' own times, so
    a run of decode steps advanced at once counts the arrivals within it as stepping
    does.)"""
    return int(((requests["arrival_s"] <= time_s) & ~(requests["admitted_s"] <= time_s)
                & ~requests["rejected"] & ~requests["shed"]
                & ~(requests["abandoned_s"] <= time_s)).sum())


def summarize(requests: pd.DataFrame, steps: pd.DataFrame, averages: dict[str, float],
              capacity_slots: int, extra: dict[str, Any], slo: SloConfig | None = None
              ) -> dict[str, Any]:
    """Summary metrics of one system's run (see the README's metric table), with the
    SLO metrics of :mod:`sim.slo` where the scenario sets objectives."""
    done = requests[requests["finished_s"] >= 0]
    start = float(requests["arrival_s"].min()) if len(requests) else 0.0
    end = float(done["finished_s"].max()) if len(done) else start
    makespan = max(end - start, 1e-12)
    generated = float((done["output_len"] * done["n"]).sum())
    prompt = float(done["prompt_len"].sum())
    measured = latencies(done)
    # One output token has no gap between tokens: no TPOT to report.
    tpot = measured["tpot"][done["output_len"].to_numpy() > 1]
    step_count = float(steps["steps"].sum()) if len(steps) else 0.0
    batch_mean = float((steps["decode_seqs"] * steps["steps"]).sum() / step_count) if (
        step_count) else 0.0
    used = sum(averages[c] for c in ("token", "reserved", "internal", "external"))
    allocated = sum(averages[c] for c in ("token", "reserved", "internal"))
    finish_alloc = float(done["allocated_at_finish"].sum())
    finish_used = float((final_kv_tokens(done["prompt_len"], done["output_len"])
                         * done["n"]).sum())
    # None (shown "—") where there is no prefix cache: 0 % would read as a cache that missed.
    # First admissions only; a preempted request's own blocks found again are apart (None
    # where nothing was preempted and looked up again).
    hit_rate = preempted_hit_rate = None
    if extra["prefix_caching"]:
        lookups = extra["lookup_tokens"]
        hit_rate = extra["hit_tokens"] / lookups if lookups else 0.0
        again = extra["preempted_lookup_tokens"]
        preempted_hit_rate = extra["preempted_hit_tokens"] / again if again else None
    summary: dict[str, Any] = {
        "requests": len(requests),
        "completed": len(done),
        "rejected": int(requests["rejected"].sum()),
        "makespan_s": makespan,
        "throughput_tok_s": generated / makespan,
        "throughput_tok_s_per_gpu": generated / makespan / extra["gpus"],
        # The GPUs' price over the output tokens they served (None: no cost section).
        "usd_per_million_tokens": (
            extra["gpus"] * extra["usd_per_gpu_hour"] / 3600 * makespan / generated * 1e6
            if extra["usd_per_gpu_hour"] and generated else None),
        "total_tok_s": (generated + prompt) / makespan,
        "throughput_req_s": len(done) / makespan,
        **_percentiles(measured["ttft"], "ttft"),
        **_percentiles(tpot, "tpot"),
        **_percentiles(measured["e2e"], "e2e"),
        # Each request's longest wait between two of its tokens: a preemption's (the line
        # and the recompute), a handover's, a long step's.
        **_percentiles(done["max_itl_s"].to_numpy(dtype=float), "max_itl"),
        "mean_batch": batch_mean,
        "peak_batch": int(steps["decode_seqs"].max()) if len(steps) else 0,
        "mean_running": float(averages["running"]),
        "peak_running": int(steps["running"].max()) if len(steps) else 0,
        **{f"{c}_frac": averages[c] / capacity_slots for c in TAXONOMY},
        "duplicate_frac": averages["duplicate"] / capacity_slots,
        # A state-space hybrid's states, one a running sequence (None: no state layers).
        "state_frac": (averages["running"] * extra["state_slots_per_sequence"]
                       / capacity_slots if extra["state_slots_per_sequence"] else None),
        "waste_frac": (used - averages["token"]) / used if used else 0.0,
        "internal_frac_of_allocated": averages["internal"] / allocated if allocated else 0.0,
        "internal_at_finish_frac": (finish_alloc - finish_used) / finish_alloc if (
            finish_alloc) else 0.0,
        "prefix_hit_rate": hit_rate,
        "preempted_hit_rate": preempted_hit_rate,
        "waiting_at_last_arrival": _waiting_at(requests, float(requests["arrival_s"].max())
                                               if len(requests) else 0.0),
        "preemptions": int(requests["preemptions"].sum()),
        "recomputed_tokens": int(requests["recomputed_tokens"].sum()),
        "steps": int(step_count),
        "capacity_slots": capacity_slots,
        **slo_summary(requests, makespan, slo),
        **_by_priority(requests, makespan, slo),
    }
    summary.update({k: v for k, v in extra.items()
                    if k not in ("hit_tokens", "lookup_tokens", "preempted_hit_tokens",
                                 "preempted_lookup_tokens", "prefix_caching",
                                 "usd_per_gpu_hour", "state_slots_per_sequence")})
    return summary


def _by_priority(requests: pd.DataFrame, makespan_s: float, slo: SloConfig | None
                 ) -> dict[str, Any]:
    """Per priority level, where the trace has several (``priority_L_METRIC`` keys): the
    requests, their latency percentiles, preemptions and SLO attainment, which tell what a
    priority policy buys one class and costs another."""
    if "priority" not in requests or requests["priority"].nunique() < 2:
        return {}
    out: dict[str, Any] = {}
    for level, part in requests.groupby("priority", sort=True):
        done = part[part["finished_s"] >= 0]
        measured = latencies(done)
        tpot = measured["tpot"][done["output_len"].to_numpy() > 1]
        key = f"priority_{level}_"
        out[key + "requests"] = len(part)
        out.update({key + k: v for k, v in {
            **_percentiles(measured["ttft"], "ttft"), **_percentiles(tpot, "tpot"),
            **_percentiles(measured["e2e"], "e2e"),
            **_percentiles(done["max_itl_s"].to_numpy(dtype=float), "max_itl")}.items()})
        out[key + "preemptions"] = int(part["preemptions"].sum())
        if slo is not None:  # every level against the bounds, judged by them or not
            out[key + "slo_attainment"] = float(in_time(part, slo)["all"].mean())
    return out


SATURATED_WAITING_FRAC = 0.05  # of the requests, still queued when the last one arrived


def saturation_note(summaries: dict[str, dict[str, Any]]) -> str | None:
    """A warning when arrivals outran a system: its queue was still long when they stopped,
    so its throughput is its capacity and its TTFT and E2E latency are mostly queueing."""
    saturated = {name: s for name, s in summaries.items()
                 if (s.get("waiting_at_last_arrival") or 0)
                 >= max(10, SATURATED_WAITING_FRAC * s.get("requests", 0))}
    if not saturated:
        return None
    queues = ", ".join(f"{name} {s['waiting_at_last_arrival']:,}"
                       for name, s in saturated.items())
    return (f"saturated: requests still waiting at the last arrival: {queues}; the offered "
            "load exceeds what "
            + ("this system sustains" if len(saturated) == 1 else "these systems sustain")
            + ", so throughput is capacity and TTFT/E2E are mostly queueing")


def _unserved(summaries: dict[str, dict[str, Any]], key: str) -> str | None:
    """``"NAME COUNT of REQUESTS, ..."`` for each system with requests unserved by ``key``
    (``rejected``, ``shed``, ``abandoned``), or None where none has any."""
    counts = [f"{name} {s[key]:,} of {s['requests']:,}" for name, s in summaries.items()
              if s.get(key)]
    return ", ".join(counts) if counts else None


def rejection_note(summaries: dict[str, dict[str, Any]]) -> str | None:
    """A warning when a system turned requests away because they could never fit its pool
    (all of a request's samples at their reservation, in an empty pool; under SGLang's
    admission, a prompt with the max_tokens it keeps room for)."""
    counts = _unserved(summaries, "rejected")
    if counts is None:
        return None
    reserving = any(s.get("reserve_holds") is not None for s in summaries.values())
    return (f"rejected as larger than the whole KV pool: {counts}"
            + (" (under scheduler.admission: new_token_ratio, a prompt with the max_tokens "
               "it keeps room for, at most 4,096)" if reserving else "")
            + "; throughput and latency count only the requests that were served")


def shedding_note(summaries: dict[str, dict[str, Any]]) -> str | None:
    """A warning when a bounded waiting line (``scheduler.max_queued_requests``) turned
    requests away on arrival."""
    counts = _unserved(summaries, "shed")
    if counts is None:
        return None
    retried = any(s.get("retries") is not None for s in summaries.values())
    return ("turned away by a full waiting line" + (" (at their last try)" if retried else "")
            + f": {counts}; they count against the SLO, while throughput and latency "
            "percentiles are of the requests served")


def restart_note(summaries: dict[str, dict[str, Any]]) -> str | None:
    """A hint when preempted groups of forked samples started over, their answers thrown
    away (``discarded_output_tokens``): what keeps them instead."""
    thrown = {name: s for name, s in summaries.items() if s.get("discarded_output_tokens")}
    if not thrown:
        return None
    swapping = {name for name, s in thrown.items() if s.get("swap_preemptions") is not None}
    counts = ", ".join(f"{name} {s['discarded_output_tokens']:,}"
                       + (" (its swap space full)" if name in swapping else "")
                       for name, s in thrown.items())
    note = ("preempted groups of forked samples started over, their answers thrown away and "
            f"generated again (output tokens): {counts}")
    if len(swapping) < len(thrown):
        note += ("; scheduler.preemption_mode: swap_groups swaps a group whole instead (vLLM "
                 "v0's default), and parallel_sampling: fan_out preempts samples alone "
                 "(vLLM v1)")
    return note


def abandonment_note(summaries: dict[str, dict[str, Any]]) -> str | None:
    """A warning when clients gave up on requests that waited too long for a seat, a first
    token, the whole answer or a next token (``workload.queue_timeout_s``,
    ``ttft_timeout_s``, ``e2e_timeout_s``, ``itl_timeout_s``): the latencies are of the
    requests served, and the work done for those aborted while seated was lost."""
    counts = _unserved(summaries, "abandoned")
    if counts is None:
        return None
    retried = any(s.get("retries") is not None for s in summaries.values())
    seated = ", ".join(f"{name} {s['abandoned_seated']:,}" for name, s in summaries.items()
                       if s.get("abandoned_seated"))
    tokens = ", ".join(f"{name} {s['abandoned_output_tokens']:,}"
                       for name, s in summaries.items() if s.get("abandoned_output_tokens"))
    return ("abandoned by clients who timed out" + (" (at their last try)" if retried else "")
            + f": {counts}"
            + (f", of them aborted while seated, their prompts read in vain: {seated}"
               if seated else "")
            + (f", output tokens generated in vain: {tokens}" if tokens else "")
            + "; they count against the SLO, while throughput and latency percentiles are "
            "of the requests served")


def run_notes(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """The warnings a reader of a run's summary needs: saturation, rejections, requests
    shed and abandonments, fork groups that started over; and the drafts by batch size that
    an auto schedule chose."""
    notes = (saturation_note(summaries), rejection_note(summaries), shedding_note(summaries),
             abandonment_note(summaries), restart_note(summaries), *schedule_notes(summaries))
    return [note for note in notes if note]


def schedule_notes(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """For each system whose speculative decoding chose its K by batch size (``auto``): the
    schedule, as vLLM's ``num_speculative_tokens_per_batch_size`` takes it."""
    return [f"system {name!r} chose num_speculative_tokens_per_batch_size: "
            f"{summary['draft_schedule']} ([bs_lo, bs_hi, K]: K drafts after a step of bs_lo "
            "to bs_hi requests)"
            for name, summary in summaries.items() if summary.get("draft_schedule")]


def _atomic_write(path: Path, write) -> None:  # type: ignore[no-untyped-def]
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def write_table(frame: pd.DataFrame, path: Path) -> Path:
    """Parquet (pyarrow), or CSV if pyarrow is missing; written atomically."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        path = path.with_suffix(".csv")
        _atomic_write(path, lambda p: frame.to_csv(p, index=False))
        return path
    _atomic_write(path, lambda p: frame.to_parquet(p, index=False))
    return path


def read_table(path: Path) -> pd.DataFrame:
    """Read a table written by :func:`write_table` (either suffix)."""
    if path.exists():
        return pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    csv = path.with_suffix(".csv")
    if not csv.exists():
        raise FileNotFoundError(path)
    return pd.read_csv(csv)


class RunFolderError(ValueError):
    """A run or sweep folder that cannot be read back: a file missing or damaged."""


def read_back(folder: Path, relative: str, reader: Callable[[Path], Any]) -> Any:
    """``reader(folder / relative)``, with a one-line :class:`RunFolderError` naming the file
    when it is missing or cannot be parsed."""
    path = folder / relative
    try:
        return reader(path)
    except FileNotFoundError:
        raise RunFolderError(f"{folder}: {relative} is missing; rerun kvsim run or kvsim "
                             "sweep to rebuild it") from None
    except KeyError as exc:
        raise RunFolderError(f"{path}: cannot be read back (no {exc.args[0]!r} field)") from None
    except (ValueError, TypeError, OSError, yaml.YAMLError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RunFolderError(f"{path}: cannot be read back ({detail})") from None


def write_yaml(data: Any, path: Path) -> None:
    """``data`` as YAML in its own order (a resolved scenario reads as its file does)."""
    _atomic_write(path, lambda p: p.write_text(yaml.safe_dump(data, sort_keys=False)))


def write_json(data: Any, path: Path) -> None:
    _atomic_write(path, lambda p: p.write_text(json.dumps(data, indent=2, sort_keys=True,
                                                          allow_nan=True) + "\n"))


class OutputFolderError(ValueError):
    """An output folder that cannot be made: a file in the way, no permission."""


def make_output_folder(path: Path) -> Path:
    """Create ``path`` (and its parents) for results, or say in one line why it cannot be.

    Commands call it before any simulation, so that a bad ``--out`` costs no work."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputFolderError(f"{path}: expected an output folder, but a file is in the "
                                "way") from None
    except OSError as exc:
        raise OutputFolderError(f"{path}: cannot create the output folder "
                                f"({exc.strerror or exc})") from None
    return path


def write_run(result: ScenarioResult, out_dir: Path) -> Path:
    """Write a run folder (layout in the module docstring)."""
    make_output_folder(out_dir)
    write_yaml(result.scenario, out_dir / "scenario.yaml")
    for name, run in result.systems.items():
        folder = out_dir / _safe_name(name)
        folder.mkdir(exist_ok=True)
        write_table(run.requests, folder / "requests.parquet")
        write_table(run.memory, folder / "memory.parquet")
        write_table(run.steps, folder / "steps.parquet")
    write_json({"systems": {n: r.summary for n, r in result.systems.items()},
                "trace_notes": result.trace_notes, "made_by": result.made_by},
               out_dir / "summary.json")
    return out_dir


@dataclass(frozen=True)
class SummaryFile:
    """A run folder's summary.json, read back and checked."""

    systems: dict[str, dict[str, Any]]  # summary metrics per system
    trace_notes: list[str]
    made_by: dict[str, str] | None  # None: written by a kvsim from before it was kept


def read_summary_file(out_dir: Path) -> SummaryFile:
    """A run folder's summary.json (a one-line :class:`RunFolderError` where it is wrong)."""
    summary: SummaryFile = read_back(out_dir, "summary.json", _read_summary)
    return summary


def swept_value_text(value: Any) -> str:
    """A swept value as the sweep file writes it: ``null`` for one left unset (None, or NaN
    in a column of numbers), ``true``/``false``, ``4`` for 4.0 (a whole number the column
    widened to float beside a null)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "null"
    if isinstance(value, bool | np.bool_):
        return "true" if value else "false"
    if isinstance(value, float | np.floating) and float(value).is_integer():
        return str(int(value))
    return str(value)


# What names a run rather than sets it up: no setting that tells two runs apart.
_NAMING_FIELDS = ("name", "description", "output_dir", "sweep")


def scenario_differences(first: Any, other: Any) -> list[str]:
    """The settings in which resolved scenario ``other`` differs from ``first``, each as a
    sweep path with both values ("systems[paged].scheduler.max_num_seqs: 256 → 64"),
    systems matched by name, in the order the scenario gives them."""
    def setting(value: Any) -> str:
        if isinstance(value, dict | list):
            return json.dumps(value, separators=(", ", ": "))
        return swept_value_text(value)

    def by_name(systems: Any) -> dict[str, Any] | None:
        named = isinstance(systems, list) and all(isinstance(s, dict) and "name" in s
                                                  for s in systems)
        return {str(s["name"]): s for s in systems} if named else None

    differences: list[str] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in dict.fromkeys([*a, *b]):
                if not path and key in _NAMING_FIELDS:
                    continue
                walk(a.get(key), b.get(key), f"{path}.{key}" if path else str(key))
            return
        systems_a, systems_b = (by_name(a), by_name(b)) if path == "systems" else (None, None)
        if systems_a is not None and systems_b is not None:
            for name in dict.fromkeys([*systems_a, *systems_b]):
                if name not in systems_b or name not in systems_a:
                    whose = "first" if name in systems_a else "second"
                    differences.append(f"systems[{name}]: only in the {whose}")
                else:
                    walk(systems_a[name], systems_b[name], f"systems[{name}]")
            return
        if a != b:
            differences.append(f"{path}: {setting(a)} → {setting(b)}")

    walk(first, other, "")
    return differences


def load_scenario_copy(out_dir: Path) -> dict[str, Any] | None:
    """The resolved scenario a run folder keeps (scenario.yaml), or None where it has none
    (a folder written before it did)."""
    return read_scenario(out_dir) if (out_dir / "scenario.yaml").is_file() else None


def sweep_run_label(out_dir: Path) -> str | None:
    """The swept values of a sweep's run folder (``SWEEP/runs/KEY``), as
    "max_model_len=4096, seed 0"; None for a folder no sweep's table lists."""
    results = out_dir.parent.parent / "results.parquet"
    if out_dir.parent.name != "runs" or not results.is_file():
        return None
    table = read_back(out_dir.parent.parent, "results.parquet", read_table)
    rows = table[table["key"] == out_dir.name]
    if rows.empty:
        return None
    row = rows.iloc[0]
    values = [f"{column.removeprefix('param:')}={swept_value_text(row[column])}"
              for column in table.columns if column.startswith("param:")]
    return ", ".join([*values, f"seed {row['seed']}"])


def read_scenario(folder: Path) -> dict[str, Any]:
    """The resolved scenario a run or capacity folder keeps (``scenario.yaml``)."""
    def mapping(path: Path) -> dict[str, Any]:
        data = yaml.safe_load(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("expected a mapping of scenario fields")
        return data

    return read_back(folder, "scenario.yaml", mapping)


def load_run(out_dir: Path) -> ScenarioResult:
    """Read a run folder back (the inverse of :func:`write_run`)."""
    summary = read_summary_file(out_dir)
    summaries = summary.systems
    scenario = read_scenario(out_dir)
    listed = scenario.get("systems")
    named = [str(s.get("name")) for s in listed if isinstance(s, dict)] if isinstance(
        listed, list) else []
    if sorted(named) != sorted(summaries):
        raise RunFolderError(f"{out_dir / 'scenario.yaml'}: its systems ({', '.join(named)}) "
                             f"are not those of summary.json ({', '.join(summaries)}); rerun "
                             "kvsim run to rebuild the folder")
    systems = {}
    for name, metrics in summaries.items():
        folder = _safe_name(name)
        tables = {table: read_back(out_dir, f"{folder}/{table}.parquet",
                                   partial(_read_system_table, table=table))
                  for table in TABLE_COLUMNS}
        systems[name] = RunResult(system=name, summary=metrics, **tables)
    return ScenarioResult(scenario=scenario, systems=systems, trace_notes=summary.trace_notes,
                          made_by=summary.made_by)


def _read_system_table(path: Path, table: str) -> pd.DataFrame:
    """One of a system's tables, checked to have every column kvsim writes in it."""
    frame = read_table(path)
    missing = [column for column in TABLE_COLUMNS[table] if column not in frame.columns]
    if missing:
        raise ValueError(f"no {', '.join(map(repr, missing))} column{'s' * (len(missing) > 1)}"
                         "; a table of another kvsim version, or edited: rerun kvsim run to "
                         "rebuild it")
    return frame


# The summary metrics held as text (a JSON list); every other one is a number or null.
TEXT_METRICS = frozenset({"draft_schedule"})
# Metrics every run gives a number (what the memory taxonomy splits, and the run's shape),
# which the report reckons with: null there is damage, not "none" as for a hit rate.
TAXONOMY_FRACTIONS = frozenset(f"{category}_frac" for category in TAXONOMY)
# Counts of the run's shape: the least and the most each can be (replicas as many as a
# scenario may ask for; else a float's whole numbers).
COUNT_METRICS = {"replicas": (1, MAX_REPLICAS), "prefill_replicas": (0, MAX_REPLICAS),
                 "gpus": (1, 2**53), "capacity_slots": (1, 2**53), "requests": (0, 2**53)}
NEVER_NULL_METRICS = TAXONOMY_FRACTIONS | set(COUNT_METRICS)


class ReadSummary(dict[str, Any]):
    """One system's summary metrics as read back from a summary.json: a metric it lacks (a
    folder written by another kvsim version, or edited) is asked for in a one-line
    :class:`RunFolderError` that names the file and the metric, not a KeyError."""

    def __init__(self, metrics: dict[str, Any], path: Path, system: str) -> None:
        super().__init__(metrics)
        self.path = path
        self.system = system

    def __missing__(self, key: str) -> Any:
        raise RunFolderError(f"{self.path}: system {self.system!r} has no {key!r} metric (a "
                             "folder of another kvsim version, or edited); rerun kvsim run "
                             "to rebuild it")


def check_metrics(metrics: dict[str, Any], where: str) -> None:
    """Raise a one-line ValueError (naming ``where``.KEY) unless every metric of a system's
    summary read back from a file is a number (text where it is text) or null, in its
    range."""
    for key, value in metrics.items():
        text = key in TEXT_METRICS
        kind_ok = isinstance(value, str) if text else (
            isinstance(value, int | float) and not isinstance(value, bool))
        if value is None and key in NEVER_NULL_METRICS:
            raise ValueError(f"{where}.{key}: expected a number, got null")
        if key in TAXONOMY_FRACTIONS and kind_ok and not 0 <= value <= 1 + 1e-9:
            raise ValueError(f"{where}.{key}: expected a share from 0 to 1, got {value!r}")
        if key in COUNT_METRICS and kind_ok:
            least, most = COUNT_METRICS[key]
            if not (isinstance(value, int) and least <= value <= most):
                raise ValueError(f"{where}.{key}: expected a whole number from {least} to "
                                 f"{most:,}, got {value!r}")
        if value is not None and not kind_ok:
            raise ValueError(f"{where}.{key}: expected {'text' if text else 'a number'} or "
                             f"null, got {value!r}")


def _read_summary(path: Path) -> SummaryFile:
    """A run's summary.json, every metric checked to be a number or null (an edited or
    damaged file is refused where it is wrong)."""
    data = json.loads(path.read_text())
    systems = data["systems"] if isinstance(data, dict) else None
    if not isinstance(systems, dict) or not all(
            isinstance(metrics, dict) for metrics in systems.values()):
        raise ValueError('expected {"systems": {system name: {metric: value, ...}}}')
    for system, metrics in systems.items():
        check_metrics(metrics, f"systems.{system}")
    notes = data.get("trace_notes", [])
    if not isinstance(notes, list) or not all(isinstance(note, str) for note in notes):
        raise ValueError("trace_notes: expected a list of texts")
    return SummaryFile({system: ReadSummary(metrics, path, system)
                        for system, metrics in systems.items()}, notes,
                       checked_made_by(data.get("made_by")))


def checked_made_by(made: Any) -> dict[str, str] | None:
    """A file's record of the kvsim that made it (None: a file from before kvsim kept it),
    or a ValueError saying what it should be."""
    if made is not None and not (isinstance(made, dict) and set(made) == {"kvsim", "build"}
                                 and all(isinstance(v, str) for v in made.values())):
        raise ValueError(f'made_by: expected {{"kvsim": version, "build": id}}, got {made!r}')
    return made


def _safe_name(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
