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


def device_label(timings: pd.DataFrame) -> str:
    """"NAME, driver X, DATE" from a timing table's columns (what is there of them)."""
    first = timings.iloc[0] if len(timings) else {}
    parts = [str(first.get(column, "")) for column in ("device", "driver", "date")]
    parts = [p for p in parts if p and p != "nan"]
    if len(parts) == 3:
        return f"{parts[0]}, driver {parts[1]}, {parts[2]}"
    return ", ".join(parts)


def main(argv: list[str] | None = None, *, prog: str = "python -m gpu_validate",
         name: str = "gpu_validate") -> int:
    """The command line; ``prog`` and ``name`` (the prefix of its messages) let ``kvsim
    calibrate`` present it as its own."""
    from sim.cli import CommandParser

    parser = CommandParser(prog=prog, name=name, description=__doc__.replace("``", ""),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-2-7b", help="model preset (default "
                        "llama-2-7b)")
    parser.add_argument("--out", default="calibration", help="output folder")
    parser.add_argument("--quick", action="store_true", help="a smaller timing sweep")
    parser.add_argument("--keep-going", action="store_true",
                        help="time and fit even when the correctness check fails (the exit "
                        "status is still 1): one run then shows both")
    parser.add_argument("--from-csv", help="fit this timings.csv instead of measuring")
    args = parser.parse_args(argv)

    from gpu_validate.fit import FitError, fit_calibration, plot_fit
    from gpu_validate.harness import model_problem
    from sim.presets import lookup_model

    try:
        model = lookup_model(args.model)
    except KeyError as exc:
        print(f"{name}: error: {exc.args[0]}", file=sys.stderr)
        return 2
    problem = model_problem(model)
    if problem:
        print(f"{name}: error: --model: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out)
    status = 0
    if args.from_csv:
        try:
            timings = pd.read_csv(args.from_csv)
        except FileNotFoundError:
            problem = "no such file"
        except IsADirectoryError:
            problem = "is a directory"
        except UnicodeDecodeError as exc:
            problem = f"not UTF-8 text (byte {exc.object[exc.start]:#04x} at {exc.start})"
        except (pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
            problem = str(exc).strip().splitlines()[0]
        else:
            problem = ""
        if problem:
            print(f"{name}: error: {args.from_csv}: {problem}; expected a timings.csv "
                  "written by gpu_validate", file=sys.stderr)
            return 2
    else:
        from gpu_validate.correctness import check_correctness
        from gpu_validate.harness import Kernels, cuda_status, run_timings

        ok, device = cuda_status()
        if not ok:
            print(f"{name}: {device}; nothing was timed. Fit existing timings with "
                  "--from-csv FILE.", file=sys.stderr)
            return EXIT_NO_DEVICE
        out.mkdir(parents=True, exist_ok=True)
        kernels = Kernels()
        correctness = check_correctness(kernels)
        correctness.to_csv(out / "correctness.csv", index=False)
        print(correctness.to_string(index=False), flush=True)
        worst = correctness[["rel_error_contiguous", "rel_error_paged"]].max().max()
        print(f"max relative error against float64: {worst:.2e}", flush=True)
        if not correctness["ok"].all():
            print(f"{name}: the kernel failed its correctness check "
                  f"(see {out / 'correctness.csv'})", file=sys.stderr)
            if not args.keep_going:
                return 1
            status = 1
        timings = run_timings(kernels, model, quick=args.quick, device=device,
                              partial_csv=out / "timings.csv",
                              log=lambda line: print(line, flush=True))
        timings.to_csv(out / "timings.csv", index=False)
    try:
        result = fit_calibration(timings, model, device=device_label(timings))
    except FitError as exc:
        source = args.from_csv or out / "timings.csv"
        print(f"{name}: error: {source}: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    result.calibration.dump(out / "calibration.yaml")
    result.points.to_csv(out / "fit_points.csv", index=False)
    plot_fit(result, out / "fit.png")
    print_summary(timings, result)
    print(f"wrote {out / 'calibration.yaml'} (use it as timing: {{calibration: FILE}})")
    return status


def print_summary(timings: pd.DataFrame, result) -> None:  # type: ignore[no-untyped-def]
    """The figures a calibration is judged by: bandwidth, ρ per block size, held-out error."""
    attention = timings[timings["kind"] == "attention"]
    if len(attention) and "gbps" in attention:
        best = attention.groupby("layout")["gbps"].max()
        copy = f" of {timings['copy_gbps'].iloc[0]:.0f} GB/s copy" if "copy_gbps" in timings \
            else ""
        print("best attention bandwidth: " + ", ".join(
            f"{layout} {gbps:.0f} GB/s" for layout, gbps in best.items()) + copy)
    calibration = result.calibration
    print("coefficients (s): " + ", ".join(
        f"{k}={v:.3g}" for k, v in calibration.coefficients.items()))
    print("rho (paged/contiguous): " + ", ".join(
        f"{bs}: {r:.3f}" for bs, r in sorted(calibration.rho.items())))
    fit = calibration.fit
    judged = "held-out" if fit["held_out_points"] else "in-sample (too few points to hold out)"
    print(f"{judged} MAPE {fit['mape'] * 100:.2f}%, max error {fit['max_error'] * 100:.2f}% "
          f"({fit['held_out_points']} of {fit['points']} points held out)")


if __name__ == "__main__":
    sys.exit(main())
