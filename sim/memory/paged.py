"""Paged KV allocation: fixed-size blocks, per-sequence block tables, shared prefixes.

Like virtual memory: each sequence sees a contiguous run of logical blocks (its block table)
that maps to scattered physical blocks taken from a :class:`~sim.memory.block_pool.BlockPool`
only when tokens need them. Identical prefixes map to the same physical blocks (reference
counts), and a shared, partly-filled block is copied before anyone writes into it.

The prefix-cache rules follow vLLM v1 (see DESIGN.md, "Paged"):

1. only full blocks are hashed, chained on their parent's hash;
2. admission looks up the prompt's full blocks from block 0 and stops at the first miss,
   never covering the prompt's last token (it is always recomputed);
3. a finished sequence releases its blocks in reverse order; blocks reaching ref 0 keep their
   hash and become evictable, unhashed blocks are reused first;
4. a cached block is evicted lazily, when it is handed out again;
6. ``fork`` shares every block; writing into a shared partial block copies it first.

With a host tier (:mod:`sim.memory.host_cache`), an evicted block's content goes to host
memory, and admission continues its lookup there where the GPU cache stops: blocks found
there are loaded into fresh GPU blocks, full and hashed, instead of being prefilled again.
"""

from __future__ import annotations

from sim.memory.base import (
    AllocatorError,
    KVAllocator,
    MemorySnapshot,
    SeqSpec,
    claim_end,
    table_token_bounds,
    write_past_end,
)
from sim.memory.block_pool import (
    BlockPool,
    KVBlock,
    copy_for_write,
    drop_reference,
    shared_tail_internal,
)
from sim.memory.content import BlockHasher, DuplicateCounter
from sim.memory.host_cache import HostCache


class _PagedSeq:
    """One sequence's view: its block table and how far it has written."""

    __slots__ = ("blocks", "claimed", "final_len", "hasher", "internal", "num_tokens",
                 "per_chunk", "shared_blocks", "spec")

    def __init__(self, spec: SeqSpec, blocks: list[KVBlock], hasher: BlockHasher,
                 block_size: int) -> None:
        self.spec = spec
        self.final_len = spec.final_len
        # Full blocks inside the prompt may repeat another sequence's content; a block that
        # reaches past it holds text this sequence generated, unique to it, so it can never
        # be a duplicate and is left out of the duplicate count.
        self.shared_blocks = spec.prompt_len // block_size
        self.blocks = blocks
        self.hasher = hasher
        self.num_tokens = 0
        self.claimed = 0  # the furthest slot an append's lookahead held (0: none)
        self.internal = 0  # this sequence's share of `internal` slots while its tail is its own
        self.per_chunk = False  # admitted with blocks for its first prompt chunk only


class PagedAllocator(KVAllocator):
    """Block tables over a shared :class:`BlockPool`, with optional prefix caching.

    Admission allocates blocks for the whole prompt (prefix hits excepted), or for its first
    prompt chunk only (``max_new_tokens``: later chunks take theirs as they are written);
    decode grows the table one block at a time as tokens cross block boundaries.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
        eviction: str = "lru",
        watermark: float = 0.0,
        host_cache_blocks: int = 0,
    ) -> None:
        if block_size < 1:  # (a page of virtual memory may hold thousands of tokens)
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"the pool must hold at least one block, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.capacity_slots = num_blocks * block_size
        self.enable_prefix_caching = enable_prefix_caching
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        # Blocks admission leaves free for running sequences to grow into (vLLM v0's
        # watermark), so that a new request does not force a preemption on the next step.
        self.watermark_blocks = int(watermark * num_blocks)
        if host_cache_blocks and not enable_prefix_caching:
            raise ValueError("a host cache needs prefix caching: blocks are found by content")
        self.host = HostCache(host_cache_blocks) if host_cache_blocks else None
        self.pool = BlockPool(num_blocks, eviction, enable_prefix_caching, self.host)
        self._seqs: dict[int, _PagedSeq] = {}
        self._token_slots = 0  # written slots in blocks with ref_cnt > 0
        self._internal_exclusive = 0  # Σ seq.internal over sequences not in _shared_tail
        self._shared_tail: set[int] = set()  # sequences whose partial tail block is forked
        self._duplicates = DuplicateCounter()
        self.num_cow_copies = 0
        self.num_hit_blocks = 0
        self.last_loaded_tokens = 0  # tokens the last admission loaded from the host tier
        # The last admission refused had blocks for what it claims, but not for the tokens
        # it was to keep room for besides (reserve_tokens).
        self.refused_for_reserve = False

    # ------------------------------------------------------------------ queries
    @property
    def live_seq_ids(self) -> list[int]:
        return list(self._seqs)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.pool.num_free / self.num_blocks

    def num_tokens(self, seq_id: int) -> int:
        return self._seq(seq_id).num_tokens

    def allocated_slots(self, seq_id: int) -> int:
        return len(self._seq(seq_id).blocks) * self.block_size

    def block_table(self, seq_id: int) -> list[int]:
        """Physical block ids of the sequence, logical block 0 first."""
        return [b.block_id for b in self._seq(seq_id).blocks]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_admit_ever(self, spec: SeqSpec) -> bool:
        """Whether an empty pool holds the sequence at its final length (else it could be
        admitted but never finish)."""
        return self.blocks_for(spec.final_len) <= self.num_blocks

    def _seq(self, seq_id: int) -> _PagedSeq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise AllocatorError(f"unknown sequence {seq_id}") from None

    # ------------------------------------------------------------------ lifecycle
    def lookup(self, spec: SeqSpec) -> int:
        """Prefix-hit tokens ``spec`` would get now, on the GPU or in host memory (no state
        changes)."""
        hasher = BlockHasher(spec.segments, self.block_size)
        hits = len(self._hit_blocks(spec, hasher))
        return (hits + self._host_hits(spec, hasher, hits)) * self.block_size

    def _hit_blocks(self, spec: SeqSpec, hasher: BlockHasher) -> list[KVBlock]:
        """The GPU's cached blocks of ``spec``'s prompt, from block 0 to the first miss
        (never the last token's block, which is always computed). ``hasher`` may be fresh
        or one kept from an earlier walk."""
        hits: list[KVBlock] = []
        if not self.enable_prefix_caching:
            return hits
        hashes = hasher.hashes
        for idx in range((spec.prompt_len - 1) // self.block_size):
            block = self.pool.lookup(hashes[idx] if idx < len(hashes) else hasher.advance())
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_prefix_tokens(self, spec: SeqSpec, hasher: BlockHasher) -> int:
        return len(self._hit_blocks(spec, hasher)) * self.block_size

    def _host_hits(self, spec: SeqSpec, hasher: BlockHasher, start: int) -> int:
        """Blocks ``start``, ``start + 1``, … found in host memory, up to the first miss
        (``hasher`` has hashed block ``start``: the GPU lookup stopped there)."""
        host = self.host
        if host is None:
            return 0
        found = 0
        for idx in range(start, (spec.prompt_len - 1) // self.block_size):
            block_hash = hasher.hash_upto(idx + 1)[idx]
            if block_hash not in host:
                break
            found += 1
        return found

    def admit(self, spec: SeqSpec, max_new_tokens: int | None = None,
              extra_blocks: int = 0, reserve_tokens: int = 0) -> int | None:
        """As :meth:`KVAllocator.admit`; with ``extra_blocks``, only if that many free blocks
        are left besides (for what the caller writes next); with ``reserve_tokens``, only
        if the blocks for the whole prompt and that many tokens more are free (SGLang's
        admission keeps room for decoding), whatever part of the prompt it claims now."""
        if spec.seq_id in self._seqs:
            raise AllocatorError(f"sequence {spec.seq_id} is already admitted")
        hasher = BlockHasher(spec.segments, self.block_size)
        hits = self._hit_blocks(spec, hasher)
        loaded = self._host_hits(spec, hasher, len(hits))
        revived = sum(1 for b in hits if b.ref_cnt == 0)  # hits that leave the free set
        ready = (len(hits) + loaded) * self.block_size
        # Loaded blocks are among those needed.
        need = self.blocks_for(claim_end(spec, ready, max_new_tokens)) - len(hits)
        room = need if not reserve_tokens else max(
            need, self.blocks_for(spec.prompt_len + reserve_tokens) - len(hits))
        reserve = self.watermark_blocks if self._seqs else 0
        if room + extra_blocks > self.pool.num_free - revived - reserve:
            # (Whether its own blocks were free, and only the room kept besides was not.)
            self.refused_for_reserve = need + extra_blocks <= (
                self.pool.num_free - revived - reserve)
            return None
        for block in hits:
            if block.ref_cnt == 0:
                self._token_slots += block.num_filled
                self._duplicates.add(block.block_hash)  # type: ignore[arg-type]
                block.counted = True
            self.pool.touch(block)
        loaded_hashes = hasher.hashes[len(hits):len(hits) + loaded]
        host = self.host
        if host is not None:
            # Read up before taking GPU blocks, whose evictions may fill host memory.
            for block_hash in loaded_hashes:
                host.load(block_hash)
        blocks = hits + [self.pool.take() for _ in range(need)]
        bs = self.block_size
        for block, block_hash in zip(blocks[len(hits):], loaded_hashes, strict=False):
            block.num_filled = bs
            self.pool.register(block, block_hash)
            self._duplicates.add(block_hash)  # a prompt block: may repeat another's
            block.counted = True
        self._token_slots += loaded * bs
        seq = _PagedSeq(spec, blocks, hasher, bs)
        seq.num_tokens = ready
        seq.per_chunk = max_new_tokens is not None
        self._seqs[spec.seq_id] = seq
        self._set_internal(seq)
        self.num_hit_blocks += len(hits) + loaded
        self.last_loaded_tokens = loaded * bs
        return seq.num_tokens

    def admit_forks(self, parent: SeqSpec, samples: list[SeqSpec], tokens: int) -> int | None:
        """As :meth:`KVAllocator.admit_forks`: the samples share the prompt's blocks, a
        partial last one copied on write, and own the rest."""
        prompt = parent.prompt_len
        count = 1 + len(samples)
        # Past the prompt's blocks, each sample's own; and a copy of the prompt's partial last
        # block for each sample but the last to write into it (copy-on-write).
        growth = count * (self.blocks_for(tokens + 1) - self.blocks_for(prompt)) + (
            count - 1 if prompt % self.block_size else 0)
        hits = self.admit(parent, extra_blocks=growth)
        if hits is None:
            return None
        written = self.append(parent.seq_id, prompt - hits)
        for sample in samples:
            written = self.fork(parent.seq_id, sample) and written
        for seq_id in (parent.seq_id, *(sample.seq_id for sample in samples)):
            written = self.append(seq_id, tokens - prompt) and written
        assert written, "admission counted the group's blocks"
        return hits

    def append(self, seq_id: int, num_tokens: int, lookahead: int = 0) -> bool:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise AllocatorError(f"unknown sequence {seq_id}")
        if num_tokens <= 0:
            return num_tokens == 0
        bs = self.block_size
        start = seq.num_tokens
        end = start + num_tokens
        if end > seq.final_len:
            raise write_past_end(seq_id, end, seq.final_len)
        # Lookahead slots are held, not written: blocks past the tokens count as reserved.
        claim = end
        if lookahead > 0:
            claim = min(end + lookahead, seq.final_len)
            if claim > seq.claimed:
                seq.claimed = claim
        blocks = seq.blocks
        pool = self.pool
        first = start // bs
        nblocks = len(blocks)
        # Copy-on-write: the block we write into first is shared with a fork.
        cow = first < nblocks and blocks[first].ref_cnt > 1
        grow = -(-claim // bs) - nblocks
        if grow > 0 or cow:
            if grow + cow > pool.num_free:
                return False
            # The table changes shape: take the sequence out of the internal-slot sums.
            if self._shared_tail and seq_id in self._shared_tail:
                self._shared_tail.discard(seq_id)
            else:
                self._internal_exclusive -= seq.internal
            if cow:
                blocks[first] = copy_for_write(pool, blocks[first])
                self._token_slots += blocks[first].num_filled
                self.num_cow_copies += 1
            if grow == 1:
                blocks.append(pool.take())
            elif grow > 1:
                blocks.extend([pool.take() for _ in range(grow)])
            # _set_internal, inlined: this branch runs at every block crossing.
            cap = len(blocks) * bs
            seq.internal = cap - seq.final_len if cap > seq.final_len else 0
            self._internal_exclusive += seq.internal
        # Write: fill blocks first..last; hash the ones that become full.
        duplicates = self._duplicates
        idx = first
        room = bs - (start - first * bs)
        remaining = num_tokens
        while remaining:
            block = blocks[idx]
            take = room if room < remaining else remaining
            filled = block.num_filled + take
            block.num_filled = filled
            remaining -= take
            if filled == bs:
                hashes = seq.hasher.hashes
                block_hash = hashes[idx] if idx < len(hashes) else seq.hasher.advance()
                pool.register(block, block_hash)
                if idx < seq.shared_blocks:
                    duplicates.add(block_hash)
                    block.counted = True
            idx += 1
            room = bs
        self._token_slots += num_tokens
        seq.num_tokens = end
        return True

    def _set_internal(self, seq: _PagedSeq) -> None:
        cap = len(seq.blocks) * self.block_size
        seq.internal = cap - seq.final_len if cap > seq.final_len else 0
        self._internal_exclusive += seq.internal

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise AllocatorError(f"unknown sequence {seq_id}")
        if seq_id in self._shared_tail:
            self._shared_tail.discard(seq_id)
        else:
            self._internal_exclusive -= seq.internal
        for block in reversed(seq.blocks):  # deepest first: the tail is evicted first
            self._token_slots -= drop_reference(self.pool, block, self._duplicates)

    def free_caching_prefix(self, seq_id: int, cached_tokens: int) -> None:
        """:meth:`free`, the blocks past the first ``cached_tokens`` tokens' whole blocks
        forgotten rather than cached as they become free (SGLang's retraction: its tree
        holds a request's prompt, not the tokens it generated)."""
        tail = self._seq(seq_id).blocks[cached_tokens // self.block_size:]
        self.free(seq_id)
        for block in reversed(tail):
            if block.ref_cnt == 0:
                self.pool.forget(block)

    def fork(self, parent_id: int, child: SeqSpec) -> bool:
        parent = self._seq(parent_id)
        if parent.num_tokens < parent.spec.prompt_len:
            raise AllocatorError(f"sequence {parent_id} cannot fork before its prompt is written")
        if child.seq_id in self._seqs:
            raise AllocatorError(f"sequence {child.seq_id} is already admitted")
        if len(parent.blocks) > self.blocks_for(max(parent.num_tokens, parent.spec.prompt_len)):
            # Its blocks past the tokens would be shared empty, and written by both.
            raise AllocatorError(f"sequence {parent_id} holds lookahead slots; fork it before "
                                 "it claims any (samples fork at the prompt's end)")
        for block in parent.blocks:
            self.pool.touch(block)
        seq = _PagedSeq(child, list(parent.blocks), parent.hasher.copy(child.segments),
                        self.block_size)
        seq.num_tokens = parent.num_tokens
        seq.claimed = parent.claimed
        self._seqs[child.seq_id] = seq
        if parent.num_tokens < len(parent.blocks) * self.block_size:
            # The partial tail is shared now: its unwritten slots are accounted per block.
            if parent_id not in self._shared_tail:
                self._internal_exclusive -= parent.internal
                self._shared_tail.add(parent_id)
            self._shared_tail.add(child.seq_id)
            self._set_internal(seq)
            self._internal_exclusive -= seq.internal
        else:
            self._set_internal(seq)
        return True

    def max_uniform_append(self, seq_ids: list[int], limit: int) -> int:
        if limit <= 0:
            return 0
        free = self.pool.num_free
        seqs = [self._seq(s) for s in seq_ids]
        bs = self.block_size

        # Copy-on-write: of the m sequences here that first write into a shared block, all
        # but the last copy it, as appending one after another does (the last then holds
        # the block alone), unless sequences not here hold it too.
        writers: dict[int, int] = {}
        shared: dict[int, KVBlock] = {}
        for seq in seqs:
            first = seq.num_tokens // bs
            if first < len(seq.blocks) and seq.blocks[first].ref_cnt > 1:
                block = seq.blocks[first]
                writers[block.block_id] = writers.get(block.block_id, 0) + 1
                shared[block.block_id] = block
        copies = sum(min(m, shared[b].ref_cnt - 1) for b, m in writers.items())

        def need(k: int) -> int:
            total = copies
            for seq in seqs:
                grow = -(-(seq.num_tokens + k) // bs) - len(seq.blocks)
                if grow > 0:
                    total += grow
            return total

        if need(limit) <= free:
            return limit
        lo, hi = 0, limit  # need(lo) <= free < need(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if need(mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo

    # ------------------------------------------------------------------ accounting
    def snapshot(self, waiting: SeqSpec | None = None) -> MemorySnapshot:
        internal = self._internal_exclusive
        if self._shared_tail:
            internal += shared_tail_internal(
                (seq.blocks[-1].block_id, len(seq.blocks) * self.block_size, seq.spec.final_len)
                for seq in map(self._seqs.__getitem__, self._shared_tail))
        return self.pool.taxonomy(self.block_size, self._token_slots, internal,
                                  self._duplicates.duplicate_units)

    def check_invariants(self) -> None:
        bs = self.block_size
        # Tables holding each block, by block id (a list: this runs over the whole pool at
        # every step of a debug run, so each block should cost a few operations only).
        refs = [0] * self.num_blocks
        for seq in self._seqs.values():
            least, most = table_token_bounds(seq.spec, seq.num_tokens, seq.per_chunk)
            most = max(most, seq.claimed)
            assert self.blocks_for(least) <= len(seq.blocks) <= self.blocks_for(most), (
                "block table length does not match the tokens written")
            for block in seq.blocks:
                refs[block.block_id] += 1
        evictable = {block.block_id for block in self.pool.evictable.ordered()}
        assert len(evictable) == len(self.pool.evictable), "a block evictable twice"
        token_slots = 0
        free_unhashed = 0
        live_hashed = 0  # blocks held by a table whose content is hashed
        live_hashes: set[int] = set()
        for block in self.pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"{block}: ref_cnt != {refs[block.block_id]} tables holding it"
            )
            in_evictable = block.block_id in evictable
            if block.ref_cnt:
                assert not in_evictable, f"{block} is referenced and evictable"
                token_slots += block.num_filled
                if block.block_hash is not None:
                    live_hashed += 1
                    live_hashes.add(block.block_hash)
            elif in_evictable:
                assert block.block_hash is not None, f"{block} evictable without a hash"
                assert self.pool.cached.get(block.block_hash) is block, (
                    f"{block} evictable but not in the cache map"
                )
            else:
                free_unhashed += 1
                assert block.block_hash is None, f"{block} free but keeps a hash"
            assert 0 <= block.num_filled <= bs
            if block.num_filled == bs and block.ref_cnt:
                assert block.block_hash is not None, f"{block} full but unhashed"
        assert free_unhashed + len(self.pool.evictable) == self.pool.num_free
        assert token_slots == self._token_slots, "token slot counter drifted"
        assert live_hashed - len(live_hashes) == self._duplicates.duplicate_units, (
            "duplicate counter drifted")
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash, f"cache map entry points to {block}"
        for seq in self._seqs.values():
            written_full = seq.num_tokens // bs
            for idx in range(written_full):
                assert seq.blocks[idx].num_filled == bs
                assert seq.blocks[idx].block_hash == seq.hasher.hashes[idx]
            if seq.num_tokens % bs:
                assert seq.blocks[written_full].num_filled == seq.num_tokens % bs
        snap = self.snapshot()
        assert snap.total == self.capacity_slots, "taxonomy does not sum to the pool"
        assert min(snap.as_dict().values()) >= 0, f"negative category in {snap}"
        expected_internal = 0
        seen_tails: set[int] = set()
        for seq in self._seqs.values():
            cap = len(seq.blocks) * bs
            tail = seq.blocks[-1]
            if seq.spec.seq_id in self._shared_tail:
                continue
            assert tail.block_id not in seen_tails or cap <= seq.spec.final_len
            seen_tails.add(tail.block_id)
            expected_internal += max(0, cap - seq.spec.final_len)
        assert expected_internal == self._internal_exclusive, "internal counter drifted"
        if self.host is not None:
            assert len(self.host) <= self.host.capacity_blocks, "host cache over capacity"
