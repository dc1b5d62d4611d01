"""Importers of public request traces into :class:`~workloads.trace.Trace`.

Each format is read into one small table (arrival, prompt_len, output_len and, for Mooncake,
``hash_ids``), checked row by row with errors that name the file, the row and the column,
and turned into a trace. Mooncake's ``hash_ids`` name 512-token prompt blocks: requests that
share a hash id share that block's content, so they become shared segments here. A table
``kvsim trace export`` wrote is read whole by :mod:`workloads.trace_file` instead.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from workloads.distributions import EmpiricalLength
from workloads.spec import ColumnMap, TraceWorkload
from workloads.trace import (
    MAX_COUNT,
    SHARED_SEGMENT_BASE,
    UNIQUE_SEGMENT_BASE,
    Trace,
    fit_context,
)
from workloads.trace_file import (
    REQUIRED_COLUMNS,
    TRACE_ENCODING,
    RowLines,
    TraceImportError,
    cell_text,
    csv_row_lines,
    is_trace_table,
    read_rows,
    read_trace_file,
)

BUILTIN_DIR = Path(__file__).parent / "data"
BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class _Format:
    """How one known format names its columns and times."""

    columns: ColumnMap
    time_unit: str
    reader: str  # "csv" or "jsonl"


KNOWN_FORMATS: dict[str, _Format] = {
    # Azure LLM inference trace 2023 (and 2024, same columns): TIMESTAMP,ContextTokens,...
    "azure": _Format(ColumnMap(arrival="TIMESTAMP", prompt_len="ContextTokens",
                               output_len="GeneratedTokens"), "datetime", "csv"),
    # BurstGPT: Timestamp (s),Model,Request tokens,Response tokens,Total tokens,Log Type
    "burstgpt": _Format(ColumnMap(arrival="Timestamp", prompt_len="Request tokens",
                                  output_len="Response tokens"), "s", "csv"),
    # Mooncake FAST'25: {"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}
    "mooncake": _Format(ColumnMap(arrival="timestamp", prompt_len="input_length",
                                  output_len="output_length", hash_ids="hash_ids"), "ms",
                        "jsonl"),
}


def resolve_path(path: str, base_dir: Path) -> Path:
    """``builtin:NAME`` → the shipped copy; a relative path → relative to ``base_dir``."""
    if path.startswith(BUILTIN_PREFIX):
        resolved = BUILTIN_DIR / path[len(BUILTIN_PREFIX):]
        if not resolved.is_file():
            names = ", ".join(builtin_traces())
            raise TraceImportError(f"{path}: no such built-in trace; shipped: {names}")
        return resolved
    resolved = Path(path)
    if not resolved.is_absolute():
        resolved = base_dir / resolved
    if resolved.is_dir():
        raise TraceImportError(f"{resolved}: is a directory, expected a trace file")
    if resolved.exists() and not resolved.is_file():  # read twice: a pipe would be empty
        raise TraceImportError(f"{resolved}: not a regular file (a device or a pipe), "
                               "expected a trace file")
    if not resolved.is_file():
        raise TraceImportError(f"{resolved}: trace file not found")
    return resolved


def builtin_traces() -> list[str]:
    """Names usable as ``builtin:NAME``."""
    return sorted(p.name for p in BUILTIN_DIR.iterdir() if p.suffix in (".csv", ".jsonl"))


def builtin_trace_summary(name: str) -> tuple[str, int]:
    """(format, rows) of a shipped trace, for ``kvsim trace list``."""
    path = BUILTIN_DIR / name
    if path.suffix == ".csv":  # records, not lines: a quoted value may hold a line break
        rows = len(csv_row_lines(path))
    else:
        with path.open(encoding=TRACE_ENCODING, errors="replace") as handle:
            rows = sum(1 for line in handle if line.strip())
    return _guess_format(path), rows


def _guess_format(path: Path) -> str:
    head = _first_line(path)
    if path.suffix == ".jsonl":
        try:
            record = json.loads(head)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and is_trace_table(list(record)):
            return "kvsim"
        return "mooncake" if '"hash_ids"' in head else "jsonl"
    if is_trace_table(head.split(",")):
        return "kvsim"
    if "ContextTokens" in head:
        return "azure"
    if "Request tokens" in head:
        return "burstgpt"
    return "csv"


def _format_of(workload: TraceWorkload, path: Path) -> str:
    """The format to read ``path`` as: the one given, else the one its first line shows (a
    file that looks like a kvsim trace table but comes with a columns map is read as a
    generic one)."""
    if workload.format is not None:
        return workload.format
    guessed = _guess_format(path)
    if guessed == "kvsim" and workload.columns is not None:
        return "jsonl" if path.suffix == ".jsonl" else "csv"
    if guessed == "kvsim" and workload.time_unit not in (None, "s"):
        raise TraceImportError(f"{path}: a kvsim trace table (kvsim trace export wrote it) "
                               f"keeps times in seconds: time_unit {workload.time_unit} does "
                               "not apply")
    return guessed


def _first_line(path: Path) -> str:
    """A file's first line that is not blank (a CSV's header), stripped."""
    with path.open(encoding=TRACE_ENCODING, errors="replace") as handle:
        return next((line.strip() for line in handle if line.strip()), "")


def _needs_columns(path: Path, fmt_name: str, guessed: bool) -> str:
    """Why a generic file cannot be read without a columns map, and what would read it."""
    first = _first_line(path)[:120]
    known = "; ".join(f"{name}: {fmt.columns.arrival!r}, {fmt.columns.prompt_len!r}, "
                      f"{fmt.columns.output_len!r}" for name, fmt in KNOWN_FORMATS.items())
    known += "; kvsim: " + ", ".join(map(repr, REQUIRED_COLUMNS))
    return (f"{path}: format {fmt_name} needs a columns map (workload.columns: {{arrival, "
            "prompt_len, output_len}: the names of its columns; on kvsim trace, --columns "
            "arrival=NAME,prompt_len=NAME,output_len=NAME)"
            + (f"; it is none of the known formats ({known}); its first line: {first!r}"
               if guessed else ""))


def _numbers(raw: pd.Series) -> np.ndarray:
    """A column's values as floats, NaN where one is not a number."""
    return pd.to_numeric(raw, errors="coerce").to_numpy(dtype=float)


A_COUNT = "an integer from 1 to 2^53"  # a length or token count read from a file


def _not_a_count(values: np.ndarray) -> np.ndarray:
    """Where ``values`` are not integers from 1 to ``MAX_COUNT`` (a length, a token count)."""
    return (~np.isfinite(values) | (values < 1) | (values > MAX_COUNT)
            | (values != np.round(values)))


def _rows(count: int) -> str:
    return f"{count} row" if count == 1 else f"{count} rows"


def _bad_rows(
    raw: pd.DataFrame,
    lines: RowLines,
    problems: list[tuple[np.ndarray, str, str]],
    path: Path,
    skip_invalid: bool,
    skip_hint: str = "skip_invalid: true, or --skip-invalid on kvsim trace",
) -> tuple[np.ndarray, list[str]]:
    """The rows that fail any of ``problems`` (mask, column, what was expected) and a note per
    column on what was skipped; without ``skip_invalid``, the first bad row is an error that
    names its line, column and value, and ``skip_hint``: how to skip such rows instead."""
    bad = np.zeros(len(raw), dtype=bool)
    notes: list[str] = []
    for mask, column, expected in problems:
        mask = mask & ~bad
        if mask.any():
            row = int(np.flatnonzero(mask)[0])
            value = cell_text(raw[column].iloc[row])
            if not skip_invalid:
                raise TraceImportError(
                    f"{path}:{lines[row]}: column {column!r}: expected {expected}, got "
                    f"{value} ({skip_hint}, skips such rows)")
            notes.append(f"skipped {_rows(int(mask.sum()))} with bad {column!r} "
                         f"(first at line {lines[row]}: {value})")
            bad |= mask
    return bad, notes


# Hash ids become segment ids above SHARED_SEGMENT_BASE; this bound keeps them below the
# ids of each request's own text.
HASH_ID_BITS = 50


def _hash_id_list(value: object) -> list[int] | None:
    """A row's hash ids: a JSON list (a CSV cell holds its text) of integers in range, or
    None where it is anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError:
            return None
    if not isinstance(value, list):
        return None
    if not all(type(i) is int and 0 <= i < 1 << HASH_ID_BITS for i in value):
        return None
    return value


def _times(raw: pd.Series, unit: str) -> np.ndarray:
    if unit == "datetime":
        parsed = pd.to_datetime(raw, errors="coerce", format="mixed")
        seconds = (parsed - parsed.min()).dt.total_seconds()
        return seconds.to_numpy(dtype=float, na_value=np.nan)
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]
    return _numbers(raw) * scale


def read_trace_table(
    workload: TraceWorkload, base_dir: Path
) -> tuple[pd.DataFrame, list[str]]:
    """The trace as a clean table (arrival_s from 0, prompt_len, output_len[, priority]
    [, predicted_output][, max_tokens][, hash_ids]) and notes on what was skipped."""
    path = resolve_path(workload.path, base_dir)
    fmt_name = _format_of(workload, path)
    if fmt_name in KNOWN_FORMATS:
        fmt = KNOWN_FORMATS[fmt_name]
        columns = workload.columns or fmt.columns
        unit = workload.time_unit or fmt.time_unit
        reader = fmt.reader
    else:
        if workload.columns is None:
            raise TraceImportError(_needs_columns(path, fmt_name, guessed=not workload.format))
        columns, reader = workload.columns, fmt_name
        unit = workload.time_unit or "s"
    wanted = [columns.arrival, columns.prompt_len, columns.output_len]
    wanted += [c for c in (columns.priority, columns.predicted_output, columns.max_tokens,
                           columns.hash_ids) if c is not None]
    raw, lines = read_rows(path, reader, wanted)
    arrival = _times(raw[columns.arrival], unit)
    prompt = _numbers(raw[columns.prompt_len])
    output = _numbers(raw[columns.output_len])
    problems = [
        (~np.isfinite(arrival) | (arrival < 0), columns.arrival,
         "a date and time" if unit == "datetime" else f"a time >= 0 (in {unit})"),
        (_not_a_count(prompt), columns.prompt_len, A_COUNT),
        (_not_a_count(output), columns.output_len, A_COUNT),
    ]
    if columns.priority is not None:
        priority = _numbers(raw[columns.priority])
        problems.append((~np.isfinite(priority) | (priority != np.round(priority)),
                         columns.priority, "an integer"))
    if columns.predicted_output is not None:
        predicted = _numbers(raw[columns.predicted_output])
        problems.append((_not_a_count(predicted), columns.predicted_output, A_COUNT))
    if columns.max_tokens is not None:
        # A client that sent no max_tokens (an empty cell, a JSON null) is capped by the
        # limits alone; one that did is never generated more for (a server stops there).
        cells = raw[columns.max_tokens]
        unasked = (cells.isna() | (cells.astype(str).str.strip() == "")).to_numpy()
        asked = np.where(unasked, MAX_COUNT, _numbers(cells))
        problems.append((_not_a_count(asked) | (asked < output), columns.max_tokens,
                         f"an integer from the row's {columns.output_len!r} to 2^53, or "
                         "none (empty)"))
    if columns.hash_ids is not None:
        hash_lists = [_hash_id_list(value) for value in raw[columns.hash_ids]]
        problems.append((np.array([ids is None for ids in hash_lists], dtype=bool),
                         columns.hash_ids, f"a list of integers 0 <= id < 2^{HASH_ID_BITS} "
                         "(in a CSV cell, as JSON: \"[1, 2, 3]\")"))
    bad, notes = _bad_rows(raw, lines, problems, path, workload.skip_invalid)
    # Unsorted timestamps: a row earlier than one before it.
    running = np.fmax.accumulate(np.where(bad, -np.inf, arrival))
    earlier = ~bad & (arrival < np.concatenate(([-np.inf], running[:-1])))
    if earlier.any():
        row = int(np.flatnonzero(earlier)[0])
        if not workload.skip_invalid:
            raise TraceImportError(
                f"{path}:{lines[row]}: column {columns.arrival!r}: timestamps must not decrease "
                f"(got {cell_text(raw[columns.arrival].iloc[row])} after a later one)")
        notes.append(f"skipped {_rows(int(earlier.sum()))} with out-of-order "
                     f"{columns.arrival!r} (first at line {lines[row]})")
        bad |= earlier
    keep = ~bad
    table = pd.DataFrame({
        "arrival_s": arrival[keep] - (arrival[keep].min() if keep.any() else 0.0),
        "prompt_len": prompt[keep].astype(np.int64),
        "output_len": output[keep].astype(np.int64),
    })
    if columns.priority is not None:
        table["priority"] = priority[keep].astype(np.int64)
    if columns.predicted_output is not None:
        table["predicted_output"] = predicted[keep].astype(np.int64)
    if columns.max_tokens is not None:
        table["max_tokens"] = asked[keep].astype(np.int64)
    if columns.hash_ids is not None:
        table["hash_ids"] = [ids for ids, kept in zip(hash_lists, keep, strict=True) if kept]
    if table.empty:
        raise TraceImportError(f"{path}: no valid rows")
    return table, notes


def read_length_column(
    dist: EmpiricalLength, base_dir: Path
) -> tuple[np.ndarray, tuple[str, ...]]:
    """The lengths an empirical distribution resamples (read-only) and notes on skipped rows:
    the column ``dist.file_column`` names, else the one its format keeps ``dist.column`` in.
    A file is read once while it is unchanged, however many times the workload is drawn."""
    path = resolve_path(dist.path, base_dir)
    stat = path.stat()
    return _length_values(path, stat.st_mtime_ns, stat.st_size, dist.format or
                          _guess_format(path), dist.column, dist.file_column, dist.skip_invalid)


@functools.lru_cache(maxsize=32)
def _length_values(
    path: Path, mtime_ns: int, size_bytes: int, fmt_name: str, column: str | None,
    file_column: str | None, skip_invalid: bool,
) -> tuple[np.ndarray, tuple[str, ...]]:
    if fmt_name in KNOWN_FORMATS:
        known = KNOWN_FORMATS[fmt_name]
        reader, name = known.reader, file_column or getattr(known.columns, str(column))
    else:
        reader = "jsonl" if fmt_name == "jsonl" or path.suffix == ".jsonl" else "csv"
        name = file_column or (column if fmt_name == "kvsim" else None)
        if name is None:
            raise TraceImportError(
                f"{path}: format {fmt_name} does not say which column holds {column}: give the "
                "empirical length a file_column (the column's name in the file); its first "
                f"line: {_first_line(path)[:120]!r}")
    raw, lines = read_rows(path, reader, [name])
    values = _numbers(raw[name])
    bad, notes = _bad_rows(raw, lines, [(_not_a_count(values), name, A_COUNT)],
                           path, skip_invalid, "skip_invalid: true on the empirical length")
    kept = values[~bad]
    if not kept.size:
        raise TraceImportError(f"{path}: no valid rows in column {name!r}")
    kept.setflags(write=False)
    return kept, tuple(notes)


def import_trace(
    workload: TraceWorkload, base_dir: Path, max_model_len: int, seed: int = 0
) -> Trace:
    """Read ``workload.path`` into a trace; lengths beyond the context limit are clipped
    (refused in a kvsim trace table, whose requests continue each other)."""
    path = resolve_path(workload.path, base_dir)
    if _format_of(workload, path) == "kvsim":
        return _replay_trace_file(workload, path, max_model_len, seed)
    table, notes = read_trace_table(workload, base_dir)
    size = len(table)
    cap: np.ndarray | int = workload.max_tokens or max_model_len
    if "max_tokens" in table:  # each client's own, within the workload's and the context's
        cap = np.minimum(table["max_tokens"].to_numpy(), cap)
    prompt, output, max_tokens, clip_notes = fit_context(
        table["prompt_len"].to_numpy(), table["output_len"].to_numpy(), cap, max_model_len)
    notes += clip_notes
    if "hash_ids" in table:
        offsets, seg_ids, seg_lens = _hash_segments(
            table["hash_ids"].to_list(), prompt, workload.hash_block_tokens)
    else:
        offsets = np.arange(size + 1)
        seg_ids = UNIQUE_SEGMENT_BASE + np.arange(size)
        seg_lens = prompt
    trace = Trace.from_columns(
        arrival_s=_arrivals(workload, table["arrival_s"].to_numpy(), seed),
        prompt_len=prompt,
        output_len=output,
        max_tokens=max_tokens,
        n=np.full(size, workload.sampling.forks),
        seg_offsets=offsets,
        seg_ids=seg_ids,
        seg_lens=seg_lens,
        priority=table["priority"].to_numpy() if "priority" in table else None,
        predicted_output=(table["predicted_output"].to_numpy() if "predicted_output" in table
                          else None),
        source=str(workload.path),
    )
    trace.notes.extend(notes)
    return trace


def _replay_trace_file(
    workload: TraceWorkload, path: Path, max_model_len: int, seed: int
) -> Trace:
    """A table ``kvsim trace export`` wrote, with the workload's arrival and sampling."""
    try:
        trace = read_trace_file(path, max_model_len, workload.max_tokens)
    except TraceImportError as exc:
        if workload.skip_invalid:
            raise TraceImportError(f"{exc} (skip_invalid skips no row of a kvsim trace table: "
                                   "its rows name each other by index)") from None
        raise
    trace.arrival_s = _arrivals(workload, trace.arrival_s, seed)
    if workload.arrival.process == "trace" and workload.arrival.scale_think:
        trace.think_s = trace.think_s / workload.arrival.speed
    if "sampling" in workload.model_fields_set:  # else each request keeps its own n
        trace.n = np.full(len(trace), workload.sampling.forks, dtype=np.int64)
    return trace


def _arrivals(workload: TraceWorkload, arrival_s: np.ndarray, seed: int) -> np.ndarray:
    """The trace's own times, ``speed`` times faster, or times drawn by the workload's
    synthetic arrival process."""
    if workload.arrival.process == "trace":
        return arrival_s / workload.arrival.speed
    return workload.arrival.sample(np.random.default_rng(seed), len(arrival_s))


def _hash_segments(
    hash_lists: list, prompt: np.ndarray, block_tokens: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mooncake-style ``hash_ids`` → shared segments of ``block_tokens`` (the last partial),
    plus a private segment for any prompt tokens the hash ids do not cover."""
    seg_ids: list[int] = []
    seg_lens: list[int] = []
    offsets = [0]
    for i, (ids, length) in enumerate(zip(hash_lists, prompt.tolist(), strict=True)):
        remaining = length
        for hash_id in ids:
            if remaining <= 0:
                break
            take = min(block_tokens, remaining)
            seg_ids.append(SHARED_SEGMENT_BASE + int(hash_id))
            seg_lens.append(take)
            remaining -= take
        if remaining > 0:
            seg_ids.append(UNIQUE_SEGMENT_BASE + i)
            seg_lens.append(remaining)
        offsets.append(len(seg_ids))
    return (np.array(offsets, dtype=np.int64), np.array(seg_ids, dtype=np.int64),
            np.array(seg_lens, dtype=np.int64))
