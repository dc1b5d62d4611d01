"""kvsim's own trace file: a :class:`~workloads.trace.Trace` written out as a table, and read
back unchanged.

A trace file is sheet music. ``kvsim trace export`` writes down every request of a scenario's
trace, its dependencies (``after``, ``context_parent``) and its content as shared segments,
so that another scenario, another machine or another simulator plays exactly the same piece:
replayed in a scenario (``workload: {kind: trace, path: trace.csv}``) it gives results
identical to the scenario that wrote it. Rows name each other by index, so a row cannot be
skipped or clipped without changing the rest; a bad one stops the read, naming its line. (A
table of plain rows, written by hand, is cut to the context limit as a generic file is.)
"""

from __future__ import annotations

import csv
import difflib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pandas as pd

from workloads.trace import (
    COLUMNS,
    MAX_COUNT,
    UNIQUE_SEGMENT_BASE,
    Trace,
    TraceError,
    fit_context,
    segments_from_text,
)


class TraceImportError(ValueError):
    """A trace file that cannot be read as asked; the message names file, row and column."""


# The columns a table cannot do without; the others have the defaults of a plain request
# (one sample, no dependency, one private segment of prompt).
REQUIRED_COLUMNS = ("arrival_s", "prompt_len", "output_len")
SEGMENTS_COLUMN = "segments"
# The columns by which a row's prompt depends on other rows: one it follows, one it extends.
LINK_COLUMNS = ("after", "context_parent")
_TIME_COLUMNS = ("arrival_s", "think_s")
# How trace files are read: UTF-8, less a byte-order mark (spreadsheets write one), which
# would otherwise be read as part of the first column's name.
TRACE_ENCODING = "utf-8-sig"


def cell_text(value: Any) -> str:
    """A table cell as an error quotes it: ``0.0``, ``'abc'``, not ``np.float64(0.0)``."""
    return repr(value.item() if isinstance(value, np.generic) else value)


def is_trace_table(names: list[str]) -> bool:
    """Whether a file whose columns are ``names`` is a kvsim trace table: one ``kvsim trace
    export`` wrote, or one written by hand with the columns it needs."""
    return all(name in names for name in REQUIRED_COLUMNS)


def write_trace_file(trace: Trace, path: Path) -> None:
    """Write ``trace`` as CSV or JSONL (by ``path``'s suffix); times keep every digit."""
    frame = trace.to_frame()
    if path.suffix == ".csv":
        frame.to_csv(path, index=False)
    elif path.suffix == ".jsonl":
        # json.dumps writes a float's shortest round-trip form; DataFrame.to_json rounds.
        with path.open("w") as handle:
            for record in frame.to_dict("records"):
                handle.write(json.dumps(record) + "\n")
    else:
        raise TraceImportError(f"{path}: expected a .csv or .jsonl output file")


def read_trace_file(path: Path, max_model_len: int | None = None,
                    max_tokens: int | None = None) -> Trace:
    """Read a trace table back into the trace it was written from.

    With ``max_model_len`` (and ``max_tokens``, a cap on any request's generation), a request
    whose prompt and output do not fit is refused where rows name each other or lay out
    shared segments, since clipping one would change the prompts of others; in a table of
    plain rows (no ``after``, ``context_parent`` or ``segments``) it is clipped, as a generic
    file's is. Each request's ``max_tokens`` is cut to what is left (absent, it is that).
    """
    frame, lines = read_rows(path, "jsonl" if path.suffix == ".jsonl" else "csv",
                             optional=(*COLUMNS, SEGMENTS_COLUMN))
    if frame.empty:
        raise TraceImportError(f"{path}: no requests")
    missing = [name for name in REQUIRED_COLUMNS if name not in frame]
    if missing:
        optional = [name for name in (*COLUMNS, SEGMENTS_COLUMN) if name not in REQUIRED_COLUMNS]
        raise TraceImportError(f"{path}: missing column {missing[0]!r}: a kvsim trace table "
                               f"needs {', '.join(REQUIRED_COLUMNS)} (and may have "
                               f"{', '.join(optional)})")
    columns: dict[str, np.ndarray] = {}
    for name in COLUMNS:
        if name not in frame:
            continue
        values = pd.to_numeric(frame[name], errors="coerce").to_numpy(dtype=float)
        whole = name not in _TIME_COLUMNS
        bad = ~np.isfinite(values) | (whole & ((values != np.round(values))
                                               | (np.abs(values) > MAX_COUNT)))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise TraceImportError(
                f"{path}:{lines[row]}: column {name!r}: expected "
                f"{'an integer within ±2^53' if whole else 'a finite time in seconds'}, "
                f"got {cell_text(frame[name].iloc[row])}")
        columns[name] = values.astype(np.int64) if whole else values
    try:
        if SEGMENTS_COLUMN in frame:
            cells = frame[SEGMENTS_COLUMN].fillna("").astype(str)
            columns.update(segments_from_text(cells))
        elif "context_parent" in columns:
            columns.update(_own_text(columns["prompt_len"], columns["output_len"],
                                     columns["context_parent"]))
        trace = Trace.from_columns(**columns, source=str(path))
    except TraceError as exc:
        where = f"{path}:{lines[exc.request]}" if exc.request is not None else str(path)
        raise TraceImportError(f"{where}: {exc.problem}") from None
    unread = [str(name) for name in frame.columns if name not in (*COLUMNS, SEGMENTS_COLUMN)]
    if unread:  # (a misspelt column would otherwise be lost without a word)
        trace.notes.append(
            f"{path}: left {_columns(unread)} unread: a kvsim trace table reads "
            f"{', '.join((*COLUMNS, SEGMENTS_COLUMN))}")
    if max_model_len is None:
        return trace
    # A client that gave no max_tokens may generate up to what the limits leave (as in a
    # generic file, and as a request_max reservation then holds).
    cap = trace.max_tokens if "max_tokens" in frame else max_model_len
    if max_tokens is not None:
        cap = np.minimum(cap, max_tokens)
    linked = [name for name in (*LINK_COLUMNS, SEGMENTS_COLUMN) if name in frame]
    if not linked:  # no row depends on another's lengths: each is cut alone
        prompt, output, caps, notes = fit_context(trace.prompt_len, trace.output_len, cap,
                                                  max_model_len)
        trace.prompt_len, trace.output_len, trace.max_tokens = prompt, output, caps
        trace.seg_lens = prompt.copy()  # (one private segment per prompt)
        trace.validate()
        trace.notes.extend(notes)
        return trace
    room = np.minimum(max_model_len - trace.prompt_len, cap)
    over = np.flatnonzero(trace.output_len > room)
    if len(over):
        row = int(over[0])
        raise TraceImportError(
            f"{path}:{lines[row]}: prompt_len {trace.prompt_len[row]} + output_len "
            f"{trace.output_len[row]} does not fit the context limit max_model_len "
            f"{max_model_len}" + (f" with max_tokens {max_tokens}" if max_tokens else "")
            + f" ({len(over)} of {len(trace)} requests): the table was written for a longer "
            f"one, and a table with {_names(linked)} is replayed as written, none clipped")
    trace.max_tokens = room
    return trace


def _own_text(prompt_len: np.ndarray, output_len: np.ndarray, context_parent: np.ndarray
              ) -> dict[str, np.ndarray]:
    """Segments for a table that names what each prompt continues (``context_parent``) but
    not its text: the context it continues (that request's prompt and output), then text of
    its own for the rest of ``prompt_len``."""
    rows = np.arange(len(prompt_len))
    # A parent that is not an earlier row is left for Trace.validate to name.
    parent = np.where((context_parent >= 0) & (context_parent < rows), context_parent, -1)
    inherited = np.where(parent >= 0, (prompt_len + output_len)[np.maximum(parent, 0)], 0)
    own = prompt_len - inherited
    short = np.flatnonzero(own < 0)
    if len(short):
        row = int(short[0])
        raise TraceError(f"prompt_len {prompt_len[row]} is shorter than the context it "
                         f"continues: request {parent[row]}'s prompt and output, "
                         f"{inherited[row]} tokens (context_parent {parent[row]})", request=row)
    return {"seg_offsets": np.arange(len(rows) + 1, dtype=np.int64),
            "seg_ids": UNIQUE_SEGMENT_BASE + rows, "seg_lens": own}


def _names(columns: list[str]) -> str:
    """Column names as a sentence lists them."""
    quoted = [repr(name) for name in columns]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


def _columns(names: list[str]) -> str:
    """``names`` as a note names them, each with the column it may be a misspelling of."""
    known = [*COLUMNS, SEGMENTS_COLUMN]
    named = []
    for name in names:
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        named.append(f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    return ("column " if len(names) == 1 else "columns ") + ", ".join(named)


class RowLines:
    """The line of its file that each row of a table starts on, for messages.

    A JSONL file's lines are known as it is read. A CSV file's are counted only when a message
    asks for one: blank lines and quoted line breaks make them differ from the row number, and
    counting them is a second, slower pass over the file.
    """

    def __init__(self, path: Path, known: np.ndarray | None = None) -> None:
        self._path = path
        self._lines = known

    def __getitem__(self, row: int) -> int:
        if self._lines is None:
            self._lines = csv_row_lines(self._path)
        return int(self._lines[row])


def _csv_records(path: Path) -> Iterator[tuple[int, list[str]]]:
    """Each record of a CSV file (the header first) with the line it starts on, past blank
    lines (which pandas skips too)."""
    last_line = [""]

    def physical_lines(handle: TextIO) -> Iterator[str]:
        for line in handle:
            last_line[0] = line
            yield line

    with path.open(newline="", encoding=TRACE_ENCODING, errors="replace") as handle:
        records = csv.reader(physical_lines(handle))
        end = 0
        for fields in records:
            start, end = end + 1, records.line_num
            if start == end and not last_line[0].strip():
                continue
            yield start, fields


def csv_row_lines(path: Path) -> np.ndarray:
    """Where each data row of a CSV file starts."""
    starts = [start for start, _ in _csv_records(path)][1:]
    return np.array(starts, dtype=np.int64)


def _csv_overlong_row(path: Path) -> str:
    """The first data row with more values than the header names, as "FILE:LINE: ..."."""
    records = _csv_records(path)
    _, header = next(records)
    for start, fields in records:
        if len(fields) > len(header):
            return (f"{path}:{start}: {len(fields)} values, but the header names "
                    f"{len(header)} columns: expected one value per column (a trailing comma?)")
    return f"{path}: a row has more values than the header names columns"


def _refuse_duplicates(path: Path, where: str, names: Sequence[str], read: Sequence[str],
                       kind: str) -> None:
    """A column that is read must be named once: pandas would rename a CSV's second one
    (``a.1``) and JSON keeps an object's last, so either would be read silently."""
    for name in read:
        count = sum(1 for n in names if n == name)
        if count > 1:
            raise TraceImportError(f"{path}:{where}: column {name!r} appears {count} times in "
                                   f"the {kind}: expected each column once, so that which one "
                                   "is read is clear")


def read_rows(path: Path, reader: str, wanted: Sequence[str] = (),
              optional: Sequence[str] = ()) -> tuple[pd.DataFrame, RowLines]:
    """A CSV or JSONL file (``reader``) as a table of its values as read (a CSV's as text),
    with the line each row starts on. A ``wanted`` column it lacks is an error, and so is a
    column read (``wanted`` or ``optional``) that is named twice."""
    read = [*wanted, *optional]
    if reader == "csv":
        header_line, header = next(_csv_records(path), (0, []))
        if not header:
            raise TraceImportError(f"{path}: empty file: expected a CSV file whose first line "
                                   "names its columns")
        _refuse_duplicates(path, str(header_line), header, read, "header")
        try:
            frame = pd.read_csv(path, dtype=str, keep_default_na=False,
                                encoding=TRACE_ENCODING)
        except pd.errors.ParserError as exc:
            if "Expected " in str(exc) and " fields in line " in str(exc):
                raise TraceImportError(_csv_overlong_row(path)) from None
            raise TraceImportError(f"{path}: not a readable CSV file: {exc}") from None
        except UnicodeDecodeError as exc:
            raise TraceImportError(f"{path}: not a readable CSV file: {exc}") from None
        if not isinstance(frame.index, pd.RangeIndex):
            # More values in the first row than names: pandas took the extra as an index and
            # would shift every column by one.
            raise TraceImportError(_csv_overlong_row(path))
        missing = [name for name in wanted if name not in header]
        if missing:
            raise TraceImportError(f"{path}: missing column {missing[0]!r}; header has "
                                   f"{', '.join(header)}")
        return frame, RowLines(path)
    records, lines = [], []
    for line_no, record in jsonl_records(path, read):
        for name in wanted:
            if name not in record:
                raise TraceImportError(f"{path}:{line_no}: missing column {name!r}")
        records.append(record)
        lines.append(line_no)
    return pd.DataFrame.from_records(records), RowLines(path, np.array(lines, dtype=np.int64))


def jsonl_records(path: Path, read: Sequence[str] = ()) -> Iterator[tuple[int,
                                                                          dict[str, Any]]]:
    """Each JSON object of a JSON-lines file with its line number; blank lines skipped, and
    a key in ``read`` that an object holds twice an error."""
    def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        record = dict(pairs)
        if len(record) < len(pairs):
            _refuse_duplicates(path, str(line_no), [key for key, _ in pairs], read, "object")
        return record

    # Undecodable bytes are replaced, so that they are invalid JSON on their line.
    with path.open(encoding=TRACE_ENCODING, errors="replace") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line, object_pairs_hook=unique_keys)
            except json.JSONDecodeError as exc:
                raise TraceImportError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise TraceImportError(f"{path}:{line_no}: expected a JSON object per line")
            yield line_no, record
