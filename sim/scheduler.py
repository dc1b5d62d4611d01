"""Iteration-level continuous batching (Orca / vLLM), identical for every allocator.

The scheduler is a maître d' seating diners at every course: before each engine step it
serves one more token to every running request (decode), continues any prompt still being
read (chunked prefill), then seats new requests from the front of the queue while there are
seats (``max_num_seqs``), kitchen capacity (``max_num_batched_tokens``) and memory. When a
running request needs memory that is not there, someone is asked to leave (preemption by
recompute: all its KV is dropped and it goes back to the front of the queue).

No SimPy here: the engine asks for a :class:`Batch`, times it, and reports it done.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sim.memory import ContiguousAllocator, KVAllocator, SeqSpec
from sim.scenario import SchedulerConfig
from workloads.trace import Trace, output_segment_id

MAX_SAMPLES = 256  # sequences per request (n / beam width); seq id = request × 256 + sample


class Request:
    """One request's progress through the system (times are simulation seconds)."""

    __slots__ = (
        "admitted_s",
        "arrival_s",
        "computed",
        "finished_s",
        "first_token_s",
        "generated",
        "hit_tokens",
        "index",
        "max_len",
        "n",
        "num_seqs",
        "output_len",
        "prefill_target",
        "prefilled",
        "preemptions",
        "prompt_len",
        "prompt_segments",
        "recomputed_tokens",
        "rejected",
        "resumed",
    )

    def __init__(self, trace: Trace, index: int, arrival_s: float) -> None:
        self.index = index
        self.arrival_s = arrival_s
        self.prompt_len = int(trace.prompt_len[index])
        self.output_len = int(trace.output_len[index])
        self.max_len = self.prompt_len + int(trace.max_tokens[index])
        self.n = int(trace.n[index])
        self.prompt_segments = tuple(trace.prompt_segments(index))
        self.generated = 0
        self.prefilled = 0  # tokens of the current admission's prompt already in KV
        self.prefill_target = 0  # prompt tokens (+ regenerated output) to prefill this time
        self.num_seqs = 0
        self.admitted_s = -1.0
        self.first_token_s = -1.0
        self.finished_s = -1.0
        self.preemptions = 0
        self.hit_tokens = 0
        self.recomputed_tokens = 0
        self.rejected = False
        self.resumed = False  # re-admitted after a preemption that discarded computed KV
        self.computed = False  # some step has computed KV for it

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.output_len

    def seq_ids(self) -> list[int]:
        base = self.index * MAX_SAMPLES
        return [base + s for s in range(self.num_seqs)]

    def spec(self, sample: int = 0) -> SeqSpec:
        """Sequence ``sample``: the prompt, then its own generated text."""
        segments = (*self.prompt_segments,
                    (output_segment_id(self.index, sample), self.output_len))
        prompt = self.prompt_len + (self.generated if sample == 0 else 0)
        return SeqSpec(self.index * MAX_SAMPLES + sample, segments, prompt, self.final_len,
                       max(self.max_len, self.final_len))

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < self.prefill_target

    @property
    def remaining_tokens(self) -> int:
        return self.output_len - self.generated


@dataclass
class Batch:
    """What one engine step computes."""

    decode: list[Request] = field(default_factory=list)
    prefill: list[tuple[Request, int, int]] = field(default_factory=list)  # (req, new, history)
    decode_seqs: int = 0
    context_tokens: int = 0
    prefill_tokens: int = 0
    prefill_pairs: int = 0
    preempted: int = 0

    @property
    def pure_decode(self) -> bool:
        return not self.prefill and self.decode_seqs > 0


class Scheduler:
    """FCFS continuous batching over one allocator, with preemption by recompute."""

    def __init__(self, allocator: KVAllocator, config: SchedulerConfig, debug: bool = False):
        self.allocator = allocator
        self.config = config
        self.debug = debug
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.rejected: list[Request] = []
        self.num_preemptions = 0
        self.lookup_tokens = 0  # prompt tokens looked up in the prefix cache, all admissions
        self.hit_tokens = 0

    # ------------------------------------------------------------------ queue
    def add(self, request: Request) -> bool:
        """Queue a new arrival; a request that could never fit is rejected (False)."""
        spec = request.spec()
        fits = self.allocator.can_admit_ever(spec)
        if fits and request.n > 1 and isinstance(self.allocator, ContiguousAllocator):
            # Contiguous samples cannot share: all n reservations must fit at once.
            fits = request.n * self.allocator.reservation(spec) <= self.allocator.capacity_slots
        if not fits:
            request.rejected = True
            self.rejected.append(request)
            return False
        self.waiting.append(request)
        return True

    @property
    def head_spec(self) -> SeqSpec | None:
        return self.waiting[0].spec() if self.waiting else None

    # ------------------------------------------------------------------ preemption
    def _victim(self, candidates: list[Request]) -> Request:
        if self.config.preemption_victim == "fewest_generated":
            # Fewest generated tokens; the most recently admitted among equals.
            return min(reversed(candidates), key=lambda r: r.generated)
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        for seq_id in request.seq_ids():
            self.allocator.free(seq_id)
        request.num_seqs = 0
        request.prefilled = 0
        request.preemptions += 1
        request.resumed = request.resumed or request.computed
        if request.n > 1:
            request.generated = 0  # forks cannot be rebuilt from sample 0: restart the request
        self.running.remove(request)
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _grow(self, request: Request, tokens: int, batch: Batch,
              scheduled: list[Request]) -> bool:
        """Append ``tokens`` to every sequence of ``request``, preempting others if memory is
        short; False if ``request`` itself had to be preempted."""
        seq_ids = request.seq_ids()
        while self.allocator.max_uniform_append(seq_ids, tokens) < tokens:
            victim = self._victim(self.running)
            self._preempt(victim)
            batch.preempted += 1
            if victim is request:
                return False
            if victim in scheduled:
                scheduled.remove(victim)
        for seq_id in seq_ids:
            assert self.allocator.append(seq_id, tokens)
        return True

    # ------------------------------------------------------------------ one step
    def schedule(self, now_s: float) -> Batch:
        """Choose this step's work (starting at ``now_s``) and claim its memory."""
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        decode: list[Request] = []
        waiting_prefill: list[Request] = []
        for request in list(self.running):
            if request not in self.running:  # preempted earlier in this loop
                continue
            if request.in_prefill:
                waiting_prefill.append(request)
            elif self._grow(request, 1, batch, decode):
                decode.append(request)
        budget -= sum(r.num_seqs for r in decode)
        # Prompts still being read (chunked prefill), in admission order.
        for request in waiting_prefill:
            if request in self.running and budget > 0:
                chunk = min(request.prefill_target - request.prefilled, budget)
                if self._prefill(request, chunk, batch, decode):
                    budget -= chunk
        # New admissions, FCFS with head-of-line blocking.
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            request = self.waiting[0]
            spec = request.spec()
            if not self.config.chunked_prefill and spec.prompt_len > budget and batch.prefill:
                # The whole prompt must fit this step's budget unless it is the only prefill.
                lookup = getattr(self.allocator, "lookup", None)
                if spec.prompt_len - (lookup(spec) if lookup else 0) > budget:
                    break
            hits = self.allocator.admit(spec)
            if hits is None:
                break
            self.waiting.popleft()
            request.num_seqs = 1
            request.prefilled = hits
            request.prefill_target = spec.prompt_len
            if request.admitted_s < 0:
                request.admitted_s = now_s
            request.hit_tokens += hits
            self.hit_tokens += hits
            self.lookup_tokens += spec.prompt_len
            if request.resumed:
                request.recomputed_tokens += spec.prompt_len - hits
            self.running.append(request)
            remaining = spec.prompt_len - hits
            chunk = min(remaining, budget) if self.config.chunked_prefill else remaining
            if not self._prefill(request, chunk, batch, decode):
                break
            budget -= chunk
        # Preemptions late in the loop may have removed requests scheduled earlier.
        batch.decode = [r for r in decode if r.num_seqs]
        batch.prefill = [p for p in batch.prefill if p[0].num_seqs]
        batch.decode_seqs = sum(r.num_seqs for r in batch.decode)
        batch.prefill_tokens = sum(chunk for _, chunk, _ in batch.prefill)
        batch.prefill_pairs = sum(chunk * (history + chunk) for _, chunk, history in batch.prefill)
        batch.context_tokens = sum(
            self.allocator.num_tokens(s) for r in batch.decode for s in r.seq_ids())
        return batch

    def _prefill(self, request: Request, chunk: int, batch: Batch,
                 decode: list[Request]) -> bool:
        """Write ``chunk`` prompt tokens; on the last chunk, fork samples and write the first
        generated token. False if the request was preempted instead."""
        history = request.prefilled
        completes = history + chunk == request.prefill_target
        if chunk:
            assert self.allocator.append(request.index * MAX_SAMPLES, chunk)
        request.prefilled += chunk
        if completes:
            if request.n > 1 and request.num_seqs == 1:
                for sample in range(1, request.n):
                    if not self.allocator.fork(request.index * MAX_SAMPLES,
                                               request.spec(sample)):
                        # Contiguous memory cannot hold the samples now: retry later.
                        self._preempt(request)
                        batch.preempted += 1
                        return False
                    request.num_seqs += 1
            if not self._grow(request, 1, batch, decode):
                return False
        batch.prefill.append((request, chunk, history))
        return True

    # ------------------------------------------------------------------ after a step
    def max_extra_steps(self, batch: Batch, limit: int) -> int:
        """Decode steps after this one that need no scheduling decision (≤ ``limit``)."""
        if not batch.pure_decode or limit <= 0:
            return 0
        limit = min(limit, min(r.remaining_tokens for r in batch.decode) - 1)
        if limit <= 0:
            return 0
        seq_ids = [s for r in batch.decode for s in r.seq_ids()]
        return self.allocator.max_uniform_append(seq_ids, limit)

    def apply_extra_steps(self, batch: Batch, steps: int) -> None:
        """Claim memory for ``steps`` further decode steps of ``batch`` at once."""
        for request in batch.decode:
            for seq_id in request.seq_ids():
                assert self.allocator.append(seq_id, steps)

    def finish_step(self, batch: Batch, end_s: float, steps: int = 1) -> list[Request]:
        """Credit the tokens of ``steps`` steps ending at ``end_s``; return finished requests."""
        finished = []
        for request, _chunk, _history in batch.prefill:
            request.computed = True
        for request in batch.decode:
            request.generated += steps
        for request, _chunk, _history in batch.prefill:
            if request.in_prefill:
                continue
            request.generated += 1
            if request.first_token_s < 0:
                request.first_token_s = end_s
        for request in (*batch.decode, *(r for r, _, _ in batch.prefill)):
            if request.generated >= request.output_len and request.finished_s < 0:
                request.finished_s = end_s
                for seq_id in request.seq_ids():
                    self.allocator.free(seq_id)
                self.running.remove(request)
                finished.append(request)
        if self.debug:
            self.allocator.check_invariants()
        return finished

