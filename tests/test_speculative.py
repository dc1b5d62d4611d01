"""Speculative decoding: a token clock of τ tokens a step, drafts and lookahead slots claimed
by each step, the drafts' and the drafter's time, and the drafter's memory."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import kvsim_in_process

from sim.engine import (
    best_draft_schedule,
    build_timing,
    memory_summary,
    run_scenario,
    scenario_pool_slots,
    system_pool_slots,
    with_speculation,
)
from sim.memory import AllocatorError, PagedAllocator, SeqSpec
from sim.presets import GPU_PRESETS, MODEL_PRESETS
from sim.results import schedule_notes
from sim.scenario import ScenarioError, SpeculativeConfig, scenario_from_dict
from sim.timing import Calibration, StepTimeModel


def one_request(prompt: int, output: int, speculative: dict | None, block_size: int = 16,
                mode: str = "step") -> dict:
    system: dict = {"name": "s", "allocator": {"kind": "paged", "block_size": block_size}}
    if speculative:
        system["speculative"] = speculative
    return {
        "name": "one", "model": "llama-2-7b", "memory": {"kv_memory_gib": 2},
        "workload": {"arrival": {"process": "poisson", "rate": 1},
                     "prompt_len": {"dist": "constant", "value": prompt},
                     "output_len": {"dist": "constant", "value": output},
                     "max_tokens": output},
        "systems": [system], "stop": {"num_requests": 1},
        "engine": {"mode": mode, "debug_invariants": mode == "step"},
    }


@pytest.mark.parametrize(("tau", "k"), [(1.0, 3), (2.5, 3), (1.37, 2), (4.0, 3)])
def test_a_request_takes_as_many_steps_as_the_token_clock_needs(tau, k):
    # The replica's clock reads ⌊s·τ⌋ after s steps. Step 0 is the prefill, which samples
    # the first token; the request has kept ⌊s·τ⌋ − ⌊τ⌋ more after step s − 1, and finishes
    # with the first s at which that reaches 99.
    spec = {"method": "ngram", "num_speculative_tokens": k, "mean_acceptance_length": tau}
    run = run_scenario(scenario_from_dict(one_request(200, 100, spec))).systems["s"]
    rate = Fraction(tau).limit_denominator(1000)
    steps = next(s for s in range(1, 200) if math.floor(s * rate) - math.floor(rate) >= 99)
    assert int(run.steps["steps"].sum()) == steps
    assert run.requests["output_len"].iloc[0] == 100


@pytest.mark.parametrize(("method", "claim"), [("ngram", 1 + 3), ("eagle", 1 + 3 + 3)])
def test_each_step_holds_blocks_for_its_drafts_and_lookahead(method, claim):
    # vLLM v1 claims slots for the step's input token and its k drafts, and for an EAGLE
    # drafter k lookahead slots more: a step that read t tokens before it holds
    # ⌈min(t + claim, final) / 16⌉ blocks. The memory rows (one a step) say both.
    spec = {"method": method, "num_speculative_tokens": 3, "mean_acceptance_length": 2.2}
    run = run_scenario(scenario_from_dict(one_request(32, 300, spec))).systems["s"]
    memory = run.memory
    final = 32 + 300 - 1
    decoding = memory[memory["decode_seqs"] == 1]
    assert len(decoding) > 100
    held = decoding["token"] + decoding["reserved"] + decoding["internal"]
    expected = [16 * -(-min(t + claim, final) // 16) for t in decoding["token"]]
    assert held.tolist() == expected


def test_drafts_that_are_never_accepted_cost_time_and_change_nothing_else():
    plain = run_scenario(scenario_from_dict(one_request(200, 100, None))).systems["s"]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "mean_acceptance_length": 1}
    wasted = run_scenario(scenario_from_dict(one_request(200, 100, spec))).systems["s"]
    assert wasted.steps["steps"].sum() == plain.steps["steps"].sum()
    assert wasted.summary["tpot_p50_s"] > plain.summary["tpot_p50_s"]


def test_accepted_drafts_shorten_the_time_per_token():
    results = {}
    for tau in (1.0, 2.0, 3.0):
        spec = {"method": "eagle", "num_speculative_tokens": 3, "mean_acceptance_length": tau}
        run = run_scenario(scenario_from_dict(one_request(200, 400, spec))).systems["s"]
        results[tau] = run.summary["tpot_p50_s"]
    assert results[1.0] > results[2.0] > results[3.0]
    # Memory-bound single-request decode: a step costs about the same, so the time per
    # token falls nearly as 1/τ.
    assert results[1.0] / results[3.0] == pytest.approx(3.0, rel=0.1)


def test_jump_equals_step_with_a_queue_and_preemptions():
    data = {
        "name": "busy", "model": "llama-2-7b", "memory": {"kv_memory_gib": 0.4},
        "workload": {"arrival": {"process": "poisson", "rate": 40},
                     "prompt_len": {"dist": "lognormal", "mean": 120, "sigma": 1, "max": 600},
                     "output_len": {"dist": "uniform", "low": 1, "high": 300},
                     "prefix_groups": {"groups": 2, "length": 40, "fraction": 0.6}},
        "systems": [{"name": "eagle", "allocator": {"kind": "paged", "block_size": 16},
                     "speculative": {"method": "eagle", "num_speculative_tokens": 4,
                                     "acceptance_rate": 0.7}},
                    {"name": "predicted", "allocator": {"kind": "contiguous",
                                                        "reserve_policy": "predicted"},
                     "speculative": {"method": "mtp", "num_speculative_tokens": 2,
                                     "mean_acceptance_length": 2.6}}],
        "stop": {"num_requests": 150}, "seed": 3,
    }
    runs = {}
    for mode in ("jump", "step"):
        data["engine"] = {"mode": mode, "debug_invariants": mode == "step"}
        runs[mode] = run_scenario(scenario_from_dict(data)).systems
    for name in ("eagle", "predicted"):
        jump, step = runs["jump"][name], runs["step"][name]
        assert jump.requests.equals(step.requests)
        assert len(jump.steps) < len(step.steps)
    assert runs["step"]["eagle"].summary["preemptions"] > 0
    assert runs["step"]["predicted"].summary["preemptions"] > 0  # outgrown reservations


def test_acceptance_rate_gives_the_geometric_mean_acceptance_length():
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=3, acceptance_rate=0.6)
    assert float(spec.tokens_per_step) == pytest.approx((1 - 0.6 ** 4) / 0.4, abs=1e-3)
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                             acceptance_rate=1.0).tokens_per_step == 4
    assert spec.lookahead_slots == 3 and spec.drafter_layers == 1
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=5,
                              mean_acceptance_length=2.4)
    assert ngram.tokens_per_step == Fraction(12, 5)
    assert ngram.lookahead_slots == 0 and ngram.drafter_layers == 0


@pytest.mark.parametrize(("speculative", "expected"), [
    ({"method": "eagle", "num_speculative_tokens": 2, "mean_acceptance_length": 3.5},
     "mean_acceptance_length 3.5: a step keeps at most num_speculative_tokens + 1 = 3"),
    ({"method": "eagle", "num_speculative_tokens": 2},
     "give exactly one of mean_acceptance_length"),
    ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_rate": 0.5,
      "draft_layers": 1}, "draft_layers: n-gram drafting uses no model"),
    ({"method": "medusa", "num_speculative_tokens": 2, "acceptance_rate": 0.5},
     "speculative.method"),
    ({"method": "mtp", "num_speculative_tokens": 2, "acceptance_rate": 0.5,
      "draft_params": 1e8}, "draft_params: for an EAGLE head (method eagle or eagle3); mtp "
     "drafts with draft_layers of the target's own kind"),
    ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_rate": 0.5,
      "draft_params": 1e8}, "draft_params: for an EAGLE head (method eagle or eagle3); ngram "
     "drafts with no model"),
    ({"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 2,
      "acceptance_rate": 0.5, "draft_params": 1e8},
     "draft_params: for an EAGLE head (method eagle or eagle3); draft_model takes the draft "
     "model's shape"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "acceptance_rate": 0.5,
      "draft_params": 1e8, "draft_layers": 0}, "draft_params: a head of no layers"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "acceptance_rate": 0.5,
      "draft_params": 0}, "draft_params: Input should be greater than 0"),
])
def test_bad_settings_are_refused(speculative, expected):
    with pytest.raises(ScenarioError, match=re.escape(expected)):
        scenario_from_dict(one_request(10, 10, speculative))


def test_a_drafter_takes_its_layers_weights_and_kv_out_of_the_pool():
    data = one_request(10, 10, {"method": "eagle", "num_speculative_tokens": 2,
                                "acceptance_rate": 0.5})
    del data["memory"]  # 90 % of the GPU less the weights
    data["systems"].append({"name": "ngram", "allocator": {"kind": "paged"},
                            "speculative": {"method": "ngram", "num_speculative_tokens": 2,
                                            "acceptance_rate": 0.5}})
    scenario = scenario_from_dict(data)
    model = MODEL_PRESETS["llama-2-7b"]
    slots = scenario_pool_slots(scenario)
    eagle, ngram = scenario.systems
    # One more layer of KV a token (33 of 32), and one layer's weights less pool.
    pool_bytes = slots * model.kv_bytes_per_token - model.weight_bytes / 32
    assert system_pool_slots(scenario, eagle) == int(pool_bytes // (model.kv_bytes_per_token
                                                                     * 33 / 32))
    assert system_pool_slots(scenario, ngram) == slots
    line = memory_summary(scenario)
    assert (f"system 's': its eagle drafter's 1 layer (weights and KV) leave "
            f"{system_pool_slots(scenario, eagle):,} tokens") in line
    assert "'ngram'" not in line


def test_the_step_time_counts_drafts_as_tokens_and_the_drafters_passes():
    base = StepTimeModel(a=5e-3, b=1e-5, c=2e-7, d=1e-5, e=1e-9)
    head = base.share(1 / 32, "one layer")
    spec = replace(base, speculative_tokens=3, drafter=head)
    decode, context, rho = 8, 4000, 1.125
    drafter = (5e-3 + 1e-5 * decode + rho * 2e-7 * context) / 32
    assert spec.step_time(decode, context, 0, 0, rho) == pytest.approx(
        base.step_time(decode, context, 0, 0, rho) + 3 * (1e-5 * decode + drafter))
    # The drafter reads a prefill once too, a 32nd of the target's work, weights included
    # where no decode pass of its own read them.
    assert spec.step_time(0, 0, 100, 100 * 100, rho) == pytest.approx(
        base.step_time(0, 0, 100, 100 * 100, rho) * (1 + 1 / 32))
    assert spec.step_time(decode, context, 100, 100 * 100, rho) == pytest.approx(
        spec.step_time(decode, context, 0, 0, rho) + (1e-5 * 100 + 1e-9 * 100 * 100)
        * (1 + 1 / 32))
    # No drafts this step (K by batch size): the drafter still makes one pass, keeping its
    # KV in step (vLLM), and reads new prompts; n-gram lookup then costs nothing.
    idle = replace(spec, speculative_tokens=0)
    assert idle.step_time(decode, context, 0, 0, rho) == pytest.approx(
        base.step_time(decode, context, 0, 0, rho) + drafter)
    assert idle.step_time(0, 0, 100, 100 * 100, rho) == spec.step_time(0, 0, 100, 100 * 100,
                                                                        rho)
    assert replace(base, speculative_tokens=0).step_time(decode, context, 0, 0, rho) == (
        base.step_time(decode, context, 0, 0, rho))
    # n-gram lookup: the drafts' GEMM tokens only.
    ngram = replace(base, speculative_tokens=3)
    assert ngram.step_time(decode, context, 0, 0, rho) == pytest.approx(
        base.step_time(decode, context, 0, 0, rho) + 3 * 1e-5 * decode)
    # A pure-decode run advanced at once costs the same floats as steps one at a time.
    for skipped in (0, 700):
        for model in (spec, ngram, idle, replace(spec, sliding_share=0.5)):
            assert model.decode_step_time(decode, rho)(context, skipped) == model.step_time(
                decode, context, 0, 0, rho, skipped)


def draft_model_scenario(draft: str | dict = "llama-3.2-1b", **memory) -> dict:
    data = one_request(10, 10, {"method": "draft_model", "draft_model": draft,
                                "num_speculative_tokens": 4, "acceptance_rate": 0.7})
    data["model"], data["gpu"], data["memory"] = "llama-3.1-8b", "h100-80g", memory
    return data


def test_a_draft_model_takes_its_weights_and_kv_and_runs_its_own_roofline():
    scenario = scenario_from_dict(draft_model_scenario())
    target, draft = MODEL_PRESETS["llama-3.1-8b"], MODEL_PRESETS["llama-3.2-1b"]
    slots = scenario_pool_slots(scenario)
    system = scenario.systems[0]
    pool_bytes = slots * target.kv_bytes_per_token - draft.weight_bytes
    assert system_pool_slots(scenario, system) == int(
        pool_bytes // (target.kv_bytes_per_token + draft.kv_bytes_per_token))
    assert (f"its draft model llama-3.2-1b (weights and KV) leave "
            f"{system_pool_slots(scenario, system):,} tokens") in memory_summary(scenario)
    # An explicit pool holds the weights elsewhere: only the KV shares it.
    sized = scenario_from_dict(draft_model_scenario(kv_memory_gib=4))
    assert system_pool_slots(sized, sized.systems[0]) == int(
        scenario_pool_slots(sized) * target.kv_bytes_per_token
        // (target.kv_bytes_per_token + draft.kv_bytes_per_token))
    timing = with_speculation(build_timing(scenario, Path()), scenario, system)
    assert timing.drafter is not None
    assert timing.drafter.a == pytest.approx(draft.weight_bytes / GPU_PRESETS["h100-80g"]
                                             .hbm_bandwidth_bytes_per_s)
    assert timing.speculative_tokens == 4
    run = run_scenario(scenario).systems["s"]
    assert run.requests["finished_s"].notna().all()


@pytest.mark.parametrize(("change", "expected"), [
    ({"draft_model": "llama-9b"}, "draft_model: unknown preset 'llama-9b'"),
    ({"draft_model": None}, "draft_model: give it with method draft_model"),
    ({"method": "eagle"}, "draft_model: give it with method draft_model"),
    ({"draft_layers": 2}, "draft_layers: a draft model has its own layers"),
    ({"draft_model": "gemma-2-9b"}, "sliding-window layers is not modelled"),
    ({"method": "eagle", "draft_model": None, "draft_calibration": "cal.yaml"},
     "draft_calibration: the times of a draft model"),
])
def test_bad_draft_models_are_refused(change, expected):
    data = draft_model_scenario()
    data["systems"][0]["speculative"].update(change)
    with pytest.raises(ScenarioError, match=expected):
        scenario_from_dict(data)


def test_a_draft_model_must_split_over_the_targets_gpus():
    data = draft_model_scenario({"name": "tiny-draft", "num_layers": 4, "num_heads": 6,
                                 "num_kv_heads": 2, "head_dim": 64, "num_params": 1e8,
                                 "max_model_len": 131072})
    data["parallel"] = {"tensor_parallel_size": 4}
    with pytest.raises(ScenarioError, match=re.escape(
            "system 's': speculative.draft_model on tensor_parallel_size 4: tiny-draft's 6 "
            "attention heads do not divide over 4 GPUs")):
        scenario_from_dict(data)
    data["parallel"] = {"tensor_parallel_size": 2}  # 6 heads and 2 KV heads split in two
    scenario = scenario_from_dict(data)
    assert system_pool_slots(scenario, scenario.systems[0]) < scenario_pool_slots(scenario)


def test_a_paged_sequence_holding_lookahead_slots_cannot_fork():
    allocator = PagedAllocator(10, 4)
    spec = SeqSpec(0, ((1, 20),), 6, 20, 20)
    assert allocator.admit(spec) == 0
    assert allocator.append(0, 6)
    assert allocator.append(0, 1, lookahead=5)  # 7 tokens, slots to 12: 3 blocks
    assert allocator.allocated_slots(0) == 12
    with pytest.raises(AllocatorError, match="holds lookahead slots"):
        allocator.fork(0, SeqSpec(1, ((1, 7), (2, 5)), 6, 12, 12))
    allocator.check_invariants()


# ---------------------------------------------------------------- K by batch size (vLLM's
# num_speculative_tokens_per_batch_size)
def test_the_batch_size_schedule_reads_as_vllms():
    # vLLM's own example: a gap keeps the K before it, past the last range the last K.
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=3, acceptance_rate=0.7,
                             num_speculative_tokens_per_batch_size=[
                                 [1, 16, 3], [32, 128, 2], [256, 2048, 0]])
    drafts = {size: spec.drafts_after(size) for size in
              (0, 1, 16, 17, 31, 32, 128, 129, 255, 256, 2048, 5000)}
    assert drafts == {0: 3, 1: 3, 16: 3, 17: 3, 31: 3, 32: 2, 128: 2, 129: 2, 255: 2, 256: 0,
                      2048: 0, 5000: 0}
    assert spec.draft_counts == [0, 2, 3]
    assert spec.tokens_per_step_with(0) == 1
    assert float(spec.tokens_per_step_with(2)) == pytest.approx(1 + 0.7 + 0.49, abs=1e-3)
    assert spec.tokens_per_step_with(3) == spec.tokens_per_step
    fixed = SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                              mean_acceptance_length=2.0)
    assert fixed.draft_counts == [4] and fixed.drafts_after(1000) == 4


@pytest.mark.parametrize(("schedule", "expected"), [
    ([], "num_speculative_tokens_per_batch_size: expected .*got an empty list"),
    ([[2, 8, 3]], "the first range starts at 2; expected 1"),
    ([[1, 8, 3], [8, 16, 0]], r"\[8, 16, 0\] starts at or before the end of the range "
                              r"before it \(8\)"),
    ([[1, 8, 3], [20, 16, 0]], r"\[20, 16, 0\] ends before it starts"),
    ([[1, 8, 5]], r"\[1, 8, 5\] drafts more than num_speculative_tokens = 3"),
    ([[1, 8, 2]], "mean_acceptance_length is for 3 drafts; for K = 2 give acceptance_rate"),
    ([[1, 8, -1]], r"num_speculative_tokens_per_batch_size\[0\]\[2\]: Input should be "
                   "greater than or equal to 0"),
    ([[1, 8, 1, 100, 3]], r"entry \[1, 8, 1, 100, 3\]: expected \[bs_lo, bs_hi, K\] \(vLLM's "
                          r"context-length form, five items, is not modelled\)"),
    ("sometimes", "num_speculative_tokens_per_batch_size: expected auto or "
                  r"\[\[bs_lo, bs_hi, K\], \.\.\.\] \(got 'sometimes'\)"),
])
def test_bad_batch_size_schedules_are_refused(schedule, expected):
    spec = {"method": "eagle", "num_speculative_tokens": 3, "mean_acceptance_length": 2.5,
            "num_speculative_tokens_per_batch_size": schedule}
    with pytest.raises(ScenarioError, match=expected):
        scenario_from_dict(one_request(10, 10, spec))


def test_one_k_for_every_batch_size_is_plain_speculation():
    spec = {"method": "eagle", "num_speculative_tokens": 3, "acceptance_rate": 0.6}
    fixed = run_scenario(scenario_from_dict(one_request(200, 300, spec))).systems["s"]
    spec["num_speculative_tokens_per_batch_size"] = [[1, 4, 3]]
    scheduled = run_scenario(scenario_from_dict(one_request(200, 300, spec))).systems["s"]
    assert scheduled.requests.equals(fixed.requests)
    assert scheduled.steps.equals(fixed.steps)
    assert set(scheduled.steps["draft_tokens"]) == {3}
    assert scheduled.summary["mean_draft_tokens"] == 3


def test_k_zero_decodes_a_token_a_step_at_the_plain_step_time():
    # n-gram drafting has no drafter: with K 0 at every batch size a step is a plain one, in
    # time and tokens (only the memory differs: the claim stays that of k drafts).
    plain = run_scenario(scenario_from_dict(one_request(200, 300, None))).systems["s"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "mean_acceptance_length": 3.0,
            "num_speculative_tokens_per_batch_size": [[1, 1, 0]]}
    off = run_scenario(scenario_from_dict(one_request(200, 300, spec))).systems["s"]
    assert off.requests.equals(plain.requests)
    assert set(off.steps["draft_tokens"]) == {0}
    assert off.summary["mean_draft_tokens"] == 0 and plain.summary["mean_draft_tokens"] is None


def busy_scenario(schedule: list | None, mode: str = "step") -> dict:
    return {
        "name": "busy", "model": "llama-2-7b", "memory": {"kv_memory_gib": 0.5},
        "workload": {"arrival": {"process": "poisson", "rate": 30},
                     "prompt_len": {"dist": "lognormal", "mean": 120, "sigma": 1, "max": 600},
                     "output_len": {"dist": "uniform", "low": 1, "high": 300}},
        "systems": [{"name": "s", "allocator": {"kind": "paged", "block_size": 16},
                     "speculative": {"method": "eagle", "num_speculative_tokens": 4,
                                     "acceptance_rate": 0.7,
                                     "num_speculative_tokens_per_batch_size": schedule}}],
        "stop": {"num_requests": 200}, "seed": 5,
        "engine": {"mode": mode, "debug_invariants": mode == "step"},
    }


def test_each_step_verifies_the_k_of_the_batch_before_it():
    # vLLM proposes a step's drafts by the number of requests that step scheduled, and the
    # next step verifies them: row by row (one step each), K follows the row before.
    schedule = [[1, 3, 4], [4, 7, 2], [10, 10_000, 0]]
    run = run_scenario(scenario_from_dict(busy_scenario(schedule))).systems["s"]
    steps = run.steps
    assert (steps["steps"] == 1).all()
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=4, acceptance_rate=0.7,
                             num_speculative_tokens_per_batch_size=schedule)
    size = steps["decode_seqs"] + steps["prefill_requests"]
    expected = [spec.drafts_after(s) for s in size.shift(1, fill_value=0)]
    assert steps["draft_tokens"].tolist() == expected
    assert set(expected) == {0, 2, 4}  # the load moves through every range
    decode_steps = steps["decode_seqs"] > 0
    assert run.summary["mean_draft_tokens"] == pytest.approx(
        steps["draft_tokens"][decode_steps].mean())
    # A step's context counts each decoding sequence's K drafts too.
    decoding = steps[steps["decode_seqs"] > 0]
    assert ((decoding["context_tokens"] - decoding["decode_seqs"] * (1 + decoding[
        "draft_tokens"])) > 0).all()


def test_jump_equals_step_with_k_by_batch_size():
    schedule = [[1, 3, 4], [4, 7, 2], [10, 10_000, 0]]
    step = run_scenario(scenario_from_dict(busy_scenario(schedule))).systems["s"]
    jump = run_scenario(scenario_from_dict(busy_scenario(schedule, "jump"))).systems["s"]
    assert jump.requests.equals(step.requests)
    assert len(jump.steps) < len(step.steps)
    assert step.summary["preemptions"] > 0


def test_speculation_off_at_high_load_decodes_as_plain_there_and_speculates_at_low_load():
    # Turned off above 8 requests: a lone request speculates as with K fixed, a batch of
    # ~45 decodes as plain decoding does, but for the EAGLE head's one pass a step (a 32nd
    # of the target's layers) and its memory.
    def tpot(schedule: list | None, rate: float, speculative: bool = True) -> float:
        data = busy_scenario(schedule, "jump")
        if not speculative:
            del data["systems"][0]["speculative"]
        data["memory"], data["gpu"] = {"kv_memory_gib": 8}, "a100-80g"
        data["workload"]["arrival"]["rate"] = rate
        return run_scenario(scenario_from_dict(data)).systems["s"].summary["tpot_p50_s"]

    dynamic = [[1, 8, 4], [9, 10_000, 0]]
    assert tpot(dynamic, 0.5) == pytest.approx(tpot(None, 0.5), rel=0.02)
    assert tpot(dynamic, 0.5) < 0.5 * tpot(None, 0.5, speculative=False)
    assert tpot(dynamic, 60) == pytest.approx(tpot(None, 60, speculative=False), rel=0.05)
    assert tpot(dynamic, 60) > 1.2 * tpot(None, 60)


def test_an_auto_schedule_takes_the_k_that_keeps_the_most_tokens_a_second():
    # T(B, K) = a + b·B + c·B·(context + 1 + K) + d·B·K, τ(K) = 1 + α + … + α^K: drafts are
    # nearly free to a lone request (weights dominate) and dear to a big batch (the verify
    # GEMMs), so K falls as the batch grows. The answer, worked out here from the formula.
    timing = StepTimeModel(a=6e-3, b=2e-5, c=4e-8, d=6e-5, e=0.0)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, acceptance_rate=0.6,
                             num_speculative_tokens_per_batch_size="auto")
    timings = {k: replace(timing, speculative_tokens=k) for k in spec.draft_counts}
    schedule = best_draft_schedule(timings, spec, context_tokens=1000.0, rho=1.0,
                                   max_batch=512)

    def best(size: int) -> int:
        def rate(k: int) -> float:
            tau = sum(0.6 ** i for i in range(k + 1))
            step_s = (6e-3 + 2e-5 * size + 4e-8 * round(size * (1001 + k))
                      + 6e-5 * size * k)
            return tau / step_s
        return max(range(5), key=lambda k: (rate(k), -k))

    chosen = [next(k for lo, hi, k in schedule if lo <= size <= hi) for size in range(1, 513)]
    assert chosen == [best(size) for size in range(1, 513)]
    assert chosen[0] == 4 and chosen[-1] == 0 and len(schedule) >= 3
    assert [lo for lo, _, _ in schedule] == [1] + [hi + 1 for _, hi, _ in schedule[:-1]]
    assert schedule[-1][1] == 512
    # From a mean acceptance length (τ of k drafts only), the choice is k or none.
    fixed = spec.model_copy(update={"acceptance_rate": None, "mean_acceptance_length": 2.0})
    assert fixed.draft_counts == [0, 4]


def test_an_auto_run_follows_the_schedule_it_chose_and_says_it():
    data = busy_scenario("auto")
    data["systems"][0]["speculative"]["method"] = "draft_model"
    data["systems"][0]["speculative"]["draft_model"] = "llama-3.2-1b"
    data["memory"], data["gpu"] = {"kv_memory_gib": 4}, "h100-80g"
    data["workload"]["arrival"]["rate"] = 200
    run = run_scenario(scenario_from_dict(data)).systems["s"]
    schedule = json.loads(run.summary["draft_schedule"])
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=4, acceptance_rate=0.7,
                             num_speculative_tokens_per_batch_size=schedule)
    steps = run.steps
    size = steps["decode_seqs"] + steps["prefill_requests"]
    assert steps["draft_tokens"].tolist() == [spec.drafts_after(s)
                                              for s in size.shift(1, fill_value=0)]
    assert len(set(steps["draft_tokens"])) > 1  # the load reaches more than one range
    note = schedule_notes({"s": run.summary})
    assert note == [f"system 's' chose num_speculative_tokens_per_batch_size: {schedule} "
                    "([bs_lo, bs_hi, K]: K drafts after a step of bs_lo to bs_hi requests)"]
    assert schedule_notes({"s": {"draft_schedule": None}}) == []


def test_decode_batches_past_the_token_budget_are_noted():
    # vLLM would leave running requests out of such a step; the simulator decodes them all,
    # and says so.
    data = one_request(10, 10, {"method": "eagle", "num_speculative_tokens": 8,
                                "acceptance_rate": 0.5})
    data["systems"][0]["scheduler"] = {"max_num_batched_tokens": 2048}
    assert scenario_from_dict(data).setting_notes() == [
        "system 's': 256 decoding requests × 9 tokens make 2,304 tokens, more than "
        "max_num_batched_tokens 2,048; where a batch grows so large, every running request "
        "still decodes every step here (and the step admits no prompt), where vLLM would "
        "leave some out of the step"]
    data["systems"][0]["scheduler"]["max_num_seqs"] = 200
    assert scenario_from_dict(data).setting_notes() == []
    plain = one_request(10, 10, None)
    plain["systems"][0]["scheduler"] = {"max_num_batched_tokens": 128}
    (note,) = scenario_from_dict(plain).budget_overruns()
    assert note.startswith("system 's': 256 decoding requests make 256 tokens, more than "
                           "max_num_batched_tokens 128;")


def test_run_and_capacity_print_the_schedule_auto_chose(tmp_path):
    data = busy_scenario("auto", "jump")
    data["memory"], data["gpu"] = {"kv_memory_gib": 4}, "h100-80g"
    data["stop"] = {"num_requests": 60}
    data["slo"] = {"ttft_s": 2.0, "tpot_s": 0.05}
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(data))
    ran = kvsim_in_process("run", str(path), "--out", str(tmp_path / "run"), "--quiet",
                           "--no-report")
    assert ran.returncode == 0, ran.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["systems"]["s"]
    note = (f"note: system 's' chose num_speculative_tokens_per_batch_size: "
            f"{summary['draft_schedule']} ([bs_lo, bs_hi, K]")
    assert note in ran.stdout
    capacity = kvsim_in_process("capacity", str(path), "--rel-tol", "0.2", "--quiet",
                                "--out", str(tmp_path / "cap"))
    assert capacity.returncode == 0, capacity.stderr
    assert "note (at capacity): system 's' chose num_speculative_tokens_per_batch_size: [[1, " \
        in capacity.stdout


def test_the_token_clock_sums_each_steps_tau_of_its_k(tmp_path):
    # A decodes alone (K 3, τ 2.176), then B's arrival makes the batch two (K 1, τ 1.6):
    # after s steps the replica's clock reads ⌊Σ τ(K_i)⌋ over the steps before, exactly,
    # and a request seated at step p has 1 + clock(s + 1) − clock(p + 1) tokens after step
    # s. Each finishes at the end of the first step that gives it its output.
    rows = [(0.0, 32, 201), (0.1, 32, 41)]
    pd.DataFrame(rows, columns=["t", "prompt", "output"]).to_csv(tmp_path / "t.csv",
                                                                   index=False)
    schedule = [[1, 1, 3], [2, 8, 1]]
    data = one_request(32, 201, {"method": "eagle", "num_speculative_tokens": 3,
                                 "acceptance_rate": 0.6,
                                 "num_speculative_tokens_per_batch_size": schedule})
    data["workload"] = {"kind": "trace", "path": str(tmp_path / "t.csv"), "format": "csv",
                        "columns": {"arrival": "t", "prompt_len": "prompt",
                                    "output_len": "output"}}
    data["stop"] = {"num_requests": 2}
    run = run_scenario(scenario_from_dict(data)).systems["s"]
    steps = run.steps.reset_index(drop=True)
    assert (steps["steps"] == 1).all()
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=3, acceptance_rate=0.6,
                             num_speculative_tokens_per_batch_size=schedule)
    assert spec.tokens_per_step_with(3) == Fraction(272, 125)
    total, clock = Fraction(0), [0]
    for drafts in steps["draft_tokens"]:
        total += spec.tokens_per_step_with(drafts)
        clock.append(math.floor(total))
    prefills = steps.index[steps["prefill_requests"] > 0].tolist()
    assert len(prefills) == 2 and set(steps["draft_tokens"]) == {1, 3}
    ends = (steps["time_s"] + steps["duration_s"]).tolist()
    requests = run.requests.sort_values("request")
    written = [0] * len(steps)  # KV tokens each step starts from (its prompts included)
    for seated, output, finished_s in zip(prefills, requests["output_len"],
                                          requests["finished_s"], strict=True):
        last = next(s for s in range(seated, len(steps))
                    if 1 + clock[s + 1] - clock[seated + 1] >= output)
        assert finished_s == pytest.approx(ends[last], abs=1e-12)
        for s in range(seated, last + 1):
            written[s] += 32 + (clock[s] - clock[seated + 1] if s > seated else 0)
    # Step by step, the memory the steps start from holds exactly those tokens.
    assert run.memory["token"].tolist() == written


def test_a_draft_models_calibration_times_its_passes(tmp_path):
    # Measured coefficients of the draft model (kvsim calibrate --model llama-3.2-1b) in
    # place of its roofline, found beside the scenario as timing.calibration is.
    coefficients = {"a": 2e-3, "b": 3e-6, "c": 5e-9, "d": 4e-6, "e": 1e-10}
    Calibration(model="llama-3.2-1b", device="test", coefficients=coefficients, rho={},
                fit={}).dump(tmp_path / "draft.yaml")
    data = draft_model_scenario()
    data["systems"][0]["speculative"]["draft_calibration"] = "draft.yaml"
    scenario = scenario_from_dict(data)
    system = scenario.systems[0]
    roofline_drafter = with_speculation(build_timing(scenario, tmp_path), scenario,
                                        scenario_from_dict(draft_model_scenario()).systems[0])
    timing = with_speculation(build_timing(scenario, tmp_path), scenario, system, tmp_path)
    drafter = timing.drafter
    assert drafter is not None and drafter.source == str(tmp_path / "draft.yaml")
    assert (drafter.a, drafter.b, drafter.c, drafter.d, drafter.e) == tuple(
        coefficients.values())  # no step overhead: its passes run inside the step
    base = build_timing(scenario, tmp_path)
    decode, context, rho = 8, 4000, base.rho(16)
    assert timing.step_time(decode, context, 0, 0, rho) == pytest.approx(
        base.step_time(decode, context, 0, 0, rho) + 4 * (
            base.d * decode + 2e-3 + 3e-6 * decode + rho * 5e-9 * context))
    assert timing.step_time(decode, context, 0, 0, rho) != roofline_drafter.step_time(
        decode, context, 0, 0, rho)
    # kvsim run finds it beside the scenario, from any directory.
    path = tmp_path / "draft_scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    ran = kvsim_in_process("run", str(path), "--out", str(tmp_path / "run"), "--quiet",
                           "--no-report", cwd=Path("/"))
    assert ran.returncode == 0, ran.stderr
    # Timed for another model: refused in one line naming the file and both models.
    Calibration(model="llama-3.1-8b", device="test", coefficients=coefficients, rho={},
                fit={}).dump(tmp_path / "draft.yaml")
    expected = (f"kvsim: error: {path}: {tmp_path / 'draft.yaml'}: model: calibrated for "
                "'llama-3.1-8b', but systems[s].speculative.draft_model is 'llama-3.2-1b'")
    for command in (("run", str(path), "--out", str(tmp_path / "run2"), "--quiet"),
                    ("validate", str(path))):
        refused = kvsim_in_process(*command)
        assert refused.returncode == 2
        assert refused.stderr.strip() == expected


def test_eagle3_on_gpt_oss_pays_least_where_drafts_wake_the_most_experts(tmp_path):
    # The shipped comparison with a model card's measurement (README): on the roofline, a
    # batch of 8 with 3 drafts each reads 2.2 times the experts its 8 tokens read alone, so
    # EAGLE-3's gain dips there, between one request (little to read but the dense weights)
    # and 64 (nearly every expert read anyway).
    from sim.sweep import run_sweep

    outcome = run_sweep(Path(__file__).resolve().parents[1] / "scenarios" / "sweeps"
                        / "gpt_oss_eagle3.yaml", out_dir=tmp_path, jobs=2, quick=True)
    assert outcome.failed == 0
    throughput = outcome.table.pivot_table(index="param:workload.arrival.users",
                                           columns="system", values="throughput_tok_s")
    gain = throughput["eagle3"] / throughput["plain"]
    assert list(gain.index) == [1, 8, 64]
    assert (gain > 1).all()
    assert gain[8] < 0.85 * min(gain[1], gain[64])


def moe_eagle_scenario(**speculative: object) -> dict:
    data = one_request(10, 10, {"method": "eagle3", "num_speculative_tokens": 3,
                                "mean_acceptance_length": 2.44, **speculative})
    data["model"], data["gpu"], data["memory"] = "gpt-oss-120b", "h100-80g", {}
    data["systems"].append({"name": "mtp", "allocator": {"kind": "paged"}, "speculative": {
        "method": "mtp", "num_speculative_tokens": 3, "mean_acceptance_length": 2.44}})
    return data


def test_an_eagle_head_of_a_mixture_of_experts_reads_the_same_weights_at_any_batch():
    # An EAGLE-3 head is a dense Llama layer whatever its target: by default a layer's share
    # of GPT-OSS-120B's active parameters, stored in bf16, every pass reading all of it. An
    # MTP module is a layer of the target's own kind: the more tokens it drafts for, the more
    # of its experts it reads.
    scenario = scenario_from_dict(moe_eagle_scenario())
    target, bandwidth = MODEL_PRESETS["gpt-oss-120b"], GPU_PRESETS["h100-80g"]
    eagle, mtp = scenario.systems
    assert eagle.speculative is not None and mtp.speculative is not None
    head = eagle.speculative.drafter_spec(target)
    assert head is not None and not head.is_moe and head.num_layers == 1
    assert head.num_params == pytest.approx(target.active_params / 36)
    assert mtp.speculative.drafter_spec(target) is None
    timing = build_timing(scenario, Path())
    drafter = with_speculation(timing, scenario, eagle).drafter
    assert drafter is not None
    bytes_per_s = bandwidth.hbm_bandwidth_bytes_per_s
    assert drafter.fixed_s(1) == drafter.fixed_s(64) == pytest.approx(
        head.num_params * 2 / bytes_per_s)
    share = with_speculation(timing, scenario, mtp).drafter
    assert share is not None
    assert share.fixed_s(64) > 3 * share.fixed_s(1)
    assert drafter.b == pytest.approx(2 * head.num_params / bandwidth.peak_flops)


def test_draft_params_size_the_head_its_weights_its_passes_and_the_pool():
    # The SpecForge EAGLE-3 head of Llama-3.1-8B: fc 3·4096→4096, attention from 2·4096
    # wide, a 14,336-wide MLP and a 32,000-token lm_head, 0.425B parameters (its embedding is
    # the target's). One layer of the target's KV a token, its bf16 weights out of the pool.
    data = draft_model_scenario()
    data["systems"][0]["speculative"] = {"method": "eagle3", "num_speculative_tokens": 3,
                                         "acceptance_rate": 0.7, "draft_params": 4.25e8}
    data["systems"].append({"name": "share", "allocator": {"kind": "paged"}, "speculative": {
        "method": "eagle3", "num_speculative_tokens": 3, "acceptance_rate": 0.7}})
    scenario = scenario_from_dict(data)
    target, gpu = MODEL_PRESETS["llama-3.1-8b"], GPU_PRESETS["h100-80g"]
    head_system, share_system = scenario.systems
    slots = scenario_pool_slots(scenario)
    per_token = target.kv_bytes_per_token
    assert system_pool_slots(scenario, head_system) == int(
        (slots * per_token - 4.25e8 * 2) // (per_token * 33 / 32))
    assert system_pool_slots(scenario, share_system) == int(
        (slots * per_token - target.weight_bytes / 32) // (per_token * 33 / 32))
    assert (f"its dense eagle3 head of 0.42B parameters (weights and KV) leave "
            f"{system_pool_slots(scenario, head_system):,} tokens") in memory_summary(scenario)
    timing = build_timing(scenario, Path())
    head = with_speculation(timing, scenario, head_system).drafter
    share = with_speculation(timing, scenario, share_system).drafter
    assert head is not None and share is not None
    assert head.a == pytest.approx(4.25e8 * 2 / gpu.hbm_bandwidth_bytes_per_s)
    assert head.d == pytest.approx(2 * 4.25e8 / gpu.peak_flops)
    assert head.c == pytest.approx(share.c)  # one layer of the target's attention either way
    assert share.a == pytest.approx(timing.a / 32)  # a dense target's share, as before
    run = run_scenario(scenario)
    assert run.systems["s"].requests["finished_s"].notna().all()
