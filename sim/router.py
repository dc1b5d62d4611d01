"""Routers: which engine replica serves each new request.

A router is the host at a restaurant's door. ``round_robin`` seats parties at each table in
turn; ``least_loaded`` at the table with the fewest parties still eating; ``vllm_dp``
(vLLM's balancer of its data-parallel ranks, until July 2026) counts a party still waiting
at a table four times one already eating; ``vllm_dp_2026`` (its balancer since) counts every
party once, never fewer than the host itself seated there and has not yet seen leave, and a
waiting party the more the fuller that table's kitchen is; ``cache_aware`` (SGLang's router)
remembers which table already has a party's friends, seats it there while the room is
balanced, and falls back to the emptiest table when it is not; ``kv_aware`` (NVIDIA Dynamo's
KV router) prices every table, the dishes its kitchen has yet to cook, the party's included,
plus the plates already on it, and picks the cheapest (or, with a temperature, draws a
table, the cheaper the likelier).

Routers know only what a real router knows: what they sent where, which requests have been
seated (or preempted, back in line), which have given their first token, and which have
finished; ``kv_aware`` with KV events also what each replica's prefix cache holds, from the
blocks its pool logged as stored or removed, as vLLM publishes them to Dynamo. They learn
each fact at the simulated time it happens (events applied up to, and excluding, the arrival
being routed), never from a replica's state as it is when the router looks, so the same
trace gives the same routing whether the engine steps or jumps.

What a router sends it knows at once; what the replicas report (seatings, first tokens,
finishes, KV events) may reach it late. With a report interval the host hears from the
kitchen only when a runner comes by, every ``stats_interval_s``: a fact reaches the router
at the first multiple of the interval after it happened, as vLLM's DP coordinator publishes
its ranks' counts to the front end every 100 ms, the front end adding each request it sends
meanwhile to its copy. ``vllm_dp_2026`` also reads how full each replica's KV cache was at
the last publication, as the replicas log it at the end of each step that changed it. vLLM
may run several front ends (API servers, ``front_ends``), each with its own copy: a request
reaches one of them, which knows what the others sent only from the coordinator's next
publication, and adds each request it sends as many times as there are front ends, guessing
that the others send as much.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from typing import Literal

from sim.memory.content import BlockHasher

Segments = Sequence[tuple[int, int]]
# The policies a Router follows (round robin needs none).
RouterPolicy = Literal["least_loaded", "vllm_dp", "vllm_dp_2026", "cache_aware", "kv_aware"]

# Order of simultaneous events: fixed, not by insertion.
_ARRIVE, _TOUCH, _PREEMPTED, _ADMITTED, _PREFILLED, _FINISH, _ANSWERED = 0, 1, 2, 3, 4, 5, 6

# vLLM's DP load balancer scores a rank 4 × its waiting requests + its running ones.
VLLM_DP_WAITING_WEIGHT = 4

# vLLM's DP balancer since July 2026 (vllm_dp_2026) adds to a rank's score its waiting
# requests × 6 × how far its KV cache usage is over a half (none at or under a half).
VLLM_DP_KV_PENALTY = 6.0
VLLM_DP_KV_PENALTY_FROM = 0.5

# vLLM's DP coordinator publishes its ranks' waiting and running counts to the front end at
# most every 100 ms (min_stats_update_interval_ms).
VLLM_DP_STATS_INTERVAL_S = 0.1

# How long Dynamo's router without KV events believes a block it sent stays cached
# (--router-ttl-secs).
DYNAMO_TTL_S = 120.0


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
    tier, which cannot hold more; SGLang's router keeps such a tree per worker, of text), or,
    with ``ttl_s``, once unsent for that long (Dynamo's router without KV events, which
    knows nothing of the pool's size)."""

    def __init__(self, capacity: int | None, ttl_s: float | None = None) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.size = 0  # tokens held
        # key -> (tokens, when last sent), least recently sent first.
        self._prefixes: OrderedDict[int, tuple[int, float]] = OrderedDict()

    def match(self, chain: list[tuple[int, int]]) -> int:
        """Tokens of the longest prefix of ``chain`` held here."""
        matched = 0
        for key, tokens in chain:
            if key not in self._prefixes:
                break
            matched += tokens
        return matched

    def insert(self, chain: list[tuple[int, int]], now_s: float = 0.0) -> None:
        """``chain`` was sent here at ``now_s`` (never earlier than the last insert)."""
        # Leaf first, so a prefix is always more recent than its extensions and eviction
        # trims the tree from its leaves, as a radix tree's LRU does.
        prefixes = self._prefixes
        for key, tokens in reversed(chain):
            if key in prefixes:
                prefixes.move_to_end(key)
            else:
                self.size += tokens
            prefixes[key] = (tokens, now_s)
        if self.capacity is not None:
            while self.size > self.capacity:
                _, (tokens, _) = prefixes.popitem(last=False)
                self.size -= tokens

    def expire(self, now_s: float) -> None:
        """Forget the prefixes last sent ``ttl_s`` or more before ``now_s``."""
        if self.ttl_s is None:
            return
        prefixes = self._prefixes
        horizon = now_s - self.ttl_s
        while prefixes:
            key, (tokens, sent_s) = next(iter(prefixes.items()))
            if sent_s > horizon:
                break
            del prefixes[key]
            self.size -= tokens


class CacheEvents:
    """What each replica's prefix cache holds, as its KV events say: the hashes its pool
    logged as stored and not since removed, applied in time order up to a moment (every
    replica has logged all it did before the arrival being routed: the engine routes an
    arrival only once every replica has simulated past it). A prompt finds the run of its
    full blocks from block 0 that a replica holds, never the block of its last token (as
    admission looks it up)."""

    def __init__(self, logs: list[deque[tuple[float, int, bool]]],
                 block_size: int | None) -> None:
        self.logs = logs
        self.block_size = block_size  # None: no prefix cache to report (nothing is ever held)
        self.held: list[set[int]] = [set() for _ in logs]

    def catch_up(self, until_s: float) -> None:
        """Apply every event logged before ``until_s``."""
        for log, held in zip(self.logs, self.held, strict=True):
            while log and log[0][0] < until_s:
                _, block_hash, stored = log.popleft()
                if stored:
                    held.add(block_hash)
                else:
                    held.discard(block_hash)

    def block_hashes(self, segments: Segments) -> list[int]:
        """The hashes a lookup of this prompt goes through (all its full blocks but the
        one holding its last token)."""
        if self.block_size is None:
            return []
        prompt_len = sum(length for _, length in segments)
        count = (prompt_len - 1) // self.block_size
        return BlockHasher(segments, self.block_size).hash_upto(count)[:count]

    def cached_tokens(self, replica: int, hashes: list[int]) -> int:
        """Prompt tokens ``replica`` holds, of a prompt whose lookup hashes are ``hashes``."""
        held = self.held[replica]
        found = 0
        for block_hash in hashes:
            if block_hash not in held:
                break
            found += 1
        return found * (self.block_size or 0)


class UsageReports:
    """How full each replica's KV cache was when it last reported, as its engine publishes
    it after each step (vLLM's ``kv_cache_usage``): from the log its scheduler keeps,
    (end of step, usage) at each step end that changed it, applied in time order up to a
    moment (every replica has logged all it did before the arrival being routed, as for
    :class:`CacheEvents`)."""

    def __init__(self, logs: list[deque[tuple[float, float]]]) -> None:
        self.logs = logs
        self.usage = [0.0] * len(logs)

    def catch_up(self, until_s: float) -> None:
        """Apply every report logged before ``until_s``."""
        usage = self.usage
        for replica, log in enumerate(self.logs):
            while log and log[0][0] < until_s:
                usage[replica] = log.popleft()[1]


class Router:
    """Routes open arrivals by load and cache (``least_loaded``, ``vllm_dp``, ``vllm_dp_2026``,
    ``cache_aware``, ``kv_aware``); ``round_robin`` needs no state and the engine assigns it
    up front. The engine tells the router of every request that will run on a replica
    (:meth:`assign` as it routes, :meth:`expect` for a session's later turns), of every
    intake, seating and preemption (:meth:`taken_in`, :meth:`admitted`, :meth:`preempted`,
    which only vLLM's balancers heed), of every first token (:meth:`prefilled`, which only
    ``kv_aware`` heeds) and of every finish (:meth:`finished`), each at its simulated time
    (``vllm_dp_2026`` also reads each replica's KV cache usage, :meth:`watch_usage`).
    ``cache_slots`` is what one replica can cache (its GPU pool and host tier), which bounds
    ``cache_aware``'s memory of prefixes; ``kv_aware``'s forgets a prefix ``ttl_s`` after it
    was last sent, as Dynamo's, unless it reads the replicas' KV events (:meth:`watch_caches`)
    and so knows what they cache. ``kv_aware`` draws with ``temperature`` from a generator
    seeded by ``seed``, one draw per route, so a run repeats exactly. With
    ``stats_interval_s`` what the replicas report (intakes, seatings, first tokens,
    finishes, KV events) reaches the router only at the next multiple of that interval; what
    it sends (and a session's turns it expects) it knows at once, but vLLM's balancers count
    a request sent as their front end does: in its own copy of the counts, until the next
    publication replaces the copy, and in the published counts from its intake on. With
    ``front_ends`` (vLLM's balancers only) each route is made by one of them, drawn at
    random: what the others sent reaches it with the replicas' reports, and what it sent
    itself counts ``front_ends`` times in its copy. ``vllm_dp_2026`` counts besides, per
    front end, the requests it sent each replica and has not seen finish (at once: answers
    stream back to it)."""

    def __init__(self, policy: RouterPolicy, replicas: int, cache_slots: int, *,
                 cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.0001,
                 overlap_score_weight: float = 1.0, track_prefill_tokens: bool = True,
                 temperature: float = 0.0, ttl_s: float = DYNAMO_TTL_S,
                 stats_interval_s: float = 0.0, front_ends: int = 1, seed: int = 0) -> None:
        self.policy = policy
        self.stats_interval_s = stats_interval_s
        # vLLM's balancers: what a front end sends reaches the counts only once its engine
        # has taken it in (taken_in) and the next publication after that, counted
        # front_ends times in its own copy until a publication replaces the copy.
        self._vllm = policy in ("vllm_dp", "vllm_dp_2026")
        assert front_ends == 1 or self._vllm, "several front ends balance as vLLM's"
        self.front_ends = front_ends
        # Per front end, the requests it sent each replica since the last publication, as
        # it counts them (front_ends times each); and the one that made the last route.
        self._sent_since = [[0] * replicas for _ in range(front_ends)]
        self.front_end = 0
        self._published_s = -math.inf
        # Where each front end starts its scan for the lowest score: its share of the
        # replicas (vllm_dp_2026 moves it on by one after each of its routes).
        self._scan_start = [replicas * f // front_ends for f in range(front_ends)]
        # vllm_dp_2026: per front end, the requests it sent each replica and has not seen
        # finish; and which front end sent each of those.
        self.inflight = [[0] * replicas for _ in range(front_ends)]
        self._sender: dict[int, int] = {}
        self.usage: UsageReports | None = None  # (vllm_dp_2026; see watch_usage)
        self.replicas = replicas
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.overlap_score_weight = overlap_score_weight
        self.track_prefill_tokens = track_prefill_tokens
        self.temperature = temperature
        # A string seed is hashed the same way on every platform and Python version.
        self._rng = random.Random(f"kvsim router {seed}")
        self.load = [0] * replicas  # requests arrived and not finished, as of the last route
        # vllm_dp: of those, the ones not yet seated (vLLM's waiting), by request.
        self.waiting = [0] * replicas
        self._unseated: dict[int, int] = {}  # request -> its replica
        self.trees = [ApproximateTree(None, ttl_s) if policy == "kv_aware"
                      else ApproximateTree(cache_slots) for _ in range(replicas)]
        self._now_s = 0.0  # the time of the arrival being routed
        # kv_aware: the prompt tokens in flight on each replica, a prefix shared by several
        # of its requests counted once (Dynamo's active blocks, assuming KV reuse), from the
        # prefixes each in-flight request holds there.
        self.active_tokens = [0] * replicas
        self._held: list[Counter[int]] = [Counter() for _ in range(replicas)]
        self._chains: dict[int, list[tuple[int, int]]] = {}  # request -> its prefix chain
        # kv_aware: the prompt tokens each replica has yet to prefill (Dynamo's active
        # prefill tokens): each request's, less what the replica cached when it was sent
        # there, until its first token is out.
        self.prefill_tokens = [0] * replicas
        self._prefilling: dict[int, tuple[int, int]] = {}  # request -> (replica, tokens)
        # (time, kind, request, replica, chain): applied in time order before each route,
        # what the router sent (arrivals, their prefixes) up to the route, what the replicas
        # reported (seatings, first tokens, finishes) up to the last report before it.
        self._events: list[tuple[float, int, int, int, list[tuple[int, int]]]] = []
        self._reports: list[tuple[float, int, int, int, list[tuple[int, int]]]] = []
        # kv_aware with KV events: what each replica caches, from its pool's log, in place
        # of what the trees believe (see watch_caches).
        self.caches: CacheEvents | None = None
        self._lookups: dict[int, list[int]] = {}  # expected request -> its lookup hashes
        self._routed: tuple[Segments, list[int]] | None = None  # the last route's lookup

    def watch_caches(self, caches: CacheEvents) -> None:
        """``kv_aware`` learns what each replica caches from its KV events from now on."""
        self.caches = caches

    def watch_usage(self, logs: list[deque[tuple[float, float]]]) -> None:
        """``vllm_dp_2026`` learns each replica's KV cache usage from these logs, one per
        replica (see :class:`UsageReports`)."""
        self.usage = UsageReports(logs)

    @property
    def counts_waiting(self) -> bool:
        """Whether the router tells waiting requests from running ones (vLLM's balancers):
        it then heeds every intake, seating and preemption."""
        return self._vllm

    @property
    def reads_usage(self) -> bool:
        """Whether the router reads the replicas' KV cache usage (``vllm_dp_2026``)."""
        return self.policy == "vllm_dp_2026"

    @property
    def _tracks_cache(self) -> bool:
        return self.policy not in ("least_loaded", "vllm_dp", "vllm_dp_2026")

    def assign(self, replica: int, segments: Segments, request: int) -> None:
        """Request ``request``, just routed, will run on ``replica``: it loads it from now
        on (requests that arrive together see each other; with several front ends, the
        others hear of it at the next publication)."""
        if self._vllm:
            self._sent_since[self.front_end][replica] += self.front_ends
            if self.reads_usage:
                self.inflight[self.front_end][replica] += 1
                self._sender[request] = self.front_end
            return
        self._arrive(request, replica)
        if self._tracks_cache:
            chain = prefix_chain(segments)
            if self.policy == "kv_aware":
                self._chains[request] = chain
                self._start(request, replica, chain,
                            self._cached(replica, chain, self._lookup(segments)))
            self.trees[replica].insert(chain, self._now_s)

    def expect(self, request: int, replica: int, arrival_s: float, segments: Segments) -> None:
        """A request will arrive on ``replica`` at ``arrival_s`` (a session's next turn, which
        stays with its conversation): it adds to the load and to the tree from then on (for
        vLLM's balancers, from the publication after its intake on)."""
        if not self._vllm:
            heapq.heappush(self._events, (arrival_s, _ARRIVE, request, replica, []))
        if self._tracks_cache:
            chain = prefix_chain(segments)
            if self.policy == "kv_aware":
                self._chains[request] = chain
                if self.caches is not None:
                    self._lookups[request] = self.caches.block_hashes(segments)
            heapq.heappush(self._events, (arrival_s, _TOUCH, request, replica, chain))

    def _lookup(self, segments: Segments) -> list[int] | None:
        """The prompt's lookup hashes when the router reads KV events (None else); the
        assignment that follows a route reuses the route's."""
        if self.caches is None:
            return None
        if self._routed is not None and self._routed[0] is segments:
            return self._routed[1]
        return self.caches.block_hashes(segments)

    def _cached(self, replica: int, chain: list[tuple[int, int]],
                hashes: list[int] | None) -> int:
        """Prompt tokens ``replica`` caches of the prompt ``chain``, as far as the router
        knows: from its KV events (the prompt's lookup ``hashes``), else from what it sent
        there."""
        if self.caches is None or hashes is None:  # (both or neither)
            return self.trees[replica].match(chain)
        return self.caches.cached_tokens(replica, hashes)

    def _start(self, request: int, replica: int, chain: list[tuple[int, int]],
               cached: int) -> None:
        """kv_aware: ``request`` starts on ``replica``, which caches ``cached`` tokens of its
        prompt, before its prompt joins the tree."""
        self._hold(replica, chain, +1)
        prompt = sum(tokens for _, tokens in chain)
        new = prompt - cached
        self._prefilling[request] = (replica, new)
        self.prefill_tokens[replica] += new

    def _hold(self, replica: int, chain: list[tuple[int, int]], step: int) -> None:
        """A request holding ``chain`` starts (+1) or stops (-1) running on ``replica``."""
        held = self._held[replica]
        for key, tokens in chain:
            held[key] += step
            if held[key] == (1 if step > 0 else 0):  # the first holder, or the last gone
                self.active_tokens[replica] += step * tokens
            if not held[key]:
                del held[key]

    def _arrive(self, request: int, replica: int) -> None:
        self.load[replica] += 1
        if self.counts_waiting:
            self._unseat(request, replica)

    def _unseat(self, request: int, replica: int) -> None:
        # Arrived, or preempted: waiting (again), unless already unseated (one count each).
        if request not in self._unseated:
            self._unseated[request] = replica
            self.waiting[replica] += 1

    def _seat(self, request: int) -> None:
        # Seated, or finished unseated (a request its replica turned away never counts).
        replica = self._unseated.pop(request, None)
        if replica is not None:
            self.waiting[replica] -= 1

    def taken_in(self, request: int, replica: int, taken_s: float) -> None:
        """``replica``'s engine took ``request`` in (into its waiting queue, or turned it away
        at once) at ``taken_s``: vLLM's engines count it from then on, in the counts they
        publish before and after each step (only vLLM's balancers heed that)."""
        if self._vllm:
            heapq.heappush(self._reports, (taken_s, _ARRIVE, request, replica, []))

    def admitted(self, request: int, replica: int, admitted_s: float) -> None:
        """``request`` was seated on ``replica`` (its prefill scheduled), first or again
        after a preemption, as the replica reports at ``admitted_s``, the end of that step:
        it runs there rather than waits (only ``vllm_dp`` counts that)."""
        if self.counts_waiting:
            heapq.heappush(self._reports, (admitted_s, _ADMITTED, request, replica, []))

    def preempted(self, request: int, replica: int, preempted_s: float) -> None:
        """``request`` was preempted on ``replica``, as the replica reports at
        ``preempted_s``, the end of that step: it waits there again, as vLLM's scheduler puts
        it back in its waiting queue (only ``vllm_dp`` counts that)."""
        if self.counts_waiting:
            heapq.heappush(self._reports, (preempted_s, _PREEMPTED, request, replica, []))

    def prefilled(self, request: int, replica: int, first_token_s: float) -> None:
        """``request`` gave its first token on ``replica`` at ``first_token_s``: its prompt
        no longer waits there (only ``kv_aware`` counts that)."""
        if self.policy == "kv_aware":
            heapq.heappush(self._reports, (first_token_s, _PREFILLED, request, replica, []))

    def finished(self, request: int, replica: int, finished_s: float) -> None:
        """``request`` finished on ``replica`` at ``finished_s`` (or was turned away or given
        up then): the replicas report it, and the front end that sent it sees its answer end
        at once (only ``vllm_dp_2026`` counts that)."""
        heapq.heappush(self._reports, (finished_s, _FINISH, request, replica, []))
        if request in self._sender:
            heapq.heappush(self._events, (finished_s, _ANSWERED, request, replica, []))

    def _end_prefill(self, request: int) -> None:
        # A first token after a preemption, or a finish after the first token: nothing left.
        started = self._prefilling.pop(request, None)
        if started is not None:
            replica, tokens = started
            self.prefill_tokens[replica] -= tokens

    def _reported_until(self, now_s: float) -> float:
        """The time of the last report the router has had by ``now_s``: ``now_s`` itself
        without a report interval, else the last multiple of the interval up to it (one
        that ``now_s`` misses by float rounding alone counts, but never past ``now_s``)."""
        interval_s = self.stats_interval_s
        if not interval_s:
            return now_s
        return min(math.floor(now_s / interval_s + 1e-9) * interval_s, now_s)

    def _catch_up(self, now_s: float) -> None:
        events, reports = self._events, self._reports
        caches = self.caches
        reported_s = self._reported_until(now_s)
        while True:
            sent = events[0] if events and events[0][0] < now_s else None
            if reports and reports[0][0] < reported_s and (sent is None or reports[0] < sent):
                event_s, kind, request, replica, chain = heapq.heappop(reports)
            elif sent is not None:
                event_s, kind, request, replica, chain = heapq.heappop(events)
            else:
                break
            if caches is not None:
                caches.catch_up(min(event_s, reported_s))
            if kind == _ARRIVE:
                self._arrive(request, replica)
            elif kind == _PREEMPTED:
                self._unseat(request, replica)
            elif kind == _ADMITTED:
                self._seat(request)
            elif kind == _PREFILLED:
                self._end_prefill(request)
            elif kind == _ANSWERED:
                self.inflight[self._sender.pop(request)][replica] -= 1
            elif kind == _FINISH:
                self.load[replica] -= 1
                self._seat(request)
                if self.policy == "kv_aware":
                    self._hold(replica, self._chains.pop(request), -1)
                    self._end_prefill(request)
            else:
                self.trees[replica].expire(event_s)
                if self.policy == "kv_aware":
                    hashes = self._lookups.pop(request) if caches is not None else None
                    self._start(request, replica, chain, self._cached(replica, chain, hashes))
                self.trees[replica].insert(chain, event_s)
        if caches is not None:
            caches.catch_up(reported_s)
        if self.usage is not None:
            self.usage.catch_up(reported_s)
        for tree in self.trees:
            tree.expire(now_s)
        self._now_s = now_s
        if self._vllm and reported_s > self._published_s:
            # A publication replaces every front end's copy, its own sends included.
            self._published_s = reported_s
            for counts in self._sent_since:
                counts[:] = [0] * self.replicas

    def route(self, arrival_s: float, segments: Segments, prompt_len: int) -> int:
        """The replica for an open arrival. Call in arrival order; then :meth:`assign` it
        there unless the pool will refuse it."""
        self._catch_up(arrival_s)
        chain = prefix_chain(segments) if self._tracks_cache else []
        if self.policy == "kv_aware":
            hashes = self._lookup(segments)
            if hashes is not None:
                self._routed = (segments, hashes)
            cached = [self._cached(r, chain, hashes) for r in range(self.replicas)]
            return self._cheapest(chain, prompt_len, cached)
        if self.policy in ("vllm_dp", "vllm_dp_2026"):
            return self._balance()
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

    def _balance(self) -> int:
        """vLLM's balancer, by one of its front ends, drawn at random: the replica of the
        lowest score, ties to the first from where the front end's scan starts. A score is
        ``vllm_dp``'s 4 × waiting + running; or ``vllm_dp_2026``'s waiting + running, never
        under front_ends × the requests the front end has in flight there, plus, while any
        waits, waiting × 6 × how far the KV cache usage is over a half. The front end's own
        sends since the last publication count as waiting."""
        replicas = self.replicas
        if self.front_ends > 1:
            self.front_end = self._rng.randrange(self.front_ends)
        front_end = self.front_end
        sent = self._sent_since[front_end]  # (all 0 for vllm_dp with one front end)
        start = self._scan_start[front_end]
        load, waiting = self.load, self.waiting
        if self.policy == "vllm_dp":
            # 4 × waiting + running = load + 3 × waiting.
            weight = VLLM_DP_WAITING_WEIGHT - 1
            return min(range(replicas), key=lambda r: (
                load[r] + weight * waiting[r] + VLLM_DP_WAITING_WEIGHT * sent[r],
                (r - start) % replicas))
        inflight = self.inflight[front_end]
        usage = self.usage.usage if self.usage is not None else [0.0] * replicas

        def score(r: int) -> float:
            queued = waiting[r] + sent[r]
            floor = self.front_ends * inflight[r]
            total = load[r] + sent[r]  # waiting + running
            pressure = usage[r] - VLLM_DP_KV_PENALTY_FROM
            return (max(floor, total) + (queued * VLLM_DP_KV_PENALTY * pressure
                                         if queued and pressure > 0 else 0))
        # (Rotating the scan start keeps equal scores, as after a publication when every
        # replica looks alike, from favouring one replica.)
        self._scan_start[front_end] = (start + 1) % replicas
        return min(range(replicas), key=lambda r: (score(r), (r - start) % replicas))

    def _imbalanced(self) -> bool:
        # SGLang's rule: both the gap and the ratio between the busiest and the idlest.
        high, low = max(self.load), min(self.load)
        return (high - low > self.balance_abs_threshold
                and high > self.balance_rel_threshold * low)

    def _least_loaded(self) -> int:
        return min(range(self.replicas), key=lambda r: (self.load[r], r))

    def _cheapest(self, chain: list[tuple[int, int]], prompt_len: int,
                  cached: list[int]) -> int:
        """Dynamo's cost, in tokens rather than blocks: the prompt tokens a replica would
        compute (those its cache lacks, ``cached`` holding what each has, and, with
        ``track_prefill_tokens``, those of the prompts it has yet to prefill), weighted by
        ``overlap_score_weight``, plus the tokens it would then hold in flight (its own and
        this prompt's, shared prefixes once). The cheapest wins, ties going to the first;
        or, with a temperature, one is drawn (:meth:`_draw`)."""
        def cost(r: int) -> float:
            held = self._held[r]
            adds = sum(tokens for key, tokens in chain if key not in held)
            prefill = prompt_len - cached[r]
            if self.track_prefill_tokens:
                prefill += self.prefill_tokens[r]
            return self.overlap_score_weight * prefill + self.active_tokens[r] + adds
        costs = [cost(r) for r in range(self.replicas)]
        if self.temperature:
            return self._draw(costs)
        return costs.index(min(costs))

    def _draw(self, costs: list[float]) -> int:
        """Dynamo's softmax sampling: the costs scaled to [0, 1] (all alike: equally
        likely), replica r drawn with probability ∝ exp(-scaled_r / temperature)."""
        low, high = min(costs), max(costs)
        span = (high - low) * self.temperature
        weights = [math.exp(-(c - low) / span) if span else 1.0 for c in costs]
        point = self._rng.random() * sum(weights)
        for replica, weight in enumerate(weights):
            point -= weight
            if point < 0:
                return replica
        return len(weights) - 1  # rounding left the point at the very end


__all__ = ["DYNAMO_TTL_S", "VLLM_DP_KV_PENALTY", "VLLM_DP_KV_PENALTY_FROM",
           "VLLM_DP_STATS_INTERVAL_S", "VLLM_DP_WAITING_WEIGHT", "ApproximateTree",
           "CacheEvents", "Router", "RouterPolicy", "UsageReports", "prefix_chain"]
