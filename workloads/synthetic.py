"""Synthetic traces: a recipe (:class:`~workloads.spec.SyntheticWorkload`) plus a seed in,
a :class:`~workloads.trace.Trace` out.

Open-loop, non-session workloads are drawn column by column with numpy (a million requests in
about a second); sessions walk each conversation in Python because every turn's prompt is
built from the one before.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from workloads.spec import FewShot, PrefixGroups, SyntheticWorkload
from workloads.trace import (
    SHARED_SEGMENT_BASE,
    UNIQUE_SEGMENT_BASE,
    Trace,
    context_clip_notes,
)

FEW_SHOT_SEGMENT_BASE = SHARED_SEGMENT_BASE + (1 << 40)


class WorkloadError(ValueError):
    """A workload recipe that cannot produce a valid trace (with the reason)."""


def _zipf_choice(rng: np.random.Generator, k: int, s: float, size: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, k + 1) ** s
    return rng.choice(k, size=size, p=weights / weights.sum())


def _shared_prefix(
    rng: np.random.Generator,
    size: int,
    groups: PrefixGroups | None,
    few_shot: FewShot | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-request leading shared segments as (ids, lens, present) matrices of shape (size, C)."""
    ids, lens, present = [], [], []
    if groups is not None:
        uses = rng.random(size) < groups.fraction
        pick = _zipf_choice(rng, groups.groups, groups.zipf_s, size)
        ids.append(SHARED_SEGMENT_BASE + pick)
        lens.append(np.full(size, groups.length))
        present.append(uses)
    if few_shot is not None:
        uses = rng.random(size) < few_shot.fraction
        template = _zipf_choice(rng, few_shot.templates, few_shot.zipf_s, size)
        for shot in range(few_shot.shots):
            ids.append(FEW_SHOT_SEGMENT_BASE + template * few_shot.shots + shot)
            lens.append(np.full(size, few_shot.shot_len))
            present.append(uses)
    if not ids:
        empty = np.zeros((size, 0), dtype=np.int64)
        return empty, empty, empty.astype(bool)
    return (np.stack(ids, axis=1).astype(np.int64), np.stack(lens, axis=1).astype(np.int64),
            np.stack(present, axis=1))


def _pack_segments(
    ids: np.ndarray, lens: np.ndarray, present: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row-major CSR of the present cells of (size, C) matrices."""
    offsets = np.concatenate(([0], np.cumsum(present.sum(axis=1)))).astype(np.int64)
    return offsets, ids[present], lens[present]


def generate(
    spec: SyntheticWorkload,
    num_requests: int,
    seed: int,
    max_model_len: int,
    base_dir: Path = Path(),
) -> Trace:
    """Draw ``num_requests`` requests from ``spec`` (deterministic for a seed).

    Lengths are clipped so that prompt + output fits ``max_model_len``; a shared prefix that
    alone leaves no room is an error.
    """
    if num_requests < 1:
        raise WorkloadError("num_requests must be >= 1")
    problem = spec.context_problem(max_model_len)
    if problem:
        raise WorkloadError(problem)
    if spec.sessions is not None:
        # A conversation that reaches the context limit ends early; draw more sessions
        # until there are enough turns (each attempt from the same seed: deterministic).
        for factor in (1.5, 3, 6, 12, 24):
            trace = _generate_sessions(spec, num_requests, np.random.default_rng(seed),
                                       max_model_len, base_dir, factor)
            if trace is not None:
                return trace
        raise WorkloadError("sessions end too early to reach num_requests; raise the "
                            "model's context limit or shorten the turns")
    rng = np.random.default_rng(seed)
    size = num_requests
    own = spec.prompt_len.sample(rng, size, base_dir)
    output = spec.output_len.sample(rng, size, base_dir)
    ids, lens, present = _shared_prefix(rng, size, spec.prefix_groups, spec.few_shot)
    prefix = (lens * present).sum(axis=1)
    room = max_model_len - 1 - prefix
    clipped_prompts = int((own > room).sum())
    own = np.minimum(own, room)
    prompt = prefix + own
    clipped_outputs = int((output > max_model_len - prompt).sum())
    max_tokens = _max_tokens(spec, prompt, max_model_len)
    output = np.minimum(output, max_tokens)
    idx = np.arange(size, dtype=np.int64)
    ids = np.concatenate([ids, (UNIQUE_SEGMENT_BASE + idx)[:, None]], axis=1)
    lens = np.concatenate([lens, own[:, None]], axis=1)
    present = np.concatenate([present, np.ones((size, 1), dtype=bool)], axis=1)
    offsets, seg_ids, seg_lens = _pack_segments(ids, lens, present)
    columns: dict[str, np.ndarray] = {}
    if spec.arrival.process == "closed_loop":
        users = min(spec.arrival.users, size)  # users past the requests never send one
        columns["arrival_s"] = np.zeros(size)
        columns["after"] = np.where(idx >= users, idx - users, -1)
        columns["think_s"] = np.where(idx >= users, spec.arrival.think(rng, size), 0.0)
        columns["session_id"] = idx % users
    else:
        columns["arrival_s"] = spec.arrival.sample(rng, size)
    trace = Trace.from_columns(
        prompt_len=prompt,
        output_len=output,
        max_tokens=max_tokens,
        n=np.full(size, spec.sampling.forks),
        seg_offsets=offsets,
        seg_ids=seg_ids,
        seg_lens=seg_lens,
        source="synthetic",
        **columns,
    )
    trace.notes.extend(context_clip_notes(clipped_prompts, clipped_outputs, size,
                                          max_model_len))
    return trace


def _max_tokens(spec: SyntheticWorkload, prompt: np.ndarray, max_model_len: int) -> np.ndarray:
    cap = spec.max_tokens or spec.output_len.max or max_model_len
    return np.maximum(np.minimum(cap, max_model_len - prompt), 1)


def _generate_sessions(
    spec: SyntheticWorkload,
    num_requests: int,
    rng: np.random.Generator,
    max_model_len: int,
    base_dir: Path,
    factor: float,
) -> Trace | None:
    """Conversations: turn t's prompt = turn t-1's prompt and answer + new user text.
    None if ``factor`` × the expected number of sessions does not give enough turns."""
    sessions = spec.sessions
    assert sessions is not None
    estimate = max(8, int(num_requests / max(1.0, _mean_turns(sessions, base_dir)) * factor))
    starts = spec.arrival.sample(rng, estimate)  # type: ignore[union-attr]
    turns = sessions.turns.sample(rng, estimate, base_dir)
    first_own = spec.prompt_len.sample(rng, estimate, base_dir)
    ids, lens, present = _shared_prefix(rng, estimate, spec.prefix_groups, spec.few_shot)
    user_dist = sessions.user_len or spec.prompt_len
    rows: dict[str, list] = {k: [] for k in ("arrival_s", "prompt_len", "output_len",
                                              "max_tokens", "after", "think_s",
                                              "context_parent", "session_id", "turn")}
    seg_ids: list[int] = []
    seg_lens: list[int] = []
    offsets = [0]
    # No conversation outlasts the requests asked for, nor the context: each turn's prompt
    # holds the last one and its answer, two tokens more at least.
    max_turns = int(min(turns.max(), num_requests, max_model_len // 2 + 1))
    turns = np.minimum(turns, max_turns)
    later_own = user_dist.sample(rng, estimate * max_turns, base_dir).reshape(estimate, max_turns)
    outputs = spec.output_len.sample(rng, estimate * max_turns, base_dir).reshape(
        estimate, max_turns)
    thinks = rng.exponential(sessions.think_time_s, (estimate, max_turns)) if (
        sessions.think_time_s > 0) else np.zeros((estimate, max_turns))
    cap = spec.max_tokens or spec.output_len.max or max_model_len
    session = 0
    while len(rows["prompt_len"]) < num_requests:
        if session == estimate:
            return None
        context = 0
        prev = -1
        for turn in range(int(turns[session])):
            index = len(rows["prompt_len"])
            if turn == 0:
                shared = [(int(i), int(n)) for i, n, p in
                          zip(ids[session], lens[session], present[session], strict=True) if p]
                own = int(first_own[session])
            else:
                shared = []
                own = int(later_own[session, turn])
            prompt = context + sum(n for _, n in shared) + own
            if prompt >= max_model_len:
                break
            max_tok = max(1, min(cap, max_model_len - prompt))
            output = int(min(outputs[session, turn], max_tok))
            rows["arrival_s"].append(float(starts[session]))
            rows["prompt_len"].append(prompt)
            rows["output_len"].append(output)
            rows["max_tokens"].append(max_tok)
            rows["after"].append(prev)
            rows["think_s"].append(float(thinks[session, turn]) if turn else 0.0)
            rows["context_parent"].append(prev)
            rows["session_id"].append(session)
            rows["turn"].append(turn)
            for seg in [*shared, (UNIQUE_SEGMENT_BASE + index, own)]:
                seg_ids.append(seg[0])
                seg_lens.append(seg[1])
            offsets.append(len(seg_ids))
            context, prev = prompt + output, index
            if len(rows["prompt_len"]) == num_requests:
                break
        session += 1
    return Trace.from_columns(
        **{k: np.array(v) for k, v in rows.items()},
        n=np.full(len(rows["prompt_len"]), spec.sampling.forks),
        seg_offsets=np.array(offsets),
        seg_ids=np.array(seg_ids, dtype=np.int64),
        seg_lens=np.array(seg_lens, dtype=np.int64),
        source="synthetic",
    )


def _mean_turns(sessions, base_dir) -> float:  # type: ignore[no-untyped-def]
    probe = np.random.default_rng(0)
    return float(sessions.turns.sample(probe, 1000, base_dir).mean())
