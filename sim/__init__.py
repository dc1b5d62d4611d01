"""kvsim: a discrete-event simulator of LLM-serving KV-cache memory management.

``sim.run("scenarios/paged_vs_contiguous.yaml")`` runs a scenario and returns its tables;
``sim.capacity_under_slo(...)`` finds each system's highest rate within the scenario's SLO.
"""

from __future__ import annotations

from typing import Any

from sim.compiled import select_core

__version__ = "0.1.0"
CORE = select_core()  # before any other sim module loads: compiled extensions or source


def run(*args: Any, **kwargs: Any) -> Any:
    """Run a scenario; see :func:`sim.api.run` (imported lazily to keep ``sim.memory`` light)."""
    from sim.api import run as _run

    return _run(*args, **kwargs)


def capacity_under_slo(*args: Any, **kwargs: Any) -> Any:
    """Search each system's capacity under SLO; see :func:`sim.api.capacity_under_slo`
    (not ``sim.capacity``: that is the module doing the search)."""
    from sim.api import capacity_under_slo as _capacity_under_slo

    return _capacity_under_slo(*args, **kwargs)
