"""The ``kvsim`` command line.

Exit codes: 0 success, 1 the run failed, 2 bad input (scenario, trace, arguments). Errors
are one line on stderr naming the file and field; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import math
import os
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, get_args

from sim import CORE, __version__
from sim.bench import DEFAULT_SIZES, request_counts
from sim.metrics import format_comparison, format_summary
from sim.provenance import build_id, made_by

if TYPE_CHECKING:
    import pandas as pd

    from sim.hit_curve import HitCurve
    from sim.presets import ModelSpec
    from sim.scenario import Scenario
    from workloads.spec import ColumnMap

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
COMPARED_SETTINGS = 8  # the settings kvsim compare names that differ, at most, a run


class BadInput(Exception):
    """Raised for user errors: one line, exit code 2."""


class Interrupted(Exception):
    """Raised for Ctrl-C in a command that keeps its finished work: says where, exit 1."""


class _ReaderMayLeave:
    """Standard output that outlives its reader.

    When ``kvsim run … | head`` stops reading, writing raises BrokenPipeError: from then on
    the output goes to /dev/null, and the command still writes every file it owes (the
    report comes after the table) and returns its own exit code.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _bad_input_types() -> tuple[type[BaseException], ...]:
    from reports.sweep_report import SweepReportError
    from sim.capacity import CapacityError
    from sim.presets import SizingError
    from sim.results import OutputFolderError, RunFolderError
    from sim.scenario import ScenarioError
    from sim.sweep import SweepError
    from sim.timing import CalibrationError
    from workloads import TraceError, TraceImportError, WorkloadError

    return (BadInput, CapacityError, ScenarioError, SizingError, CalibrationError, TraceError,
            TraceImportError, WorkloadError, SweepError, SweepReportError, OutputFolderError,
            RunFolderError)


def _progress_bar(total: int, desc: str, unit: str, *, quiet: bool = False,
                  leave: bool = True) -> Callable[[int], None]:
    """A tqdm bar on stderr (none when ``quiet`` or stderr is no terminal), advanced by the
    returned function and closed when it reaches ``total``."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, leave=leave, mininterval=0.5,
               disable=True if quiet else None, file=sys.stderr)

    def update(n: int) -> None:
        bar.update(n)
        if bar.n >= total:
            bar.close()

    return update


def _progress_factory(quiet: bool) -> Callable[[str, int], Callable[[int], None] | None]:
    """A bar per system of a run, cleared when the system is done."""
    def factory(name: str, total: int) -> Callable[[int], None] | None:
        return None if quiet else _progress_bar(total, name, "req", leave=False)

    return factory


# ---------------------------------------------------------------------- commands
def cmd_run(args: argparse.Namespace) -> int:
    from sim.api import load
    from sim.engine import memory_summary, run_scenario
    from sim.results import run_notes, write_run

    path = Path(args.scenario)
    scenario, _ = load(path, args.seed, dict(args.overrides or []))
    out = Path(args.out or scenario.output_dir or Path("runs") / scenario.name)
    made = _make_output_folder(out)
    try:
        result = run_scenario(scenario, path.parent, progress=_progress_factory(args.quiet))
    except _bad_input_types() as exc:
        _unmake_empty(out, made)
        raise BadInput(f"{path}: {exc}") from None
    write_run(result, out)
    changed = "".join(f", {field}={value}" for field, value in (args.overrides or []))
    print(f"{scenario.name}: {len(next(iter(result.systems.values())).requests):,} requests, "
          f"seed {scenario.seed}{changed}")
    print(memory_summary(scenario))
    for note in [*result.trace_notes, *scenario.setting_notes()]:
        print(f"note: {note}")
    if scenario.sweep:
        print(f"note: {path} has a sweep section; this ran its base scenario only "
              f"(kvsim sweep {path} runs the grid)")
    summaries = {n: r.summary for n, r in result.systems.items()}
    print(format_summary(summaries))
    for note in run_notes(summaries):
        print(f"note: {note}")
    if not args.no_report:
        report = _write_report(out)
        if report:
            print(f"report: {report}")
    print(f"results: {out}")
    return EXIT_OK


def _make_output_folder(out: Path) -> bool:
    """Create the output folder before any work (so that a bad ``--out`` costs none); True
    if this made it, for :func:`_unmake_empty` to take it back on a refusal."""
    from sim.results import make_output_folder

    made = not out.exists()
    make_output_folder(out)
    return made


def _unmake_empty(out: Path, made: bool) -> None:
    """Remove the output folder a refused command ``made``, as long as nothing was written
    in it."""
    if made and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


def _write_report(out: Path) -> Path:
    from reports.html import write_report

    return write_report(out)


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless one: "1 point", "3 points"."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _older_note(older: int, rerun_older: bool, table_file: str, does: str) -> str:
    """What a resumed sweep (``kvsim sweep``, ``kvsim capacity --sweep``: ``does`` runs or
    searches a point) says of the ``older`` points it found another kvsim build had done,
    kept or done again (``rerun_older``); ``table_file`` names each row's build."""
    was, them = ("was", "it") if older == 1 else ("were", "them")
    if rerun_older:
        return f"{_count(older, 'point')} done by another kvsim build {was} done again"
    return (f"{older} of the points done before {was} done by another kvsim build than this "
            f"one ({build_id()}), and {'is' if older == 1 else 'are'} kept ({table_file}'s "
            f"build column names each one's): --rerun-older {does} {them} again")


def _note(line: str) -> None:
    """Print a note on what a command was asked and does not do."""
    print(f"note: {line}")


def cmd_sweep(args: argparse.Namespace) -> int:
    from sim.sweep import run_sweep

    def progress(total: int, skipped: int) -> Callable[[int], None]:
        if skipped:
            print(f"resuming: {_count(skipped, 'finished point')} skipped")
        return _progress_bar(total, "sweep", "run", quiet=args.quiet)

    try:
        outcome = run_sweep(Path(args.scenario), out_dir=Path(args.out) if args.out else None,
                            jobs=args.jobs, executor=args.executor, address=args.address,
                            quick=args.quick, progress=progress,
                            overrides=dict(args.overrides or []), notify=_note,
                            rerun_older=args.rerun_older)
    except KeyboardInterrupt:
        raise Interrupted("the points that finished are kept, each in its run folder: the "
                          "same command goes on from there") from None
    table = outcome.table
    print(f"sweep: {_count(outcome.ran, 'point')} ran, {outcome.skipped} already done, "
          f"{outcome.failed} failed; {len(table)} rows in {outcome.out_dir / 'results.parquet'}")
    if outcome.older:
        _note(_older_note(outcome.older, args.rerun_older, "results.parquet", "runs"))
    if not table.empty and "throughput_tok_s" in table:
        print(_sweep_means(table, SWEEP_TABLE_METRICS))
    if table is not None and (table.get("status") == "failed").any():
        for error in table.loc[table["status"] == "failed", "error"].unique()[:5]:
            print(f"failed: {error}", file=sys.stderr)
    if not args.no_report and not table.empty:
        from reports import write_any_report

        print(f"report: {write_any_report(outcome.out_dir)}")
    return EXIT_FAILED if outcome.failed else EXIT_OK


SWEEP_TABLE_METRICS = ("throughput_tok_s", "usd_per_million_tokens", "e2e_p90_s",
                       "slo_attainment", "slo_tightest_attainment", "shed", "abandoned",
                       "abandoned_seated", "abandoned_output_tokens", "waste_frac",
                       "prefix_hit_rate", "reserve_holds", "swap_preemptions",
                       "discarded_output_tokens", "reservation_overflows",
                       "rank_wait_frac", "pipeline_bubble_frac")


def _sweep_means(table: pd.DataFrame, metrics: Sequence[str]) -> str:
    """The sweep's finished runs averaged over seeds, one row per point and system, with
    ``metrics`` labelled and formatted as in a run's summary."""
    import pandas as pd

    from sim.metrics import labelled_sweep_means

    seeds = table.loc[table["status"] == "ok", "seed"].nunique()
    shown = labelled_sweep_means(table, metrics)
    with pd.option_context("display.max_rows", 500, "display.width", 200):
        text = shown.to_string(index=False)
    return text + (f"\n(means over {seeds} seeds)" if seeds > 1 else "")


def cmd_capacity(args: argparse.Namespace) -> int:
    from sim.api import load
    from sim.capacity import PROBES_FOLDER, capacity_by_seed
    from sim.scenario import scenario_from_dict

    path = Path(args.scenario)
    scenario, _ = load(path, args.seed, dict(args.overrides or []))
    bounds = {"ttft_s": args.ttft_s, "tpot_s": args.tpot_s, "e2e_s": args.e2e_s,
              "max_itl_s": args.max_itl_s, "attainment": args.attainment, "judge": args.judge}
    given = {k: v for k, v in bounds.items() if v is not None}
    if (given or args.seed is not None or args.seeds) and args.sweep:
        raise BadInput("--sweep searches the file's own slo section and seeds; put the bounds "
                       "or seeds there")
    in_processes = "a search of one scenario runs its systems in local processes (--jobs)"
    sweep_only = {  # each given without --sweep, and why it has nothing to do there
        "--quick": (args.quick, "for one scenario, fewer requests are --set "
                                "stop.num_requests=N"),
        "--executor": (args.executor != "local", in_processes),
        "--address": (args.address is not None, in_processes),
        "--rerun-older": (args.rerun_older, "a search of one scenario reads back only the "
                                            "runs this kvsim build made"),
    }
    for option, (given_here, why) in sweep_only.items():
        if given_here and not args.sweep:
            raise BadInput(f"{option} goes with --sweep: {why}")
    if given:  # the command line's objectives replace the file's, bound by bound
        slo = {**(scenario.slo.model_dump(exclude_none=True) if scenario.slo else {}), **given}
        scenario = scenario_from_dict({**scenario.model_dump(), "slo": slo}, "command line")
    runs = Path(scenario.output_dir or Path("runs") / scenario.name)
    out = Path(args.out or runs.with_name(f"{runs.name}-capacity"))
    made = _make_output_folder(out)
    if args.sweep:
        try:
            return _capacity_sweep(path, args, out, scenario)
        except BadInput:
            _unmake_empty(out, made)
            raise

    slo = scenario.slo.model_dump() if scenario.slo else {}
    # Each system (and seed) is searched in a process of its own, which prints its probes
    # as they end.
    progress = None if args.quiet else functools.partial(
        _print_probe, slo=slo, with_seed=bool(args.seeds and len(args.seeds) > 1))
    try:
        knob, capacities = capacity_by_seed(scenario, path.parent,
                                            args.seeds or [scenario.seed],
                                            rel_tol=args.rel_tol, max_probes=args.max_probes,
                                            systems=args.system, progress=progress,
                                            jobs=args.jobs or os.cpu_count() or 1,
                                            probe_dir=out / PROBES_FOLDER)
    except _bad_input_types() as exc:
        if (out / PROBES_FOLDER).is_dir() and not any((out / PROBES_FOLDER).iterdir()):
            (out / PROBES_FOLDER).rmdir()
        _unmake_empty(out, made)
        raise BadInput(f"{path}: {exc}") from None
    except KeyboardInterrupt:
        raise Interrupted(f"the runs the searches made are kept in {out / PROBES_FOLDER}: the "
                          "same command goes on from there") from None
    kept = sum(p.kept for c in capacities for p in c.probes)
    if kept:
        print(f"resuming: {_count(kept, 'run')} of the searches read back from "
              f"{out / PROBES_FOLDER}, made before by this kvsim build")
    if scenario.sweep:
        print(f"note: {path} has a sweep section; this searched its base scenario only "
              "(--sweep searches every point)")
    for note in scenario.setting_notes():
        print(f"note: {note}")
    print(_capacity_text(scenario, knob, capacities))
    print(f"results: {_write_capacity(scenario, knob, capacities, out, not args.no_report)}")
    return EXIT_OK


def _print_probe(probe: Any, slo: dict[str, Any], with_seed: bool = False) -> None:
    """``kvsim capacity``'s line for one run of a search (naming its seed, ``with_seed``)."""
    from sim.slo import describe_attainment

    seed = f" (seed {probe.seed})" if with_seed else ""
    line = (f"  {probe.system}{seed}: {probe.offered_req_s:,.4g} req/s → "
            f"{describe_attainment(probe.attainment, slo)}, "
            f"{'holds' if probe.holds else 'misses'}{' (run before)' if probe.kept else ''}\n")
    # One write per line: the searches print from processes of their own, and print()'s
    # separate write of the newline let another process's line land in the middle.
    sys.stderr.write(line)
    sys.stderr.flush()


def _capacity_sweep(path: Path, args: argparse.Namespace, out: Path, scenario: Any) -> int:
    """``kvsim capacity --sweep``: every point's search, a table, figures; ``scenario`` is
    the sweep's base (its ``sweep`` section with it)."""
    from reports.capacity_report import (
        SCENARIO_FILE,
        SWEEP_TABLE,
        capacity_metrics,
        write_capacity_report,
    )
    from sim.capacity import POINTS_FOLDER, capacity_sweep, unsettled_note
    from sim.results import swept_value_text, write_table, write_yaml

    def progress(total: int, skipped: int) -> Callable[[int], None]:
        if skipped:
            print(f"resuming: {_count(skipped, 'point')} searched before skipped")
        return _progress_bar(total, "capacity", "point", quiet=args.quiet)

    try:
        outcome = capacity_sweep(path, jobs=args.jobs, executor=args.executor,
                                 address=args.address, rel_tol=args.rel_tol,
                                 max_probes=args.max_probes, quick=args.quick,
                                 overrides=dict(args.overrides or []), systems=args.system,
                                 notify=_note, progress=progress, out_dir=out,
                                 rerun_older=args.rerun_older)
    except _bad_input_types() as exc:
        # The sweep's own checks name the file already; the search's do not.
        raise BadInput(str(exc) if str(exc).startswith(f"{path}") else f"{path}: {exc}"
                       ) from None
    except KeyboardInterrupt:
        raise Interrupted(f"the points searched are kept in {out / POINTS_FOLDER}: the "
                          "same command goes on from there") from None
    table = outcome.table
    print(f"capacity: {_count(outcome.searched, 'point')} searched, {outcome.skipped} "
          f"searched before, {outcome.failed} failed")
    if outcome.older:
        _note(_older_note(outcome.older, args.rerun_older, SWEEP_TABLE, "searches"))
    written = write_table(table, out / SWEEP_TABLE)
    write_yaml(scenario.model_dump(mode="json"), out / SCENARIO_FILE)
    if not args.no_report:
        write_capacity_report(out)  # figures and report.html, drawn from the table
    fields = [c.removeprefix("param:") for c in table.columns if c.startswith("param:")]
    if (table["status"] == "ok").any():  # (with every point failed, only their errors)
        print(_sweep_means(table, capacity_metrics(table)))
        print("(the other columns: the run at each capacity)")
    failed = table[table["status"] != "ok"]
    for error in failed["error"].unique()[:5]:
        print(f"failed: {error}", file=sys.stderr)
    for _, row in table[(table["status"] == "ok") & table["capacity_req_s"].notna()].iterrows():
        where = ", ".join(f"{f}={swept_value_text(row['param:' + f])}" for f in fields)
        note = unsettled_note(str(row["system"]), int(row["requests"]),
                              float(row["capacity_req_s"]), float(row["makespan_s"]))
        if note:
            print(f"note ({where}): {note}")
    print(f"results: {written}")
    return EXIT_FAILED if len(failed) else EXIT_OK


def _capacity_text(scenario: Any, knob: Any, capacities: list[Any]) -> str:
    """What ``kvsim capacity`` prints: each system's capacity (with several seeds, their
    median and spread), then the summaries of the runs at those loads side by side."""
    from sim.capacity import unsettled_note
    from sim.results import schedule_notes
    from sim.slo import describe_slo

    slo = scenario.slo.model_dump()
    by_system = _by_system(capacities)
    seeds = sorted({c.seed for c in capacities})
    lines = [f"{scenario.name}: capacity with {describe_slo(slo)}, "
             f"{knob.path} searched, seed{'s' if len(seeds) > 1 else ''} "
             f"{', '.join(str(seed) for seed in seeds)}"]
    width = max(len(name) for name in by_system) + 2
    for name, searches in by_system.items():
        runs = sum(len(c.probes) for c in searches)
        if len(searches) == 1:
            text = _search_text(searches[0], knob, slo)
        else:
            text = _seeds_text(searches, knob, slo)
        lines.append(f"  {name:<{width}}{text}  [{runs} runs]")
    # The run at each system's capacity; with several seeds, at its median seed's.
    at_capacity = {}
    for name, searches in by_system.items():
        middle = _median_search(searches, knob)
        if middle is not None and middle.held is not None:
            label = name if len(searches) == 1 else f"{name} (seed {middle.seed})"
            at_capacity[label] = (middle, middle.at(middle.held).summary)
    if at_capacity:
        summaries = {label: summary for label, (_, summary) in at_capacity.items()}
        lines += ["", "at capacity:", format_summary(summaries)]
        lines += [f"note (at capacity): {note}" for note in schedule_notes(summaries)]
        unsettled = [unsettled_note(label, summary["requests"], knob.offered_req_s(c.held),
                                    summary["makespan_s"])
                     for label, (c, summary) in at_capacity.items()]
        lines += [f"note (at capacity): {note}" for note in unsettled if note]
    return "\n".join(lines)


def _by_system(capacities: list[Any]) -> dict[str, list[Any]]:
    """The searches of each system, seed by seed, systems in the order searched."""
    grouped: dict[str, list[Any]] = {}
    for c in capacities:
        grouped.setdefault(c.system, []).append(c)
    return grouped


def _search_text(c: Any, knob: Any, slo: dict[str, Any]) -> str:
    """One search's answer: the capacity and the load that missed, or why there is none."""
    from sim.slo import describe_attainment

    if c.held is None:
        lightest = c.at(c.failed)
        text = (f"{'none: even' if c.converged else 'below'} "
                f"{lightest.offered_req_s:,.4g} req/s, which misses "
                f"({describe_attainment(lightest.attainment, slo)})")
    elif c.failed is None:
        text = (f"over {knob.offered_req_s(c.held):,.4g} req/s: every load tried holds"
                + (" (the search stops at 1024× the scenario's)" if c.converged else ""))
    else:
        text = (f"{knob.offered_req_s(c.held):,.4g} req/s"
                + (f" (speed ×{c.held:.4g})" if knob.path.endswith("speed") else "")
                + f", misses at {knob.offered_req_s(c.failed):,.4g}")
    return text + ("" if c.converged else " (not converged: raise --max-probes)")


def _seeds_text(searches: list[Any], knob: Any, slo: dict[str, Any]) -> str:
    """A system's capacity over several seeds: the median, the range and each seed's; each
    seed's own answer where one of them found no capacity within the range searched."""
    if any(c.held is None or c.failed is None for c in searches):
        return "; ".join(f"seed {c.seed}: {_search_text(c, knob, slo)}" for c in searches)
    values = [knob.offered_req_s(c.held) for c in searches]
    middle = statistics.median(values)
    each = ", ".join(f"{c.seed}: {v:,.4g}" for c, v in zip(searches, values, strict=True))
    unconverged = [str(c.seed) for c in searches if not c.converged]
    return (f"median {middle:,.4g} req/s over {len(searches)} seeds, "
            f"{min(values):,.4g}–{max(values):,.4g} (seed {each})"
            + (f" (seed {', '.join(unconverged)} not converged: raise --max-probes)"
               if unconverged else ""))


def _median_search(searches: list[Any], knob: Any) -> Any:
    """The search whose capacity is the median of the seeds' (the lower of the middle two
    for an even count; a seed without one counts as the lowest; of seeds alike, the first),
    or None if none has one."""
    ranked = sorted(searches, key=lambda c: (-math.inf if c.held is None
                                             else knob.offered_req_s(c.held), c.seed))
    middle = ranked[(len(ranked) - 1) // 2]
    if middle.held is None:
        return None
    return min((c for c in searches if c.held == middle.held), key=lambda c: c.seed)


def _write_capacity(scenario: Any, knob: Any, capacities: list[Any], out: Path,
                    report: bool = True) -> Path:
    """``capacity.json`` (each system's result; with several seeds, their median, range
    and each seed's), ``probes.csv`` (every run's summary) and, with ``report``,
    ``capacity.png``/``.svg`` (attainment and goodput against load, a line per system and
    seed) and ``report.html`` into ``out``."""
    import pandas as pd

    from reports.capacity_report import (
        CAPACITY_FILE,
        PROBES_FILE,
        SCENARIO_FILE,
        write_capacity_report,
    )
    from sim.results import write_json, write_yaml

    probes = pd.DataFrame([{"system": p.system, "seed": p.seed, "load": p.load,
                            "offered_req_s": p.offered_req_s, "holds": p.holds, **p.summary}
                           for c in capacities for p in c.probes])
    probes.to_csv(out / PROBES_FILE, index=False)
    by_system = _by_system(capacities)
    several = any(len(searches) > 1 for searches in by_system.values())

    def found(c: Any) -> dict[str, Any]:
        return {"capacity_req_s": None if c.held is None else knob.offered_req_s(c.held),
                "capacity_load": c.held, "misses_at_load": c.failed,
                "converged": c.converged, "runs": len(c.probes)}

    if several:
        systems = {}
        for name, searches in by_system.items():
            values = [found(c)["capacity_req_s"] for c in searches]
            bounded = all(c.held is not None and c.failed is not None for c in searches)
            systems[name] = {
                "capacity_req_s": statistics.median(values) if bounded else None,
                "capacity_req_s_min": min(values) if bounded else None,
                "capacity_req_s_max": max(values) if bounded else None,
                "by_seed": {str(c.seed): found(c) for c in searches}}
        head = {"seeds": sorted({c.seed for c in capacities})}
    else:
        systems = {c.system: found(c) for c in capacities}
        head = {"seed": capacities[0].seed}  # (--seeds N alone: that seed's)
    write_json({"scenario": scenario.name, **head, "slo": scenario.slo.model_dump(),
                "knob": knob.path, "systems": systems, "made_by": made_by()},
               out / CAPACITY_FILE)
    write_yaml(scenario.model_dump(mode="json"), out / SCENARIO_FILE)
    if report:
        write_capacity_report(out)  # the figure, drawn from the files just written
    return out


def cmd_report(args: argparse.Namespace) -> int:
    from reports import write_any_report
    from reports.capacity_report import CAPACITY_FILE, SWEEP_TABLE, is_capacity_folder
    from sim.capacity import POINTS_FOLDER, PROBES_FOLDER

    path = Path(args.run_dir)
    if not ((path / "summary.json").is_file() or (path / "sweep.json").is_file()
            or is_capacity_folder(path)):
        if (path / POINTS_FOLDER).is_dir():
            raise BadInput(f"{path}: a kvsim capacity --sweep that did not finish (no "
                           f"{SWEEP_TABLE} yet; {POINTS_FOLDER}/ keeps the points it searched): "
                           "the same command again searches the rest and writes it")
        if (path / PROBES_FOLDER).is_dir():
            raise BadInput(f"{path}: a kvsim capacity that did not finish (no {CAPACITY_FILE} "
                           f"yet; {PROBES_FOLDER}/ keeps the runs its searches made): the same "
                           "command again goes on from there and writes it")
        raise BadInput(f"{path}: not a kvsim run, sweep or capacity folder (no summary.json, "
                       "sweep.json, capacity.json or capacity.parquet)")
    if (args.x or args.y) and not (path / "sweep.json").is_file():
        kind = "run" if (path / "summary.json").is_file() else "capacity"
        raise BadInput(f"{path}: --x and --y choose a sweep figure, and this is a {kind} "
                       "folder (a sweep folder holds sweep.json)")
    report = write_any_report(path, x=args.x, y=args.y)
    print(f"report: {report}")
    return EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    from reports.capacity_report import is_capacity_folder
    from sim.results import (
        load_scenario_copy,
        read_summary_file,
        scenario_differences,
        sweep_run_label,
    )

    paths = [Path(p) for p in args.run_dirs]
    if len(paths) < 2:
        raise BadInput(f"compare needs two run folders or more, got {len(paths)}")
    for path in paths:
        if (path / "sweep.json").is_file() and not (path / "summary.json").is_file():
            raise BadInput(f"{path}: a sweep folder; compare its runs (folders under "
                           f"{path / 'runs'}) or see kvsim report {path}")
        if not (path / "summary.json").is_file() and is_capacity_folder(path):
            raise BadInput(f"{path}: a kvsim capacity folder; capacities under other settings "
                           "are compared by kvsim capacity --sweep (a sweep over what "
                           f"differs), and kvsim report {path} shows this one")
        if not (path / "summary.json").is_file():
            raise BadInput(f"{path}: not a kvsim run folder (no summary.json)")
    # Each run by what its sweep set, or its folder's name, or by the path given where two
    # names are alike.
    if len({p.resolve() for p in paths}) < len(paths):  # however each is spelt
        raise BadInput(f"the same run folder is given twice: {' '.join(args.run_dirs)}")
    names = [sweep_run_label(p) or p.name or str(p) for p in paths]
    labels = names if len(set(names)) == len(names) else [str(p) for p in paths]
    summaries = [read_summary_file(path) for path in paths]
    print(format_comparison({label: summary.systems
                             for label, summary in zip(labels, summaries, strict=True)}))
    builds = {None if s.made_by is None else s.made_by["build"] for s in summaries}
    if len(builds) > 1:  # the same settings need not give the same numbers then
        made = ", ".join(f"{label}: {'unrecorded' if s.made_by is None else s.made_by['build']}"
                         for label, s in zip(labels, summaries, strict=True))
        _note(f"these runs were made by different kvsim builds ({made})")
    # What was run differently: each run's settings against the first's.
    first = load_scenario_copy(paths[0])
    for label, path in zip(labels[1:], paths[1:], strict=True):
        other = load_scenario_copy(path)
        if first is None or other is None:
            continue
        differences = scenario_differences(first, other)
        shown = "; ".join(differences[:COMPARED_SETTINGS]) or "none (the same scenario)"
        more = len(differences) - COMPARED_SETTINGS
        print(f"settings of {label} that differ from {labels[0]}'s: {shown}"
              + (f"; and {more} more" if more > 0 else ""))
    return EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    from sim.api import load
    from sim.engine import build_timing, memory_summary, read_workload_files, with_speculation
    from sim.scenario import scenario_from_dict
    from sim.sweep import load_sweep_points

    path = Path(args.scenario)
    overrides = dict(args.overrides or [])
    scenario, _ = load(path, overrides=overrides)

    def check(checked: Scenario) -> str:
        """Its memory line, or an error: a pool the weights leave no room for, or less than
        a block; a calibration file that is missing or times another model; a trace file
        (or one an empirical length resamples) missing or with a bad row."""
        memory = memory_summary(checked)
        timing = build_timing(checked, path.parent)
        for system in checked.systems:
            with_speculation(timing, checked, system, path.parent)
        read_workload_files(checked, path.parent)
        return memory

    systems = ", ".join(s.name for s in scenario.systems)
    if not scenario.sweep:
        try:
            memory = check(scenario)
        except _bad_input_types() as exc:
            raise BadInput(f"{path}: {exc}") from None
        print(f"{args.scenario}: ok — scenario {scenario.name!r}, systems: {systems}")
        print(memory)
    else:  # every point must run, as kvsim sweep would run it; the base need not
        notes: list[str] = []
        _, points = load_sweep_points(path, overrides=overrides, notes=notes)
        for note in notes:
            _note(note)
        for point in points:
            try:
                check(scenario_from_dict(point.scenario))
            except _bad_input_types() as exc:
                where = ", ".join(f"{p}={v!r}" for p, v in point.params.items())
                raise BadInput(f"{path}: {exc} [at sweep point {where}]") from None
        print(f"{args.scenario}: ok — scenario {scenario.name!r}, systems: {systems}; "
              f"sweep: {len(points)} runs, each valid")
        try:
            print(check(scenario))
        except _bad_input_types() as exc:
            _note(f"the base scenario alone does not run ({exc}): kvsim run runs it as it is; "
                  "the sweep's points all do")
    for note in scenario.setting_notes():
        print(f"note: {note}")
    return EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
    from sim.scenario import Scenario

    print(json.dumps(Scenario.model_json_schema(), indent=2))
    return EXIT_OK


def _load_trace_arg(target: str, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The trace of a scenario file (with its --set changes) and the scenario, or the trace
    of a trace file and None."""
    from pydantic import ValidationError

    from sim.api import load
    from sim.engine import scenario_trace
    from sim.scenario import validation_message
    from workloads import build_trace
    from workloads.spec import TraceWorkload

    path = Path(target)
    if path.suffix in (".yaml", ".yml"):
        for option, value, field in (("--format", args.format, "workload.format"),
                                     ("--columns", args.columns, "workload.columns"),
                                     ("--time-unit", args.time_unit, "workload.time_unit"),
                                     ("--skip-invalid", args.skip_invalid or None,
                                      "workload.skip_invalid"),
                                     ("--max-model-len", args.max_model_len, "max_model_len")):
            if value is not None:
                raise BadInput(f"{target}: {option} reads a bare trace file; a scenario names "
                               f"its own ({field}; --set {field}=...)")
        scenario, _ = load(path, overrides=dict(args.overrides or []))
        return scenario_trace(scenario, path.parent), scenario
    if args.overrides:
        raise BadInput(f"{target}: --set changes a scenario's fields; this is a trace file")
    if args.format in ("csv", "jsonl") and args.columns is None:
        raise BadInput(f"{target}: format {args.format} needs a columns map: give --columns "
                       "arrival=NAME,prompt_len=NAME,output_len=NAME")
    try:
        workload = TraceWorkload(path=target, format=args.format, columns=args.columns,
                                 time_unit=args.time_unit, skip_invalid=args.skip_invalid)
    except ValidationError as exc:  # options that do not go together (kvsim with --columns)
        raise BadInput(f"{target}: {validation_message(exc, vars(args))}") from None
    return build_trace(workload, seed=0, max_model_len=_bare_context(args), base_dir=Path()), None


def _bare_context(args: argparse.Namespace) -> int:
    """A bare trace file's context limit: --max-model-len, else one no public trace reaches."""
    return int(args.max_model_len or 1 << 20)


def cmd_trace_stats(args: argparse.Namespace) -> int:
    from sim.trace_stats import trace_stats

    for target in args.targets:
        trace, scenario = _load_trace_arg(target, args)
        # (A bare file's requests may fill --max-model-len unless it gives max_tokens.)
        stats = trace_stats(trace, args.block_size,
                            _bare_context(args) if scenario is None else None)
        print(f"== {target}")
        for note in trace.notes:
            print(f"note: {note}")
        for key, value in stats.items():
            if isinstance(value, float):
                text = f"{value:.4f}" if "potential" in key else f"{value:,.2f}"
            elif isinstance(value, int):
                text = f"{value:,}"
            else:
                text = str(value)
            print(f"  {key:<27} {text}")
    return EXIT_OK


def _hit_curve_block_size(args: argparse.Namespace, scenario: Scenario | None) -> int:
    """--block-size, else the scenario's first paged system's, else 16."""
    if args.block_size is not None:
        return int(args.block_size)
    for system in scenario.systems if scenario is not None else ():
        size = getattr(system.allocator, "block_size", None)
        if size is not None and getattr(system.allocator, "prefix_caching", False):
            return int(size)
    return 16


def _pool_marks(scenario: Scenario) -> dict[str, int]:
    """Where a scenario's caches sit: a replica's GPU pool, and that with each host tier."""
    from sim.engine import host_memory, scenario_pool_slots

    pool = scenario_pool_slots(scenario)
    one = (" (one rank's)" if scenario.parallel.data_parallel_size > 1
           else " (one replica's)" if scenario.engine.replicas > 1 else "")
    marks = {"GPU KV pool" + one: pool}
    for system in scenario.systems:
        host_slots = host_memory(scenario, system)[0]
        if host_slots and getattr(system.allocator, "prefix_caching", False):
            gib = system.allocator.host_cache_gib  # type: ignore[union-attr]
            marks[f"{system.name}: pool + {gib:g} GiB host tier"] = pool + host_slots
    return marks


def _print_hit_curve(curve: HitCurve, requests: int, rows: int, model: ModelSpec | None,
                     marks: dict[str, int]) -> None:
    """The curve as a table of doubling sizes, where it levels off, and the ``marks``."""
    from sim.presets import GIB

    bs = curve.block_size
    print(f"prefix-cache hit rate against cache size: LRU over {bs}-token blocks, "
          f"{requests:,} requests one at a time in trace order (the most a pool of that size "
          "could find: running requests hold part of a real one)")

    def gib(tokens: int) -> str:
        return f"{tokens * model.kv_bytes_per_token / GIB:,.2f}" if model else ""

    def size(tokens: int) -> str:
        return f"{tokens:,} tokens" + (f" ({gib(tokens)} GiB)" if model else "")

    if curve.max_hit_rate == 0:
        print("  no prompt starts with a full block of an earlier request's: no cache size "
              "finds anything")
        return
    print(f"  {'cache (tokens)':>16}" + (f"  {'GiB of ' + model.name + ' KV':>24}" if model
                                         else "") + f"  {'hit rate':>9}")
    # Doubling sizes, the last the first power of two that finds all an unlimited cache does.
    top = 1 << max(curve.saturation_tokens - 1, bs).bit_length()
    for tokens in sorted({max(top >> k, bs) for k in range(rows)}):
        print(f"  {tokens:>16,}" + (f"  {gib(tokens):>24}" if model else "")
              + f"  {curve.hit_rate(tokens):>9.1%}")
    print(f"  unlimited: {curve.max_hit_rate:.1%} of {curve.prompt_tokens:,} prompt tokens, "
          f"reached at {size(curve.saturation_tokens)}; the trace writes "
          f"{size(curve.working_set_blocks * bs)} in full blocks")
    print(f"  half of that rate at {size(curve.tokens_for(0.5))}, 90% of it at "
          f"{size(curve.tokens_for(0.9))}")
    for label, tokens in marks.items():
        print(f"  {label}: {size(tokens)}: {curve.hit_rate(tokens):.1%}")
    if model is not None and model.sliding_window:
        print(f"  note: the curve keeps every layer's blocks; {model.name}'s sliding-window "
              "layers need only a window's before a hit under the hybrid KV cache manager")
    if model is not None and model.has_state_layers:
        print(f"  note: the sizes count {model.name}'s attention layers' KV only; with "
              "prefix caching (off by default, as in vLLM) its state-space layers keep a "
              "state only where a step ended on a block boundary, and a hit ends at the "
              "last such one, so it finds at most these hits")


def cmd_trace_hit_curve(args: argparse.Namespace) -> int:
    from reports.hit_curve_figure import hit_curve_figure
    from sim.hit_curve import hit_curve
    from sim.presets import lookup_model

    out = Path(args.plot) if args.plot else None
    if out is not None:  # before the work, not after it
        if out.suffix not in (".png", ".svg", ".pdf"):
            raise BadInput(f"{out}: expected a .png, .svg or .pdf figure file")
        if not out.parent.is_dir():
            raise BadInput(f"{out}: no folder {out.parent} to write into")
    try:
        chosen = lookup_model(args.model) if args.model else None
    except KeyError as exc:
        raise BadInput(f"--model: {exc.args[0]}") from None
    curves = {}
    kv_bytes: set[int] = set()  # a token's KV under each target's model
    marks: dict[str, int] = {}
    for target in args.targets:
        trace, scenario = _load_trace_arg(target, args)
        model = chosen or (scenario.model_spec() if scenario is not None else None)
        bar = None if args.quiet else _progress_bar(2 * len(trace), "hit curve", "req",
                                                    leave=False)
        curve = hit_curve(trace, _hit_curve_block_size(args, scenario), progress=bar)
        curves[target] = curve
        marks = _pool_marks(scenario) if scenario is not None else {}
        print(f"== {target}")
        for note in trace.notes:
            print(f"note: {note}")
        _print_hit_curve(curve, len(trace), args.rows, model, marks)
        kv_bytes.add(model.kv_bytes_per_token if model is not None else 0)
    if out is not None:
        # A GiB axis only where every curve's tokens weigh the same; marks for one target.
        per_token = kv_bytes.pop() if len(kv_bytes) == 1 else 0
        fig = hit_curve_figure(curves, per_token or None, marks if len(curves) == 1 else None)
        fig.savefig(out, dpi=120, metadata={"Date": None} if out.suffix == ".svg" else None)
        print(f"wrote {out}")
    return EXIT_OK


def cmd_trace_export(args: argparse.Namespace) -> int:
    from workloads.trace_file import write_trace_file

    trace, _ = _load_trace_arg(args.target, args)
    out = Path(args.output)
    if not out.parent.is_dir():
        raise BadInput(f"{out}: no folder {out.parent} to write into")
    write_trace_file(trace, out)  # refuses a suffix other than .csv or .jsonl
    print(f"wrote {len(trace):,} requests to {out}")
    return EXIT_OK


def cmd_trace_list(args: argparse.Namespace) -> int:
    from workloads import builtin_traces
    from workloads.importers import BUILTIN_DIR, builtin_trace_summary

    labels = {name: f"builtin:{name}" for name in builtin_traces()}
    width = max(map(len, labels.values())) + 2
    for name, label in labels.items():
        fmt, rows = builtin_trace_summary(name)
        print(f"{label:<{width}}{fmt:<10}{rows:>8,} requests")
    print(f"provenance and licenses: {BUILTIN_DIR / 'README.md'}")
    return EXIT_OK


def cmd_presets(args: argparse.Namespace) -> int:
    import pandas as pd

    from sim.presets import GIB, GPU_PRESETS, MODEL_PRESETS

    if args.model is not None:
        return _fits(args)

    def attention(m: ModelSpec) -> str:
        if m.uses_mla:
            kind = f"MLA ({m.kv_latent_dim})"
        else:
            kind = "MHA" if m.num_kv_heads == m.num_heads else f"GQA ({m.num_kv_heads} KV heads)"
        if m.sliding_window:
            kind += (f", window {m.sliding_window:,} in {m.num_sliding_layers} of "
                     f"{m.num_layers} layers")
        if m.has_state_layers:
            kind += f", state-space in {m.num_state_layers} of {m.num_layers} layers"
        return kind

    def products(m: ModelSpec) -> str:
        """The tensor cores the weights' products are meant for, where the GPU has them."""
        shares = [f"{kind} {share:.0%}" for kind, share in (("FP8", m.fp8_share),
                                                             ("FP4", m.fp4_share)) if share]
        return ", ".join(shares) or "bf16"

    models = pd.DataFrame([{
        "model": m.name, "attention": attention(m), "layers": m.num_layers,
        "KV a token (KiB)": f"{m.kv_bytes_per_token / 1024:,.1f}",
        "params (B)": f"{m.num_params / 1e9:,.1f}",
        "active (B)": f"{m.active_params / 1e9:,.1f}" if m.active_params else "—",
        "experts a token": (f"{m.experts_per_token} of {m.num_experts}" if m.num_experts
                            else "—"),
        "weights (GiB)": f"{m.weight_bytes / GIB:,.1f}",
        "products in": products(m),
        "max context": f"{m.max_model_len:,}"} for m in MODEL_PRESETS.values()])
    gpus = pd.DataFrame([{
        "gpu": g.name, "memory (GiB)": f"{g.memory_bytes / GIB:,.1f}",
        "HBM (TB/s)": f"{g.hbm_bandwidth_bytes_per_s / 1e12:,.2f}",
        "dense bf16 (TFLOP/s)": f"{g.peak_flops / 1e12:,.0f}",
        "dense FP8 (TFLOP/s)": (f"{g.fp8_peak_flops / 1e12:,.0f}" if g.fp8_peak_flops
                                else "—"),
        "dense FP4 (TFLOP/s)": (f"{g.fp4_peak_flops / 1e12:,.0f}" if g.fp4_peak_flops
                                else "—"),
        "GPU link (GB/s, one way)": (f"{g.interconnect_kind} "
                                     f"{g.interconnect_bytes_per_s / 1e9:,.0f} × "
                                     f"{g.interconnect_gpus} GPUs"
                                     if g.interconnect_bytes_per_s else "—"),
        "host link (GB/s, one way)": (f"{g.host_link_bytes_per_s / 1e9:,.0f}"
                                      if g.host_link_bytes_per_s else "—")}
        for g in GPU_PRESETS.values()])
    print(models.to_string(index=False))
    print()
    print(gpus.to_string(index=False))
    print("\nmodel: and gpu: take these names, or a mapping of the same shapes (kvsim schema)")
    return EXIT_OK


def _fits(args: argparse.Namespace) -> int:
    """``kvsim presets --model NAME``: the KV tokens one engine of the model holds on each
    GPU preset at each tensor-parallel size one board joins, and how many requests of the
    context limit that is at once (vLLM's "maximum concurrency")."""
    import dataclasses

    import pandas as pd

    from sim.presets import (
        FP4_KV_CACHE_DTYPES,
        GIB,
        GPU_PRESETS,
        KV_CACHE_DTYPE_BYTES,
        SizingError,
        kv_pool_slots,
        lookup_model,
        max_concurrency,
    )

    try:
        model = lookup_model(args.model)
    except KeyError as exc:
        raise BadInput(f"--model: {exc.args[0]}") from None
    context = args.max_model_len or model.max_model_len
    if context > model.max_model_len:
        raise BadInput(f"--max-model-len {context}: {model.name}'s context is "
                       f"{model.max_model_len:,} tokens")
    if args.kv_cache_dtype != "auto":
        model = dataclasses.replace(model, kv_dtype_bytes=KV_CACHE_DTYPE_BYTES[
            args.kv_cache_dtype])
    sizes = [1, 2, 4, 8]
    rows = []
    fp4 = args.kv_cache_dtype in FP4_KV_CACHE_DTYPES
    for gpu in GPU_PRESETS.values():
        row = {"gpu": gpu.name}
        for tp in sizes:
            if fp4 and gpu.fp4_peak_flops is None:
                row[f"TP {tp}"] = "no FP4"
                continue
            if gpu.interconnect_gpus is not None and tp > gpu.interconnect_gpus:
                row[f"TP {tp}"] = "—"
                continue
            if model.tensor_parallel_problem(tp):
                row[f"TP {tp}"] = "heads"
                continue
            try:
                slots = kv_pool_slots(model, gpu, tensor_parallel_size=tp,
                                      gpu_memory_utilization=args.gpu_memory_utilization)
            except SizingError:  # (the weights leave no room)
                row[f"TP {tp}"] = "—"
                continue
            row[f"TP {tp}"] = f"{slots:,} ({max_concurrency(model, slots, context, tp):,.1f}×)"
        rows.append(row)
    print(f"{model.name}: weights {model.weight_bytes / GIB:,.1f} GiB, KV "
          f"{model.kv_bytes_per_token / 1024:,.1f} KiB a token; KV tokens one engine holds "
          f"at {args.gpu_memory_utilization:.0%} of GPU memory (requests of "
          f"{context:,} tokens at once):")
    frame = pd.DataFrame(rows)
    print(frame.to_string(index=False))
    heads = "; heads: its heads do not split so" if (frame == "heads").any().any() else ""
    if fp4:
        heads += (f"; no FP4: only GPUs with FP4 tensor cores (Blackwell) read a "
                  f"{args.kv_cache_dtype} cache")
    print(f"\n—: the weights leave no room (or the GPUs' link joins fewer){heads}. Pipeline "
          "stages, data-parallel ranks and memory.kv_memory_gib: kvsim validate on a scenario")
    if model.has_state_layers:
        print(f"{model.name}'s {model.num_state_layers} state-space layers keep a state a "
              "request, not KV a token: the requests at once are those whose blocks (vLLM's, "
              "raised to hold a state) fit, a state and the context's attention blocks each")
    if model.sliding_window:
        print(f"{model.name} keeps a {model.sliding_window:,}-token window in "
              f"{model.num_sliding_layers} of its {model.num_layers} layers; these count "
              "every layer's KV in every token (allocator.hybrid_kv_cache: false); under the "
              "hybrid KV cache manager a slot is one group of layers (kvsim validate says "
              "how many)")
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from sim.bench import main as bench_main

    return bench_main(args.sizes, args.mode)


# ---------------------------------------------------------------------- parser
def _whole_number(low: int, high: int | None, expected: str) -> Callable[[str], int]:
    """An argparse type: a whole number from ``low`` to ``high`` (no end where None),
    refused as ``expected``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_int = _whole_number(1, None, "a positive whole number")


def _context_length() -> Callable[[str], int]:
    """An argparse type: a context limit, a whole number of tokens from 2 (a prompt token and
    an answer's) to the longest simulated."""
    from workloads.distributions import MAX_LENGTH

    return _whole_number(2, MAX_LENGTH, f"a whole number of tokens from 2 to {MAX_LENGTH:,}")


def _seed_list(text: str) -> list[int]:
    """An argparse type: distinct whole numbers, comma-separated (``0,1,2``)."""
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) < len(seeds):
        raise argparse.ArgumentTypeError(
            f"expected distinct seeds ≥ 0 separated by commas (0,1,2), got {text!r}")
    return seeds


def _override(text: str) -> tuple[str, Any]:
    """An argparse type: ``PATH=VALUE``, the value read as YAML (``8``, ``true``,
    ``{kind: paged, block_size: 32}``)."""
    import yaml

    path, equals, value = text.partition("=")
    if not equals or not path.strip():
        raise argparse.ArgumentTypeError(
            f"expected PATH=VALUE, e.g. memory.kv_memory_gib=8, got {text!r}")
    try:
        return path.strip(), yaml.safe_load(value)
    except yaml.YAMLError:
        raise argparse.ArgumentTypeError(f"{text!r}: the value is not valid YAML") from None


def _column_map(text: str) -> ColumnMap:
    """An argparse type: ``KEY=NAME,...``, which column of a generic CSV/JSONL trace holds
    what (``arrival=t,prompt_len=in,output_len=out``)."""
    from workloads.spec import ColumnMap

    keys = list(ColumnMap.model_fields)
    required = [k for k, field in ColumnMap.model_fields.items() if field.is_required()]
    mapping: dict[str, str] = {}
    for part in text.split(","):
        key, equals, name = (piece.strip() for piece in part.partition("="))
        if not equals or not key or not name:
            raise argparse.ArgumentTypeError(
                f"expected KEY=NAME pairs separated by commas (arrival=t,prompt_len=in,"
                f"output_len=out), got {part.strip()!r}")
        if key not in keys:
            raise argparse.ArgumentTypeError(
                f"unknown key {key!r}: expected one of {', '.join(keys)}")
        if key in mapping:
            raise argparse.ArgumentTypeError(f"key {key!r} given twice")
        mapping[key] = name
    missing = [k for k in required if k not in mapping]
    if missing:
        raise argparse.ArgumentTypeError(
            f"missing {', '.join(missing)}: {', '.join(required)} are required")
    return ColumnMap(**mapping)


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", metavar="PATH=VALUE", type=_override,
                        action="append", help="change a field of the scenario, as a sweep "
                        "path (memory.kv_memory_gib=8, systems[paged-16].allocator."
                        "block_size=32); repeatable")


def _positive_float(text: str) -> float:
    """An argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _fraction(text: str) -> float:
    """An argparse type: a share, a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1], got {text!r}")
    return value


class _Version(argparse.Action):
    """``--version``: the version and the core that runs, on one line as it is (argparse's
    own version action wraps a long line at the terminal's width)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"kvsim {__version__} (build {build_id()}), {CORE.describe()}")
        parser.exit()


# What argparse says of an option given too few or too many values.
ARGUMENT_COUNT_ERRORS = ("expected one argument", "expected at most one argument",
                         "expected at least one argument", "ignored explicit argument")


class CommandParser(argparse.ArgumentParser):
    """kvsim's parsers (and gpu_validate's, whose messages start with its ``name``): bad
    arguments exit with code 2 and one ``kvsim: error:`` line, which names the nearest
    option or command where a typo is near one, and the command whose ``--help`` lists them
    (the usage block argparse prints first is left out: for some commands it fills a
    screen). An option is taken only by its whole name: ``--gpu h100`` must not be read as
    ``--gpu-memory-utilization h100`` and refused as a bad share."""

    def __init__(self, *args: Any, name: str = "kvsim", **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.name = name  # what its messages start with

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        # Arguments nobody took are told by the command they were given to (argparse has
        # the top-level parser tell them, which knows none of that command's options).
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._command_parser(parsed).error(
                f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _command_parser(self, parsed: argparse.Namespace) -> CommandParser:
        """The parser of the (sub)command ``parsed`` ran: this one or one it chose."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                name = getattr(parsed, action.dest, None)
                chosen = action.choices.get(name) if isinstance(name, str) else None
                if isinstance(chosen, CommandParser):
                    return chosen._command_parser(parsed)
        return self

    def error(self, message: str) -> None:  # type: ignore[override]
        # Where the arguments' shape is wrong (not a value: its message says what it
        # expected), the command that lists the right ones.
        commands = any(isinstance(a, argparse._SubParsersAction) for a in self._actions)
        shape = message.startswith(("unrecognized arguments", "the following arguments are "
                                    "required")) or any(
            count in message for count in ARGUMENT_COUNT_ERRORS)
        hint = (f" ({self.prog} --help lists the {'commands' if commands else 'options'})"
                if shape else "")
        self.exit(EXIT_BAD_INPUT, f"{self.name}: error: {self._with_guess(message)}{hint}\n")

    def _with_guess(self, message: str) -> str:
        """``message`` with "; did you mean X?" after the word refused where it is a typo of
        a command or an option."""
        choice = re.match(r"(argument [^:]+: invalid choice: '([^']*)')( \(choose from .*\))$",
                          message)
        if choice:
            known = re.findall(r"'([^']*)'", choice.group(3))
            near = difflib.get_close_matches(choice.group(2), known, n=1, cutoff=0.6)
            guess = f"; did you mean {near[0]!r}?" if near else ""
            return choice.group(1) + guess + choice.group(3)
        if message.startswith("unrecognized arguments: "):
            # (Matched without their dashes, which every option shares.)
            options = {name.lstrip("-"): name for name in self._option_string_actions
                       if name.startswith("--")}
            for word in message.split()[2:]:
                if word.startswith("--"):
                    near = difflib.get_close_matches(word.split("=")[0].lstrip("-"),
                                                     list(options), n=1, cutoff=0.6)
                    if near:
                        return f"{message}; did you mean {options[near[0]]}?"
        return message


def build_parser() -> argparse.ArgumentParser:
    from sim.presets import KV_CACHE_DTYPES
    from workloads.distributions import TraceFormat

    parser = CommandParser(prog="kvsim", description="KV-cache memory simulator for LLM "
                           "serving: contiguous reservation vs paged allocation.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action=_Version,
                        help="show the version and which core runs, and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)

    run = sub.add_parser("run", help="run a scenario and print the systems side by side")
    run.add_argument("scenario", help="scenario YAML file")
    run.add_argument("-o", "--out", help="run folder (default: the scenario's output_dir or "
                     "runs/NAME)")
    run.add_argument("--seed", type=int, help="override the scenario's seed")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--no-report", action="store_true", help="skip the HTML report")
    _add_overrides(run)
    run.set_defaults(func=cmd_run)

    sweep = sub.add_parser("sweep", help="run a scenario's sweep: grid × seeds, resumable")
    sweep.add_argument("scenario", help="scenario YAML file with a sweep: section")
    sweep.add_argument("--jobs", type=_positive_int, help="parallel runs (default: all cores)")
    sweep.add_argument("--executor", choices=["local", "ray"], default="local",
                       help="where the runs execute: local processes (default) or Ray")
    sweep.add_argument("--address", help="Ray cluster address ('auto', 'ray://host:10001'); "
                       "default: start a local Ray")
    sweep.add_argument("-o", "--out", help="sweep folder (default: output_dir or runs/NAME)")
    sweep.add_argument("--quick", action="store_true",
                       help="a quarter of the requests, ≤3 values per numeric axis, one seed")
    sweep.add_argument("--quiet", action="store_true", help="no progress bar")
    sweep.add_argument("--no-report", action="store_true", help="skip the figures and report")
    sweep.add_argument("--rerun-older", action="store_true",
                       help="run again the finished points another kvsim build made (kept "
                            "by default, and counted in a note)")
    _add_overrides(sweep)
    sweep.set_defaults(func=cmd_sweep)

    capacity = sub.add_parser(
        "capacity", help="the highest request rate each system serves within the SLO",
        description="Search the arrival rate (or a trace's replay speed) at which each "
        "system still serves slo.attainment of its requests within the scenario's SLO: "
        "doubling or halving from the scenario's rate, then bisecting.")
    capacity.add_argument("scenario", help="scenario YAML file (its slo: section, or the "
                          "bounds below)")
    capacity.add_argument("--ttft-s", type=_positive_float, help="TTFT bound in seconds")
    capacity.add_argument("--tpot-s", type=_positive_float, help="TPOT bound in seconds")
    capacity.add_argument("--e2e-s", type=_positive_float, help="end-to-end bound in seconds")
    capacity.add_argument("--max-itl-s", type=_positive_float,
                          help="bound in seconds on each request's longest wait between two "
                               "tokens")
    capacity.add_argument("--attainment", type=_positive_float,
                          help="share of requests that must be within the SLO (default 0.9)")
    capacity.add_argument("--judge", choices=["requests", "percentiles"],
                          help="requests: that share meets every bound at once (default); "
                          "percentiles: each bound alone, e.g. p99 TTFT and p99 TPOT")
    seeding = capacity.add_mutually_exclusive_group()
    seeding.add_argument("--seed", type=int, help="override the scenario's seed")
    seeding.add_argument("--seeds", type=_seed_list, metavar="S1,S2,...",
                         help="search under each of these seeds (other requests, the same "
                              "distributions): the median capacity and its spread")
    capacity.add_argument("--system", action="append",
                          help="search this system only (repeatable; default: all)")
    capacity.add_argument("--rel-tol", type=_positive_float, default=0.02,
                          help="stop when the loads that hold and miss are this close "
                          "(relative; default 0.02)")
    capacity.add_argument("--max-probes", type=_positive_int, default=24,
                          help="runs per system at most (default 24)")
    capacity.add_argument("--sweep", action="store_true",
                          help="search every point of the file's sweep section (its rate axis "
                          "dropped), in parallel; resumable, as kvsim sweep")
    capacity.add_argument("--jobs", type=_positive_int,
                          help="parallel searches, one per system (or, with --sweep, per "
                          "point; default: all cores); 1 searches one after another")
    capacity.add_argument("--executor", choices=["local", "ray"], default="local",
                          help="--sweep: where the searches run, as for kvsim sweep")
    capacity.add_argument("--address", help="--sweep --executor ray: a Ray cluster address")
    capacity.add_argument("--quick", action="store_true",
                          help="--sweep: a quarter of the requests, ≤3 values per axis")
    capacity.add_argument("--rerun-older", action="store_true",
                          help="--sweep: search again the points another kvsim build searched "
                               "(kept by default, and counted in a note)")
    capacity.add_argument("-o", "--out", help="results folder (default: runs/NAME-capacity)")
    capacity.add_argument("--quiet", action="store_true", help="no line per run")
    capacity.add_argument("--no-report", action="store_true",
                          help="skip the figures and report (kvsim report draws them later)")
    _add_overrides(capacity)
    capacity.set_defaults(func=cmd_capacity)

    report = sub.add_parser("report", help="figures and report.html for a run, sweep or "
                            "capacity folder")
    report.add_argument("run_dir", metavar="FOLDER")
    report.add_argument("--x", help="sweep: swept field for the x axis (e.g. "
                        "workload.arrival.rate)")
    report.add_argument("--y", help="sweep: summary metric for the y axis (e.g. "
                        "throughput_tok_s)")
    report.set_defaults(func=cmd_report)

    compare = sub.add_parser("compare", help="run folders side by side, with the change "
                             "from one to another")
    compare.add_argument("run_dirs", metavar="RUN_DIR", nargs="+",
                         help="two or more kvsim run folders (the first is the baseline)")
    compare.set_defaults(func=cmd_compare)

    validate = sub.add_parser("validate", help="check a scenario file without running it")
    validate.add_argument("scenario")
    _add_overrides(validate)
    validate.set_defaults(func=cmd_validate)

    schema = sub.add_parser("schema", help="print the scenario JSON Schema (for editors)")
    schema.set_defaults(func=cmd_schema)

    presets = sub.add_parser("presets", help="the model and GPU presets and their shapes; "
                             "with --model, how many KV tokens each GPU holds of it")
    presets.add_argument("--model", help="a model preset: the KV tokens an engine of it holds "
                         "on each GPU preset, at each tensor-parallel size")
    presets.add_argument("--max-model-len", type=_context_length(), default=None,
                         help="the context limit the concurrency counts (default: the "
                         "model's)")
    presets.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto")
    presets.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                         help="the share of GPU memory the engine may use (default 0.9)")
    presets.set_defaults(func=cmd_presets)

    bench = sub.add_parser("bench", help="engine benchmark: ShareGPT-like load, paged-16")
    bench.add_argument("--sizes", type=request_counts, default=DEFAULT_SIZES,
                       help="comma-separated request counts (default 10000,100000; e.g. "
                       "10000,100000,1000000)")
    bench.add_argument("--mode", choices=["jump", "step"], default="jump")
    bench.set_defaults(func=cmd_bench)

    # Listed for --help only: main() hands "calibrate ..." to gpu_validate's parser.
    sub.add_parser("calibrate", help="GPU: check and time real kernels, fit the step-time "
                   "model (kvsim calibrate --help)")

    trace = sub.add_parser("trace", help="inspect, list and export traces")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True,
                                     parser_class=CommandParser)
    common = CommandParser(add_help=False)
    common.add_argument("--format",
                        choices=get_args(TraceFormat),
                        help="trace file format (default: guessed; kvsim: a table kvsim trace "
                        "export wrote)")
    common.add_argument("--columns", type=_column_map, metavar="KEY=NAME,...",
                        help="a generic CSV/JSONL file's columns: arrival, prompt_len, "
                        "output_len required; hash_ids, priority, predicted_output, max_tokens "
                        "optional "
                        "(arrival=t,prompt_len=in,output_len=out)")
    common.add_argument("--time-unit", choices=["s", "ms", "us", "datetime"],
                        help="unit of the arrival column (default: the format's; s for a "
                        "generic file)")
    common.add_argument("--skip-invalid", action="store_true", help="skip bad rows")
    common.add_argument("--max-model-len", type=_context_length(), default=None,
                        help="context limit for a bare trace file (default: 1,048,576 "
                        "tokens, no clipping of any public trace)")
    _add_overrides(common)
    stats = trace_sub.add_parser("stats", parents=[common],
                                 help="count, rate, lengths, prefix-sharing potential")
    stats.add_argument("targets", nargs="+", metavar="FILE|SCENARIO")
    stats.add_argument("--block-size", type=_positive_int, default=16)
    stats.set_defaults(func=cmd_trace_stats)
    curve = trace_sub.add_parser(
        "hit-curve", parents=[common],
        help="prefix-cache hit rate against cache size, every size from one pass")
    curve.add_argument("targets", nargs="+", metavar="FILE|SCENARIO")
    curve.add_argument("--block-size", type=_positive_int, default=None,
                       help="tokens a block (default: a scenario's first paged system's "
                       "with prefix caching, else 16)")
    curve.add_argument("--model", help="a model preset, to give sizes in GiB of its KV "
                       "(default: a scenario's model)")
    curve.add_argument("--rows", type=_positive_int, default=12,
                       help="cache sizes printed, doubling up to the one that finds all "
                       "(default 12)")
    curve.add_argument("--plot", metavar="FILE", help="also draw the curves (.png, .svg, .pdf)")
    curve.add_argument("--quiet", action="store_true", help="no progress bar")
    curve.set_defaults(func=cmd_trace_hit_curve)
    export = trace_sub.add_parser("export", parents=[common],
                                  help="write a trace to CSV or JSONL, a table a scenario "
                                  "replays exactly (workload kind: trace)")
    export.add_argument("target", metavar="FILE|SCENARIO")
    export.add_argument("-o", "--output", required=True, help="output .csv or .jsonl")
    export.set_defaults(func=cmd_trace_export)
    listing = trace_sub.add_parser("list", help="the traces shipped with kvsim")
    listing.set_defaults(func=cmd_trace_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:  # its options belong to gpu_validate's own parser
        from gpu_validate.__main__ import main as calibrate_main

        return calibrate_main(argv[1:], prog="kvsim calibrate", name="kvsim")
    parser = build_parser()
    args = parser.parse_args(argv)
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (_ReaderMayLeave(s) for s in streams)  # type: ignore[assignment]
    try:
        return int(args.func(args))
    except Interrupted as exc:
        print(f"kvsim: interrupted: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("kvsim: interrupted", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:
        if args.debug:
            raise
        if isinstance(exc, _bad_input_types()):
            print(f"kvsim: error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        if isinstance(exc, MemoryError):
            detail = f" ({exc})" if str(exc) else ""  # numpy names the array; Python nothing
            print(f"kvsim: run failed: out of memory{detail}: the scenario asks for more than "
                  "this machine holds; give fewer requests (stop.num_requests), shorter ones, "
                  "a smaller KV pool or a smaller sweep", file=sys.stderr)
            return EXIT_FAILED
        print(f"kvsim: run failed: {type(exc).__name__}: {exc} (rerun with --debug for the "
              "traceback)", file=sys.stderr)
        return EXIT_FAILED
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # while a reader that left is still caught
        sys.stdout, sys.stderr = streams


if __name__ == "__main__":
    sys.exit(main())
