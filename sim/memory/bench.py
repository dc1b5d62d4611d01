"""Allocator microbenchmark: ``python -m sim.memory.bench [--tokens N]``.

Drives each allocator through the life of many requests — admit, write the prompt, decode one
token per call, free — with up to ``--concurrency`` live at once and a shared system prompt on
a third of them, and prints operations per second. No engine, no timing model: only the
memory bookkeeping the engine pays for.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from sim import CORE
from sim.memory import ContiguousAllocator, KVAllocator, PagedAllocator, SeqSpec


def _workload(total_tokens: int, seed: int) -> list[SeqSpec]:
    rng = np.random.default_rng(seed)
    specs: list[SeqSpec] = []
    written = 0
    while written < total_tokens:
        prompt = int(np.clip(rng.lognormal(np.log(161) - 0.5, 1.0), 4, 2048))
        output = int(np.clip(rng.lognormal(np.log(338) - 0.5, 1.0), 1, 2048))
        seq_id = len(specs)
        own = prompt + output
        segments: tuple[tuple[int, int], ...] = ((seq_id + 1000, own),)
        if seq_id % 3 == 0:
            segments = ((1, 256), (seq_id + 1000, own))
            prompt += 256
        specs.append(SeqSpec(seq_id, segments, prompt, prompt + output, prompt + output))
        written += prompt + output
    return specs


def run_allocator(allocator: KVAllocator, specs: list[SeqSpec], concurrency: int) -> int:
    """Replay ``specs`` through ``allocator``; return the number of operations performed."""
    ops = 0
    live: list[SeqSpec] = []
    pending = iter(specs)
    exhausted = False
    while live or not exhausted:
        while not exhausted and len(live) < concurrency:
            spec = next(pending, None)
            if spec is None:
                exhausted = True
                break
            hit = allocator.admit(spec)
            ops += 1
            if hit is None:  # pool full: let the live ones finish first
                exhausted = False
                pending = iter([spec, *pending])
                break
            allocator.append(spec.seq_id, spec.prompt_len - hit)
            ops += 1
            live.append(spec)
        still: list[SeqSpec] = []
        for spec in live:
            if allocator.num_tokens(spec.seq_id) < spec.final_len and allocator.append(
                spec.seq_id, 1
            ):
                ops += 1
                still.append(spec)
            else:
                allocator.free(spec.seq_id)
                ops += 1
        live = still
    return ops


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000, help="tokens written in all")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    specs = _workload(args.tokens, args.seed)
    tokens = sum(s.final_len for s in specs)
    pool_slots = args.concurrency * 1024
    builders: dict[str, Callable[[], KVAllocator]] = {
        "paged-16 (prefix cache, lru)": lambda: PagedAllocator(pool_slots // 16, 16),
        "paged-16 (no cache)": lambda: PagedAllocator(
            pool_slots // 16, 16, enable_prefix_caching=False
        ),
        "paged-16 (sharing_aware)": lambda: PagedAllocator(
            pool_slots // 16, 16, eviction="sharing_aware"
        ),
        "contiguous (request_max, first_fit)": lambda: ContiguousAllocator(
            pool_slots * 2, max_model_len=4096, reserve_policy="request_max"
        ),
    }
    print(f"{len(specs):,} requests, {tokens:,} tokens, concurrency {args.concurrency}; "
          f"{CORE.describe()}")
    print(f"{'allocator':<38}{'ops':>12}{'seconds':>10}{'ops/s':>14}{'tokens/s':>14}")
    for name, build in builders.items():
        allocator = build()
        start = time.perf_counter()
        ops = run_allocator(allocator, specs, args.concurrency)
        elapsed = time.perf_counter() - start
        print(f"{name:<38}{ops:>12,}{elapsed:>10.2f}{ops / elapsed:>14,.0f}"
              f"{tokens / elapsed:>14,.0f}")


if __name__ == "__main__":
    main()
