"""KV-cache allocators: contiguous reservation and paged blocks (with the hybrid manager's
groups for sliding-window models), one interface, one taxonomy."""

from sim.memory.base import (
    TAXONOMY,
    AllocatorError,
    KVAllocator,
    MemorySnapshot,
    SeqSpec,
    final_kv_tokens,
)
from sim.memory.block_pool import EVICTION_POLICIES
from sim.memory.contiguous import PLACEMENTS, RESERVE_POLICIES, ContiguousAllocator
from sim.memory.hybrid import HybridPagedAllocator
from sim.memory.paged import PagedAllocator

__all__ = [
    "EVICTION_POLICIES",
    "PLACEMENTS",
    "RESERVE_POLICIES",
    "TAXONOMY",
    "AllocatorError",
    "ContiguousAllocator",
    "HybridPagedAllocator",
    "KVAllocator",
    "MemorySnapshot",
    "PagedAllocator",
    "SeqSpec",
    "final_kv_tokens",
]
