"""Engine benchmark: ``kvsim bench`` (or ``python -m sim.bench``).

A ShareGPT-like workload — lognormal prompts (mean 161) and outputs (mean 338), Poisson
arrivals faster than the GPU can serve, so the KV pool stays full — on paged-16 with prefix
caching, Llama-2-7B on A100-80G. Each size runs in a fresh process so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

DEFAULT_SIZES = [10_000, 100_000]  # request counts when --sizes is not given
RATE_REQ_S = 12.0  # above the ≈10 req/s this setup sustains: the queue never drains


def bench_scenario(num_requests: int, mode: str = "jump") -> dict:
    """The benchmark scenario for ``num_requests`` requests."""
    return {
        "name": f"bench-{num_requests}",
        "model": "llama-2-7b",
        "gpu": "a100-80g",
        "workload": {
            "arrival": {"process": "poisson", "rate": RATE_REQ_S},
            "prompt_len": {"dist": "lognormal", "mean": 161, "sigma": 1.0, "max": 4000},
            "output_len": {"dist": "lognormal", "mean": 338, "sigma": 1.0, "max": 4000},
        },
        "systems": [{"name": "paged-16",
                     "allocator": {"kind": "paged", "block_size": 16, "prefix_caching": True}}],
        "stop": {"num_requests": num_requests},
        "engine": {"mode": mode, "sample_interval_s": 1.0},
    }


def run_one(num_requests: int, mode: str) -> dict:
    """Run one size in this process and return its figures."""
    from sim.engine import run_scenario
    from sim.scenario import scenario_from_dict

    scenario = scenario_from_dict(bench_scenario(num_requests, mode))
    start = time.perf_counter()
    result = run_scenario(scenario)
    wall = time.perf_counter() - start
    summary = result.systems["paged-16"].summary
    tokens = summary["total_tok_s"] * summary["makespan_s"]
    return {
        "requests": num_requests,
        "wall_s": wall,
        "sim_req_per_wall_s": num_requests / wall,
        "sim_tok_per_wall_s": tokens / wall,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "simulated_s": summary["makespan_s"],
        "preemptions": summary["preemptions"],
        "steps": summary["steps"],
    }


def request_counts(text: str) -> list[int]:
    """``--sizes``: comma-separated positive request counts (an argparse type)."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive request counts such as 10000,100000, "
            f"got {text!r}")
    return counts


def main(sizes: list[int] | None = None, mode: str = "jump") -> int:
    from sim import CORE

    counts = sizes or DEFAULT_SIZES
    print(f"kvsim bench: ShareGPT-like (prompt≈161, output≈338, lognormal), Poisson "
          f"{RATE_REQ_S:g} req/s, paged-16 + prefix cache, llama-2-7b on a100-80g, mode {mode}; "
          f"{CORE.describe()}")
    header = (f"{'requests':>10}{'wall s':>10}{'req/s':>10}{'tok/s':>12}{'RSS MiB':>10}"
              f"{'sim s':>10}{'preempt':>10}{'steps':>10}")
    print(header)
    for count in counts:
        proc = subprocess.run(
            [sys.executable, "-m", "sim.bench", "--one", str(count), "--mode", mode],
            capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"},
            check=False)
        if proc.returncode:
            print(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed",
                  file=sys.stderr)
            return 1
        r = json.loads(proc.stdout)
        print(f"{r['requests']:>10,}{r['wall_s']:>10.2f}{r['sim_req_per_wall_s']:>10,.0f}"
              f"{r['sim_tok_per_wall_s']:>12,.0f}{r['peak_rss_mib']:>10,.0f}"
              f"{r['simulated_s']:>10,.0f}{r['preemptions']:>10,}{r['steps']:>10,}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", type=int, help="run a single size here and print JSON")
    parser.add_argument("--sizes", type=request_counts, default=DEFAULT_SIZES)
    parser.add_argument("--mode", choices=["jump", "step"], default="jump")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.mode)))
    else:
        sys.exit(main(args.sizes, args.mode))
