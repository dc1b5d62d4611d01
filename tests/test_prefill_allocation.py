"""Prompt memory claimed whole at admission (vLLM v0) or chunk by chunk (vLLM v1).

Hand-worked cases on small pools, where every block can be counted, then the engine on a
long-prompt load.
"""

from __future__ import annotations

import numpy as np
import pytest

from sim.api import run
from sim.memory import ContiguousAllocator, HybridPagedAllocator, PagedAllocator, SeqSpec
from sim.scenario import ScenarioError, SchedulerConfig, scenario_from_dict
from sim.scheduler import Request, Scheduler
from workloads.trace import Trace


def prompt(seq_id: int, prompt_len: int, output_len: int, shared: int = 0) -> SeqSpec:
    """A sequence whose first ``shared`` prompt tokens are common to all that share them."""
    own = ((1000 + seq_id, prompt_len - shared + output_len),)
    segments = ((7, shared), *own) if shared else own
    return SeqSpec(seq_id, segments, prompt_len, prompt_len + output_len,
                   prompt_len + output_len)


def test_admission_per_chunk_claims_the_hits_and_the_first_chunk():
    alloc = PagedAllocator(30, 16, enable_prefix_caching=True)
    # Whole: the prompt's 200 slots are 13 blocks.
    assert alloc.admit(prompt(0, 200, 10, shared=100)) == 0
    assert alloc.allocated_slots(0) == 13 * 16
    assert alloc.append(0, 200) and alloc.append(0, 10)
    alloc.free(0)
    # Per chunk: the 96 tokens of 6 cached blocks, and 64 more: 10 blocks, 4 of them new.
    free = alloc.num_free_blocks
    assert alloc.admit(prompt(1, 200, 10, shared=100), max_new_tokens=64) == 96
    assert alloc.allocated_slots(1) == 10 * 16
    assert alloc.num_free_blocks == free - 10  # the hits left the free queue too
    # The chunk fills what it claimed; the last one takes its own blocks as it is written.
    assert alloc.append(1, 64) and alloc.allocated_slots(1) == 10 * 16
    assert alloc.append(1, 40) and alloc.allocated_slots(1) == 13 * 16
    alloc.check_invariants()
    # A first chunk that reaches the prompt's end claims the prompt, as whole does: the first
    # generated token's block comes with the step that writes it.
    assert alloc.admit(prompt(2, 48, 5), max_new_tokens=64) == 0
    assert alloc.allocated_slots(2) == 3 * 16


def test_the_hybrid_manager_per_chunk_claims_and_promises_the_first_chunk_only():
    # One full-attention and two sliding groups (window 32), 16-token blocks, 64-token chunks.
    def hybrid() -> HybridPagedAllocator:
        return HybridPagedAllocator(100, 16, full_groups=1, sliding_groups=2, sliding_window=32,
                                    prefill_chunk_tokens=64, enable_prefix_caching=False)

    whole, per_chunk = hybrid(), hybrid()
    assert whole.admit(prompt(0, 300, 10)) == 0
    assert per_chunk.admit(prompt(0, 300, 10), max_new_tokens=64) == 0
    # Whole: the full group's 300 tokens (19 blocks), and a promise of a window and a chunk,
    # cdiv(31 + 64, 16) + 1 = 7 blocks, for each sliding group.
    assert whole.num_free_blocks == 100 - 19 - 2 * 7
    # Per chunk: the full group's 64 tokens (4 blocks), and 4 promised to each sliding group.
    assert per_chunk.num_free_blocks == 100 - 4 - 2 * 4
    assert per_chunk.append(0, 64)
    per_chunk.check_invariants()
    assert per_chunk.num_free_blocks == 100 - 3 * 4  # the promise is kept: nothing more
    # Later chunks take their blocks as they come; the sliding groups first give back what
    # the chunk's first token cannot see (token 64 sees from 33 on: blocks 0 and 1 go).
    assert per_chunk.append(0, 64)
    assert per_chunk.num_free_blocks == 100 - 8 - 2 * (8 - 2)
    per_chunk.check_invariants()


def two_requests(prompt_lens: list[int], output_lens: list[int]) -> Trace:
    count = len(prompt_lens)
    return Trace.from_columns(arrival_s=np.zeros(count), prompt_len=np.array(prompt_lens),
                              output_len=np.array(output_lens))


def seated(trace: Trace, allocation: str, num_blocks: int, prefix_caching: bool = True,
           steps: int = 0) -> tuple[list[Request], Scheduler]:
    """A scheduler over ``num_blocks`` of 16 tokens and 64-token chunks, every request of
    ``trace`` added, and ``steps`` steps run (a step a second)."""
    allocator = PagedAllocator(num_blocks, 16, enable_prefix_caching=prefix_caching,
                               watermark=0.0)
    config = SchedulerConfig(chunked_prefill=True, max_num_batched_tokens=64,
                             prefill_allocation=allocation)
    sched = Scheduler(allocator, config, debug=True)
    requests = [Request(trace, i, 0.0) for i in range(len(trace))]
    for request in requests:
        assert sched.add(request)
    for step in range(steps):
        sched.finish_step(sched.schedule(float(step)), step + 1.0)
    return requests, sched


def serve(trace: Trace, allocation: str, num_blocks: int) -> tuple[list[Request], Scheduler]:
    """Step a scheduler (a step a second) until every request finished."""
    requests, sched = seated(trace, allocation, num_blocks)
    clock = 0.0
    while (sched.running or sched.waiting) and clock < 1000:
        batch = sched.schedule(clock)
        clock += 1.0
        sched.finish_step(batch, clock)
    assert all(r.finished_s > 0 for r in requests)
    return requests, sched


def test_a_long_prompt_starts_at_once_per_chunk_and_waits_for_its_whole_prompt_else():
    # 11 blocks of 16. B: a 17-token prompt, 3 tokens out (2 blocks). A: a 160-token prompt,
    # 2 out. Whole, A needs its prompt's 10 blocks at once: with B's 2, 12 > 11, so A waits
    # until B has finished (3 steps), then reads its prompt in 64, 64, 32.
    trace = two_requests([17, 160], [3, 2])
    (b, a), sched = serve(trace, "whole_prompt", 11)
    assert a.admitted_s == 3.0 and a.first_token_s == 6.0
    assert a.preemptions == b.preemptions == 0
    # Per chunk, A starts beside B: 47 tokens (3 blocks), then 63 (7 blocks); its last 50
    # need 10 with B's 2: A, the last admitted, is preempted before reading them. Seated
    # again when B has finished, it finds its 6 full blocks (96 tokens) and reads the rest
    # in one step: its first token comes two steps before it would have waited for its
    # prompt, and it recomputes the 110 - 96 = 14 tokens it had computed past them.
    (b, a), sched = serve(trace, "per_chunk", 11)
    assert a.admitted_s == 0.0 and a.preemptions == 1 and b.preemptions == 0
    assert a.first_token_s == 4.0
    assert sched.preempted_hit_tokens == 96 and a.recomputed_tokens == 14


def test_a_request_whose_first_token_is_out_is_preempted_for_the_block_it_is_written_in():
    # 11 blocks of 16. B: 14 + 4 tokens; A: 160 + 2, read in chunks of 50, 63 and 47. In
    # step 2 A's last chunk fills the pool (B's block and A's 10), and its first token is
    # sampled: as in vLLM v1, its KV is written by the next step, which reads it. There B's
    # token 16 needs a block, and A, the last admitted, gives up its seat.
    (b, a), sched = seated(two_requests([14, 160], [4, 2]), "per_chunk", 11, steps=3)
    assert a.first_token_s == 3.0 and a.gen_sync == 1 and a.preemptions == 0
    assert sched.allocator.num_free_blocks == 0
    batch = sched.schedule(3.0)
    assert batch.preempted == 1 and a.preemptions == 1 and sched.waiting.head() is a
    assert batch.prefill == [] and batch.decode_seqs == 1 and batch.prefill_tokens == 0
    # What it computed is its prompt; seated again, its prompt is those 160 tokens and its
    # first token, whose KV it computes as its second token's step.
    assert a.computed_tokens == 160 and a.spec().prompt_len == 161
    sched.finish_step(batch, 4.0)
    assert b.finished_s == 4.0
    batch = sched.schedule(4.0)
    # B's new block evicted A's deepest, freed first: A finds 9 of its 10 blocks and
    # computes the rest of its prompt (16 tokens, again) with its first token.
    assert [(r, new, history) for r, new, history in batch.prefill] == [(a, 17, 144)]
    sched.finish_step(batch, 5.0)
    assert a.finished_s == 5.0 and a.first_token_s == 3.0
    assert a.recomputed_tokens == 16 and sched.preempted_hit_tokens == 144


def test_a_first_token_that_is_the_last_needs_no_block():
    # As above, but A's first token is its last: vLLM never writes a last token's KV, so A
    # finishes with the step that read its last chunk, and nobody is preempted.
    (b, a), _ = serve(two_requests([14, 160], [4, 1]), "per_chunk", 11)
    assert a.first_token_s == a.finished_s == 3.0
    assert a.preemptions == b.preemptions == 0 and a.recomputed_tokens == 0


def test_contiguous_samples_are_seated_when_all_their_extents_fit():
    # Contiguous memory of 90 slots, oracle reservations. B (10 + 30: 39 slots) is seated;
    # A (20 + 10, n = 2) needs 29 slots a sample, which cannot share: 58 > 90 - 39, so A
    # waits for B rather than read a prompt it would find no room to sample from.
    trace = Trace.from_columns(arrival_s=np.zeros(2), prompt_len=np.array([10, 20]),
                               output_len=np.array([30, 10]), n=np.array([1, 2]))
    allocator = ContiguousAllocator(90, max_model_len=4096, reserve_policy="oracle")
    sched = Scheduler(allocator, SchedulerConfig(), debug=True)
    b, a = (Request(trace, i, 0.0) for i in range(2))
    assert sched.add(b) and sched.add(a)
    batch = sched.schedule(0.0)
    assert [r for r, _, _ in batch.prefill] == [b] and sched.head_blocked
    assert allocator.can_place([a.spec()]) and not allocator.can_place([a.spec(), a.spec(1)])
    sched.finish_step(batch, 1.0)
    clock = 1.0
    while a.finished_s < 0 and clock < 100:
        batch = sched.schedule(clock)
        clock += 1.0
        sched.finish_step(batch, clock)
    assert b.finished_s == 30.0 and a.admitted_s == 30.0 and a.first_token_s == 31.0
    assert a.finished_s == 40.0 and a.preemptions == 0 and a.recomputed_tokens == 0


def test_a_preempted_partial_prefill_recomputes_only_what_it_had_computed():
    # As above, but B generates 120 tokens: growing to 9 blocks, it evicts 7 of A's 10
    # cached blocks, deepest first. A is seated again once B has finished, with 3 blocks
    # (48 tokens) found: it recomputes the other 160 - 48 = 112 tokens it had computed.
    trace = two_requests([16, 160], [120, 2])
    (_, a), sched = serve(trace, "per_chunk", 12)
    assert a.preemptions == 1 and a.admitted_s == 0.0
    assert sched.preempted_hit_tokens == 48
    assert a.recomputed_tokens == 160 - 48


def test_a_step_that_preempted_seats_no_one_while_others_run():
    # 14 blocks of 16, no prefix cache. B (16 + 60 tokens) decodes; A (200 + 2) is read in
    # chunks of 48, 63, 63: 11 blocks. Its last 26 tokens need 2 more: 15 > 14, so A, the
    # last admitted, is preempted. Its first chunk (4 blocks) would fit at once in the
    # memory it left, but as in vLLM v1, that step seats no one: A is seated the step after.
    (b, a), sched = seated(two_requests([16, 200], [60, 2]), "per_chunk", 14,
                           prefix_caching=False, steps=3)
    allocator = sched.allocator
    assert allocator.allocated_slots(a.seq_ids()[0]) == 11 * 16
    batch = sched.schedule(3.0)
    assert batch.preempted == 1 and a.preemptions == 1
    assert list(sched.running.values()) == [b] and sched.waiting.head() is a
    assert allocator.num_free_blocks >= 4  # room for its first chunk
    sched.finish_step(batch, 4.0)
    batch = sched.schedule(4.0)
    assert [r for r, _, _ in batch.prefill] == [a] and a.prefilled == 63


LONG_PROMPTS = {
    "name": "long_prompts", "model": "llama-2-7b", "memory": {"kv_memory_gib": 3},
    "workload": {"arrival": {"process": "poisson", "rate": 2},
                 "prompt_len": {"dist": "lognormal", "mean": 1500, "p99": 3500, "max": 3800},
                 "output_len": {"dist": "lognormal", "mean": 150, "p99": 280, "max": 290}},
    "systems": [
        {"name": "whole", "allocator": {"kind": "paged"},
         "scheduler": {"chunked_prefill": True, "max_num_batched_tokens": 512}},
        {"name": "per-chunk", "allocator": {"kind": "paged"},
         "scheduler": {"chunked_prefill": True, "max_num_batched_tokens": 512,
                       "prefill_allocation": "per_chunk"}}],
    "stop": {"num_requests": 150}, "seed": 3,
}


def test_per_chunk_seats_more_prefills_and_preempts_more_on_a_long_prompt_load():
    result = run(scenario_from_dict(LONG_PROMPTS))
    whole, per_chunk = (result.systems[n] for n in ("whole", "per-chunk"))
    for system in (whole, per_chunk):
        assert system.requests["finished_s"].notna().all()
    # Seated sooner: the median wait for a seat shrinks.
    wait = {name: (s.requests["admitted_s"] - s.requests["arrival_s"]).median()
            for name, s in (("whole", whole), ("per_chunk", per_chunk))}
    assert wait["per_chunk"] < wait["whole"]
    # And partial prefills are preempted when the pool runs dry.
    assert per_chunk.summary["preemptions"] > whole.summary["preemptions"]


def test_prefill_allocation_is_checked():
    data = dict(LONG_PROMPTS, systems=[{"name": "s", "allocator": {"kind": "paged"},
                                        "scheduler": {"prefill_allocation": "lazy"}}])
    with pytest.raises(ScenarioError, match=r"prefill_allocation.*whole_prompt.*per_chunk"):
        scenario_from_dict(data)
