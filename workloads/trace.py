"""The Trace: a columnar table of requests, replayed identically against every system.

A trace is a ledger of orders. Each row is one request: when it arrives, how long its prompt
is, how many tokens it will generate, how many samples it asks for. Its *content* is written
compactly: the prompt is "everything request ``context_parent`` saw and said, then these
segments of my own". A segment ``(segment_id, length)`` stands for the first ``length``
tokens of text ``segment_id``; requests that name the same segments share that content, so
their KV blocks hash identically in the simulator without any real token ids.

Requests arrive either at ``arrival_s`` (open arrivals) or ``think_s`` seconds after request
``after`` finishes (closed loops and multi-turn sessions).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

# Segment-id namespaces, so that ids from different sources never collide.
SHARED_SEGMENT_BASE = 1 << 50  # shared texts: system prompts, few-shot shots, Mooncake hash ids
UNIQUE_SEGMENT_BASE = 1 << 52  # each request's own new text: + request index
OUTPUT_SEGMENT_BASE = 1 << 54  # generated text: + request index + sample × OUTPUT_SAMPLE_STRIDE
OUTPUT_SAMPLE_STRIDE = 1 << 40


def output_segment_id(request: int, sample: int = 0) -> int:
    """Segment id of the text that ``sample`` of ``request`` generates."""
    return OUTPUT_SEGMENT_BASE + sample * OUTPUT_SAMPLE_STRIDE + request


# The largest length or token count a trace file may give: past 2^53 a float no longer holds
# every integer (and an int64 soon overflows), and no trace means such a count.
MAX_COUNT = 2**53

COLUMNS = (
    "arrival_s",
    "prompt_len",
    "output_len",
    "max_tokens",
    "n",
    "after",
    "think_s",
    "context_parent",
    "session_id",
    "turn",
    "priority",
    "predicted_output",
)


def segments_from_text(cells: Iterable[str]) -> dict[str, np.ndarray]:
    """Each request's ``id:length`` segment pairs (space-separated, as :meth:`Trace.to_frame`
    writes them) as ``seg_offsets``, ``seg_ids`` and ``seg_lens``."""
    seg_ids: list[int] = []
    seg_lens: list[int] = []
    offsets = [0]
    for row, text in enumerate(cells):
        for pair in text.split():
            segment, colon, length = pair.partition(":")
            if not (colon and segment.isdigit() and length.isdigit()
                    and int(segment) < 1 << 63 and int(length) <= MAX_COUNT):
                raise TraceError(f"column 'segments': expected id:length pairs of whole numbers "
                                 f"(id < 2^63, length <= 2^53) separated by spaces, got "
                                 f"{pair!r}", request=row)
            seg_ids.append(int(segment))
            seg_lens.append(int(length))
        offsets.append(len(seg_ids))
    return {"seg_offsets": np.array(offsets, dtype=np.int64),
            "seg_ids": np.array(seg_ids, dtype=np.int64),
            "seg_lens": np.array(seg_lens, dtype=np.int64)}


def context_clip_notes(prompts: int, outputs: int, size: int, max_model_len: int) -> list[str]:
    """Notes on what the context limit (``max_model_len``) cut of ``size`` requests: prompts
    clipped to ``max_model_len - 1`` tokens, outputs to the room their prompts left."""
    notes = []
    if prompts:
        notes.append(f"clipped {prompts:,} of {size:,} prompts to the context limit "
                     f"{max_model_len - 1:,}")
    if outputs:
        notes.append(f"clipped {outputs:,} of {size:,} outputs to the room the context limit "
                     f"({max_model_len:,} tokens) leaves after their prompts")
    return notes


def fit_context(prompt_len: np.ndarray, output_len: np.ndarray, max_tokens: np.ndarray | int,
                max_model_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """Requests cut to the context limit as a server takes them: each prompt to
    ``max_model_len - 1`` tokens, each ``max_tokens`` (a client's cap) to the room its prompt
    leaves, each output to that cap; with notes on what the limit cut."""
    clipped_prompts = int((prompt_len > max_model_len - 1).sum())
    prompt_len = np.minimum(prompt_len, max_model_len - 1)
    room = max_model_len - prompt_len
    clipped_outputs = int((output_len > room).sum())
    caps = np.maximum(np.minimum(max_tokens, room), 1)
    return (prompt_len, np.minimum(output_len, caps), caps,
            context_clip_notes(clipped_prompts, clipped_outputs, len(prompt_len), max_model_len))


class TraceError(ValueError):
    """A trace that breaks its own rules (negative length, a parent after its child, …);
    ``request`` is the index of the first offending one, where there is one."""

    def __init__(self, message: str, request: int | None = None) -> None:
        super().__init__(message if request is None else f"request {request}: {message}")
        self.request = request
        self.problem = message


@dataclass
class Trace:
    """Columnar requests; every column has one entry per request, in arrival order.

    ``seg_offsets`` (length N+1) index the flat ``seg_ids`` / ``seg_lens`` arrays: request i's
    own prompt segments are ``seg_ids[seg_offsets[i]:seg_offsets[i+1]]``.
    """

    arrival_s: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    max_tokens: np.ndarray
    n: np.ndarray
    after: np.ndarray
    think_s: np.ndarray
    context_parent: np.ndarray
    session_id: np.ndarray
    turn: np.ndarray
    priority: np.ndarray  # scheduling priority, lower first (vLLM's); 0 for all by default
    predicted_output: np.ndarray  # output tokens a length predictor expected; 0: none given
    seg_offsets: np.ndarray
    seg_ids: np.ndarray
    seg_lens: np.ndarray
    source: str = "synthetic"
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.arrival_s)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_columns(
        cls,
        *,
        arrival_s: np.ndarray,
        prompt_len: np.ndarray,
        output_len: np.ndarray,
        max_tokens: np.ndarray | None = None,
        n: np.ndarray | None = None,
        after: np.ndarray | None = None,
        think_s: np.ndarray | None = None,
        context_parent: np.ndarray | None = None,
        session_id: np.ndarray | None = None,
        turn: np.ndarray | None = None,
        priority: np.ndarray | None = None,
        predicted_output: np.ndarray | None = None,
        seg_offsets: np.ndarray | None = None,
        seg_ids: np.ndarray | None = None,
        seg_lens: np.ndarray | None = None,
        source: str = "synthetic",
    ) -> Trace:
        """Build a trace; omitted columns get defaults (one private segment per prompt)."""
        count = len(arrival_s)
        idx = np.arange(count, dtype=np.int64)
        minus1 = np.full(count, -1, dtype=np.int64)
        prompt_len = np.asarray(prompt_len, dtype=np.int64)
        output_len = np.asarray(output_len, dtype=np.int64)
        if seg_offsets is None:
            seg_offsets = np.arange(count + 1, dtype=np.int64)
            seg_ids = UNIQUE_SEGMENT_BASE + idx
            seg_lens = prompt_len.copy()
        trace = cls(
            arrival_s=np.asarray(arrival_s, dtype=np.float64),
            prompt_len=prompt_len,
            output_len=output_len,
            max_tokens=output_len.copy()
            if max_tokens is None
            else np.asarray(max_tokens, np.int64),
            n=np.ones(count, np.int64) if n is None else np.asarray(n, np.int64),
            after=minus1.copy() if after is None else np.asarray(after, np.int64),
            think_s=np.zeros(count) if think_s is None else np.asarray(think_s, np.float64),
            context_parent=minus1.copy()
            if context_parent is None
            else np.asarray(context_parent, np.int64),
            session_id=minus1.copy() if session_id is None else np.asarray(session_id, np.int64),
            turn=np.zeros(count, np.int64) if turn is None else np.asarray(turn, np.int64),
            priority=np.zeros(count, np.int64) if priority is None
            else np.asarray(priority, np.int64),
            predicted_output=np.zeros(count, np.int64) if predicted_output is None
            else np.asarray(predicted_output, np.int64),
            seg_offsets=np.asarray(seg_offsets, np.int64),
            seg_ids=np.asarray(seg_ids, np.int64),
            seg_lens=np.asarray(seg_lens, np.int64),
            source=source,
        )
        trace.validate()
        return trace

    def validate(self) -> None:
        """Raise :class:`TraceError` naming the first offending request and column."""
        count = len(self)
        for name in COLUMNS:
            if len(getattr(self, name)) != count:
                raise TraceError(f"column {name} has {len(getattr(self, name))} rows, not {count}")

        def first_bad(mask: np.ndarray, message: str) -> None:
            bad = np.flatnonzero(mask)
            if len(bad):
                raise TraceError(message, request=int(bad[0]))

        first_bad(~np.isfinite(self.arrival_s) | (self.arrival_s < 0),
                  "arrival_s must be a finite time >= 0")
        first_bad(np.concatenate(([False], np.diff(self.arrival_s) < 0)),
                  "arrival_s must not decrease")
        first_bad(self.prompt_len < 1, "prompt_len must be >= 1")
        first_bad(self.output_len < 1, "output_len must be >= 1")
        first_bad(self.max_tokens < self.output_len, "max_tokens must be >= output_len")
        first_bad(self.n < 1, "n must be >= 1")
        first_bad(self.predicted_output < 0, "predicted_output must be >= 0 (0: none given)")
        idx = np.arange(count)
        first_bad(self.after >= idx, "after must name an earlier request (or -1)")
        first_bad(self.context_parent >= idx, "context_parent must name an earlier request (or -1)")
        first_bad(self.think_s < 0, "think_s must be >= 0")
        if len(self.seg_offsets) != count + 1 or self.seg_offsets[0] != 0:
            raise TraceError("seg_offsets must have one entry per request plus one, from 0")
        first_bad(np.diff(self.seg_offsets) < 0, "seg_offsets must not decrease")
        if np.any(self.seg_lens < 0):
            raise TraceError("segment lengths must be >= 0")
        cumulative = np.concatenate(([0], np.cumsum(self.seg_lens)))
        own = cumulative[self.seg_offsets[1:]] - cumulative[self.seg_offsets[:-1]]
        parent = self.context_parent
        has_parent = parent >= 0
        inherited = np.where(
            has_parent,
            self.prompt_len[np.maximum(parent, 0)] + self.output_len[np.maximum(parent, 0)],
            0,
        )
        first_bad(inherited + own != self.prompt_len,
                  "prompt_len != parent's prompt + output + own segment lengths")

    # ------------------------------------------------------------------ content
    def column_lists(self) -> dict[str, list]:
        """The columns as Python lists (cached): faster than numpy for one row at a time."""
        lists = self.__dict__.get("_column_lists")
        if lists is None:
            lists = {name: getattr(self, name).tolist() for name in COLUMNS}
            self.__dict__["_column_lists"] = lists
        return lists

    def own_segments(self, i: int) -> list[tuple[int, int]]:
        lists = self.__dict__.get("_segment_lists")
        if lists is None:  # Python lists: the engine asks once per request, numpy is slow here
            lists = (self.seg_offsets.tolist(), self.seg_ids.tolist(), self.seg_lens.tolist())
            self.__dict__["_segment_lists"] = lists
        offsets, ids, lens = lists
        lo, hi = offsets[i], offsets[i + 1]
        return list(zip(ids[lo:hi], lens[lo:hi], strict=True))

    def prompt_segments(self, i: int) -> list[tuple[int, int]]:
        """Every segment of request ``i``'s prompt, parent content first."""
        parents = self.column_lists()["context_parent"]
        chain = [i]
        j = parents[i]
        while j >= 0:
            chain.append(j)
            j = parents[j]
        segments: list[tuple[int, int]] = []
        for k, j in enumerate(reversed(chain)):
            segments += self.own_segments(j)
            if k < len(chain) - 1:
                segments.append((output_segment_id(j), self.column_lists()["output_len"][j]))
        return segments

    # ------------------------------------------------------------------ tables
    def to_frame(self) -> pd.DataFrame:
        """One row per request; ``segments`` as ``id:len`` pairs joined by spaces."""
        frame = pd.DataFrame({name: getattr(self, name) for name in COLUMNS})
        frame["segments"] = [
            " ".join(f"{s}:{n}" for s, n in self.own_segments(i)) for i in range(len(self))
        ]
        return frame

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, source: str = "table") -> Trace:
        """Inverse of :meth:`to_frame`."""
        return cls.from_columns(
            # Tables written before priorities (predictions) existed lack them: all 0.
            **{name: frame[name].to_numpy() for name in COLUMNS if name in frame},
            **segments_from_text(frame["segments"].fillna("").astype(str)),
            source=source,
        )

    def head(self, count: int) -> Trace:
        """The first ``count`` requests (dependencies always point backwards, so this is whole)."""
        if count >= len(self):
            return self
        hi = self.seg_offsets[count]
        cut = {name: getattr(self, name)[:count] for name in COLUMNS}
        return Trace(**cut, seg_offsets=self.seg_offsets[: count + 1], seg_ids=self.seg_ids[:hi],
                     seg_lens=self.seg_lens[:hi], source=self.source, notes=list(self.notes))

    def fan_out(self) -> tuple[Trace, np.ndarray]:
        """Each request of n samples as n requests of one sample each, in a row, as vLLM v1
        fans a request out: the same arrival and prompt (its content shared, so that a
        prefix cache finds it), each its own answer; and the request of this trace each
        one stands for. A request that waits on or continues one of several samples
        (``after``, ``context_parent``) cannot say which sample: refused."""
        for name in ("after", "context_parent"):
            column = getattr(self, name)
            waits = np.flatnonzero((column >= 0) & (self.n[np.maximum(column, 0)] > 1))
            if len(waits):
                request = int(waits[0])
                raise TraceError(f"{name} names request {int(column[request])}, of "
                                 f"{int(self.n[column[request]])} samples: which one it "
                                 "follows is unknown once they are requests of their own",
                                 request=request)
        parent = np.repeat(np.arange(len(self), dtype=np.int64), self.n)
        first = np.concatenate(([0], np.cumsum(self.n)[:-1]))  # each request's first sample
        columns = {name: getattr(self, name)[parent] for name in COLUMNS}
        columns["n"] = np.ones(len(parent), dtype=np.int64)
        for name in ("after", "context_parent"):
            column = columns[name]
            columns[name] = np.where(column >= 0, first[np.maximum(column, 0)], -1)
        counts = np.diff(self.seg_offsets)[parent]
        offsets = np.concatenate(([0], np.cumsum(counts)))
        # Each sample's segments: its request's, from where they start.
        take = (np.repeat(self.seg_offsets[:-1][parent], counts)
                + np.arange(offsets[-1]) - np.repeat(offsets[:-1], counts))
        samples = Trace(**columns, seg_offsets=offsets, seg_ids=self.seg_ids[take],
                        seg_lens=self.seg_lens[take], source=self.source,
                        notes=list(self.notes))
        samples.validate()
        return samples, parent

    def total_tokens(self) -> int:
        return int(self.prompt_len.sum() + (self.output_len * self.n).sum())
