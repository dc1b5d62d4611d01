"""Sliding-window models under vLLM v1's hybrid KV cache manager: groups of block tables
over one pool, windows given back, prefix hits that need only a window, prefills that never
wait; hand-worked cases, a hypothesis state machine, and the engine."""

from __future__ import annotations

import itertools
import os
from dataclasses import fields
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from test_memory_properties import PREFIXES, PagedMachine, _prefix_of

from sim.api import load, run
from sim.engine import (
    MAX_POOL_BLOCKS,
    build_allocator,
    build_timing,
    check_pool,
    run_system,
    scenario_pool_slots,
    scenario_trace,
)
from sim.memory import AllocatorError, HybridPagedAllocator, SeqSpec
from sim.memory.base import claim_end
from sim.memory.content import BlockHasher
from sim.presets import MODEL_PRESETS, SizingError
from sim.scenario import ScenarioError
from sim.timing import StepTimeModel

ROOT = Path(__file__).resolve().parents[1]


def spec(seq_id: int, prompt: int, out: int, segment: int | None = None,
         shared: tuple[tuple[int, int], ...] = ()) -> SeqSpec:
    shared_len = sum(n for _, n in shared)
    own = segment if segment is not None else 100 + seq_id
    return SeqSpec(seq_id, (*shared, (own, prompt - shared_len + out)), prompt, prompt + out,
                   prompt + out)


def test_layers_group_as_vllm_groups_them():
    groups = {name: MODEL_PRESETS[name].kv_cache_groups()
              for name in ("gemma-3-27b", "gemma-2-9b", "mistral-7b-v0.1", "llama-3-8b",
                           "qwen3-next-80b-a3b")}
    # Gemma-3: 10 full and 52 sliding layers; groups of 10, the last sliding one padded.
    # Qwen3-Next: 12 full-attention and 36 state-space layers; groups of 12.
    assert groups == {"gemma-3-27b": (10, 1, 6, 0), "gemma-2-9b": (21, 1, 1, 0),
                      "mistral-7b-v0.1": (32, 0, 1, 0), "llama-3-8b": (32, 1, 0, 0),
                      "qwen3-next-80b-a3b": (12, 1, 0, 3)}


def test_a_sliding_window_table_keeps_only_what_its_window_sees():
    # One sliding group, a 32-token window, 16-token blocks, no prefix cache.
    alloc = HybridPagedAllocator(100, 16, full_groups=0, sliding_groups=1, sliding_window=32,
                                 enable_prefix_caching=False)
    alloc.admit(spec(0, 100, 20))
    # An unchunked prefill may hold the whole prompt: 7 blocks promised.
    assert alloc.num_free_blocks == 93
    assert alloc.append(0, 100)
    assert alloc.block_tables(0) == [[0, 1, 2, 3, 4, 5, 6]]
    assert alloc.num_free_blocks == 93  # promise used up, none left over
    # The first generated token (position 100) sees positions 69..100: blocks 4, 5, 6.
    assert alloc.append(0, 1)
    assert alloc.block_tables(0)[0][:4] == [None] * 4
    assert alloc.num_free_blocks == 97
    # Nineteen decode steps at once: token 119 sees 88..119, blocks 5, 6 and a new 7.
    assert alloc.append(0, 19)
    assert alloc.block_tables(0)[0][:6] == [None] * 5 + [5]
    snap = alloc.snapshot()
    assert snap.token == 120 - 5 * 16  # blocks 5, 6 full and 8 tokens in block 7
    assert snap.internal == 8 * 16 - 120
    assert snap.reserved == 0 and snap.free == (100 - 3) * 16
    alloc.check_invariants()
    alloc.free(0)
    assert alloc.num_free_blocks == 100


def hybrid(num_blocks: int) -> HybridPagedAllocator:
    """One full-attention group, one sliding (32 tokens), 16-token blocks and chunks."""
    return HybridPagedAllocator(num_blocks, 16, full_groups=1, sliding_groups=1,
                                sliding_window=32, prefill_chunk_tokens=16)


def run_through(alloc: HybridPagedAllocator, s: SeqSpec) -> None:
    """Admit ``s``, prefill it chunk by chunk, decode it a token a step, free it."""
    hit = alloc.admit(s)
    assert hit is not None
    chunk = alloc.prefill_chunk_tokens or s.prompt_len
    for start in range(hit, s.prompt_len, chunk):
        assert alloc.append(s.seq_id, min(chunk, s.prompt_len - start))
    for _ in range(s.final_len - s.prompt_len):
        assert alloc.append(s.seq_id, 1)
    alloc.check_invariants()
    alloc.free(s.seq_id)


def spec_hashes(s: SeqSpec) -> list[int]:
    return BlockHasher(s.segments, 16).hash_upto(s.prompt_len // 16)


def evict_oldest(alloc: HybridPagedAllocator, blocks: int) -> None:
    """Evict the ``blocks`` least recently used cached blocks: admit (then free) a prompt
    that takes every unhashed block and that many more."""
    unhashed = alloc.pool.num_free - alloc.pool.num_cached_free
    filler = spec(99, 16 * (unhashed + blocks) - 1, 1)
    assert alloc.admit(filler) == 0
    alloc.free(99)


SHARED = ((1, 100),)


def test_a_prefix_hit_needs_only_the_sliding_window_before_it():
    # Request A (100 shared tokens + 10) runs and leaves its blocks cached. The least
    # recently used are the sliding group's first four, given back while A ran.
    alloc = hybrid(40)
    run_through(alloc, spec(0, 100, 10, shared=SHARED))
    hashes = spec_hashes(spec(9, 100, 0, shared=SHARED))
    evict_oldest(alloc, 4)
    cached = [[alloc.pool.lookup(alloc._key(h, group)) is not None for h in hashes]
              for group in (0, 1)]
    assert cached == [[True] * 6, [False] * 4 + [True] * 2]
    # B shares A's 100 tokens: the lookup covers 6 blocks (99 // 16), and the sliding group
    # needs only the cdiv(32 - 1, 16) = 2 blocks before the hit, 4 and 5: cached.
    b = spec(2, 100, 5, shared=SHARED)
    assert alloc.lookup(b) == 96
    assert alloc.admit(b) == 96
    assert alloc.block_tables(2)[1] == [None] * 4 + [
        alloc.pool.lookup(alloc._key(hashes[i], 1)).block_id for i in (4, 5)]
    alloc.check_invariants()


def test_no_hit_where_the_window_before_the_full_groups_hit_is_gone():
    alloc = hybrid(40)
    run_through(alloc, spec(0, 100, 10, shared=SHARED))
    # Sliding blocks 0-3, then the full group's 5, 4, 3, 2 (a table is freed deepest first).
    evict_oldest(alloc, 8)
    hashes = spec_hashes(spec(9, 100, 0, shared=SHARED))
    assert [alloc.pool.lookup(h) is not None for h in hashes] == [True] * 2 + [False] * 4
    # The full group finds blocks 0 and 1; the sliding group lacks both: nothing.
    assert alloc.lookup(spec(2, 100, 5, shared=SHARED)) == 0


def test_a_short_run_from_block_zero_is_a_hit_shorter_than_a_window():
    # A window of 64 tokens needs 4 blocks before a hit; a prompt sharing 2 blocks from
    # block 0 still hits them (vLLM keeps a run from the start, however short).
    alloc = HybridPagedAllocator(60, 16, full_groups=1, sliding_groups=2, sliding_window=64)
    shared = ((1, 32),)
    run_through(alloc, spec(0, 40, 4, shared=shared))
    assert alloc.admit(spec(1, 50, 4, shared=shared)) == 32
    alloc.check_invariants()


def test_a_chunked_prefill_never_waits_for_what_others_take():
    # 128-token chunks, a 32-token window: a sliding group holds at most
    # cdiv(31 + 128, 16) + 1 = 11 blocks during a prefill, so admission promises 2 × 11.
    alloc = HybridPagedAllocator(60, 16, full_groups=1, sliding_groups=2, sliding_window=32,
                                 prefill_chunk_tokens=128, enable_prefix_caching=False)
    long = spec(0, 500, 10)
    assert alloc.admit(long) == 0
    assert alloc.num_free_blocks == 60 - 32 - 22  # full group: 501 tokens; 22 promised
    # Another sequence grows into everything not promised, and no further.
    other = spec(1, 15, 200)
    assert alloc.admit(other) == 0
    grown = 0
    while alloc.append(1, 1):
        grown += 1
    assert 15 < grown < 200  # past its prompt, then stopped: memory is short
    # Every chunk of the long prompt still gets its blocks, and then its first token.
    for _ in range(3):
        assert alloc.append(0, 128)
        alloc.check_invariants()
    assert alloc.append(0, 500 - 384)
    assert alloc.append(0, 1)
    assert alloc.num_free_blocks > 0  # its prompt's old blocks are back in the pool
    alloc.check_invariants()
    # Too much memory for both at once is refused whole: nothing changes.
    assert alloc.admit(spec(2, 400, 1)) is None


def test_samples_share_the_prompts_blocks_and_copy_the_tail_they_write():
    # A 20-token prompt over 16-token blocks, a 32-token window: block 0 full, block 1
    # holding 4 tokens, in both groups. Three samples fork it: they take no block; each
    # of the first two to write copies block 1 in both groups, the last writes the original.
    alloc = hybrid(20)
    alloc.admit(spec(0, 20, 30))
    alloc.append(0, 20)
    free = alloc.num_free_blocks
    for child in (1, 2):
        assert alloc.fork(0, spec(child, 20, 30))
    assert alloc.num_free_blocks == free and alloc.block_tables(1) == alloc.block_tables(0)
    alloc.check_invariants()
    before = alloc.snapshot()
    assert before.token == 2 * 20  # shared: written once, in two groups
    for seq_id in (0, 1, 2):
        assert alloc.append(seq_id, 1)
        alloc.check_invariants()
    assert alloc.num_cow_copies == 4 and alloc.num_free_blocks == free - 4
    tails = {alloc.block_tables(seq_id)[group][1] for seq_id in (0, 1, 2) for group in (0, 1)}
    assert len(tails) == 6  # each sample's own, in each group
    full = {alloc.block_tables(seq_id)[0][0] for seq_id in (0, 1, 2)}
    assert len(full) == 1  # the prompt's full block, shared by all
    # The window passes block 0 at token 47: each sample gives its reference back, and the
    # block leaves use with the last (cached, as a finished request's blocks are).
    cached = alloc.snapshot().cached
    for seq_id in (0, 1, 2):
        assert alloc.append(seq_id, 27)
        assert alloc.block_tables(seq_id)[1][0] is None
        assert alloc.snapshot().cached == cached + 16 * (seq_id == 2)
    # Block 0 of the full group written once, then 32 tokens each in both groups.
    assert alloc.snapshot().token == 16 + 3 * 32 + 3 * 32
    alloc.check_invariants()


def test_samples_fit_a_pool_as_large_as_their_peak_and_no_smaller():
    # A 20-token prompt and 30 tokens out (4 blocks) in 3 samples: the full group holds the
    # prompt's full block once and 3 of its own each; each window 3 at most (32 tokens and
    # the block being written). 10 + 9 blocks at the end, decoding in step.
    s = spec(0, 20, 30)
    assert hybrid(19).can_admit_ever(s, 3) and not hybrid(18).can_admit_ever(s, 3)
    alloc = hybrid(19)
    alloc.admit(s)
    alloc.append(0, 16)
    alloc.append(0, 4)
    for child in (1, 2):
        alloc.fork(0, spec(child, 20, 30))
    for _ in range(30):
        assert alloc.appends_fit([0, 1, 2], 1)
        for seq_id in (0, 1, 2):
            assert alloc.append(seq_id, 1)
        alloc.check_invariants()
    assert alloc.num_free_blocks == 0


def test_appends_fit_counts_a_block_the_last_sample_to_give_it_back_frees():
    # Every layer slides over 2 tokens: the step computing token 17 gives block 0 back.
    # Two samples share block 0; another request holds its own; 2 blocks are free. Each
    # appends tokens 16 and 17 in turn, taking a block: the second sample's giving block 0
    # back frees it for the other request.
    alloc = HybridPagedAllocator(4, 16, full_groups=0, sliding_groups=1, sliding_window=2)
    for seq_id in (0, 2):
        alloc.admit(spec(seq_id, 16, 4))
        alloc.append(seq_id, 16)
    alloc.fork(0, spec(1, 16, 4))
    assert alloc.num_free_blocks == 2
    assert alloc.appends_fit([0, 1, 2], 2)
    assert all([alloc.append(seq_id, 2) for seq_id in (0, 1, 2)])
    alloc.check_invariants()


def test_a_fork_needs_the_prompt_written_and_no_lookahead_held():
    alloc = hybrid(20)
    alloc.admit(spec(0, 20, 30))
    alloc.append(0, 10)
    with pytest.raises(AllocatorError, match="cannot fork before its prompt is written"):
        alloc.fork(0, spec(1, 20, 30))
    alloc.append(0, 10, lookahead=20)
    with pytest.raises(AllocatorError, match="holds lookahead slots"):
        alloc.fork(0, spec(1, 20, 30))


class HybridMachine(PagedMachine):
    """Random admissions, prefills, decode steps, frees and re-admissions, driven as the
    scheduler drives them (prompt chunks, then a token a step, or several at once as lazy
    decode syncs them), against a reference of tokens and the blocks each window needs."""

    block_size = 4
    swaps_groups = False  # (swapping is not modelled under the hybrid manager)
    full_groups = 1
    sliding_groups = 2
    window = 10
    chunk: int | None = 12
    num_blocks = 70
    caching = True
    state_groups = 0  # groups keeping one state block a sequence
    state_slots = 4  # slots of it the state fills
    states_per_group = 1  # 1 + k under speculative decoding: a state a draft position
    every_state = False  # mode "all": a state kept at every boundary, inside chunks too

    @property
    def state_blocks(self) -> int:
        """Blocks a sequence's states take."""
        return self.state_groups * self.states_per_group

    def build(self):
        # First token of each sequence's last step (freed ones stay: ids are never reused).
        self.last_start: dict[int, int] = {}
        self.drafts_held: dict[int, int] = {}  # the furthest slot a speculative step held
        return HybridPagedAllocator(self.num_blocks, self.block_size,
                                    full_groups=self.full_groups,
                                    sliding_groups=self.sliding_groups,
                                    sliding_window=self.window, prefill_chunk_tokens=self.chunk,
                                    enable_prefix_caching=self.caching,
                                    state_groups=self.state_groups,
                                    state_slots=self.state_slots,
                                    states_per_group=self.states_per_group,
                                    cache_every_state=self.every_state)

    def _admitted(self, spec: SeqSpec, hit: int | None) -> None:
        if hit is not None:
            assert 0 <= hit < spec.prompt_len and hit % self.block_size == 0
            self.specs[spec.seq_id] = spec
            self.tokens[spec.seq_id] = hit
            self.last_start[spec.seq_id] = hit

    @rule(prefix_idx=st.integers(0, len(PREFIXES) - 1), prompt=st.integers(1, 60),
          extra=st.integers(0, 30), out=st.integers(1, 60), first_chunk=st.integers(1, 60))
    def admit(self, prefix_idx, prompt, extra, out, first_chunk):
        self._admit(self.new_spec(prefix_idx, prompt, extra, out), first_chunk)

    @precondition(lambda self: self._readmittable())
    @rule(data=st.data(), first_chunk=st.integers(1, 60))
    def readmit(self, data, first_chunk):
        old = data.draw(st.sampled_from(self._readmittable()))
        s = SeqSpec(self.next_id, old.segments, old.prompt_len, old.final_len, old.max_len)
        self.next_id += 1
        self._admit(s, first_chunk)

    def _admit(self, s: SeqSpec, first_chunk: int) -> None:
        # Per chunk, as the scheduler claims: within its token budget.
        max_new = min(first_chunk, self.chunk or first_chunk) if self.per_chunk else None
        hit = self.allocator.admit(s, max_new)
        self._admitted(s, hit)
        if hit is not None:
            self.claims[s.seq_id] = claim_end(s, hit, max_new)

    @precondition(lambda self: self.specs)
    @rule(data=st.data(), steps=st.integers(1, 6))
    def append(self, data, steps):
        seq_id = data.draw(st.sampled_from(sorted(self.specs)))
        s, n = self.specs[seq_id], self.tokens[seq_id]
        claim = self.claims[seq_id]  # admission claimed (or promised) memory up to here
        if n < s.prompt_len:  # a prefill chunk: it never fails unless claimed per chunk
            chunk = min(s.prompt_len - n, self.chunk or s.prompt_len,
                        data.draw(st.integers(1, s.prompt_len - n)))
            if self.per_chunk and n < claim:  # the first chunk, as admission claimed it
                chunk = min(claim, s.prompt_len) - n
            if self.allocator.append(seq_id, chunk):
                self.tokens[seq_id] += chunk
                self.last_start[seq_id] = n
            else:
                assert n + chunk > claim, "a claimed prefill chunk found memory short"
        else:  # decode steps: no admission claimed their memory, the first token's neither
            k = min(steps, s.final_len - n)
            if k and self.allocator.append(seq_id, k):
                self.tokens[seq_id] += k
                self.last_start[seq_id] = n + k - 1

    @precondition(lambda self: self._prefilling())
    @rule(data=st.data())
    def prefill_the_rest(self, data):
        """The rest of a prompt, chunk by chunk as the scheduler writes it (so that more
        sequences decode); stops where a chunk finds memory short."""
        seq_id = data.draw(st.sampled_from(self._prefilling()))
        s = self.specs[seq_id]
        while (n := self.tokens[seq_id]) < s.prompt_len:
            chunk = min(s.prompt_len - n, self.chunk or s.prompt_len)
            if not self.allocator.append(seq_id, chunk):
                assert self.per_chunk and n + chunk > self.claims[seq_id], (
                    "a claimed prefill chunk found memory short")
                return
            self.tokens[seq_id] += chunk
            self.last_start[seq_id] = n

    @precondition(lambda self: self._prefilling())
    @rule(data=st.data())
    def arrive(self, data):
        """Prompt tokens computed elsewhere arrive (a decode replica's transfer): the
        windows hold only what the next token sees; within what admission claimed (all of
        the prompt, unless per chunk) they always fit, and a refusal changes nothing."""
        seq_id = data.draw(st.sampled_from(self._prefilling()))
        s, n = self.specs[seq_id], self.tokens[seq_id]
        count = data.draw(st.integers(1, s.prompt_len - n))
        before, tables = self.allocator.snapshot(), self.allocator.block_tables(seq_id)
        if self.allocator.arrive(seq_id, count):
            self.tokens[seq_id] += count
            self.last_start[seq_id] = max(self.last_start[seq_id], n + count)
        else:
            assert self.per_chunk and n + count > self.claims[seq_id], (
                "tokens within admission's claim found memory short")
            assert self.allocator.snapshot() == before
            assert self.allocator.block_tables(seq_id) == tables

    def _prefilling(self) -> list[int]:
        return sorted(seq_id for seq_id, s in self.specs.items()
                      if self.tokens[seq_id] < s.prompt_len)

    def _decoding(self) -> list[int]:
        """Sequences past their prompt with a token still to write."""
        return sorted(seq_id for seq_id, s in self.specs.items()
                      if s.prompt_len <= self.tokens[seq_id] < s.final_len)

    @precondition(lambda self: self._decoding())
    @rule(data=st.data(), lazy=st.integers(0, 5), kept=st.integers(1, 4),
          lookahead=st.integers(0, 9))
    def append_with_lookahead(self, data, lazy, kept, lookahead):
        """Speculative decode steps as the scheduler syncs them: ``lazy`` steps' tokens,
        then a step from the token after them keeping ``kept`` and holding ``lookahead``
        slots past them (its drafts): its windows give back what its first token cannot
        see, every table holds its drafts' slots; refused, nothing changes."""
        seq_id = data.draw(st.sampled_from(self._decoding()))
        s, n = self.specs[seq_id], self.tokens[seq_id]
        count = min(lazy + kept, s.final_len - n)
        if lazy >= count:
            return  # it ends before that step
        before, tables = self.allocator.snapshot(), self.allocator.block_tables(seq_id)
        if self.allocator.append(seq_id, count, lookahead, step_start=n + lazy):
            self.tokens[seq_id] += count
            self.last_start[seq_id] = n + lazy
            if lookahead:
                self.drafts_held[seq_id] = max(self.drafts_held.get(seq_id, 0),
                                               min(n + count + lookahead, s.final_len))
        else:
            assert self.allocator.snapshot() == before
            assert self.allocator.block_tables(seq_id) == tables

    @precondition(lambda self: self.specs)
    @rule(data=st.data())
    def a_step_starts_among_its_tokens(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.specs)))
        n = self.tokens[seq_id]
        if n >= self.specs[seq_id].final_len:
            return
        with pytest.raises(AllocatorError, match=f"cannot start at token {n + 1}"):
            self.allocator.append(seq_id, 1, step_start=n + 1)

    @precondition(lambda self: self._decoding())
    @rule(data=st.data(), limit=st.integers(1, 12))
    def append_to_several(self, data, limit):
        """max_uniform_append: that many tokens each, one a step, appended in turn, fit;
        no more up to the limit does."""
        seq_ids = data.draw(st.lists(st.sampled_from(self._decoding()), min_size=1,
                                     unique=True))
        limit = min([limit] + [self.specs[s].final_len - self.tokens[s] for s in seq_ids])
        fit = self.allocator.max_uniform_append(seq_ids, limit)
        assert 0 <= fit <= limit
        assert not any(self.allocator.appends_fit(seq_ids, k) for k in range(fit + 1, limit + 1))
        for seq_id in seq_ids:
            assert self.allocator.append(seq_id, fit)
            if fit:
                self.tokens[seq_id] += fit
                self.last_start[seq_id] = self.tokens[seq_id] - 1

    @precondition(lambda self: self._decoding())
    @rule(data=st.data(), lazy=st.integers(0, 5), kept=st.integers(1, 4),
          lookahead=st.integers(0, 9))
    def append_to_samples(self, data, lazy, kept, lookahead):
        """Samples decoding in step, as the scheduler syncs them: appends_fit says whether
        appending to each in turn (``lazy`` steps, then a step from the token after them
        keeping ``kept`` and holding ``lookahead`` slots) succeeds, and it does, or one of
        them is refused."""
        n = data.draw(st.sampled_from(sorted({self.tokens[s] for s in self._decoding()})))
        peers = [s for s in self._decoding() if self.tokens[s] == n]
        seq_ids = data.draw(st.lists(st.sampled_from(peers), min_size=1, unique=True))
        count = min([lazy + kept] + [self.specs[s].final_len - n for s in seq_ids])
        if lazy >= count:
            return  # one of them ends before that step
        fits = self.allocator.appends_fit(seq_ids, count, lookahead, n + lazy)
        written = []
        for seq_id in seq_ids:
            ok = self.allocator.append(seq_id, count, lookahead, step_start=n + lazy)
            written.append(ok)
            if ok:
                self.tokens[seq_id] += count
                self.last_start[seq_id] = n + lazy
                if lookahead:
                    self.drafts_held[seq_id] = max(
                        self.drafts_held.get(seq_id, 0),
                        min(n + count + lookahead, self.specs[seq_id].final_len))
        assert all(written) == fits

    @precondition(lambda self: self.specs)
    @rule(data=st.data(), out=st.integers(1, 40))
    def fork(self, data, out):
        """A sample forked from a sequence past its prompt (refused while it reads its
        prompt, or holds slots past its tokens)."""
        parent = self.specs[data.draw(st.sampled_from(sorted(self.specs)))]
        n = max(self.tokens[parent.seq_id], parent.prompt_len)
        child = SeqSpec(self.next_id, (*_prefix_of(parent.segments, n),
                                       (100 + self.next_id, out)),
                        parent.prompt_len, n + out, n + out)
        n = self.tokens[parent.seq_id]
        bs = self.block_size
        if n < parent.prompt_len:
            with pytest.raises(AllocatorError, match="before its prompt is written"):
                self.allocator.fork(parent.seq_id, child)
            return
        if -(-self.drafts_held.get(parent.seq_id, 0) // bs) > -(-n // bs):
            with pytest.raises(AllocatorError, match="holds lookahead slots"):
                self.allocator.fork(parent.seq_id, child)
            return
        self.next_id += 1
        assert self.allocator.fork(parent.seq_id, child)
        self.specs[child.seq_id] = child
        self.tokens[child.seq_id] = n
        self.claims[child.seq_id] = self.claims[parent.seq_id]
        self.last_start[child.seq_id] = self.last_start[parent.seq_id]
        self.forked = True

    @invariant()
    def consistent(self):
        alloc = self.allocator
        alloc.check_invariants()
        assert sorted(alloc.live_seq_ids) == sorted(self.specs)
        bs, window = self.block_size, self.window
        held_tokens = 0
        for seq_id, n in self.tokens.items():
            assert alloc.num_tokens(seq_id) == n
            tables = alloc.block_tables(seq_id)
            # Every block a token from its last step's first on can see, and no other.
            released = max(0, self.last_start[seq_id] - window + 1) // bs
            drafts = self.drafts_held.get(seq_id, 0)
            for table in tables[self.full_groups:]:
                assert len(table) == -(-max(n, drafts) // bs)
                assert table[:released] == [None] * released
                assert None not in table[released:]
            for table in tables[:self.full_groups]:
                assert len(table) == -(-max(n, self.claims[seq_id], drafts) // bs)
            held_tokens += self.full_groups * n + self.sliding_groups * (n - released * bs)
            held_tokens += self.state_blocks * self.state_slots  # states, written whole
        snap = alloc.snapshot()
        assert snap.total == alloc.capacity_slots
        assert snap.internal == self._internal_reference()
        if not self.caching and not self.forked:  # nothing shared: the reference's slots
            assert snap.token == held_tokens
            assert snap.cached == 0
        else:
            assert snap.token <= held_tokens
        assert alloc.num_free_blocks >= 0

    def _internal_reference(self) -> int:
        """Slots of held blocks that none of their holders will ever write (past every
        holder's final length), each physical block once."""
        bs = self.block_size
        never: dict[int, int] = {}  # block id → slots no holder writes, so far
        for seq_id, s in self.specs.items():
            for table in self.allocator.block_tables(seq_id):
                for idx, block_id in enumerate(table):
                    if block_id is not None:
                        past = max(0, (idx + 1) * bs - max(s.final_len, idx * bs))
                        never[block_id] = min(never.get(block_id, bs), past)
        # Each state block's padding past its state.
        padding = len(self.specs) * self.state_blocks * (bs - self.state_slots)
        return sum(never.values()) + padding

    def paged_accounting(self):  # (PagedMachine's arithmetic is per-sequence paging)
        pass

    def lookup(self, prefix_idx, prompt):  # re-declared below with the hybrid's bound
        pass

    @rule(prefix_idx=st.integers(0, len(PREFIXES) - 1), prompt=st.integers(1, 60))
    def lookup_changes_nothing(self, prefix_idx, prompt):
        s = self.new_spec(prefix_idx, prompt, 0, 1)
        before = self.allocator.snapshot()
        hit = self.allocator.lookup(s)
        assert hit % self.block_size == 0 and 0 <= hit < s.prompt_len
        assert self.allocator.snapshot() == before


class HybridPerChunk(HybridMachine):
    """vLLM v1's own way: admission claims a first chunk; later chunks may find memory
    short (a small pool, so they do)."""

    per_chunk = True
    num_blocks = 40


class HybridPureSlidingUnchunked(HybridMachine):
    full_groups = 0
    sliding_groups = 1
    window = 7
    chunk = None
    num_blocks = 50


class HybridNoCache(HybridMachine):
    caching = False
    window = 16
    block_size = 16
    num_blocks = 30


class HybridStateSpace(HybridMachine):
    """A state-space hybrid (Qwen3-Next's shape, small): one full-attention group and
    three state groups, each state filling 3 of a block's 4 slots; no prefix cache, no
    forks."""

    caching = False
    full_groups = 1
    sliding_groups = 0
    state_groups = 3
    state_slots = 3
    window = 0
    num_blocks = 40

    @precondition(lambda self: self.specs)
    @rule(data=st.data())
    def fork(self, data):  # a state is a sequence's own: no fork shares it
        parent = data.draw(st.sampled_from(sorted(self.specs)))
        spec = self.specs[parent]
        with pytest.raises(AllocatorError, match="state is not shared"):
            self.allocator.fork(parent, SeqSpec(self.next_id, spec.segments, spec.prompt_len,
                                                spec.final_len, spec.max_len))

    @invariant()
    def a_state_is_held_from_admission_to_the_end(self):
        # Every live sequence's states, and its blocks, out of the pool: nothing cached.
        blocks = sum(len(t) - t.count(None) for seq_id in self.specs
                     for t in self.allocator.block_tables(seq_id))
        held = blocks + len(self.specs) * self.state_blocks
        assert self.allocator.pool.num_free == self.num_blocks - held
        assert self.allocator.snapshot().cached == 0


class HybridStateCaching(HybridStateSpace):
    """The state-space hybrid with a prefix cache of states (vLLM's mamba cache mode
    "align"): a step starting on a block boundary leaves its states to the cache; a hit ends
    where every state group's state is cached, and finds them still cached."""

    caching = True
    num_blocks = 50

    def _admit(self, s: SeqSpec, first_chunk: int) -> None:
        # The hit it will get ends where every state group's state is kept.
        alloc = self.allocator
        expected = alloc.lookup(s)
        if expected:
            blocks = expected // self.block_size
            block_hash = BlockHasher(s.segments, self.block_size).hash_upto(blocks)[blocks - 1]
            for group in alloc._state_group_ids:
                kept = alloc.pool.lookup(alloc._key(block_hash, group))
                assert kept is not None and kept.num_filled == self.state_slots
        super()._admit(s, first_chunk)
        assert s.seq_id not in self.specs or self.tokens[s.seq_id] == expected

    @invariant()
    def a_state_is_held_from_admission_to_the_end(self):
        # Every live sequence holds its own running states (unkept), and only states and
        # its tables' blocks are out of the pool; kept states wait in it, cached.
        alloc = self.allocator
        running = [state for seq_id in self.specs for state in alloc._seqs[seq_id].states]
        assert all(state.ref_cnt == 1 and state.block_hash is None for state in running)
        assert len(running) == len(self.specs) * self.state_blocks
        tables = {b for seq_id in self.specs for t in alloc.block_tables(seq_id)
                  for b in t if b is not None}
        assert alloc.pool.num_free == self.num_blocks - len(tables) - len(running)


class HybridStateCachingAll(HybridStateCaching):
    """The same under vLLM's mamba cache mode "all": the states at a prefill chunk's inner
    boundaries are kept too (and a chunk crosses several here: 12 tokens in blocks of 4)."""

    every_state = True


class HybridStateSpeculative(HybridStateSpace):
    """The state-space hybrid under speculative decoding of 2 drafts a step: each state
    group keeps 3 states a sequence (one after each draft too)."""

    states_per_group = 3
    num_blocks = 60


_SETTINGS = settings(max_examples=int(os.environ.get("KVSIM_HYPOTHESIS_EXAMPLES", "60")),
                     stateful_step_count=40, deadline=None,
                     derandomize="KVSIM_HYPOTHESIS_EXAMPLES" not in os.environ)
for _machine in (HybridMachine, HybridPerChunk, HybridPureSlidingUnchunked, HybridNoCache,
                 HybridStateSpace, HybridStateCaching, HybridStateCachingAll,
                 HybridStateSpeculative):
    _machine.TestCase.settings = _SETTINGS
    globals()[f"Test{_machine.__name__}"] = _machine.TestCase


GEMMA = {
    "name": "gemma", "model": "gemma-3-27b", "gpu": "h100-80g",
    "memory": {"kv_memory_gib": 4},
    "workload": {"arrival": {"process": "poisson", "rate": 20},
                 "prompt_len": {"dist": "lognormal", "mean": 1500, "p99": 4000, "max": 6000},
                 "output_len": {"dist": "lognormal", "mean": 400, "p99": 1500, "max": 2000}},
    "systems": [
        {"name": "hybrid", "allocator": {"kind": "paged", "block_size": 16},
         "scheduler": {"chunked_prefill": True}},
        {"name": "all-layers", "allocator": {"kind": "paged", "block_size": 16,
                                             "hybrid_kv_cache": False},
         "scheduler": {"chunked_prefill": True}}],
    "stop": {"num_requests": 150},
}


def test_a_pool_past_the_block_cap_is_refused_counting_group_blocks():
    scenario, _ = load(GEMMA)
    hybrid_system, flat_system = scenario.systems
    # All-layer blocks: the cap itself passes, one block more is refused.
    check_pool(scenario, flat_system, MAX_POOL_BLOCKS * 16)
    with pytest.raises(SizingError, match=r"^memory.kv_memory_gib: the KV pool of system "
                       r"'all-layers' would hold 33,554,433 blocks of 16 tokens; at most "
                       r"33,554,432 are simulated"):
        check_pool(scenario, flat_system, (MAX_POOL_BLOCKS + 1) * 16)
    # The same slots make 6.2 times as many blocks of one group's 10 layers.
    group_cap_slots = MAX_POOL_BLOCKS * 16 * 10 // 62
    check_pool(scenario, hybrid_system, group_cap_slots)
    with pytest.raises(SizingError, match="'hybrid' would hold"):
        check_pool(scenario, hybrid_system, MAX_POOL_BLOCKS * 16)


def test_a_pool_of_group_blocks_sized_from_the_same_bytes():
    scenario, _ = load(GEMMA)
    slots = scenario_pool_slots(scenario)  # tokens of all 62 layers
    hybrid_system, flat_system = scenario.systems
    alloc = build_allocator(hybrid_system, slots, 131072, model=scenario.model_spec())
    assert isinstance(alloc, HybridPagedAllocator)
    # A block holds 16 tokens of 10 layers: 6.2 times as many blocks as of all 62 layers.
    assert alloc.num_blocks == slots * 62 // (10 * 16)
    assert (alloc.full_groups, alloc.sliding_groups, alloc.sliding_window) == (1, 6, 1024)
    assert alloc.prefill_chunk_tokens == 8192
    flat = build_allocator(flat_system, slots, 131072, model=scenario.model_spec())
    assert not isinstance(flat, HybridPagedAllocator)
    assert flat.capacity_slots == slots // 16 * 16


def test_windows_given_back_seat_more_requests():
    result = run(GEMMA)
    hybrid_run, flat_run = result.systems["hybrid"].summary, result.systems["all-layers"].summary
    # Requests average 1,900 tokens, two windows: the sliding groups hold about half of
    # what every layer's every token would, so more requests decode at once.
    assert hybrid_run["mean_batch"] > 1.2 * flat_run["mean_batch"]
    assert hybrid_run["throughput_tok_s"] > 1.15 * flat_run["throughput_tok_s"]
    for summary in (hybrid_run, flat_run):
        assert summary["completed"] == 150


@pytest.mark.parametrize(("change", "message"), [
    ({"systems[hybrid].allocator.host_cache_gib": 1},
     "system 'hybrid': a host tier (allocator.host_cache_gib) is not modelled with the hybrid "
     "KV cache manager that gemma-3-27b's sliding-window layers use; set "
     "allocator.hybrid_kv_cache: false (every layer keeps every token)"),
    ({"systems[hybrid].scheduler.preemption_mode": "swap_groups"},
     "preemption by swap (scheduler.preemption_mode) is not"),
    ({"model": {"name": "m", "num_layers": 4, "num_heads": 4, "head_dim": 64,
                "num_params": 1e8, "max_model_len": 4096, "num_sliding_layers": 2}},
     "num_sliding_layers needs sliding_window"),
    ({"model": {"name": "m", "num_layers": 4, "num_heads": 4, "head_dim": 64,
                "num_params": 1e8, "max_model_len": 4096, "sliding_window": 64,
                "num_sliding_layers": 5}}, "num_sliding_layers (5) exceeds num_layers (4)"),
])
def test_what_the_hybrid_manager_does_not_model_is_refused_in_one_line(change, message):
    with pytest.raises(ScenarioError, match=None) as caught:
        load(GEMMA, overrides=change)
    assert message in str(caught.value) and "\n" not in str(caught.value)


class _RecordingTiming(StepTimeModel):
    """The roofline, noting the shape of every step it times (step mode times each)."""

    def step_time(self, decode_seqs, context_tokens, prefill_tokens, prefill_pairs, rho,
                  skipped_context=0, skipped_pairs=0, round_tokens=0):
        SHAPES.append((decode_seqs, context_tokens, prefill_tokens, prefill_pairs,
                       skipped_context, skipped_pairs))
        return super().step_time(decode_seqs, context_tokens, prefill_tokens, prefill_pairs,
                                 rho, skipped_context, skipped_pairs, round_tokens)


SHAPES: list[tuple[int, ...]] = []


@pytest.mark.parametrize("users", [1, 3])
def test_sliding_layers_skip_the_context_past_their_window(users):
    # Closed-loop users with equal prompts: every decoding sequence of a step has the same
    # context when they start together, so the context past the window is exact arithmetic.
    window = 40
    scenario, _ = load({
        "name": "window", "model": {"name": "swa", "num_layers": 8, "num_heads": 8,
                                    "head_dim": 64, "num_params": 1e9, "max_model_len": 4096,
                                    "sliding_window": window, "num_sliding_layers": 6},
        "memory": {"kv_memory_gib": 1},
        "workload": {"arrival": {"process": "closed_loop", "users": users,
                                 "think_time_s": 0},
                     "prompt_len": {"dist": "constant", "value": 30},
                     "output_len": {"dist": "constant", "value": 25}},
        "systems": [{"name": "s", "allocator": {"kind": "paged", "block_size": 16}}],
        "stop": {"num_requests": 2 * users}, "engine": {"mode": "step"}})
    base = build_timing(scenario, ROOT)
    assert base.sliding_share == 6 / 8
    timing = _RecordingTiming(**{f.name: getattr(base, f.name) for f in fields(base)})
    SHAPES.clear()
    run_system(scenario, scenario.systems[0], scenario_trace(scenario, ROOT), timing)
    decode_only = [s for s in SHAPES if s[2] == 0 and s[0] == users]
    assert len(decode_only) >= 20
    for seqs, context, _, _, skipped, _ in decode_only:
        assert skipped == seqs * max(0, context // seqs - window)
    assert any(s[4] for s in decode_only)  # contexts do pass the window (30 + 25 > 40)
    for _, _, prefill, pairs, _, skipped_pairs in SHAPES:  # fresh 30-token prompts
        assert skipped_pairs == 0 and pairs == prefill * 30


def one_windowed_request(window: int, prompt: int, output: int, mode: str) -> dict:
    """One request to a model whose every layer slides, no prefix cache, invariants checked."""
    return {
        "name": "window-steps",
        "model": {"name": "swa", "num_layers": 8, "num_heads": 8, "head_dim": 64,
                  "num_params": 1e9, "max_model_len": 4096, "sliding_window": window,
                  "num_sliding_layers": 8},
        "memory": {"kv_memory_gib": 1},
        "workload": {"arrival": {"process": "constant", "rate": 1},
                     "prompt_len": {"dist": "constant", "value": prompt},
                     "output_len": {"dist": "constant", "value": output}},
        "systems": [{"name": "s", "allocator": {"kind": "paged", "block_size": 16,
                                                "prefix_caching": False}}],
        "stop": {"num_requests": 1}, "engine": {"mode": mode, "debug_invariants": True}}


@pytest.mark.parametrize("mode", ["step", "jump"])
def test_a_window_gives_a_block_back_at_the_step_whose_token_cannot_see_it(mode):
    # vLLM's remove_skipped_blocks runs before every step: the step computing token p keeps
    # blocks from (p - W + 1) // 16 on. A 40-token window over 16-token blocks passes a
    # block 8 steps before the table needs its next one, so block crossings alone would give
    # each back 8 steps late.
    window, prompt, output = 40, 30, 60
    data = one_windowed_request(window, prompt, output, mode)
    result = run(data).systems["s"]
    steps = result.steps
    assert steps["steps"].sum() == output  # the prefill and 59 decode steps
    # Each step's blocks (the memory it began with) against vLLM's rule, token by token.
    memory = result.memory
    held = (memory["token"] + memory["reserved"] + memory["internal"]) // 16
    first_step = steps["steps"].cumsum().shift(fill_value=0).to_numpy()
    expected = [2] + [-(-(p + 1) // 16) - max(0, p - window + 1) // 16
                      for p in range(prompt, prompt + output - 1)]
    assert held.tolist() == [expected[i] for i in first_step]
    # (The case the test is for: blocks given back between crossings, 8 steps before them.)
    drops = [p for p in range(prompt + 1, prompt + output - 1)
             if expected[p - prompt + 1] < expected[p - prompt]]
    assert drops and all(p % 16 == window % 16 - 1 for p in drops)


def test_a_token_written_between_block_crossings_fills_a_slot_in_every_groups_table():
    # Four full-attention and four sliding layers: two groups. The step computing token p
    # begins with p tokens written in the full group's table and, in the sliding one's, all
    # but the blocks p cannot see, though the scheduler tells the allocator only at block
    # crossings and window releases (the tokens between are counted lazily, one slot a
    # group each).
    window, prompt, output = 40, 30, 60
    data = one_windowed_request(window, prompt, output, "step")
    data["model"]["num_sliding_layers"] = 4
    result = run(data).systems["s"]
    first_step = result.steps["steps"].cumsum().shift(fill_value=0).to_numpy()[1:]
    expected = [p + p - max(0, p - window + 1) // 16 * 16
                for p in range(prompt, prompt + output - 1)]
    assert result.memory["token"].tolist()[1:] == [expected[i - 1] for i in first_step]
    jump = run(one_windowed_request(window, prompt, output, "jump") | {
        "model": data["model"]}).systems["s"]
    assert jump.summary["token_frac"] == pytest.approx(result.summary["token_frac"],
                                                       rel=1e-12)


def test_three_samples_share_the_prompts_blocks_until_their_windows_pass_them():
    # A full and a sliding group, a 40-token window, one request of 3 samples: they fork
    # at the prompt's end (30 tokens: block 0 full, block 1 partial) and copy block 1 at
    # their first step. From then on each holds its own blocks after block 0 in both
    # groups; block 0 stays shared in the full group, and in the sliding one until the
    # windows pass it (the step computing token 55).
    window, prompt, output = 40, 30, 60
    data = one_windowed_request(window, prompt, output, "step")
    data["model"]["num_sliding_layers"] = 4
    data["workload"]["sampling"] = {"n": 3}
    result = run(data).systems["s"]
    memory, steps = result.memory, result.steps
    held = ((memory["token"] + memory["reserved"] + memory["internal"]) // 16).tolist()
    first_step = steps["steps"].cumsum().shift(fill_value=0).to_numpy()

    def blocks(p: int) -> int:  # held by the step computing token p
        own = -(-(p + 1) // 16)
        released = max(0, p - window + 1) // 16
        return 1 + 3 * (own - 1) + (released == 0) + 3 * (own - max(1, released))

    expected = [4] + [blocks(p) for p in range(prompt, prompt + output - 1)]
    assert held == [expected[i] for i in first_step]
    assert blocks(54) - blocks(55) == 1  # the shared block given back by all three
    jump = run(data | {"engine": {"mode": "jump"}}).systems["s"]
    pd.testing.assert_frame_equal(jump.requests, result.requests)
    assert jump.summary["token_frac"] == pytest.approx(result.summary["token_frac"],
                                                       rel=1e-12)


@pytest.mark.parametrize("mode", ["step", "jump"])
def test_a_speculative_step_claims_its_drafts_and_gives_back_what_its_first_token_cannot_see(
        mode):
    # EAGLE with 2 drafts, every one accepted: each decode step computes from the token
    # after the last kept, p, keeps 3 and holds slots to p + 5 (the last token, 2 drafts and
    # 2 lookahead), in the window's table too, which gives back the blocks p cannot see.
    # The head's layer attends to every token: vLLM groups it as a full-attention group of
    # 1 layer, and the model's 8 sliding layers as 8 groups of 1, each holding the window.
    window, prompt, output = 40, 30, 60
    data = one_windowed_request(window, prompt, output, mode)
    data["systems"][0]["speculative"] = {"method": "eagle", "num_speculative_tokens": 2,
                                         "mean_acceptance_length": 3.0}
    result = run(data).systems["s"]
    steps, memory = result.steps, result.memory
    assert steps["steps"].sum() == 1 + 20  # the prefill, and 59 tokens 3 a step
    held = (memory["token"] + memory["reserved"] + memory["internal"]) // 16
    first_step = steps["steps"].cumsum().shift(fill_value=0).to_numpy()
    final = prompt + output
    claimed = [2] + [-(-min(p + 5, final) // 16) for p in range(prompt, final - 1, 3)]
    expected = [2] + [-(-min(p + 5, final) // 16) - max(0, p - window + 1) // 16
                      for p in range(prompt, final - 1, 3)]
    assert held.tolist() == [claimed[i] + 8 * expected[i] for i in first_step]
    # (The case the test is for: windows do give blocks back between the drafts' claims.)
    assert any(later < earlier for earlier, later in itertools.pairwise(expected[1:]))


def test_gpt_oss_a_mixture_of_experts_with_a_128_token_window_runs_as_stepping():
    # GPT-OSS-20B: every other layer sees 128 tokens, 4 of 32 experts a token. Its sliding
    # group holds at most a window and a chunk of every request, so the hybrid manager seats
    # more at once; and runs of decode steps (experts read, windows passed) equal stepping.
    data = dict(GEMMA, name="gpt-oss", model="gpt-oss-20b", memory={"kv_memory_gib": 1})
    data["stop"] = {"num_requests": 60}
    runs = {}
    for mode in ("jump", "step"):
        data["engine"] = {"mode": mode}
        runs[mode] = run(data)
    for name in ("hybrid", "all-layers"):
        pd.testing.assert_frame_equal(runs["jump"].systems[name].requests,
                                      runs["step"].systems[name].requests)
    hybrid, flat = (runs["jump"].systems[n].summary for n in ("hybrid", "all-layers"))
    assert hybrid["mean_batch"] > 1.3 * flat["mean_batch"]
    assert hybrid["completed"] == flat["completed"] == 60


def test_gpt_oss_with_eagle3_under_the_hybrid_manager_runs_as_stepping():
    # GPT-OSS-20B with an EAGLE-3 head: each step claims its drafts' slots in both groups'
    # tables, and the window's table gives back what the step's first token cannot see. It
    # still seats more than every layer keeping every token, and runs of decode steps equal
    # stepping, invariants checked.
    speculative = {"method": "eagle3", "num_speculative_tokens": 3,
                   "mean_acceptance_length": 2.6}
    data = dict(GEMMA, name="gpt-oss-eagle3", model="gpt-oss-20b",
                memory={"kv_memory_gib": 1}, stop={"num_requests": 60},
                systems=[dict(system, speculative=speculative) for system in GEMMA["systems"]])
    runs = {}
    for mode in ("jump", "step"):
        data["engine"] = {"mode": mode, "debug_invariants": mode == "step"}
        runs[mode] = run(data)
    for name in ("hybrid", "all-layers"):
        pd.testing.assert_frame_equal(runs["jump"].systems[name].requests,
                                      runs["step"].systems[name].requests)
    hybrid, flat = (runs["jump"].systems[n].summary for n in ("hybrid", "all-layers"))
    assert hybrid["completed"] == flat["completed"] == 60
    assert hybrid["mean_batch"] > 1.3 * flat["mean_batch"]
    assert hybrid["mean_draft_tokens"] == flat["mean_draft_tokens"] == 3
