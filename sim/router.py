"""Routers: which engine replica serves each new request.

A router is the host at a restaurant's door. ``round_robin`` seats parties at each table in
turn; ``least_loaded`` at the table with the fewest parties still eating; ``cache_aware``
(SGLang's router) remembers which table already has a party's friends, seats it there while
the room is balanced, and falls back to the emptiest table when it is not.

Routers know only what a real router knows: what they sent where, and which requests have
finished. They learn each fact at the simulated time it happens (an event queue applied up
to, and excluding, the arrival being routed), never from a replica's scheduler state, so the
same trace gives the same routing whether the engine steps or jumps.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

Segments = Sequence[tuple[int, int]]
RouterPolicy = Literal["least_loaded", "cache_aware"]  # round robin needs no router

_ARRIVE, _TOUCH, _FINISH = 0, 1, 2  # order of simultaneous events: fixed, not by insertion


def prefix_chain(segments: Segments) -> list[tuple[int, int]]:
    """(key, tokens) per leading run of a prompt's segments: key i names segments 0..i, so
    two prompts share key i exactly when their first i + 1 segments are equal."""
    chain = []
    key = 0
    for segment_id, length in segments:
        key = hash((key, segment_id, length))
        chain.append((key, length))
    return chain


class ApproximateTree:
    """What the router believes one replica caches: the prompt prefixes it sent there, least
    recently sent first out once they exceed ``capacity`` tokens (the replica's pool and host
    tier, which cannot hold more). SGLang's router keeps such a tree per worker, of text."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0  # tokens held
        self._prefixes: OrderedDict[int, int] = OrderedDict()  # key -> tokens, LRU first

    def match(self, chain: list[tuple[int, int]]) -> int:
        """Tokens of the longest prefix of ``chain`` held here."""
        matched = 0
        for key, tokens in chain:
            if key not in self._prefixes:
                break
            matched += tokens
        return matched

    def insert(self, chain: list[tuple[int, int]]) -> None:
        # Leaf first, so a prefix is always more recent than its extensions and eviction
        # trims the tree from its leaves, as a radix tree's LRU does.
        for key, tokens in reversed(chain):
            if key in self._prefixes:
                self._prefixes.move_to_end(key)
            else:
                self._prefixes[key] = tokens
                self.size += tokens
        while self.size > self.capacity:
            _, tokens = self._prefixes.popitem(last=False)
            self.size -= tokens


class Router:
    """Routes open arrivals by load (``least_loaded``, ``cache_aware``); ``round_robin`` needs
    no state and the engine assigns it up front. The engine tells the router of every request
    that will run on a replica (:meth:`assign` as it routes, :meth:`expect` for a session's
    later turns) and of every finish (:meth:`finished`), each at its simulated time.
    ``cache_slots`` is what one replica can cache (its GPU pool and host tier)."""

    def __init__(self, policy: RouterPolicy, replicas: int, cache_slots: int, *,
                 cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.0001) -> None:
        self.policy = policy
        self.replicas = replicas
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.load = [0] * replicas  # requests arrived and not finished, as of the last route
        self.trees = [ApproximateTree(cache_slots) for _ in range(replicas)]
        # (time, kind, request, replica, chain): applied in time order before each route.
        self._events: list[tuple[float, int, int, int, list[tuple[int, int]]]] = []

    def assign(self, replica: int, segments: Segments) -> None:
        """The request just routed will run on ``replica``: it loads it from now on (requests
        that arrive together see each other)."""
        self.load[replica] += 1
        if self.policy == "cache_aware":
            self.trees[replica].insert(prefix_chain(segments))

    def expect(self, request: int, replica: int, arrival_s: float, segments: Segments) -> None:
        """A request will arrive on ``replica`` at ``arrival_s`` (a session's next turn, which
        stays with its conversation): it adds to the load and to the tree from then on."""
        heapq.heappush(self._events, (arrival_s, _ARRIVE, request, replica, []))
        if self.policy == "cache_aware":
            heapq.heappush(self._events, (arrival_s, _TOUCH, request, replica,
                                          prefix_chain(segments)))

    def finished(self, request: int, replica: int, finished_s: float) -> None:
        heapq.heappush(self._events, (finished_s, _FINISH, request, replica, []))

    def _catch_up(self, now_s: float) -> None:
        events = self._events
        while events and events[0][0] < now_s:
            _, kind, _, replica, chain = heapq.heappop(events)
            if kind == _ARRIVE:
                self.load[replica] += 1
            elif kind == _FINISH:
                self.load[replica] -= 1
            else:
                self.trees[replica].insert(chain)

    def route(self, arrival_s: float, segments: Segments, prompt_len: int) -> int:
        """The replica for an open arrival. Call in arrival order; then :meth:`assign` it
        there unless the pool will refuse it."""
        self._catch_up(arrival_s)
        chain = prefix_chain(segments) if self.policy == "cache_aware" else []
        if self.policy == "least_loaded" or self._imbalanced():
            replica = self._least_loaded()
        else:
            matched = [tree.match(chain) for tree in self.trees]
            best = max(range(self.replicas), key=lambda r: (matched[r], -self.load[r], -r))
            if prompt_len and matched[best] / prompt_len > self.cache_threshold:
                replica = best
            else:  # no replica holds enough of it: the one with most room in its cache
                replica = min(range(self.replicas), key=lambda r: (self.trees[r].size, r))
        return replica

    def _imbalanced(self) -> bool:
        # SGLang's rule: both the gap and the ratio between the busiest and the idlest.
        high, low = max(self.load), min(self.load)
        return (high - low > self.balance_abs_threshold
                and high > self.balance_rel_threshold * low)

    def _least_loaded(self) -> int:
        return min(range(self.replicas), key=lambda r: (self.load[r], r))


__all__ = ["ApproximateTree", "Router", "RouterPolicy", "prefix_chain"]
