"""Iteration-level continuous batching (Orca / vLLM), identical for every allocator.

The scheduler is a maître d' seating diners at every course: before each engine step it
serves one more token to every running request (decode), continues any prompt still being
read (chunked prefill), then seats new requests from the front of the queue while there are
seats (``max_num_seqs``), kitchen capacity (``max_num_batched_tokens``) and memory. When a
running request needs memory that is not there, someone is asked to leave and goes back to
the front of the queue: by recompute (its KV is dropped, to be computed again), or by swap
(its KV is parked in host memory, to be copied back when it is seated again). Some houses
keep a guest list by rank (``policy: priority``): the best-ranked waiting guest is seated
first, the worst-ranked seated one is the first asked to leave; others seat first the
diner expected to order least (``policy: shortest_predicted``). A house that lays each
table for the courses it expects a diner to order (contiguous memory reserved for a
predicted output length) sends a diner who orders more back to the queue, to be seated
again at a larger table: laid for twice as many, or for all the diner may order. A diner
with a long order is seated when the table for all of it is free (``prefill_allocation:
whole_prompt``), or as soon as the first course fits, each later course claiming its space
as it comes (``per_chunk``, vLLM v1), at the risk of being asked to leave halfway. A
diner tired of waiting walks out: of the queue (not seated in time), or, waiting for the
first course, from the table too, which is cleared at the next course.

A token's KV is written by the step that reads it, as vLLM v1 claims its slot: the prompt's
by the prefill, each generated token's by the step after the one that sampled it, so the last
token's never is.

Decoding is accounted lazily, like interest on a bank account: a decoding request's token
count is ``tok_sync + (clock(steps) - c_sync)``, where the token clock reads the tokens every
decoding request has kept by a step (``steps`` itself, a token a step, or ⌊steps·τ⌋ under
speculative decoding, τ tokens a step on average; with K drafts by batch size, τ of each
step's K summed) and ``c_sync`` its reading when the allocator was last told ("synced"):
when the request crosses into a block it does not have yet, finishes, or is preempted. Those
moments sit in buckets keyed by the clock reading at which they fall due, so a step costs
work only for the requests that have an event in it — never a loop over the whole batch.

No SimPy here: the engine asks for a :class:`Batch`, times it, and reports it done.
"""

from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fractions import Fraction

import numpy as np

from sim.memory import (
    ContiguousAllocator,
    HybridPagedAllocator,
    KVAllocator,
    MemorySnapshot,
    PagedAllocator,
    SeqSpec,
    final_kv_tokens,
)
from sim.memory.block_pool import BlockPool
from sim.memory.content import BlockHasher
from sim.scenario import NEW_TOKEN_RATIO_INIT, SchedulerConfig, SpeculativeConfig
from workloads.spec import MAX_SAMPLES
from workloads.trace import Trace, output_segment_id

# SGLang's line length past which longest prefix match leaves the line unranked: ranking
# asks the prefix cache about every request waiting.
LPM_QUEUE_LIMIT = 128
# Event kinds; at one step, grows come before finishes. WINDOW: a sequence's context
# outgrows a sliding window (its attention time, not its memory, changes). CAUGHT_UP: a
# fork group started over generates a token its client has not had yet.
GROW, FINISH, WINDOW, CAUGHT_UP = 0, 1, 2, 3
# A run of tokens that starts at no step (a fork group regenerating what its client has).
NO_STEP = 1 << 62


def wait_us(wait_s: float) -> int:
    """A wait between two tokens as the ITL counts it: in whole microseconds."""
    return int(wait_s * 1e6 + 0.5)


# SGLang's admission by a new-token ratio, with its defaults (its environment variables
# SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR, _NEW_TOKEN_RATIO_DECAY_STEPS, _RETRACT_DECODE_STEPS and
# _CLIP_MAX_NEW_TOKENS_ESTIMATION; the start, NEW_TOKEN_RATIO_INIT, is the configuration's).
NEW_TOKEN_RATIO_MIN_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
# The most of a request's max_tokens admission counts on (a long max_tokens would make it
# reserve too much; the request may still generate past it).
CLIP_MAX_NEW_TOKENS = 4096


class NewTokenRatio:
    """SGLang's guess at the share of its max_tokens left that a running request will
    still generate: admission keeps that much memory free for each one.

    A lender's confidence in its borrowers: cautious at first (0.7 × the conservativeness,
    at most 1), bolder with every decode step (one that reads no prompt) that passes
    without a default, down to 0.14 of that over 600 of them; after a preemption, set to
    what the facts show (the tokens the survivors have generated, plus 20 steps' worth
    each, over their max_tokens); cautious again once nobody runs. The ratio is a function
    of the decode steps since it was last set, so that a run of them advanced at once moves
    it exactly as stepping does.
    """

    def __init__(self, conservativeness: float) -> None:
        self.init = min(NEW_TOKEN_RATIO_INIT * conservativeness, 1.0)
        self.floor = min(self.init * NEW_TOKEN_RATIO_MIN_FACTOR, 1.0)
        self.decay = (self.init - self.floor) / NEW_TOKEN_RATIO_DECAY_STEPS
        self._base = self.init
        self._base_step = 0

    def at(self, step: int) -> float:
        """The ratio once ``step`` steps are done: what it was set to at its last setting,
        less a decay for each step since, never below the floor (a guess set below it
        holds until the next step, as SGLang's)."""
        steps = step - self._base_step
        if not steps:
            return self._base
        return max(self._base - steps * self.decay, self.floor)

    def reset(self, step: int) -> None:
        """Nobody runs after ``step`` steps: start cautious again."""
        self._base, self._base_step = self.init, step

    def after_preemption(self, step: int, generated: int, max_new: int,
                         requests: int) -> None:
        """A step (``step`` steps done) preempted for memory: set the ratio from the
        ``requests`` still decoding, which have ``generated`` tokens of their ``max_new``
        max_tokens."""
        guess = (generated + RETRACT_DECODE_STEPS * requests) / (max_new + 1)
        self._base, self._base_step = min(1.0, guess), step


class Siblings:
    """The samples of one try of a request that run as requests of their own
    (``fan_out``), as their client sees them: seated when the first is, given a first
    token when the first is (a client who waits for a seat or a first token waits for one
    of any sample), turned away when the first is (a full line turns a request away
    whole). Its stream of tokens is theirs together: while one decodes it flows, and
    else its last token is the last any of them gave (a client who waits for a next token
    waits for one of any sample); ``members``, where the engine keeps them, are the
    samples of the try not done yet."""

    __slots__ = ("admitted_s", "decoding", "first_token_s", "given_up", "last_token_s",
                 "members", "shed")

    def __init__(self) -> None:
        self.admitted_s = -1.0
        self.first_token_s = -1.0
        self.shed = False
        # Of its samples, those decoding that give the stream a token each step (not one
        # waiting, after a prefill batch, for its second token alone).
        self.decoding = 0
        self.last_token_s = -1.0  # the last token of those not decoding (-1: none yet)
        self.members: list[Request] = []
        self.given_up = False  # its client gave up on it, while some were seated


class Request:
    """One request's progress through the system (times are simulation seconds)."""

    __slots__ = (
        "abandoned_s",
        "admit_seq",
        "admitted_s",
        "arrival_s",
        "attempts",
        "c_sync",
        "client_tokens",
        "computed",
        "computed_tokens",
        "decoding",
        "discarded_output",
        "finished_s",
        "first_arrival_s",
        "first_token_s",
        "gen_sync",
        "hit_tokens",
        "index",
        "last_token_s",
        "max_itl_s",
        "max_len",
        "n",
        "num_seqs",
        "output_len",
        "past_window",
        "predicted_output",
        "preemptions",
        "prefill_target",
        "prefilled",
        "prefix_hasher",
        "priority",
        "prompt_len",
        "prompt_segments",
        "recomputed_tokens",
        "regenerating",
        "rejected",
        "resumed",
        "shed",
        "siblings",
        "spec_cache",
        "streak_step",
        "swap_slots",
        "swapped",
        "ticket",
        "tok_sync",
        "token_runs",
        "transferred",
        "version",
    )

    def __init__(self, trace: Trace, index: int, arrival_s: float) -> None:
        self.index = index
        self.arrival_s = arrival_s  # of this attempt: a client may send it again (retry)
        self.first_arrival_s = arrival_s  # of its first attempt, which latencies count from
        self.attempts = 1
        columns = trace.column_lists()
        self.prompt_len = columns["prompt_len"][index]
        self.output_len = columns["output_len"][index]
        self.max_len = self.prompt_len + columns["max_tokens"][index]
        self.n = columns["n"][index]
        self.priority = columns["priority"][index]  # lower is served first (vLLM's)
        # Output tokens the engine's length predictor expects (0: it has none): what a
        # contiguous reservation is sized for (doubled each time the request outgrows it),
        # and what a line by predicted length orders by.
        self.predicted_output = 0
        self.prompt_segments = tuple(trace.prompt_segments(index))
        self.gen_sync = 0  # generated tokens as of clock c_sync (exact unless decoding)
        self.prefilled = 0  # tokens of the current admission's prompt already in KV
        self.prefill_target = 0  # prompt tokens (+ regenerated output) to prefill this time
        self.num_seqs = 0
        self.admit_seq = -1
        self.decoding = False
        self.c_sync = 0
        self.tok_sync = 0
        self.version = 0
        self.admitted_s = -1.0
        self.first_token_s = -1.0
        # When its client last received a token, and the longest wait between two of its
        # tokens so far (-1: none yet), a gap that runs of decode steps settle when they end.
        self.last_token_s = -1.0
        self.max_itl_s = -1.0
        self.streak_step = 0  # decoding: the step that gives it its first token of the run
        # Generated tokens its client has received: a fork group started over regenerates
        # them unseen (``regenerating``), and its client's next token is the one after. (A
        # request whose first token a prefill batch gave is marked so until its next.)
        self.client_tokens = 0
        self.regenerating = False
        self.discarded_output = 0  # tokens of each sample generated before it started over
        # Where a client may give up mid-answer: the tokens it has received after another,
        # as runs (waits by step, first, stop) of a scheduler's Scheduler.step_waits_us (a
        # token received alone, its own list of one), so that the engine can take them back
        # out of the ITL if it gives up (None: none kept).
        self.token_runs: list[tuple[list[int], int, int]] | None = None
        self.finished_s = -1.0
        self.preemptions = 0
        self.hit_tokens = 0
        self.recomputed_tokens = 0
        self.rejected = False
        self.shed = False  # turned away on arrival by a full waiting line
        self.abandoned_s = -1.0  # when its client gave up on it (-1: never)
        self.resumed = False  # re-admitted after a preemption that discarded computed KV
        self.computed = False  # some step has computed KV for it
        # Leading tokens of the prompt it is seated with next whose KV some step computed
        # (a preemption in the middle of a prefill leaves the rest never computed).
        self.computed_tokens = 0
        # Prompt tokens whose KV another replica computed and sent (disaggregated prefill):
        # admission writes them without computing them, once.
        self.transferred = 0
        # Tokens whose KV a swap preemption parked in host memory, and the swap space
        # (slots) they hold there until the request is seated again.
        self.swapped = 0
        self.swap_slots = 0
        self.past_window = False  # decoding with context past a sliding window
        self.spec_cache: SeqSpec | None = None
        # Its content's block hashes, walked as far as a longest-prefix-match line has
        # looked its prompt up (the content of sample 0 never changes; its prompt grows).
        self.prefix_hasher: BlockHasher | None = None
        self.ticket = 0  # its place in the waiting line; a new one each time it joins or leaves
        # A sample of a request fanned out whose client waits for a seat, a first token or
        # a next token, or whose line turns requests away: what the client sees of all the
        # samples of its try (None: its own; see Siblings).
        self.siblings: Siblings | None = None

    @property
    def final_len(self) -> int:
        """Tokens whose KV the request holds when it finishes (all but its last token's)."""
        return final_kv_tokens(self.prompt_len, self.output_len)

    def seq_ids(self) -> list[int]:
        base = self.index * MAX_SAMPLES
        return [base + s for s in range(self.num_seqs)]

    def spec(self, sample: int = 0) -> SeqSpec:
        """Sequence ``sample``: the prompt, then its own generated text (sample 0's prompt
        includes what it generated before a preemption)."""
        if sample == 0 and self.spec_cache is not None and (
                self.spec_cache.prompt_len == self.prompt_len + self.gen_sync):
            return self.spec_cache
        segments = (*self.prompt_segments,
                    (output_segment_id(self.index, sample), self.output_len))
        # (A finished request's last token is no prompt: its KV is never written.)
        prompt = min(self.prompt_len + (self.gen_sync if sample == 0 else 0), self.final_len)
        predicted = (final_kv_tokens(self.prompt_len, self.predicted_output)
                     if self.predicted_output else 0)
        spec = SeqSpec(self.index * MAX_SAMPLES + sample, segments, prompt, self.final_len,
                       max(self.max_len, self.final_len), predicted)
        if sample == 0:
            self.spec_cache = spec
        return spec

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < self.prefill_target


class WaitingLine:
    """The queue of requests waiting for a seat: first come, first served, by priority,
    shortest predicted job first, longest cached prefix first, grouped by cached prefix, or
    at random; and, with a ``timeout_s`` or ``ttft_timeout_s``, the clients who give up.

    First come, first served is a deque; a preempted request goes back to its front (or,
    as SGLang's retraction, its back: ``preempted_to_back``). Longest prefix match
    (``lpm``, SGLang's ``--schedule-policy lpm``) keeps the same deque, which the
    scheduler of a pool with a prefix cache sorts (:meth:`rank`) before it seats anyone,
    as SGLang's scheduler sorts its list each round: the most prompt tokens cached first,
    in the order before among equals, so that as a request of a shared prefix warms the
    cache the others of its group move up. Ranking asks about every request waiting, so a
    line longer than ``max_lpm_queue_size`` (128 unless given; 0: no limit) is left as it
    is, as SGLang's: in the order its last ranking left, with arrivals behind. SGLang's
    ``dfs-weight`` (``dfs_weight``) orders the same deque by a walk down the cache's tree,
    every request of a cached prefix together, the prefix most of them share first; its
    ``random`` shuffles it each round, with draws seeded by ``seed``; its ``lof`` (longest
    output first) sorts it stably by the tokens each request may generate (max_tokens),
    most first. The others
    are heaps, lower first, ordered by (priority, arrival, request index) — vLLM
    v1's ``--scheduling-policy priority`` — or by (tokens the predictor expects the request
    still to generate, arrival, request index); a preempted request simply goes back in,
    where its key places it.

    Two kinds of aging keep long jobs from starving. With ``aging_tokens_per_s`` r, every
    second waited counts as r predicted tokens fewer: the key is the tokens left − r × the
    wait, and since the wait is now − arrival, where now is the same for everyone, the
    order is that of tokens left + r × arrival, a key fixed when the request joins. With
    ``max_wait_s``, a request that arrived that long before ``clock`` goes ahead of the
    key's order, the oldest first. It then sits in a second heap, by arrival, too; an entry
    whose ticket is no longer its request's (the request left the line by the other heap)
    is skipped when it surfaces.

    With ``timeout_s``, a client whose request has not been seated that long after it
    arrived cancels it: :meth:`expire` takes it out of the line wherever it stands; a
    request seated once (a preempted one, or one whose KV another replica prefilled) has
    been answered and never times out so. With ``ttft_timeout_s``, a client whose request
    has no first token that long after it arrived cancels it, seated before or not (a
    request preempted before its first token still times out). With ``e2e_timeout_s``, a
    client whose request is not answered whole that long after it arrived cancels it,
    whatever it has had (a preempted request times out in the line). With
    ``itl_timeout_s``, a streaming client that has had a token and no other since for that
    long disconnects: one preempted, or handed to a decode replica, times out in the line
    or while its prompt is read again (one decoding, only by a step that long: the
    scheduler sees it). A deadline sits in a third heap, checked by ticket in the same way;
    each request joining or leaving the line takes a new ticket.
    """

    def __init__(self, order: str = "fcfs", max_wait_s: float | None = None,
                 aging_tokens_per_s: float = 0.0, timeout_s: float | None = None,
                 ttft_timeout_s: float | None = None,
                 e2e_timeout_s: float | None = None,
                 itl_timeout_s: float | None = None,
                 max_lpm_queue_size: int | None = None, seed: str = "",
                 preempted_to_back: bool = False) -> None:
        self.by_priority = order == "priority"
        self.by_length = order == "shortest_predicted"
        self.by_prefix = order == "lpm"
        self.by_cache_tree = order == "dfs_weight"
        self.by_output = order == "lof"
        self._heaped = self.by_priority or self.by_length
        # A preempted request rejoins at the back, as SGLang's retraction (else the front).
        self.preempted_to_back = preempted_to_back
        # Under lpm, the prompt tokens a waiting request finds cached now (set by the
        # scheduler of a pool that caches prefixes; without, the line is first come, first
        # served), and the longest line ranked so.
        self.prefix_tokens: Callable[[Request], int] | None = None
        # Under dfs_weight, the hashes of the blocks a waiting request finds cached now,
        # from its first (its path down the cache's tree; set as prefix_tokens is).
        self.cached_path: Callable[[Request], list[int]] | None = None
        # Under random, the draws that shuffle the line, the same each run of one seed:
        # numpy's, since a line past capacity holds thousands, shuffled each step (a
        # permutation drawn in C, where random.shuffle draws element by element).
        self._shuffler = (np.random.default_rng(random.Random(f"kvsim line {seed}")
                                                .getrandbits(128))
                          if order == "random" else None)
        self.max_lpm_queue_size = (LPM_QUEUE_LIMIT if max_lpm_queue_size is None
                                   else max_lpm_queue_size)
        self.max_wait_s = max_wait_s
        self.aging_tokens_per_s = aging_tokens_per_s
        self.clock = 0.0  # the time "waited that long" is judged at (the scheduler sets it)
        self._line: deque[Request] = deque()
        # (key, arrival, request index, ticket, request): the index and ticket, unique,
        # spare comparing requests.
        self._heap: list[tuple[float, float, int, int, Request]] = []
        self._by_arrival: list[tuple[float, int, int, Request]] = []
        self.timeout_s = timeout_s
        self.ttft_timeout_s = ttft_timeout_s
        self.e2e_timeout_s = e2e_timeout_s
        self.itl_timeout_s = itl_timeout_s
        # Whether a seated request may still time out (on a token or the whole answer).
        self.seated_may_time_out = (ttft_timeout_s, e2e_timeout_s, itl_timeout_s) != (
            None, None, None)
        # (deadline, request index, ticket, request) of those that may still time out.
        self._by_deadline: list[tuple[float, int, int, Request]] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def may_be_passed(self) -> bool:
        """Whether a request arriving now may be seated before the head: by its priority or
        its length, or, under lpm, by the prompt it finds cached (unless the line is too
        long to rank, and can only grow until someone is seated or gives up)."""
        return self._heaped or self.ranks()

    def reorders(self) -> bool:
        """Whether the scheduler orders this line anew each round with a seat to fill: lpm
        or dfs_weight with a prefix cache, random, lof."""
        return (self.prefix_tokens is not None or self.cached_path is not None
                or self._shuffler is not None or self.by_output)

    def ranks(self) -> bool:
        """Whether :meth:`rank` would order the line now: as it :meth:`reorders`, but for
        an lpm line longer than ``max_lpm_queue_size``."""
        limit = self.max_lpm_queue_size
        if self.prefix_tokens is not None and limit and self._count > limit:
            return False
        return self.reorders()

    def reshuffles(self) -> bool:
        """Whether every ranking draws a new order (random), whatever changed or not."""
        return self._shuffler is not None

    def rank(self) -> None:
        """Order the line, in place, as the scheduler does before it seats anyone (if it
        :meth:`ranks`): longest prefix match sorts it stably by the prompt tokens each
        request finds cached now, most first; dfs_weight puts it in the order of a walk
        down the cache's tree (:meth:`_walk_cache_tree`); random shuffles it; lof sorts it
        stably by max_tokens, most first."""
        if not self.ranks():
            return
        prefix_tokens = self.prefix_tokens
        if prefix_tokens is not None:
            ranked = sorted(self._line, key=lambda request: -prefix_tokens(request))
        elif self.cached_path is not None:
            ranked = self._walk_cache_tree(self.cached_path)
        elif self.by_output:
            ranked = sorted(self._line, key=lambda request: request.prompt_len - request.max_len)
        else:
            assert self._shuffler is not None
            waiting = list(self._line)
            ranked = [waiting[i] for i in self._shuffler.permutation(len(waiting)).tolist()]
        self._line.clear()
        self._line.extend(ranked)

    def _walk_cache_tree(self, cached_path: Callable[[Request], list[int]]) -> list[Request]:
        """SGLang's dfs-weight order. Each waiting request hangs from the deepest block of
        its prompt the cache holds (the root if none); a block weighs the requests hanging
        in its subtree; a depth-first walk from the root takes the heavier child first, and
        at each block the requests of its subtree before its own, so that requests sharing a
        cached prefix are seated together, the largest group first, while it is cached.
        (SGLang breaks a tie between children in the order its radix tree made them; here,
        in the order the line met them.) A block's hash names its whole prefix, so requests
        hanging from one block share their path, which is walked once for them all."""
        hanging: dict[int, list[Request]] = {}  # by the hash of the block they hang from
        paths: dict[int, list[int]] = {}
        at_root: list[Request] = []
        for request in self._line:
            path = cached_path(request)
            if not path:
                at_root.append(request)
            elif path[-1] in hanging:
                hanging[path[-1]].append(request)
            else:
                hanging[path[-1]] = [request]
                paths[path[-1]] = path
        weight: dict[int, int] = {}
        top: list[int] = []  # the root's children, then each block's, in the order met
        children: dict[int, list[int]] = {}
        for last, path in paths.items():
            count = len(hanging[last])
            siblings = top
            for block_hash in path:
                if block_hash in weight:
                    weight[block_hash] += count
                else:
                    weight[block_hash] = count
                    siblings.append(block_hash)
                    children[block_hash] = []
                siblings = children[block_hash]
        order: list[Request] = []
        # (block, whether its subtree is done: its own requests next), the next on top.
        stack: list[tuple[int, bool]] = []

        def push_children(kids: list[int]) -> None:
            ranked = sorted(kids, key=lambda block_hash: -weight[block_hash])  # stable
            stack.extend((block_hash, False) for block_hash in reversed(ranked))

        push_children(top)
        while stack:
            block_hash, done = stack.pop()
            if done:
                order.extend(hanging.get(block_hash, ()))
            else:
                stack.append((block_hash, True))
                push_children(children[block_hash])
        order.extend(at_root)
        return order

    def head(self) -> Request:
        """The request to seat next."""
        if not self._heaped:
            return self._line[0]
        if self.max_wait_s is not None:
            overdue = self._oldest()
            if overdue is not None and overdue.arrival_s + self.max_wait_s <= self.clock:
                return overdue
        heap = self._heap
        while heap[0][3] != heap[0][4].ticket:  # left by the other heap, or timed out
            heapq.heappop(heap)
        return heap[0][4]

    def _oldest(self) -> Request | None:
        """The earliest arrival waiting (aging only)."""
        by_arrival = self._by_arrival
        while by_arrival and by_arrival[0][2] != by_arrival[0][3].ticket:
            heapq.heappop(by_arrival)
        return by_arrival[0][3] if by_arrival else None

    def oldest_due_s(self) -> float:
        """When the earliest arrival waiting will have waited ``max_wait_s`` (inf if none)."""
        if self.max_wait_s is None:
            return math.inf
        oldest = self._oldest()
        return math.inf if oldest is None else oldest.arrival_s + self.max_wait_s

    def pop(self) -> Request:
        """Take the head off the line."""
        self._count -= 1
        request = self._line.popleft() if not self._heaped else self.head()
        request.ticket += 1  # its entries in the heaps are stale now
        return request

    def deadline_s(self, request: Request) -> float:
        """When the client of ``request`` gives up if it is still in the line (or seated)
        then (inf: never): unseated after ``timeout_s``, without a first token after
        ``ttft_timeout_s``, unanswered after ``e2e_timeout_s``, or, not decoding (or only
        regenerating), without a token ``itl_timeout_s`` after its last, whichever comes
        first. A sample of a request fanned out is seated, or has had a first token, when
        any of its ``siblings`` has, and waits for a next token while none of them
        decodes, from the last any of them gave."""
        deadline = math.inf
        seen: Request | Siblings = request if request.siblings is None else request.siblings
        if self.e2e_timeout_s is not None:
            deadline = request.arrival_s + self.e2e_timeout_s
        if self.ttft_timeout_s is not None and seen.first_token_s < 0:
            deadline = min(deadline, request.arrival_s + self.ttft_timeout_s)
        if self.itl_timeout_s is not None:
            if request.siblings is None:
                if request.last_token_s >= 0 and (not request.decoding
                                                  or request.regenerating):
                    deadline = min(deadline, request.last_token_s + self.itl_timeout_s)
            elif not request.siblings.decoding and request.siblings.last_token_s >= 0:
                deadline = min(deadline, request.siblings.last_token_s + self.itl_timeout_s)
        if self.timeout_s is not None and seen.admitted_s < 0:
            deadline = min(deadline, request.arrival_s + self.timeout_s)
        return deadline

    def _join(self, request: Request) -> None:
        """Count ``request`` in, with a new ticket and, if its client may give up, its
        deadline."""
        self._count += 1
        request.ticket += 1
        deadline = self.deadline_s(request)
        if deadline < math.inf:
            heapq.heappush(self._by_deadline, (deadline, request.index, request.ticket,
                                               request))

    def arrive(self, request: Request) -> None:
        """A new arrival joins the back (or its place, by its key)."""
        self._join(request)
        key: float
        if self.by_priority:
            key = float(request.priority)
        elif self.by_length:
            # What is left of the guess (a preempted request has generated some of it).
            key = float(max(request.predicted_output - request.gen_sync, 1))
            if self.aging_tokens_per_s:
                key += self.aging_tokens_per_s * request.arrival_s
        else:
            self._line.append(request)
            return
        heapq.heappush(self._heap, (key, request.arrival_s, request.index, request.ticket,
                                    request))
        if self.max_wait_s is not None:
            heapq.heappush(self._by_arrival, (request.arrival_s, request.index,
                                              request.ticket, request))

    def readmit(self, request: Request) -> None:
        """A preempted request returns to the front, or the back (or its place, by its
        key)."""
        if self._heaped:
            self.arrive(request)
        else:
            self._join(request)
            if self.preempted_to_back:
                self._line.append(request)
            else:
                self._line.appendleft(request)

    def _next_deadline(self) -> tuple[float, int, int, Request] | None:
        """The earliest deadline of a request still in the line."""
        deadlines = self._by_deadline
        while deadlines and deadlines[0][2] != deadlines[0][3].ticket:  # seated meanwhile
            heapq.heappop(deadlines)
        return deadlines[0] if deadlines else None

    def next_timeout_s(self) -> float:
        """When the next client waiting gives up (inf if none will)."""
        entry = self._next_deadline()
        return math.inf if entry is None else entry[0]

    def expire(self, now_s: float) -> list[Request]:
        """Take out every request whose client gave up by ``now_s``, in the order they did,
        each with ``abandoned_s`` set to when it did."""
        gone: list[Request] = []
        while True:
            entry = self._next_deadline()
            if entry is None or entry[0] > now_s:
                return gone
            deadline, index, ticket, request = heapq.heappop(self._by_deadline)
            if request.siblings is not None:  # one seated or answered may have put it off
                later = self.deadline_s(request)
                if later > deadline:
                    if later < math.inf:
                        heapq.heappush(self._by_deadline, (later, index, ticket, request))
                    continue
            self.take_out(request, deadline)
            gone.append(request)

    def take_out(self, request: Request, abandoned_s: float) -> None:
        """Take ``request`` out of the line: its client gave up at ``abandoned_s``."""
        if not self._heaped:
            self._line.remove(request)  # near the front: the oldest unseated arrivals
        request.ticket += 1  # its entries in the heaps are stale now
        request.abandoned_s = abandoned_s
        self._count -= 1
        if self._heaped and len(self._heap) > 2 * self._count + 64:
            self._drop_stale()

    def watch(self, request: Request) -> None:
        """``request``, waiting, may give up sooner than its client would have when it
        joined (its siblings stopped decoding): its deadline as of now too."""
        deadline = self.deadline_s(request)
        if deadline < math.inf:
            heapq.heappush(self._by_deadline, (deadline, request.index, request.ticket,
                                               request))

    def _drop_stale(self) -> None:
        """Rebuild the heaps without their stale entries: those of requests that timed out
        deep in the line would otherwise stay (and keep their requests) until they surface,
        which under lasting overload may be never."""
        self._heap = [entry for entry in self._heap if entry[3] == entry[4].ticket]
        heapq.heapify(self._heap)
        self._by_arrival = [entry for entry in self._by_arrival
                            if entry[2] == entry[3].ticket]
        heapq.heapify(self._by_arrival)

    def requests(self) -> list[Request]:
        """Everyone waiting: in the line's order where it is a deque (first come, first
        served, or longest prefix match), else in no particular order."""
        if not self._heaped:
            return list(self._line)
        return [entry[4] for entry in self._heap if entry[3] == entry[4].ticket]


_TOKEN, _RESERVED = MemorySnapshot._fields.index("token"), MemorySnapshot._fields.index(
    "reserved")


@dataclass
class QuietDecode:
    """A run of pure-decode steps advanced at once (:meth:`Scheduler.decode_quietly`): how
    many, when the last ended, who finished then (and how many were aborted then, their
    clients gone), and the memory the steps held."""

    steps: int = 0
    clock_s: float = 0.0
    finished: list[Request] = field(default_factory=list)
    aborted: int = 0
    # Per MemorySnapshot field: slots × seconds, summed over the steps (each step's memory
    # for as long as it ran, as stepping records it).
    slot_seconds: list[float] = field(default_factory=list)
    last_step_s: float = 0.0  # the last step's time (the finishes came at its end)

    def add(self, memory: MemorySnapshot, duration_s: float, written_token_s: float) -> None:
        """Steps that held ``memory`` for ``duration_s`` and, beyond it, wrote tokens worth
        ``written_token_s`` token-seconds into reserved slots."""
        for index, slots in enumerate(memory):
            self.slot_seconds[index] += slots * duration_s
        self.slot_seconds[_TOKEN] += written_token_s
        self.slot_seconds[_RESERVED] -= written_token_s


@dataclass
class Batch:
    """What one engine step computes."""

    prefill: list[tuple[Request, int, int]] = field(default_factory=list)  # (req, new, history)
    decode_seqs: int = 0
    draft_tokens: int = 0  # K: drafts each decoding sequence feeds the step
    context_tokens: int = 0
    prefill_tokens: int = 0
    prefill_pairs: int = 0
    skipped_context: int = 0  # context tokens past a sliding window (its layers skip them)
    skipped_pairs: int = 0  # prefill token pairs past a sliding window
    preempted: int = 0
    # Requests seated (True) or preempted (False) by the step, in the order it did so, for
    # a router that counts waiting requests (vLLM's): None where none listens.
    seatings: list[tuple[Request, bool]] | None = None
    loaded_tokens: int = 0  # prefix-hit tokens read from host memory at admission
    swapped_slots: int = 0  # KV slots copied to host memory (swap out) or back (swap in)
    # The blocks (pages, contiguous extents) those slots are in: vLLM v0 copies each of them
    # layer by layer, K and V apart, a copy each.
    swapped_units: int = 0
    # Fork groups swapped back in (each in ``prefill`` once): every sample reads its own
    # last token, a token of work each, where the entry counts one.
    resumed_groups: list[Request] | None = None
    # SGLang's prefill batch (batching: prefill_first): it reads prompts only, and those
    # decoding wait for the next step that decodes.
    prefill_only: bool = False

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode_seqs


class Scheduler:
    """Continuous batching over one allocator, first come first served, by priority or
    shortest predicted job first, with preemption by recompute or swap (into
    ``swap_slots`` token slots of host memory).

    ``predicted_output`` (per trace request, for a contiguous ``predicted`` reservation or a
    line by predicted length) is what the engine's length predictor says each request will
    generate. Under ``speculative`` decoding, each decode step verifies k drafts for every
    decoding request and keeps τ tokens of it on average (the token clock's rate); with
    ``num_speculative_tokens_per_batch_size``, K drafts by the size of the step before, as
    vLLM proposes them.

    Clients may give up (``queue_timeout_s``: on a seat; ``ttft_timeout_s``: on a first
    token; ``e2e_timeout_s``: on the whole answer; ``itl_timeout_s``: on a next token): the
    line lets go of those waiting, and a step's end aborts those seated whose first token,
    last or next it came too late for (:meth:`time_out` hands both over).

    A request's client receives a token at the end of each step it decodes in, and one when
    a prompt read again after a preemption (or handed over) is done: each request keeps its
    longest wait between two (``max_itl_s``), and the scheduler counts every token by its
    wait (``token_waits_us``, the ITL distribution; where clients may give up mid-answer,
    each request keeps its runs of tokens, ``token_runs``, for the engine to take out the
    tokens of those that did).
    """

    def __init__(self, allocator: KVAllocator, config: SchedulerConfig, debug: bool = False,
                 swap_slots: int = 0, predicted_output: list[int] | None = None,
                 overflow_to_max: bool = False, sliding_window: int = 0,
                 speculative: SpeculativeConfig | None = None,
                 waiting: WaitingLine | None = None,
                 queue_timeout_s: float | None = None,
                 ttft_timeout_s: float | None = None,
                 e2e_timeout_s: float | None = None, itl_timeout_s: float | None = None,
                 tells_seatings: bool = False, line_seed: str = "") -> None:
        self.allocator = allocator
        # Whether each step lists the requests it seated and preempted (Batch.seatings).
        self.tells_seatings = tells_seatings
        # (end of step, the pool's kv_cache_usage then) at each step end that changed it, for
        # a balancer that reads it (see log_usage); None: nobody reads it.
        self.usage_log: deque[tuple[float, float]] | None = None
        self._usage_logged = -1.0
        # The token clock (see the module's docstring) reads ⌊acc / den⌋: acc moves on by
        # each step's rate (τ·den, of the drafts the step verifies), so that with one K it
        # reads ⌊steps·τ⌋. Readings before this step, now and after it: events are keyed by
        # the reading at which they fall due, the range (prev, now] at each step boundary.
        counts = speculative.draft_counts if speculative else [0]
        rates = {drafts: speculative.tokens_per_step_with(drafts) if speculative else
                 Fraction(1) for drafts in counts}
        self._rate_den = math.lcm(*(rate.denominator for rate in rates.values()))
        self._rate_by_drafts = {drafts: rate.numerator * (self._rate_den // rate.denominator)
                                for drafts, rate in rates.items()}
        # Dynamic speculative decoding: K by the size of the step before (None: one K).
        schedule = speculative.num_speculative_tokens_per_batch_size if speculative else None
        assert schedule != "auto", "the engine chooses an auto schedule"
        self._dynamic = speculative if schedule is not None else None
        self.drafts = speculative.drafts_after(0) if speculative else 0  # K of this step
        self._rate_num = self._rate_by_drafts[self.drafts]
        self._clock_acc = 0
        self._clock_prev = -1
        self._clock_now = 0
        self._clock_next = self._rate_num // self._rate_den
        # Tokens a decoding request feeds a step (its last and the drafts, each read and
        # written), and the slots past its tokens the step claims: those for the most
        # drafts, and the lookahead (vLLM's num_lookahead_tokens, fixed whatever K).
        self.step_tokens = 1 + self.drafts
        most = speculative.num_speculative_tokens if speculative else 0
        self._step_claim = 1 + most + (speculative.lookahead_slots if speculative else 0)
        self.predicted_output = predicted_output
        # A request that outgrew its predicted reservation is seated again with its
        # max_tokens (True) or twice the predicted output (False).
        self.overflow_to_max = overflow_to_max
        self.reservation_overflows = 0  # preemptions of requests that outgrew a prediction
        self.config = config
        self.debug = debug
        self.swap_slots = swap_slots  # 0: preempt by recompute only
        # A prefill replica keeps a finished request's KV until it has been sent on: the
        # engine calls release() then.
        self.keep_finished = False
        # SGLang's steps (batching: prefill_first): a prefill batch whenever there are
        # prompts to read, decoding only between (the engine's decode replicas seat the
        # requests handed over into the decode batch instead).
        self.prefill_first = config.batching == "prefill_first"
        self.swap_used = 0  # slots of swap space parked requests hold
        self.swap_preemptions = 0
        self.swapped_out_slots = 0
        self.swapped_in_slots = 0
        # A line of its own, or one it shares with the other batches of a pipeline.
        self.waiting = waiting if waiting is not None else WaitingLine(
            config.policy, config.max_wait_s, config.aging_tokens_per_s or 0.0,
            queue_timeout_s, ttft_timeout_s, e2e_timeout_s, itl_timeout_s,
            config.max_lpm_queue_size, line_seed, config.preempted_rejoin == "back")
        # A streaming client gives up on a decoding request only when a step outlasts this.
        self._itl_timeout_s = itl_timeout_s if itl_timeout_s is not None else math.inf
        # Seated requests whose clients gave up (before their first token, or their last):
        # aborted at the step boundary after, their KV freed (vLLM aborts a request whose
        # client went away), until time_out hands them to the engine.
        self.gave_up: list[Request] = []
        # (deadline, admit_seq, request) of each seated request that may time out, earliest
        # first. The deadline is as of its seating: a first token since may have put it off
        # (it is looked up again when it surfaces); an entry whose admit_seq is no longer
        # in ``running`` (the request finished, was preempted or aborted) is stale.
        self._seated_deadlines: list[tuple[float, int, Request]] = []
        # Under pipeline parallelism the schedulers of the batches in flight, which share
        # the allocator, the line and max_num_seqs (None: this one alone).
        self._peers: list[Scheduler] | None = None
        self._noticed_s = -math.inf  # the last time notice_time was told
        self.running: dict[int, Request] = {}  # admit_seq -> request, in admission order
        self.steps = 0  # steps completed (SGLang's prefill batches aside: steps that decode)
        self._decoded = True  # the last step decoded (not one of SGLang's prefill batches)
        # Steps that read no prompt: SGLang's decode batches, the only ones on which it lowers
        # its new-token ratio (a batch that reads prompts, mixed or not, leaves it).
        self.decode_only_steps = 0
        # A request decoding in two steps in a row waits between its tokens from the end of
        # the first to the end of the second. Those waits of the steps since the batch last
        # had a decoding request, as a stack of (step, wait), steps ascending and waits
        # descending (a wait is dropped when a later one is as long): the first entry at or
        # after a request's first step of a run is the longest wait of the run, found when
        # the run ends, whatever its length.
        self._last_end_s = 0.0
        self._prev_end_s = 0.0  # the end of the step before the last
        self._wait_steps: list[int] = []
        self._waits_s: list[float] = []
        # Every token a client received after one before it, by that wait in microseconds
        # (a step's wait counts once for each request decoding in it): the distribution
        # vLLM's benchmark reports as ITL, kept as counts so that it costs no memory per step.
        self.token_waits_us: dict[int, int] = {}
        # Where clients may give up mid-answer (an e2e_timeout_s or itl_timeout_s), each
        # step's wait (step s's at s - 1, in microseconds), which the runs of tokens of each
        # request decoding refer to (Request.token_runs): the engine takes those of a request
        # given up back out, as vLLM's benchmark counts the tokens of requests served alone.
        self.step_waits_us: list[int] | None = (
            [] if (e2e_timeout_s, itl_timeout_s) != (None, None) else None)
        self.decode_requests = 0
        # Of them, fork groups started over, their tokens unseen (and those a prefill batch
        # gave a first token, until their next: a token alone).
        self.regenerating = 0
        self.num_preemptions = 0
        # Prefix-cache lookups of first admissions: a preempted request looking its own
        # blocks up again is counted apart (vLLM v1's ``preempted_queries``), else every
        # preemption would raise the hit rate.
        self.lookup_tokens = 0
        self.hit_tokens = 0
        self.preempted_lookup_tokens = 0
        self.preempted_hit_tokens = 0
        self.loaded_tokens = 0  # read from a host tier at admission, all admissions
        self.first_loaded_tokens = 0  # of hit_tokens, those read from a host tier
        self._admit_counter = 0
        # Per event kind, clock reading -> [(admit_seq, version, request)]; an entry is
        # stale once the request's version moved on. Buckets, not a heap: every step boundary
        # visits the readings the clock passed, so dict lookups find its events.
        self._events: tuple[dict[int, list], ...] = ({}, {}, {}, {})
        # Lazy decode sums over decoding requests (each weighted by its sequences).
        self.decode_seqs = 0
        self._tok_sync_sum = 0
        self._c_sync_sum = 0
        # Sliding-window layers (a model's; 0: none) read at most the last sliding_window
        # tokens. A decoding sequence's context past the window is k + clock(steps), where
        # k = tok_sync - c_sync + 1 - window never changes while it decodes (syncing moves
        # both), so over the sequences past it the sum is _skip_base + _past_window × clock.
        self.sliding_window = sliding_window
        self._past_window = 0
        self._skip_base = 0
        self.head_blocked = False  # the last admission attempt failed; nothing freed since
        self.prefilling = 0
        self._append = allocator.append
        # Prompt memory taken chunk by chunk as it is written (vLLM v1), not at admission.
        self._per_chunk = config.chunked_prefill and config.prefill_allocation == "per_chunk"
        # The most prompt tokens one request reads in a step (the budget, or vLLM's
        # long_prefill_token_threshold below it).
        self._chunk_cap: int = config.prefill_chunk_tokens
        self._pool: BlockPool | None = getattr(allocator, "pool", None)
        # Paged tables grow a block at a time: a decoding sequence holding t tokens holds
        # ceil(t / bs) blocks. Contiguous extents never grow (cap stays the reservation),
        # and only a predicted reservation may end before the request does.
        self._block_size: int | None = getattr(allocator, "block_size", None)
        # Block tables a sequence keeps (the hybrid manager's groups, else one): its block
        # crossing takes a block in each, and each token it writes a slot in each.
        self._groups: int = getattr(allocator, "groups", 1)
        # Sliding-window tables give back a block at the step whose first token no longer
        # sees it (vLLM's remove_skipped_blocks, every step): a prompt's last chunk's at its
        # first decode step, then one a table each time the window passes a block's end. The
        # hybrid manager that knows where (None where no table gives blocks back).
        self._windowed = allocator if isinstance(allocator, HybridPagedAllocator) and (
            allocator.sliding_groups) else None
        # A prefix cache of states (vLLM's mamba cache mode "align"): the block size prefill
        # chunks end on, so that the states they leave are kept (0: none; mode "all" keeps
        # the states inside a chunk too).
        self._state_align: int = allocator.block_size if isinstance(
            allocator, HybridPagedAllocator) and allocator.caches_states and not (
            allocator.caches_every_state) else 0
        self._predicts = getattr(allocator, "reserve_policy", None) == "predicted"
        # Longest prefix match and dfs_weight rank the line by the prefix cache: without
        # one, first come, first served (as SGLang falls back when its radix cache is off).
        self._by_cache = (self.waiting.by_prefix or self.waiting.by_cache_tree) and getattr(
            allocator, "enable_prefix_caching", False)
        if self._by_cache and self.waiting.by_prefix:
            self.waiting.prefix_tokens = self._ready_prompt_tokens
        elif self._by_cache:
            self.waiting.cached_path = self._cached_path
        # Whether the line is ordered anew each round with a seat to fill (by the cache, at
        # random, or by max_tokens).
        self._ranked_line = self.waiting.reorders()
        # SGLang's admission (admission: new_token_ratio): a newcomer is seated only where
        # the pool keeps room for what those running may still generate (None: seated as
        # soon as its own memory is free). Blocks are reserved: a paged pool's.
        self._new_token_ratio: NewTokenRatio | None = None
        self._reserving: PagedAllocator | None = None
        if config.admission == "new_token_ratio":
            if not isinstance(allocator, PagedAllocator):
                raise ValueError("admission new_token_ratio reserves blocks: it needs paged "
                                 "(or virtual) memory without the hybrid manager")
            conservativeness = config.schedule_conservativeness
            self._new_token_ratio = NewTokenRatio(
                1.0 if conservativeness is None else conservativeness)
            self._reserving = allocator
        self._retracted = False  # this step preempted for memory
        # SGLang's retraction frees a victim's generated KV uncached, its prompt staying in
        # the tree (preempted_cache: prompt); None: a victim leaves every full block cached.
        self._prompt_only_cache: PagedAllocator | None = None
        if config.preempted_cache == "prompt":
            if not isinstance(allocator, PagedAllocator):
                raise ValueError("preempted_cache prompt forgets blocks: it needs paged "
                                 "memory without the hybrid manager")
            self._prompt_only_cache = allocator
        # Times the line's head found memory for itself but not for the room kept for
        # decoding besides (what SGLang's caution costs): each time, no one is seated until
        # memory is freed.
        self.reserve_holds = 0
        if (self._predicts or self.waiting.by_length) and predicted_output is None:
            raise ValueError("a predicted reservation, or a line by predicted length, needs "
                             "the predicted output lengths")

    def share_seats(self, peers: list[Scheduler]) -> None:
        """Count ``peers``' running requests (this one among them) against max_num_seqs,
        as vLLM counts every request of every batch in flight."""
        self._peers = peers

    def _seated(self) -> int:
        """Requests seated against max_num_seqs."""
        if self._peers is None:
            return len(self.running)
        return sum(len(peer.running) for peer in self._peers)

    # ------------------------------------------------------------------ queue
    def fits_ever(self, request: Request) -> bool:
        """Whether ``request`` (all its samples) fits this pool when nothing else holds it."""
        spec = request.spec()
        if self._windowed is not None:
            return self._windowed.can_admit_ever(spec, request.n)
        fits = self.allocator.can_admit_ever(spec)
        if fits and self._reserving is not None:
            # Seated alone, it still keeps room for its own max_tokens.
            fits = self._reserving.blocks_for(
                spec.prompt_len + self._new_tokens_left(request)) <= self._reserving.num_blocks
        if fits and request.n > 1:
            if isinstance(self.allocator, ContiguousAllocator):
                # Contiguous samples cannot share: all n reservations must fit at once (a
                # predicted one grows, as far as the true length, by preemption).
                need = request.n * (spec.final_len if self._predicts
                                    else self.allocator.reservation(spec))
            else:
                # Paged samples share the prompt's full blocks and own the rest.
                bs = self.allocator.block_size  # type: ignore[attr-defined]
                own = -(-spec.final_len // bs) - spec.prompt_len // bs
                need = (spec.prompt_len // bs + request.n * own) * bs
            fits = need <= self.allocator.capacity_slots
        return fits

    def add(self, request: Request, bounded: bool = True) -> bool:
        """Queue a new arrival; a request that could never fit is rejected, and, where the
        line is ``bounded``, one that finds ``max_queued_requests`` waiting is shed
        (False)."""
        if self.predicted_output is not None and not request.predicted_output:
            # What the engine's predictor expects it to generate (its reservation and its
            # place in a line by length follow from it).
            request.predicted_output = self._within_pool(
                request, self.predicted_output[request.index])
            request.spec_cache = None
        if not self.fits_ever(request):
            request.rejected = True
            return False
        limit = self.config.max_queued_requests
        if bounded and limit is not None and len(self.waiting) >= limit:
            request.shed = True  # the server answers 503 (or 429) at once
            if request.siblings is not None:
                request.siblings.shed = True
            return False
        self.waiting.arrive(request)
        # A new head may fit where the old one did not (under lpm, the next ranking may put
        # the arrival first).
        if self.waiting.head() is request or self.waiting.ranks():
            self.head_blocked = False
        return True

    def _ready_prompt_tokens(self, request: Request) -> int:
        """Prompt tokens a waiting request would not compute if seated now: those the
        prefix cache holds, or all it brings (KV another replica read, or swapped out)."""
        spec = request.spec()
        return max(self.allocator.cached_prefix_tokens(spec, self._kept_hasher(request)),
                   request.transferred, request.swapped)

    def _cached_path(self, request: Request) -> list[int]:
        """The hashes of the blocks of a waiting request's prompt the GPU's prefix cache
        holds now, from its first: its path down the cache's tree (dfs_weight)."""
        bs = self._block_size
        assert bs is not None  # (a pool with a prefix cache is paged)
        hasher = self._kept_hasher(request)
        return hasher.hashes[:self.allocator.cached_prefix_tokens(request.spec(), hasher) // bs]

    def _kept_hasher(self, request: Request) -> BlockHasher:
        """The request's content hashes, kept from one ranking to the next."""
        hasher = request.prefix_hasher
        if hasher is None:
            hasher = request.prefix_hasher = BlockHasher(
                request.spec().segments, self._block_size)  # type: ignore[arg-type]
        return hasher

    def _samples_fit(self, request: Request, spec: SeqSpec) -> bool:
        """Whether every sample of the request would find memory now. Contiguous samples
        cannot share: the engine seats a request only where all their extents can be placed
        (each taken as its prompt is read and forked), or it would read a prompt it has no
        room to sample from."""
        if request.n == 1 or not isinstance(self.allocator, ContiguousAllocator):
            return True
        samples = [spec, *(request.spec(sample) for sample in range(1, request.n))]
        return self.allocator.can_place(samples, at_least=spec.prompt_len)

    @property
    def new_token_ratio(self) -> float | None:
        """SGLang's ratio as the next step's admissions read it (None under vLLM's
        admission)."""
        ratio = self._new_token_ratio
        return None if ratio is None else ratio.at(self.decode_only_steps)

    def _new_tokens_left(self, request: Request) -> int:
        """The tokens SGLang's admission counts on ``request`` still generating here: its
        max_tokens left, at most :data:`CLIP_MAX_NEW_TOKENS`; none on a prefill replica,
        which hands it on after its prompt."""
        if self.keep_finished:
            return 0
        return min(request.max_len - request.prompt_len - self.generated(request),
                   CLIP_MAX_NEW_TOKENS)

    def _decode_reserve(self) -> int:
        """Token slots SGLang's admission keeps free for the requests decoding (in every
        batch in flight): each one's max_tokens left (clipped) times the ratio."""
        ratio = self._new_token_ratio
        assert ratio is not None
        left = sum(sched._new_tokens_left(request) for sched in self._peers or [self]
                   for request in sched.running.values() if request.decoding)
        return math.ceil(ratio.at(self.decode_only_steps) * left)

    def _retraction_guess(self) -> None:
        """This step preempted for memory: the ratio becomes what those still decoding
        show."""
        ratio = self._new_token_ratio
        assert ratio is not None
        generated = max_new = requests = 0
        for request in self.running.values():
            if request.decoding:
                generated += self.generated(request)
                max_new += request.max_len - request.prompt_len
                requests += 1
        ratio.after_preemption(self.decode_only_steps, generated, max_new, requests)

    def _within_pool(self, request: Request, predicted_output: int) -> int:
        """A predicted output no larger than lets all the request's samples' reservations
        fit the pool (the allocator cannot place more; the true length fits if any does)."""
        most = self.allocator.capacity_slots // request.n - request.prompt_len
        return max(1, min(predicted_output, most))

    def notice_time(self, now_s: float) -> None:
        """The engine is at a step boundary at ``now_s``: what the allocator does next
        happens then (its KV events are stamped so). Under aging the line's head depends on
        the time: the earliest arrival goes ahead once it has waited ``max_wait_s``, and a
        head blocked before may give way to one that fits."""
        if self._pool is not None:
            self._pool.clock_s = now_s
        if self.waiting.max_wait_s is None:
            return
        if self._noticed_s < self.waiting.oldest_due_s() <= now_s:
            self.head_blocked = False
        self._noticed_s = self.waiting.clock = now_s

    def next_promotion_s(self) -> float:
        """When the line's head next changes by time alone (aging, or a client giving up),
        or inf: a run of decode steps must stop there, as stepping would try to seat it
        then."""
        due = self.waiting.oldest_due_s()
        return min(due if due > self._noticed_s else math.inf, self.waiting.next_timeout_s())

    def time_out(self, now_s: float) -> list[Request]:
        """The requests whose clients gave up by ``now_s``, in the order they did: those
        waiting, taken out of the line (a head that could not be seated may have been one of
        them), and those seated that steps ending by then aborted."""
        gone = self.waiting.expire(now_s)
        schedulers = self._peers or [self]  # (a pipeline's batches share the line)
        if gone:
            for sched in schedulers:
                sched.head_blocked = False
            for request in gone:  # one preempted mid-answer may have parked its KV
                self._free_swap(request)  # (never under pipeline stages: one scheduler's)
        aborted = [request for sched in schedulers for request in sched.gave_up]
        if aborted:
            for sched in schedulers:
                sched.gave_up = []
            gone = sorted(gone + aborted, key=lambda r: (r.abandoned_s, r.index))
        return gone

    def _snapshot_head(self) -> SeqSpec | None:
        # Only contiguous memory has external fragmentation, defined by the waiting head.
        if self._block_size is None and self.waiting:
            return self.waiting.head().spec()
        return None

    def generated(self, request: Request) -> int:
        if request.decoding:
            return request.gen_sync + self._clock_now - request.c_sync
        return request.gen_sync

    # ------------------------------------------------------------------ lazy decode
    def _advance(self, batch_size: int, end_s: float, read_prompts: bool = False) -> bool:
        """A step of ``batch_size`` requests (that ``read_prompts`` or not) is done at
        ``end_s``: the token clock moves on by its rate, and the next step verifies the
        drafts proposed for a batch of that size (dynamic speculative decoding); True if
        that changed K."""
        self.steps += 1
        if not read_prompts:
            self.decode_only_steps += 1
        self._decoded = True
        self._prev_end_s = self._last_end_s
        wait_s = end_s - self._last_end_s
        if self.step_waits_us is not None:
            self.step_waits_us.append(wait_us(wait_s))
        if self.decode_seqs:  # (a step no request decodes in is in no run of tokens)
            waits = self._waits_s
            while waits and waits[-1] <= wait_s:
                waits.pop()
                self._wait_steps.pop()
            waits.append(wait_s)
            self._wait_steps.append(self.steps)
        self._last_end_s = end_s
        self._clock_acc += self._rate_num
        self._clock_prev = self._clock_now
        self._clock_now = self._clock_next
        changed = False
        dynamic = self._dynamic
        if dynamic is not None:
            drafts = dynamic.drafts_after(batch_size)
            if drafts != self.drafts:
                changed = True
                self.drafts = drafts
                self.step_tokens = 1 + drafts
                self._rate_num = self._rate_by_drafts[drafts]
                self.head_blocked = False  # another budget: someone may be seated now
        self._clock_next = (self._clock_acc + self._rate_num) // self._rate_den
        return changed

    def _step_reaching(self, tokens: int) -> int:
        """With one K: the first step by which the token clock reads ``tokens``."""
        return -(-tokens * self._rate_den // self._rate_num)

    def _before_finish(self, key: int, finish: int) -> bool:
        """Whether an event due at clock reading ``key`` comes at a step before the step
        boundary of a finish due at ``finish``. With K by batch size the steps of later
        readings are not known yet: every event short of the finish is kept (one that comes
        at the finish's boundary finds the request done, and is skipped)."""
        if self._dynamic is not None:
            return key < finish
        return self._step_reaching(key) < self._step_reaching(finish)

    def _due_now(self, events: dict[int, list]) -> bool:
        """Whether ``events`` holds a bucket due at this step boundary."""
        # (A loop, not any(): mypyc compiles it to a plain C loop, it runs every step.)
        for key in range(self._clock_prev + 1, self._clock_now + 1):  # noqa: SIM110
            if key in events:
                return True
        return False

    def _written(self, request: Request) -> int:
        """Tokens a decoding request has written before this step (its computed context)."""
        return request.tok_sync + self._clock_now - request.c_sync

    def _pending(self) -> int:
        """Decode tokens written but not yet told to the allocator (all sequences)."""
        return self.decode_seqs * self._clock_now - self._c_sync_sum

    def pending_slots(self) -> int:
        """Slots of the decode tokens written but not yet told to the allocator."""
        return self._pending() * self._groups

    def snapshot(self) -> MemorySnapshot:
        """The allocator's taxonomy with lazily-written decode tokens moved to ``token``
        (each a slot in every group's table)."""
        snap = self.allocator.snapshot(self._snapshot_head())
        pending = self.pending_slots()
        if not pending:
            return snap
        return MemorySnapshot(snap.token + pending, snap.reserved - pending, snap.internal,
                              snap.external, snap.cached, snap.free, snap.duplicate)

    def _sync(self, request: Request, include_current: bool) -> bool:
        """Tell the allocator the request's lazily written tokens (and, with
        ``include_current``, those this step keeps, claiming what the step writes past them:
        its drafts and lookahead); False if memory is short."""
        target = self._clock_next if include_current else self._clock_now
        # A request's last step keeps no more than it has left to generate.
        count = min(target - request.c_sync, request.output_len - request.gen_sync)
        if count <= 0:
            return True
        lookahead = 0
        if include_current and self._step_claim > 1:
            # The step claims slots for what it reads past the tokens before it.
            lookahead = self._written(request) + self._step_claim - request.tok_sync - count
        windowed = self._windowed
        if windowed is not None:
            # Its windows give back what the step's first token cannot see (this step's,
            # or, finished or preempted, the last's): a speculative step keeps several.
            step_start = self._written(request) if include_current else (
                request.tok_sync + self._clock_prev - request.c_sync)
            if request.num_seqs == 1:
                if not windowed.append(request.index * MAX_SAMPLES, count, lookahead,
                                       step_start):
                    return False
            else:
                seq_ids = request.seq_ids()
                if not windowed.appends_fit(seq_ids, count, lookahead, step_start):
                    return False
                for seq_id in seq_ids:
                    appended = windowed.append(seq_id, count, lookahead, step_start)
                    assert appended, "appends_fit said every sample fits"
        elif request.num_seqs == 1:
            if not self._append(request.index * MAX_SAMPLES, count, lookahead):
                return False
        else:
            seq_ids = request.seq_ids()
            claim = min(count + lookahead, request.final_len - request.tok_sync)
            if self.allocator.max_uniform_append(seq_ids, claim) < claim:
                return False
            for seq_id in seq_ids:
                self.allocator.append(seq_id, count, lookahead)
        # Tokens and clock move together: where a last step keeps less than the clock says,
        # the request still reads its tokens before the step exactly, and finishes at its end.
        if request.decoding:
            seqs = request.num_seqs
            self._tok_sync_sum += seqs * count
            self._c_sync_sum += seqs * count
        request.tok_sync += count
        request.gen_sync += count
        request.c_sync += count
        return True

    def _start_decoding(self, request: Request, after_prefill_batch: bool = False) -> None:
        """After its prefill step: decode lazily from now on. After a prefill batch (which
        ended after the last decode step), its next token's wait runs from its first, not
        from the end of that decode step as the others' do: it gets that token alone."""
        request.decoding = True
        request.streak_step = self.steps + 1
        self.decode_requests += 1
        request.c_sync = self._clock_now
        request.tok_sync = self.allocator.num_tokens(request.index * MAX_SAMPLES)
        seqs = request.num_seqs
        self.decode_seqs += seqs
        self._tok_sync_sum += seqs * request.tok_sync
        self._c_sync_sum += seqs * request.c_sync
        request.version += 1
        self._push_events(request, start=True)
        # The clock reading at which its client's next token comes alone (0: with the
        # step's, counted by the step's wait).
        caught_up = 0
        if request.gen_sync <= request.client_tokens:
            # Started over: its client has these tokens, and waits for the one after.
            caught_up = request.c_sync + request.client_tokens + 1 - request.gen_sync
        elif after_prefill_batch:
            caught_up = request.c_sync + 1  # (the next decode step's)
        if caught_up:
            request.regenerating = True
            self.regenerating += 1
            request.streak_step = NO_STEP
            self._events[CAUGHT_UP].setdefault(caught_up, []).append(
                (request.admit_seq, request.version, request))
            if self.waiting.seated_may_time_out:
                # Its client now waits for a token since its last, which may come before
                # the deadline it was seated with (a first token given by a prefill batch:
                # the wait for the second is no step's, and the step-wide check skips it).
                self._watch_seated(request)
        elif request.siblings is not None:
            request.siblings.decoding += 1
        if self.sliding_window:
            past = self._past_window_offset(request)
            if past + request.c_sync > 0:
                self._leave_window(request)
            elif self._before_finish(reaching := 1 - past, self._finish_key(request)):
                # The step whose context first holds a token past the window, before it ends.
                entry = (request.admit_seq, request.version, request)
                self._events[WINDOW].setdefault(reaching, []).append(entry)

    def _finish_key(self, request: Request) -> int:
        """The clock reading at which a decoding request has generated all its output
        (syncing moves tokens, generated count and clock reading together, so it holds)."""
        return request.c_sync + request.output_len - request.gen_sync

    def _past_window_offset(self, request: Request) -> int:
        """k: a decoding request's context holds k + clock(steps) tokens past the sliding
        window."""
        return request.tok_sync - request.c_sync + 1 - self.sliding_window

    def _leave_window(self, request: Request) -> None:
        """From now on the request's context grows past the window, as the clock does."""
        request.past_window = True
        self._past_window += request.num_seqs
        self._skip_base += request.num_seqs * self._past_window_offset(request)

    def _windows_due(self) -> None:
        for request in self._due(WINDOW):
            self._leave_window(request)

    def skipped_context(self) -> int:
        """Context tokens of this step past the sliding window, over every sequence."""
        if not self._past_window:
            return 0
        return self._skip_base + self._past_window * self._clock_now

    def _stop_decoding(self, request: Request, received_now: bool = True) -> None:
        """The request's run of decode steps ends with the last step (whose token its client
        received, unless it gave up by then: not ``received_now``)."""
        step_waits = self.step_waits_us
        if step_waits is not None:
            last = self.steps if received_now else self.steps - 1
            if request.streak_step <= last:
                _keep_run(request, step_waits, request.streak_step - 1, last)
        if request.streak_step <= self.steps:  # a token each step since it started decoding
            longest_s = self._waits_s[bisect_left(self._wait_steps, request.streak_step)]
            if longest_s > request.max_itl_s:
                request.max_itl_s = longest_s
            request.last_token_s = self._last_end_s
        seqs = request.num_seqs
        self.decode_seqs -= seqs
        self._tok_sync_sum -= seqs * request.tok_sync
        self._c_sync_sum -= seqs * request.c_sync
        if request.past_window:
            request.past_window = False
            self._past_window -= seqs
            self._skip_base -= seqs * self._past_window_offset(request)
        streaming = not request.regenerating  # (its siblings count it as decoding)
        if request.regenerating:
            request.regenerating = False
            self.regenerating -= 1
        request.decoding = False
        request.version += 1
        self.decode_requests -= 1
        if not self.decode_seqs:  # no run of tokens goes on: none will ask of these steps
            self._wait_steps.clear()
            self._waits_s.clear()
        siblings = request.siblings
        if siblings is not None and streaming:
            siblings.decoding -= 1
            # (A client who gave up on it gave up on them all: nothing to watch.)
            if received_now and request.last_token_s > siblings.last_token_s:
                siblings.last_token_s = request.last_token_s
            if received_now and not siblings.decoding:
                self._watch_siblings(siblings, request)

    def _watch_siblings(self, siblings: Siblings, stopped: Request) -> None:
        """None of ``siblings`` decodes since ``stopped`` stopped (or finished without
        decoding): the others, waiting or reading a prompt, may give up a next token's wait
        from their last one; ``stopped`` itself, put back in the line, says when as it
        joins."""
        for member in siblings.members:
            if member is stopped or member.abandoned_s >= 0 or member.finished_s >= 0:
                continue
            if self.running.get(member.admit_seq) is member:
                self._watch_seated(member)
            else:
                self.waiting.watch(member)

    def _watch_seated(self, request: Request) -> None:
        """``request``, seated, gives up at its client's deadline as of now, if it has one
        (:meth:`_abort_overdue` asks again then: a token since may have put it off)."""
        deadline = self.waiting.deadline_s(request)
        if deadline < math.inf:
            heapq.heappush(self._seated_deadlines, (deadline, request.admit_seq, request))

    def _push_events(self, request: Request, *, start: bool = False) -> None:
        """Queue the request's next block crossing: the first step that claims a slot past
        the memory it holds, or whose sliding windows give a block back (and, when it starts
        decoding, its finish)."""
        finish = self._finish_key(request)
        entry = (request.admit_seq, request.version, request)
        if start:
            self._events[FINISH].setdefault(finish, []).append(entry)
        final_len = request.final_len
        release = final_len  # the first token whose step gives a block back (none: final_len)
        bs = self._block_size
        if bs is not None:
            cap = -(-request.tok_sync // bs) * bs
            windowed = self._windowed
            if start and (request.num_seqs > 1 or windowed is not None):
                # The first decode step writes at once: samples sharing the prompt's last
                # block copy it (or, the block full, take one of their own), and sliding
                # windows give back what the prompt's last chunk held and the step cannot see.
                cap = request.tok_sync
            elif windowed is not None:
                # Or earlier, at the step whose first token's window misses one more block
                # than the last synced step's did (a step starts at most at final_len - 1).
                release = min(final_len, windowed.next_release(request.index * MAX_SAMPLES))
        elif self._predicts:
            # The request outgrows its extent when it writes the slot past its end.
            cap = self.allocator.allocated_slots(request.index * MAX_SAMPLES)
        else:
            return  # a contiguous extent is reserved to the final length: it never grows
        if cap >= final_len and release >= final_len:
            return  # it holds all it will ever claim (a step claims no slot past the end)
        # A step claims its tokens before it + _step_claim slots; the first step not yet
        # synced is this one (a request just seated: readings past the last boundary's), or
        # the next (readings past this one's). Its first token is its tokens before it.
        first = (self._clock_prev if request.c_sync <= self._clock_now
                 else self._clock_now) + 1
        offset = request.c_sync - request.tok_sync  # reading = offset + the step's first token
        grow = offset + release
        if cap < final_len:
            grow = min(grow, offset + cap - self._step_claim + 1)
        grow = max(first, grow)
        if self._before_finish(grow, finish):
            self._events[GROW].setdefault(grow, []).append(entry)

    def _due(self, kind: int) -> list[Request]:
        """Take the valid events of ``kind`` due at this step boundary, in admission order."""
        events = self._events[kind]
        bucket: list | None = None
        for key in range(self._clock_prev + 1, self._clock_now + 1):
            found = events.pop(key, None)
            if found is not None:
                if bucket is None:
                    bucket = found
                else:
                    bucket += found
        if bucket is None:
            return []
        if len(bucket) > 1:
            bucket.sort()  # by admit_seq (unique), so requests are never compared
        return [request for _, version, request in bucket
                if version == request.version and request.decoding]

    # ------------------------------------------------------------------ preemption
    def _victim(self) -> Request:
        if self.waiting.by_priority:
            # The lowest priority (highest value), the latest arrival among equals (vLLM v1).
            return max(self.running.values(),
                       key=lambda r: (r.priority, r.arrival_s, r.index))
        if self.config.preemption_victim == "fewest_generated":
            # Fewest generated tokens, then the longest prompt (SGLang's retraction order),
            # then the most recently admitted.
            return min(reversed(self.running.values()),
                       key=lambda r: (self.generated(r), -r.prompt_len))
        return next(reversed(self.running.values()))

    def _make_room(self, request: Request, batch: Batch) -> bool:
        """With ``priority_preemption``, preempt the worst running request if its priority
        is worse than waiting ``request``'s, which then needs its seat or memory (vLLM v0's
        priority preemption); False if nobody was preempted."""
        if not self._may_make_room(request):
            return False
        self._preempt(self._victim(), batch)
        return True

    def _may_make_room(self, request: Request) -> bool:
        """Whether :meth:`_make_room` would preempt someone for waiting ``request``."""
        return (self.config.priority_preemption and bool(self.running)
                and self._victim().priority > request.priority)

    def _preempt_victim(self, request: Request, batch: Batch) -> bool:
        """Preempt the running request that gives way first (:meth:`_victim`) to make room
        for ``request``; False if that was ``request`` itself."""
        victim = self._victim()
        self._preempt(victim, batch)
        self._retracted = True
        return victim is not request

    def _preempt(self, request: Request, batch: Batch) -> None:
        batch.preempted += 1
        if batch.seatings is not None:
            batch.seatings.append((request, False))
        decoding = request.decoding
        if decoding:
            self._sync(request, include_current=False)  # cache what it computed
            self._stop_decoding(request)
        elif request.in_prefill:
            self.prefilling -= 1
        now = self._clock_now
        if request.c_sync > now:
            request.gen_sync -= request.c_sync - now  # this step's tokens never happen
            request.c_sync = now
        if decoding:
            request.computed_tokens = final_kv_tokens(request.prompt_len, request.gen_sync)
        if decoding and self.swap_slots and (
                request.n > 1 or self.config.preemption_mode == "swap"):
            self._swap_out(request, batch)
        prompt_only = self._prompt_only_cache
        for seq_id in request.seq_ids():
            if prompt_only is not None and decoding:
                prompt_only.free_caching_prefix(seq_id, request.prompt_len)
            else:
                self.allocator.free(seq_id)
        request.num_seqs = 0
        request.prefilled = request.prefill_target = 0
        request.preemptions += 1
        request.resumed = request.resumed or (request.computed and not request.swapped)
        if request.n > 1 and not request.swapped:
            # Forks cannot be rebuilt from sample 0: restart the request.
            request.client_tokens = max(request.client_tokens, request.gen_sync)
            request.discarded_output += request.gen_sync
            request.gen_sync = 0
        del self.running[request.admit_seq]
        self.waiting.readmit(request)
        self.num_preemptions += 1
        self.head_blocked = False

    def _swap_out(self, request: Request, batch: Batch) -> None:
        """Park a decoding request's KV in host memory if the swap space has room: all of
        it, which is all but its last token's (never yet a step's input): seated again, that
        token is computed as a fully cached prompt's last token is (so that step computes a
        token for it, as a decode step would). A request's samples go together."""
        tokens = final_kv_tokens(request.prompt_len, request.gen_sync)
        bs = self._block_size
        slots = -(-tokens // bs) * bs if bs else tokens  # paged memory moves whole blocks
        allocator = self.allocator
        if request.num_seqs > 1 and isinstance(allocator, PagedAllocator):
            # A group's blocks, each once: those of its prompt its samples share, their own.
            held = {block for seq_id in request.seq_ids()
                    for block in allocator.block_table(seq_id)}
            slots = len(held) * allocator.block_size
        elif request.num_seqs > 1:
            slots *= request.num_seqs  # contiguous samples share nothing
        if self.swap_used + slots > self.swap_slots:
            return  # no room: recompute it
        request.swapped = tokens
        request.swap_slots = slots
        self.swap_used += slots
        self.swap_preemptions += 1
        self.swapped_out_slots += slots
        batch.swapped_slots += slots
        batch.swapped_units += self._swap_units(request, slots)

    def _swap_units(self, request: Request, slots: int) -> int:
        """The pieces ``slots`` of ``request``'s KV cross the host link in, each copied on
        its own: whole blocks (pages), or each sample's contiguous extent."""
        bs = self._block_size
        if bs:
            return -(-slots // bs)
        return request.n if slots else 0

    def _admit_group(self, request: Request, spec: SeqSpec) -> int | None:
        """Seat a group of forked samples swapped out whole, as it was: its prompt (what
        the cache holds of it found there), the samples forked from it, each with its own
        tokens; the prompt tokens found cached, or None if the pool cannot hold it."""
        parent = replace(spec, prompt_len=request.prompt_len)  # (sample 0's, less its tokens)
        samples = [request.spec(sample) for sample in range(1, request.n)]
        return self.allocator.admit_forks(parent, samples, request.swapped)

    def _swap_in(self, request: Request, hits: int, batch: Batch) -> None:
        """Copy a parked request's KV back, but for the blocks still cached on the GPU (a
        host tier's blocks come up the same link: they count as copied)."""
        if request.n > 1:  # a group, seated whole with its samples' tokens
            request.num_seqs = request.n
            request.prefilled = request.swapped
        else:
            self._write_ready(request, request.swapped, hits)
        slots = max(request.swap_slots - (hits - self.allocator.last_loaded_tokens), 0)
        self.swapped_in_slots += slots
        batch.swapped_slots += slots
        batch.swapped_units += self._swap_units(request, slots)
        self._free_swap(request)

    def _free_swap(self, request: Request) -> None:
        """``request``'s KV parked in host memory is back, or no longer wanted: its swap
        space is free."""
        self.swap_used -= request.swap_slots
        request.swapped = request.swap_slots = 0

    def _write_ready(self, request: Request, ready: int, hits: int) -> None:
        """Write the KV of the first ``ready`` tokens, which arrives computed (from another
        replica, or back from host memory), beyond the ``hits`` the prefix cache holds: no
        step computes it."""
        arrived = max(ready - hits, 0)
        if arrived:
            seq_id = request.index * MAX_SAMPLES
            # (Under the hybrid manager only a transfer arrives: swapping is not modelled.)
            written = (self._windowed.arrive(seq_id, arrived) if self._windowed is not None
                       else self.allocator.append(seq_id, arrived))
            assert written  # admission claimed the prompt's blocks
            request.prefilled += arrived

    def _grow_now(self, request: Request, batch: Batch) -> bool:
        """Sync ``request`` through this step's token, preempting others while memory is
        short; False if the request itself was preempted."""
        while not self._sync(request, include_current=True):
            if self._block_size is None:
                self._overflow(request, batch)
                return False
            if not self._preempt_victim(request, batch):
                return False
        if request.decoding:
            self._push_events(request)
        return True

    def _overflow(self, request: Request, batch: Batch) -> None:
        """``request`` outgrew its predicted contiguous reservation. The extent cannot grow
        where it lies, and preempting others would not lengthen it, so the request itself
        goes back to the line, to be seated with a larger reservation (S3's rescheduling
        of a misprediction): twice the predicted output, or its max_tokens."""
        larger = (request.max_len - request.prompt_len if self.overflow_to_max
                  else 2 * request.predicted_output)
        request.predicted_output = self._within_pool(request, larger)
        request.spec_cache = None
        self.reservation_overflows += 1
        self._preempt(request, batch)

    # ------------------------------------------------------------------ one step
    def fast_step_ready(self) -> bool:
        """True if the next step is pure decode with no admission possible: the engine may
        then run it through :meth:`fast_step` without a full :meth:`schedule`."""
        return (self.decode_seqs > 0 and not self.prefilling
                and (not self.waiting or self.head_blocked))

    def fast_step(self) -> bool:
        """Claim memory for a pure-decode step's block crossings, if there is enough without
        preempting (else change nothing and return False)."""
        if self.sliding_window:
            self._windows_due()
        due = self._due(GROW)
        if not due:
            return True
        if self._windowed is not None:
            need, gives_back = self._window_grows(self._windowed, due)
        elif self._step_claim > 1 and self._block_size is not None:
            need, gives_back = sum(r.num_seqs * self._claim_blocks(r) for r in due), False
        else:
            need, gives_back = sum(r.num_seqs for r in due) * self._groups, False
        # A contiguous extent's end is always an overflow: schedule() preempts for it. Per
        # chunk, a blocked head's claim grows with its prefix hits, so evicting one of them
        # may let it in; under lpm, evicting one may put another request at the head: in
        # either case schedule() then tries, as stepping would (taking only blocks that hold
        # nothing cached evicts nothing).
        if self._block_size is None or gives_back or need > (
                self.allocator.num_free_blocks) or (  # type: ignore[attr-defined]
                (self._per_chunk or self._by_cache) and self.waiting
                and self._pool is not None
                and need > self._pool.num_free - self._pool.num_cached_free):
            # Put them back for schedule() to handle with preemption.
            self._events[GROW][self._clock_now] = [(r.admit_seq, r.version, r) for r in due]
            return False
        for request in due:
            synced = self._sync(request, include_current=True)  # blocks counted above
            assert synced  # (never inside the assert: ``python -O`` would skip the write)
            self._push_events(request)
        return True

    def _claim_blocks(self, request: Request) -> int:
        """Blocks, at most, one sequence of a speculating request takes at its block
        crossing: those its claim reaches past its table, and a copy of a shared tail."""
        bs = self._block_size
        assert bs is not None
        claim = min(self._written(request) + self._step_claim, request.final_len)
        held = self.allocator.allocated_slots(request.index * MAX_SAMPLES) // bs
        return max(1, -(-claim // bs) - held) + (request.num_seqs > 1)

    def _window_grows(self, windowed: HybridPagedAllocator, due: list[Request]
                      ) -> tuple[int, bool]:
        """Blocks the sliding-window model's requests with an event this step take, and
        whether one of them gives a block back. Giving back frees memory, which may seat the
        line's head: schedule() then tries, as stepping would (and always at a first decode
        step, which gives back what the prompt's last chunk held)."""
        need = 0
        gives_back = False
        advance = self._clock_now - self._clock_prev  # tokens the last step kept
        for request in due:
            token = self._written(request)  # this step's first
            claim = min(token + self._step_claim, request.final_len)
            # Samples grow alike; each may copy a tail it shares, one block a group.
            need += request.num_seqs * windowed.blocks_to_hold(
                request.index * MAX_SAMPLES, claim) + (
                request.num_seqs * windowed.groups if request.num_seqs > 1 else 0)
            if request.tok_sync == request.prefill_target or (self.waiting and (
                    windowed.release_point(token) > windowed.release_point(token - advance))):
                gives_back = True
        return need, gives_back

    def schedule(self, now_s: float) -> Batch:
        """Choose this step's work (starting at ``now_s``) and claim its memory."""
        self.notice_time(now_s)
        batch = Batch()
        if self.tells_seatings:
            batch.seatings = []
        budget = self.config.max_num_batched_tokens
        ratio = self._new_token_ratio
        if ratio is not None and not self.running:
            ratio.reset(self.decode_only_steps)
        if self.sliding_window:
            self._windows_due()
        if not self.prefill_first:
            self._grow_decoders(batch)
            budget -= self.decode_seqs * self.step_tokens  # (vLLM counts drafts as new tokens)
        self._read_prompts(batch, budget, now_s)
        if self.prefill_first:
            # SGLang runs a prefill batch whenever it has prompts to read; the running
            # requests decode only in a step without one.
            if not batch.prefill:
                if self._grow_decoders(batch) and self._reserving is None:
                    # Claims after the seating may have freed memory for the line's head
                    # (sliding windows giving blocks back) or evicted its prefix hits: the
                    # next step tries it again.
                    self.head_blocked = False
                if not self.decode_seqs and self.waiting:
                    # Those decoding all went back to the line (outgrown extents): seat now
                    # (the engine would find the step empty, the next one seats).
                    self._read_prompts(batch, budget, now_s)
            batch.prefill_only = bool(batch.prefill)
        if self._retracted:
            self._retracted = False
            if ratio is not None:
                self._retraction_guess()
        computed = [(chunk, history) for _, chunk, history in batch.prefill]
        if batch.resumed_groups:  # (one preempted since has no samples left)
            computed += [(1, group.prefilled - 1) for group in batch.resumed_groups
                         for _ in range(group.num_seqs - 1)]
        batch.prefill_tokens = sum(chunk for chunk, _ in computed)
        batch.prefill_pairs = sum(chunk * (history + chunk) for chunk, history in computed)
        window = self.sliding_window
        if window:  # a sliding layer's new tokens each meet at most a window of keys
            batch.skipped_pairs = sum(chunk * max(0, history + chunk - window)
                                      for chunk, history in computed)
        self.fill_decode(batch)
        return batch

    def _read_prompts(self, batch: Batch, budget: int, now_s: float) -> None:
        """Put into ``batch`` the prompts this step reads, within ``budget`` tokens: the next
        chunks of those being read, then the requests it seats (claiming their memory)."""
        # Prompts still being read (chunked prefill), in admission order.
        if self.prefilling:
            for request in [r for r in self.running.values() if r.in_prefill]:
                if request.admit_seq in self.running and budget > 0:
                    chunk = min(request.prefill_target - request.prefilled, budget,
                                self._chunk_cap)
                    if self._state_align:
                        chunk = self._aligned_chunk(request.prefill_target, request.prefilled,
                                                    chunk)
                        if not chunk:
                            continue  # less budget than a block: the next step's
                    if self._prefill(request, chunk, batch):
                        budget -= chunk
        # New admissions, in the line's order with head-of-line blocking. vLLM v1 (per chunk)
        # seats no one in a step that preempted while others run: memory is short, and a
        # newcomer would only be preempted in turn (with nobody left, its empty step would
        # take no time: seat at once). SGLang, its batch once marked full (a newcomer found no
        # seat or room), tries again only when memory is freed or a prompt's chunk is read:
        # its ratio's decay alone seats no one.
        batch_full = (self._reserving is not None and self.head_blocked and not batch.prefill
                      and bool(self.running))
        self.head_blocked = batch_full
        seating = not ((self._per_chunk and batch.preempted and self.running) or batch_full)
        ranked = seating and self._ranked_line and self._seated() < self.config.max_num_seqs
        if ranked:
            self.waiting.rank()  # once a round, as SGLang: a seat taken does not re-rank it
        admitted = self._admit_counter
        # Under SGLang's admission: the slots kept for those decoding (counted at the first
        # try, and again after a preemption), and the max_tokens of those seated since.
        decode_reserve = -1
        reserved_at = 0
        seated_reserve = 0
        while seating and self.waiting:
            seated = self._seated()
            if seated >= self.config.max_num_seqs or budget <= 0:
                if budget > 0 and self._make_room(self.waiting.head(), batch):
                    continue  # a seat freed for a better priority
                # Blocked for as long as pure decode lasts, unless this step's prefills used
                # the budget (the next step has a fresh one), with which a better priority
                # than the worst running one's may take its seat. (Decode tokens take no
                # budget of SGLang's prefill batches.)
                self.head_blocked = (seated >= self.config.max_num_seqs or (
                    not self.prefill_first and self.decode_seqs * self.step_tokens
                    >= self.config.max_num_batched_tokens)) and not (
                    budget <= 0 and self._may_make_room(self.waiting.head()))
                break
            request = self.waiting.head()
            spec = request.spec()
            if not self.config.chunked_prefill and spec.prompt_len > budget and batch.prefill:
                # The whole prompt must fit this step's budget unless it is the only prefill.
                lookup = getattr(self.allocator, "lookup", None)
                ready = max(lookup(spec) if lookup else 0, request.transferred,
                            request.swapped)
                if spec.prompt_len - ready > budget:
                    break  # not blocked for good: a step without other prefills admits it
            if self._state_align and min(budget, self._chunk_cap) < self._state_align:
                ready = self.allocator.lookup(spec)  # type: ignore[attr-defined]
                if not self._aligned_chunk(spec.prompt_len, ready,
                                           min(spec.prompt_len - ready, budget,
                                               self._chunk_cap)):
                    break  # not blocked for good: a step with a block's budget seats it
            # Per chunk (vLLM v1), a prompt computed here claims only its first chunk's memory
            # (a swapped or transferred one arrives whole).
            group = request.swapped > 0 and request.n > 1
            if group and budget < request.n and (batch.prefill or self.decode_seqs):
                break  # its samples read a token each: a step with the budget seats it
            hits = None
            if group:
                hits = self._admit_group(request, spec)
            elif self._samples_fit(request, spec):
                first_chunk = min(budget, self._chunk_cap) if self._per_chunk and not (
                    request.swapped or request.transferred) else None
                if self._reserving is None:
                    hits = self.allocator.admit(spec, first_chunk)
                else:
                    if decode_reserve < 0 or reserved_at != batch.preempted:
                        decode_reserve, reserved_at = self._decode_reserve(), batch.preempted
                    own = self._new_tokens_left(request)
                    hits = self._reserving.admit(
                        spec, first_chunk, reserve_tokens=decode_reserve + seated_reserve + own)
                    if hits is not None:
                        seated_reserve += own
            if hits is None:
                if self._make_room(request, batch):
                    continue  # memory freed for a better priority: try again
                # Blocked until memory is freed.
                self.head_blocked = True
                if self._reserving is not None and self._reserving.refused_for_reserve:
                    self.reserve_holds += 1
                break
            self.waiting.pop()
            if batch.seatings is not None:
                batch.seatings.append((request, True))
            request.num_seqs = 1
            request.prefilled = hits
            request.prefill_target = spec.prompt_len
            request.admit_seq = self._admit_counter
            self._admit_counter += 1
            if self.waiting.seated_may_time_out:
                self._watch_seated(request)
            if request.admitted_s < 0:
                request.admitted_s = now_s
                if request.siblings is not None and request.siblings.admitted_s < 0:
                    request.siblings.admitted_s = now_s
            if request.swapped:
                # Its KV waits in host memory: copy it back rather than compute it (not a
                # lookup: the prefix cache can only spare a copy here).
                self._swap_in(request, hits, batch)
            elif request.transferred:
                # Its prompt was read elsewhere: write what the cache lacks, compute nothing
                # (not a lookup either: the prefix cache saved no computation here, and
                # blocks found in a host tier came over the network anyway).
                self._write_ready(request, request.transferred, hits)
                request.transferred = 0  # after a preemption, recompute here
            else:
                loaded = self.allocator.last_loaded_tokens
                batch.loaded_tokens += loaded
                self.loaded_tokens += loaded
                if request.preemptions:
                    self.preempted_hit_tokens += hits
                    self.preempted_lookup_tokens += spec.prompt_len
                else:
                    request.hit_tokens = hits
                    self.hit_tokens += hits
                    self.lookup_tokens += spec.prompt_len
                    self.first_loaded_tokens += loaded
            if request.resumed:
                request.recomputed_tokens += max(
                    0, min(spec.prompt_len, request.computed_tokens) - request.prefilled)
            self.running[request.admit_seq] = request
            self.prefilling += 1
            remaining = spec.prompt_len - request.prefilled
            chunk = (min(remaining, budget, self._chunk_cap) if self.config.chunked_prefill
                     else remaining)
            if self._state_align:
                chunk = self._aligned_chunk(spec.prompt_len, request.prefilled, chunk)
                assert chunk, "seated with a block's budget (checked above)"
            if not self._prefill(request, chunk, batch):
                break
            budget -= chunk * request.n if group else chunk
        if ranked and (self._admit_counter != admitted or self.waiting.reshuffles()):
            # Those seated changed what the others find cached (or the line is shuffled each
            # round): the next round ranks again (as stepping would), and may put another
            # head first.
            self.head_blocked = False
        if batch.preempted:
            # Preemptions late in the step may have removed requests scheduled earlier, and
            # seated some of them again since, each with a chunk of its own: the last.
            last = {id(p[0]): i for i, p in enumerate(batch.prefill)}
            batch.prefill = [p for i, p in enumerate(batch.prefill)
                             if p[0].num_seqs and last[id(p[0])] == i]

    def _grow_decoders(self, batch: Batch) -> bool:
        """Claim the memory of this step's decode tokens where a request's claim crosses
        into a block it lacks, preempting while memory is short; whether any did."""
        due = self._due(GROW)
        for request in due:
            if request.decoding:  # not preempted meanwhile
                self._grow_now(request, batch)
        return bool(due)

    def _aligned_chunk(self, end: int, start: int, chunk: int) -> int:
        """``chunk`` prefill tokens from ``start`` of ``end``, cut as vLLM's mamba cache mode
        "align" cuts them (``_mamba_block_aligned_split``): to whole blocks while the
        prefill's last block boundary lies beyond the chunk, at that boundary where the
        chunk would pass it, and the tokens after it as they come. Where a block is larger
        than the most a request reads in a step (the step's whole budget, or its
        long_prefill_token_threshold), chunks go on to the next boundary instead, keeping no
        state before it (as newer vLLM does)."""
        bs = self._state_align
        last = end - end % bs
        if start >= last:
            return chunk
        if self._chunk_cap < bs:
            return min(chunk, (start // bs + 1) * bs - start)
        if start + chunk < last:
            return chunk // bs * bs
        return last - start

    def fill_decode(self, batch: Batch) -> None:
        """Decode shape of the step about to run: sequences and context tokens read."""
        if batch.prefill_only:
            batch.draft_tokens = self.drafts  # (the timing of the K in force)
            return
        batch.decode_seqs = self.decode_seqs
        batch.draft_tokens = self.drafts
        batch.context_tokens = (self._tok_sync_sum + self._pending()
                                + self.decode_seqs * self.step_tokens)
        batch.skipped_context = self.skipped_context()

    def _prefill(self, request: Request, chunk: int, batch: Batch) -> bool:
        """Write ``chunk`` prompt tokens; on the last chunk, fork samples and sample the first
        generated token (its KV is written the next step, which reads it, as every later
        token's: vLLM claims a token's slot when it is a step's input). False if the request
        was preempted instead."""
        history = request.prefilled
        completes = history + chunk == request.prefill_target
        if request.num_seqs > 1:
            # A group swapped back in: each sample reads its own last token.
            for seq_id in request.seq_ids():
                appended = self._append(seq_id, chunk)
                assert appended, "admission counted the group's blocks"
            if batch.resumed_groups is None:
                batch.resumed_groups = []
            batch.resumed_groups.append(request)
        else:
            # Admission claimed the prompt's memory, or (per chunk) its first chunk's: a
            # later chunk preempts for its blocks as a decode step does.
            while chunk and not self._append(request.index * MAX_SAMPLES, chunk):
                assert self._per_chunk, "admission claimed the prompt's memory"
                if not self._preempt_victim(request, batch):
                    return False
        request.prefilled += chunk
        if completes:
            self.prefilling -= 1
            if request.n > 1 and request.num_seqs == 1:
                for sample in range(1, request.n):
                    forked = self.allocator.fork(request.index * MAX_SAMPLES,
                                                 request.spec(sample))
                    # Paged samples share; contiguous extents were found at admission, and
                    # nobody is seated between a prompt's admission and its last chunk.
                    assert forked, "admission found every sample's memory"
                    request.num_seqs += 1
            request.gen_sync += 1  # sampled at the end of this step
            request.c_sync = self._clock_now + 1
        batch.prefill.append((request, chunk, history))
        return True

    # ------------------------------------------------------------------ after a step
    def finish_step(self, batch: Batch | None, end_s: float) -> list[Request]:
        """Complete the step that ends at ``end_s``; return the requests that finished."""
        if self._pool is not None:
            self._pool.clock_s = end_s
        prefill_only = batch is not None and batch.prefill_only
        if prefill_only:
            self._decoded = False
        else:
            self._advance(batch.decode_seqs + len(batch.prefill) if batch else self.decode_seqs,
                          end_s, batch is not None and bool(batch.prefill))
        # (After a prefill batch nobody decoded: the token clock stands, and with it the
        # steps counted, which are decode steps, and the wait for the next token, which runs
        # from the last decode step's end.)
        finished = []
        # Clients who gave up by the step's end, before their first token or last: a token
        # given just as the client gives up comes too late, as a seat does.
        if self._seated_deadlines and self._seated_deadlines[0][0] <= end_s:
            self._abort_overdue(end_s)
        if not prefill_only:
            self._deliver_step()
        elif self.decode_requests and end_s - self._last_end_s > self._itl_timeout_s:
            self._abort_stalled(self._last_end_s)  # they waited out the prefill batch
        for request, chunk, history in batch.prefill if batch else ():
            request.computed = True
            if history + chunk > request.computed_tokens:
                request.computed_tokens = history + chunk
            if request.abandoned_s >= 0 or request.in_prefill:
                continue
            # _prefill counted the first generated token in gen_sync already (or, seated
            # again, the first since it was preempted or handed over, a wait with no step).
            if request.first_token_s < 0:
                request.first_token_s = end_s
                if request.siblings is not None and request.siblings.first_token_s < 0:
                    request.siblings.first_token_s = end_s
            if request.gen_sync > request.client_tokens:  # (else a fork group started over)
                self._token_alone(request, end_s)
            if request.gen_sync >= request.output_len:
                self._finish(request, end_s)
                finished.append(request)
                if request.siblings is not None and not request.siblings.decoding:
                    self._watch_siblings(request.siblings, request)  # (its token, alone)
            else:
                self._start_decoding(request, after_prefill_batch=prefill_only)
        finished += self._finish_due(end_s)
        return finished

    def log_usage(self, end_s: float) -> None:
        """Log the pool's usage at the end of a step (``end_s``), if it changed since the last
        log: what vLLM's engine publishes after each step, the step's claims and the memory
        its finishes and aborts freed included (those of the next step's schedule not);
        nothing without a log to keep."""
        if self.usage_log is None:
            return
        usage = self.allocator.kv_cache_usage
        if usage != self._usage_logged:
            self._usage_logged = usage
            self.usage_log.append((end_s, usage))

    def _abort_overdue(self, end_s: float) -> int:
        """Abort every seated request whose client gave up by ``end_s``, the end of a step
        (reading a prompt, decoding, or given no budget): its KV is freed, the blocks it
        computed left to the prefix cache as a preemption leaves them. How many were."""
        deadlines = self._seated_deadlines
        aborted = 0
        while deadlines and deadlines[0][0] <= end_s:
            _, admit_seq, request = heapq.heappop(deadlines)
            if self.running.get(admit_seq) is not request:
                continue  # finished, preempted or aborted since
            deadline = self.waiting.deadline_s(request)  # a first token may have put it off
            if deadline > end_s:
                if deadline < math.inf:
                    heapq.heappush(deadlines, (deadline, admit_seq, request))
                continue
            aborted += self._abort(request, deadline)
        return aborted

    def _deliver_step(self) -> int:
        """The step that just ended gave each request decoding in it a token (but a fork
        group regenerating what its client has, until it catches up): a client who waited
        longer than ``itl_timeout_s`` for it has gone (aborted; how many were), the others
        count it."""
        aborted = 0
        if self.decode_requests:
            wait_s = self._last_end_s - self._prev_end_s
            if wait_s > self._itl_timeout_s:
                aborted = self._abort_stalled(self._prev_end_s)
            else:
                self._delivered(wait_s, self.decode_requests - self.regenerating)
        if self._events[CAUGHT_UP]:
            for request in self._due(CAUGHT_UP):
                self._catch_up(request)
        return aborted

    def _catch_up(self, request: Request) -> None:
        """A request that gets its next token alone (a fork group started over, or one whose
        first token a prefill batch gave) had it in the step that just ended: the client's
        wait for it runs from its last one, and the step's tokens flow from now on."""
        request.regenerating = False
        self.regenerating -= 1
        self._token_alone(request, self._last_end_s)
        request.streak_step = self.steps + 1
        if request.siblings is not None:
            request.siblings.decoding += 1  # its tokens flow with the step's from now on

    def _token_alone(self, request: Request, end_s: float) -> None:
        """Its client received a token at ``end_s`` that no run of decode steps counts (a
        prompt's, or a fork group's first past what its client had): counted by its wait
        since the client's last, if it had one."""
        if request.last_token_s >= 0:
            wait_s = end_s - request.last_token_s
            self._delivered(wait_s, 1)
            if self.step_waits_us is not None:
                _keep_run(request, [wait_us(wait_s)], 0, 1)
            if wait_s > request.max_itl_s:
                request.max_itl_s = wait_s
        request.last_token_s = end_s
        if request.siblings is not None and end_s > request.siblings.last_token_s:
            request.siblings.last_token_s = end_s

    def _delivered(self, wait_s: float, tokens: int) -> None:
        """Count ``tokens`` received ``wait_s`` after the one before each."""
        key = wait_us(wait_s)
        self.token_waits_us[key] = self.token_waits_us.get(key, 0) + tokens

    def _abort_stalled(self, last_token_s: float) -> int:
        """Abort every decoding request: the wait since their last token, which came at
        ``last_token_s`` (the end of the decode step before), outlasted ``itl_timeout_s``, so
        each one's client gave up that long after it. How many were."""
        gave_up_s = last_token_s + self._itl_timeout_s
        # (A fork group regenerating gave its client no token: its own deadline holds.)
        stalled = [request for request in self.running.values()
                   if request.decoding and not request.regenerating]
        # (Their siblings' stream stalled with theirs: the client gives up on them too.)
        return sum(self._abort(request, gave_up_s) for request in stalled
                   if request.abandoned_s < 0)

    def _give_up_siblings(self, siblings: Siblings, gave_up_s: float) -> int:
        """The client of ``siblings`` gave up on them all at ``gave_up_s``: abort those
        seated, take those waiting out of the line. How many were seated."""
        siblings.given_up = True
        seated = 0
        for member in siblings.members:
            if member.abandoned_s >= 0 or member.finished_s >= 0:
                continue
            if self.running.get(member.admit_seq) is member:
                seated += self._abort(member, gave_up_s)
            else:
                self.waiting.take_out(member, gave_up_s)
                self._free_swap(member)
                self.gave_up.append(member)
                self.head_blocked = False
        return seated

    def _abort(self, request: Request, abandoned_s: float) -> int:
        """Abort a seated request whose client gave up at ``abandoned_s``, and, a sample of
        a request fanned out whose samples know one another, every other sample with it
        (its client gave up on the request). How many seated requests that aborted."""
        if request.decoding:
            self._sync(request, include_current=False)  # cache what it computed
            # The last step's token came too late for its client; after a prefill batch,
            # which gave none, the last decode step's had come before.
            self._stop_decoding(request, received_now=not self._decoded)
        elif request.in_prefill:
            self.prefilling -= 1
        self.release(request)
        request.num_seqs = 0
        request.abandoned_s = abandoned_s
        del self.running[request.admit_seq]
        self.gave_up.append(request)
        siblings = request.siblings
        if siblings is not None and siblings.members and not siblings.given_up:
            return 1 + self._give_up_siblings(siblings, abandoned_s)
        return 1

    def _finish_due(self, end_s: float) -> list[Request]:
        """Finish the decoding requests whose last token was this step's."""
        finished = []
        for request in self._due(FINISH):
            self._sync(request, include_current=False)
            self._stop_decoding(request)
            self._finish(request, end_s)
            finished.append(request)
        if self.debug:
            self.allocator.check_invariants()
            if self._windowed is not None:
                self._check_windows(self._windowed)
            for events in self._events:  # every boundary is visited: nothing is left behind
                assert all(key > self._clock_prev for key in events), "an event was missed"
            assert self.swap_used == sum(r.swap_slots for r in self.waiting.requests()) <= (
                self.swap_slots), "swap space held by no parked request"
        return finished

    def _check_windows(self, windowed: HybridPagedAllocator) -> None:
        """Debug: each decoding sequence's sliding-window tables have given back exactly the
        blocks the last step's token cannot see (before its first decode step, the last
        chunk's first token's)."""
        for request in self.running.values():
            if not request.decoding or request.tok_sync == request.prefill_target:
                continue
            token = request.tok_sync + self._clock_prev - request.c_sync
            missed = windowed.release_point(token)
            for seq_id in request.seq_ids():
                for table in windowed.block_tables(seq_id)[windowed.full_groups:]:
                    assert table[:missed] == [None] * missed and None not in table[missed:], (
                        f"request {request.index}: a window gave back the wrong blocks")

    def decode_quietly(self, step_time: Callable[[int, int], float], clock_s: float,
                       stop_at_s: float, memory: MemorySnapshot) -> QuietDecode:
        """Run pure-decode steps (the first one's block crossings already claimed by
        :meth:`fast_step`, after which the pool holds ``memory``, this :meth:`snapshot`)
        until a step ends with a finish, the clock reaches ``stop_at_s``, or the next step's
        crossings would need a preemption.

        Exactly :meth:`finish_step` and :meth:`fast_step` step after step, without the
        per-step calls: context tokens grow by the batch each tick of the token clock
        (syncing only moves tokens from pending to synced), and so do the token slots of the
        memory each step holds, at the expense of reserved ones, until a crossing's claim
        changes it.
        """
        seqs = self.decode_seqs
        slots = seqs * self._groups  # written each tick of the clock
        context = self._tok_sync_sum + self._pending() + seqs * self.step_tokens
        grows, finishes, windows = self._events[GROW], self._events[FINISH], self._events[WINDOW]
        past, base = self._past_window, self._skip_base  # (skipped_context, inlined)
        # A pool that logs KV events stamps them with each step's time (nothing to do else).
        pool = self._pool if self._pool is not None and self._pool.events is not None else None
        run = QuietDecode(slot_seconds=[0.0] * len(memory))
        # Since the last claim (or the run's start), steps take segment_s; a step's memory is
        # ``memory`` with ``slots`` written more for each the clock moved on since, which
        # ramp_s weighs.
        segment_s = ramp_s = 0.0
        clock = segment_clock = self._clock_now
        steps = aborted = 0
        finished: list[Request] = []
        seated_deadlines = self._seated_deadlines  # (deadline, ...) earliest first
        while True:
            step_s = step_time(context, base + past * clock)
            clock_s += step_s
            segment_s += step_s
            ramp_s += (clock - segment_clock) * step_s
            if pool is not None:
                pool.clock_s = clock_s  # this step's finishes, the next one's block crossings
            steps += 1
            # (A new K changes the step's shape and budget: the engine decides anew.)
            changed = self._advance(seqs, clock_s)
            ticked = self._clock_now
            context += seqs * (ticked - clock)
            clock = ticked
            if windows and self._due_now(windows):
                self._windows_due()
                past, base = self._past_window, self._skip_base
            # A client giving up changes the batch: the engine decides anew.
            aborted = self._abort_overdue(clock_s) if (
                seated_deadlines and seated_deadlines[0][0] <= clock_s) else 0
            aborted += self._deliver_step()
            if self.debug or self._due_now(finishes):
                finished = self._finish_due(clock_s)
            if self.usage_log is not None:
                self.log_usage(clock_s)  # (before the next step's claims, as stepping does)
            if finished:
                break
            if clock_s >= stop_at_s or changed or aborted:
                break
            if self._due_now(grows):
                if not self.fast_step():
                    break
                # Claimed: from the next step on, the memory holds what it took.
                run.add(memory, segment_s, slots * ramp_s)
                memory = self.snapshot()
                segment_s = ramp_s = 0.0
                segment_clock = clock
        run.add(memory, segment_s, slots * ramp_s)
        run.steps = steps
        run.clock_s = clock_s
        run.finished = finished
        run.aborted = aborted
        run.last_step_s = step_s
        return run

    def _finish(self, request: Request, end_s: float) -> None:
        request.finished_s = end_s
        request.computed = True
        if not self.keep_finished:
            self.release(request)
        del self.running[request.admit_seq]
        self.head_blocked = False

    def release(self, request: Request) -> None:
        """Free a finished request's KV (at once, or, with ``keep_finished``, when the
        engine says: once a prefill replica has sent it on)."""
        for seq_id in request.seq_ids():
            self.allocator.free(seq_id)
        self.head_blocked = False


def _keep_run(request: Request, step_waits_us: list[int], first: int, stop: int) -> None:
    """Keep the request's tokens that waited ``step_waits_us[first:stop]``."""
    if request.token_runs is None:
        request.token_runs = []
    request.token_runs.append((step_waits_us, first, stop))
