"""Shared helpers for the tests."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from sim.memory import SeqSpec


@pytest.fixture(autouse=True)
def _close_figures() -> Iterator[None]:
    """Tests inspect figures and drop them; pyplot keeps them until closed."""
    yield
    plt.close("all")


@pytest.fixture
def itl_token_counts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tokens each system's ITL counted, run after run: the engine's own
    summary of the waits, watched (not replaced) as it is called."""
    import sim.engine

    counted: list[int] = []
    summarize = sim.engine.token_wait_summary

    def watched(waits_us: dict[int, int]) -> dict[str, float]:
        counted.append(sum(waits_us.values()))
        return summarize(waits_us)

    monkeypatch.setattr(sim.engine, "token_wait_summary", watched)
    return counted


@pytest.fixture
def sample_rows(monkeypatch: pytest.MonkeyPatch) -> list:
    """The rows of the samples of requests fanned out, each run's before they are
    gathered into their requests' rows (with the request each is of, ``of``): the engine's
    own gathering, watched (not replaced) as it is called."""
    import sim.engine

    rows: list = []
    gather = sim.engine.gather_samples

    def watched(samples, request_of):  # type: ignore[no-untyped-def]
        rows.append(samples.assign(of=request_of[samples["request"].to_numpy()]))
        return gather(samples, request_of)

    monkeypatch.setattr(sim.engine, "gather_samples", watched)
    return rows


ROOT = Path(__file__).resolve().parents[1]


@dataclass
class CliOutcome:
    """What a ``kvsim`` command returned and printed (as ``subprocess.CompletedProcess``)."""

    returncode: int
    stdout: str
    stderr: str


def kvsim_in_process(*args: str, cwd: Path = ROOT) -> CliOutcome:
    """``kvsim ARGS`` run by :func:`sim.cli.main` in this process: the same code as the
    console script without a second of interpreter start-up and imports per call. Tests
    that need a process of their own (hash seeds, ``python -O``, a closed pipe) start one."""
    from sim.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse: --help, --version, usage errors
            code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    return CliOutcome(code, out.getvalue(), err.getvalue())


# Requests in each shipped public trace (workloads/data/README.md).
PUBLIC_TRACE_ROWS = {
    "azure_llm_2023_code.csv": 8_819,
    "azure_llm_2023_conv.csv": 19_366,
    "mooncake_fast25_conversation_trace.jsonl": 12_031,
    "mooncake_fast25_synthetic_trace.jsonl": 3_993,
}


def make_spec(
    seq_id: int,
    prompt_len: int,
    final_len: int,
    *,
    prefix: tuple[tuple[int, int], ...] = (),
    max_len: int | None = None,
) -> SeqSpec:
    """A sequence whose content is ``prefix`` then text of its own (segment id 10_000 + id)."""
    own = final_len - sum(n for _, n in prefix)
    segments = (*prefix, (10_000 + seq_id, own))
    return SeqSpec(seq_id, segments, prompt_len, final_len, max_len or final_len)
