"""``python -m gpu_validate`` (also ``kvsim calibrate``): check, time, fit, write.

On a CUDA machine: compile the kernels, check them against float64, time attention and the
layer GEMMs, fit the step-time model, and write ``OUT/timings.csv``, ``OUT/correctness.csv``,
``OUT/calibration.yaml`` and ``OUT/fit.png``. Without CuPy or a device it says so and exits 3;
``--from-csv TIMINGS`` fits timings measured elsewhere (no GPU needed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

EXIT_NO_DEVICE = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_validate", description=__doc__)
    parser.add_argument("--model", default="llama-2-7b", help="model preset (default "
                        "llama-2-7b)")
    parser.add_argument("--out", default="calibration", help="output folder")
    parser.add_argument("--quick", action="store_true", help="a smaller timing sweep")
    parser.add_argument("--from-csv", help="fit this timings.csv instead of measuring")
    args = parser.parse_args(argv)

    from gpu_validate.fit import FitError, fit_calibration, plot_fit
    from sim.presets import lookup_model

    try:
        model = lookup_model(args.model)
    except KeyError as exc:
        print(f"gpu_validate: error: {exc.args[0]}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.from_csv:
        try:
            timings = pd.read_csv(args.from_csv)
        except (FileNotFoundError, pd.errors.ParserError) as exc:
            print(f"gpu_validate: error: {args.from_csv}: {exc}", file=sys.stderr)
            return 2
        device = str(timings["device"].iloc[0]) if "device" in timings else ""
    else:
        from gpu_validate.harness import Kernels, check_correctness, cuda_status, run_timings

        ok, device = cuda_status()
        if not ok:
            print(f"gpu_validate: {device}; nothing was timed. Fit existing timings with "
                  "--from-csv FILE.", file=sys.stderr)
            return EXIT_NO_DEVICE
        kernels = Kernels()
        out.mkdir(parents=True, exist_ok=True)
        correctness = check_correctness(kernels)
        correctness.to_csv(out / "correctness.csv", index=False)
        print(correctness.to_string(index=False))
        if not correctness["ok"].all():
            print("gpu_validate: the kernel failed its correctness check", file=sys.stderr)
            return 1
        timings = run_timings(kernels, model, quick=args.quick, device=device)
        timings.to_csv(out / "timings.csv", index=False)
    try:
        result = fit_calibration(timings, model, device=device)
    except FitError as exc:
        print(f"gpu_validate: error: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    result.calibration.dump(out / "calibration.yaml")
    result.points.to_csv(out / "fit_points.csv", index=False)
    plot_fit(result, out / "fit.png")
    fit = result.calibration.fit
    print(f"coefficients: {result.calibration.coefficients}")
    print(f"rho: {result.calibration.rho}")
    print(f"held-out MAPE {fit['mape'] * 100:.2f}%, max error {fit['max_error'] * 100:.2f}% "
          f"({fit['held_out_points']} of {fit['points']} points held out)")
    print(f"wrote {out / 'calibration.yaml'} (use it as timing: {{calibration: FILE}})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
