"""SGLang's steps (scheduler.batching: prefill_first): prompts alone whenever there are any
to read, the running requests decoding only in the steps between; and its retraction (the
victim, and where it rejoins the line).

Hand-worked steps of a scheduler against vLLM's mixed steps (who gets a token when, the
waits between tokens, a client giving up while prompts are read, the new-token ratio
decaying on steps that read no prompt only), and the engine:
the shapes of the steps it records, first tokens sooner and longer gaps after, decode
replicas under disaggregation, which read no prompts, and the shipped scenario's figures
that the README quotes.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ROOT

from reports.run_figures import batch_and_queue
from reports.style import close
from sim.api import run
from sim.engine import run_scenario
from sim.memory import PagedAllocator
from sim.scenario import ScenarioError, SchedulerConfig, scenario_from_dict
from sim.scheduler import NewTokenRatio, Request, Scheduler
from workloads.trace import Trace


def step_by_step(batching: str, arrivals: list[float], prompts: list[int], outputs: list[int],
                 **scheduler) -> tuple[Scheduler, list[Request], list[tuple[int, int]]]:
    """Requests arriving at step boundaries, stepped a second a step in a pool of 100
    blocks of 16: the scheduler, the requests, and each step's (decode sequences, prompt
    tokens)."""
    trace = Trace.from_columns(arrival_s=np.array(arrivals), prompt_len=np.array(prompts),
                               output_len=np.array(outputs))
    sched = Scheduler(PagedAllocator(100, 16),
                      SchedulerConfig(batching=batching, **scheduler), debug=True)
    requests = [Request(trace, i, arrivals[i]) for i in range(len(arrivals))]
    shapes = []
    clock = 0.0
    while (sched.running or sched.waiting or clock <= max(arrivals)) and clock < 1000:
        for request in requests:
            if request.arrival_s == clock:
                assert sched.add(request)
        batch = sched.schedule(clock)
        shapes.append((batch.decode_seqs, batch.prefill_tokens))
        clock += 1.0
        sched.finish_step(batch, clock)
    return sched, requests, shapes


def test_a_prompt_to_read_takes_a_step_of_its_own_while_the_running_request_waits():
    # A (16 tokens, 5 to generate) arrives at 0, B (32, 3) at 2. vLLM reads B's prompt in
    # the step A decodes in; SGLang reads it alone, and A's third token waits a step.
    arrivals, prompts, outputs = [0.0, 2.0], [16, 32], [5, 3]
    _, (a, b), mixed = step_by_step("mixed", arrivals, prompts, outputs)
    assert mixed == [(0, 16), (1, 0), (1, 32), (2, 0), (2, 0)]
    assert (a.first_token_s, a.finished_s, b.first_token_s, b.finished_s) == (1, 5, 3, 5)
    assert a.max_itl_s == b.max_itl_s == 1.0
    _, (a, b), first = step_by_step("prefill_first", arrivals, prompts, outputs)
    assert first == [(0, 16), (1, 0), (0, 32), (2, 0), (2, 0), (1, 0)]
    assert (a.first_token_s, a.finished_s, b.first_token_s, b.finished_s) == (1, 6, 3, 5)
    # A waited out B's prompt (2 s between its second and third tokens); B's next token
    # came a step after its first, not two.
    assert a.max_itl_s == 2.0 and b.max_itl_s == 1.0


def test_every_token_is_counted_by_its_own_wait():
    # The ITL distribution of the run above: A's tokens 2..5 waited 1, 2, 1, 1 s, B's 2..3
    # waited 1 and 1 s (a first token is TTFT's).
    sched, _, _ = step_by_step("prefill_first", [0.0, 2.0], [16, 32], [5, 3])
    assert sched.token_waits_us == {1_000_000: 5, 2_000_000: 1}
    sched, _, _ = step_by_step("mixed", [0.0, 2.0], [16, 32], [5, 3])
    assert sched.token_waits_us == {1_000_000: 6}


def test_a_long_prompt_read_in_chunks_stalls_the_decoding_for_every_chunk():
    # B's 64 tokens in chunks of 16 (the budget): four prefill steps in a row, A waiting
    # through them all; vLLM's steps give A one token each and B's chunks the rest.
    arrivals, prompts, outputs = [0.0, 2.0], [16, 64], [6, 2]
    chunks = {"chunked_prefill": True, "max_num_batched_tokens": 16}
    _, (a, _), first = step_by_step("prefill_first", arrivals, prompts, outputs, **chunks)
    assert first[2:6] == [(0, 16)] * 4 and first[6] == (2, 0)
    assert a.max_itl_s == 5.0
    _, (a, _), mixed = step_by_step("mixed", arrivals, prompts, outputs, **chunks)
    assert mixed[2:7] == [(1, 15)] * 4 + [(0, 4)] and a.max_itl_s == 1.0


def test_a_client_gives_up_while_the_prompts_of_others_are_read():
    # A's client waits at most 2.5 s for a next token. A's second token comes at 2 s; B's
    # prompt then takes four prefill steps (2 to 6 s): A's client gives up at 4.5 s, and
    # A is aborted at the end of the step it gave up in, with the two tokens it received.
    trace = Trace.from_columns(arrival_s=np.array([0.0, 2.0]), prompt_len=np.array([16, 64]),
                               output_len=np.array([20, 2]))
    sched = Scheduler(PagedAllocator(100, 16), SchedulerConfig(
        batching="prefill_first", chunked_prefill=True, max_num_batched_tokens=16),
        debug=True, itl_timeout_s=2.5)
    a, b = Request(trace, 0, 0.0), Request(trace, 1, 2.0)
    assert sched.add(a)
    clock = 0.0
    while sched.running or sched.waiting or clock <= 2.0:
        if clock == 2.0:
            assert sched.add(b)
        batch = sched.schedule(clock)
        clock += 1.0
        sched.finish_step(batch, clock)
        if sched.gave_up:
            assert clock == 5.0 and sched.gave_up == [a]
            sched.gave_up = []
    assert a.abandoned_s == 4.5 and a.finished_s < 0 and b.finished_s == 7.0
    # Its tokens after the first, as its client received them: the one at 2 s alone.
    assert [(first, stop) for _, first, stop in a.token_runs] == [(0, 1)]


@pytest.mark.parametrize("batching", ["prefill_first", "mixed"])
def test_the_new_token_ratio_decays_on_steps_that_read_no_prompt_only(batching):
    # SGLang lowers its ratio when it runs a decode batch, not a batch that reads prompts,
    # mixed with decoding or not: B's four (mixed: five) chunks leave it where A's decode
    # steps before them brought it.
    trace = Trace.from_columns(arrival_s=np.array([0.0, 3.0]), prompt_len=np.array([16, 64]),
                               output_len=np.array([20, 2]))
    sched = Scheduler(PagedAllocator(100, 16), SchedulerConfig(
        batching=batching, admission="new_token_ratio", chunked_prefill=True,
        max_num_batched_tokens=16), debug=True)
    a, b = Request(trace, 0, 0.0), Request(trace, 1, 3.0)
    assert sched.add(a)
    start = sched.new_token_ratio
    steps = []
    clock = 0.0
    while sched.running or sched.waiting:
        if clock == 3.0:
            assert sched.add(b)
        ratio = sched.new_token_ratio  # as this step's admissions read it
        batch = sched.schedule(clock)
        steps.append((batch.prefill_tokens > 0, ratio))
        clock += 1.0
        sched.finish_step(batch, clock)
    reads = [reads for reads, _ in steps[:9]]
    if batching == "prefill_first":
        assert reads == [True, False, False, True, True, True, True, False, False]
    else:
        assert reads == [True, False, False, True, True, True, True, True, False]
    decay = NewTokenRatio(1.0).decay  # (the default conservativeness)
    # Read at each step: less a decay for each step before it that read no prompt.
    assert [ratio for _, ratio in steps[:9]] == pytest.approx(
        [start - decay * sum(not r for r in reads[:i]) for i in range(9)])


@pytest.mark.parametrize(("victim", "preempted"), [("last_admitted", [0, 1]),
                                                   ("fewest_generated", [1, 0])])
def test_sglang_retracts_the_fewest_generated_then_the_longest_prompt(victim, preempted):
    # A (a prompt of 48 tokens) and B (16), seated in one step, each to generate 40 tokens
    # in a pool of 8 blocks of 16: at their ends they would need 6 + 4 blocks, so the pool
    # runs dry on the way, when both have generated as many tokens. vLLM preempts the last
    # seated (B); SGLang, among equals, the longest prompt (A).
    trace = Trace.from_columns(arrival_s=np.zeros(2), prompt_len=np.array([48, 16]),
                               output_len=np.array([40, 40]))
    sched = Scheduler(PagedAllocator(8, 16), SchedulerConfig(preemption_victim=victim),
                      debug=True)
    requests = [Request(trace, i, 0.0) for i in range(2)]
    for request in requests:
        assert sched.add(request)
    clock = 0.0
    generated_then = []
    while sched.running or sched.waiting:
        before = [sched.generated(r) for r in requests]
        batch = sched.schedule(clock)
        if batch.preempted:
            generated_then.append(before)
        clock += 1.0
        sched.finish_step(batch, clock)
    assert [r.preemptions for r in requests] == preempted
    assert len(generated_then) == 1 and generated_then[0][0] == generated_then[0][1] > 0


@pytest.mark.parametrize(("kept", "found_again"), [("computed", 32), ("prompt", 16)])
def test_a_retracted_request_leaves_only_its_prompt_cached_under_sglang(kept, found_again):
    # A and B of the test above, vLLM's victim (B: a prompt of one block). Preempted after
    # 33 tokens, B has filled 3 blocks: vLLM leaves them cached (the deepest evicted first,
    # as A takes one to grow), SGLang its prompt's only (what its tree holds), the tokens
    # it generated freed uncached. Seated again once A is done, B finds 2 blocks of its
    # text, or 1, and computes the rest of its 48 tokens' KV again.
    trace = Trace.from_columns(arrival_s=np.zeros(2), prompt_len=np.array([48, 16]),
                               output_len=np.array([40, 40]))
    sched = Scheduler(PagedAllocator(8, 16), SchedulerConfig(preempted_cache=kept),
                      debug=True)
    a, b = (Request(trace, i, 0.0) for i in range(2))
    assert sched.add(a) and sched.add(b)
    clock = 0.0
    while sched.running or sched.waiting:
        batch = sched.schedule(clock)
        if batch.preempted:
            assert sched.generated(b) == 33 and b.preemptions == 1
            pool = sched.allocator.pool
            assert pool.num_cached_free == (2 if kept == "computed" else 1)
        clock += 1.0
        sched.finish_step(batch, clock)
    assert (b.preemptions, a.preemptions) == (1, 0)
    assert sched.preempted_hit_tokens == found_again
    assert b.recomputed_tokens == 16 + 33 - 1 - found_again  # (its last token: no KV yet)


@pytest.mark.parametrize(("rejoin", "first_back"), [("front", "b"), ("back", "c")])
def test_a_retracted_request_rejoins_the_line_at_its_back_under_sglang(rejoin, first_back):
    # A and B of the test above, vLLM's victim (B, the last seated), and C (80 tokens, 5
    # blocks) arriving at the second step, when 2 blocks are free: it waits. B, preempted,
    # rejoins the line at its front (vLLM's) and is seated again before C once A is done,
    # or at its back (SGLang appends the requests it retracts to its queue), behind C.
    trace = Trace.from_columns(arrival_s=np.array([0.0, 0.0, 1.0]),
                               prompt_len=np.array([48, 16, 80]),
                               output_len=np.array([40, 40, 10]))
    sched = Scheduler(PagedAllocator(8, 16), SchedulerConfig(preempted_rejoin=rejoin),
                      debug=True)
    a, b, c = (Request(trace, i, trace.arrival_s[i]) for i in range(3))
    assert sched.add(a) and sched.add(b)
    clock, seated_from_line = 0.0, []
    while sched.running or sched.waiting or clock <= 1.0:
        if clock == 1.0:
            assert sched.add(c)
        waiting = set(map(id, sched.waiting.requests()))
        batch = sched.schedule(clock)
        seated_from_line += [name for name, r in (("b", b), ("c", c))
                         if id(r) in waiting and r.num_seqs and clock >= 1.0]
        clock += 1.0
        sched.finish_step(batch, clock)
    assert b.preemptions == 1 and c.preemptions == 0
    assert seated_from_line[0] == first_back and sorted(seated_from_line) == ["b", "c"]


def test_a_line_by_priority_puts_a_preempted_request_in_its_place_either_way():
    data = scenario("mixed")
    data["systems"][0]["scheduler"].update(preempted_rejoin="back", policy="priority")
    notes = scenario_from_dict(data).setting_notes()
    assert any("preempted_rejoin back changes nothing under policy priority" in note
               for note in notes)


@pytest.mark.parametrize(("change", "expected"), [
    ({"allocator": {"kind": "contiguous"}}, "contiguous memory, which keeps no prefix cache "
     "of blocks"),
    ({"allocator": {"kind": "virtual"}}, "virtual memory, which keeps no prefix cache of "
     "blocks"),
    ({"allocator": {"kind": "paged", "prefix_caching": False}}, "allocator.prefix_caching: "
     "false (nothing is cached to forget)"),
    ({"model": "gemma-3-27b"}, "the hybrid KV cache manager that gemma-3-27b's "
     "sliding-window layers use"),
])
def test_only_a_paged_prefix_cache_forgets_what_a_retracted_request_generated(change,
                                                                            expected):
    data = scenario("mixed")
    system = data["systems"][0]
    system["scheduler"]["preempted_cache"] = "prompt"
    system["allocator"] = change.get("allocator", system["allocator"])
    data["model"] = change.get("model", data["model"])
    with pytest.raises(ScenarioError) as refused:
        scenario_from_dict(data, "s.yaml")
    assert str(refused.value) == ("s.yaml: system 's': scheduler.preempted_cache: prompt "
                                  f"(SGLang's) is not modelled with {expected}")
    system["allocator"] = {"kind": "paged"}
    system["scheduler"]["preemption_mode"] = "swap"
    with pytest.raises(ScenarioError, match="preempted_cache prompt needs preemption_mode: "
                       "recompute"):
        scenario_from_dict(data, "s.yaml")


def scenario(batching: str, **engine) -> dict:
    return {
        "name": "batching",
        "model": "llama-3.1-8b",
        "gpu": "h100-80g",
        "workload": {"kind": "synthetic", "arrival": {"process": "poisson", "rate": 20},
                     "prompt_len": {"dist": "lognormal", "mean": 1500, "p99": 6000,
                                    "max": 8000},
                     "output_len": {"dist": "lognormal", "mean": 200, "p99": 800,
                                    "max": 1000}},
        "systems": [{"name": "s", "allocator": {"kind": "paged", "block_size": 16},
                     "scheduler": {"chunked_prefill": True, "max_num_batched_tokens": 2048,
                                   "batching": batching}}],
        "stop": {"num_requests": 300},
        "seed": 1,
        "engine": engine,
    }


def test_the_engine_runs_prompt_steps_apart_first_tokens_sooner_gaps_longer():
    runs = {batching: run_scenario(scenario_from_dict(scenario(batching))).systems["s"]
            for batching in ("mixed", "prefill_first")}
    steps = runs["prefill_first"].steps
    # No step both decodes and reads a prompt; vLLM's do.
    assert not ((steps["decode_seqs"] > 0) & (steps["prefill_tokens"] > 0)).any()
    mixed = runs["mixed"].steps
    assert ((mixed["decode_seqs"] > 0) & (mixed["prefill_tokens"] > 0)).any()
    first, vllm = runs["prefill_first"].summary, runs["mixed"].summary
    assert first["completed"] == vllm["completed"] == 300
    # Prompts read with the whole budget and no decode tokens beside them: first tokens
    # come sooner; the streams wait out every prompt step: longer gaps.
    assert first["ttft_p50_s"] < vllm["ttft_p50_s"]
    assert first["max_itl_p99_s"] > vllm["max_itl_p99_s"]


def test_the_batch_figure_holds_the_decode_batch_through_prefill_batches():
    # The steps record what each step computed: a prefill batch decodes nothing. The figure
    # shows the batch of the decode steps, each prefill batch holding the one before it.
    data = scenario("prefill_first")
    data["stop"] = {"num_requests": 40}
    result = run_scenario(scenario_from_dict(data))
    steps = result.systems["s"].steps
    prefill_batch = ((steps["decode_seqs"] == 0) & (steps["prefill_tokens"] > 0)).to_numpy()
    raw = steps["decode_seqs"].to_numpy()
    assert prefill_batch.sum() > 10 and (raw > 0).sum() > 10
    fig = batch_and_queue(result)
    shown = fig.axes[0].get_lines()[0].get_ydata()
    assert len(shown) == len(raw) and np.array_equal(shown[~prefill_batch], raw[~prefill_batch])
    for i in np.flatnonzero(prefill_batch):
        assert shown[i] == (shown[i - 1] if i else 0)
    assert shown[prefill_batch].max() > 0  # (streams waited through them)
    close(fig)


def test_decode_replicas_read_no_prompts_so_disaggregation_runs_as_before():
    # Prefill replicas never decode and decode replicas seat what is handed over into their
    # decode steps: SGLang's batching changes nothing there.
    split = {"replicas": 2, "disaggregation": {"prefill_replicas": 1}}
    runs = [run_scenario(scenario_from_dict(scenario(batching, **split))).systems["s"]
            for batching in ("mixed", "prefill_first")]
    assert runs[0].summary == runs[1].summary
    # And the scenario says so.
    notes = scenario_from_dict(scenario("prefill_first", **split)).setting_notes()
    assert any("batching prefill_first changes nothing under disaggregation" in note
               for note in notes)
    assert not any("batching" in note for note in scenario_from_dict(
        scenario("prefill_first")).setting_notes())


def test_the_sglang_batching_scenario_says_what_the_readme_says():
    # The README's figures at the file's 8 requests/s (seed 0): the mixed SGLang, whose
    # reserve never holds the line there, runs exactly as vLLM; SGLang's own steps give
    # first tokens a little sooner and stall the streams for most of a second.
    result = run(ROOT / "scenarios" / "sweeps" / "sglang_batching.yaml")
    summaries = {name: system.summary for name, system in result.systems.items()}
    names = ["vllm", "sglang", "sglang-mixed"]
    assert list(summaries) == names
    figures = {name: (round(s["ttft_p50_s"], 3), round(s["tpot_p50_s"] * 1000, 1),
                      round(s["max_itl_p99_s"], 3), round(s["slo_attainment"], 3))
               for name, s in summaries.items()}
    assert figures == {"vllm": (0.045, 12.9, 0.177, 1.0), "sglang": (0.04, 14.2, 0.827, 0.502),
                       "sglang-mixed": (0.045, 12.9, 0.177, 1.0)}
    assert summaries["sglang"]["reserve_holds"] == summaries["sglang-mixed"]["reserve_holds"] == 0


def test_the_capacities_the_readme_quotes_order_the_systems_as_it_says():
    # Checked at a rate between the capacities rather than searched again: at 10 requests/s
    # under a bound of 500 ms on gaps, vLLM (12.34) and the mixed SGLang (12.47) hold 90 %
    # in time, SGLang's own steps (8.18) do not.
    path = ROOT / "scenarios" / "sweeps" / "sglang_batching.yaml"
    result = run(path, overrides={"workload.arrival.rate": 10, "slo.max_itl_s": 0.5})
    held = {name: system.summary["slo_attainment"] >= 0.9
            for name, system in result.systems.items()}
    assert held == {"vllm": True, "sglang": False, "sglang-mixed": True}
