"""The Python entry point: ``sim.run(scenario)`` → pandas tables, the same the CLI writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
    base_dir = Path()
    if isinstance(scenario, str | Path):
        base_dir = Path(scenario).parent
        scenario = load_scenario(scenario)
    elif isinstance(scenario, dict):
        scenario = scenario_from_dict(scenario)
    if seed is not None:
        scenario = scenario_from_dict({**scenario.model_dump(), "seed": seed}, f"seed={seed}")
    result = run_scenario(scenario, base_dir)
    if out is not None:
        write_run(result, Path(out))
    return result
