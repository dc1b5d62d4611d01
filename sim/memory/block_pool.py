"""The physical side of paged KV memory: blocks, who references them, and which go next.

Picture a cloakroom with numbered hooks (blocks). A hook in use carries a count of the
tickets that point to it (``ref_cnt``). When the last ticket is returned, the coat is not
thrown out at once: if it is a *known* coat (the block has a content hash) it stays on the
hook as a cached coat someone may ask for again, and an eviction policy decides which cached
coat is taken down first when a new one must be hung. Hooks holding nothing worth keeping
(unhashed blocks) are always used before any cached coat is taken down.

A cloakroom may also keep a logbook (``events``): every known coat that joins the racks or
is taken down, with the time, which a host at the door reads to know what hangs here, as an
engine publishes KV events to NVIDIA Dynamo's router.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Iterable

from sim.memory.base import MemorySnapshot
from sim.memory.content import DuplicateCounter
from sim.memory.host_cache import HostCache

EVICTION_POLICIES = ("lru", "lfu", "fifo", "sharing_aware")


class KVBlock:
    """One physical block of ``block_size`` token slots.

    ``ref_cnt`` is the number of block tables holding it. ``block_hash`` is set once the block
    is full (its content identity) and kept after ``ref_cnt`` drops to 0, so a later request
    can hit it; it is cleared only when the block is reallocated (lazy eviction).
    The statistics (``acquire_count``, ``peak_ref_cnt``, ``cached_seq``, ``release_seq``)
    describe the current content and feed the eviction policies.
    """

    __slots__ = (
        "acquire_count",
        "block_hash",
        "block_id",
        "cached_seq",
        "counted",
        "num_filled",
        "peak_ref_cnt",
        "ref_cnt",
        "release_seq",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.num_filled = 0
        self.acquire_count = 0
        self.peak_ref_cnt = 0
        self.cached_seq = 0
        self.release_seq = 0
        self.counted = False  # in the allocator's duplicate count

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class EvictionPolicy(ABC):
    """Orders the *evictable* blocks: ref_cnt 0 and holding a content hash.

    ``push`` is called as a block becomes evictable (blocks of one released request arrive
    deepest first), ``discard`` when a prefix hit takes it back, ``pop`` to pick the victim.
    """

    name: str

    @abstractmethod
    def push(self, block: KVBlock) -> None: ...

    @abstractmethod
    def discard(self, block: KVBlock) -> None: ...

    @abstractmethod
    def pop(self) -> KVBlock: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block: KVBlock) -> bool: ...

    @abstractmethod
    def ordered(self) -> list[KVBlock]:
        """All evictable blocks, next victim first (for tests and inspection)."""


class LRUEviction(EvictionPolicy):
    """vLLM v1's free-queue order: least recently released first.

    A finished request's blocks are pushed in reverse (deepest block first), so the first
    victim is the deepest block of the least recently freed request and a prefix's shallow,
    widely shared blocks go last.
    """

    name = "lru"

    def __init__(self) -> None:
        self._queue: OrderedDict[int, KVBlock] = OrderedDict()

    def push(self, block: KVBlock) -> None:
        self._queue[block.block_id] = block

    def discard(self, block: KVBlock) -> None:
        del self._queue[block.block_id]

    def pop(self) -> KVBlock:
        return self._queue.popitem(last=False)[1]

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block: KVBlock) -> bool:
        return block.block_id in self._queue

    def ordered(self) -> list[KVBlock]:
        return list(self._queue.values())


class _KeyedEviction(EvictionPolicy):
    """A min-heap on a per-policy key with lazy deletion; the smallest key is the victim.

    Keys end with ``release_seq`` (a global release counter), never a block id, so the order
    does not depend on which physical block a request happened to get.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, ...], int, KVBlock]] = []
        self._members: dict[int, int] = {}  # block_id -> release_seq of its live heap entry

    @abstractmethod
    def key(self, block: KVBlock) -> tuple[int, ...]: ...

    def push(self, block: KVBlock) -> None:
        self._members[block.block_id] = block.release_seq
        heapq.heappush(self._heap, (self.key(block), block.release_seq, block))

    def discard(self, block: KVBlock) -> None:
        del self._members[block.block_id]

    def pop(self) -> KVBlock:
        while True:
            _, release_seq, block = heapq.heappop(self._heap)
            if self._members.get(block.block_id) == release_seq:
                del self._members[block.block_id]
                return block

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, block: KVBlock) -> bool:
        return block.block_id in self._members

    def ordered(self) -> list[KVBlock]:
        live = [
            (k, seq, b) for k, seq, b in self._heap if self._members.get(b.block_id) == seq
        ]
        return [b for _, _, b in sorted(live, key=lambda e: (e[0], e[1]))]


class LFUEviction(_KeyedEviction):
    """Fewest acquisitions (first allocation + every prefix hit) first; LRU among equals."""

    name = "lfu"

    def key(self, block: KVBlock) -> tuple[int, ...]:
        return (block.acquire_count, block.release_seq)


class FIFOEviction(_KeyedEviction):
    """Oldest content first: the order in which blocks were filled and hashed, reuse ignored."""

    name = "fifo"

    def key(self, block: KVBlock) -> tuple[int, ...]:
        return (block.cached_seq,)


class SharingAwareEviction(_KeyedEviction):
    """The seed's rule: blocks shared by more requests stay longer; isolated cold ones go first.

    Score = (peak_ref_cnt, acquire_count): ``peak_ref_cnt`` is the most block tables that held
    the block at the same moment (a system prompt under load: high; one request's private
    text: 1), ``acquire_count`` the requests that have used it over time. The lowest score is
    evicted first, least recently released among equals.
    """

    name = "sharing_aware"

    def key(self, block: KVBlock) -> tuple[int, ...]:
        return (block.peak_ref_cnt, block.acquire_count, block.release_seq)


def make_eviction_policy(name: str) -> EvictionPolicy:
    """An eviction policy by name (one of :data:`EVICTION_POLICIES`)."""
    policies: dict[str, type[EvictionPolicy]] = {
        "lru": LRUEviction,
        "lfu": LFUEviction,
        "fifo": FIFOEviction,
        "sharing_aware": SharingAwareEviction,
    }
    try:
        return policies[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; expected one of {', '.join(EVICTION_POLICIES)}"
        ) from None


class BlockPool:
    """All physical blocks, the free lists, and the prefix-cache map ``hash -> block``.

    Free blocks live in two places: ``_unhashed`` (a stack of blocks with nothing worth
    keeping; taken first) and the eviction policy (ref 0 but cached). Taking a cached block
    removes its hash from the map then, not when it was released — lazy eviction — and, with
    a ``host`` tier, writes its content down to host memory.

    With ``events`` (:meth:`log_events`), every hash that joins the map or leaves it is
    logged as ``(clock_s, hash, stored)``, stamped with ``clock_s``, which the scheduler keeps
    at the simulated time of what it asks (vLLM's BlockStored and BlockRemoved KV events).
    """

    def __init__(self, num_blocks: int, eviction: str = "lru", enable_caching: bool = True,
                 host: HostCache | None = None) -> None:
        self.enable_caching = enable_caching
        self.host = host
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Reversed so that pop() hands out block 0 first: easier to read in tests.
        self._unhashed: list[KVBlock] = self.blocks[::-1]
        self.evictable = make_eviction_policy(eviction)
        self.cached: dict[int, KVBlock] = {}
        self._release_counter = 0
        self._cache_counter = 0
        self.num_evictions = 0
        self.clock_s = 0.0  # the simulated time events are stamped with
        self.events: deque[tuple[float, int, bool]] | None = None

    def log_events(self) -> deque[tuple[float, int, bool]]:
        """Log the cache map's changes from now on; the log, oldest first, for a reader to
        consume from the left."""
        self.events = deque((self.clock_s, block_hash, True) for block_hash in self.cached)
        return self.events

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (unhashed + evictable)."""
        return len(self._unhashed) + self.evictable.__len__()

    @property
    def num_cached_free(self) -> int:
        return len(self.evictable)

    def take(self) -> KVBlock:
        """Hand out a block with ref_cnt 1, evicting a cached one only if none is unhashed."""
        if self._unhashed:
            block = self._unhashed.pop()
        else:
            block = self.evictable.pop()
            if self.cached.get(block.block_hash) is block:  # type: ignore[arg-type]
                del self.cached[block.block_hash]  # type: ignore[arg-type]
                if self.events is not None:
                    self.events.append((self.clock_s, block.block_hash, False))  # type: ignore[arg-type]
            if self.host is not None:
                self.host.offer(block.block_hash)  # type: ignore[arg-type]
            self.num_evictions += 1
        # Inlined KVBlock.reset(): this is the allocator's hottest line.
        block.block_hash = None
        block.num_filled = 0
        block.counted = False
        block.acquire_count = block.peak_ref_cnt = block.ref_cnt = 1
        return block

    def touch(self, block: KVBlock) -> None:
        """A prefix hit: one more table holds ``block`` (it leaves the evictable set at 0)."""
        if block.ref_cnt == 0:
            self.evictable.discard(block)
        block.ref_cnt += 1
        block.acquire_count += 1
        if block.ref_cnt > block.peak_ref_cnt:
            block.peak_ref_cnt = block.ref_cnt

    def release(self, block: KVBlock) -> bool:
        """Drop one reference; return True if the block became free (ref_cnt 0)."""
        block.ref_cnt -= 1
        if block.ref_cnt:
            return False
        block_hash = block.block_hash if self.enable_caching else None
        # A copy computed while the registered one was live takes over an empty map entry.
        if block_hash is not None:
            entry = self.cached.get(block_hash)
            if entry is None:
                self.cached[block_hash] = block
                if self.events is not None:
                    self.events.append((self.clock_s, block_hash, True))
            elif entry is not block:
                block_hash = None
        if block_hash is not None:
            self._release_counter += 1
            block.release_seq = self._release_counter
            self.evictable.push(block)
        else:
            block.block_hash = None
            self._unhashed.append(block)
        return True

    def forget(self, block: KVBlock) -> None:
        """A free block's content is dropped rather than kept for a later hit (SGLang's
        retraction frees what a request generated without caching it): it leaves the cache
        map and the evictable set for the unhashed stack, written nowhere."""
        assert block.ref_cnt == 0, "only a free block is forgotten"
        block_hash = block.block_hash
        if block_hash is None:
            return  # (already unhashed)
        self.evictable.discard(block)
        if self.cached.get(block_hash) is block:
            del self.cached[block_hash]
            if self.events is not None:
                self.events.append((self.clock_s, block_hash, False))
        block.block_hash = None
        self._unhashed.append(block)

    def register(self, block: KVBlock, block_hash: int) -> None:
        """Record a just-filled block's hash; it joins the cache map unless a copy is there."""
        block.block_hash = block_hash
        self._cache_counter += 1
        block.cached_seq = self._cache_counter
        if self.enable_caching and block_hash not in self.cached:
            self.cached[block_hash] = block
            if self.events is not None:
                self.events.append((self.clock_s, block_hash, True))

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def taxonomy(self, block_size: int, token_slots: int, internal: int,
                 duplicate_blocks: int) -> MemorySnapshot:
        """Every slot of the pool by category, given the slots written in blocks in use and
        those of them never to be written (``internal``): the rest of the blocks in use is
        ``reserved``, evictable blocks are ``cached``."""
        live = len(self.blocks) - self.num_free
        cached = self.num_cached_free * block_size
        return MemorySnapshot(
            token=token_slots,
            reserved=live * block_size - token_slots - internal,
            internal=internal,
            external=0,
            cached=cached,
            free=(len(self.blocks) - live) * block_size - cached,
            duplicate=duplicate_blocks * block_size,
        )


def drop_reference(pool: BlockPool, block: KVBlock, duplicates: DuplicateCounter) -> int:
    """Give back one block table's reference to ``block``; return the written slots that
    leave use (the block's, when the reference was its last), which ``duplicates`` stops
    counting too."""
    freed = 0
    if block.ref_cnt == 1:
        freed = block.num_filled
        if block.counted:
            duplicates.remove(block.block_hash)  # type: ignore[arg-type]
            block.counted = False
    pool.release(block)
    return freed


def copy_for_write(pool: BlockPool, block: KVBlock) -> KVBlock:
    """Copy on write: a fresh block holding ``block``'s tokens for the table about to
    write into it, and one reference less to ``block`` (a fork still holds it, so it is
    never freed here). The caller counts the copy's written slots."""
    copy = pool.take()
    copy.num_filled = block.num_filled
    pool.release(block)
    return copy


def shared_tail_internal(tails: Iterable[tuple[int, int, int]]) -> int:
    """``internal`` slots of tail blocks that forks share, once per physical block: for
    each (block id, its table's capacity in slots, a holder's final length), the capacity
    less the furthest any holder will write."""
    caps: dict[int, int] = {}
    will_write: dict[int, int] = {}
    for block_id, cap, final_len in tails:
        caps[block_id] = cap
        will_write[block_id] = max(will_write.get(block_id, 0), min(final_len, cap))
    return sum(caps[block_id] - written for block_id, written in will_write.items())
