#!/usr/bin/env bash
# The whole GPU calibration in one call, from the source tree with no install: a lent device
# machine has CuPy, numpy, pandas, PyYAML and matplotlib but can install nothing, and
# `python -m gpu_validate` needs no more.
#
#     bash gpu_validate/on_device.sh OUT_DIR [more python -m gpu_validate arguments]
#
# Writes OUT_DIR/environment.txt (date, nvidia-smi, versions), OUT_DIR/ptxas.txt (registers,
# stack frame, spills of both entry points), OUT_DIR/log.txt, and under OUT_DIR/calibration/
# correctness.csv, timings.csv (rewritten after every point, so a run cut short keeps what it
# measured), fit_points.csv, calibration.yaml and fit.png. The summary is printed last.
# Timing goes on even if the correctness check fails (--keep-going); the exit status is
# still 1 then.
set -u
out=${1:?usage: bash gpu_validate/on_device.sh OUT_DIR [ARGS...]}
shift
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2  # absolute: we change folder next
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python3}
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi
    "$python" -c 'import sys, cupy, numpy, pandas, matplotlib, yaml
print("python", sys.version.split()[0], "cupy", cupy.__version__, "numpy", numpy.__version__,
      "pandas", pandas.__version__, "matplotlib", matplotlib.__version__)'
} >"$out/environment.txt" 2>&1
if command -v nvcc >/dev/null 2>&1; then
    nvcc -cubin -arch=native --std=c++17 -Xptxas -v -o "$out/decode_attention.cubin" \
        gpu_validate/decode_attention.cu >"$out/ptxas.txt" 2>&1
fi
"$python" -m gpu_validate --out "$out/calibration" --keep-going "$@" 2>&1 | tee "$out/log.txt"
exit "${PIPESTATUS[0]}"
