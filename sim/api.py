"""The Python entry points: ``sim.run(scenario)`` → pandas tables, the same the CLI writes;
``sim.capacity_under_slo(scenario)`` → each system's capacity under the scenario's SLO."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from sim.engine import run_scenario
from sim.results import ScenarioResult, write_run
from sim.scenario import Scenario, read_scenario_file, scenario_from_dict


def run(
    scenario: str | Path | dict[str, Any] | Scenario,
    *,
    out: str | Path | None = None,
    seed: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> ScenarioResult:
    """Run a scenario (a YAML path, a dict or a :class:`Scenario`) and return its results.

    ``seed`` overrides the scenario's seed, ``overrides`` any field (``{"memory.kv_memory_gib":
    8}``, paths as a sweep's); ``out`` also writes the run folder there.
    Each system's ``requests``, ``memory`` and ``steps`` are pandas DataFrames, ``summary`` a
    dict (see ``ScenarioResult.summary_frame()`` for a side-by-side table).
    """
    parsed, base_dir = load(scenario, seed, overrides)
    result = run_scenario(parsed, base_dir)
    if out is not None:
        write_run(result, Path(out))
    return result


def capacity_under_slo(
    scenario: str | Path | dict[str, Any] | Scenario,
    *,
    seed: int | None = None,
    seeds: list[int] | None = None,
    rel_tol: float = 0.02,
    max_probes: int = 24,
    systems: list[str] | None = None,
    jobs: int = 1,
    overrides: dict[str, Any] | None = None,
    probe_dir: str | Path | None = None,
) -> pd.DataFrame:
    """The highest arrival rate at which each system keeps ``slo.attainment`` of its
    requests within the scenario's SLO (as ``kvsim capacity``; see :mod:`sim.capacity`).

    One row per system, indexed by name: ``capacity_req_s`` (NaN where no load tried held),
    ``misses_at_req_s``, ``converged``, ``runs``, and the summary of the run at capacity.
    With ``seeds``, one row per system and seed, indexed by both (``--seeds``).
    ``jobs`` above 1 runs that many searches at once, each in a process of its own.
    With ``probe_dir``, each run is kept there, and the runs this kvsim build made there
    before are read back (an interrupted search, called again, goes on where it stopped).
    """
    from sim.capacity import capacity_by_seed, capacity_rows

    if seed is not None and seeds is not None:
        raise ValueError("give seed or seeds, not both")
    parsed, base_dir = load(scenario, seed, overrides)
    knob, found = capacity_by_seed(parsed, base_dir, [parsed.seed] if seeds is None else seeds,
                                   rel_tol=rel_tol, max_probes=max_probes, systems=systems,
                                   jobs=jobs,
                                   probe_dir=None if probe_dir is None else Path(probe_dir))
    table = pd.DataFrame(capacity_rows(parsed, knob, found))
    if seeds is None:
        return table.set_index("system")
    table.insert(1, "seed", [c.seed for c in found])
    return table.set_index(["system", "seed"])


def load(scenario: str | Path | dict[str, Any] | Scenario, seed: int | None = None,
         overrides: dict[str, Any] | None = None) -> tuple[Scenario, Path]:
    """A validated scenario (its seed replaced by ``seed``, each ``overrides`` path, as a
    sweep's, set to its value) and the folder its relative paths start from."""
    from sim.sweep import with_overrides

    base_dir = Path()
    if isinstance(scenario, str | Path):
        base_dir = Path(scenario).parent
        scenario = scenario_from_dict(with_overrides(read_scenario_file(scenario), overrides),
                                      f"{scenario} (with --set)" if overrides else str(scenario))
    elif isinstance(scenario, dict):
        scenario = scenario_from_dict(with_overrides(scenario, overrides))
    elif overrides:
        scenario = scenario_from_dict(with_overrides(scenario.model_dump(mode="json"),
                                                     overrides))
    if seed is not None:
        scenario = scenario_from_dict({**scenario.model_dump(), "seed": seed}, f"--seed {seed}")
    return scenario, base_dir
