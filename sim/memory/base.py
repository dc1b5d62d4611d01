"""The contract every KV allocator keeps, and the one taxonomy both families report in.

An allocator is a landlord of token slots. Tenants (sequences) move in (:meth:`admit`), grow
(:meth:`append`), may split into several (:meth:`fork`) and move out (:meth:`free`). At any
moment the landlord can say what every slot is doing (:meth:`snapshot`), in categories that
add up to the whole building.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from sim.memory.content import BlockHasher, Segments

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

TokenCounts = TypeVar("TokenCounts", int, "np.ndarray", "pd.Series")
"""A number of tokens, or a trace column of them."""

TAXONOMY = ("token", "reserved", "internal", "external", "cached", "free")
"""Slot categories, in plotting order; they partition the pool."""


class AllocatorError(RuntimeError):
    """A caller broke the allocator's contract (unknown sequence, write past the end, …)."""


def write_past_end(seq_id: int, end: int, final_len: int) -> AllocatorError:
    """The error for a write that would take sequence ``seq_id`` to ``end`` tokens, past its
    final length."""
    return AllocatorError(f"sequence {seq_id}: writing to {end} tokens, past its final length "
                          f"{final_len}")


@dataclass(frozen=True, slots=True)
class SeqSpec:
    """What the allocator is told about a sequence when it is admitted.

    ``segments`` describe the content of every token the sequence will ever hold (prompt then
    output); ``final_len`` is how many tokens' KV it holds at the end (:func:`final_kv_tokens`:
    the last generated token's is never written), known to the simulator from the trace, so
    that ``reserved`` (will be written) and ``internal`` (never will) are exact.
    ``max_len`` is prompt + the request's ``max_tokens`` (what a ``request_max`` reservation
    must cover). ``predicted_len`` is the final length the engine's output-length predictor
    expects (what a ``predicted`` reservation covers; it may fall short of ``final_len``);
    0 where the engine has no predictor.
    """

    seq_id: int
    segments: Segments
    prompt_len: int
    final_len: int
    max_len: int
    predicted_len: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.prompt_len <= self.final_len <= self.max_len:
            raise ValueError(
                f"sequence {self.seq_id}: need 0 < prompt_len <= final_len <= max_len, got "
                f"{self.prompt_len}, {self.final_len}, {self.max_len}"
            )


def final_kv_tokens(prompt_len: TokenCounts, output_len: TokenCounts) -> TokenCounts:
    """Tokens whose KV a request of ``prompt_len`` prompt and ``output_len`` generated tokens
    holds when it finishes: a token's KV is computed when it is a step's input, and the last
    generated token never is one (vLLM v1 claims a token's slot the step after sampling it,
    and a request ends with its last sample)."""
    return prompt_len + output_len - 1


def claim_end(spec: SeqSpec, ready: int, max_new_tokens: int | None) -> int:
    """Tokens an admission claims memory for: the whole prompt (the first generated token's
    slot is claimed by the step that reads it, as every later token's); with
    ``max_new_tokens`` (per-chunk allocation), only the ``ready`` tokens (prefix hits) and
    that many more, unless they reach the prompt's end."""
    if max_new_tokens is None or ready + max_new_tokens >= spec.prompt_len:
        return spec.prompt_len
    return ready + max_new_tokens


def table_token_bounds(spec: SeqSpec, num_tokens: int, per_chunk: bool) -> tuple[int, int]:
    """The tokens a sequence's (full-attention) block table must cover and may cover at
    most, ``num_tokens`` written: admission claims the prompt, or per chunk only what it
    writes; a fork inherits its parent's table."""
    least = num_tokens if per_chunk else max(spec.prompt_len, num_tokens)
    return least, max(spec.prompt_len, num_tokens)


class MemorySnapshot(NamedTuple):
    """Every slot of the pool in exactly one category, plus ``duplicate`` token slots.

    ``duplicate`` counts token slots whose KV is identical to another live sequence's — sharing
    that did not happen; it is a subset of ``token``, not a separate category. (A named tuple:
    the engine takes one at every scheduling point.)
    """

    token: int
    reserved: int
    internal: int
    external: int
    cached: int
    free: int
    duplicate: int

    @property
    def total(self) -> int:
        return (
            self.token + self.reserved + self.internal + self.external + self.cached + self.free
        )

    def as_dict(self) -> dict[str, int]:
        return self._asdict()


class KVAllocator(ABC):
    """One interface for contiguous reservation and paged allocation."""

    capacity_slots: int
    last_loaded_tokens: int  # of the last admission's hits, tokens read from a host tier

    @abstractmethod
    def admit(self, spec: SeqSpec, max_new_tokens: int | None = None) -> int | None:
        """Give ``spec`` memory for its prompt; return prefix-hit tokens, or None if it cannot
        be placed now (nothing changes then).

        ``max_new_tokens`` (vLLM v1's per-chunk allocation) limits the claim to the prefix
        hits and the first ``max_new_tokens`` prompt tokens after them (and the first
        generated token if that reaches the prompt's end); the rest is appended chunk by
        chunk, and an append may then find memory short. None claims the whole prompt."""

    def cached_prefix_tokens(self, spec: SeqSpec, hasher: BlockHasher) -> int:
        """Prompt tokens of ``spec``, from its first, whose KV the GPU pool's prefix cache
        holds now (no state change): what longest-prefix-match scheduling ranks a waiting
        request by. ``hasher`` walks ``spec``'s content at this allocator's block size; the
        caller keeps it, so that asking again hashes nothing twice. 0 without a prefix
        cache, as here."""
        return 0

    @abstractmethod
    def append(self, seq_id: int, num_tokens: int, lookahead: int = 0) -> bool:
        """Record ``num_tokens`` more written tokens, and hold slots for ``lookahead`` more
        past them (as far as the final length: speculative decoding's drafts, written by the
        step and overwritten by the next where rejected); False (and no change) if memory
        is short."""

    @abstractmethod
    def free(self, seq_id: int) -> None:
        """Release everything the sequence holds."""

    @abstractmethod
    def fork(self, parent_id: int, child: SeqSpec) -> bool:
        """Start ``child`` as a copy of ``parent_id``'s current tokens; False if no memory."""

    def admit_forks(self, parent: SeqSpec, samples: list[SeqSpec], tokens: int) -> int | None:
        """Seat a group of samples whose KV comes back whole (swapped in), as it was:
        ``parent``'s prompt (found cached, or written), the ``samples`` forked from it at the
        prompt's end, and each of them written on to ``tokens``, its own. The prompt tokens
        found cached, or None (nothing taken) if the pool cannot hold the group with a slot
        more for each sample, the next step's."""
        raise AllocatorError(f"{type(self).__name__} does not seat a group swapped back in")

    @abstractmethod
    def num_tokens(self, seq_id: int) -> int:
        """Tokens the sequence has written (its computed context)."""

    @abstractmethod
    def allocated_slots(self, seq_id: int) -> int:
        """Slots the sequence holds now (its extent, or its blocks × block size)."""

    @abstractmethod
    def max_uniform_append(self, seq_ids: list[int], limit: int) -> int:
        """Largest k ≤ limit such that appending k tokens to each of ``seq_ids`` succeeds."""

    @abstractmethod
    def can_admit_ever(self, spec: SeqSpec) -> bool:
        """Whether ``spec`` would fit in an otherwise empty pool."""

    @property
    @abstractmethod
    def kv_cache_usage(self) -> float:
        """The share of the pool held now, 0 to 1, as vLLM's engines publish it
        (``kv_cache_usage``: blocks in use over all, a cached block no table holds counting as
        free; here also a contiguous pool's reserved extents over its slots)."""

    @abstractmethod
    def snapshot(self, waiting: SeqSpec | None = None) -> MemorySnapshot:
        """The taxonomy now; ``waiting`` is the head-of-line request (defines ``external``)."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise AssertionError if any internal invariant is broken (tests, debug mode)."""

    @property
    def state_slots_per_sequence(self) -> int:
        """Slots each live sequence's recurrent state fills (a state-space hybrid's, which
        count as ``token``); 0 for a model without state layers, as here."""
        return 0

    @property
    @abstractmethod
    def live_seq_ids(self) -> list[int]:
        """Sequences currently holding memory, in admission order."""
