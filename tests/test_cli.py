"""The kvsim command line: the main job, determinism, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import pandas as pd
import pytest
from conftest import PUBLIC_TRACE_ROWS, kvsim_in_process

from sim import CORE
from sim.provenance import build_id

ROOT = Path(__file__).resolve().parents[1]
GOOD = """
name: tiny
memory: {kv_memory_gib: 2}
workload:
  arrival: {process: poisson, rate: 50}
  prompt_len: {dist: uniform, low: 10, high: 200}
  output_len: {dist: uniform, low: 5, high: 100}
  prefix_groups: {groups: 2, length: 64, fraction: 0.5}
systems:
  - name: contiguous
    allocator: {kind: contiguous}
  - name: paged
    allocator: {kind: paged, block_size: 16}
stop: {num_requests: 60}
"""


def kvsim_process(*args: str, cwd: Path = ROOT, python_flags: tuple[str, ...] = ()
                  ) -> subprocess.CompletedProcess:
    """``kvsim ARGS`` in a Python process of its own (``python_flags`` for it)."""
    return subprocess.run([sys.executable, *python_flags, "-m", "sim.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, check=False)


kvsim = kvsim_in_process  # the same code, without a process's start-up per call


def test_seed_scenario_prints_63_4_percent(tmp_path):
    proc = kvsim_process("run", "scenarios/seed_63_percent.yaml", "--out", str(tmp_path), "--quiet",
                 "--no-report")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("internal frag. at"))
    assert line.split()[-2:] == ["63.38%", "0.27%"]
    assert (tmp_path / "summary.json").is_file() and (tmp_path / "scenario.yaml").is_file()
    for system in ("contiguous-4096", "paged-16"):
        for table in ("requests", "memory", "steps"):
            assert (tmp_path / system / f"{table}.parquet").is_file()
    proc = kvsim("report", str(tmp_path), "--x", "workload.arrival.rate")
    assert proc.returncode == 2  # a sweep option on a run folder is refused, not ignored
    assert proc.stderr.strip() == (f"kvsim: error: {tmp_path}: --x and --y choose a sweep "
                                   "figure, and this is a run folder (a sweep folder holds "
                                   "sweep.json)")


def test_same_seed_gives_identical_files(tmp_path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(GOOD)
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        # A process each: string hashing differs between them, as between users' runs.
        proc = kvsim_process("run", str(scenario), "--out", str(out), "--quiet", "--seed", "3")
        assert proc.returncode == 0, proc.stderr
        outs.append(out)
    files = sorted(p.relative_to(outs[0]) for p in outs[0].rglob("*") if p.is_file())
    # The tables, summary and scenario; and the report with every figure, SVG ids included.
    assert len([f for f in files if f.parts[0] != "figures"]) == 9
    assert len([f for f in files if f.suffix == ".svg"]) >= 5
    for rel in files:
        assert (outs[0] / rel).read_bytes() == (outs[1] / rel).read_bytes(), rel
    other = tmp_path / "c"
    kvsim("run", str(scenario), "--out", str(other), "--quiet", "--no-report", "--seed", "4")
    assert (other / "summary.json").read_bytes() != (outs[0] / "summary.json").read_bytes()


BAD = [
    ("unknown key", GOOD.replace("stop:", "stpo:"),
     "stpo: unknown key; did you mean 'stop'?"),
    ("a preset misspelt", GOOD.replace("name: tiny", "name: tiny\nmodel: llama3.1-8b"),
     "model: unknown preset 'llama3.1-8b'; did you mean 'llama-3.1-8b'? (known: llama-2-7b"),
    ("a preset not named", GOOD.replace("name: tiny", "name: tiny\ngpu:"),
     "gpu: expected a preset's name or a mapping of fields (got None)"),
    ("wrong type", GOOD.replace("rate: 50", "rate: fast"),
     "workload.arrival.rate: Input should be a valid number"),
    ("negative size", GOOD.replace("kv_memory_gib: 2", "kv_memory_gib: -2"),
     "memory.kv_memory_gib: Input should be greater than 0"),
    ("block size 0", GOOD.replace("block_size: 16", "block_size: 0"),
     "systems[1].allocator.block_size: Input should be greater than or equal to 1"),
    ("pool below one block", GOOD.replace("kv_memory_gib: 2", "kv_memory_gib: 0.004")
     .replace("- name: contiguous\n    allocator: {kind: contiguous}\n  ", ""),
     "the KV pool (8 slots) is smaller than one block (16 slots) of system 'paged'"),
    ("pool of no token", GOOD.replace("kv_memory_gib: 2", "kv_memory_gib: 0.000001"),
     "memory: the KV pool holds not one token (llama-2-7b takes 524,288 bytes a token)"),
    ("bad yaml", GOOD.replace("stop: {num_requests: 60}", "stop: {num_requests: 60"),
     "not valid YAML"),
    ("duplicate systems", GOOD.replace("name: paged", "name: contiguous"),
     "systems: system names must be unique"),
    # A check across sections names its fields itself (no "(top level)" before it).
    ("across sections", GOOD.replace("name: tiny", "name: tiny\nmodel: gemma-3-27b\n"
                                     "gpu: h100-80g").replace("block_size: 16",
                                                              "block_size: 16, host_cache_gib: 1"),
     "bad.yaml: system 'paged': a host tier (allocator.host_cache_gib) is not modelled"),
    ("acceptance past the drafts", GOOD.replace(
        "block_size: 16}", "block_size: 16}\n    speculative: {method: eagle, "
        "num_speculative_tokens: 2, mean_acceptance_length: 3.5}"),
     "systems[1].speculative: mean_acceptance_length 3.5: a step keeps at most "
     "num_speculative_tokens + 1 = 3 tokens; expected 1 to 3"),
    ("two acceptances", GOOD.replace(
        "block_size: 16}", "block_size: 16}\n    speculative: {method: ngram, "
        "num_speculative_tokens: 2, mean_acceptance_length: 2, acceptance_rate: 0.5}"),
     "systems[1].speculative: give exactly one of mean_acceptance_length"),
    ("a batch-size schedule entry short of K", GOOD.replace(
        "block_size: 16}", "block_size: 16}\n    speculative: {method: ngram, "
        "num_speculative_tokens: 2, acceptance_rate: 0.5, "
        "num_speculative_tokens_per_batch_size: [[1, 8, 2], [9, 16]]}"),
     "systems[1].speculative.num_speculative_tokens_per_batch_size: entry [9, 16]: expected "
     "[bs_lo, bs_hi, K]"),
    ("prefix past the context", GOOD.replace("length: 64", "length: 4095"),
     "bad.yaml: workload.prefix_groups.length 4095: shared prefixes of 4095 tokens leave no "
     "room in the model's context of 4096; expected fewer than 4095"),
    # A kind misspelt or left out, or a section given as something else, is told in the
    # file's words: the field, the kinds it takes, what was there.
    ("a kind misspelt", GOOD.replace("{kind: paged,", "{kind: page,"),
     "systems[1].allocator.kind: expected one of 'contiguous', 'paged' or 'virtual' (got "
     "'page')"),
    ("no kind", GOOD.replace("{kind: paged,", "{"),
     "systems[1].allocator.kind: required field is missing (one of 'contiguous', 'paged' or "
     "'virtual')"),
    ("a section as a number", GOOD.replace("allocator: {kind: paged, block_size: 16}",
                                           "allocator: 16"),
     "systems[1].allocator: expected a mapping of fields (got 16)"),
    ("no systems", GOOD.split("systems:")[0] + "systems: []\nstop: {num_requests: 60}\n",
     "systems: expected at least 1 item (got 0)"),
    # YAML reads 1e5 as text: an integer field says what to write instead.
    ("e-notation for a whole number", GOOD.replace("num_requests: 60", "num_requests: 6e1"),
     "stop.num_requests: expected a whole number, got the text '6e1' (YAML takes e-notation "
     "for a number only as 1.0e+5): write 60"),
    # pydantic calls a float past int64 an "input string"; the field says what it got.
    ("a float too large for a whole number", GOOD.replace("block_size: 16",
                                                         "block_size: 1.0e+300"),
     "systems[1].allocator.block_size: expected a whole number, got 1e+300, far too large"),
    # YAML's flags are no numbers (pydantic would read true as 1: a one-token block).
    ("a flag for a number", GOOD.replace("block_size: 16", "block_size: yes"),
     "systems[1].allocator.block_size: expected a number, got a yes/no flag (true: YAML "
     "reads yes, no, on, off, true and false so)"),
    ("a flag for an optional number", GOOD.replace("num_requests: 60", "num_requests: off"),
     "stop.num_requests: expected a number, got a yes/no flag (false: YAML reads yes, no, "
     "on, off, true and false so)"),
    # Sizes past any machine are refused, not run out of memory on.
    ("requests past any machine", GOOD.replace("num_requests: 60", "num_requests: 1000000000000"),
     "stop.num_requests: Input should be less than or equal to 50000000"),
    ("a context past any model", GOOD.replace("name: tiny\n", "name: tiny\nmodel: {name: m, "
                                               "num_layers: 2, num_heads: 4, head_dim: 64, "
                                               "num_params: 1e8, "
                                               "max_model_len: 100000000000000000000}\n"),
     "model.max_model_len: Input should be less than or equal to 4294967296"),
    ("prompts past any machine", GOOD.replace("groups: 2", "groups: 1099511627776"),
     "workload.prefix_groups.groups: Input should be less than or equal to 1000000"),
    ("pool past any machine", GOOD.replace("kv_memory_gib: 2", "kv_memory_gib: 10000000")
     .replace("- name: contiguous\n    allocator: {kind: contiguous}\n  ", ""),
     "bad.yaml: memory.kv_memory_gib: the KV pool of system 'paged' would hold 1,280,000,000 "
     "blocks of 16 tokens; at most 33,554,432 are simulated: give a smaller pool or a larger "
     "block size"),
    # 2^32 engines, each simulated, would take the machine's memory before a cap refuses.
    ("engines past any deployment", GOOD + "engine: {replicas: 4294967296}\n",
     "engine.replicas: Input should be less than or equal to 1048576"),
    # Past 2^40 GiB a pool's slots would leave a float (NaN) before its cap could say so.
    ("pool past any float", GOOD.replace("kv_memory_gib: 2", "kv_memory_gib: 1.0e+300"),
     "memory.kv_memory_gib: Input should be less than or equal to 1099511627776"),
    # Contiguous memory has no blocks, but its slots are counted in int64 columns.
    ("contiguous pool past any machine", GOOD.replace("kv_memory_gib: 2", "kv_memory_gib: 1e10"),
     "bad.yaml: memory.kv_memory_gib: the KV pool of system 'contiguous' would hold "
     "20,480,000,000,000 token slots; at most 8,589,934,592 are simulated: give a smaller pool"),
    # Every replica holds a pool of its own: 256 blocks each, 131,072 of them is the cap.
    ("replicas past any machine", GOOD + "engine: {replicas: 131073}\n",
     "bad.yaml: engine.replicas: system 'paged' would hold 33,554,688 blocks over its 131,073 "
     "replicas, 256 each; at most 33,554,432 are simulated in all: give fewer replicas, a "
     "smaller pool or a larger block size"),
]


@pytest.mark.parametrize(("label", "text", "expected"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_exit_2(tmp_path, label, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    proc = kvsim("run", str(path), "--quiet", "--no-report", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2, (label, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert str(path) in lines[0]
    assert expected in lines[0], lines[0]
    # Checking the file says the same, without running it.
    checked = kvsim("validate", str(path))
    assert checked.returncode == 2 and checked.stderr == proc.stderr, checked.stderr


@pytest.mark.parametrize(("old", "new", "expected"), [
    # A field of another section: where it goes.
    ("  arrival:", "  max_wait_s: 5\n  arrival:",
     "workload.max_wait_s: unknown key here; it belongs under systems[].scheduler"),
    # A field of another kind of the same section: which kind has it.
    ("{kind: contiguous}", "{kind: contiguous, block_size: 16}",
     "systems[0].allocator.block_size: unknown key for this kind (kind: paged has it)"),
    # ... whatever field tells the members apart (it said "here; it belongs under
    # workload.arrival", the section it stood in).
    ("{process: poisson, rate: 50}", "{process: poisson, rate: 50, users: 4}",
     "workload.arrival.users: unknown key for this process (process: closed_loop has it)"),
    ("{dist: uniform, low: 10, high: 200}", "{dist: uniform, low: 10, high: 200, sigma: 1}",
     "workload.prompt_len.sigma: unknown key for this dist (dist: lognormal has it)"),
    # A misspelling: this section's field, unless another section's is closer.
    ("prefix_groups:", "prefix_grups:", "workload.prefix_grups: unknown key; did you mean "
     "'prefix_groups'?"),
    ("{kind: paged, block_size: 16}", "{kind: paged, block_size: 16, prediction: {}}",
     "systems[1].allocator.prediction: unknown key; did you mean 'predictor' (under "
     "systems[])?"),
])
def test_an_unknown_key_is_told_where_it_belongs(old, new, expected):
    import yaml

    from sim.scenario import ScenarioError, scenario_from_dict

    assert old in GOOD
    with pytest.raises(ScenarioError) as caught:
        scenario_from_dict(yaml.safe_load(GOOD.replace(old, new, 1)))
    assert str(caught.value) == f"<scenario>: {expected}"


def test_a_union_alternative_is_not_counted_as_another_error(tmp_path):
    # `gpu` is a preset name or a mapping; the name form also refuses an incomplete mapping,
    # which is the same mistake, not "(and 1 more)".
    path = tmp_path / "gpu.yaml"
    path.write_text(GOOD.replace("name: tiny\n", "name: tiny\ngpu: {name: toy, memory_gib: 8, "
                                 "hbm_bandwidth_gbps: 500}\n"))
    proc = kvsim("validate", str(path))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"kvsim: error: {path}: gpu.peak_tflops: required field "
                                   "is missing")


@pytest.mark.parametrize(("content", "expected"), [
    (GOOD.encode().replace(b"name: tiny", b"name: t\xffny"),
     ": line 2: not UTF-8 text (byte 0xff); expected a scenario YAML file"),
    (GOOD.encode().replace(b"name: tiny", b"name: t\x00ny"),
     ": line 2: not valid YAML (special characters are not allowed: #x0000)"),
    (GOOD.encode().replace(b"stop:", b"stop: \x07"),
     ": line 14: not valid YAML (special characters are not allowed: #x0007)"),
])
def test_a_file_that_is_not_yaml_text_is_one_line(tmp_path, content, expected):
    """Bytes that are not UTF-8, or control characters YAML forbids, name the line (these
    were a traceback and a three-line message)."""
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    proc = kvsim("validate", str(path))
    assert proc.returncode == 2
    assert proc.stderr == f"kvsim: error: {path}{expected}\n"


def test_a_byte_order_mark_before_a_scenario_is_fine(tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    proc = kvsim("validate", str(path))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(("calibration", "expected"), [
    ("missing.yaml", "missing.yaml: calibration file not found (timing.calibration)"),
    ("folder", "folder: is a directory, expected a calibration YAML file (kvsim calibrate "
               "writes one)"),
    ("binary.yaml", "binary.yaml: line 1: not UTF-8 text (byte 0xff); expected a "
                    "calibration YAML file (kvsim calibrate writes one)"),
    ("open.yaml", "open.yaml: line 2: not valid YAML (expected ',' or ']', but got "
                  "'<stream end>')"),
])
def test_a_bad_calibration_file_is_one_line(tmp_path, calibration, expected):
    (tmp_path / "folder").mkdir()
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "open.yaml").write_text("coefficients: [1, 2\n")
    path = tmp_path / "s.yaml"
    path.write_text(GOOD + f"timing: {{calibration: {calibration}}}\n")
    proc = kvsim("run", str(path), "--quiet", "--no-report", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith(f"{tmp_path / expected}"), proc.stderr


def test_validate_reads_the_files_a_workload_reads(tmp_path):
    # A trace file, or one an empirical length resamples, missing or with a bad row is
    # found without running, as a run would find it.
    traced = tmp_path / "traced.yaml"
    traced.write_text(GOOD.replace("""workload:
  arrival: {process: poisson, rate: 50}
  prompt_len: {dist: uniform, low: 10, high: 200}
  output_len: {dist: uniform, low: 5, high: 100}
  prefix_groups: {groups: 2, length: 64, fraction: 0.5}""", "workload: {kind: trace, path: t.csv}"))
    proc = kvsim("validate", str(traced))
    assert proc.returncode == 2 and proc.stderr == (
        f"kvsim: error: {traced}: {tmp_path / 't.csv'}: trace file not found\n")
    (tmp_path / "t.csv").write_text("arrival_s,prompt_len,output_len\n0,10,5\n1,-3,5\n")
    proc = kvsim("validate", str(traced))
    assert proc.returncode == 2 and proc.stderr == (
        f"kvsim: error: {traced}: {tmp_path / 't.csv'}:3: prompt_len must be >= 1\n")
    (tmp_path / "t.csv").write_text("arrival_s,prompt_len,output_len\n0,10,5\n1,30,5\n")
    assert kvsim("validate", str(traced)).returncode == 0
    resampled = tmp_path / "resampled.yaml"
    resampled.write_text(GOOD.replace("prompt_len: {dist: uniform, low: 10, high: 200}",
                                      "prompt_len: {dist: empirical, path: lengths.csv, "
                                      "file_column: n}"))
    proc = kvsim("validate", str(resampled))
    assert proc.returncode == 2 and "lengths.csv" in proc.stderr and "not found" in proc.stderr
    (tmp_path / "lengths.csv").write_text("n\n40\nforty\n")
    proc = kvsim("validate", str(resampled))
    assert proc.returncode == 2 and "lengths.csv:3: column 'n'" in proc.stderr


def test_missing_file_and_validate_and_schema(tmp_path):
    proc = kvsim("run", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"kvsim: error: {tmp_path / 'nope.yaml'}: no such file"
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    proc = kvsim("validate", str(good))
    assert proc.returncode == 0 and "ok" in proc.stdout
    # How memory divides, in the figures vLLM logs at start-up: 2 GiB of 0.5 MiB tokens.
    assert ("memory: llama-2-7b on a100-80g: weights 12.6 GiB, KV pool 2.0 GiB "
            "(memory.kv_memory_gib); GPU KV cache size 4,096 tokens of 512.0 KiB; maximum "
            "concurrency for 4,096 tokens per request: 1.00x") in proc.stdout
    split = tmp_path / "split.yaml"
    split.write_text(GOOD.replace("memory: {kv_memory_gib: 2}", "model: llama-2-70b\n"
                                  "parallel: {tensor_parallel_size: 4}"))
    proc = kvsim("validate", str(split))
    # Per GPU: 90 % of 80 GiB less a quarter of 68.98 B fp16 weights, over 80 layers × 2
    # of Llama-2-70B's 8 KV heads × 128 × 2 (K, V) × 2 bytes.
    pool_bytes = 81920 * 1024**2 * 0.9 - 68.98e9 * 2 / 4
    tokens = int(pool_bytes // (80 * 2 * 128 * 2 * 2))
    assert (f"GPU KV cache size {tokens:,} tokens of 80.0 KiB a GPU; maximum concurrency for "
            f"4,096 tokens per request: {tokens / 4096:.2f}x") in proc.stdout
    proc = kvsim("validate", str(split).replace("split", "nope"))
    assert proc.returncode == 2
    split.write_text(GOOD.replace("memory: {kv_memory_gib: 2}", "model: llama-2-70b"))
    proc = kvsim("validate", str(split))  # the weights leave no pool: an error, not "ok"
    assert proc.returncode == 2 and not proc.stdout
    assert "llama-2-70b weights (128.5 GiB) do not fit" in proc.stderr
    # A sweep file is valid only if every point is: validate checks them all.
    swept = tmp_path / "sweep.yaml"
    swept.write_text(GOOD + "sweep: {grid: {workload.arrival.rate: [5, 10]}, seeds: [0, 1]}\n")
    proc = kvsim("validate", str(swept))
    assert proc.returncode == 0 and "sweep: 4 runs, each valid" in proc.stdout
    proc = kvsim("run", str(swept), "--quiet", "--no-report", "--out", str(tmp_path / "base"))
    assert proc.returncode == 0
    assert f"note: {swept} has a sweep section; this ran its base scenario only" in proc.stdout
    swept.write_text(GOOD + "sweep: {grid: {workload.arival.rate: [5, 10]}}\n")
    proc = kvsim("validate", str(swept))
    assert proc.returncode == 2
    assert "workload.arival: unknown key; did you mean 'arrival'?" in proc.stderr
    proc = kvsim("schema")
    assert proc.returncode == 0 and '"systems"' in proc.stdout
    proc = kvsim("presets")  # every preset, with what a token of it caches
    assert proc.returncode == 0
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert "MLA (576)" in rows["deepseek-v3"] and "68.6" in rows["deepseek-v3"]
    assert "GQA (8 KV heads)" in rows["llama-2-70b"] and "512.0" in rows["llama-2-7b"]
    assert "8 of 128" in rows["qwen3-30b-a3b"] and "NVLink 450 × 8 GPUs" in rows["h200-141g"]
    assert "PCIe 32 × 8 GPUs" in rows["l40s-48g"] and "453.7" in rows["llama-3.1-405b-fp8"]
    assert "FP8 80%" in rows["llama-3.1-405b-fp8"] and "FP4 99%" in rows["llama-3.1-405b-fp4"]
    assert "9,000" in rows["b200-180g"] and "bf16" in rows["gpt-oss-120b"]
    proc = kvsim("run")
    assert proc.returncode == 2


def test_presets_say_how_many_tokens_each_gpu_holds_of_a_model():
    proc = kvsim("presets", "--model", "llama-3.1-70b", "--max-model-len", "16384")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[2:9]}
    assert list(rows) == ["a100-40g", "a100-80g", "h100-80g", "h200-141g", "b200-180g",
                          "h20-96g", "l40s-48g"]
    # A B200 holds the 131.4 GiB alone: 90 % of 183,359 MiB less the weights, over
    # 2 × 80 layers × 8 KV heads × 128 × 2 bytes a token.
    alone = int((183359 * 2**20 * 0.9 - 70.55e9 * 2) // (2 * 80 * 8 * 128 * 2))
    assert rows["b200-180g"][:2] == [f"{alone:,}", f"({alone / 16384:.1f}×)"]
    assert rows["h100-80g"][:3] == ["—", "39,176", "(2.4×)"]  # one H100 holds none of it
    # An FP8 cache holds twice the tokens in the same memory.
    fp8 = kvsim("presets", "--model", "llama-3.1-70b", "--kv-cache-dtype", "fp8")
    fp8_rows = {line.split()[0]: line.split()[1:] for line in fp8.stdout.splitlines()[2:9]}
    assert fp8_rows["b200-180g"][0] == (
        f"{int((183359 * 2**20 * 0.9 - 70.55e9 * 2) // (2 * 80 * 8 * 128)):,}")
    # An FP4 cache: 4.5 bits an element, read on Blackwell only.
    fp4 = kvsim("presets", "--model", "llama-3.1-70b", "--kv-cache-dtype", "fp4_e2m1")
    fp4_rows = {line.split()[0]: line.split()[1:] for line in fp4.stdout.splitlines()[2:9]}
    assert fp4_rows["b200-180g"][0] == (
        f"{int((183359 * 2**20 * 0.9 - 70.55e9 * 2) // (2 * 80 * 8 * 128 * 0.5625)):,}")
    assert fp4_rows["h200-141g"] == ["no", "FP4"] * 4
    assert "no FP4: only GPUs with FP4 tensor cores (Blackwell) read" in fp4.stdout
    for args, words in ((("--model", "nope"), "kvsim: error: --model: unknown model 'nope'"),
                        (("--model", "qwen3-8b", "--max-model-len", "50000"),
                         "kvsim: error: --max-model-len 50000: qwen3-8b's context is 40,960 "
                         "tokens"),
                        (("--model", "qwen3-8b", "--gpu-memory-utilization", "0"),
                         "expected a share in (0, 1], got '0'")):
        proc = kvsim("presets", *args)
        assert proc.returncode == 2 and words in proc.stderr and proc.stdout == ""
    # An option is known by its whole name only: --gpu is not --gpu-memory-utilization.
    proc = kvsim("presets", "--model", "qwen3-8b", "--gpu", "h100-80g")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("kvsim: error: unrecognized arguments: --gpu h100-80g (kvsim "
                           "presets --help lists the options)\n")


@pytest.mark.parametrize("args, expected", [
    # A typo of a command or an option: the nearest named.
    (("runn",), "argument command: invalid choice: 'runn'; did you mean 'run'? (choose from "
                "'run', 'sweep', 'capacity', 'report', 'compare', 'validate', 'schema', "
                "'presets', 'bench', 'calibrate', 'trace')"),
    (("trace", "stat"), "argument trace_command: invalid choice: 'stat'; did you mean "
                        "'stats'? (choose from 'stats', 'hit-curve', 'export', 'list')"),
    (("capacity", "scenarios/seed_63_percent.yaml", "--max-itl", "0.1"),
     "unrecognized arguments: --max-itl 0.1; did you mean --max-itl-s? (kvsim capacity "
     "--help lists the options)"),
    (("sweep", "scenarios/sweeps/rate_sweep.yaml", "--job=2"),
     "unrecognized arguments: --job=2; did you mean --jobs? (kvsim sweep --help lists the "
     "options)"),
    # Nothing near: where the options are listed.
    (("run", "scenarios/seed_63_percent.yaml", "--bogus"),
     "unrecognized arguments: --bogus (kvsim run --help lists the options)"),
    (("run",), "the following arguments are required: scenario (kvsim run --help lists the "
               "options)"),
    ((), "the following arguments are required: command (kvsim --help lists the commands)"),
    (("run", "scenarios/seed_63_percent.yaml", "--set"),
     "argument --set: expected one argument (kvsim run --help lists the options)"),
    # A bad value says what it expected, and that is all.
    (("capacity", "scenarios/seed_63_percent.yaml", "--max-itl-s", "abc"),
     "argument --max-itl-s: expected a positive number, got 'abc'"),
    (("calibrate", "--modle", "x"), "unrecognized arguments: --modle x; did you mean "
                                    "--model? (kvsim calibrate --help lists the options)"),
])
def test_a_command_line_error_is_one_line_naming_what_was_meant(args, expected):
    proc = kvsim(*args)
    assert proc.returncode == 2 and not proc.stdout
    assert proc.stderr == f"kvsim: error: {expected}\n"


@pytest.mark.parametrize("args", [
    ("bench", "--sizes", "abc"),
    ("bench", "--sizes", "10000,0"),
    ("sweep", "scenarios/sweeps/rate_sweep.yaml", "--jobs", "0"),
    ("trace", "stats", "builtin:azure_llm_2023_code.csv", "--block-size", "0"),
    ("trace", "stats", "builtin:azure_llm_2023_code.csv", "--max-model-len", "-5"),
    # A one-token context holds no prompt and answer; one past 2^32 no simulated length.
    ("trace", "stats", "builtin:azure_llm_2023_code.csv", "--max-model-len", "1"),
    ("trace", "stats", "builtin:azure_llm_2023_code.csv", "--max-model-len",
     "100000000000000000000"),
], ids=["sizes-text", "sizes-zero", "jobs-zero", "block-size-zero", "max-model-len-negative",
        "max-model-len-one", "max-model-len-huge"])
def test_bad_numeric_options_are_refused_before_any_work(args):
    proc = kvsim(*args)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    option = next(a for a in args if a.startswith("--"))
    assert last.startswith(f"kvsim: error: argument {option}: expected")
    assert "Traceback" not in proc.stderr and not proc.stdout


def test_set_changes_a_field_for_one_run(tmp_path):
    import yaml

    proc = kvsim("run", "scenarios/seed_63_percent.yaml", "--out", str(tmp_path), "--quiet",
                 "--no-report", "--set", "systems[paged-16].allocator.block_size=32",
                 "--set", "stop={num_requests: 4}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == (
        "seed_63_percent: 4 requests, seed 0, systems[paged-16].allocator.block_size=32, "
        "stop={'num_requests': 4}")
    resolved = yaml.safe_load((tmp_path / "scenario.yaml").read_text())
    assert resolved["systems"][1]["allocator"]["block_size"] == 32
    assert resolved["stop"]["num_requests"] == 4
    # The same as a file with that change, byte for byte.
    raw = yaml.safe_load((ROOT / "scenarios/seed_63_percent.yaml").read_text())
    raw["systems"][1]["allocator"]["block_size"] = 32
    raw["stop"] = {"num_requests": 4}
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(raw))
    again = kvsim("run", str(edited), "--out", str(tmp_path / "edited"), "--quiet",
                  "--no-report")
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "summary.json").read_bytes() == (
        tmp_path / "edited" / "summary.json").read_bytes()


@pytest.mark.parametrize(("change", "expected"), [
    ("memory.kv_memory_gib", "argument --set: expected PATH=VALUE, e.g. "
                             "memory.kv_memory_gib=8, got 'memory.kv_memory_gib'"),
    ("memory.kv_memory_gib=[1", "argument --set: 'memory.kv_memory_gib=[1': the value is not "
                                "valid YAML"),
    ("systems[nope].allocator.block_size=8", "--set 'systems[nope].allocator.block_size': no "
                                             "item named 'nope' in systems (names: "
                                             "contiguous-4096, paged-16)"),
    ("memory.kv_memory_gib=-1", "scenarios/seed_63_percent.yaml (with --set): "
                                "memory.kv_memory_gib: Input should be greater than 0 (got -1)"),
])
@pytest.mark.parametrize("command", ["run", "validate", "capacity"])
def test_a_bad_set_is_one_line(command, change, expected):
    proc = kvsim(command, "scenarios/seed_63_percent.yaml", "--set", change)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"kvsim: error: {expected}"
    assert not proc.stdout


def test_an_unusable_output_path_is_refused_before_the_run(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    scenario = tmp_path / "good.yaml"
    scenario.write_text(GOOD)
    for args in (("run", str(scenario), "--out", str(blocker), "--quiet"),
                 ("sweep", "scenarios/sweeps/rate_sweep.yaml", "--out", str(blocker),
                  "--quiet")):
        proc = kvsim(*args)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip() == (f"kvsim: error: {blocker}: expected an output folder, "
                                       "but a file is in the way")
        assert not proc.stdout  # refused before anything ran
    target = tmp_path / "missing" / "trace.csv"
    proc = kvsim("trace", "export", str(scenario), "-o", str(target))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"kvsim: error: {target}: no folder {target.parent} to "
                                   "write into")


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory) -> Path:
    """A run folder of the seed scenario, made once for the tests that damage copies of it."""
    run = tmp_path_factory.mktemp("seed") / "run"
    proc = kvsim("run", "scenarios/seed_63_percent.yaml", "--out", str(run), "--quiet",
                 "--no-report")
    assert proc.returncode == 0, proc.stderr
    return run


def edit_summary(run: Path, edit: Callable[[dict], object]) -> None:
    """Change a run folder's summary.json as a person editing it might."""
    data = json.loads((run / "summary.json").read_text())
    edit(data["systems"])
    (run / "summary.json").write_text(json.dumps(data))


def drop_columns(table: Path, *columns: str) -> None:
    """Take columns out of a run folder's table, as an older kvsim or an edit might."""
    pd.read_parquet(table).drop(columns=list(columns)).to_parquet(table)


@pytest.mark.parametrize(("damage", "expected"), [
    (lambda run: (run / "paged-16" / "memory.parquet").unlink(),
     "{run}: paged-16/memory.parquet is missing; rerun kvsim run or kvsim sweep to "
     "rebuild it"),
    (lambda run: (run / "summary.json").write_text("garbage"),
     "{run}/summary.json: cannot be read back (Expecting value"),
    (lambda run: (run / "summary.json").write_text('{"trace_notes": []}'),
     "{run}/summary.json: cannot be read back (no 'systems' field)"),
    (lambda run: (run / "paged-16" / "steps.parquet").write_text("xx"),
     "{run}/paged-16/steps.parquet: cannot be read back ("),
    # An edited metric is named where it is wrong; one gone is named where it is wanted.
    (lambda run: edit_summary(run, lambda systems: systems["paged-16"].update(
        makespan_s="long")),
     "{run}/summary.json: cannot be read back (systems.paged-16.makespan_s: expected a "
     "number or null, got 'long')"),
    (lambda run: edit_summary(run, lambda systems: systems.update({"paged-16": [1]})),
     '{run}/summary.json: cannot be read back (expected {{"systems": {{system name: {{metric: '
     'value, ...}}}}}})'),
    (lambda run: edit_summary(run, lambda systems: systems["paged-16"].pop("external_frac")),
     "{run}/summary.json: system 'paged-16' has no 'external_frac' metric (a folder of "
     "another kvsim version, or edited); rerun kvsim run to rebuild it"),
    # A column gone from a table (the report read it as a KeyError: "run failed").
    (lambda run: drop_columns(run / "paged-16" / "requests.parquet", "first_token_s", "n"),
     "{run}/paged-16/requests.parquet: cannot be read back (no 'first_token_s', 'n' columns; "
     "a table of another kvsim version, or edited: rerun kvsim run to rebuild it)"),
    (lambda run: drop_columns(run / "contiguous-4096" / "memory.parquet", "cached"),
     "{run}/contiguous-4096/memory.parquet: cannot be read back (no 'cached' column;"),
    # A metric the report reckons with is never null, a share of the pool never past it,
    # and a count whole and within what a run can have.
    (lambda run: edit_summary(run, lambda systems: systems["paged-16"].update(
        token_frac=None)),
     "{run}/summary.json: cannot be read back (systems.paged-16.token_frac: expected a "
     "number, got null)"),
    (lambda run: edit_summary(run, lambda systems: systems["paged-16"].update(
        reserved_frac=1e300)),
     "{run}/summary.json: cannot be read back (systems.paged-16.reserved_frac: expected a "
     "share from 0 to 1, got 1e+300)"),
    (lambda run: edit_summary(run, lambda systems: systems["paged-16"].update(
        replicas=2.0)),
     "{run}/summary.json: cannot be read back (systems.paged-16.replicas: expected a whole "
     "number from 1 to 1,048,576, got 2.0)"),
    # The scenario kept beside the summary is the one that ran its systems.
    (lambda run: (run / "scenario.yaml").write_text(
        (run / "scenario.yaml").read_text().replace("name: paged-16", "name: paged")),
     "{run}/scenario.yaml: its systems (contiguous-4096, paged) are not those of "
     "summary.json (contiguous-4096, paged-16); rerun kvsim run to rebuild the folder"),
], ids=["missing-table", "bad-json", "no-systems", "bad-parquet", "bad-metric",
        "bad-system", "missing-metric", "missing-columns", "missing-column", "null-share",
        "share-past-the-pool", "count-not-whole", "systems-renamed"])
def test_a_damaged_run_folder_is_named_in_one_line(seed_run, tmp_path, damage, expected):
    run = Path(shutil.copytree(seed_run, tmp_path / "run"))
    damage(run)
    proc = kvsim("report", str(run))
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"kvsim: error: {expected.format(run=run)}")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_compare_puts_runs_side_by_side_with_the_change(seed_run, tmp_path):
    other = tmp_path / "smaller"  # the same requests, half the pool: 4 seated at a time
    proc = kvsim("run", "scenarios/seed_63_percent.yaml", "--out", str(other), "--quiet",
                 "--no-report", "--set", "memory.kv_memory_gib=8")
    assert proc.returncode == 0, proc.stderr
    proc = kvsim("compare", str(seed_run), str(other))
    assert proc.returncode == 0, proc.stderr
    header, _, *rows = proc.stdout.splitlines()
    assert header.split() == ["run:", "contiguous-4096", "smaller:", "contiguous-4096",
                              "change", "run:", "paged-16", "smaller:", "paged-16", "change"]
    row = next(r for r in rows if r.startswith("mean decode batch")).split()[3:]
    before = json.loads((seed_run / "summary.json").read_text())["systems"]
    after = json.loads((other / "summary.json").read_text())["systems"]
    change = (after["contiguous-4096"]["mean_batch"] / before["contiguous-4096"]["mean_batch"]
              - 1) * 100
    assert row[:3] == ["8.0", "4.0", f"{change:+.1f}%"] and change < 0
    # Under the table, what was run differently.
    assert proc.stdout.splitlines()[-1] == (
        "settings of smaller that differ from run's: memory.kv_memory_gib: 16 → 8")
    # A folder without its scenario (written before runs kept one) is compared all the same.
    (other / "scenario.yaml").unlink()
    proc = kvsim("compare", str(seed_run), str(other))
    assert proc.returncode == 0 and "settings of" not in proc.stdout
    # A folder that is no run is named in one line; so is a single folder.
    again = f"{seed_run}/../{seed_run.name}"  # the same folder, spelt otherwise
    for args, expected in [((str(seed_run), str(tmp_path)),
                            f"{tmp_path}: not a kvsim run folder (no summary.json)"),
                           ((str(seed_run),), "compare needs two run folders or more, got 1"),
                           ((str(seed_run), again),
                            f"the same run folder is given twice: {seed_run} {again}")]:
        proc = kvsim("compare", *args)
        assert proc.returncode == 2 and proc.stderr == f"kvsim: error: {expected}\n"


def test_compare_names_a_sweeps_runs_by_what_the_sweep_set(tmp_path):
    from sim.sweep import run_sweep

    scenario = tmp_path / "swept.yaml"
    scenario.write_text(GOOD + "sweep: {grid: {memory.kv_memory_gib: [1, 2]}}\n")
    outcome = run_sweep(scenario, out_dir=tmp_path / "sweep", jobs=1)
    assert outcome.failed == 0
    keys = list(outcome.table.drop_duplicates("key").sort_values("param:memory.kv_memory_gib")[
        "key"])
    proc = kvsim("compare", *(str(tmp_path / "sweep" / "runs" / key) for key in keys))
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.splitlines()[0]
    assert "memory.kv_memory_gib=1, seed 0: paged" in header
    assert "memory.kv_memory_gib=2, seed 0: paged" in header


def test_version_and_calibrate_speak_as_kvsim(tmp_path):
    proc = kvsim("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == (f"kvsim {metadata.version('kvsim')} (build {build_id()}), "
                                   f"{CORE.describe()}")
    # One line however narrow the terminal and long the reason (argparse's own wrapped it).
    narrow = subprocess.run([sys.executable, "-m", "sim.cli", "--version"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, check=False,
                            env={**os.environ, "COLUMNS": "30", "KVSIM_PURE_PYTHON": "1"})
    assert narrow.stdout == (f"kvsim {metadata.version('kvsim')} (build {build_id()}), "
                             "pure-Python core (KVSIM_PURE_PYTHON=1)\n")
    proc = kvsim("calibrate", "--help")
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: kvsim calibrate") and "``" not in proc.stdout
    timings = tmp_path / "timings.csv"
    timings.write_text("x\n1\n")
    proc = kvsim("calibrate", "--from-csv", str(timings), "--out", str(tmp_path / "cal"))
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"kvsim: error: {timings}: no 'kind' column")


def test_trace_stats_and_export(tmp_path):
    proc = kvsim("trace", "stats", "builtin:azure_llm_2023_code.csv")
    assert proc.returncode == 0, proc.stderr
    assert "8,819" in proc.stdout
    out = tmp_path / "trace.csv"
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    proc = kvsim("trace", "export", str(good), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert len(out.read_text().splitlines()) == 61
    proc = kvsim("trace", "export", str(good), "-o", str(out), "--set", "stop.num_requests=7")
    assert proc.returncode == 0, proc.stderr
    assert len(out.read_text().splitlines()) == 8
    proc = kvsim("trace", "stats", "builtin:azure_llm_2023_code.csv", "--set", "seed=1")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "kvsim: error: builtin:azure_llm_2023_code.csv: --set changes a scenario's fields; "
        "this is a trace file")
    proc = kvsim("trace", "stats", str(tmp_path / "missing.csv"))
    assert proc.returncode == 2 and "trace file not found" in proc.stderr
    proc = kvsim("trace", "stats", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr == (
        f"kvsim: error: {tmp_path}: is a directory, expected a trace file\n")
    # A pipe (a shell's <(...)) is read twice, the header first: refused, not found empty.
    pipe = tmp_path / "pipe.csv"
    os.mkfifo(pipe)
    proc = kvsim("trace", "stats", str(pipe))
    assert proc.returncode == 2 and proc.stderr == (
        f"kvsim: error: {pipe}: not a regular file (a device or a pipe), expected a trace "
        "file\n")
    generic = tmp_path / "generic.csv"
    generic.write_text("t,in,out\n0,10,5\n")
    proc = kvsim("trace", "stats", str(generic), "--format", "csv")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"kvsim: error: {generic}: format csv needs a columns map: give --columns "
        "arrival=NAME,prompt_len=NAME,output_len=NAME")
    proc = kvsim("trace", "stats", str(generic))  # guessed: none of the formats known
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"kvsim: error: {generic}: format csv needs a columns map (workload.columns: "
        "{arrival, prompt_len, output_len}: the names of its columns; on kvsim trace, "
        "--columns arrival=NAME,prompt_len=NAME,output_len=NAME); it is none of the "
        "known formats (azure: 'TIMESTAMP', 'ContextTokens', 'GeneratedTokens'; burstgpt: "
        "'Timestamp', 'Request tokens', 'Response tokens'; mooncake: 'timestamp', "
        "'input_length', 'output_length'; kvsim: 'arrival_s', 'prompt_len', 'output_len'); "
        "its first line: 't,in,out'")
    proc = kvsim("trace", "list")
    assert proc.returncode == 0, proc.stderr
    listed = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()
              if line.startswith("builtin:")}
    assert listed == {f"builtin:{name}": [name.split("_")[0] if "azure" in name else "mooncake",
                                          f"{rows:,}", "requests"]
                      for name, rows in PUBLIC_TRACE_ROWS.items()}
    proc = kvsim("trace", "stats", "builtin:nope.csv")
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("shipped: " + ", ".join(sorted(PUBLIC_TRACE_ROWS)))


def test_trace_columns_read_a_generic_file(tmp_path):
    generic = tmp_path / "generic.jsonl"
    generic.write_text('{"t": 0, "in": 40, "out": 5, "h": [1, 2], "p": 1}\n'
                       '{"t": 2000, "in": 40, "out": 7, "h": [1, 3], "p": 0}\n')
    columns = "arrival=t, prompt_len=in, output_len=out, hash_ids=h, priority=p"
    proc = kvsim("trace", "stats", str(generic), "--columns", columns, "--time-unit", "ms")
    assert proc.returncode == 0, proc.stderr
    stats = dict(line.split(None, 1) for line in proc.stdout.splitlines()[1:])
    assert (stats["requests"], stats["duration_s"], stats["prompt_len_mean"],
            stats["output_len_max"]) == ("2", "2.00", "40.00", "7")
    # Both prompts open with hash id 1: their first two full blocks (64 of 80 tokens) shared.
    assert stats["sharing_potential_bs16"] == "0.8000"
    out = tmp_path / "out.csv"
    proc = kvsim("trace", "export", str(generic), "--columns", columns, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    header, *rows = (line.split(",") for line in out.read_text().splitlines())
    exported = {name: [row[header.index(name)] for row in rows]
                for name in ("arrival_s", "priority")}
    assert exported == {"arrival_s": ["0.0", "2000.0"], "priority": ["1", "0"]}  # seconds
    for bad, message in [
        ("arrival=t,prompt_len=in", "missing output_len: arrival, prompt_len, output_len are "
         "required"),
        ("arrival=t,size=in", "unknown key 'size': expected one of arrival, prompt_len, "
         "output_len, hash_ids, priority, predicted_output, max_tokens"),
        ("arrival=t,arrival=u", "key 'arrival' given twice"),
        ("arrival", "expected KEY=NAME pairs separated by commas (arrival=t,prompt_len=in,"
         "output_len=out), got 'arrival'"),
    ]:
        proc = kvsim("trace", "stats", str(generic), "--columns", bad)
        assert proc.returncode == 2
        assert proc.stderr.splitlines()[-1] == f"kvsim: error: argument --columns: {message}"
    proc = kvsim("trace", "stats", str(generic), "--columns",
                 "arrival=t,prompt_len=in,output_len=tokens")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"kvsim: error: {generic}:1: missing column 'tokens'")
    scenario = tmp_path / "s.yaml"
    scenario.write_text(GOOD)
    # Each option a bare file's reading needs is refused on a scenario, not ignored.
    for option, value, field in [("--columns", columns, "workload.columns"),
                                 ("--time-unit", "ms", "workload.time_unit"),
                                 ("--format", "azure", "workload.format"),
                                 ("--skip-invalid", None, "workload.skip_invalid"),
                                 ("--max-model-len", "4096", "max_model_len")]:
        proc = kvsim("trace", "stats", str(scenario), option, *([value] if value else []))
        assert proc.returncode == 2 and proc.stderr.strip() == (
            f"kvsim: error: {scenario}: {option} reads a bare trace file; a scenario names "
            f"its own ({field}; --set {field}=...)")


def test_invariant_checks_refuse_python_O(tmp_path):
    path = tmp_path / "debug.yaml"
    path.write_text(GOOD + "engine: {debug_invariants: true}\n")
    proc = kvsim_process("run", str(path), "--out", str(tmp_path / "out"), "--quiet",
                         "--no-report", python_flags=("-O",))
    assert proc.returncode == 2
    assert proc.stderr == (f"kvsim: error: {path}: engine.debug_invariants: its checks are "
                           "assert statements, which python -O removes; run without -O, or "
                           "set it false\n")
    assert kvsim("run", str(path), "--out", str(tmp_path / "out"), "--quiet",
                 "--no-report").returncode == 0  # without -O the checks run


def test_a_reader_that_stops_early_loses_no_results(tmp_path):
    # `kvsim run … | head -1`: the table and the report still get written, exit code 0.
    # Unbuffered, so every line after the first meets the closed pipe.
    proc = subprocess.Popen([sys.executable, "-m", "sim.cli", "run",
                             "scenarios/seed_63_percent.yaml", "--out", str(tmp_path), "--quiet"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=300) == 0
    assert first.startswith(b"seed_63_percent: 8 requests")
    assert proc.stderr.read() == b""
    assert (tmp_path / "report.html").is_file() and (tmp_path / "summary.json").is_file()
    assert (tmp_path / "figures" / "memory_over_time.png").is_file()


@pytest.mark.parametrize(("setting", "cause"), [
    ("stop.num_requests=50000000", " (Unable to allocate"),  # numpy names the array
    ("memory.kv_memory_gib=150000", ":"),  # 18.75 M blocks, under the cap; Python says nothing
], ids=["requests", "pool"])
def test_a_run_past_the_machines_memory_says_so_in_one_line(tmp_path, setting, cause):
    """Fifty million requests, or a pool of millions of blocks, in a process held to 2 GB of
    address space: they do not fit, and the error says what to give less of (exit 1, no
    traceback, no empty parentheses where the MemoryError has no message)."""
    import os
    import resource

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 * 10**9, 2 * 10**9))

    proc = subprocess.run(
        [sys.executable, "-m", "sim.cli", "run", "scenarios/paged_vs_contiguous.yaml", "--set",
         setting, "--quiet", "--no-report", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        preexec_fn=limited, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(f"kvsim: run failed: out of memory{cause}")
    assert proc.stderr.strip().endswith("give fewer requests (stop.num_requests), shorter "
                                        "ones, a smaller KV pool or a smaller sweep")
    assert "\n" not in proc.stderr.strip()


def test_scenario_differences_are_paths_with_both_values():
    from sim.results import scenario_differences

    first = {"name": "a", "output_dir": "x", "seed": 0, "memory": {"kv_memory_gib": 2},
             "workload": {"priorities": {0: 1}}, "slo": {"priorities": [0]},
             "systems": [{"name": "paged", "scheduler": {"max_num_seqs": 256}},
                         {"name": "contiguous", "allocator": {"kind": "contiguous"}}]}
    other = {"name": "b", "output_dir": "y", "seed": 3, "memory": {"kv_memory_gib": None},
             "workload": {"priorities": {0: 1, 1: 4}}, "slo": {"priorities": [0, 1]},
             "systems": [{"name": "fast", "scheduler": {}},
                         {"name": "paged", "scheduler": {"max_num_seqs": 64}}]}
    # Names and folders tell runs apart without setting them up; a mapping is followed key
    # by key, systems matched by name whatever their order, and a list is shown whole.
    assert scenario_differences(first, other) == [
        "seed: 0 → 3", "memory.kv_memory_gib: 2 → null", "workload.priorities.1: null → 4",
        "slo.priorities: [0] → [0, 1]", "systems[paged].scheduler.max_num_seqs: 256 → 64",
        "systems[contiguous]: only in the first", "systems[fast]: only in the second"]
    assert scenario_differences(first, first) == []
