"""Synthetic generators (statistics on 100k draws) and importers of the public traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import PUBLIC_TRACE_ROWS
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from sim.engine import run_scenario
from sim.memory.content import BlockHasher
from sim.scenario import scenario_from_dict
from sim.trace_stats import sharing_potential, trace_stats
from workloads import Trace, TraceImportError, WorkloadError, build_trace
from workloads.distributions import (
    GammaArrivals,
    LengthDist,
    LognormalLength,
    PoissonArrivals,
)
from workloads.spec import TraceWorkload, Workload

WORKLOAD = TypeAdapter(Workload)
N = 100_000


def draw(spec: dict) -> np.ndarray:
    return TypeAdapter(LengthDist).validate_python(spec).sample(np.random.default_rng(0), N)


@pytest.mark.parametrize(("spec", "mean", "rel_tol"), [
    ({"dist": "lognormal", "mean": 161, "sigma": 1.0, "max": 100_000}, 161, 0.02),
    ({"dist": "lognormal", "mean": 338, "p99": 2000, "max": 100_000}, 338, 0.02),
    ({"dist": "exponential", "mean": 250, "max": 100_000}, 250, 0.02),
    ({"dist": "uniform", "low": 10, "high": 30}, 20, 0.01),
    ({"dist": "normal", "mean": 500, "std": 50}, 500, 0.01),
    ({"dist": "constant", "value": 77}, 77, 0.0),
    ({"dist": "pareto", "alpha": 3.0, "scale": 100, "max": 10**9}, 150, 0.03),
])
def test_length_means(spec, mean, rel_tol):
    values = draw(spec)
    assert values.mean() == pytest.approx(mean, rel=rel_tol, abs=0.5)
    assert values.min() >= 1


def test_a_lognormal_p99_out_of_reach_names_the_bound_readably():
    # (The bound of a mean of 1e300 was printed with all its 302 digits.)
    for mean, p99, bound in ((1000, 500, "14968"), (1e300, 3000, "1.5e+301")):
        with pytest.raises(ValidationError) as caught:
            LognormalLength(dist="lognormal", mean=mean, p99=p99)
        assert f"be at most {bound} for a lognormal" in str(caught.value)


def test_lognormal_p99_is_reproduced():
    values = draw({"dist": "lognormal", "mean": 338, "p99": 2000, "max": 100_000})
    assert np.percentile(values, 99) == pytest.approx(2000, rel=0.05)
    spec = LognormalLength(dist="lognormal", mean=338, p99=2000)
    assert spec.log_sigma == pytest.approx(1.2, abs=0.3)


def test_clipping_and_zipf():
    values = draw({"dist": "lognormal", "mean": 300, "sigma": 1.5, "min": 50, "max": 400})
    assert values.min() == 50 and values.max() == 400
    zipf = draw({"dist": "zipf", "a": 2.0, "scale": 10})
    assert (zipf % 10 == 0).all() and np.mean(zipf == 10) == pytest.approx(0.608, abs=0.01)


def test_arrival_processes():
    rng = np.random.default_rng(1)
    gaps = np.diff(PoissonArrivals(process="poisson", rate=5).sample(rng, N))
    assert gaps.mean() == pytest.approx(0.2, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.02)
    for cv in (0.5, 2.0, 4.0):
        gaps = np.diff(GammaArrivals(process="gamma", rate=5, cv=cv).sample(rng, N))
        assert gaps.mean() == pytest.approx(0.2, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.07)


def synthetic(**extra) -> dict:
    return {"arrival": {"process": "poisson", "rate": 10},
            "prompt_len": {"dist": "lognormal", "mean": 200, "sigma": 1.0},
            "output_len": {"dist": "lognormal", "mean": 150, "sigma": 1.0}, **extra}


def test_generation_is_deterministic_and_fits_the_context():
    spec = WORKLOAD.validate_python(synthetic(prefix_groups={"groups": 3, "length": 100}))
    a = build_trace(spec, seed=7, max_model_len=2048, num_requests=5000)
    b = build_trace(spec, seed=7, max_model_len=2048, num_requests=5000)
    c = build_trace(spec, seed=8, max_model_len=2048, num_requests=5000)
    assert a.to_frame().equals(b.to_frame())
    assert not a.to_frame().equals(c.to_frame())
    assert (a.prompt_len + a.output_len <= 2048).all()
    assert (a.prompt_len > 100).all()  # every request carries its 100-token system prompt


def test_prefix_groups_follow_zipf_popularity():
    spec = WORKLOAD.validate_python(
        synthetic(prefix_groups={"groups": 4, "length": 64, "fraction": 0.5, "zipf_s": 1.0}))
    trace = build_trace(spec, seed=0, max_model_len=4096, num_requests=20_000)
    first = np.array([trace.own_segments(i)[0][0] for i in range(len(trace))])
    shared = first < (1 << 52)
    assert shared.mean() == pytest.approx(0.5, abs=0.02)
    counts = np.bincount(first[shared] - first[shared].min())
    weights = 1 / np.arange(1, 5)
    assert counts / counts.sum() == pytest.approx(weights / weights.sum(), abs=0.02)


def test_sessions_grow_their_prefix():
    spec = WORKLOAD.validate_python(synthetic(
        sessions={"turns": {"dist": "constant", "value": 3}, "think_time_s": 2.0}))
    trace = build_trace(spec, seed=1, max_model_len=100_000, num_requests=300)
    second = int(np.flatnonzero(trace.turn == 1)[0])
    first = int(trace.after[second])
    assert trace.context_parent[second] == first
    assert trace.prompt_len[second] > trace.prompt_len[first] + trace.output_len[first]
    segments = trace.prompt_segments(second)
    assert segments[: len(trace.prompt_segments(first))] == trace.prompt_segments(first)
    assert (trace.think_s[trace.turn > 0] > 0).all()


def test_a_tail_past_any_context_is_clipped_not_wrapped():
    # Pareto with alpha 0.01 draws past 2^63; clipped before the integer cast, such draws
    # stay the longest length, never a negative one, and the context clips them again.
    values = draw({"dist": "pareto", "alpha": 0.01, "scale": 100})
    assert values.min() >= 100 and values.max() == 1 << 32
    spec = WORKLOAD.validate_python(synthetic(prompt_len={"dist": "pareto", "alpha": 0.01,
                                                          "scale": 100}))
    trace = build_trace(spec, seed=0, max_model_len=4096, num_requests=200)
    assert trace.prompt_len.min() >= 100 and trace.prompt_len.max() == 4095
    assert any(note.startswith("clipped") for note in trace.notes)


def test_conversations_longer_than_the_run_draw_only_what_it_takes():
    # A billion turns a conversation: the turns drawn stop at the context, not at the
    # billion (which would take terabytes).
    spec = WORKLOAD.validate_python(synthetic(
        sessions={"turns": {"dist": "constant", "value": 10**9}, "think_time_s": 1.0}))
    trace = build_trace(spec, seed=0, max_model_len=100_000, num_requests=300)
    assert len(trace) == 300 and trace.turn.max() > 0
    assert (trace.prompt_len + trace.output_len).max() <= 100_000


def test_empirical_lengths_and_few_shot_templates():
    values = draw({"dist": "empirical", "path": "builtin:azure_llm_2023_code.csv",
                   "column": "prompt_len"})
    assert values.mean() == pytest.approx(2047.85, rel=0.02)
    spec = WORKLOAD.validate_python(synthetic(
        few_shot={"templates": 3, "shots": 4, "shot_len": 50, "fraction": 1.0}))
    trace = build_trace(spec, seed=2, max_model_len=100_000, num_requests=300)
    heads = {tuple(trace.own_segments(i)[:4]) for i in range(len(trace))}
    assert len(heads) == 3  # three templates, each four 50-token shots
    assert all(len(h) == 4 and all(n == 50 for _, n in h) for h in heads)
    assert (trace.prompt_len > 200).all()


def test_empirical_lengths_read_any_column_of_a_generic_file(tmp_path):
    csv_path = write(tmp_path, "id,tokens_in\n1,7\n2,9\n3,7\n", "lengths.csv")
    jsonl_path = write(tmp_path, '{"n": 5, "x": 1}\n\n{"n": 6}\n', "lengths.jsonl")
    assert set(draw({"dist": "empirical", "path": str(csv_path),
                     "file_column": "tokens_in"}).tolist()) == {7, 9}
    assert set(draw({"dist": "empirical", "path": str(jsonl_path),
                     "file_column": "n"}).tolist()) == {5, 6}
    # A known format's column by its own name: the same values as by meaning.
    by_name = draw({"dist": "empirical", "path": "builtin:azure_llm_2023_code.csv",
                    "file_column": "GeneratedTokens"})
    by_meaning = draw({"dist": "empirical", "path": "builtin:azure_llm_2023_code.csv",
                       "column": "output_len"})
    assert (by_name == by_meaning).all()
    with pytest.raises(TraceImportError, match=r"lengths\.csv: format csv does not say which "
                       r"column holds prompt_len: give the empirical length a file_column.*"
                       r"first line: 'id,tokens_in'"):
        draw({"dist": "empirical", "path": str(csv_path), "column": "prompt_len"})
    with pytest.raises(TraceImportError, match=r"lengths\.csv: missing column 'tokens'; "
                       r"header has id, tokens_in"):
        draw({"dist": "empirical", "path": str(csv_path), "file_column": "tokens"})
    with pytest.raises(TraceImportError, match=r"lengths\.jsonl:3: missing column 'x'"):
        draw({"dist": "empirical", "path": str(jsonl_path), "file_column": "x"})
    empty = write(tmp_path, "", "empty.csv")
    with pytest.raises(TraceImportError, match=r"empty\.csv: empty file: expected a CSV file "
                       "whose first line names its columns"):
        draw({"dist": "empirical", "path": str(empty), "file_column": "n"})
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"n": 5}\n\xff\xfe\x00\n')
    with pytest.raises(TraceImportError, match=r"binary\.jsonl:2: not valid JSON"):
        draw({"dist": "empirical", "path": str(binary), "file_column": "n"})
    for both_or_neither in ({"column": "prompt_len", "file_column": "n"}, {}):
        with pytest.raises(ValidationError, match=r"give column .* or file_column"):
            draw({"dist": "empirical", "path": str(jsonl_path), **both_or_neither})


def test_empirical_bad_rows_stop_or_are_skipped_and_reported(tmp_path):
    path = write(tmp_path, "tokens_in\n7\n0\nmany\n9\n", "lengths.csv")
    spec = {"dist": "empirical", "path": str(path), "file_column": "tokens_in"}
    with pytest.raises(TraceImportError, match=r"lengths\.csv:3: column 'tokens_in': expected "
                       r"an integer from 1 to 2\^53, got '0' \(skip_invalid: true on the "
                       r"empirical length, skips such rows\)$"):
        draw(spec)
    workload = WORKLOAD.validate_python(synthetic(
        prompt_len={**spec, "skip_invalid": True}, output_len={**spec, "skip_invalid": True}))
    trace = build_trace(workload, seed=0, max_model_len=4096, num_requests=200)
    assert set(trace.prompt_len.tolist()) == set(trace.output_len.tolist()) == {7, 9}
    assert trace.notes == [f"empirical lengths from {path}: skipped 2 rows with bad "
                           "'tokens_in' (first at line 3: '0')"]  # once for both columns


def test_empirical_lengths_follow_a_rewritten_file(tmp_path):
    path = write(tmp_path, "n\n7\n", "lengths.csv")
    spec = {"dist": "empirical", "path": str(path), "file_column": "n"}
    assert set(draw(spec).tolist()) == {7}
    path.write_text("n\n1234\n")  # another size, so another file even at the same mtime
    assert set(draw(spec).tolist()) == {1234}


def test_beam_width_forks_and_onoff_bursts():
    spec = WORKLOAD.validate_python({**synthetic(sampling={"n": 2, "beam_width": 4}),
                                     "arrival": {"process": "onoff", "rate": 100,
                                                 "on_s": 1.0, "off_s": 9.0}})
    trace = build_trace(spec, seed=0, max_model_len=4096, num_requests=2000)
    assert (trace.n == 4).all()
    phase = np.mod(trace.arrival_s, 10.0)
    assert (phase < 1.0).all()  # nothing arrives in the 9-second silences
    assert trace.arrival_s[-1] == pytest.approx(200, rel=0.1)


def test_closed_loop_chains_requests_per_user():
    spec = WORKLOAD.validate_python({**synthetic(), "arrival": {
        "process": "closed_loop", "users": 4, "think_time_s": 1.0}})
    trace = build_trace(spec, seed=0, max_model_len=4096, num_requests=20)
    assert (trace.after[:4] == -1).all()
    assert (trace.after[4:] == np.arange(16)).all()


def test_more_users_than_requests_send_one_each():
    # Users past the requests never send; 2^63 of them are as many as the requests.
    for users in (20, 1 << 63):
        spec = WORKLOAD.validate_python({**synthetic(), "arrival": {
            "process": "closed_loop", "users": users, "think_time_s": 1.0}})
        trace = build_trace(spec, seed=0, max_model_len=4096, num_requests=20)
        assert (trace.after == -1).all() and (trace.session_id == np.arange(20)).all()


@pytest.mark.parametrize(("section", "field"), [
    ({"output_len": {"dist": "lognormal", "mean": 100, "sigma": 1e300}}, "sigma"),
    ({"arrival": {"process": "gamma", "rate": 10, "cv": 1e300}}, "cv"),
    ({"arrival": {"process": "gamma", "rate": 10, "cv": 1e-300}}, "cv"),
])
def test_a_shape_past_float_arithmetic_is_refused(section, field):
    # sigma²/2 and 1/cv² overflow or vanish there: refused, not an OverflowError mid-run.
    with pytest.raises(ValidationError, match=rf"{field}\n  Input should be (less|greater)"):
        WORKLOAD.validate_python({**synthetic(), **section})


def test_a_clock_past_31_years_is_refused():
    # Past about 1e15 s a float clock no longer adds a step's milliseconds; arrivals past
    # 1e9 s and waits longer than that are refused before they stop time.
    spec = WORKLOAD.validate_python({**synthetic(), "arrival": {"process": "poisson",
                                                                "rate": 1e-9}})
    with pytest.raises(WorkloadError, match=r"the last request arrives \S+ s in, past "
                       r"1,000,000,000 s \(31 years\)"):
        build_trace(spec, seed=0, max_model_len=4096, num_requests=20)
    for section in ({"sessions": {"turns": {"dist": "constant", "value": 2},
                                  "think_time_s": 1e16}},
                    {"arrival": {"process": "closed_loop", "users": 2, "think_time_s": 1e16}},
                    {"retry": {"backoff_s": 1e16}, "queue_timeout_s": 1.0}):
        with pytest.raises(ValidationError, match="less than or equal to 1000000000"):
            WORKLOAD.validate_python({**synthetic(), **section})


@pytest.mark.parametrize(("name", "rows"), PUBLIC_TRACE_ROWS.items())
def test_public_traces_import(name, rows):
    trace = build_trace(TraceWorkload(path=f"builtin:{name}"), seed=0,
                        max_model_len=1 << 20)
    assert len(trace) == rows
    assert trace.arrival_s[0] == 0 and (np.diff(trace.arrival_s) >= 0).all()
    assert not trace.notes


@pytest.mark.parametrize("block_size", [2**k for k in range(10)])  # every divisor of 512
def test_mooncake_shared_hash_ids_share_exactly_k_blocks(block_size):
    trace = build_trace(TraceWorkload(path="builtin:mooncake_fast25_conversation_trace.jsonl"),
                        seed=0, max_model_len=1 << 20).head(40)
    # Requests 0 and 1 share their first hash id (0), then differ.
    for i, j, k in ((0, 1, 1), (0, 2, 1)):
        a = BlockHasher(trace.prompt_segments(i), block_size)
        b = BlockHasher(trace.prompt_segments(j), block_size)
        blocks = int(min(trace.prompt_len[i], trace.prompt_len[j])) // block_size
        ha, hb = a.hash_upto(blocks), b.hash_upto(blocks)
        common = next((n for n in range(blocks) if ha[n] != hb[n]), blocks)
        assert common * block_size == k * 512


def write(tmp_path: Path, text: str, name: str = "t.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "message"), [
    ("TIMESTAMP,ContextTokens\n2023-11-16 18:00:00,10\n", "missing column 'GeneratedTokens'"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,10,5\n"
     "2023-11-16 18:00:01,-4,5\n", ":3: column 'ContextTokens': expected an integer from 1 to "
     "2^53, got '-4'"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,99999999999999999999,5\n",
     ":2: column 'ContextTokens': expected an integer from 1 to 2^53, got "
     "'99999999999999999999'"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,ten,5\n",
     ":2: column 'ContextTokens': expected an integer from 1 to 2^53, got 'ten'"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:05,10,5\n"
     "2023-11-16 18:00:01,10,5\n", ":3: column 'TIMESTAMP': timestamps must not decrease"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n12.5,10,5\n",
     ":2: column 'TIMESTAMP': expected a date and time, got '12.5' (skip_invalid: true"),
    ("Timestamp,Model,Request tokens,Response tokens\n-3,GPT-4,10,5\n",
     ":2: column 'Timestamp': expected a time >= 0 (in s), got '-3'"),
    # Lines as the file counts them: past blank ones and a quoted line break.
    ("\nTIMESTAMP,ContextTokens,GeneratedTokens\n\n2023-11-16 18:00:00,10,5\n  \n"
     "2023-11-16 18:00:01,-4,5\n", ":6: column 'ContextTokens'"),
    ('Timestamp,Model,Request tokens,Response tokens\n1,"GPT\n4",10,5\n2,GPT-4,10,0\n',
     ":4: column 'Response tokens': expected an integer from 1 to 2^53, got '0'"),
])
def test_bad_rows_name_file_row_and_column(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(TraceImportError) as err:
        build_trace(TraceWorkload(path=str(path)), seed=0, max_model_len=4096)
    assert str(path) in str(err.value) and message in str(err.value)


def test_a_bad_json_number_is_quoted_as_the_file_writes_it(tmp_path):
    # JSON cells arrive as numpy numbers; the error quotes 0, not np.int64(0).
    path = write(tmp_path, '{"timestamp": 0, "input_length": 10, "output_length": 5, '
                 '"hash_ids": [0]}\n{"timestamp": 1, "input_length": 10, "output_length": 0, '
                 '"hash_ids": [0]}\n', "m.jsonl")
    with pytest.raises(TraceImportError) as err:
        build_trace(TraceWorkload(path=str(path)), seed=0, max_model_len=4096)
    assert str(err.value).startswith(f"{path}:2: column 'output_length': expected an integer "
                                     "from 1 to 2^53, got 0 (skip_invalid: true")
    trace = build_trace(TraceWorkload(path=str(path), skip_invalid=True), seed=0,
                        max_model_len=4096)
    assert "skipped 1 row with bad 'output_length' (first at line 2: 0)" in trace.notes


def test_skip_invalid_counts_and_reports(tmp_path):
    path = write(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:00:00,10,5\n2023-11-16 18:00:01,x,5\n"
                 "2023-11-16 18:00:02,10,0\n2023-11-16 18:00:03,12,3\n")
    trace = build_trace(TraceWorkload(path=str(path), skip_invalid=True), seed=0,
                        max_model_len=4096)
    assert len(trace) == 2
    assert any("skipped 1 row with bad 'ContextTokens'" in n for n in trace.notes)
    assert any("skipped 1 row with bad 'GeneratedTokens'" in n for n in trace.notes)


def test_generic_jsonl_and_burstgpt(tmp_path):
    path = write(tmp_path, '{"t": 0, "in": 5, "out": 7}\n{"t": 1500, "in": 9, "out": 2}\n',
                 "g.jsonl")
    trace = build_trace(TraceWorkload(path=str(path), format="jsonl", time_unit="ms",
                                      columns={"arrival": "t", "prompt_len": "in",
                                               "output_len": "out"}),
                        seed=0, max_model_len=4096)
    assert trace.arrival_s.tolist() == [0.0, 1.5] and trace.prompt_len.tolist() == [5, 9]
    path = write(tmp_path, "Timestamp,Model,Request tokens,Response tokens,Total tokens,"
                 "Log Type\n5,ChatGPT,100,20,120,Conversation log\n"
                 "7,GPT-4,50,0,50,Conversation log\n", "burst.csv")
    trace = build_trace(TraceWorkload(path=str(path), skip_invalid=True), seed=0,
                        max_model_len=4096)
    assert len(trace) == 1 and trace.notes
    bad = write(tmp_path, '{"t": 0, "in": 5}\n', "bad.jsonl")
    with pytest.raises(TraceImportError, match=r"bad.jsonl:1: missing column 'out'"):
        build_trace(TraceWorkload(path=str(bad), format="jsonl", columns={
            "arrival": "t", "prompt_len": "in", "output_len": "out"}), seed=0,
            max_model_len=4096)


def test_hash_ids_of_a_generic_file_are_checked_row_by_row(tmp_path):
    columns = {"arrival": "t", "prompt_len": "in", "output_len": "out", "hash_ids": "h"}
    jsonl = write(tmp_path, '{"t": 0, "in": 40, "out": 5, "h": [1, 2]}\n'
                  '{"t": 1, "in": 40, "out": 5, "h": [1, 3]}\n', "g.jsonl")
    csv = write(tmp_path, 't,in,out,h\n0,40,5,"[1, 2]"\n1,40,5,"[1,3]"\n', "g.csv")
    traces = [build_trace(TraceWorkload(path=str(path), columns=columns), seed=0,
                          max_model_len=4096) for path in (jsonl, csv)]
    assert traces[0].prompt_segments(1) == traces[1].prompt_segments(1)
    assert traces[1].prompt_segments(0)[0] == traces[1].prompt_segments(1)[0]  # hash id 1
    for name, text, shown in [
        ("words.csv", 't,in,out,h\n0,40,5,"[1]"\n1,40,5,1 3\n', "'1 3'"),
        ("float.jsonl", '{"t": 0, "in": 40, "out": 5, "h": [1.5]}\n', "[1.5]"),
        ("null.jsonl", '{"t": 0, "in": 40, "out": 5, "h": null}\n', "None"),
        ("negative.csv", 't,in,out,h\n0,40,5,[-1]\n', "'[-1]'"),
    ]:
        path = write(tmp_path, text, name)
        with pytest.raises(TraceImportError) as err:
            build_trace(TraceWorkload(path=str(path), columns=columns), seed=0,
                        max_model_len=4096)
        line = 3 if name == "words.csv" else (2 if name.endswith(".csv") else 1)
        assert str(err.value).startswith(
            f"{path}:{line}: column 'h': expected a list of integers 0 <= id < 2^50 (in a CSV "
            f'cell, as JSON: "[1, 2, 3]"), got {shown}')
    kept = build_trace(TraceWorkload(path=str(tmp_path / "words.csv"), columns=columns,
                                     skip_invalid=True), seed=0, max_model_len=4096)
    assert len(kept) == 1 and "skipped 1 row with bad 'h'" in kept.notes[0]


def test_each_clients_max_tokens_from_a_generic_file(tmp_path):
    columns = {"arrival": "t", "prompt_len": "in", "output_len": "out", "max_tokens": "m"}
    path = write(tmp_path, "t,in,out,m\n0,100,10,50\n1,200,20,4000\n2,50,5,5\n", "m.csv")
    trace = build_trace(TraceWorkload(path=str(path), columns=columns), seed=0,
                        max_model_len=4096)
    # Each row's own, within the context limit (4,096 − 200 left for the second).
    assert trace.max_tokens.tolist() == [50, 3896, 5]
    assert trace.output_len.tolist() == [10, 20, 5]
    # Within the workload's cap too; without the column, the cap alone.
    capped = build_trace(TraceWorkload(path=str(path), columns=columns, max_tokens=30),
                         seed=0, max_model_len=4096)
    assert capped.max_tokens.tolist() == [30, 30, 5]
    del columns["max_tokens"]
    plain = build_trace(TraceWorkload(path=str(path), columns=columns, max_tokens=30),
                        seed=0, max_model_len=4096)
    assert plain.max_tokens.tolist() == [30, 30, 30]
    # What a request_max reservation of them holds for tokens never generated.
    stats = trace_stats(trace, context_limit=4096)
    assert (stats["max_tokens_p50"], stats["max_tokens_max"]) == (50, 3896)
    assert stats["max_tokens_unused_share"] == pytest.approx(1 - 35 / (50 + 3896 + 5))
    assert trace_stats(plain, context_limit=4096)["max_tokens_max"] == 30
    # A file that sets no limit: every request may fill the context; nothing to say.
    unlimited = build_trace(TraceWorkload(path=str(path), columns=columns), seed=0,
                            max_model_len=4096)
    assert "max_tokens_max" not in trace_stats(unlimited, context_limit=4096)
    assert "max_tokens_max" in trace_stats(unlimited)  # (a scenario's: its own limit)
    # A request_max reservation holds each one's prompt and max_tokens.
    data = {"name": "m", "model": "llama-2-7b", "memory": {"kv_memory_gib": 4},
            "workload": {"kind": "trace", "path": str(path),
                         "columns": {**columns, "max_tokens": "m"}},
            "systems": [{"name": "c", "allocator": {"kind": "contiguous",
                                                     "reserve_policy": "request_max"}}],
            "stop": {"num_requests": 3}}
    requests = run_scenario(scenario_from_dict(data)).systems["c"].requests
    assert requests["allocated_at_finish"].tolist() == [150, 4096, 55]
    # A client never gets more than it asked for: a smaller max_tokens is a bad row.
    columns["max_tokens"] = "m"
    bad = write(tmp_path, "t,in,out,m\n0,100,10,50\n1,200,20,19\n2,50,5,x\n", "bad.csv")
    with pytest.raises(TraceImportError) as err:
        build_trace(TraceWorkload(path=str(bad), columns=columns), seed=0, max_model_len=4096)
    assert str(err.value).startswith(f"{bad}:3: column 'm': expected an integer from the "
                                     "row's 'out' to 2^53, or none (empty), got '19'")
    kept = build_trace(TraceWorkload(path=str(bad), columns=columns, skip_invalid=True),
                       seed=0, max_model_len=4096)
    assert len(kept) == 1 and "skipped 2 rows with bad 'm'" in kept.notes[0]
    # A client that sent none (an empty cell, a JSON null) has the limits' cap.
    some = write(tmp_path, "t,in,out,m\n0,100,10,50\n1,200,20,\n", "some.csv")
    asked = build_trace(TraceWorkload(path=str(some), columns=columns, max_tokens=1000),
                        seed=0, max_model_len=4096)
    assert asked.max_tokens.tolist() == [50, 1000]
    some = write(tmp_path, '{"t": 0, "in": 100, "out": 10, "m": 50}\n'
                           '{"t": 1, "in": 4090, "out": 20, "m": null}\n', "some.jsonl")
    asked = build_trace(TraceWorkload(path=str(some), columns=columns), seed=0,
                        max_model_len=4096)
    assert asked.max_tokens.tolist() == [50, 6] and asked.output_len.tolist() == [10, 6]


def test_trace_speed_and_frame_round_trip():
    base = build_trace(TraceWorkload(path="builtin:azure_llm_2023_code.csv"), seed=0,
                       max_model_len=8192)
    fast = build_trace(TraceWorkload(path="builtin:azure_llm_2023_code.csv",
                                     arrival={"process": "trace", "speed": 2}), seed=0,
                       max_model_len=8192)
    assert fast.arrival_s[-1] == pytest.approx(base.arrival_s[-1] / 2)
    again = Trace.from_frame(base.head(100).to_frame())
    assert again.to_frame().equals(base.head(100).to_frame())


def test_trace_stats_figures():
    spec = WORKLOAD.validate_python(synthetic(prefix_groups={"groups": 1, "length": 320}))
    trace = build_trace(spec, seed=0, max_model_len=100_000, num_requests=200)
    stats = trace_stats(trace, 16)
    assert stats["requests"] == 200
    assert stats["rate_req_s"] == pytest.approx(10, rel=0.25)
    shared = 320 * 200 / trace.prompt_len.sum()
    assert stats["sharing_potential_bs16"] == pytest.approx(shared, rel=1e-9)
    unique = build_trace(WORKLOAD.validate_python(synthetic()), seed=0, max_model_len=100_000,
                         num_requests=50)
    assert sharing_potential(unique, 16) == 0.0


# Prompts as segments from a small alphabet, so that ids repeat, lengths differ for the same
# id, segments are empty and whole prompts coincide.
_PROMPTS = st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), min_size=1,
                             max_size=5).filter(lambda segs: sum(n for _, n in segs) > 0),
                    min_size=1, max_size=12)


@given(prompts=_PROMPTS, block_size=st.sampled_from([1, 4, 16, 48]))
@settings(max_examples=300, deadline=None)
def test_sharing_potential_counts_what_chained_block_hashes_share(prompts, block_size):
    """The figure equals the share of prompt tokens in full blocks whose chained hash, as the
    pool computes it, more than one prompt holds."""
    lens = [sum(n for _, n in segs) for segs in prompts]
    trace = Trace.from_columns(
        arrival_s=np.arange(len(prompts), dtype=float), prompt_len=np.array(lens),
        output_len=np.ones(len(prompts), dtype=np.int64),
        seg_offsets=np.cumsum([0] + [len(segs) for segs in prompts]),
        seg_ids=np.array([i for segs in prompts for i, _ in segs]),
        seg_lens=np.array([n for segs in prompts for _, n in segs]))
    holders: dict[int, int] = {}
    for segs, length in zip(prompts, lens, strict=True):
        for block_hash in BlockHasher(segs, block_size).hash_upto(length // block_size):
            holders[block_hash] = holders.get(block_hash, 0) + 1
    shared_blocks = sum(count for count in holders.values() if count > 1)
    assert sharing_potential(trace, block_size) == shared_blocks * block_size / sum(lens)


def test_million_requests_vectorised():
    spec = WORKLOAD.validate_python(synthetic(prefix_groups={"groups": 8, "length": 128,
                                                             "fraction": 0.3}))
    trace = build_trace(spec, seed=0, max_model_len=4096, num_requests=1_000_000)
    assert len(trace) == 1_000_000
    assert trace.seg_ids.nbytes < 32 * 1024 * 1024


@pytest.mark.parametrize("name", ["azure_code", "azure_conv", "mooncake_conversation",
                                  "mooncake_synthetic"])
def test_shipped_trace_scenarios_run(name):
    import yaml

    import sim

    root = Path(__file__).resolve().parents[1]
    data = yaml.safe_load((root / "scenarios" / "traces" / f"{name}.yaml").read_text())
    data["stop"] = {"num_requests": 150}  # the full traces run in minutes: see -m slow
    result = sim.run(data)
    for system in ("contiguous-req", "paged-16"):
        summary = result.systems[system].summary
        assert summary["completed"] + summary["rejected"] == 150
        assert summary["completed"] > 0
    paged = result.systems["paged-16"].summary
    contiguous = result.systems["contiguous-req"].summary
    assert paged["waste_frac"] < contiguous["waste_frac"]
    if name.startswith("mooncake"):
        assert paged["prefix_hit_rate"] > 0  # shared hash_ids become cache hits


@pytest.mark.slow
@pytest.mark.parametrize("name", ["azure_code", "azure_conv", "mooncake_conversation",
                                  "mooncake_synthetic"])
def test_shipped_trace_scenarios_run_in_full(name):
    import sim

    root = Path(__file__).resolve().parents[1]
    result = sim.run(root / "scenarios" / "traces" / f"{name}.yaml")
    assert all(r.summary["completed"] + r.summary["rejected"] == ROWS_BY_SCENARIO[name]
               for r in result.systems.values())


ROWS_BY_SCENARIO = {
    "azure_code": PUBLIC_TRACE_ROWS["azure_llm_2023_code.csv"],
    "azure_conv": PUBLIC_TRACE_ROWS["azure_llm_2023_conv.csv"],
    "mooncake_conversation": PUBLIC_TRACE_ROWS["mooncake_fast25_conversation_trace.jsonl"],
    "mooncake_synthetic": PUBLIC_TRACE_ROWS["mooncake_fast25_synthetic_trace.jsonl"],
}


def test_a_generic_file_past_the_context_limit_is_clipped_and_says_how_much(tmp_path):
    columns = {"arrival": "t", "prompt_len": "in", "output_len": "out"}
    path = write(tmp_path, "t,in,out\n0,100,10\n1,5000,20\n2,4000,200\n3,3000,50\n",
                 "long.csv")
    trace = build_trace(TraceWorkload(path=str(path), columns=columns), seed=0,
                        max_model_len=4096)
    assert trace.prompt_len.tolist() == [100, 4095, 4000, 3000]
    assert trace.output_len.tolist() == [10, 1, 96, 50]
    assert trace.notes == [
        "clipped 1 of 4 prompts to the context limit 4,095",
        "clipped 2 of 4 outputs to the room the context limit (4,096 tokens) leaves after "
        "their prompts"]
    within = build_trace(TraceWorkload(path=str(path), columns=columns), seed=0,
                         max_model_len=8192)
    assert within.notes == [] and within.output_len.tolist() == [10, 20, 200, 50]
