"""Paged KV allocation for models with sliding-window layers: vLLM v1's hybrid KV cache
manager.

A cloakroom where some guests keep every coat they are handed all evening (the layers that
attend to every token) and others keep only their last few (the sliding-window layers,
which see only the last ``W`` tokens): what a window has passed goes back to the rail. vLLM
splits the layers of each kind into *groups* of equally many layers (see
:meth:`~sim.presets.ModelSpec.kv_cache_groups`); every group keeps its own block table
per sequence, and all tables draw from one pool of blocks, each holding ``block_size``
tokens of one group's layers. A pool slot here is one token in one group.

A sliding-window group gives a block back as soon as no token still to be computed can see
it (vLLM's ``remove_skipped_blocks``, before each allocation): with its hash, so it stays
cached until evicted, as a finished request's blocks do.

Prefix caching follows vLLM v1's hybrid coordinator. The full-attention groups find the
longest run of cached blocks from block 0; the sliding-window groups then look, at or
below that length, for the last ``cdiv(W - 1, block_size)`` blocks before a position (all
that a token there can see) cached, or for a run from block 0; the shorter is the hit. Each
group caches its blocks under its own key, as vLLM keys them by (hash, group).

Admission claims the full-attention groups' blocks for the prompt, as
:class:`~sim.memory.paged.PagedAllocator` does. A sliding-window group holds at
most a window and a prefill chunk at once, so it is *promised* that many blocks instead:
they stay in the pool, but nobody else may take them until the prefill is over, so that no
chunk waits for memory. Under per-chunk allocation (``max_new_tokens``, vLLM v1's own way)
both claims cover the first chunk only, and later chunks take their blocks as they come.

Speculative decoding claims each step's drafts and lookahead in every group's table, as
:class:`~sim.memory.paged.PagedAllocator` does; a sliding-window table gives back what the
step's first token (the last one kept, before the drafts) cannot see, so a step that keeps
several tokens is told where it started.

Parallel samples fork a sequence at the end of its prompt: the child holds every block of
the parent's tables, and the first write into a shared partial block copies it (copy on
write), group by group; a window's shared block returns to the pool when its last holder
gives it back.

KV computed elsewhere (a prefill replica's, sent to a decode replica) *arrives*: the
full-attention tables take its every block, the sliding-window ones only the blocks the
next token computed here sees, so those before are never held.

State-space layers (Mamba-2, Gated DeltaNet) keep no KV a token but one recurrent state a
sequence: a *state group* holds one block per sequence, from admission to the end, as
vLLM v1's mamba manager does without prefix caching (its block size raised so that a
block holds one state: see :meth:`~sim.presets.ModelSpec.state_block_size`). Its
``state_slots`` count as written; the block's rest, vLLM's padding of the state to the
page, as internal. Under speculative decoding a state group holds 1 + k blocks a sequence,
vLLM's ``num_speculative_blocks``: the kernel writes the state after each of the k drafts,
so that the state after the last accepted one is there to go on from. A state is not
shared, so a state-space model forks no samples.

With prefix caching a state group keeps states as vLLM's mamba cache mode "align" does: a
step that starts on a block boundary leaves the sequence's running state (the state after
the tokens before the boundary) to the cache, under the key of the block that ends there,
and goes on in a new block; the scheduler ends prefill chunks on boundaries so that such
states exist. Under mode "all" (``cache_every_state``) the Mamba-2 kernel writes the state
at every boundary inside a prefill chunk too, in blocks of whole chunks of the kernel's,
and each is kept so; chunks need not end on boundaries. A prefix hit is then the longest
full-attention hit cut back to the last boundary whose every state group's state is
cached; its states are copied into the sequence's own. (Not modelled with speculative
states, or beside sliding windows.)

Not modelled: a host tier, swapping out.
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


class _HybridSeq:
    """One sequence: a block table per group (full-attention groups first), how far it has
    written, and the sliding-window blocks it has given back or is promised."""

    __slots__ = ("claim_end", "claimed", "final_len", "hasher", "internal", "num_tokens",
                 "per_chunk", "promised", "released", "shared_blocks", "spec", "states",
                 "tables")

    def __init__(self, spec: SeqSpec, tables: list[list[KVBlock | None]], hasher: BlockHasher,
                 block_size: int) -> None:
        self.spec = spec
        self.final_len = spec.final_len
        self.tables = tables  # None where a sliding-window group gave the block back
        self.hasher = hasher
        self.shared_blocks = spec.prompt_len // block_size  # (see _PagedSeq)
        self.num_tokens = 0
        self.released = 0  # leading blocks every sliding-window table has given back
        self.promised = 0  # pool blocks kept for this sequence's prefill
        self.internal = 0  # slots of its tables past its final length
        # Admission claimed memory up to this token (see sim.memory.base.claim_end); with
        # per_chunk, the rest of the prompt takes its blocks chunk by chunk.
        self.claim_end = spec.prompt_len
        self.per_chunk = False
        self.claimed = 0  # the furthest slot an append's lookahead held (0: none)
        self.states: list[KVBlock] = []  # one block a state group, held to the end


class HybridPagedAllocator(KVAllocator):
    """Block tables per group of layers over one :class:`BlockPool`: ``full_groups`` groups
    whose tables keep every block, then ``sliding_groups`` whose tables keep the blocks the
    last ``sliding_window`` tokens lie in; and ``state_groups`` that keep one block a
    sequence (``states_per_group``: 1 + k under speculative decoding of k drafts, a state
    for each draft position), ``state_slots`` of it filled by its recurrent state.
    ``prefill_chunk_tokens`` is the most prompt tokens one step writes for a sequence (the
    scheduler's token budget under chunked prefill; None: a whole prompt)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        full_groups: int,
        sliding_groups: int,
        sliding_window: int,
        prefill_chunk_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        eviction: str = "lru",
        watermark: float = 0.0,
        state_groups: int = 0,
        state_slots: int | None = None,
        states_per_group: int = 1,
        cache_every_state: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"the pool must hold at least one block, got {num_blocks}")
        if min(full_groups, sliding_groups, state_groups) < 0 or not (
                sliding_groups or state_groups):
            raise ValueError(f"need a sliding-window or state group, got {sliding_groups} and "
                             f"{state_groups} (and {full_groups} full-attention groups)")
        if sliding_groups and sliding_window < 2:
            raise ValueError(f"sliding_window must be at least 2 tokens, got {sliding_window}")
        if state_slots is None:
            state_slots = block_size
        if not 0 < state_slots <= block_size:
            raise ValueError(f"a state fills 1 to {block_size} slots of a block, not "
                             f"{state_slots}")
        if states_per_group < 1:
            raise ValueError(f"a state group keeps at least one state a sequence, not "
                             f"{states_per_group}")
        if state_groups and enable_prefix_caching and (states_per_group > 1 or sliding_groups):
            raise ValueError("a prefix cache of states beside speculative states or sliding "
                             "windows is not modelled: enable_prefix_caching must be False")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.capacity_slots = num_blocks * block_size
        self.full_groups = full_groups
        self.sliding_groups = sliding_groups
        self.groups = full_groups + sliding_groups  # block tables a sequence keeps
        self.state_groups = state_groups
        self.state_slots = state_slots
        # Blocks a sequence's states take: one a state group, or 1 + k under speculation.
        self.state_blocks = state_groups * states_per_group
        # With a prefix cache, the state at each block boundary a step ends on is kept
        # (vLLM's mamba cache mode "align"), under each state group's own key; or, with
        # cache_every_state (mode "all"), at every boundary, a prefill chunk's inner ones
        # too (the Mamba-2 kernel writes a state at each chunk's end).
        self.caches_states = bool(state_groups) and enable_prefix_caching
        self.caches_every_state = self.caches_states and cache_every_state
        self._state_group_ids = range(self.groups, self.groups + state_groups)
        # Slots of a sequence's state blocks its states leave unwritten (vLLM's padding).
        self._state_padding = self.state_blocks * (block_size - state_slots)
        self.sliding_window = sliding_window
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # Blocks before a position that a token there can see (vLLM's
        # sliding_window_contiguous_blocks): what a prefix hit must find cached.
        self.window_blocks = -(-(sliding_window - 1) // block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.pool = BlockPool(num_blocks, eviction, enable_prefix_caching)
        self._seqs: dict[int, _HybridSeq] = {}
        self._token_slots = 0  # written slots in blocks with ref_cnt > 0
        self._internal = 0  # Σ seq.internal over sequences not in _shared_tail
        # Sequences whose partial tail blocks a fork shares: their unwritten slots are
        # counted once per block (see snapshot).
        self._shared_tail: set[int] = set()
        self.num_cow_copies = 0
        self._promised = 0  # Σ seq.promised
        self._duplicates = DuplicateCounter()
        self.num_hit_blocks = 0
        self.last_loaded_tokens = 0  # no host tier: always 0
        self._refused: tuple[SeqSpec, BlockHasher] | None = None  # the last admission refused

    # ------------------------------------------------------------------ queries
    @property
    def live_seq_ids(self) -> list[int]:
        return list(self._seqs)

    @property
    def num_free_blocks(self) -> int:
        """Blocks anyone may take now: the pool's free ones less those promised."""
        return self.pool.num_free - self._promised

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.pool.num_free / self.num_blocks

    @property
    def state_slots_per_sequence(self) -> int:
        return self.state_blocks * self.state_slots

    def num_tokens(self, seq_id: int) -> int:
        return self._seq(seq_id).num_tokens

    def allocated_slots(self, seq_id: int) -> int:
        seq = self._seq(seq_id)
        return sum(len(t) for t in seq.tables) * self.block_size - (
            self.sliding_groups * seq.released * self.block_size)

    def block_tables(self, seq_id: int) -> list[list[int | None]]:
        """Each group's physical block ids, logical block 0 first (None: given back)."""
        return [[None if b is None else b.block_id for b in table]
                for table in self._seq(seq_id).tables]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def release_point(self, first_computed: int) -> int:
        """Leading blocks that no token from ``first_computed`` on can see (it sees the
        ``sliding_window`` tokens up to itself): a sliding-window table gives them back
        before the step computing that token."""
        return max(0, first_computed - self.sliding_window + 1) // self.block_size

    def next_release(self, seq_id: int) -> int:
        """The first token whose step gives back one more block of the sequence's windows
        than they have given back."""
        return (self._seq(seq_id).released + 1) * self.block_size + self.sliding_window - 1

    def blocks_to_hold(self, seq_id: int, num_slots: int) -> int:
        """Blocks the sequence's tables take to hold ``num_slots`` slots, every group."""
        target = self.blocks_for(num_slots)
        return sum(max(0, target - len(table)) for table in self._seq(seq_id).tables)

    def _prefill_peak(self, spec: SeqSpec, start: int, end: int | None = None) -> int:
        """The most blocks a sliding-window table holds while the tokens from ``start`` to
        ``end`` (the prompt) are written: after a chunk [s, e) it holds blocks
        release_point(s) .. ceil(e / bs), at most a window and a chunk."""
        if end is None:
            end = spec.prompt_len
        chunk = self.prefill_chunk_tokens or end
        bound = self.blocks_for(self.sliding_window - 1 + chunk) + 1
        return min(bound, self.blocks_for(end) - self.release_point(start))

    def _decode_peak(self) -> int:
        """The most blocks a sliding-window table holds once decoding: the window's, and the
        block being written."""
        return self.blocks_for(self.sliding_window) + 1

    def can_admit_ever(self, spec: SeqSpec, samples: int = 1) -> bool:
        """Whether an empty pool holds the sequence at its largest (an upper bound), with
        ``samples`` forks of it at its prompt's end: they share the prompt's full blocks,
        and each holds the rest, and its own window, alone (the prompt's last window
        shared until each has copied its tail)."""
        final = self.blocks_for(spec.final_len)
        shared = spec.prompt_len // self.block_size
        full = shared + samples * (final - shared)
        prefill, decode = self._prefill_peak(spec, 0), self._decode_peak()
        sliding = min(samples * final, max(prefill + samples - 1, samples * decode))
        return (self.full_groups * full + self.sliding_groups * sliding
                + samples * self.state_blocks <= self.num_blocks)

    def _seq(self, seq_id: int) -> _HybridSeq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise AllocatorError(f"unknown sequence {seq_id}") from None

    def _key(self, block_hash: int, group: int) -> int:
        """The cache key of a block of ``group`` with content ``block_hash``."""
        return block_hash if group == 0 else hash((block_hash, group))

    # ------------------------------------------------------------------ prefix hits
    def _cached(self, block_hash: int, groups: range) -> bool:
        """Whether every group of ``groups`` has a cached block of that content."""
        return all(self.pool.lookup(self._key(block_hash, group)) is not None
                   for group in groups)

    def _hit_length(self, spec: SeqSpec, hasher: BlockHasher) -> int:
        """Prefix-hit blocks, by vLLM v1's hybrid rule (module docstring)."""
        if not self.enable_prefix_caching:
            return 0
        limit = (spec.prompt_len - 1) // self.block_size
        hashes = hasher.hash_upto(limit)
        full = range(self.full_groups)
        length = 0
        if self.full_groups:
            while length < limit and self._cached(hashes[length], full):
                length += 1
        else:
            length = limit
        if self.caches_states:  # the last boundary at or before it with every state kept
            states = self._state_group_ids
            while length and not self._cached(hashes[length - 1], states):
                length -= 1
            return length
        sliding = range(self.full_groups, self.groups)
        run = 0
        for idx in range(length - 1, -1, -1):  # the last window of cached blocks
            if not self._cached(hashes[idx], sliding):
                run = 0
                continue
            run += 1
            if run >= self.window_blocks:
                return idx + run
        return run  # a run from block 0, shorter than a window

    def lookup(self, spec: SeqSpec) -> int:
        """Prefix-hit tokens ``spec`` would get now (no state changes)."""
        return self._hit_length(spec, BlockHasher(spec.segments, self.block_size)) * (
            self.block_size)

    def cached_prefix_tokens(self, spec: SeqSpec, hasher: BlockHasher) -> int:
        return self._hit_length(spec, hasher) * self.block_size

    # ------------------------------------------------------------------ lifecycle
    def admit(self, spec: SeqSpec, max_new_tokens: int | None = None) -> int | None:
        if spec.seq_id in self._seqs:
            raise AllocatorError(f"sequence {spec.seq_id} is already admitted")
        bs = self.block_size
        # A head of the line refused for memory asks again, often: its hashes are the same.
        if self._refused is not None and self._refused[0] is spec:
            hasher = self._refused[1]
        else:
            hasher = BlockHasher(spec.segments, bs)
        length = self._hit_length(spec, hasher)
        hashes = hasher.hashes
        claim = claim_end(spec, length * bs, max_new_tokens)
        released = self.release_point(length * bs)  # what the first new token cannot see
        hits: list[list[KVBlock]] = []
        for group in range(self.groups):
            start = 0 if group < self.full_groups else released
            hits.append([self.pool.lookup(self._key(hashes[i], group))  # type: ignore[misc]
                         for i in range(start, length)])
        # The states kept at the hit's end, copied into the sequence's own at once. (vLLM
        # holds them through the step that copies them, which here would keep a request
        # that fills the pool but for them out of it for good.)
        state_hits: list[KVBlock] = []
        if length and self.caches_states:
            for group in self._state_group_ids:
                kept = self.pool.lookup(self._key(hashes[length - 1], group))
                assert kept is not None, "a hit ends where every state is cached"
                state_hits.append(kept)
        revived = sum(1 for table in hits for b in table if b.ref_cnt == 0)
        need = self.full_groups * (self.blocks_for(claim) - length)
        # Revived sliding-window hits will be this sequence's alone.
        alone = sum(1 for table in hits[self.full_groups:] for b in table if b.ref_cnt == 0)
        promised = max(0, self.sliding_groups * self._prefill_peak(spec, length * bs, claim)
                       - alone)
        # A hit on a sliding-window block another prefill holds alone means that giving it
        # back will free nothing: that prefill's promise grows.
        taken = {b.block_id for table in hits[self.full_groups:] for b in table
                 if b.ref_cnt == 1}
        repromised = {seq: self._promise(seq, seq.num_tokens, taken)
                      for seq in self._seqs.values()
                      if seq.num_tokens < seq.spec.prompt_len} if taken else {}
        grown = sum(p - seq.promised for seq, p in repromised.items())
        reserve = self.watermark_blocks if self._seqs else 0
        if need + promised + grown + self.state_blocks > (
                self.pool.num_free - self._promised - revived - reserve):
            self._refused = (spec, hasher)
            return None
        self._refused = None
        for seq, p in repromised.items():
            self._promised += p - seq.promised
            seq.promised = p
        duplicates = self._duplicates
        # Every hit first: a block taken afterwards may evict any cached block left at ref 0.
        for found in hits:
            for block in found:
                if block.ref_cnt == 0:
                    self._token_slots += block.num_filled
                    duplicates.add(block.block_hash)  # type: ignore[arg-type]
                    block.counted = True
                self.pool.touch(block)
        for block in state_hits:  # used: the last to be evicted (LRU)
            self.pool.touch(block)
            self.pool.release(block)
        tables: list[list[KVBlock | None]] = []
        for group, found in enumerate(hits):
            table: list[KVBlock | None] = [None] * (length - len(found))
            table += found
            if group < self.full_groups:
                table += [self.pool.take() for _ in range(need // self.full_groups)]
            tables.append(table)
        seq = _HybridSeq(spec, tables, hasher, bs)
        for _ in range(self.state_blocks):
            seq.states.append(self._new_state())
        seq.num_tokens = length * bs
        seq.released = released
        seq.promised = promised
        seq.claim_end = claim
        seq.per_chunk = max_new_tokens is not None
        self._promised += promised
        self._seqs[spec.seq_id] = seq
        self._set_internal(seq)
        self.num_hit_blocks += length
        return seq.num_tokens

    def _new_state(self) -> KVBlock:
        """A block holding a sequence's running state (written whole at once)."""
        state = self.pool.take()
        state.num_filled = self.state_slots
        self._token_slots += self.state_slots
        return state

    def _kept_states(self, seq: _HybridSeq, start: int, end: int) -> list[int]:
        """The block boundaries whose states an append of tokens ``start`` to ``end`` keeps
        in the prefix cache (of states: ``caches_states``): the boundary the last step ended
        on, and those its decode steps ended on; a prefill chunk's inner boundaries end no
        step, so their states never exist (vLLM aligns chunks to blocks for this), but under
        ``caches_every_state`` (mode "all") the kernel writes them too."""
        bs = self.block_size
        boundaries = range(max(bs, -(-start // bs) * bs), end, bs)
        if self.caches_every_state:
            return list(boundaries)
        prompt = seq.spec.prompt_len
        return [b for b in boundaries if b == start or b >= prompt]

    def _keep_states(self, seq: _HybridSeq, boundary: int) -> None:
        """Leave the sequence's running states, the states at ``boundary``, to the prefix
        cache (each under its group's key) and go on in new blocks, as vLLM's align mode
        keeps the block a state was written to and writes the next state to a new one.
        Each new block is taken after the old one is left, so that keeping a state never
        needs memory: in a pool with nothing else to give, the new block evicts a cached
        one by the eviction policy, the state just kept among them (vLLM takes the new
        block first, for a step)."""
        block_hash = seq.hasher.hashes[boundary // self.block_size - 1]
        for index, group in enumerate(self._state_group_ids):
            kept = seq.states[index]
            self.pool.register(kept, self._key(block_hash, group))
            self._token_slots -= drop_reference(self.pool, kept, self._duplicates)
            seq.states[index] = self._new_state()

    def _set_internal(self, seq: _HybridSeq) -> None:
        """Recount the sequence's slots past its final length (after its tables changed
        shape: its tails are its own from then on)."""
        if seq.spec.seq_id in self._shared_tail:
            self._shared_tail.discard(seq.spec.seq_id)
        else:
            self._internal -= seq.internal
        final = seq.final_len
        seq.internal = sum(max(0, len(t) * self.block_size - final) for t in seq.tables) + (
            self._state_padding)
        self._internal += seq.internal

    def _drop(self, block: KVBlock) -> None:
        """Give back one table's reference to ``block``."""
        self._token_slots -= drop_reference(self.pool, block, self._duplicates)

    def _release(self, seq: _HybridSeq, point: int) -> None:
        """Give back every sliding-window block before ``point``, the last first (as vLLM's
        remove_skipped_blocks does: the earlier blocks become the more recently used)."""
        if point <= seq.released:
            return
        for table in seq.tables[self.full_groups:]:
            for idx in range(point - 1, seq.released - 1, -1):
                block = table[idx]
                if block is not None:
                    table[idx] = None
                    self._drop(block)
        seq.released = point

    def _freed_by_release(self, seq: _HybridSeq, point: int) -> int:
        """Blocks ``_release(seq, point)`` would return to the pool."""
        freed = 0
        for table in seq.tables[self.full_groups:]:
            for idx in range(seq.released, min(point, len(table))):
                block = table[idx]
                if block is not None and block.ref_cnt == 1:
                    freed += 1
        return freed

    @staticmethod
    def _last_step_start(seq: _HybridSeq, end: int, step_start: int | None = None) -> int:
        """The first token the last step of an append from ``seq.num_tokens`` to ``end``
        computes: ``step_start`` where the caller says (a speculative step keeps several),
        else a prompt chunk's first (one step computes it), or one generated token a step."""
        if step_start is not None:
            return step_start
        return seq.num_tokens if end <= seq.spec.prompt_len else end - 1

    def _exclusive(self, seq: _HybridSeq, taken: set[int] | frozenset[int] = frozenset()
                   ) -> int:
        """Sliding-window blocks only this sequence holds (giving them back frees them),
        ``taken`` ones apart (about to be shared)."""
        return sum(1 for table in seq.tables[self.full_groups:]
                   for block in table[seq.released:]
                   if block is not None and block.ref_cnt == 1
                   and block.block_id not in taken)

    def _promise(self, seq: _HybridSeq, start: int,
                 taken: set[int] | frozenset[int] = frozenset()) -> int:
        """Blocks to keep for the rest of the prefill from ``start``: the peak of every
        sliding-window table, less the blocks they hold alone (a shared block given back
        frees nothing, so it cannot count towards the peak). Only a sequence holding a
        block alone can make it shared, by a prefix hit: admission then grows the promise.
        Under per-chunk allocation only what admission claimed is promised."""
        if start >= seq.spec.prompt_len or (seq.per_chunk and start >= seq.claim_end):
            return 0
        peak = self.sliding_groups * self._prefill_peak(seq.spec, start, seq.claim_end)
        return max(0, peak - self._exclusive(seq, taken))

    def _repromise(self, seq: _HybridSeq) -> None:
        """Promise what the rest of the sequence's prefill needs, from its tokens on."""
        self._promised -= seq.promised
        seq.promised = self._promise(seq, seq.num_tokens)
        self._promised += seq.promised

    def append(self, seq_id: int, num_tokens: int, lookahead: int = 0,
               step_start: int | None = None) -> bool:
        """Record ``num_tokens`` more written tokens and hold ``lookahead`` slots past them
        (see :meth:`KVAllocator.append`); ``step_start`` is the first token the append's last
        step computed, where that step kept more than one generated token (speculative
        decoding): its windows give back what that token cannot see."""
        seq = self._seq(seq_id)
        if num_tokens <= 0:
            return num_tokens == 0
        bs = self.block_size
        start = seq.num_tokens
        end = start + num_tokens
        if end > seq.final_len:
            raise write_past_end(seq_id, end, seq.final_len)
        if step_start is not None and not start <= step_start < end:
            raise AllocatorError(f"sequence {seq_id}: the last step of an append of tokens "
                                 f"{start} to {end} cannot start at token {step_start}")
        last_step_start = self._last_step_start(seq, end, step_start)
        # Lookahead slots are held, not written: blocks past the tokens count as reserved.
        claim = end
        if lookahead > 0:
            claim = min(end + lookahead, seq.final_len)
            seq.claimed = max(seq.claimed, claim)
        # As each step does: give back what its first token cannot see, then take blocks for
        # what it writes (and, speculating, holds for its drafts).
        first = min(self.release_point(start), self.blocks_for(start))
        target = self.blocks_for(claim)
        grow = sum(max(0, target - len(t)) for t in seq.tables)
        # Copy on write: the block each table writes into first is shared with a fork
        # (only a sequence whose tails a fork shared may hold one).
        idx = start // bs
        copies = [group for group, table in enumerate(seq.tables)
                  if idx < len(table) and table[idx].ref_cnt > 1  # type: ignore[union-attr]
                  ] if self._shared_tail and seq_id in self._shared_tail else []
        if grow or copies:
            available = (self.pool.num_free - (self._promised - seq.promised)
                         + self._freed_by_release(seq, first))
            if grow + len(copies) > available:
                return False
        self._release(seq, first)
        for group in copies:
            table = seq.tables[group]
            table[idx] = copy_for_write(self.pool, table[idx])  # type: ignore[arg-type]
            self._token_slots += table[idx].num_filled  # type: ignore[union-attr]
            self.num_cow_copies += 1
        if grow:
            for table in seq.tables:
                while len(table) < target:
                    table.append(self.pool.take())
        if grow or copies:
            self._set_internal(seq)
        written = self._write(seq, start, num_tokens)
        assert written == num_tokens * self.groups  # every token inside its own window
        if self.caches_states:  # (every append of a sliding-window model passes here)
            for boundary in self._kept_states(seq, start, end):
                self._keep_states(seq, boundary)
        seq.num_tokens = end
        # Decode tokens were computed one a step (or a speculative step's few): the last
        # step gave back more.
        self._release(seq, min(self.release_point(last_step_start), self.blocks_for(end)))
        self._repromise(seq)
        return True

    def _write(self, seq: _HybridSeq, start: int, num_tokens: int) -> int:
        """Fill blocks start // bs .. (end - 1) // bs of every group's table, where the
        table holds them, and hash the full ones; return the slots written."""
        bs = self.block_size
        hashes = seq.hasher.hash_upto((start + num_tokens) // bs)
        written = 0
        for group, table in enumerate(seq.tables):
            idx = start // bs
            room = bs - (start - idx * bs)
            remaining = num_tokens
            while remaining:
                take = room if room < remaining else remaining
                remaining -= take
                block = table[idx]
                if block is not None:
                    block.num_filled += take
                    written += take
                    if block.num_filled == bs:
                        key = self._key(hashes[idx], group)
                        self.pool.register(block, key)
                        if idx < seq.shared_blocks:
                            self._duplicates.add(key)
                            block.counted = True
                idx += 1
                room = bs
        self._token_slots += written
        return written

    def arrive(self, seq_id: int, num_tokens: int) -> bool:
        """Write ``num_tokens`` whose KV was computed elsewhere (another replica's prefill,
        sent over): the full-attention tables take every block, the sliding-window ones
        only the blocks the next token computed here sees, as vLLM's P/D connectors send
        a sliding layer's last window alone. False (nothing changed) if memory is short."""
        seq = self._seq(seq_id)
        if num_tokens <= 0:
            return num_tokens == 0
        start = seq.num_tokens
        end = start + num_tokens
        if end > seq.final_len:
            raise write_past_end(seq_id, end, seq.final_len)
        keep = max(self.release_point(end), seq.released)  # blocks before it: never held
        target = self.blocks_for(end)
        sliding = seq.tables[self.full_groups:]
        grow = (sum(max(0, target - len(t)) for t in seq.tables[:self.full_groups])
                + sum(max(0, target - max(len(t), keep)) for t in sliding))
        available = (self.pool.num_free - (self._promised - seq.promised)
                     + self._freed_by_release(seq, keep))
        if grow > available:
            return False
        for table in sliding:
            table.extend([None] * (keep - len(table)))
        self._release(seq, keep)
        for table in seq.tables:
            while len(table) < target:
                table.append(self.pool.take())
        self._set_internal(seq)
        self._write(seq, start, num_tokens)
        seq.num_tokens = end
        self._repromise(seq)
        return True

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise AllocatorError(f"unknown sequence {seq_id}")
        if seq_id in self._shared_tail:
            self._shared_tail.discard(seq_id)
        else:
            self._internal -= seq.internal
        self._promised -= seq.promised
        # Group by group, each deepest first (vLLM frees each group's table in reverse).
        for table in seq.tables:
            for block in reversed(table):
                if block is not None:
                    self._drop(block)
        for state in seq.states:
            self._drop(state)

    def fork(self, parent_id: int, child: SeqSpec) -> bool:
        """The child holds every block of the parent's tables (what the parent's windows
        gave back too), each written block once more referenced; the first write into a
        shared one copies it. Forks take no block, so they never fail."""
        parent = self._seq(parent_id)
        if self.state_groups:
            raise AllocatorError(f"sequence {parent_id}: a recurrent state is not shared, so "
                                 "a state-space model's samples are not forked")
        if parent.num_tokens < parent.spec.prompt_len:
            raise AllocatorError(f"sequence {parent_id} cannot fork before its prompt is written")
        if child.seq_id in self._seqs:
            raise AllocatorError(f"sequence {child.seq_id} is already admitted")
        if any(len(t) > self.blocks_for(parent.num_tokens) for t in parent.tables):
            # Its blocks past the tokens would be shared empty, and written by both.
            raise AllocatorError(f"sequence {parent_id} holds lookahead slots; fork it before "
                                 "it claims any (samples fork at the prompt's end)")
        tables = [list(table) for table in parent.tables]
        for table in tables:
            for block in table:
                if block is not None:
                    self.pool.touch(block)
        seq = _HybridSeq(child, tables, parent.hasher.copy(child.segments), self.block_size)
        seq.num_tokens = parent.num_tokens
        seq.released = parent.released
        seq.claim_end = parent.claim_end
        seq.per_chunk = parent.per_chunk
        seq.claimed = parent.claimed
        self._seqs[child.seq_id] = seq
        if parent.num_tokens % self.block_size:
            # The partial tails are shared now: their unwritten slots count per block.
            if parent_id not in self._shared_tail:
                self._internal -= parent.internal
                self._shared_tail.add(parent_id)
            self._shared_tail.add(child.seq_id)
        else:
            self._set_internal(seq)
        return True

    def appends_fit(self, seq_ids: list[int], num_tokens: int, lookahead: int = 0,
                    step_start: int | None = None) -> bool:
        """Whether :meth:`append` of ``num_tokens`` (``lookahead``, ``step_start``) to each
        sequence, one after another, succeeds: each gives back what its windows no longer
        see, copies what it shares with a fork and grows its tables, in turn, a block
        shared by several freed only by the last to give it back. Exact for sequences past
        their prompts (samples); a prompt's promise after a chunk is estimated before it."""
        refs: dict[int, int] = {}  # block id → references left as the appends go
        available = self.pool.num_free - self._promised

        def give_back(seq: _HybridSeq, start: int, point: int) -> int:
            freed = 0
            for table in seq.tables[self.full_groups:]:
                for block in table[start:min(point, len(table))]:
                    if block is not None:
                        left = refs.get(block.block_id, block.ref_cnt) - 1
                        refs[block.block_id] = left
                        freed += not left
            return freed

        for seq_id in seq_ids:
            seq = self._seq(seq_id)
            start = seq.num_tokens
            end = start + num_tokens
            claim = min(end + lookahead, seq.final_len) if lookahead > 0 else end
            first = self.release_point(start)
            available += seq.promised + give_back(seq, seq.released, first)
            idx = start // self.block_size
            copies = 0
            for table in seq.tables:
                block = table[idx] if idx < len(table) else None
                held = refs.get(block.block_id, block.ref_cnt) if block is not None else 0
                if held > 1:
                    refs[block.block_id] = held - 1  # type: ignore[union-attr]
                    copies += 1
            target = self.blocks_for(claim)
            available -= copies + sum(max(0, target - len(t)) for t in seq.tables)
            if available < 0:
                return False
            point = self.release_point(self._last_step_start(seq, end, step_start))
            available += give_back(seq, max(first, seq.released), point)
            available -= self._promise(seq, end)
        return True

    def max_uniform_append(self, seq_ids: list[int], limit: int) -> int:
        """Largest k ≤ limit such that appending k tokens to each sequence, one after
        another, succeeds (:meth:`appends_fit`)."""
        for k in range(limit, 0, -1):
            if self.appends_fit(seq_ids, k):
                return k
        return 0

    # ------------------------------------------------------------------ accounting
    def snapshot(self, waiting: SeqSpec | None = None) -> MemorySnapshot:
        internal = self._internal
        if self._shared_tail:
            internal += shared_tail_internal(
                (table[-1].block_id, len(table) * self.block_size, seq.final_len)
                for seq in map(self._seqs.__getitem__, self._shared_tail)
                for table in seq.tables if table[-1] is not None)
        return self.pool.taxonomy(self.block_size, self._token_slots, internal,
                                  self._duplicates.duplicate_units)

    def check_invariants(self) -> None:
        bs = self.block_size
        refs = [0] * self.num_blocks  # tables holding each block, by id (see PagedAllocator)
        for seq in self._seqs.values():
            least, most = table_token_bounds(seq.spec, seq.num_tokens, seq.per_chunk)
            most = max(most, seq.claimed)
            for group, table in enumerate(seq.tables):
                if group < self.full_groups:
                    assert self.blocks_for(least) <= len(table) <= self.blocks_for(most), (
                        "full-attention table length does not match the tokens written")
                    assert None not in table, "a full-attention table gave a block back"
                else:
                    # (Speculating, it may hold the drafts' slots past its tokens.)
                    assert self.blocks_for(seq.num_tokens) <= len(table) <= (
                        self.blocks_for(max(seq.num_tokens, seq.claimed))), (
                        "sliding-window table length does not match the tokens written")
                    assert all(b is None for b in table[:seq.released]), "released block kept"
                    assert None not in table[seq.released:], "block in the window given back"
                    if seq.num_tokens:
                        last = self.release_point(max(0, seq.num_tokens - 1))
                        assert seq.released <= min(last + 1, len(table)), "window given back"
                for idx, block in enumerate(table):
                    if block is None:
                        continue
                    refs[block.block_id] += 1
                    if idx < seq.num_tokens // bs:
                        assert block.num_filled == bs
                        assert block.block_hash == self._key(seq.hasher.hashes[idx], group)
            assert len(seq.states) == self.state_blocks, "a state group holds no state"
            for state in seq.states:
                refs[state.block_id] += 1
                assert state.num_filled == self.state_slots and state.block_hash is None
            if seq.spec.prompt_len <= seq.num_tokens:
                assert seq.promised == 0, "a prefilled sequence keeps a promise"
        assert self._promised == sum(s.promised for s in self._seqs.values())
        assert 0 <= self._promised <= self.pool.num_free, "promised more than the pool has"
        token_slots = 0
        live_hashed = 0  # blocks held by a table whose content is hashed
        live_hashes: set[int] = set()
        for block in self.pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"{block}: ref_cnt != {refs[block.block_id]} tables holding it")
            if block.ref_cnt:
                assert block not in self.pool.evictable, f"{block} is referenced and evictable"
                token_slots += block.num_filled
                if block.block_hash is not None:
                    live_hashed += 1
                    live_hashes.add(block.block_hash)
        assert token_slots == self._token_slots, "token slot counter drifted"
        assert live_hashed - len(live_hashes) == self._duplicates.duplicate_units, (
            "duplicate counter drifted")
        assert self._internal == sum(
            max(0, len(t) * bs - s.final_len) for s in self._seqs.values() for t in s.tables
            if s.spec.seq_id not in self._shared_tail) + self._state_padding * sum(
            s.spec.seq_id not in self._shared_tail for s in self._seqs.values()), (
            "internal counter drifted")
        snap = self.snapshot()
        assert snap.total == self.capacity_slots, "taxonomy does not sum to the pool"
        assert min(snap.as_dict().values()) >= 0, f"negative category in {snap}"
