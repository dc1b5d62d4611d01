"""Where a result came from: the kvsim build each run folder records, how a resumed sweep
treats the runs of another build, and an edited input file making a new sweep point."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import yaml
from conftest import kvsim_in_process
from test_sweep import BASE

from sim.provenance import build_id, input_digests, input_files, made_by
from sim.sweep import expand, run_sweep

ROOT = Path(__file__).resolve().parents[1]
# test_sweep's mini sweep, with one system and the rate swept alone.
SWEEP = {**BASE, "systems": [{"name": "paged", "allocator": {"kind": "paged"}}],
         "stop": {"num_requests": 30},
         "sweep": {"grid": {"workload.arrival.rate": [5, 10, 20]}}}


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def set_build(summary: Path, build: str | None) -> None:
    """Make a run folder say another kvsim made it (None: one from before builds were kept)."""
    data = json.loads(summary.read_text())
    if build is None:
        del data["made_by"]
    else:
        data["made_by"]["build"] = build
    summary.write_text(json.dumps(data))


def metadata_version() -> str:
    from importlib import metadata

    return metadata.version("kvsim")


def test_the_build_is_the_sources_hash_and_any_edit_changes_it(tmp_path):
    assert re.fullmatch(r"[0-9a-f]{12}", build_id())
    assert made_by() == {"kvsim": metadata_version(), "build": build_id()}
    # The same sources copied elsewhere: the same build; one source edited: another.
    for package in ("sim", "workloads"):
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "KVSIM_PURE_PYTHON": "1"}

    def build_of_copy() -> str:
        proc = subprocess.run([sys.executable, "-c", "import sim.provenance as p; "
                               "print(p.__file__, p.build_id())"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, check=True)
        where, build = proc.stdout.split()
        assert Path(where).is_relative_to(tmp_path)  # the copy ran, not the installed one
        return build

    assert build_of_copy() == build_id()
    edited = tmp_path / "sim" / "memory" / "paged.py"
    edited.write_text(edited.read_text() + "# an edit\n")
    assert build_of_copy() != build_id()


def test_a_run_folder_names_its_build_and_a_bad_one_is_refused(tmp_path):
    path = write_yaml(tmp_path / "run.yaml", {k: v for k, v in SWEEP.items() if k != "sweep"})
    out = tmp_path / "out"
    proc = kvsim_in_process("run", str(path), "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["made_by"] == made_by()
    page = (out / "report.html").read_text()
    assert f"<td>results made by</td><td>kvsim {metadata_version()} (build {build_id()})" in page
    # A folder of a kvsim from before it was kept still reads back, and says so.
    set_build(out / "summary.json", None)
    assert kvsim_in_process("report", str(out)).returncode == 0
    assert "a kvsim from before run folders named their build" in (out / "report.html").read_text()
    # An edited made_by is refused in one line, naming the file and the field.
    data = json.loads((out / "summary.json").read_text())
    data["made_by"] = {"kvsim": 1}
    (out / "summary.json").write_text(json.dumps(data))
    proc = kvsim_in_process("report", str(out))
    assert proc.returncode == 2
    assert proc.stderr == (f"kvsim: error: {out / 'summary.json'}: cannot be read back (made_by: "
                           "expected {\"kvsim\": version, \"build\": id}, got {'kvsim': 1})\n")


def test_compare_says_when_the_runs_come_from_different_builds(tmp_path):
    path = write_yaml(tmp_path / "run.yaml", {k: v for k, v in SWEEP.items() if k != "sweep"})
    for name in ("a", "b"):
        proc = kvsim_in_process("run", str(path), "--out", str(tmp_path / name), "--quiet",
                                "--no-report")
        assert proc.returncode == 0, proc.stderr
    same = kvsim_in_process("compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert same.returncode == 0 and "kvsim builds" not in same.stdout
    set_build(tmp_path / "b" / "summary.json", "0123456789ab")
    other = kvsim_in_process("compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert other.returncode == 0, other.stderr
    assert (f"note: these runs were made by different kvsim builds (a: {build_id()}, "
            "b: 0123456789ab)") in other.stdout


def test_a_resumed_sweep_keeps_another_builds_runs_says_so_and_reruns_them_if_asked(tmp_path):
    path = write_yaml(tmp_path / "sweep.yaml", SWEEP)
    out = tmp_path / "out"
    first = run_sweep(path, out_dir=out, jobs=1)
    assert (first.ran, first.older) == (3, 0)
    assert (first.table["build"] == build_id()).all()
    summaries = sorted((out / "runs").glob("*/summary.json"))
    set_build(summaries[0], "0123456789ab")
    set_build(summaries[1], None)
    kept = {p: p.stat().st_mtime_ns for p in summaries}
    args = ("sweep", str(path), "--out", str(out), "--quiet", "--jobs", "1")
    proc = kvsim_in_process(*args)
    assert proc.returncode == 0, proc.stderr
    assert "sweep: 0 points ran, 3 already done" in proc.stdout
    assert ("note: 2 of the points done before were done by another kvsim build than this "
            f"one ({build_id()}), and are kept (results.parquet's build column names each "
            "one's): --rerun-older runs them again") in proc.stdout
    assert all(p.stat().st_mtime_ns == kept[p] for p in summaries)  # nothing ran again
    table = pd.read_parquet(out / "results.parquet")
    builds = dict(zip(table["key"], table["build"], strict=True))
    assert builds[summaries[0].parent.name] == "0123456789ab"
    assert pd.isna(builds[summaries[1].parent.name])
    assert builds[summaries[2].parent.name] == build_id()
    page = (out / "report.html").read_text()
    assert "these runs were made by 3 kvsim builds" in page
    # Asked to, it runs those two again, and the table is that of a sweep run from scratch.
    proc = kvsim_in_process(*args, "--rerun-older", "--no-report")
    assert proc.returncode == 0, proc.stderr
    assert "sweep: 2 points ran, 1 already done" in proc.stdout
    assert "note: 2 points done by another kvsim build were done again" in proc.stdout
    assert summaries[2].stat().st_mtime_ns == kept[summaries[2]]
    pd.testing.assert_frame_equal(pd.read_parquet(out / "results.parquet"), first.table)
    proc = kvsim_in_process(*args, "--no-report")
    assert "sweep: 0 points ran, 3 already done" in proc.stdout and "note:" not in proc.stdout


def test_an_edited_input_file_is_another_sweep_point(tmp_path):
    trace = tmp_path / "t.csv"
    pd.DataFrame({"t": [0.0, 0.5, 1.0], "prompt": [100, 200, 300],
                  "output": [10, 20, 30]}).to_csv(trace, index=False)
    data = {**SWEEP, "stop": {}, "sweep": {"grid": {"memory.kv_memory_gib": [1, 2]}},
            "workload": {"kind": "trace", "format": "csv", "path": "t.csv",
                         "columns": {"arrival": "t", "prompt_len": "prompt",
                                     "output_len": "output"}}}
    path = write_yaml(tmp_path / "sweep.yaml", data)
    points = expand(data, str(path), base_dir=tmp_path)
    assert input_files(points[0].scenario) == {"workload.path": "t.csv"}
    assert set(input_digests(points[0].scenario, tmp_path)) == {"workload.path"}
    first = run_sweep(path, out_dir=tmp_path / "out", jobs=1)
    assert first.ran == 2
    assert run_sweep(path, out_dir=tmp_path / "out", jobs=1).skipped == 2
    # The same path, other rows: new points, run; the first file's runs stay as they were.
    trace.write_text(trace.read_text().replace("300,30", "900,90"))
    again = run_sweep(path, out_dir=tmp_path / "out", jobs=1)
    assert (again.ran, again.skipped) == (2, 0)
    assert set(again.table["key"]).isdisjoint(first.table["key"])
    assert len(list((tmp_path / "out" / "runs").glob("*/summary.json"))) == 4
    # (the run read the edited file: its last request's longer answer is served)
    assert (again.table["throughput_tok_s"].to_numpy()
            != first.table["throughput_tok_s"].to_numpy()).all()


def test_input_files_are_found_wherever_the_scenario_names_them():
    resolved = {"workload": {"kind": "synthetic",
                             "prompt_len": {"dist": "empirical", "path": "lengths.csv"},
                             "output_len": {"dist": "uniform", "low": 1, "high": 2}},
                "timing": {"calibration": "h200.yaml"},
                "systems": [{"name": "a", "speculative": {"draft_calibration": "draft.yaml"}},
                            {"name": "b", "speculative": {"draft_calibration": None}}]}
    assert input_files(resolved) == {"workload.prompt_len.path": "lengths.csv",
                                     "timing.calibration": "h200.yaml",
                                     "systems[0].speculative.draft_calibration": "draft.yaml"}
