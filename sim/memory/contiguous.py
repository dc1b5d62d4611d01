"""Contiguous max-length reservation: the way serving engines managed KV before paging.

A parking lot with no painted bays: every arriving vehicle (request) is given one unbroken
stretch of kerb long enough for the longest it might ever become, and keeps it until it
leaves. Whatever it does not grow into is wasted (*internal* fragmentation); the gaps left
between parked vehicles may add up to plenty but be too short for the next one (*external*
fragmentation); and two vehicles carrying the same cargo (a shared prompt prefix) each carry
their own copy (*duplicate* slots).

A valet with a guess (``predicted``) sizes each stretch by how long the vehicle is expected
to grow (S3: an output-length predictor). Guess short and the vehicle reaches the end of its
stretch before it is done: a contiguous stretch cannot be lengthened where it stands, so
the allocator refuses the write and the scheduler sends the vehicle round again.

A model with state-space layers parks a trailer too: each stretch begins with
``state_slots`` slots of the sequence's recurrent state, written from the start.
"""

from __future__ import annotations

import bisect

from sim.memory.base import (
    AllocatorError,
    KVAllocator,
    MemorySnapshot,
    SeqSpec,
    write_past_end,
)
from sim.memory.content import BlockHasher, DuplicateCounter

RESERVE_POLICIES = ("max_model_len", "request_max", "pow2", "oracle", "predicted")
PLACEMENTS = ("first_fit", "best_fit")


def reservation_slots(spec: SeqSpec, reserve_policy: str, max_model_len: int) -> int:
    """Slots reserved for ``spec`` at admission.

    ``max_model_len``: the model's context limit (the seed's 4096); ``request_max``: prompt +
    max_tokens; ``pow2``: the next power of two ≥ the true final length (Orca (Pow2));
    ``oracle``: exactly the true final length (Orca (Oracle)). Never below the final length,
    but for ``predicted``: the predictor's final length (``spec.predicted_len``), at most what
    ``request_max`` reserves and at least the prompt, which may fall short.
    """
    if reserve_policy == "max_model_len":
        slots = max_model_len
    elif reserve_policy == "request_max":
        slots = min(spec.max_len, max_model_len)
    elif reserve_policy == "pow2":
        slots = min(1 << (spec.final_len - 1).bit_length(), max_model_len)
    elif reserve_policy == "oracle":
        slots = spec.final_len
    elif reserve_policy == "predicted":
        if spec.predicted_len < 1:
            raise ValueError(f"sequence {spec.seq_id}: reserve_policy predicted needs a "
                             "predicted_len")
        most = max(min(spec.max_len, max_model_len), spec.final_len)
        return max(min(spec.predicted_len, most), spec.prompt_len)
    else:
        raise ValueError(
            f"unknown reserve_policy {reserve_policy!r}; expected one of "
            f"{', '.join(RESERVE_POLICIES)}"
        )
    return max(slots, spec.final_len)


class _Extent:
    """A live sequence's reservation: ``size`` slots from ``start``, the first ``state`` of
    them its recurrent state (the allocator's ``state_slots``) and the rest its tokens' KV;
    ``num_tokens`` tokens written, ``will_write`` slots written by the end (its state and
    final length, or the size if shorter)."""

    __slots__ = ("hasher", "num_tokens", "size", "spec", "start", "will_write")

    def __init__(self, spec: SeqSpec, start: int, size: int, hasher: BlockHasher,
                 state: int) -> None:
        self.spec = spec
        self.start = start
        self.size = size
        self.will_write = min(spec.final_len, size - state) + state
        self.num_tokens = 0
        self.hasher = hasher


class ContiguousAllocator(KVAllocator):
    """One extent per sequence in a linear slot space, placed first-fit or best-fit.

    An extent never grows: a write past a ``predicted`` reservation is refused. Free space
    is a sorted list of maximal free extents (neighbours coalesce on free). Duplicate slots
    are measured on ``duplicate_granularity``-token chunks of written content. A model with
    state-space layers adds ``state_slots`` to every extent, for one sequence's state.
    """

    def __init__(
        self,
        capacity_slots: int,
        *,
        max_model_len: int,
        reserve_policy: str = "max_model_len",
        placement: str = "first_fit",
        duplicate_granularity: int = 16,
        state_slots: int = 0,
    ) -> None:
        if capacity_slots < 1:
            raise ValueError(f"the pool must hold at least one slot, got {capacity_slots}")
        if reserve_policy not in RESERVE_POLICIES:
            raise ValueError(
                f"unknown reserve_policy {reserve_policy!r}; expected one of "
                f"{', '.join(RESERVE_POLICIES)}"
            )
        if placement not in PLACEMENTS:
            raise ValueError(
                f"unknown placement {placement!r}; expected one of {', '.join(PLACEMENTS)}"
            )
        self.capacity_slots = capacity_slots
        self.last_loaded_tokens = 0  # no host tier: nothing is ever loaded
        self.max_model_len = max_model_len
        self.reserve_policy = reserve_policy
        self.placement = placement
        self.duplicate_granularity = duplicate_granularity
        self.state_slots = state_slots
        self._free_starts: list[int] = [0]
        self._free_len: dict[int, int] = {0: capacity_slots}
        self._seqs: dict[int, _Extent] = {}
        self._reserved_total = 0  # Σ extent sizes
        self._final_total = 0  # Σ will_write of live sequences
        self._token_total = 0
        self._duplicates = DuplicateCounter()

    @property
    def live_seq_ids(self) -> list[int]:
        return list(self._seqs)

    def reservation(self, spec: SeqSpec) -> int:
        """Slots reserved for ``spec``'s tokens (its state's come on top)."""
        slots = reservation_slots(spec, self.reserve_policy, self.max_model_len)
        if self.reserve_policy == "predicted":
            # A guess never asks for more than the pool: the request might still fit.
            slots = min(slots, self.capacity_slots - self.state_slots)
        return slots

    def num_tokens(self, seq_id: int) -> int:
        return self._seq(seq_id).num_tokens

    def allocated_slots(self, seq_id: int) -> int:
        """Slots of the sequence's extent for its tokens (its state's left out)."""
        return self._seq(seq_id).size - self.state_slots

    @property
    def state_slots_per_sequence(self) -> int:
        return self.state_slots

    def extent(self, seq_id: int) -> tuple[int, int]:
        """``(start, size)`` of the sequence's reservation."""
        ext = self._seq(seq_id)
        return ext.start, ext.size

    @property
    def free_extents(self) -> list[tuple[int, int]]:
        """Maximal free extents ``(start, length)`` in address order."""
        return [(s, self._free_len[s]) for s in self._free_starts]

    def can_admit_ever(self, spec: SeqSpec) -> bool:
        if self.reserve_policy == "predicted":  # some reservation would hold it
            return spec.final_len + self.state_slots <= self.capacity_slots
        return self.reservation(spec) + self.state_slots <= self.capacity_slots

    def _seq(self, seq_id: int) -> _Extent:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise AllocatorError(f"unknown sequence {seq_id}") from None

    # ------------------------------------------------------------------ placement
    def _find(self, size: int) -> int | None:
        if self.placement == "first_fit":
            for start in self._free_starts:
                if self._free_len[start] >= size:
                    return start
            return None
        best: int | None = None
        best_len = 0
        for start in self._free_starts:
            length = self._free_len[start]
            if length >= size and (best is None or length < best_len):
                best, best_len = start, length
        return best

    def can_place(self, specs: list[SeqSpec], at_least: int = 0) -> bool:
        """Whether extents for all of ``specs``, each of at least ``at_least`` slots, would
        be placed now, one after another (as admitting the first and forking the others
        places them): a trial run of the placement over the free extents' lengths."""
        free = [self._free_len[start] for start in self._free_starts]  # in address order
        for spec in specs:
            size = max(self.reservation(spec), at_least) + self.state_slots
            fitting = [i for i, length in enumerate(free) if length >= size]
            if not fitting:
                return False
            # What is left of an extent stays where it was, so the order never changes.
            chosen = fitting[0] if self.placement == "first_fit" else min(
                fitting, key=lambda i: free[i])
            free[chosen] -= size
        return True

    def _place(self, spec: SeqSpec, at_least: int = 0) -> _Extent | None:
        size = max(self.reservation(spec), at_least) + self.state_slots
        start = self._find(size)
        if start is None:
            return None
        length = self._free_len.pop(start)
        idx = bisect.bisect_left(self._free_starts, start)
        if length > size:
            self._free_starts[idx] = start + size
            self._free_len[start + size] = length - size
        else:
            del self._free_starts[idx]
        ext = _Extent(spec, start, size, BlockHasher(spec.segments, self.duplicate_granularity),
                      self.state_slots)
        self._seqs[spec.seq_id] = ext
        self._reserved_total += size
        self._final_total += ext.will_write
        self._token_total += self.state_slots
        return ext

    # ------------------------------------------------------------------ lifecycle
    def admit(self, spec: SeqSpec, max_new_tokens: int | None = None) -> int | None:
        # An extent is reserved whole at admission, however the prompt is then written.
        if spec.seq_id in self._seqs:
            raise AllocatorError(f"sequence {spec.seq_id} is already admitted")
        return None if self._place(spec) is None else 0

    def append(self, seq_id: int, num_tokens: int, lookahead: int = 0) -> bool:
        ext = self._seq(seq_id)
        if num_tokens <= 0:
            return num_tokens == 0
        end = ext.num_tokens + num_tokens
        if end > ext.spec.final_len:
            raise write_past_end(seq_id, end, ext.spec.final_len)
        if min(end + lookahead, ext.spec.final_len) > ext.size - self.state_slots:
            return False  # outgrew a predicted reservation: an extent cannot grow in place
        self._write(ext, end)
        return True

    def _write(self, ext: _Extent, end: int) -> None:
        granularity = self.duplicate_granularity
        hasher = ext.hasher
        for _ in range(end // granularity - ext.num_tokens // granularity):
            self._duplicates.add(hasher.advance())
        self._token_total += end - ext.num_tokens
        ext.num_tokens = end

    def free(self, seq_id: int) -> None:
        ext = self._seqs.pop(seq_id, None)
        if ext is None:
            raise AllocatorError(f"unknown sequence {seq_id}")
        for chunk_hash in ext.hasher.hashes[: ext.num_tokens // self.duplicate_granularity]:
            self._duplicates.remove(chunk_hash)
        self._reserved_total -= ext.size
        self._final_total -= ext.will_write
        self._token_total -= ext.num_tokens + self.state_slots
        self._release_extent(ext.start, ext.size)

    def _release_extent(self, start: int, size: int) -> None:
        """Return ``[start, start+size)`` to the free list, merging with free neighbours."""
        idx = bisect.bisect_left(self._free_starts, start)
        if idx < len(self._free_starts) and self._free_starts[idx] == start + size:
            size += self._free_len.pop(start + size)
            del self._free_starts[idx]
        if idx > 0:
            prev = self._free_starts[idx - 1]
            if prev + self._free_len[prev] == start:
                self._free_len[prev] += size
                return
        self._free_starts.insert(idx, start)
        self._free_len[start] = size

    def fork(self, parent_id: int, child: SeqSpec) -> bool:
        """Contiguous memory cannot share: the child gets its own extent and a copy."""
        parent = self._seq(parent_id)
        if child.seq_id in self._seqs:
            raise AllocatorError(f"sequence {child.seq_id} is already admitted")
        ext = self._place(child, at_least=parent.num_tokens)  # the copy must fit
        if ext is None:
            return False
        self._write(ext, parent.num_tokens)
        return True

    def admit_forks(self, parent: SeqSpec, samples: list[SeqSpec], tokens: int) -> int | None:
        """As :meth:`KVAllocator.admit_forks`: each sample has an extent of its own, the
        prompt copied into it."""
        group = [parent, *samples]
        for spec in group:
            if spec.seq_id in self._seqs:
                raise AllocatorError(f"sequence {spec.seq_id} is already admitted")
        if not self.can_place(group, at_least=tokens + 1):
            return None
        for spec in group:
            ext = self._place(spec, at_least=tokens + 1)
            assert ext is not None, "can_place found every extent"
            self._write(ext, tokens)
        return 0

    def max_uniform_append(self, seq_ids: list[int], limit: int) -> int:
        state = self.state_slots
        room = min(
            (self._seqs[s].will_write - state - self._seqs[s].num_tokens for s in seq_ids),
            default=limit,
        )
        return max(0, min(limit, room))

    # ------------------------------------------------------------------ accounting
    @property
    def kv_cache_usage(self) -> float:
        return self._reserved_total / self.capacity_slots

    def snapshot(self, waiting: SeqSpec | None = None) -> MemorySnapshot:
        free_total = self.capacity_slots - self._reserved_total
        external = 0
        if waiting is not None:
            need = self.reservation(waiting) + self.state_slots
            external = sum(n for n in self._free_len.values() if n < need)
        return MemorySnapshot(
            token=self._token_total,
            reserved=self._final_total - self._token_total,
            internal=self._reserved_total - self._final_total,
            external=external,
            cached=0,
            free=free_total - external,
            duplicate=self._duplicates.duplicate_units * self.duplicate_granularity,
        )

    def check_invariants(self) -> None:
        spans = sorted(
            [(e.start, e.size, "live") for e in self._seqs.values()]
            + [(s, n, "free") for s, n in self._free_len.items()]
        )
        assert sorted(self._free_len) == self._free_starts, "free list out of order"
        pos = 0
        prev_kind = ""
        for start, size, kind in spans:
            assert start == pos, f"extents overlap or leave a hole at {pos}"
            assert size > 0
            assert not (kind == prev_kind == "free"), f"free extents at {start} not coalesced"
            pos, prev_kind = start + size, kind
        assert pos == self.capacity_slots, "extents do not cover the slot space"
        state = self.state_slots
        for ext in self._seqs.values():
            room = ext.size - state  # slots for its tokens
            assert ext.num_tokens + state <= ext.will_write == min(
                ext.spec.final_len, room) + state
            assert ext.spec.final_len <= room or self.reserve_policy == "predicted"
        assert self._final_total == sum(e.will_write for e in self._seqs.values())
        assert self._reserved_total == sum(e.size for e in self._seqs.values())
        assert self._token_total == sum(e.num_tokens + state for e in self._seqs.values())
        snap = self.snapshot()
        assert snap.total == self.capacity_slots, "taxonomy does not sum to the pool"
        assert min(snap.as_dict().values()) >= 0, f"negative category in {snap}"
