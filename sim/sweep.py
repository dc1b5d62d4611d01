"""Parameter sweeps: a grid of scenario variants, run in parallel, resumable.

A sweep is a mail merge: the scenario is the letter, the ``sweep:`` section the address list.
Each combination of values (a *point*) times each seed becomes one complete scenario, checked
before anything runs, and keyed by a hash of its resolved configuration. A point whose run
folder already holds a ``summary.json`` is done and never recomputed, so a killed sweep
resumes where it stopped. Points run in a local process pool or as Ray tasks; the results
table is the same either way.

::

    sweep:
      grid:                                   # every combination
        workload.arrival.rate: [2, 4, 8]
        systems[paged].allocator.block_size: [8, 16, 32]
      zip:                                    # advanced together (equal lengths)
        memory.kv_memory_gib: [10, 20]
        systems[*].scheduler.max_num_seqs: [64, 128]
      seeds: [0, 1]
      layouts: {gpus: 16}                     # every way to run 16 GPUs (× the rest)

Paths are dotted field names; ``[NAME]`` picks a list item by its ``name``, ``[2]`` by index,
``[*]`` every item.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import re
import signal
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Annotated, Any

import pandas as pd
from pydantic import Field, PositiveInt, ValidationError, field_validator, model_validator

from sim.metrics import ONLY_WHEN_SET
from sim.provenance import build_id, input_digests
from sim.results import (
    RunFolderError,
    make_output_folder,
    read_summary_file,
    write_json,
    write_table,
)
from sim.scenario import Scenario, ScenarioError, scenario_from_dict, validation_message
from sim.slo import SLO_KEYS
from workloads.distributions import ConfigModel

_SEGMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)((?:\[[^\]]+\])*)$")


class SweepError(ValueError):
    """A sweep section, path or value that cannot work (reported before any run)."""


MAX_LAYOUT_GPUS = 1 << 20  # beyond any deployment; keeps the layouts quick to list


class LayoutsConfig(ConfigModel):
    """``sweep.layouts``: every way to run ``gpus`` GPUs of the scenario's model that holds
    its weights: engines (``engine.replicas`` of them) of ``tensor_parallel_size`` GPUs, in
    ``pipeline_parallel_size`` stages, or for a mixture of experts in ``data_parallel_size``
    ranks with expert parallelism. The lists, where given, keep only those sizes."""

    gpus: PositiveInt = Field(le=MAX_LAYOUT_GPUS,
                              description="the GPUs every layout uses, all its engines'")
    tensor_parallel_sizes: list[PositiveInt] | None = None
    pipeline_parallel_sizes: list[PositiveInt] | None = None
    data_parallel_sizes: list[PositiveInt] | None = None


# What a layout sets, in the order its columns show.
LAYOUT_PATHS = ("engine.replicas", "parallel.tensor_parallel_size",
                "parallel.pipeline_parallel_size", "parallel.data_parallel_size",
                "parallel.expert_parallel")


class SweepConfig(ConfigModel):
    """The ``sweep:`` section of a scenario."""

    grid: dict[str, list[Any]] = Field(default_factory=dict)
    zip: dict[str, list[Any]] = Field(default_factory=dict)
    seeds: list[Annotated[int, Field(ge=0)]] | None = None
    layouts: LayoutsConfig | None = None

    @field_validator("grid", "zip")
    @classmethod
    def _non_empty_lists(cls, axes: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for path, values in axes.items():
            if not values:
                raise ValueError(f"{path}: needs at least one value")
        return axes

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, seeds: list[int] | None) -> list[int] | None:
        # An empty list must not fall back to the scenario's seed unsaid.
        if seeds is not None and not seeds:
            raise ValueError("expected at least one seed (leave seeds out to run the "
                             "scenario's own seed)")
        repeated = sorted(seed for seed, count in Counter(seeds or []).items() if count > 1)
        if repeated:
            raise ValueError(f"{', '.join(map(str, repeated))} given more than once")
        return seeds

    @model_validator(mode="after")
    def _zip_lengths(self):  # type: ignore[no-untyped-def]
        lengths = {len(v) for v in self.zip.values()}
        if len(lengths) > 1:
            raise ValueError(f"zip: all lists must have the same length, got "
                             f"{ {k: len(v) for k, v in self.zip.items()} }")
        return self

    @model_validator(mode="after")
    def _seeds_by_seeds(self):  # type: ignore[no-untyped-def]
        # Each point's seed is set from seeds (or the scenario's) after its paths: a seed
        # in the grid or zip would be overwritten unsaid.
        for axes, name in ((self.grid, "grid"), (self.zip, "zip")):
            if "seed" in axes:
                raise ValueError(f"{name}.seed: sweep seeds with seeds: [0, 1, ...], which "
                                 "sets every point's seed")
        return self

    @model_validator(mode="after")
    def _layouts_alone(self):  # type: ignore[no-untyped-def]
        if self.layouts is None:
            return self
        for path in (*self.grid, *self.zip):
            if path in LAYOUT_PATHS:
                raise ValueError(f"layouts: sets {path} itself; leave it out of grid and zip")
        return self


def _divisors(n: int) -> list[int]:
    """Every divisor of ``n``, smallest first (each found with its pair, up to √n)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def describe_layout(row: dict[str, Any]) -> str:
    """A layout's sweep row in words: ``2 engines × 2 stages × TP 4`` (a path the row
    leaves out is not named, nor stages or ranks of one)."""
    parts = []
    replicas = row.get("engine.replicas")
    if replicas is not None:
        parts.append(f"{replicas} engine{'s' if replicas > 1 else ''}")
    if (stages := row.get("parallel.pipeline_parallel_size", 1)) > 1:
        parts.append(f"{stages} stages")
    if (ranks := row.get("parallel.data_parallel_size", 1)) > 1:
        parts.append(f"{ranks} ranks" + (" (expert parallel)"
                                         if row.get("parallel.expert_parallel") else ""))
    if (tp := row.get("parallel.tensor_parallel_size")) is not None:
        parts.append(f"TP {tp}")
    return " × ".join(parts)


def layout_rows(base: dict[str, Any], scenario: Scenario, layouts: LayoutsConfig,
                source: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The layouts (sweep rows, every path of :data:`LAYOUT_PATHS`) that run the ``base``
    scenario (``scenario`` as validated), fewest engines first, and a line for each one
    refused, saying why (its weights do not fit, its heads do not split, its GPUs' link does
    not reach). Data-parallel ranks are a mixture of experts' only, and are not laid out in
    stages (not modelled)."""
    from sim.engine import memory_summary  # (it runs the engine's own sizing checks)
    from sim.presets import SizingError

    moe = scenario.model_spec().is_moe
    wanted = (layouts.tensor_parallel_sizes, layouts.pipeline_parallel_sizes,
              layouts.data_parallel_sizes)
    rows: list[dict[str, Any]] = []
    refused: list[str] = []
    for engine_gpus in reversed(_divisors(layouts.gpus)):
        for tp in reversed(_divisors(engine_gpus)):
            for pp in _divisors(engine_gpus // tp):
                dp = engine_gpus // tp // pp
                if (dp > 1 and (pp > 1 or not moe)) or any(
                        allowed is not None and size not in allowed
                        for allowed, size in zip(wanted, (tp, pp, dp), strict=True)):
                    continue
                row = dict(zip(LAYOUT_PATHS, (layouts.gpus // engine_gpus, tp, pp, dp, dp > 1),
                               strict=True))
                data = copy.deepcopy(base)
                for path, value in row.items():
                    set_path(data, path, value, label=f"{source}: sweep path")
                try:
                    memory_summary(scenario_from_dict(data, source))
                except ScenarioError as exc:
                    refused.append(f"{describe_layout(row)}: "
                                   f"{str(exc).removeprefix(f'{source}: ')}")
                except SizingError as exc:
                    refused.append(f"{describe_layout(row)}: {exc}")
                else:
                    rows.append(row)
    return rows, refused


def _as_given(scenario: Scenario) -> dict[str, Any]:
    """The values of :data:`LAYOUT_PATHS` the scenario has of itself."""
    parallel = scenario.parallel
    return dict(zip(LAYOUT_PATHS, (
        scenario.engine.replicas, parallel.tensor_parallel_size,
        parallel.pipeline_parallel_size, parallel.data_parallel_size,
        parallel.expert_parallel), strict=True))


def _laid_out(base: dict[str, Any], config: SweepConfig, source: str,
              notes: list[str] | None) -> list[dict[str, Any]]:
    """Every combination of the grid and zip crossed with the layouts that hold it: those
    of its own scenario (a GPU swept beside the layouts holds the model in layouts another
    does not). A layout refused at every combination is told once in ``notes``, one refused
    at some of them with where; combinations no layout holds are told and left out."""
    layouts = config.layouts
    assert layouts is not None
    combinations: list[dict[str, Any]] = []
    refusals: dict[str, list[str]] = {}  # a refused layout's line → where it was refused
    unheld: list[str] = []  # the combinations no layout holds
    idle = set(LAYOUT_PATHS)
    places = list(_combinations(config))
    for params in places:
        data = copy.deepcopy(base)
        for path, value in params.items():
            set_path(data, path, value, label=f"{source}: sweep path")
        where = ", ".join(f"{p}={v}" for p, v in params.items())
        scenario = scenario_from_dict(data, source)
        rows, refused = layout_rows(data, scenario, layouts, source)
        for line in refused:
            refusals.setdefault(line, []).append(where)
        if not rows:
            unheld.append(where)
            continue
        as_given = _as_given(scenario)
        idle -= {path for path in LAYOUT_PATHS if any(row[path] != as_given[path]
                                                       for row in rows)}
        combinations += [{**params, **row} for row in rows]
    if not combinations:
        raise SweepError(f"{source}: sweep.layouts: no way to run {layouts.gpus} GPUs holds "
                         f"the scenario: {next(iter(refusals), 'no size allowed')}")
    if notes is not None:
        for line, wheres in refusals.items():
            at = "" if len(wheres) == len(places) else f"at {'; '.join(wheres)}: "
            notes.append(f"sweep.layouts: {at}not {line}")
        notes += [f"sweep.layouts: at {where}: no layout of {layouts.gpus} GPUs holds the "
                  "scenario; left out" for where in unheld]
    # A path every layout leaves as the scenario has it is no column (a dense model's ranks).
    return [{k: v for k, v in row.items() if k not in idle} for row in combinations]


def _parse_path(path: str) -> list[str | int | tuple[str, str]]:
    """``systems[paged].allocator.block_size`` → ['systems', ('name', 'paged'), ...]."""
    steps: list[str | int | tuple[str, str]] = []
    for segment in path.split("."):
        match = _SEGMENT.match(segment)
        if not match:
            what = repr(segment) if segment else "an empty name"
            raise SweepError(f"sweep path {path!r}: cannot read {what}; expected field names "
                             "joined by dots, a list's item picked by [NAME], [INDEX] or [*] "
                             "(systems[paged].allocator.block_size)")
        steps.append(match.group(1))
        for selector in re.findall(r"\[([^\]]+)\]", match.group(2)):
            if selector == "*":
                steps.append(("*", ""))
            elif selector.lstrip("-").isdigit():
                steps.append(int(selector))
            else:
                steps.append(("name", selector))
    return steps


def set_path(data: dict[str, Any], path: str, value: Any, label: str = "sweep path") -> None:
    """Set ``path`` in the raw scenario dict ``data`` (intermediate mappings are created);
    errors name it as ``label`` (what gave it)."""
    try:
        steps = _parse_path(path)
    except SweepError as exc:
        raise SweepError(str(exc).replace("sweep path", label, 1)) from None

    def walk(node: Any, rest: list, trail: str) -> None:
        step, tail = rest[0], rest[1:]
        if isinstance(step, str):
            if not isinstance(node, dict):
                raise SweepError(f"{label} {path!r}: {trail or 'the scenario'} is not a "
                                 "mapping")
            if not tail:
                node[step] = copy.deepcopy(value)
                return
            walk(node.setdefault(step, {}), tail, f"{trail}.{step}" if trail else step)
            return
        if not isinstance(node, list):
            raise SweepError(f"{label} {path!r}: {trail} is not a list")
        if isinstance(step, int):
            if not -len(node) <= step < len(node):
                items = f"{len(node)} item{'' if len(node) == 1 else 's'}"
                raise SweepError(f"{label} {path!r}: {trail} has {items}, no [{step}]")
            targets = [step]
        elif step[0] == "*":
            targets = list(range(len(node)))
        else:
            targets = [i for i, item in enumerate(node)
                       if isinstance(item, dict) and item.get("name") == step[1]]
            if not targets:
                names = [item.get("name") for item in node if isinstance(item, dict)]
                raise SweepError(f"{label} {path!r}: no item named {step[1]!r} in {trail} "
                                 f"(names: {', '.join(map(str, names))})")
        for i in targets:
            if not tail:
                node[i] = copy.deepcopy(value)
            else:
                walk(node[i], tail, f"{trail}[{i}]")

    walk(data, steps, "")


@dataclass(frozen=True)
class SweepPoint:
    """One run of a sweep: a parameter combination and a seed."""

    point: int
    seed: int
    params: dict[str, Any]
    scenario: dict[str, Any]  # resolved, validated (as JSON-compatible data)
    key: str


# Fields added with a default other than null, of each system and of the scenario, and the
# value that does what kvsim did before they existed: left out of the key at that value, as
# a null is.
_AS_BEFORE_FIELDS: dict[tuple[str, str], Any] = {
    ("allocator", "hybrid_kv_cache"): True,  # no effect on a model without a window
    ("allocator", "mamba_cache_mode"): "align",
    ("scheduler", "prefill_allocation"): "whole_prompt",
    ("scheduler", "admission"): "memory",
    ("scheduler", "batching"): "mixed",
    ("scheduler", "preempted_rejoin"): "front",
    ("scheduler", "preempted_cache"): "computed",
}
_SCENARIO_AS_BEFORE_FIELDS: dict[tuple[str, str], Any] = {
    ("parallel", "data_parallel_size"): 1,
    ("parallel", "expert_parallel"): False,
    ("parallel", "expert_load_imbalance"): 1.0,
    ("parallel", "pipeline_parallel_size"): 1,
    ("model", "num_dense_layers"): 0,  # (a model given by its shape)
}
# The same of the prefill replicas' own parallelism (engine.disaggregation.prefill_parallel).
_PREFILL_PARALLEL_AS_BEFORE_FIELDS = {("prefill_parallel", "pipeline_parallel_size"): 1}


def config_key(resolved: dict[str, Any], file_digests: dict[str, str] | None = None) -> str:
    """Stable hash of a resolved scenario (names and output folder excluded) and of what the
    files it reads hold (``file_digests``, by field, as :func:`~sim.provenance.input_digests`
    gives them: an edited trace is another point).

    Unset optional fields (null), and later fields at the value that does what kvsim did
    before them, are left out, so a kvsim that adds one more feature keys every scenario
    not using it as before, and a resumed sweep keeps its runs (saying so where another
    kvsim build made them).
    """
    material = _without_as_before({k: v for k, v in resolved.items()
                                   if k not in ("name", "description", "output_dir", "sweep")},
                                  _SCENARIO_AS_BEFORE_FIELDS)
    engine = material.get("engine")
    if isinstance(engine, dict) and isinstance(engine.get("disaggregation"), dict):
        material["engine"] = {**engine, "disaggregation": _without_as_before(
            engine["disaggregation"], _PREFILL_PARALLEL_AS_BEFORE_FIELDS)}
    if isinstance(material.get("systems"), list):
        material["systems"] = [_without_idle_swap(_without_as_before(system, _AS_BEFORE_FIELDS))
                               for system in material["systems"]]
    if file_digests:
        material["input_files"] = file_digests
    text = json.dumps(_without_nulls(material), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _without_as_before(settings: Any, fields: dict[tuple[str, str], Any]) -> Any:
    """Resolved settings (a system's, or the scenario's) less the later ``fields`` at their
    as-before value."""
    if not isinstance(settings, dict):
        return settings
    settings = dict(settings)
    for (section, field_name), value in fields.items():
        part = settings.get(section)
        if isinstance(part, dict) and field_name in part and part[field_name] == value:
            settings[section] = {k: v for k, v in part.items() if k != field_name}
    return settings


def _without_idle_swap(system: Any) -> Any:
    """A system's resolved settings less how a swap copies where nothing swaps (a field
    added later, with a default other than what kvsim did before: it changes the runs that
    swap, and no other)."""
    scheduler = system.get("scheduler") if isinstance(system, dict) else None
    if not isinstance(scheduler, dict) or scheduler.get("preemption_mode") != "recompute":
        return system
    return {**system, "scheduler": {k: v for k, v in scheduler.items()
                                    if k != "swap_copy_overhead_s"}}


def _without_nulls(value: Any) -> Any:
    """``value`` with every mapping entry whose value is null removed, at any depth."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _combinations(config: SweepConfig) -> Iterator[dict[str, Any]]:
    """The grid's every combination, each with every row of the zip."""
    grid_paths = list(config.grid)
    zip_rows = ([dict(zip(config.zip, row, strict=True))
                 for row in zip(*config.zip.values(), strict=True)] if config.zip else [{}])
    for values in itertools.product(*config.grid.values()):
        for zipped in zip_rows:
            yield {**dict(zip(grid_paths, values, strict=True)), **zipped}


def sweep_config(raw: dict[str, Any], source: str) -> SweepConfig:
    """The raw scenario's ``sweep`` section, validated."""
    if "sweep" not in raw or raw["sweep"] is None:
        raise SweepError(f"{source}: no sweep section (use kvsim run for a single run)")
    if raw["sweep"] in ({}, []):
        raise SweepError(f"{source}: sweep: an empty section; give grid, zip or seeds (and "
                         "layouts) to sweep over")
    if not isinstance(raw["sweep"], dict):
        raise SweepError(f"{source}: sweep: expected a mapping of grid, zip, seeds and "
                         f"layouts, got {raw['sweep']!r}")
    _refuse_unknown_keys(raw["sweep"], source)
    try:
        return SweepConfig.model_validate(raw["sweep"])
    except ValidationError as exc:
        raise SweepError(f"{source}: sweep: {validation_message(exc, raw['sweep'])}") from None


def _refuse_unknown_keys(section: dict[str, Any], source: str) -> None:
    """A key the sweep section (or its layouts) does not take, named with the keys it does:
    the scenario's own hints would point at its fields (``gpus`` → ``gpu``)."""
    layouts = section.get("layouts")
    for where, keys, model in (("", section, SweepConfig),
                               ("layouts.", layouts if isinstance(layouts, dict) else {},
                                LayoutsConfig)):
        for key in keys:
            if key not in model.model_fields:
                belongs = (" (it belongs under layouts)"
                           if not where and key in LayoutsConfig.model_fields else "")
                raise SweepError(f"{source}: sweep: {where}{key}: unknown key; expected "
                                 f"{', '.join(model.model_fields)}{belongs}")


def expand(raw: dict[str, Any], source: str, *, quick: bool = False,
           notes: list[str] | None = None, base_dir: Path = Path(".")) -> list[SweepPoint]:
    """Every point of the sweep, each validated as a full scenario; the layouts
    ``sweep.layouts`` refuses are told in ``notes``, where given. Under ``quick`` a point
    that replays its trace file to the end replays a quarter of that file (read from
    ``base_dir``, the scenario's folder)."""
    config = sweep_config(raw, source)
    base = {k: v for k, v in raw.items() if k != "sweep"}
    if quick:
        base, config = _shrink(base, config)
    seeds = config.seeds or [int(base.get("seed", 0))]
    combinations = (list(_combinations(config)) if config.layouts is None
                    else _laid_out(base, config, source, notes))
    points: list[SweepPoint] = []
    counts: dict[str, int] = {}  # requests in each trace file read, by _files_key
    for index, params in enumerate(combinations):
        for seed in seeds:
            data = copy.deepcopy(base)
            for path, value in params.items():
                set_path(data, path, value, label=f"{source}: sweep path")
            data["seed"] = seed
            try:
                scenario = scenario_from_dict(data, source)
                if quick and scenario.stop.open_ended:
                    data["stop"] = {"num_requests": _quarter(
                        _trace_count(scenario, base_dir, counts, source, params))}
                    scenario = scenario_from_dict(data, source)
            except ScenarioError as exc:
                raise SweepError(f"{exc}{_where(params)}") from None
            resolved = scenario.model_dump(mode="json")
            points.append(SweepPoint(index, seed, params, resolved,
                                     config_key(resolved, input_digests(resolved, base_dir))))
    first_with: dict[str, SweepPoint] = {}
    for point in points:
        twin = first_with.setdefault(point.key, point)
        if twin is not point:
            raise SweepError(
                f"{source}: sweep: the points [{_point_text(twin.params, twin.seed)}] and "
                f"[{_point_text(point.params, point.seed)}] resolve to the same scenario (a "
                "value given twice, or a path that changes nothing)")
    return points


def _shrink(base: dict[str, Any], config: SweepConfig) -> tuple[dict[str, Any], SweepConfig]:
    """``--quick``: a quarter of the requests, at most three values per numeric axis (or
    three rows of a zip of numbers), one seed."""
    base = copy.deepcopy(base)
    stop = base.get("stop", {})
    if isinstance(stop, dict) and isinstance(stop.get("num_requests"), int):
        stop["num_requests"] = _quarter(stop["num_requests"])
    if isinstance(stop, dict) and isinstance(stop.get("duration_s"), int | float):
        stop["duration_s"] = stop["duration_s"] / 4

    def numeric(values: list[Any]) -> bool:
        return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)

    def thin(values: list[Any]) -> list[Any]:
        if len(values) <= 3 or not numeric(values):  # every policy/name is kept
            return values
        return [values[0], values[len(values) // 2], values[-1]]

    grid = {k: thin(v) for k, v in config.grid.items()}
    zipped = config.zip
    if zipped and all(numeric(values) for values in zipped.values()):  # (as in the grid)
        length = len(next(iter(zipped.values())))
        keep = sorted({0, length // 2, length - 1})
        zipped = {k: [v[i] for i in keep] for k, v in zipped.items()}
    seeds = (config.seeds or [int(base.get("seed", 0))])[:1]
    return base, SweepConfig(grid=grid, zip=zipped, seeds=seeds, layouts=config.layouts)


def _quarter(num_requests: int) -> int:
    """``--quick``'s count of requests: a quarter, but enough to show a trend."""
    return max(20, num_requests // 4)


def _where(params: dict[str, Any]) -> str:
    """`` [at sweep point PATH=VALUE, ...]``, a sweep point named by its parameters for a
    message's end; nothing for a point that changes nothing (a sweep over seeds alone)."""
    if not params:
        return ""
    return f" [at sweep point {_point_text(params)}]"


def _point_text(params: dict[str, Any], seed: int | None = None) -> str:
    """A sweep point's parameters as ``PATH=VALUE, ...`` (and its seed, where given)."""
    return ", ".join([*(f"{p}={v!r}" for p, v in params.items()),
                      *([] if seed is None else [f"seed {seed}"])])


def _files_key(resolved: dict[str, Any]) -> str:
    """What decides the files a point's workload reads and the trace they give."""
    return json.dumps([resolved["workload"], resolved["model"], resolved["max_model_len"]],
                      sort_keys=True)


def _trace_count(scenario: Scenario, base_dir: Path, counts: dict[str, int], source: str,
                 params: dict[str, Any]) -> int:
    """The requests in the trace file a point replays to its end (each file read once)."""
    from sim.engine import scenario_trace
    from workloads import TraceError, TraceImportError, WorkloadError

    key = _files_key(scenario.model_dump(mode="json"))
    if key not in counts:
        try:
            counts[key] = len(scenario_trace(scenario, base_dir))
        except (TraceError, TraceImportError, WorkloadError) as exc:
            raise SweepError(f"{source}: {exc}{_where(params)}") from None
    return counts[key]


# ---------------------------------------------------------------------- running
def run_point(scenario: dict[str, Any], base_dir: str, run_dir: str) -> dict[str, Any]:
    """Run one point into ``run_dir`` (in a worker); never raises."""
    from sim.engine import run_scenario
    from sim.results import write_run

    start = time.perf_counter()
    try:
        result = run_scenario(scenario_from_dict(scenario), Path(base_dir))
        write_run(result, Path(run_dir))
        return {"status": "ok", "summaries": {n: r.summary for n, r in result.systems.items()},
                "build": build_id(), "wall_s": time.perf_counter() - start}
    except Exception as exc:  # recorded with the point; the sweep goes on
        error = f"{type(exc).__name__}: {exc}"
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        write_json({"error": error, "traceback": traceback.format_exc()},
                   Path(run_dir) / "error.json")
        return {"status": "failed", "error": error, "build": build_id(),
                "wall_s": time.perf_counter() - start}


@dataclass
class SweepOutcome:
    """What a sweep did: the table, and how many points ran, were skipped or failed;
    ``older``: how many of the skipped another kvsim build made (or an unknown one)."""

    table: pd.DataFrame
    ran: int
    skipped: int
    failed: int
    out_dir: Path
    older: int = 0


def _load_done(run_dir: Path) -> dict[str, Any] | None:
    """A finished point's outcome as its run folder holds it; None where it must run."""
    if not (run_dir / "summary.json").is_file():
        return None
    try:
        summary = read_summary_file(run_dir)
    except RunFolderError:
        return None  # a torn write from a killed run, or a damaged file: rerun the point
    return {"status": "ok", "summaries": summary.systems,
            "build": summary.made_by["build"] if summary.made_by else None}


def results_table(points: list[SweepPoint], outcomes: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per (point, system, seed): the point's parameters and every summary metric."""
    rows = []
    for point in points:
        outcome = outcomes.get(point.key)
        if outcome is None:
            continue
        base = {"point": point.point, "seed": point.seed, "key": point.key,
                "build": outcome.get("build"),
                **{f"param:{p}": v for p, v in point.params.items()}}
        if outcome["status"] == "ok":
            for system, summary in outcome["summaries"].items():
                rows.append({**base, "system": system, "status": "ok", "error": "",
                             **summary})
        else:
            for system in (s["name"] for s in point.scenario["systems"]):
                rows.append({**base, "system": system, "status": "failed",
                             "error": outcome["error"]})
    table = pd.DataFrame(rows)
    if not table.empty:
        # Column order must not depend on where a summary came from (memory or JSON).
        ids = ["point", "seed", "key", "build",
               *sorted(c for c in table if c.startswith("param:")),
               "system", "status", "error"]
        table = table[ids + sorted(c for c in table.columns if c not in ids)]
        order = {s["name"]: i for i, s in enumerate(points[0].scenario["systems"])}
        table["_order"] = table["system"].map(order).fillna(len(order))
        table = table.sort_values(["point", "_order", "seed"], kind="stable").drop(
            columns="_order").reset_index(drop=True)
        # None where a system lacks the feature (a prefix cache, objectives): NaN here.
        for column in ("prefix_hit_rate", "preempted_hit_rate", *ONLY_WHEN_SET, *SLO_KEYS):
            if column in table:
                table[column] = table[column].astype(float)
        table = params_as_text(table)
    return table


def params_as_text(table: pd.DataFrame) -> pd.DataFrame:
    """A swept field whose values include mappings or lists (a whole section swept, null
    switching it off), or mix kinds (``[true, 0]``, which the field reads alike), as JSON
    text, every value of it, so that tables group by it and files store one type per
    column."""
    for column in table.columns:
        values = table[column]
        if column.startswith("param:") and values.dtype == object and (
                any(isinstance(v, dict | list) for v in values)
                or len({type(v) for v in values if v is not None}) > 1):
            table[column] = values.map(json.dumps)
    return table


# An executor runs ``fn(*args)`` for each (key, args) task and yields (key, result) as they
# finish: local processes or Ray tasks, the same results either way.
Tasks = list[tuple[Any, tuple[Any, ...]]]
Executor = Callable[[Callable[..., Any], Tasks], Iterator[tuple[Any, Any]]]


class _WorkerState:
    """A local worker process's answer to Ctrl-C, which reaches every process of the
    terminal's group: the task it runs stops, and the tasks already queued for it (which
    the pool can no longer take back) stop at once, so that the command ends in the time a
    task takes to notice rather than the time the queued ones take to run."""

    running = False  # a task runs: Ctrl-C raises KeyboardInterrupt in it
    interrupted = False  # Ctrl-C came: a task that starts stops at once

    @classmethod
    def install(cls) -> None:
        """The pool's worker initializer."""
        signal.signal(signal.SIGINT, cls._on_interrupt)

    @classmethod
    def _on_interrupt(cls, signum: int, frame: Any) -> None:
        cls.interrupted = True
        if cls.running:  # (an idle worker raising would die with a traceback)
            raise KeyboardInterrupt

    @classmethod
    def run(cls, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, unless Ctrl-C came before."""
        if cls.interrupted:
            raise KeyboardInterrupt
        cls.running = True
        try:
            return fn(*args)
        finally:
            cls.running = False


def _pool_context() -> BaseContext | None:
    """How a local pool starts its workers: forked from this process (None: the platform's
    way), which is quick, as they share what it has loaded; but where this process has run
    Ray, from a fork server, a clean interpreter with kvsim loaded. Ray's runtime (its gRPC
    threads) does not survive a fork: a worker forked from it can crash at once."""
    if "ray" not in sys.modules:
        return None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["sim.sweep", "sim.capacity"])
    return context


def _local_executor(jobs: int) -> Executor:
    def execute(fn: Callable[..., Any], tasks: Tasks) -> Iterator[tuple[Any, Any]]:
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=_pool_context(),
                                   initializer=_WorkerState.install)
        try:
            pending: dict[Future, Any] = {pool.submit(_WorkerState.run, fn, *args): key
                                          for key, args in tasks}
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    yield pending.pop(future), future.result()
        finally:
            # Left early (Ctrl-C, an error): the tasks not started are dropped, not run
            # before the pool lets go, and those running end (Ctrl-C reaches them too).
            pool.shutdown(wait=True, cancel_futures=True)

    return execute


def _ray_executor(jobs: int, address: str | None) -> Executor:
    try:
        import ray
    except ImportError:
        raise SweepError("--executor ray needs Ray: pip install 'kvsim[ray]'") from None

    def execute(fn: Callable[..., Any], tasks: Tasks) -> Iterator[tuple[Any, Any]]:
        started_here = not ray.is_initialized()
        if started_here:
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(num_cpus=jobs, log_to_driver=False, include_dashboard=False)
        remote = ray.remote(num_cpus=1)(fn)
        pending = {}
        try:
            pending = {remote.remote(*args): key for key, args in tasks}
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    yield pending.pop(ref), ray.get(ref)
        finally:
            for ref in pending:  # left early: a cluster's tasks would run on without it
                ray.cancel(ref)
            if started_here:
                ray.shutdown()

    return execute


def make_executor(executor: str, jobs: int | None, address: str | None = None) -> Executor:
    """``local`` processes (``jobs``, default all cores) or ``ray`` tasks (a local Ray of
    ``jobs`` CPUs, or the cluster at ``address``)."""
    jobs = jobs or os.cpu_count() or 1
    return _ray_executor(jobs, address) if executor == "ray" else _local_executor(jobs)


def with_overrides(raw: Any, overrides: dict[str, Any] | None) -> Any:
    """A raw scenario with ``--set PATH=VALUE`` overrides applied (paths as a sweep's);
    the original is left as it was."""
    if not overrides:
        return raw
    if not isinstance(raw, dict):
        return raw  # scenario_from_dict says what is wrong with it
    data = copy.deepcopy(raw)
    for path, value in overrides.items():
        set_path(data, path, value, label="--set")
    return data


def load_sweep_points(path: Path, *, quick: bool = False,
                      overrides: dict[str, Any] | None = None,
                      notes: list[str] | None = None) -> tuple[Scenario, list[SweepPoint]]:
    """The base scenario of a sweep file (valid on its own) and every point, each validated;
    ``overrides`` change the base before the grid is laid over it (``notes``: see
    :func:`expand`)."""
    from sim.scenario import read_scenario_file

    raw = with_overrides(read_scenario_file(path), overrides)
    source = f"{path} (with --set)" if overrides else str(path)
    scenario = scenario_from_dict(raw, source)
    return scenario, expand(raw, source, quick=quick, notes=notes, base_dir=path.parent)


def read_files(points: list[SweepPoint], base_dir: Path, source: str) -> None:
    """Read the files each workload of the sweep reads before any point runs: a trace file
    missing or with a bad row fails every point that reads it, and is bad input."""
    from sim.engine import read_workload_files
    from workloads import TraceError, TraceImportError, WorkloadError

    read: set[str] = set()
    for point in points:
        resolved = point.scenario
        key = _files_key(resolved)
        if key in read:
            continue
        read.add(key)
        try:
            read_workload_files(scenario_from_dict(resolved, source), base_dir)
        except (TraceError, TraceImportError, WorkloadError) as exc:
            raise SweepError(f"{source}: {exc}{_where(point.params)}"
                             ) from None


def run_sweep(
    path: Path,
    *,
    out_dir: Path | None = None,
    jobs: int | None = None,
    executor: str = "local",
    address: str | None = None,
    quick: bool = False,
    progress: Callable[[int, int], Callable[[int], None]] | None = None,
    overrides: dict[str, Any] | None = None,
    notify: Callable[[str], None] | None = None,
    rerun_older: bool = False,
) -> SweepOutcome:
    """Expand, skip finished points, run the rest, and write ``results.parquet``;
    ``notify`` is told the layouts ``sweep.layouts`` refuses, before any run. A finished
    point that another kvsim build made is kept (the table's ``build`` column says which),
    or run again under ``rerun_older``."""
    notes: list[str] = []
    scenario, points = load_sweep_points(path, quick=quick, overrides=overrides, notes=notes)
    read_files(points, path.parent, str(path))
    if notify is not None:
        for note in notes:
            notify(note)
    out_dir = out_dir or Path(scenario.output_dir or Path("runs") / scenario.name)
    if quick:
        out_dir = out_dir.with_name(out_dir.name + "-quick")
    runs = out_dir / "runs"
    make_output_folder(out_dir)
    make_output_folder(runs)
    write_json({"scenario": str(path), "points": len(points), "quick": quick,
                "params": sorted({p for pt in points for p in pt.params})},
               out_dir / "sweep.json")
    outcomes: dict[str, dict[str, Any]] = {}
    todo = []
    older = 0
    for point in points:
        done = _load_done(runs / point.key)
        is_older = done is not None and done["build"] != build_id()
        older += is_older
        if done is not None and not (is_older and rerun_older):
            outcomes[point.key] = done
        else:
            todo.append((point, str(path.parent.resolve()), str(runs / point.key)))
    skipped = len(points) - len(todo)
    execute = make_executor(executor, jobs, address)
    tick = progress(len(todo), skipped) if progress and todo else None
    failed = 0
    for point, outcome in execute(run_point, [(point, (point.scenario, base, run))
                                              for point, base, run in todo]):
        outcomes[point.key] = outcome
        failed += outcome["status"] != "ok"
        if tick:
            tick(1)
    table = results_table(points, outcomes)
    write_table(table, out_dir / "results.parquet")
    return SweepOutcome(table, ran=len(todo), skipped=skipped, failed=failed, out_dir=out_dir,
                        older=older)
