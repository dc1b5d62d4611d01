"""gpu_validate: numpy twins of the kernel, the fit, the calibration round trip, and — on a
CUDA machine — the real kernels."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_validate import launch
from gpu_validate.correctness import Case, check_correctness
from gpu_validate.emulation import HostKernels, find_compiler
from gpu_validate.fit import decode_points, fit_calibration, fit_linear_relative
from gpu_validate.harness import cuda_status
from gpu_validate.launch import KERNEL_SOURCE, launch_args
from gpu_validate.reference import (
    MAX_RELATIVE_ERROR,
    attention_reference,
    gather_paged,
    make_inputs,
)
from sim.presets import lookup_model
from sim.timing import Calibration

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_emulated_paged_addressing_equals_contiguous_bitwise(block_size):
    rng = np.random.default_rng(block_size)
    inputs = make_inputs(rng, seqs=4, num_heads=4, num_kv_heads=2, head_dim=64,
                         context_lens=[1, block_size, 3 * block_size + 5, 700],
                         block_size=block_size)
    assert (inputs.q != 0).all() and (inputs.k != 0).all()
    for pages, dense in ((inputs.k_pages, inputs.k), (inputs.v_pages, inputs.v)):
        gathered = gather_paged(pages, inputs.block_tables, inputs.context_lens, block_size)
        for s, n in enumerate(inputs.context_lens):
            assert np.array_equal(gathered[s, :, :n].view(np.uint16),
                                  dense[s, :, :n].view(np.uint16))
    # The block table really scatters: physical blocks are not in logical order.
    used = inputs.block_tables[inputs.block_tables >= 0]
    assert not np.array_equal(used, np.sort(used))
    assert np.array_equal(attention_reference(inputs, paged=True), attention_reference(inputs))


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    """The kernel source compiled for the CPU (needs a C++ compiler, as CI has)."""
    if find_compiler() is None:
        pytest.skip("no C++ compiler to build the kernel emulation")
    return HostKernels(cache_dir=tmp_path_factory.mktemp("emulation"))


EMULATED_CASES = (
    Case(4, 2, 128, 16, (1, 17, 100, 300)),     # GQA, a partial last block and warp group
    Case(2, 2, 128, 8, (64, 5)),                # MHA, smallest block size
    Case(2, 1, 128, 128, (129, 3)),             # largest block size, one token past a block
    Case(2, 2, 64, 32, (40, 7)),                # half a slice: lanes 16-31 own nothing
    Case(2, 1, 80, 7, (50, 1)),                 # head_dim not a power of two, odd block size
    Case(2, 1, 256, 16, (33, 20)),              # two slices per lane
)


def test_kernel_source_on_the_cpu_matches_float64(host_kernels):
    table = check_correctness(host_kernels, cases=EMULATED_CASES, seed=3)
    assert (table["unwritten"] == 0).all()
    assert table["paged_equals_contiguous"].all()  # the block table is the only difference
    errors = table[["rel_error_contiguous", "rel_error_paged"]].to_numpy()
    # fp32 accumulation over exact fp16 inputs: ~1e-7, far inside the documented bound.
    assert errors.max() < 1e-5
    assert errors.max() <= MAX_RELATIVE_ERROR
    assert table["ok"].all()


@pytest.mark.parametrize(("threads", "tokens_per_warp"), [(32, 4), (256, 4), (128, 1),
                                                          (64, 8)])
def test_kernel_is_right_for_any_warps_and_tokens_in_flight(host_kernels, threads,
                                                            tokens_per_warp):
    kernels = HostKernels(cache_dir=host_kernels.library_dir, threads=threads,
                          tokens_per_warp=tokens_per_warp)
    table = check_correctness(kernels, cases=EMULATED_CASES[:2] + EMULATED_CASES[4:5],
                              seed=threads)
    assert table["ok"].all(), table.to_string()


@settings(max_examples=int(os.environ.get("KVSIM_HYPOTHESIS_EXAMPLES", "12")),
          deadline=None, derandomize="KVSIM_HYPOTHESIS_EXAMPLES" not in os.environ)
@given(group=st.sampled_from([1, 2, 4]), num_kv_heads=st.integers(1, 2),
       head_dim=st.integers(1, 64).map(lambda n: 4 * n),
       block_size=st.integers(1, 130),
       context_lens=st.lists(st.integers(1, 300), min_size=1, max_size=3),
       seed=st.integers(0, 2**32 - 1))
def test_kernel_is_right_for_any_shape_it_accepts(host_kernels, group, num_kv_heads, head_dim,
                                                  block_size, context_lens, seed):
    case = Case(group * num_kv_heads, num_kv_heads, head_dim, block_size, tuple(context_lens))
    table = check_correctness(host_kernels, cases=(case,), seed=seed)
    assert table["ok"].all(), table.to_string()


class SkipsLastSequence(HostKernels):
    """A broken launcher: its grid misses the last sequence, whose output stays unwritten."""

    def run(self, dev, paged):
        dev["out"].fill(np.nan)
        self.launch(paged, *launch_args(dict(dev, q=dev["q"][:-1]), paged, self.threads))
        return dev["out"]


def test_poisoned_output_shows_unwritten_elements(host_kernels):
    broken = SkipsLastSequence(cache_dir=host_kernels.library_dir)
    table = check_correctness(broken, cases=EMULATED_CASES[:1])
    heads, head_dim = EMULATED_CASES[0].num_heads, EMULATED_CASES[0].head_dim
    assert table["unwritten"].iloc[0] == 2 * heads * head_dim  # both layouts, one sequence
    assert not table["ok"].any()


def test_python_limits_mirror_the_kernel_defines():
    source = KERNEL_SOURCE.read_text()
    defines = {name: value for name, value in
               re.findall(r"^#define (\w+) \(?([^/\n]+?)\)?\s*(?://.*)?$", source, re.M)}
    lane_elems = int(defines["LANE_ELEMS"])
    slice_elems = 32 * lane_elems
    assert defines["SLICE"] == "32 * LANE_ELEMS"
    assert lane_elems == launch.LANE_ELEMS
    assert int(defines["MAX_SLICES"]) * slice_elems == launch.MAX_HEAD_DIM
    assert 32 * int(defines["MAX_WARPS"]) == launch.MAX_THREADS
    # NVRTC (what CuPy compiles with) has no CUDA headers on its path: the source needs none.
    assert not re.search(r"^\s*#\s*include", source, re.M)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_heads": 6, "num_kv_heads": 4}, "multiple of num_kv_heads"),
    ({"head_dim": 130}, "head_dim 130"),
    ({"head_dim": 512}, "head_dim 512"),
    ({"threads": 48}, "threads 48"),
    ({"block_size": 0}, "block_size 0"),
    ({"context_lens": [3, 0]}, "at least one token"),
])
def test_shapes_the_kernel_cannot_take_are_refused_by_name(kwargs, message):
    args = {"num_heads": 8, "num_kv_heads": 2, "head_dim": 128, "context_lens": [5],
            "block_size": 16, **kwargs}
    with pytest.raises(ValueError, match=message):
        launch.check_problem(**args)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_kernel_builds_for_hopper_with_no_local_memory(tmp_path):
    """Register arrays indexed at run time would spill to local memory (slow): ptxas says."""
    proc = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "--std=c++17", "-Xptxas", "-v",
                           "-o", str(tmp_path / "k.cubin"), str(KERNEL_SOURCE)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", proc.stderr)
    assert len(frames) == 2  # both entry points
    assert all(frame == ("0", "0") for frame in frames), proc.stderr


def synthetic_timings(a_layer: float, g1: float, h1: float, rho: dict[int, float],
                      noise: float, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for tokens in (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        rows.append({"kind": "gemm", "tokens": tokens, "time_s": a_layer + g1 * tokens,
                     "flops": 2.0 * 6.74e9 / 32 * tokens})
    for batch in (4, 8, 16, 32, 64, 128):
        for context in (256, 512, 1024, 2048, 4096, 8192):
            base = 2e-6 + h1 * batch * context
            rows.append({"kind": "attention", "layout": "contiguous", "block_size": 0,
                         "batch": batch, "context_len": context,
                         "time_s": base * (1 + noise * rng.standard_normal())})
            for bs, factor in rho.items():
                rows.append({"kind": "attention", "layout": "paged", "block_size": bs,
                             "batch": batch, "context_len": context,
                             "time_s": base * factor * (1 + noise * rng.standard_normal())})
    return pd.DataFrame(rows)


def test_fit_recovers_known_coefficients_within_one_percent(tmp_path):
    model = lookup_model("llama-2-7b")
    layers = model.num_layers
    a_layer, g1, h1 = 2.0e-4, 1.3e-6, 7.5e-9
    rho = {8: 1.30, 16: 1.15, 32: 1.08, 64: 1.05, 128: 1.03}
    timings = synthetic_timings(a_layer, g1, h1, rho, noise=0.002)
    result = fit_calibration(timings, model, device="synthetic")
    coeff = result.calibration.coefficients
    expected = {"a": layers * (a_layer + 2e-6), "b": layers * g1, "c": layers * h1,
                "d": layers * g1}
    for key, value in expected.items():
        assert coeff[key] == pytest.approx(value, rel=0.01), key
    for bs, factor in rho.items():
        assert result.calibration.rho[bs] == pytest.approx(factor, rel=0.01)
    assert result.calibration.fit["mape"] < 0.01
    assert result.calibration.fit["held_out_points"] > 0
    path = tmp_path / "calibration.yaml"
    result.calibration.dump(path)
    loaded = Calibration.load(path)
    assert loaded.coefficients == pytest.approx(coeff)
    timing = loaded.to_model("test")
    assert timing.rho(16) == pytest.approx(1.15, rel=0.01)
    assert timing.step_time(10, 5000, 0, 0, 1.0) == pytest.approx(
        coeff["a"] + 10 * coeff["b"] + 5000 * coeff["c"])


def test_fit_never_gives_a_negative_coefficient(tmp_path):
    """GEMMs flat in batch size (weight-bound) plus noise pull the batch term below zero in a
    plain fit; the constrained fit pins it at 0 and the calibration still loads."""
    model = lookup_model("llama-2-7b")
    timings = synthetic_timings(2.0e-4, 0.0, 7.5e-9, {16: 1.1}, noise=0.03, seed=1)
    gemm = timings["kind"] == "gemm"
    wide = gemm & (timings["tokens"] >= 256)
    timings.loc[wide, "time_s"] += 1.3e-6 * timings.loc[wide, "tokens"]  # prefill still grows
    points = decode_points(timings, model.num_layers)
    x = np.column_stack([np.ones(len(points)), points["batch"], points["context_tokens"]])
    y = points["measured_s"].to_numpy()
    unconstrained, *_ = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)
    assert unconstrained[1] < 0  # the trap is real
    constrained = fit_linear_relative(x, y)
    assert (constrained >= 0).all() and constrained[1] == 0
    result = fit_calibration(timings, model)
    assert min(result.calibration.coefficients.values()) >= 0
    result.calibration.dump(tmp_path / "c.yaml")
    loaded = Calibration.load(tmp_path / "c.yaml")  # refuses negative coefficients
    assert loaded.coefficients == pytest.approx(result.calibration.coefficients)


def test_text_in_a_column_another_kind_of_row_uses_is_not_read(tmp_path):
    # An attention row has no FLOPs: a word there is no bad timing, and the GEMM rows'
    # numbers still read as numbers (a column of text divided no float before).
    timings = synthetic_timings(2e-4, 1.3e-6, 7.5e-9, {16: 1.1}, noise=0.0).astype(object)
    attention_row = timings.index[timings["kind"] == "attention"][0]
    timings.loc[attention_row, "flops"] = "unknown"
    csv = tmp_path / "timings.csv"
    timings.to_csv(csv, index=False)
    proc = subprocess.run([sys.executable, "-m", "gpu_validate", "--from-csv", str(csv),
                           "--out", str(tmp_path / "cal")], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "cal" / "calibration.yaml").is_file()


def test_cli_without_gpu_says_so_and_fits_a_csv(tmp_path):
    ok, reason = cuda_status()
    if not ok:
        proc = subprocess.run([sys.executable, "-m", "gpu_validate", "--out",
                               str(tmp_path / "none")], capture_output=True, text=True,
                              cwd=ROOT, check=False)
        assert proc.returncode == 3
        assert "nothing was timed" in proc.stderr and reason in proc.stderr
    timings = synthetic_timings(2e-4, 1.3e-6, 7.5e-9, {16: 1.1}, noise=0.0)
    csv = tmp_path / "timings.csv"
    timings.to_csv(csv, index=False)
    proc = subprocess.run([sys.executable, "-m", "sim.cli", "calibrate", "--from-csv", str(csv),
                           "--out", str(tmp_path / "cal")], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "cal" / "calibration.yaml").is_file()
    assert (tmp_path / "cal" / "fit.png").stat().st_size > 1000
    assert "held-out MAPE" in proc.stdout


@pytest.mark.parametrize(("spoil", "message"), [
    (lambda t: t.drop(columns=["kind"]), "no 'kind' column"),
    (lambda t: t[t["kind"] != "attention"], "no 'attention' rows"),
    (lambda t: t.drop(columns=["flops"]), "gemm rows need column(s) flops"),
    (lambda t: t.assign(batch=t["batch"].where(t.index != 30, -4)), "row 32: batch -4"),
    (lambda t: t.assign(time_s=t["time_s"].astype(object).where(t.index != 20, "abc")),
     "row 22: time_s abc: expected a positive number"),
    # An infinite time is no timing.
    (lambda t: t.assign(time_s=t["time_s"].astype(object).where(t.index != 20, "1e400")),
     "row 22: time_s inf: expected a positive number"),
])
def test_a_bad_timings_csv_gets_one_line_naming_file_and_row(tmp_path, spoil, message):
    csv = tmp_path / "timings.csv"
    spoil(synthetic_timings(2e-4, 1.3e-6, 7.5e-9, {16: 1.1}, noise=0.0)).to_csv(csv,
                                                                                index=False)
    proc = subprocess.run([sys.executable, "-m", "gpu_validate", "--from-csv", str(csv),
                           "--out", str(tmp_path / "cal")], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"gpu_validate: error: {csv}: ")
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "cal" / "calibration.yaml").exists()


@pytest.mark.parametrize(("name", "content", "message"), [
    ("missing.csv", None, "no such file"),
    ("folder", "folder", "is a directory"),
    ("binary.csv", b"\xff\xfe\x00kind", "not UTF-8 text (byte 0xff at 0)"),
    ("empty.csv", b"", "No columns to parse from file"),
])
def test_a_timings_file_that_cannot_be_read_gets_one_line(tmp_path, name, content, message):
    path = tmp_path / name
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "gpu_validate", "--from-csv", str(path),
                           "--out", str(tmp_path / "cal")], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    assert proc.returncode == 2
    assert proc.stderr == (f"gpu_validate: error: {path}: {message}; expected a timings.csv "
                           "written by gpu_validate\n")


def test_gpu_side_runs_with_only_numpy_pandas_yaml_matplotlib(tmp_path):
    """A lent GPU machine has CuPy and the scientific stack but no simpy or pydantic, and
    nothing can be installed there: ``python -m gpu_validate`` must run from the source tree
    without them."""
    timings = synthetic_timings(2e-4, 1.3e-6, 7.5e-9, {16: 1.1}, noise=0.0)
    timings.to_csv(tmp_path / "timings.csv", index=False)
    code = f"""
import runpy, sys
class NotOnTheDevice:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {{"simpy", "pydantic", "pyarrow", "tqdm", "ray"}}:
            raise ImportError(name + " is not on the device image")
sys.meta_path.insert(0, NotOnTheDevice())
import gpu_validate.harness, gpu_validate.correctness, gpu_validate.emulation
sys.argv = ["gpu_validate", "--from-csv", {str(tmp_path / "timings.csv")!r},
            "--out", {str(tmp_path / "cal")!r}]
runpy.run_module("gpu_validate", run_name="__main__")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    assert Calibration.load(tmp_path / "cal" / "calibration.yaml").model == "llama-2-7b"


@pytest.mark.gpu
def test_kernels_on_the_gpu_match_float64():
    ok, reason = cuda_status()
    if not ok:
        pytest.skip(reason)
    from gpu_validate.harness import Kernels

    table = check_correctness(Kernels())
    assert (table["unwritten"] == 0).all()
    assert table["paged_equals_contiguous"].all()
    assert table[["rel_error_contiguous", "rel_error_paged"]].max().max() <= MAX_RELATIVE_ERROR
