"""Capacity under SLO: the highest request rate a system serves with enough requests in time.

Finding it is like finding a bridge's load limit with test lorries: send one at the expected
load; while it holds, double the load, once it fails, halve it; then split the difference
between the heaviest load that held and the lightest that failed until they are close. Each
test is a whole simulation of the scenario at that arrival rate (the same seed, so the
arrivals of a faster run are the slower run's, compressed in time), and a load *holds* when
the share of requests within the scenario's SLO reaches ``slo.attainment``: DistServe's
definition of a system's capacity (its "goodput" in requests per second).

The knob is the workload's arrival ``rate`` (synthetic or Poisson-replayed traces), or the
replay ``speed`` of a trace's own timestamps; closed-loop arrivals set their load by users
and cannot be searched.

Each test can be kept as it ends (``probe_dir``), like a load chart in the lorry's cab: a
search stopped halfway and started again reads back the tests it made, walks the same path
to where it stopped, and goes on from there. Over a sweep (:func:`capacity_sweep`), each
point's searches are kept too, so a killed sweep of searches resumes as a sweep of runs does.

One seed's requests are one sample of the workload: a burst late in the stream can sink a
load that an earlier stretch held. :func:`capacity_by_seed` searches the same scenario
under several seeds, so the spread of the answers shows how far one number can be trusted.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from sim.engine import build_timing, run_system, scenario_trace
from sim.provenance import build_id, input_digests
from sim.results import check_metrics, make_output_folder, write_json
from sim.scenario import Scenario, SloConfig, SystemConfig, scenario_from_dict
from sim.slo import judged_attainment
from sim.sweep import (
    SweepPoint,
    config_key,
    expand,
    make_executor,
    params_as_text,
    read_files,
    set_path,
    sweep_config,
    with_overrides,
)
from workloads import Trace, WorkloadError
from workloads.distributions import ClosedLoopArrivals, TraceArrivals

PROBES_FOLDER = "probes"  # kvsim capacity: a file per run of a search, for resuming
POINTS_FOLDER = "points"  # kvsim capacity --sweep: a file per point searched, for resuming
SEARCH_RANGE = 2**10  # the search gives up beyond this factor above or below the start
# A run whose requests arrive within less than this share of its makespan never settled.
UNSETTLED_SPAN_FRAC = 0.5


class CapacityError(ValueError):
    """A scenario whose capacity cannot be searched (no SLO, no arrival rate)."""


@dataclass(frozen=True)
class LoadKnob:
    """The field that sets the offered load, its value in the scenario, and the requests
    per second one unit of it offers (1 for a rate; a trace's own mean rate for a speed)."""

    path: str
    start: float
    req_s_per_unit: float

    def offered_req_s(self, value: float) -> float:
        return value * self.req_s_per_unit


@dataclass(frozen=True)
class Probe:
    """One test load: the knob's value, the share of requests in time, the run's summary."""

    system: str
    load: float
    offered_req_s: float
    attainment: float
    holds: bool
    summary: dict[str, Any]
    seed: int = 0  # the scenario's seed: whose requests were run
    kept: bool = False  # read from a file an earlier search left, not run again


@dataclass
class Capacity:
    """One system's search: the heaviest load that held and the lightest that failed (None
    where no load tried did: the capacity lies outside the range searched), and every probe
    in the order run."""

    system: str
    seed: int = 0  # the scenario's seed the search ran its requests from
    held: float | None = None
    failed: float | None = None
    converged: bool = False  # the two within the search's tolerance, or either is None
    probes: list[Probe] = field(default_factory=list)

    def at(self, load: float | None) -> Probe | None:
        """The probe run at ``load``."""
        return next((p for p in self.probes if p.load == load), None)


def knob_path(scenario: Scenario) -> str:
    """The field that sets ``scenario``'s arrival rate."""
    arrival = scenario.workload.arrival
    if isinstance(arrival, ClosedLoopArrivals):
        raise CapacityError("workload.arrival: closed_loop arrivals have no rate to search "
                            "(their load is set by users); use an open process such as "
                            "poisson")
    return "workload.arrival.speed" if isinstance(arrival, TraceArrivals) else (
        "workload.arrival.rate")


def load_knob(scenario: Scenario, trace: Trace) -> LoadKnob:
    """Which field of ``scenario`` sets its arrival rate (``trace`` is its trace as given,
    for the mean rate of a replayed trace)."""
    path = knob_path(scenario)
    arrival = scenario.workload.arrival
    if isinstance(arrival, TraceArrivals):
        span_s = float(trace.arrival_s.max() - trace.arrival_s.min()) if len(trace) else 0.0
        if len(trace) < 2 or span_s <= 0:
            raise CapacityError("workload: the trace needs at least two requests at different "
                                "times to have a rate to search")
        # The trace as given is already replayed at its speed: its rate at speed 1 is less.
        per_unit = (len(trace) - 1) / span_s / arrival.speed
        return LoadKnob(path, arrival.speed, per_unit)
    return LoadKnob(path, arrival.rate, 1.0)  # type: ignore[union-attr]


def unsettled_note(system: str, requests: int, offered_req_s: float, makespan_s: float
                   ) -> str | None:
    """A warning when a system's run at its capacity took more than twice as long as its
    ``requests`` took to arrive (at ``offered_req_s``): the run is mostly its start and its
    drain (a burst its queue absorbed within the SLO, or long requests still running from
    the start), not the steady state a longer stream settles into; None otherwise."""
    span_s = requests / offered_req_s if offered_req_s > 0 else math.inf
    if span_s >= UNSETTLED_SPAN_FRAC * makespan_s:
        return None
    return (f"{system}: at its capacity its {requests:,} requests arrive over about "
            f"{span_s:,.1f} s and take {makespan_s:,.1f} s to serve: the run is mostly its "
            "start and its drain, not a steady state, so this capacity is likely above what "
            "a longer stream sustains; give more requests (stop.num_requests) or a longer "
            "stop.duration_s")


def search(holds: Callable[[float], bool], start: float, *, rel_tol: float,
           max_probes: int) -> tuple[float | None, float | None, bool]:
    """The heaviest load that ``holds`` and the lightest that does not, bracketed from
    ``start`` by doubling or halving, then narrowed by geometric bisection until within
    ``rel_tol`` of each other; and whether they got that close in ``max_probes`` calls."""
    held: float | None = None
    failed: float | None = None
    load = start
    for _ in range(max_probes):
        if holds(load):
            held = load
        else:
            failed = load
        if held is not None and failed is not None:
            if failed / held - 1 <= rel_tol:
                return held, failed, True
            load = math.sqrt(held * failed)
        elif held is None:
            load /= 2
            if load < start / SEARCH_RANGE:
                return None, failed, True  # nothing holds: the answer is "none"
        else:
            load *= 2
            if load > start * SEARCH_RANGE:
                return held, None, True  # everything holds: capacity beyond the range
    return held, failed, False


def find_capacity(scenario: Scenario, base_dir: Path, *, rel_tol: float = 0.02,
                  max_probes: int = 24, systems: list[str] | None = None,
                  progress: Callable[[Probe], None] | None = None,
                  jobs: int = 1, probe_dir: Path | None = None
                  ) -> tuple[LoadKnob, list[Capacity]]:
    """Search each system's capacity under the scenario's SLO (see the module docstring).

    With ``jobs`` above 1 the systems are searched at once, each in a process of its own
    (the same results: every search is independent); ``progress`` is then called in those
    processes, so it must pickle (a module-level function, or a ``functools.partial`` of
    one). With ``probe_dir``, each run's summary is kept there as it ends, and a run this
    kvsim build made before is read back instead of run again (see :func:`probe_file`): a
    killed search, run again, replays its path to where it stopped."""
    objectives = _require_slo(scenario)
    target = objectives.attainment
    slo = objectives.model_dump()
    chosen = _chosen_systems(scenario, systems)
    knob = load_knob(scenario, scenario_trace(scenario, base_dir))
    if probe_dir is not None:
        make_output_folder(probe_dir)
    if jobs > 1 and len(chosen) > 1:
        data = scenario.model_dump(mode="json")
        execute = make_executor("local", min(jobs, len(chosen)))
        found = dict(execute(_search_system, [
            (s.name, (data, str(base_dir), s.name, rel_tol, max_probes, progress,
                      None if probe_dir is None else str(probe_dir)))
            for s in chosen]))
        return knob, [found[s.name] for s in chosen]
    timing = build_timing(scenario, base_dir)
    raw = scenario.model_dump(mode="json")
    variants: dict[float, Scenario] = {}
    traces: dict[float, Trace] = {}

    def variant_at(load: float) -> Scenario:
        if load not in variants:
            data = {k: v for k, v in raw.items() if k != "sweep"}
            set_path(data, knob.path, load)
            variants[load] = scenario_from_dict(data, f"{knob.path}={load:g}")
        return variants[load]

    def run_at(load: float, system: SystemConfig) -> dict[str, Any]:
        if load not in traces:
            traces[load] = scenario_trace(variant_at(load), base_dir)
        return run_system(variant_at(load), system, traces[load], timing,
                          base_dir=base_dir).summary

    results = []
    for system in chosen:
        result = Capacity(system.name, scenario.seed)

        def holds(load: float, system: SystemConfig = system, result: Capacity = result
                  ) -> bool:
            where = None if probe_dir is None else probe_file(
                probe_dir, variant_at(load), system.name, base_dir)
            summary = None if where is None else _kept_summary(where, system.name, load)
            kept = summary is not None
            if summary is None:
                summary = _as_stored(run_at(load, system))
                if where is not None:
                    write_json({"system": system.name, "load": load, "build": build_id(),
                                "summary": summary}, where)
            attainment = float(judged_attainment(summary, slo))
            probe = Probe(system.name, load, knob.offered_req_s(load), attainment,
                          attainment >= target, summary, scenario.seed, kept)
            result.probes.append(probe)
            if progress:
                progress(probe)
            return probe.holds

        try:
            result.held, result.failed, result.converged = search(
                holds, knob.start, rel_tol=rel_tol, max_probes=max_probes)
        except WorkloadError:
            # Halving left no requests before stop.duration_s: no lighter load can be
            # judged, and none tried held.
            result.held, result.failed, result.converged = None, min(
                p.load for p in result.probes), True
        results.append(result)
    return knob, results


def probe_file(folder: Path, variant: Scenario, system: str, base_dir: Path) -> Path:
    """Where a search keeps its run of ``system`` on ``variant`` (the scenario at one load):
    named by that system's resolved scenario, what the files it reads hold, and this
    kvsim's build, so that only the same run by the same code is read back."""
    resolved = variant.model_dump(mode="json")
    resolved["systems"] = [s for s in resolved["systems"] if s["name"] == system]
    return _keyed_file(folder, {"run": config_key(resolved, input_digests(resolved, base_dir)),
                                "build": build_id()})


def _keyed_file(folder: Path, material: dict[str, Any]) -> Path:
    """The JSON file in ``folder`` named by a hash of ``material``."""
    text = json.dumps(material, sort_keys=True)
    return folder / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


def _kept_summary(path: Path, system: str, load: float) -> dict[str, Any] | None:
    """The summary a run's file holds; None where there is none, or a torn or damaged one
    (the run is run again)."""
    try:
        data = json.loads(path.read_text())
        summary = data["summary"]
        if not (data["system"] == system and data["load"] == load
                and data["build"] == build_id() and isinstance(summary, dict)):
            return None
        check_metrics(summary, system)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return summary  # type: ignore[no-any-return]


def capacity_by_seed(scenario: Scenario, base_dir: Path, seeds: list[int], *,
                     rel_tol: float = 0.02, max_probes: int = 24,
                     systems: list[str] | None = None,
                     progress: Callable[[Probe], None] | None = None,
                     jobs: int = 1, probe_dir: Path | None = None
                     ) -> tuple[LoadKnob, list[Capacity]]:
    """:func:`find_capacity` of the scenario under each of ``seeds`` (the same loads
    searched, other requests drawn): one :class:`Capacity` per seed and system, seed by seed.
    With ``jobs`` above 1 every (seed, system) search runs in a process of its own."""
    if not seeds or len(set(seeds)) < len(seeds):
        raise CapacityError(f"seeds: expected distinct seeds, got {seeds}")
    data = {k: v for k, v in scenario.model_dump(mode="json").items() if k != "sweep"}
    variants = [scenario_from_dict({**data, "seed": seed}, f"seed {seed}") for seed in seeds]
    if jobs <= 1 or len(variants) == 1:
        found = [find_capacity(v, base_dir, rel_tol=rel_tol, max_probes=max_probes,
                               systems=systems, progress=progress, jobs=jobs,
                               probe_dir=probe_dir)
                 for v in variants]
        return found[0][0], [c for _, capacities in found for c in capacities]
    knob = load_knob(variants[0], scenario_trace(variants[0], base_dir))
    chosen = _chosen_systems(scenario, systems)
    folder = None if probe_dir is None else str(probe_dir)
    tasks = [((v.seed, s.name), (v.model_dump(mode="json"), str(base_dir), s.name, rel_tol,
                                 max_probes, progress, folder))
             for v in variants for s in chosen]
    execute = make_executor("local", min(jobs, len(tasks)))
    done = dict(execute(_search_system, tasks))
    return knob, [done[key] for key, _ in tasks]


def _require_slo(scenario: Scenario) -> SloConfig:
    """The scenario's objectives; without them there is no capacity to search."""
    if scenario.slo is None:
        raise CapacityError("no slo section: capacity is the load at which enough requests "
                            "meet an SLO, e.g. slo: {ttft_s: 1.0, tpot_s: 0.05}")
    return scenario.slo


def _search_system(scenario_data: dict[str, Any], base_dir: str, system: str,
                   rel_tol: float, max_probes: int,
                   progress: Callable[[Probe], None] | None, probe_dir: str | None
                   ) -> Capacity:
    """One system's search, in a worker process of :func:`find_capacity`."""
    _, (found,) = find_capacity(scenario_from_dict(scenario_data), Path(base_dir),
                                rel_tol=rel_tol, max_probes=max_probes, systems=[system],
                                progress=progress,
                                probe_dir=None if probe_dir is None else Path(probe_dir))
    return found


def _chosen_systems(scenario: Scenario, names: list[str] | None) -> list[SystemConfig]:
    if not names:
        return list(scenario.systems)
    known = {s.name: s for s in scenario.systems}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise CapacityError(f"--system {unknown[0]}: no such system; systems: "
                            f"{', '.join(known)}")
    return [known[n] for n in names]


# ---------------------------------------------------------------------- over a sweep
def capacity_points(path: Path, *, quick: bool = False,
                    overrides: dict[str, Any] | None = None,
                    notes: list[str] | None = None) -> tuple[Scenario, list[SweepPoint]]:
    """The sweep file's base scenario (``overrides`` applied) and its points, with the
    arrival rate taken off the grid: it is what each point's search varies (``notes``: see
    :func:`sim.sweep.expand`)."""
    from sim.scenario import read_scenario_file

    raw = with_overrides(read_scenario_file(path), overrides)
    scenario = scenario_from_dict(raw, f"{path} (with --set)" if overrides else str(path))
    if not scenario.sweep:
        raise CapacityError("--sweep: the file has no sweep section")
    _require_slo(scenario)  # before any point is expanded or searched
    searched = knob_path(scenario)
    sweep_config(raw, str(path))  # a malformed section is told as kvsim sweep tells it
    sweep = dict(raw["sweep"])
    if searched in (sweep.get("zip") or {}):
        raise CapacityError(f"sweep.zip: moves {searched} with other fields, and capacity "
                            "searches it; sweep the other fields alone")
    sweep["grid"] = {k: v for k, v in (sweep.get("grid") or {}).items() if k != searched}
    return scenario, expand({**raw, "sweep": sweep}, str(path), quick=quick, notes=notes,
                            base_dir=path.parent)


def point_capacity(scenario_data: dict[str, Any], base_dir: str, rel_tol: float,
                   max_probes: int, systems: list[str] | None = None,
                   probe_dir: str | None = None) -> list[dict[str, Any]]:
    """:func:`capacity_rows` of one sweep point's search of ``systems`` (all if None), in a
    worker, or its error (``probe_dir``: see :func:`find_capacity`)."""
    scenario = scenario_from_dict(scenario_data)
    try:
        knob, capacities = find_capacity(
            scenario, Path(base_dir), rel_tol=rel_tol, max_probes=max_probes,
            systems=systems, probe_dir=None if probe_dir is None else Path(probe_dir))
    except Exception as exc:  # recorded with the point; the others go on
        rows = [{"system": s.name, "status": "failed", "error": f"{type(exc).__name__}: {exc}"}
                for s in _chosen_systems(scenario, systems)]
    else:
        rows = capacity_rows(scenario, knob, capacities)
    return [{**row, "build": build_id()} for row in rows]  # (the worker's kvsim)


# What a row of a capacity table says of its search, before the run at capacity's summary.
_SEARCH_FIELDS = ("system", "status", "error", "capacity_req_s", "capacity_req_s_per_gpu",
                  "misses_at_req_s", "converged", "runs", "build")


def capacity_rows(scenario: Scenario, knob: LoadKnob, capacities: list[Capacity]
                  ) -> list[dict[str, Any]]:
    """One row per system searched: its capacity in requests/s (and per GPU), the lightest
    load that missed, and the summary of the run at capacity."""
    gpus = scenario.gpus
    rows = []
    for c in capacities:
        held = c.at(c.held)
        capacity = None if c.held is None else knob.offered_req_s(c.held)
        rows.append({
            "system": c.system, "status": "ok", "error": "",
            "capacity_req_s": capacity,
            "capacity_req_s_per_gpu": None if capacity is None else capacity / gpus,
            "misses_at_req_s": None if c.failed is None else knob.offered_req_s(c.failed),
            "converged": c.converged, "runs": len(c.probes),
            **(held.summary if held else {"gpus": gpus})})
    return rows


@dataclass
class CapacitySweepOutcome:
    """What a capacity sweep did: the table, and how many points were searched, found
    already searched in the output folder, or failed; ``older``: how many of those found
    another kvsim build searched (or an unknown one)."""

    table: pd.DataFrame
    searched: int
    skipped: int
    failed: int
    older: int = 0


def point_file(folder: Path, point: SweepPoint, rel_tol: float, max_probes: int) -> Path:
    """Where a capacity sweep in ``folder`` keeps ``point``'s rows: named by the point's key
    and the search's settings, since another tolerance is another search."""
    return _keyed_file(folder / POINTS_FOLDER,
                       {"point": point.key, "rel_tol": rel_tol, "max_probes": max_probes})


def _searched_rows(path: Path) -> dict[str, dict[str, Any]]:
    """The rows, by system, of the searches a point's file holds; none where there is no
    file, or a torn or damaged one (those points are searched again)."""
    try:
        found = {row["system"]: row for row in json.loads(path.read_text())["rows"]}
        for row in found.values():
            _check_row(row)
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return found


def _check_row(row: dict[str, Any]) -> None:
    """A ValueError unless ``row`` is one :func:`capacity_rows` gives for a search that
    ended (its fields, then the summary of the run at capacity)."""
    loads = (row["capacity_req_s"], row["capacity_req_s_per_gpu"], row["misses_at_req_s"])
    if not (isinstance(row["system"], str) and row["status"] == "ok" and row["error"] == ""
            and isinstance(row["build"], str) and isinstance(row["converged"], bool)
            and isinstance(row["runs"], int) and not isinstance(row["runs"], bool)
            and all(v is None or (isinstance(v, int | float) and not isinstance(v, bool))
                    for v in loads)):
        raise ValueError("not a search's row")
    check_metrics({k: v for k, v in row.items() if k not in _SEARCH_FIELDS}, row["system"])


def _as_stored(summary: dict[str, Any]) -> dict[str, Any]:
    """A run's summary as its file gives it back, so that what a resumed search writes (its
    rows, ``capacity.json``, ``probes.csv``) is what a search from scratch writes, byte for
    byte."""
    return json.loads(json.dumps(summary, allow_nan=True, sort_keys=True))  # type: ignore[no-any-return]


def capacity_sweep(path: Path, *, jobs: int | None = None, executor: str = "local",
                   address: str | None = None, rel_tol: float = 0.02, max_probes: int = 24,
                   quick: bool = False,
                   progress: Callable[[int, int], Callable[[int], None]] | None = None,
                   overrides: dict[str, Any] | None = None,
                   systems: list[str] | None = None,
                   notify: Callable[[str], None] | None = None,
                   out_dir: Path | None = None,
                   rerun_older: bool = False) -> CapacitySweepOutcome:
    """Each sweep point's capacity, searched in parallel (local processes or Ray, as
    :func:`sim.sweep.make_executor`): one row per point, seed and system (``systems`` only,
    if given), with the point's parameters as ``param:PATH`` columns; ``notify`` is told
    the layouts ``sweep.layouts`` refuses, before any search.

    With ``out_dir``, each point's searches are kept in a file of its own there
    (``points/``) as they finish, and a point whose file holds them is not searched again:
    a killed sweep resumes where it stopped, the points under way from their last run
    (``probes/``, as :func:`find_capacity` keeps them). A point another kvsim build searched
    is kept (its rows' ``build`` says which), or searched again under ``rerun_older``; a
    failed one is searched again.
    ``progress`` is given the number of points to search and of points skipped."""
    notes: list[str] = []
    scenario, points = capacity_points(path, quick=quick, overrides=overrides, notes=notes)
    if notify is not None:
        for note in notes:
            notify(note)
    wanted = [s.name for s in _chosen_systems(scenario, systems)]  # an unknown name first
    read_files(points, path.parent, str(path))  # a bad trace row too, as kvsim sweep's
    base_dir = str(path.parent.resolve())
    if out_dir is not None:
        make_output_folder(out_dir / POINTS_FOLDER)
    found: dict[str, dict[str, dict[str, Any]]] = {}  # point key → system → row
    todo: list[tuple[SweepPoint, list[str]]] = []
    older = 0
    for point in points:
        kept = {name: row for name, row in _searched_rows(
            point_file(out_dir, point, rel_tol, max_probes)).items()
            if name in wanted} if out_dir is not None else {}
        is_older = any(row["build"] != build_id() for row in kept.values())
        older += is_older
        if is_older and rerun_older:
            kept = {}
        found[point.key] = kept
        missing = [name for name in wanted if name not in kept]
        if missing:
            todo.append((point, missing))
    skipped = len(points) - len(todo)
    tick = progress(len(todo), skipped) if progress and todo else None
    execute = make_executor(executor, jobs, address)
    by_key = {point.key: point for point, _ in todo}
    failed = 0
    probe_dir = None if out_dir is None else str(out_dir / PROBES_FOLDER)
    # (Each row's summary is as its file gives it back: see _as_stored.)
    for key, rows in execute(point_capacity, [
            (point.key, (point.scenario, base_dir, rel_tol, max_probes, missing, probe_dir))
            for point, missing in todo]):
        found[key].update((row["system"], row) for row in rows)
        if any(row["status"] != "ok" for row in rows):
            failed += 1
        elif out_dir is not None:  # with the point's other systems, searched before
            where = point_file(out_dir, by_key[key], rel_tol, max_probes)
            kept = _searched_rows(where)
            kept.update((row["system"], row) for row in rows)
            write_json({"params": by_key[key].params, "seed": by_key[key].seed,
                        "rel_tol": rel_tol, "max_probes": max_probes,
                        "rows": list(kept.values())}, where)
        if tick:
            tick(1)
    table_rows = []
    for point in points:  # in the sweep's order, whatever order they finished in
        base = {"point": point.point, "seed": point.seed,
                **{f"param:{p}": v for p, v in point.params.items()}}
        table_rows += [{**base, **found[point.key][name]} for name in wanted]
    table = pd.DataFrame(table_rows)
    # Columns in an order that does not depend on where a row came from (a search, a file).
    ids = ["point", "seed", *(c for c in table if c.startswith("param:")), "system",
           "status", "error", "build"]
    table = params_as_text(table[ids + sorted(c for c in table if c not in ids)])
    for column in ("capacity_req_s", "capacity_req_s_per_gpu", "misses_at_req_s"):
        # (Absent where every point failed: their rows hold only the error.)
        table[column] = table[column].astype(float) if column in table else math.nan
    return CapacitySweepOutcome(table, searched=len(todo), skipped=skipped, failed=failed,
                                older=older)
