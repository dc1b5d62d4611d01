"""Figures that describe a trace before any simulation: size, rate, lengths, sharing,
priorities.

*Prefix-sharing potential* at block size ``bs`` is the share of prompt tokens that lie in full
blocks whose chained hash (the whole prefix up to and including the block) also occurs in
another request's prompt — the most a perfect, infinite prefix cache could reuse.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sim.memory.content import BlockHasher
from workloads.trace import Trace


def sharing_potential(trace: Trace, block_size: int) -> float:
    """Share of prompt tokens in full blocks that another request's prompt also has."""
    hashes: list[int] = []
    for i in range(len(trace)):
        hasher = BlockHasher(trace.prompt_segments(i), block_size)
        hashes += hasher.hash_upto(int(trace.prompt_len[i]) // block_size)
    # A block's hash chains all before it, so one prompt holds each hash once (a 64-bit
    # collision aside, ignored as in the pool): a hash's count is how many prompts hold it.
    _, holders = np.unique(np.array(hashes, dtype=np.int64), return_counts=True)
    shared_blocks = int(holders[holders > 1].sum())
    total = int(trace.prompt_len.sum())
    return shared_blocks * block_size / total if total else 0.0


def trace_stats(trace: Trace, block_size: int = 16) -> dict[str, Any]:
    """Count, duration, rate, length percentiles, sharing potential, where requests differ
    in priority the share of each level, and where a predictor's guesses are given how often
    they fall short and the log-normal ``sigma`` they amount to, of ``trace``."""
    duration = float(trace.arrival_s[-1] - trace.arrival_s[0]) if len(trace) > 1 else 0.0
    stats: dict[str, Any] = {
        "source": trace.source,
        "requests": len(trace),
        "duration_s": duration,
        "rate_req_s": (len(trace) - 1) / duration if duration > 0 else float("nan"),
    }
    for name in ("prompt_len", "output_len"):
        values = getattr(trace, name)
        stats[f"{name}_mean"] = float(values.mean())
        for p in (50, 90, 99):
            stats[f"{name}_p{p}"] = float(np.percentile(values, p))
        stats[f"{name}_max"] = int(values.max())
    stats["total_tokens"] = trace.total_tokens()
    stats["dependent_requests"] = int((trace.after >= 0).sum())
    stats["mean_samples_n"] = float(trace.n.mean())
    stats[f"sharing_potential_bs{block_size}"] = sharing_potential(trace, block_size)
    levels, counts = np.unique(trace.priority, return_counts=True)
    if len(levels) > 1:  # the share of requests at each scheduling priority
        for level, count in zip(levels.tolist(), counts.tolist(), strict=True):
            stats[f"priority_{level}_share"] = count / len(trace)
    guessed = trace.predicted_output > 0
    if guessed.any():  # a predictor's guesses: how often short, and the sigma they amount to
        log_error = np.log(trace.predicted_output[guessed] / trace.output_len[guessed])
        stats["prediction_short_share"] = float((log_error < 0).mean())
        # The median |log error| of a normal error is 0.6745 sigma: a robust estimate.
        stats["prediction_sigma"] = float(np.median(np.abs(log_error)) / 0.6745)
    return stats
