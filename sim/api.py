"""The Python entry points: ``sim.run(scenario)`` → pandas tables, the same the CLI writes;
``sim.capacity_under_slo(scenario)`` → each system's capacity under the scenario's SLO."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from sim.engine import run_scenario
from sim.results import ScenarioResult, write_run
from sim.scenario import Scenario, load_scenario, scenario_from_dict


def run(
    scenario: str | Path | dict[str, Any] | Scenario,
    *,
    out: str | Path | None = None,
    seed: int | None = None,
) -> ScenarioResult:
    """Run a scenario (a YAML path, a dict or a :class:`Scenario`) and return its results.

    ``seed`` overrides the scenario's seed; ``out`` also writes the run folder there.
    Each system's ``requests``, ``memory`` and ``steps`` are pandas DataFrames, ``summary`` a
    dict (see ``ScenarioResult.summary_frame()`` for a side-by-side table).
    """
    parsed, base_dir = load(scenario, seed)
    result = run_scenario(parsed, base_dir)
    if out is not None:
        write_run(result, Path(out))
    return result


def capacity_under_slo(
    scenario: str | Path | dict[str, Any] | Scenario,
    *,
    seed: int | None = None,
    rel_tol: float = 0.02,
    max_probes: int = 24,
    systems: list[str] | None = None,
    jobs: int = 1,
) -> pd.DataFrame:
    """The highest arrival rate at which each system keeps ``slo.attainment`` of its
    requests within the scenario's SLO (as ``kvsim capacity``; see :mod:`sim.capacity`).

    One row per system, indexed by name: ``capacity_req_s`` (NaN where no load tried held),
    ``misses_at_req_s``, ``converged``, ``runs``, and the summary of the run at capacity.
    ``jobs`` above 1 searches that many systems at once, each in a process of its own.
    """
    from sim.capacity import capacity_rows, find_capacity

    parsed, base_dir = load(scenario, seed)
    knob, found = find_capacity(parsed, base_dir, rel_tol=rel_tol, max_probes=max_probes,
                                systems=systems, jobs=jobs)
    return pd.DataFrame(capacity_rows(parsed, knob, found)).set_index("system")


def load(scenario: str | Path | dict[str, Any] | Scenario, seed: int | None = None
         ) -> tuple[Scenario, Path]:
    """A validated scenario (its seed replaced by ``seed``) and the folder its relative
    paths start from."""
    base_dir = Path()
    if isinstance(scenario, str | Path):
        base_dir = Path(scenario).parent
        scenario = load_scenario(scenario)
    elif isinstance(scenario, dict):
        scenario = scenario_from_dict(scenario)
    if seed is not None:
        scenario = scenario_from_dict({**scenario.model_dump(), "seed": seed}, f"--seed {seed}")
    return scenario, base_dir
