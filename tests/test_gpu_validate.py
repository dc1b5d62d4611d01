"""gpu_validate: numpy twins of the kernel, the fit, the calibration round trip, and — on a
CUDA machine — the real kernels."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gpu_validate.fit import fit_calibration
from gpu_validate.harness import cuda_status
from gpu_validate.reference import (
    MAX_RELATIVE_ERROR,
    attention_online_fp32,
    attention_reference,
    gather_paged,
    make_inputs,
    relative_error,
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


def test_fp32_online_softmax_within_the_documented_bound():
    rng = np.random.default_rng(7)
    inputs = make_inputs(rng, seqs=3, num_heads=4, num_kv_heads=1, head_dim=128,
                         context_lens=[1, 33, 900], block_size=16)
    reference = attention_reference(inputs)
    emulated = attention_online_fp32(inputs)
    error = relative_error(emulated, reference)
    assert error <= MAX_RELATIVE_ERROR
    assert error < 1e-5  # fp32 accumulation on fp16 inputs: far inside the bound
    # Poisoning shows up: an unwritten output element cannot pass the check.
    poisoned = emulated.copy()
    poisoned[1, 2, 3] = np.nan
    assert not relative_error(np.nan_to_num(poisoned, nan=1e9), reference) <= MAX_RELATIVE_ERROR


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


@pytest.mark.gpu
def test_kernels_on_the_gpu_match_float64():
    ok, reason = cuda_status()
    if not ok:
        pytest.skip(reason)
    from gpu_validate.harness import Kernels, check_correctness

    table = check_correctness(Kernels())
    assert (table["unwritten"] == 0).all()
    assert table["paged_equals_contiguous"].all()
    assert table[["rel_error_contiguous", "rel_error_paged"]].max().max() <= MAX_RELATIVE_ERROR
