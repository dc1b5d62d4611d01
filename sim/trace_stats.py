"""Figures that describe a trace before any simulation: size, rate, lengths, sharing,
priorities.

*Prefix-sharing potential* at block size ``bs`` is the share of prompt tokens that lie in full
blocks whose chained hash (the whole prefix up to and including the block) also occurs in
another request's prompt — the most a perfect, infinite prefix cache could reuse.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from workloads.trace import Trace


def sharing_potential(trace: Trace, block_size: int) -> float:
    """Share of prompt tokens in full blocks that another request's prompt also has."""
    # Two prompts share block k exactly when their first (k + 1) · block_size tokens agree,
    # and sorted prompts keep those sharing a prefix together, so a prompt's longest prefix
    # in common with any other is the longer of those with its two neighbours: the count a
    # pool's chained block hashes would give, without hashing millions of blocks.
    prompts = [tuple(seg for seg in trace.prompt_segments(i) if seg[1] > 0)
               for i in range(len(trace))]
    order = sorted(range(len(prompts)), key=prompts.__getitem__)
    longest_shared = [0] * len(prompts)
    for a, b in itertools.pairwise(order):
        common = _common_prefix_tokens(prompts[a], prompts[b])
        longest_shared[a] = max(longest_shared[a], common)
        longest_shared[b] = max(longest_shared[b], common)
    shared_blocks = sum(tokens // block_size for tokens in longest_shared)
    total = int(trace.prompt_len.sum())
    return shared_blocks * block_size / total if total else 0.0


def _common_prefix_tokens(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> int:
    """How many leading tokens two prompts (as segments of nonzero length) have in common: a
    segment's tokens are its id at each offset, so the same id agrees for the shorter one's
    length, and after that the two differ."""
    tokens = 0
    for (id_a, len_a), (id_b, len_b) in zip(a, b, strict=False):  # up to the shorter
        if id_a != id_b:
            break
        tokens += min(len_a, len_b)
        if len_a != len_b:
            break
    return tokens


def trace_stats(trace: Trace, block_size: int = 16,
                context_limit: int | None = None) -> dict[str, Any]:
    """Count, duration, rate, length percentiles, max_tokens and the share of it a
    request_max reservation holds in vain (unless every request may fill
    ``context_limit``), sharing potential, where requests differ
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
    # What each request may generate, and the share of it a reservation of prompt +
    # max_tokens (contiguous request_max) holds for tokens that never come; not where the
    # trace sets no limit (each request may fill ``context_limit``, a bare file's).
    unlimited = context_limit is not None and bool(
        (trace.max_tokens == np.maximum(context_limit - trace.prompt_len, 1)).all())
    if not unlimited:
        stats["max_tokens_p50"] = float(np.percentile(trace.max_tokens, 50))
        stats["max_tokens_max"] = int(trace.max_tokens.max())
        stats["max_tokens_unused_share"] = float(
            1.0 - trace.output_len.sum() / trace.max_tokens.sum())
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
