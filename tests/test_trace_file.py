"""kvsim's own trace file: what ``kvsim trace export`` writes replays exactly, and a bad
row of one stops the read naming its line."""

from __future__ import annotations

import copy
import csv
import io
from pathlib import Path

import numpy as np
import pytest
from conftest import kvsim_in_process as kvsim
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import sim
from sim.api import load
from sim.engine import scenario_trace
from sim.scenario import ScenarioError, scenario_from_dict
from workloads import build_trace
from workloads.spec import SyntheticWorkload, TraceWorkload
from workloads.trace import COLUMNS
from workloads.trace_file import (
    TraceImportError,
    read_rows,
    read_trace_file,
    write_trace_file,
)

# Sessions (requests that continue earlier ones), shared prefixes, parallel samples and
# priorities: everything a trace table must carry.
SESSIONS = {
    "name": "replay", "model": "llama-2-7b", "gpu": "a100-80g", "memory": {"kv_memory_gib": 0.4},
    "workload": {
        "arrival": {"process": "poisson", "rate": 8},
        "prompt_len": {"dist": "lognormal", "mean": 120, "sigma": 0.8, "max": 900},
        "output_len": {"dist": "uniform", "low": 4, "high": 120},
        "max_tokens": 256,
        "prefix_groups": {"groups": 3, "length": 64, "fraction": 0.7},
        "sessions": {"turns": {"dist": "uniform", "low": 1, "high": 4}, "think_time_s": 0.5},
        "sampling": {"n": 2},
        "priorities": {0: 0.3, 1: 0.7},
    },
    "systems": [{"name": "paged", "scheduler": {"policy": "priority"},
                 "allocator": {"kind": "paged", "block_size": 16, "eviction": "lru"}},
                {"name": "contiguous", "allocator": {"kind": "contiguous",
                                                      "reserve_policy": "request_max"}}],
    "stop": {"num_requests": 250},
    "seed": 3,
}
CLOSED_LOOP = copy.deepcopy(SESSIONS)
CLOSED_LOOP["workload"] = {
    "arrival": {"process": "closed_loop", "users": 6, "think_time_s": 0.2},
    "prompt_len": {"dist": "uniform", "low": 10, "high": 400},
    "output_len": {"dist": "uniform", "low": 1, "high": 60},
}


def replayed(scenario: dict, path: Path) -> dict:
    """``scenario`` with its workload replaced by the trace file at ``path``."""
    again = copy.deepcopy(scenario)
    again["workload"] = {"kind": "trace", "path": str(path)}
    return again


@pytest.mark.parametrize("scenario", [SESSIONS, CLOSED_LOOP], ids=["sessions", "closed_loop"])
@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_an_exported_trace_replays_to_identical_results(tmp_path, scenario, suffix):
    trace = scenario_trace(*load(scenario))
    assert (trace.after >= 0).any()  # requests that wait on others: the hard part
    path = tmp_path / f"trace{suffix}"
    write_trace_file(trace, path)
    back = read_trace_file(path)
    for name in (*COLUMNS, "seg_offsets", "seg_ids", "seg_lens"):
        assert np.array_equal(getattr(back, name), getattr(trace, name)), name
    original, replay = sim.run(scenario), sim.run(replayed(scenario, path))
    for name, system in original.systems.items():
        assert replay.systems[name].summary == system.summary
        assert replay.systems[name].requests.equals(system.requests)


def test_the_cli_exports_and_reads_back_a_trace_table(tmp_path):
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: s\nmodel: llama-2-7b\ngpu: a100-80g\nworkload:\n"
                        "  arrival: {process: poisson, rate: 4}\n"
                        "  prompt_len: {dist: constant, value: 64}\n"
                        "  output_len: {dist: constant, value: 8}\n"
                        "  prefix_groups: {groups: 1, length: 32, fraction: 1}\n"
                        "systems: [{name: paged, allocator: {kind: paged}}]\n"
                        "stop: {num_requests: 20}\n")
    out = tmp_path / "t.csv"
    assert kvsim("trace", "export", str(scenario), "-o", str(out)).returncode == 0
    stats = [kvsim("trace", "stats", target).stdout.splitlines()[1:]
             for target in (str(scenario), str(out))]
    assert stats[0][1:] == stats[1][1:] and "requests                    20" in stats[1][1]
    refused = kvsim("trace", "stats", str(out), "--format", "kvsim", "--columns",
                    "arrival=a,prompt_len=b,output_len=c")
    assert refused.returncode == 2 and refused.stderr == (
        f"kvsim: error: {out}: format kvsim (a table kvsim trace export wrote) names its own "
        "columns, times in seconds: give no columns or time_unit\n")
    refused = kvsim("trace", "stats", str(out), "--time-unit", "ms")
    assert refused.returncode == 2 and refused.stderr == (
        f"kvsim: error: {out}: a kvsim trace table (kvsim trace export wrote it) keeps times "
        "in seconds: time_unit ms does not apply\n")
    # With a columns map, a file with these names is a generic one: no sharing is read.
    generic = kvsim("trace", "stats", str(out), "--columns",
                    "arrival=arrival_s,prompt_len=prompt_len,output_len=output_len")
    assert generic.returncode == 0 and "sharing_potential_bs16      0.0000" in generic.stdout
    assert "sharing_potential_bs16      0.0000" not in kvsim("trace", "stats", str(out)).stdout


HEADER = "arrival_s,prompt_len,output_len,after,context_parent,segments\n"


@pytest.mark.parametrize(("rows", "message"), [
    ("0,10,5,-1,-1,1:10\n0.5,ten,5,-1,-1,2:10\n",
     ":3: column 'prompt_len': expected an integer within ±2^53, got 'ten'"),
    ("0,10,5,-1,-1,1:10\n1,10,5,-1,-1,2:10\n2,1e20,5,-1,-1,3:10\n",
     ":4: column 'prompt_len': expected an integer within ±2^53, got '1e20'"),
    ("0,10,5,-1,-1,1:10\nsoon,10,5,-1,-1,2:10\n",
     ":3: column 'arrival_s': expected a finite time in seconds, got 'soon'"),
    ("0,10,5,-1,-1,1:10\n1,10,5,-1,-1,2-10\n",
     ":3: column 'segments': expected id:length pairs of whole numbers (id < 2^63, length <= "
     "2^53) separated by spaces, got '2-10'"),
    ("0,10,5,-1,-1,1:99999999999999999999\n",
     ":2: column 'segments': expected id:length pairs of whole numbers (id < 2^63, length <= "
     "2^53) separated by spaces, got '1:99999999999999999999'"),
    ("0,10,5,-1,-1,1:10\n1,10,5,-1,-1,1:9\n",
     ":3: prompt_len != parent's prompt + output + own segment lengths"),
    ("0,10,5,-1,-1,1:10\n1,25,5,0,0,2:10\n1,30,5,3,-1,3:30\n",
     ":4: after must name an earlier request (or -1)"),
    ("2,10,5,-1,-1,1:10\n1,10,5,-1,-1,2:10\n", ":3: arrival_s must not decrease"),
    ("", ": no requests"),
    ("0,10,5,-1,-1,1:10\n\n0.5,ten,5,-1,-1,2:10\n",  # a blank line still counts
     ":4: column 'prompt_len': expected an integer within ±2^53, got 'ten'"),
])
def test_a_bad_row_names_its_line(tmp_path, rows, message):
    path = tmp_path / "bad.csv"
    path.write_text(HEADER + rows)
    with pytest.raises(TraceImportError) as err:
        read_trace_file(path)
    assert str(err.value) == f"{path}{message}"


def test_what_a_table_needs_and_what_its_replay_refuses(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceImportError, match=r"empty\.jsonl: no requests$"):
        read_trace_file(empty)
    path = tmp_path / "short.csv"
    path.write_text("arrival_s,prompt_len\n0,10\n")
    with pytest.raises(TraceImportError) as err:
        read_trace_file(path)
    assert str(err.value).startswith(
        f"{path}: missing column 'output_len': a kvsim trace table needs arrival_s, "
        "prompt_len, output_len (and may have max_tokens, n, after, ")
    # Only the three needed: plain requests, each prompt its own text.
    path.write_text("arrival_s,prompt_len,output_len,segments\n0,10,5,\n1,12,3,\n")
    with pytest.raises(TraceImportError, match=r":2: prompt_len != parent's"):
        read_trace_file(path)
    path.write_text("arrival_s,prompt_len,output_len\n0,10,5\n1,12,3\n")
    plain = read_trace_file(path)
    assert plain.prompt_segments(0) != plain.prompt_segments(1)
    assert plain.max_tokens.tolist() == [5, 3] and plain.n.tolist() == [1, 1]
    assert plain.notes == []
    # Known by those columns where the format is not given; a column it does not read (a
    # misspelt one, say) is named in the run's notes.
    path.write_text("arrival_s,prompt_len,output_len,prioirty\n0,10,5,1\n1,12,3,0\n")
    guessed = build_trace(TraceWorkload(path=str(path)), seed=0, max_model_len=4096)
    assert guessed.prompt_len.tolist() == [10, 12] and guessed.priority.tolist() == [0, 0]
    assert guessed.notes == [f"{path}: left column 'prioirty' (did you mean 'priority'?) "
                             "unread: a kvsim trace table reads arrival_s, prompt_len, "
                             "output_len, max_tokens, n, after, think_s, context_parent, "
                             "session_id, turn, priority, predicted_output, segments"]
    # Under a context limit, a client that gave no max_tokens may generate what the limit
    # leaves, and plain rows (none names another) are clipped, as a generic file's are.
    assert guessed.max_tokens.tolist() == [4086, 4084]
    path.write_text("arrival_s,prompt_len,output_len\n0,300,5\n1,12,250\n2,20,30\n")
    clipped = build_trace(TraceWorkload(path=str(path), max_tokens=200), seed=0,
                          max_model_len=256)
    assert clipped.prompt_len.tolist() == [255, 12, 20]
    assert clipped.output_len.tolist() == [1, 200, 30]
    assert clipped.max_tokens.tolist() == [1, 200, 200]
    assert [len(clipped.prompt_segments(i)) for i in range(3)] == [1, 1, 1]
    assert clipped.notes == ["clipped 1 of 3 prompts to the context limit 255",
                             "clipped 2 of 3 outputs to the room the context limit (256 "
                             "tokens) leaves after their prompts"]
    generic = build_trace(TraceWorkload(path=str(path), max_tokens=200, format="csv", columns={
        "arrival": "arrival_s", "prompt_len": "prompt_len", "output_len": "output_len"}),
        seed=0, max_model_len=256)
    for column in ("arrival_s", "prompt_len", "output_len", "max_tokens"):
        assert getattr(generic, column).tolist() == getattr(clipped, column).tolist()
    # A continued request cannot be clipped: one that does not fit the context is refused,
    # and skip_invalid cannot drop it.
    path = tmp_path / "long.csv"
    path.write_text(HEADER.replace("segments", "max_tokens,segments")
                    + "0,100,50,-1,-1,200,1:100\n1,200,20,0,0,100,2:50\n")
    workload = TraceWorkload(path=str(path), skip_invalid=True)
    assert build_trace(workload, seed=0, max_model_len=270).max_tokens.tolist() == [170, 70]
    with pytest.raises(TraceImportError) as err:
        build_trace(workload, seed=0, max_model_len=219)
    assert str(err.value) == (
        f"{path}:3: prompt_len 200 + output_len 20 does not fit the context limit "
        "max_model_len 219 (1 of 2 requests): the table was written for a longer one, and a "
        "table with 'after', 'context_parent' and 'segments' is replayed as written, none "
        "clipped (skip_invalid skips no row of a kvsim trace table: its rows name each other "
        "by index)")
    with pytest.raises(TraceImportError, match=r":2: prompt_len 100 \+ output_len 50 does not "
                       r"fit the context limit max_model_len 4096 with max_tokens 40 \(1 of 2 "
                       r"requests\)"):
        build_trace(workload.model_copy(update={"max_tokens": 40}), seed=0, max_model_len=4096)
    faster = build_trace(TraceWorkload(path=str(path), arrival={"process": "trace",
                                                                 "speed": 4}),
                         seed=0, max_model_len=4096)
    assert faster.arrival_s.tolist() == [0.0, 0.25]
    # A hand-written chat names what each prompt continues, not its text: the rest of the
    # prompt is text of its own.
    chat = tmp_path / "chat.csv"
    chat.write_text("arrival_s,prompt_len,output_len,context_parent\n"
                    "0,100,50,-1\n1,200,5,0\n2,300,5,1\n3,40,5,-1\n")
    turns = read_trace_file(chat)
    assert [sum(n for _, n in turns.own_segments(i)) for i in range(4)] == [100, 50, 95, 40]
    assert turns.prompt_segments(2)[:3] == turns.prompt_segments(1)[:3]
    assert len({seg for i in range(4) for seg, _ in turns.own_segments(i)}) == 4
    chat.write_text("arrival_s,prompt_len,output_len,context_parent\n0,100,50,-1\n1,120,5,0\n")
    with pytest.raises(TraceImportError) as err:
        read_trace_file(chat)
    assert str(err.value) == (f"{chat}:3: prompt_len 120 is shorter than the context it "
                              "continues: request 0's prompt and output, 150 tokens "
                              "(context_parent 0)")
    session = tmp_path / "session.csv"  # a second turn 2 s after the first's answer
    session.write_text("arrival_s,prompt_len,output_len,after,think_s,context_parent,segments\n"
                       "0,10,5,-1,0,-1,1:10\n0,25,5,0,2,0,2:10\n")
    for scale_think, think in ((False, [0.0, 2.0]), (True, [0.0, 0.5])):
        replay = build_trace(TraceWorkload(path=str(session), arrival={
            "process": "trace", "speed": 4, "scale_think": scale_think}), seed=0,
            max_model_len=4096)
        assert replay.think_s.tolist() == think
    forked = build_trace(TraceWorkload(path=str(path), sampling={"n": 3}), seed=0,
                         max_model_len=4096)
    assert forked.n.tolist() == [3, 3]
    with pytest.raises(ValidationError, match=r"format kvsim .* give no columns or time_unit"):
        TraceWorkload(path=str(path), format="kvsim", time_unit="ms")


def test_an_empirical_length_resamples_a_trace_table(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_len": 7, "output_len": 3, "segments": "1:7"}\n'
                    '{"arrival_s": 1, "prompt_len": 9, "output_len": 3, "segments": "2:9"}\n')
    workload = SyntheticWorkload(
        arrival={"process": "poisson", "rate": 1},
        prompt_len={"dist": "empirical", "path": str(path), "column": "prompt_len"},
        output_len={"dist": "constant", "value": 2})
    drawn = build_trace(workload, seed=0, max_model_len=4096, num_requests=200)
    assert set(drawn.prompt_len.tolist()) == {7, 9}
    with pytest.raises(ValidationError, match=r"prompt_len\.empirical\.format\n.*'kvsim'"):
        SyntheticWorkload(
            arrival={"process": "poisson", "rate": 1},
            prompt_len={"dist": "empirical", "path": str(path), "column": "prompt_len",
                        "format": "kvsim-table"},
            output_len={"dist": "constant", "value": 2})


_CELL = st.text(alphabet=st.sampled_from('ab1 ,"\n'), max_size=6)


@given(rows=st.lists(st.tuples(st.tuples(_CELL, _CELL), st.sampled_from(["", "\n", "  \n"])),
                     min_size=1, max_size=12))
@settings(max_examples=200, deadline=None)
def test_csv_rows_are_placed_on_the_lines_they_start_on(tmp_path_factory, rows):
    """Whatever the cells hold (quotes, commas, line breaks) and wherever blank lines fall,
    each row pandas reads is reported at the line it starts on."""
    path = tmp_path_factory.mktemp("csv") / "t.csv"
    text, starts, expected = "x,y\n", [], []
    for cells, blank_after in rows:
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerow(cells)
        record = buffer.getvalue()
        if not record.strip():
            continue  # a row of empty cells written as a blank line: no row at all
        starts.append(text.count("\n") + 1)
        expected.append(list(cells))
        text += record + blank_after
    path.write_bytes(text.encode())
    frame, lines = read_rows(path, "csv")
    assert frame.to_numpy().tolist() == expected
    assert [lines[row] for row in range(len(frame))] == starts


@pytest.mark.parametrize(("name", "text", "wanted", "message"), [
    # pandas would read the second 'in' as 'in.1', and the map's 'in' as the first.
    ("t.csv", "t,in,out,in\n0,40,5,7\n", ["t", "in", "out"],
     ":1: column 'in' appears 2 times in the header: expected each column once"),
    ("t.csv", "\n\nt,in,out,in\n0,40,5,7\n", ["in"], ":3: column 'in' appears 2 times"),
    # One value too many in the first row: pandas would take the first as an index and
    # shift every column left, silently.
    ("t.csv", "t,in,out\n0,40,5,9\n1,2,3\n", ["t"],
     ":2: 4 values, but the header names 3 columns: expected one value per column "
     "(a trailing comma?)"),
    ("t.csv", "t,in,out\n0,40,5,\n1,2,3,\n", ["t"], ":2: 4 values, but the header names 3"),
    # Further down, past a quoted line break: the line the row starts on.
    ("t.csv", 't,in,out\n0,"4\n0",5\n\n1,2,3,4,5\n', ["t"],
     ":5: 5 values, but the header names 3 columns"),
    ("t.jsonl", '{"t": 0, "in": 4, "out": 5}\n{"t": 1, "in": 4, "in": 9, "out": 5}\n',
     ["t", "in", "out"], ":2: column 'in' appears 2 times in the object: expected each "
     "column once"),
])
def test_a_column_that_is_read_must_be_unambiguous(tmp_path, name, text, wanted, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceImportError) as err:
        read_rows(path, "jsonl" if name.endswith(".jsonl") else "csv", wanted)
    assert str(err.value).startswith(f"{path}{message}")


def test_a_duplicated_column_that_is_not_read_is_left_alone(tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("t,note,in,note,out\n0,a,40,b,5\n")
    frame, _ = read_rows(csv_path, "csv", ["t", "in", "out"])
    assert frame[["t", "in", "out"]].to_numpy().tolist() == [["0", "40", "5"]]
    jsonl_path = tmp_path / "t.jsonl"
    jsonl_path.write_text('{"t": 0, "note": 1, "in": 40, "note": 2, "out": 5}\n')
    frame, _ = read_rows(jsonl_path, "jsonl", ["t", "in", "out"])
    assert frame[["t", "in", "out"]].to_numpy().tolist() == [[0, 40, 5]]
    # A trace table reads all of its columns, optional ones too.
    table = tmp_path / "table.csv"
    table.write_text("arrival_s,prompt_len,output_len,n,n\n0,10,5,1,2\n")
    with pytest.raises(TraceImportError, match=r"table\.csv:1: column 'n' appears 2 times"):
        read_trace_file(table)


def test_the_cli_refuses_a_shifted_csv_in_one_line(tmp_path):
    path = tmp_path / "shifted.csv"
    path.write_text("t,in,out\n0,40,5,9\n1,30,6,9\n")
    proc = kvsim("trace", "stats", str(path), "--columns", "arrival=t,prompt_len=in,output_len=out")
    assert proc.returncode != 0
    assert proc.stderr.strip() == (f"kvsim: error: {path}:2: 4 values, but the header names 3 "
                                   "columns: expected one value per column (a trailing comma?)")


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    # Spreadsheets save "CSV UTF-8" with a byte-order mark before the first name.
    bom = "\ufeff"
    csv_path = tmp_path / "t.csv"
    csv_path.write_text(f"{bom}t,in,out\n0,40,5\n1,30,6\n", encoding="utf-8")
    frame, lines = read_rows(csv_path, "csv", ["t", "in", "out"])
    assert list(frame.columns) == ["t", "in", "out"]
    assert [lines[0], lines[1]] == [2, 3]
    jsonl_path = tmp_path / "t.jsonl"
    jsonl_path.write_text(f'{bom}{{"t": 0, "in": 40, "out": 5}}\n', encoding="utf-8")
    frame, _ = read_rows(jsonl_path, "jsonl", ["t", "in", "out"])
    assert frame.to_numpy().tolist() == [[0, 40, 5]]
    # A kvsim trace table is still known by its columns, and replays the same requests.
    trace = scenario_trace(*load(SESSIONS))
    table = tmp_path / "table.csv"
    write_trace_file(trace, table)
    marked = tmp_path / "marked.csv"
    marked.write_text(bom + table.read_text(), encoding="utf-8")
    plain = kvsim("trace", "stats", str(table))
    with_mark = kvsim("trace", "stats", str(marked))
    assert with_mark.returncode == 0, with_mark.stderr
    assert with_mark.stdout.replace(str(marked), str(table)) == plain.stdout


def test_a_trace_runs_to_its_end_where_no_stop_is_given(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_len,output_len\n0,10,5\n1,12,3\n2.5,30,8\n")
    scenario = replayed(SESSIONS, path)
    del scenario["stop"]
    run = sim.run(scenario)
    assert [len(system.requests) for system in run.systems.values()] == [3, 3]
    scenario["stop"] = None  # ("stop:" left empty)
    assert scenario_from_dict(scenario).stop.open_ended
    # A synthetic workload has no end: it needs a stop, and a closed loop a count.
    endless = copy.deepcopy(SESSIONS)
    del endless["stop"]
    with pytest.raises(ScenarioError, match=r"stop: give num_requests, duration_s or both \(a "
                       r"synthetic workload draws requests for ever; a trace file's workload "
                       r"stops at its end\)"):
        scenario_from_dict(endless)
    closed = copy.deepcopy(CLOSED_LOOP)
    closed["stop"] = {"duration_s": 60}
    with pytest.raises(ScenarioError, match=r"stop.num_requests: a closed_loop workload needs "
                       r"it"):
        scenario_from_dict(closed)
