"""What a token *is*, for the purpose of sharing KV.

A request's tokens are described as a list of segments ``(segment_id, length)``: "the first
``length`` tokens of text ``segment_id``". Two requests whose token sequences start with the
same segments hold identical KV for that prefix, so a block's identity is a chained hash of
its parent block's hash and the segment pieces it covers — exactly the role of vLLM's
``hash(parent_hash, block tokens, extra_key)``, without materialising token ids.

Python's ``hash`` of a tuple of ints is deterministic across processes (no salt, unlike
``str``), so runs are reproducible; a 64-bit collision is possible in principle and ignored,
as vLLM's default hash also does.
"""

from __future__ import annotations

from collections.abc import Sequence

Segments = Sequence[tuple[int, int]]

ROOT_HASH = 0x6B7673696D  # parent hash of block 0


class BlockHasher:
    """Walks one request's content block by block, producing chained full-block hashes.

    The cursor only moves forward; :meth:`copy` gives a fork its own cursor at the same place.
    """

    __slots__ = ("_block_size", "_hashes", "_seg_idx", "_seg_off", "_segments")

    def __init__(self, segments: Segments, block_size: int) -> None:
        self._segments = segments
        self._block_size = block_size
        self._seg_idx = 0
        self._seg_off = 0
        self._hashes: list[int] = []

    @property
    def hashes(self) -> list[int]:
        """Hashes of the blocks walked so far, block 0 first."""
        return self._hashes

    def copy(self, segments: Segments | None = None) -> BlockHasher:
        """A hasher at the same position; ``segments`` may replace the content *beyond* it."""
        other = BlockHasher(self._segments if segments is None else segments, self._block_size)
        other._seg_idx, other._seg_off = self._seg_idx, self._seg_off
        other._hashes = list(self._hashes)
        return other

    def advance(self) -> int:
        """Hash the next full block and return its hash (content must cover it)."""
        segs = self._segments
        need = self._block_size
        idx, off = self._seg_idx, self._seg_off
        parent = self._hashes[-1] if self._hashes else ROOT_HASH
        seg_id, seg_len = segs[idx]
        if seg_len - off > need:  # the common case: the block lies inside one segment
            key: tuple[int, ...] = (parent, seg_id, off, need)
            off += need
        else:
            pieces = [parent]
            while need:
                seg_id, seg_len = segs[idx]
                take = min(need, seg_len - off)
                if take > 0:
                    pieces += (seg_id, off, take)
                need -= take
                off += take
                if off == seg_len:
                    idx += 1
                    off = 0
            key = tuple(pieces)
        self._seg_idx, self._seg_off = idx, off
        block_hash = hash(key)
        self._hashes.append(block_hash)
        return block_hash

    def hash_upto(self, num_blocks: int) -> list[int]:
        """Ensure the first ``num_blocks`` block hashes exist; return the list."""
        while len(self._hashes) < num_blocks:
            self.advance()
        return self._hashes


class DuplicateCounter:
    """Counts live copies of each content hash; ``duplicate_units`` are copies beyond the first.

    Both allocator families feed it: paged with physical block hashes, contiguous with the
    hashes of each request's written full chunks, so "duplicate" means the same thing in both.
    """

    __slots__ = ("_copies", "duplicate_units")

    def __init__(self) -> None:
        self._copies: dict[int, int] = {}
        self.duplicate_units = 0

    def add(self, content_hash: int) -> None:
        n = self._copies.get(content_hash, 0)
        if n:
            self.duplicate_units += 1
        self._copies[content_hash] = n + 1

    def remove(self, content_hash: int) -> None:
        n = self._copies[content_hash] - 1
        if n:
            self.duplicate_units -= 1
            self._copies[content_hash] = n
        else:
            del self._copies[content_hash]
