"""Shared helpers for the tests."""

from __future__ import annotations

from collections.abc import Iterator

import matplotlib.pyplot as plt
import pytest

from sim.memory import SeqSpec


@pytest.fixture(autouse=True)
def _close_figures() -> Iterator[None]:
    """Tests inspect figures and drop them; pyplot keeps them until closed."""
    yield
    plt.close("all")

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
