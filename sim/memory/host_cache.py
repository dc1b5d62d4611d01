"""The host-memory tier: KV blocks evicted from the GPU, kept in CPU memory to load back.

The cloakroom's hooks are few, so a coat taken down to make room goes to a storeroom
downstairs instead of the bin. A guest who asks for it later waits while it is carried up
(a PCIe transfer, much faster than making the coat again: recomputing the prefill), and the
storeroom, full, throws out the coat that has waited longest. This is the write-back policy
of SGLang's HiCache and of vLLM's CPU offloading: a block goes down when the GPU evicts it,
and a copy stays downstairs after it is loaded back up.
"""

from __future__ import annotations

from collections import OrderedDict


class HostCache:
    """Content hashes of the blocks held in host memory, least recently used first out.

    Only hashes are kept: a block's identity is its content (see
    :mod:`sim.memory.content`), and the simulator needs no bytes.
    """

    __slots__ = ("_blocks", "capacity_blocks", "num_dropped", "num_loaded", "num_offloaded")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"the host cache must hold at least one block, got "
                             f"{capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.num_offloaded = 0  # blocks written down on GPU eviction
        self.num_loaded = 0  # blocks read back up on a prefix hit
        self.num_dropped = 0  # blocks thrown out of host memory to make room

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def offer(self, block_hash: int) -> None:
        """The GPU evicts a block: keep its content here (or refresh it if already here)."""
        blocks = self._blocks
        if block_hash in blocks:
            blocks.move_to_end(block_hash)
            return
        blocks[block_hash] = None
        self.num_offloaded += 1
        if len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
            self.num_dropped += 1

    def load(self, block_hash: int) -> None:
        """A prefix hit reads the block back to the GPU; the copy here stays, most recent."""
        self._blocks.move_to_end(block_hash)
        self.num_loaded += 1

    def ordered(self) -> list[int]:
        """Every held hash, next to be dropped first (for tests and inspection)."""
        return list(self._blocks)
