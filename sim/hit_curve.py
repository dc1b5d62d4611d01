"""Prefix-cache hit rate against cache size, for every size at once, from one pass.

A least-recently-used cache of C blocks holds exactly the C blocks used most recently, like
the top C books of a pile where every book read goes back on top. So a block found again
hits a cache of C blocks exactly when fewer than C other blocks were used since it was last
(its *stack distance*, Mattson et al. 1970): recording that distance at every reuse, in one
pass over the trace, gives the hit rate of every cache size.

The model is the ideal of the simulator's prefix cache:

- requests one after another, in trace order, each done before the next: nothing is pinned
  by a running request, so this is the most a pool of that size could reuse (the simulator,
  where running requests hold blocks, finds less);
- lookup as vLLM v1: a prompt's full blocks from block 0, stopping at the first miss, never
  the block holding the prompt's last token;
- after its lookup, every full block a request writes (its prompt and each sample's output)
  is cached, released deepest first (vLLM frees a block table in reverse), so its first
  block is the most recent.

Blocks are counted in runs: consecutive blocks that exactly the same requests contain are
always used together (a prefix tree's edge), so the pass steps over a request's few runs,
not its thousands of blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sim.memory.base import final_kv_tokens
from sim.memory.content import BlockHasher
from workloads.trace import Trace, output_segment_id


class _Fenwick:
    """Prefix sums over a growing array of weights (a binary indexed tree)."""

    __slots__ = ("tree",)

    def __init__(self, size: int) -> None:
        self.tree = [0] * (size + 1)

    def add(self, index: int, delta: int) -> None:
        tree = self.tree
        index += 1
        while index < len(tree):
            tree[index] += delta
            index += index & -index

    def prefix(self, end: int) -> int:
        """Sum of the weights at positions < ``end``."""
        tree = self.tree
        total = 0
        while end > 0:
            total += tree[end]
            end -= end & -end
        return total


@dataclass(frozen=True)
class HitCurve:
    """A trace's prefix-cache hit rate as a function of the cache size.

    Each looked-up run of blocks is kept as (``distance``, ``blocks``): a cache of C blocks
    finds its first C − ``distance`` blocks (``distance`` is the blocks used since it was;
    inf for a run never cached before). A prompt's deeper run was last used before its
    shallower one (every request holding it holds the shallower one too, and caches it
    later), so it lies deeper in the stack: a cache that misses part of a run misses every
    run after it, and the lookup's stop at the first miss needs no bookkeeping.
    """

    block_size: int
    prompt_tokens: int  # tokens looked up: every request's prompt, once
    working_set_blocks: int  # distinct blocks the trace writes
    distance: np.ndarray
    blocks: np.ndarray

    def hit_tokens(self, cache_tokens: float) -> int:
        """Prompt tokens a cache of ``cache_tokens`` finds over the whole trace."""
        capacity = math.floor(cache_tokens / self.block_size) if cache_tokens < math.inf else (
            math.inf)
        found = np.clip(capacity - self.distance, 0, self.blocks)
        return int(found.sum()) * self.block_size

    def hit_rate(self, cache_tokens: float) -> float:
        """Share of prompt tokens a cache of ``cache_tokens`` finds."""
        return self.hit_tokens(cache_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def max_hit_rate(self) -> float:
        """The hit rate of an unlimited cache."""
        return self.hit_rate(np.inf)

    @property
    def saturation_tokens(self) -> int:
        """The smallest cache that reaches the unlimited hit rate."""
        finite = np.isfinite(self.distance)
        if not finite.any():
            return 0
        return int((self.distance[finite] + self.blocks[finite]).max()) * self.block_size

    def tokens_for(self, share: float) -> int:
        """The smallest cache (a whole number of blocks) whose hit rate is at least ``share``
        of the unlimited one."""
        goal = share * self.hit_tokens(np.inf)
        lo, hi = 0, self.saturation_tokens // self.block_size  # hit(hi) >= goal
        while lo < hi:
            mid = (lo + hi) // 2
            if self.hit_tokens(mid * self.block_size) >= goal:
                hi = mid
            else:
                lo = mid + 1
        return lo * self.block_size


def _request_blocks(trace: Trace, index: int, block_size: int) -> tuple[list[int], list[int]]:
    """Hashes of every full block request ``index`` writes, prompt first and then each
    sample's own blocks; and where each sample's blocks start in that list."""
    prompt = trace.prompt_segments(index)
    prompt_len = int(trace.prompt_len[index])
    final_blocks = final_kv_tokens(prompt_len, int(trace.output_len[index])) // block_size
    hasher = BlockHasher(prompt, block_size)
    hashes = list(hasher.hash_upto(prompt_len // block_size))
    starts = []
    for sample in range(int(trace.n[index])):
        output = (output_segment_id(index, sample), int(trace.output_len[index]))
        own = hasher.copy([*prompt, output])
        starts.append(len(hashes))
        hashes += own.hash_upto(final_blocks)[prompt_len // block_size:]
    return hashes, starts


def hit_curve(trace: Trace, block_size: int = 16,
              progress: Callable[[int], None] | None = None) -> HitCurve:
    """The prefix-cache hit rate of ``trace`` against cache size (see the module's model).
    ``progress`` is told each request hashed, then each request replayed."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    count = len(trace)
    # Pass 1: every request's blocks, and how many requests contain each distinct one.
    per_request: list[np.ndarray] = []
    sample_starts: list[list[int]] = []
    for i in range(count):
        hashes, starts = _request_blocks(trace, i, block_size)
        per_request.append(np.array(hashes, dtype=np.int64))
        sample_starts.append(starts)
        if progress:
            progress(1)
    lengths = np.array([len(h) for h in per_request], dtype=np.int64)
    flat = np.concatenate(per_request) if count else np.zeros(0, np.int64)
    del per_request
    unique, block_ids, containing = np.unique(flat, return_inverse=True, return_counts=True)
    del flat, unique
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    # A run starts at block 0 and where fewer requests contain a block than its parent (a
    # request that has a block has its parent: hashes are chained). That is a property of
    # the block, so every request containing a run contains all of it.
    run_start = np.zeros(len(containing), dtype=bool)
    for i in range(count):
        ids = block_ids[offsets[i]:offsets[i + 1]]
        if not len(ids):
            continue
        run_start[ids[0]] = True
        bounds = [*sample_starts[i], len(ids)]
        for s in range(len(bounds) - 1):
            # Sample s's sequence: the prompt's blocks, then its own.
            sequence = np.concatenate([ids[:bounds[0]], ids[bounds[s]:bounds[s + 1]]])
            changes = np.flatnonzero(np.diff(containing[sequence])) + 1
            run_start[sequence[changes]] = True
    # Pass 2: replay, recording each looked-up run's stack distance.
    last_touch = np.full(len(containing), -1, dtype=np.int64)
    touches = 0
    total_runs = 0
    request_runs: list[list[tuple[int, int, int]]] = []  # (position, run id, blocks)
    for i in range(count):
        ids = block_ids[offsets[i]:offsets[i + 1]]
        firsts = np.flatnonzero(run_start[ids])  # (none where the request has no full block)
        ends = np.append(firsts[1:], len(ids))
        # (A run through the prompt and several samples' own blocks is held by this request
        # alone: all of it is used together, and only its prompt part is looked up.)
        runs = [(int(a), int(ids[a]), int(b - a))
                for a, b in zip(firsts, ends[:len(firsts)], strict=True)]
        request_runs.append(runs)
        total_runs += len(runs)
    fenwick = _Fenwick(total_runs)
    weight = 0  # blocks in the cache's stack (every distinct block written so far)
    distance: list[float] = []
    blocks: list[int] = []
    prompt_tokens = 0
    for i, runs in enumerate(request_runs):
        prompt_len = int(trace.prompt_len[i])
        prompt_tokens += prompt_len
        lookup = (prompt_len - 1) // block_size
        for position, run, size in runs:
            if position >= lookup:
                break
            size = min(size, lookup - position)
            last = int(last_touch[run])
            if last < 0:
                break  # never written before: a miss, and the lookup stops there
            # Blocks used since this run's last use, including the rest of its own request.
            dist = float(weight - fenwick.prefix(last + 1))
            distance.append(dist)
            blocks.append(size)
        # Cache what the request wrote, deepest run first: its first block is then the most
        # recent, as releasing a block table in reverse leaves it.
        for _position, run, size in reversed(runs):
            last = int(last_touch[run])
            if last >= 0:
                fenwick.add(last, -size)
            else:
                weight += size
            fenwick.add(touches, size)
            last_touch[run] = touches
            touches += 1
        if progress:
            progress(1)
    return HitCurve(
        block_size=block_size,
        prompt_tokens=prompt_tokens,
        working_set_blocks=weight,
        distance=np.array(distance, dtype=np.float64),
        blocks=np.array(blocks, dtype=np.int64),
    )
