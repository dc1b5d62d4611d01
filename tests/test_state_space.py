"""State-space hybrids (Qwen3-Next: Gated DeltaNet layers beside full attention): a state a
sequence instead of KV a token, in blocks vLLM raises to hold it, or at the head of every
contiguous extent; golden numbers from vLLM's logs, the engine, and what is refused."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pandas as pd
import pytest

from sim.api import load, run
from sim.engine import (
    allocation_unit,
    build_allocator,
    build_timing,
    cached_model,
    memory_summary,
    scenario_pool_slots,
    scenario_trace,
    system_pool_slots,
    with_speculation,
)
from sim.memory import ContiguousAllocator, HybridPagedAllocator
from sim.metrics import format_summary
from sim.presets import MODEL_PRESETS, lookup_gpu, max_concurrency
from sim.scenario import ScenarioError
from sim.timing import roofline
from workloads import WorkloadError

QWEN3_NEXT = MODEL_PRESETS["qwen3-next-80b-a3b"]


def test_a_block_is_raised_to_hold_a_state_as_vllm_raises_it():
    # vLLM's log for Qwen3-Next in bf16: "Setting attention block size to 544 tokens" on one
    # GPU, 272 on four, and "Padding mamba page size by 1.49%".
    assert QWEN3_NEXT.state_bytes_per_layer_per_gpu(1) == 3 * 8192 * 2 + 32 * 128 * 128 * 2
    assert QWEN3_NEXT.kv_bytes_per_token_per_gpu(1) == 12 * 2 * 2 * 256 * 2  # 12 layers
    assert QWEN3_NEXT.state_block_size(1) == 544
    assert QWEN3_NEXT.state_block_size(4) == 272
    tokens = QWEN3_NEXT.state_tokens_per_layer(1)
    assert tokens == 536
    page = 544 * 2 * 2 * 256 * 2  # one block of one attention layer
    padding = page - QWEN3_NEXT.state_bytes_per_layer_per_gpu(1)
    assert round(100 * padding / QWEN3_NEXT.state_bytes_per_layer_per_gpu(1), 2) == 1.49
    # An fp8 cache halves an attention token, not the state (mamba_cache_dtype auto).
    fp8 = dataclasses.replace(QWEN3_NEXT, kv_dtype_bytes=1)
    assert fp8.state_block_size(1) == 1072
    # A model without state layers keeps its block size.
    assert MODEL_PRESETS["llama-3-8b"].state_block_size(1) == 0


def test_requests_at_once_count_a_state_and_the_contexts_blocks_as_vllm_does():
    # 64 blocks of 544 tokens of 12 layers; a request of ten blocks' context holds those in
    # the attention group and one block in each of three state groups.
    slots = 64 * 544
    assert max_concurrency(QWEN3_NEXT, slots, 10 * 544, 1) == 64 / 13
    assert max_concurrency(QWEN3_NEXT, slots, 10 * 544 + 1, 1) == 64 / 14
    llama = MODEL_PRESETS["llama-3-8b"]
    assert max_concurrency(llama, slots, 10 * 544, 1) == 6.4


SCENARIO = {
    "name": "qwen3-next", "model": "qwen3-next-80b-a3b", "gpu": "h100-80g",
    "parallel": {"tensor_parallel_size": 4}, "max_model_len": 4096,
    "memory": {"kv_memory_gib": 1},
    "workload": {"arrival": {"process": "poisson", "rate": 200},
                 "prompt_len": {"dist": "uniform", "low": 100, "high": 200},
                 "output_len": {"dist": "uniform", "low": 20, "high": 60},
                 "max_tokens": 60},
    "systems": [
        {"name": "paged", "allocator": {"kind": "paged", "block_size": 16}},
        {"name": "contiguous", "allocator": {"kind": "contiguous",
                                             "reserve_policy": "request_max"}}],
    "stop": {"num_requests": 200},
}


def test_a_paged_pool_keeps_three_state_blocks_and_the_attention_blocks_a_sequence():
    scenario, _ = load(SCENARIO)
    paged, contiguous = scenario.systems
    assert allocation_unit(scenario, paged) == 272  # block_size 16 asked, 272 needed
    slots = scenario_pool_slots(scenario)
    model = scenario.model_spec()
    alloc = build_allocator(paged, slots, 4096, page_tokens=272, model=model,
                            tensor_parallel_size=4)
    assert isinstance(alloc, HybridPagedAllocator)
    # A block holds 272 tokens of one group's 12 layers; the model has 12 attention layers.
    assert alloc.num_blocks == slots // 272
    assert (alloc.full_groups, alloc.sliding_groups, alloc.state_groups) == (1, 0, 3)
    assert alloc.state_slots == 268  # 274,432 state bytes a layer over 1,024 a token
    assert not alloc.enable_prefix_caching  # off unless asked, as vLLM turns it off
    flat = build_allocator(contiguous, slots, 4096, model=model, tensor_parallel_size=4)
    assert isinstance(flat, ContiguousAllocator)
    assert flat.state_slots == -(-36 * 274432 // (12 * 1024))  # 804 slots of every layer


def test_states_bound_how_many_run_at_once():
    result = run(SCENARIO)
    scenario, _ = load(SCENARIO)
    blocks = scenario_pool_slots(scenario) // 272
    paged, flat = result.systems["paged"].summary, result.systems["contiguous"].summary
    for summary in (paged, flat):
        assert summary["completed"] == 200
    # Each sequence holds 3 state blocks and 1 attention block (prompt and output under
    # 272 tokens): the pool seats at most a quarter of its blocks' worth at once, and a
    # load of 200 requests a second fills it.
    assert paged["peak_running"] <= blocks // 4
    assert paged["peak_running"] >= blocks // 4 - 1
    # Contiguous: each extent is the request's reach (prompt and max_tokens, at least 160)
    # and 804 slots of state.
    slots = scenario_pool_slots(scenario)
    assert slots // (260 + 804) <= flat["peak_running"] <= slots // (160 + 804)
    # The states are written memory: the token share counts them, and the state share is
    # each running sequence's (3 blocks' 268 slots; 804 slots), within it.
    assert paged["token_frac"] > 0.5
    for summary, per_sequence in ((paged, 3 * 268), (flat, 804)):
        assert summary["state_frac"] == pytest.approx(
            summary["mean_running"] * per_sequence / summary["capacity_slots"])
        assert 0 < summary["state_frac"] <= summary["token_frac"]
    assert "KV pool holding states" in _table(result)
    plain = run(SCENARIO, overrides={"model": "qwen3-30b-a3b", "max_model_len": 4096})
    assert plain.systems["paged"].summary["state_frac"] is None
    assert "KV pool holding states" not in _table(plain)


def _table(result) -> str:
    """The summary table a run prints."""
    return format_summary({name: r.summary for name, r in result.systems.items()})


def test_a_state_costs_a_decode_step_its_reads_and_writes():
    gpu = lookup_gpu("h100-80g")
    with_state = roofline(QWEN3_NEXT, gpu, tensor_parallel_size=4)
    stateless = roofline(dataclasses.replace(QWEN3_NEXT, state_bytes_per_layer=0), gpu,
                         tensor_parallel_size=4)
    state_s = 2 * 36 * 274432 / gpu.hbm_bandwidth_bytes_per_s  # read and written, a step
    assert with_state.b - stateless.b == pytest.approx(state_s)
    assert with_state.d == stateless.d  # (a chunk's one read and write left out)
    # Attention: the 12 attention layers' KV read (c) and query-key pairs (e) only.
    assert with_state.c == pytest.approx(max(
        12 * 2 * 256 * 2 / gpu.hbm_bandwidth_bytes_per_s,  # one replicated KV head a GPU
        4 * 12 * 4 * 256 / gpu.peak_flops))
    assert with_state.e == pytest.approx(2 * 12 * 16 * 256 / 4 / gpu.peak_flops)


# Qwen3-Next's own MTP layer drafting 2 tokens a step.
MTP = {"method": "mtp", "num_speculative_tokens": 2, "acceptance_rate": 0.7}

TINY = {"name": "m", "num_layers": 4, "num_heads": 4, "head_dim": 64, "num_params": 1e8,
        "max_model_len": 4096}


@pytest.mark.parametrize(("change", "message"), [
    ({"systems[paged].allocator.hybrid_kv_cache": False},
     "systems[paged].allocator.hybrid_kv_cache: qwen3-next-80b-a3b has state-space layers"),
    ({"systems[paged].allocator": {"kind": "virtual"}},
     "systems[paged].allocator.kind: qwen3-next-80b-a3b has state-space layers; virtual"),
    ({"systems[paged].speculative": {"method": "draft_model", "draft_model": "llama-3.2-1b",
                                     "num_speculative_tokens": 2, "acceptance_rate": 0.5}},
     "systems[paged].speculative.draft_model: a draft model of its own beside "
     "qwen3-next-80b-a3b's state-space layers is not modelled"),
    ({"systems[paged].allocator.prefix_caching": True,
      "systems[paged].scheduler.chunked_prefill": True,
      "systems[paged].allocator.host_cache_gib": 20},
     "systems[paged].allocator.host_cache_gib: qwen3-next-80b-a3b has state-space layers; "
     "a host tier of a cache that keeps states is not modelled"),
    ({"systems[paged].scheduler.preemption_mode": "swap"},
     "systems[paged].scheduler.preemption_mode: swapping qwen3-next-80b-a3b's state out"),
    ({"parallel.pipeline_parallel_size": 2}, "parallel.pipeline_parallel_size: pipeline"),
    ({"engine": {"replicas": 2, "disaggregation": {"prefill_replicas": 1}}},
     "engine.disaggregation: sending"),
    ({"engine": {"replicas": 2, "router": {"policy": "kv_aware", "kv_events": True}}},
     "engine.router.kv_events: KV events of a cache that keeps qwen3-next-80b-a3b's "
     "state-space layers' states are not modelled"),
    ({"model": {**TINY, "num_state_layers": 2}},
     "num_state_layers and state_bytes_per_layer go together"),
    ({"model": {**TINY, "state_bytes_per_draft_per_layer": 512}},
     "state_bytes_per_draft_per_layer needs num_state_layers"),
    ({"model": {**TINY, "num_state_layers": 4, "state_bytes_per_layer": 2000}},
     "num_state_layers (4) leaves no attention layer of num_layers (4)"),
    ({"model": {**TINY, "num_state_layers": 2, "state_bytes_per_layer": 2000,
                "sliding_window": 64}},
     "num_state_layers with sliding_window is not modelled"),
    ({"model": {**TINY, "num_state_layers": 2, "state_bytes_per_layer": 2000,
                "kv_latent_dim": 64}},
     "num_state_layers with kv_latent_dim is not modelled"),
])
def test_what_is_not_modelled_with_state_layers_is_refused_in_one_line(change, message):
    assert_refused_in_one_line(SCENARIO, change, message)


def assert_refused_in_one_line(data: dict, change: dict, message: str) -> None:
    """``data`` with ``change`` is refused in one line that says ``message``."""
    with pytest.raises(ScenarioError) as caught:
        load(data, overrides=change)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_forked_samples_are_refused_and_fanned_out_ones_run():
    sampled = {"workload.sampling": {"n": 2}}
    scenario, base_dir = load(SCENARIO, overrides=sampled)
    with pytest.raises(WorkloadError, match=r"systems\[paged\]\.scheduler\.parallel_sampling: "
                       r"fork: request 0 of .* has 2 samples, and qwen3-next-80b-a3b's "
                       r"state-space layers keep a state a sequence"):
        scenario_trace(scenario, base_dir)
    fanned = dict(sampled)
    fanned["systems[paged].scheduler.parallel_sampling"] = "fan_out"
    fanned["systems[contiguous].scheduler.parallel_sampling"] = "fan_out"
    result = run(SCENARIO, overrides=fanned)
    assert result.systems["paged"].summary["completed"] == 200


def test_an_explicit_model_with_state_layers_runs_as_the_preset():
    explicit = {"name": "qwen3-next-explicit", "num_layers": 48, "num_heads": 16,
                "num_kv_heads": 2, "head_dim": 256, "num_params": 80e9,
                "max_model_len": 262144, "hidden_size": 2048, "active_params": 3e9,
                "num_experts": 512, "experts_per_token": 10, "num_state_layers": 36,
                "state_bytes_per_layer": 1097728, "state_bytes_per_draft_per_layer": 16384}
    for speculative in (None, MTP):
        overrides = {"systems[paged].speculative": speculative} if speculative else {}
        preset = run(SCENARIO, overrides=overrides).systems["paged"].summary
        overrides["model"] = explicit
        given = run(SCENARIO, overrides=overrides).systems["paged"].summary
        assert given["throughput_tok_s"] == preset["throughput_tok_s"]
        assert given["peak_running"] == preset["peak_running"]


SMALL_HYBRID = {  # 2 attention layers and 6 state layers; a state is 16 tokens of a layer
    "name": "small-hybrid", "num_layers": 8, "num_heads": 4, "num_kv_heads": 2,
    "head_dim": 64, "num_params": 1e8, "max_model_len": 4096, "num_state_layers": 6,
    "state_bytes_per_layer": 8192}


@pytest.mark.parametrize("system", [
    {"kind": "paged", "block_size": 16},
    {"kind": "paged", "block_size": 16, "watermark": 0.0},
    {"kind": "contiguous", "reserve_policy": "request_max"},
    {"kind": "contiguous", "reserve_policy": "pow2", "placement": "best_fit"},
])
@pytest.mark.parametrize("scheduler", [
    {"chunked_prefill": True, "max_num_batched_tokens": 256},
    {"chunked_prefill": True, "max_num_batched_tokens": 256, "prefill_allocation": "per_chunk"},
    {"preemption_victim": "fewest_generated"},
])
def test_a_state_space_model_under_memory_pressure_runs_as_stepping(system, scheduler):
    # A pool of 131 blocks: each sequence holds 3 of state and up to 20 of its tokens, so
    # requests wait and are preempted; runs of decode steps equal stepping, invariants
    # checked at every step.
    data = _under_pressure(SMALL_HYBRID, 0.002, {"allocator": system, "scheduler": scheduler})
    summary = _jump_as_stepping(data)
    if system["kind"] == "paged":  # memory binds: 131 blocks, a state of 3 a sequence
        assert summary["peak_running"] <= 131 // 4


def _under_pressure(model: dict, kv_memory_gib: float, system: dict) -> dict:
    """80 requests at 100 a second to ``model`` in a small pool, to one system ``s``."""
    return {"name": "pressure", "model": model, "memory": {"kv_memory_gib": kv_memory_gib},
            "workload": {"arrival": {"process": "poisson", "rate": 100},
                         "prompt_len": {"dist": "uniform", "low": 20, "high": 200},
                         "output_len": {"dist": "uniform", "low": 1, "high": 120},
                         "max_tokens": 150},
            "systems": [{"name": "s", **system}], "stop": {"num_requests": 80}}


def _jump_as_stepping(data: dict) -> dict:
    """Run ``data`` in jump mode and stepping (invariants checked at every step): the same
    requests, every one completed; the jump run's summary."""
    runs = {}
    for mode in ("jump", "step"):
        data["engine"] = {"mode": mode, "debug_invariants": mode == "step"}
        runs[mode] = run(data).systems["s"]
    pd.testing.assert_frame_equal(runs["jump"].requests, runs["step"].requests)
    summary = runs["jump"].summary
    assert summary["completed"] == data["stop"]["num_requests"]
    return summary


def test_a_float32_recurrent_state_raises_the_block_as_vllm_raises_it():
    # vLLM's KV cache config of Qwen3.5-4B on two GPUs (4 KV heads of 256; 32 Gated DeltaNet
    # value heads of 128, the recurrent state in float32): a convolution state of
    # (3, 4,096) in bf16 and a recurrent state of (16, 128, 128) in float32 a GPU, blocks
    # of 528 tokens, pages padded to 1,081,344 bytes.
    state_bytes = 3 * 8192 * 2 + 32 * 128 * 128 * 4  # on one GPU
    model = dataclasses.replace(QWEN3_NEXT, name="qwen3.5-4b-like", num_layers=32,
                                num_kv_heads=4, num_state_layers=24,
                                state_bytes_per_layer=state_bytes)
    assert model.state_bytes_per_layer_per_gpu(2) == 3 * 4096 * 2 + 16 * 128 * 128 * 4
    assert model.state_block_size(2) == 528
    assert 528 * model.kv_bytes_per_token_per_gpu(2) // model.kv_layers == 1081344


# ----------------------------------------------------------------- speculative decoding
# vLLM (MambaSpec.num_speculative_blocks, gated_delta_net_state_shape's num_spec): under k
# drafts a step each state group keeps 1 + k blocks a sequence, the state after each draft
# written so that the accepted one's is kept, and the convolution state keeps k inputs
# more; an MTP or EAGLE head's attention layer joins the model's in the KV cache groups.


def test_drafts_widen_the_state_and_the_drafters_layer_joins_the_groups():
    conv, recurrent = 8192 * 2, 32 * 128 * 128 * 2  # bytes of one input, and of the rest
    for drafts, block in ((0, 544), (1, 544), (2, 560), (3, 560), (4, 576)):
        served = QWEN3_NEXT.with_speculation(1, drafts)
        assert served.state_bytes_per_layer == (3 + drafts) * conv + recurrent
        # vLLM's rule: 16 × ⌈state ÷ (16 × one layer's token of 2,048 bytes)⌉.
        assert served.state_block_size(1) == 16 * -(-served.state_bytes_per_layer // (16 * 2048))
        assert served.state_block_size(1) == block
        # 12 attention layers and the MTP layer: groups of 13, the last state group padded.
        assert served.kv_cache_groups() == (13, 1, 0, 3)
    assert QWEN3_NEXT.with_speculation(0, 0) is QWEN3_NEXT
    # vLLM's comment on its grouping: gpt-oss-20b with an EAGLE layer, 12 sliding and 13
    # full layers, pads to groups of 13 rather than making 12 and 24.
    gpt_oss = MODEL_PRESETS["gpt-oss-20b"]
    assert gpt_oss.kv_cache_groups() == (12, 1, 1, 0)
    assert gpt_oss.with_speculation(1, 3).kv_cache_groups() == (13, 1, 1, 0)


def test_a_speculative_pool_keeps_a_state_a_draft_position_in_blocks_of_13_layers():
    scenario, _ = load(SCENARIO, overrides={"systems[paged].speculative": MTP,
                                            "systems[contiguous].speculative": MTP})
    paged, contiguous = scenario.systems
    assert allocation_unit(scenario, paged) == 288  # 282,624 state bytes a GPU, 1,024 a token
    slots = system_pool_slots(scenario, paged)
    # The pool's bytes (given: no weights taken out) over 13 layers' tokens.
    assert slots == scenario_pool_slots(scenario) * 12 * 1024 // (13 * 1024)
    served = cached_model(scenario, paged)
    assert served.kv_layers == 13
    alloc = build_allocator(paged, slots, 4096, page_tokens=288, model=served,
                            tensor_parallel_size=4)
    assert isinstance(alloc, HybridPagedAllocator)
    assert alloc.num_blocks == slots // 288  # a block: 288 tokens of a group's 13 layers
    assert (alloc.full_groups, alloc.state_groups, alloc.state_blocks) == (1, 3, 9)
    assert alloc.state_slots == 276
    flat = build_allocator(contiguous, slots, 4096, model=served, tensor_parallel_size=4)
    assert isinstance(flat, ContiguousAllocator)
    assert flat.state_slots == 3 * -(-36 * 282624 // (13 * 1024))  # 3 states of 765 slots
    # n-gram lookup has no layers: 12 attention layers, 4 states of 3 + 3 inputs a sequence.
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "acceptance_rate": 0.5}
    scenario, _ = load(SCENARIO, overrides={"systems[paged].speculative": ngram})
    served = cached_model(scenario, scenario.systems[0])
    assert served.kv_cache_groups() == (12, 1, 0, 3)
    assert served.state_bytes_per_layer_per_gpu(4) == (6 * 8192 * 2 + 32 * 128 * 128 * 2) // 4
    assert system_pool_slots(scenario, scenario.systems[0]) == scenario_pool_slots(scenario)
    text = memory_summary(scenario)
    assert ("system 'paged': 4 states a sequence in each state-space layer (its own and one "
            "after each draft), 0.27 MiB each a GPU, in blocks of at least 288 tokens") in text


def test_states_a_draft_position_bound_how_many_run_at_once():
    overrides = {"systems[paged].speculative": MTP, "systems[contiguous].speculative": MTP}
    result = run(SCENARIO, overrides=overrides)
    scenario, _ = load(SCENARIO, overrides=overrides)
    paged = scenario.systems[0]
    blocks = system_pool_slots(scenario, paged) // 288
    summary = result.systems["paged"].summary
    assert summary["completed"] == 200
    # 9 state blocks and 1 block of the 13 attention layers (a request's prompt, output
    # and drafts fit in 288 tokens) a sequence.
    assert blocks // 10 - 1 <= summary["peak_running"] <= blocks // 10
    assert summary["state_frac"] == pytest.approx(
        summary["mean_running"] * 9 * 276 / summary["capacity_slots"])
    flat = result.systems["contiguous"].summary
    assert flat["state_frac"] == pytest.approx(
        flat["mean_running"] * 3 * 765 / flat["capacity_slots"])
    text = memory_summary(scenario)
    assert ("system 'paged': its mtp drafter's 1 layer (weights and KV) leave "
            f"{system_pool_slots(scenario, paged):,} tokens, the hybrid KV cache manager keeps "
            "13 attention layers, the drafter's among them, in 1 full-attention and 3 state "
            "groups of 13 layers, 3 states a sequence") in text
    assert "in 2,295 slots an extent" in text


def test_drafts_write_states_and_an_mtp_layer_reads_one_attention_layers_kv():
    scenario, base_dir = load(SCENARIO, overrides={"systems[paged].speculative": MTP})
    system = scenario.systems[0]
    gpu = lookup_gpu("h100-80g")
    timing = build_timing(scenario, base_dir)
    assert timing.state_s == pytest.approx(2 * 36 * 274432 / gpu.hbm_bandwidth_bytes_per_s)
    drafting = with_speculation(timing, scenario, system, base_dir)
    # Each state grew by 2 inputs of 8,192 bf16 elements (a quarter a GPU): read and
    # written whole every step; and each draft writes one more state.
    grown_s = 2 * 36 * 2 * 16384 / 4 / gpu.hbm_bandwidth_bytes_per_s
    assert drafting.b == pytest.approx(timing.b + grown_s)
    assert drafting.draft_state_s == pytest.approx(36 * 282624 / gpu.hbm_bandwidth_bytes_per_s)
    # The MTP layer: a 48th of the weights and FLOPs, no state, one of the 12 attention
    # layers' KV reads and query-key pairs.
    drafter = drafting.drafter
    assert drafter is not None
    assert drafter.a == pytest.approx(timing.a / 48)
    assert drafter.b == pytest.approx((timing.b - timing.state_s) / 48)
    assert drafter.c == pytest.approx(timing.c / 12)
    assert drafter.e == pytest.approx(timing.e / 12)
    assert drafter.state_s == drafter.draft_state_s == 0
    # A decode step of 8 sequences reading 1,000 tokens: the drafts' pass through the
    # target (the experts its 24 tokens choose), their states, and the drafter's two passes.
    rho = timing.rho(288)
    plain = replace(drafting, speculative_tokens=0, drafter=None)
    extra = drafting.step_time(8, 8 * 1003, 0, 0, rho) - plain.step_time(8, 8 * 1003, 0, 0, rho)
    assert extra == pytest.approx(
        drafting.fixed_s(24) - drafting.fixed_s(8)
        + 2 * ((timing.d + drafting.draft_state_s) * 8
               + drafter.fixed_s(8) + drafter.b * 8 + rho * drafter.c * 8 * 1003))


@pytest.mark.parametrize("system", [
    {"kind": "paged", "block_size": 16},
    {"kind": "contiguous", "reserve_policy": "request_max"},
])
@pytest.mark.parametrize("speculative", [
    {"method": "mtp", "num_speculative_tokens": 2, "acceptance_rate": 0.7},
    {"method": "ngram", "num_speculative_tokens": 3, "acceptance_rate": 0.5,
     "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 64, 1]]},
])
def test_a_speculative_state_space_model_under_memory_pressure_runs_as_stepping(
        system, speculative):
    # The small hybrid with an MTP layer: 3 attention layers in groups of 3 beside 2 state
    # groups (n-gram lookup: 2 and 3); drafts widen its 16-token state.
    model = {**SMALL_HYBRID, "state_bytes_per_draft_per_layer": 1024}
    data = _under_pressure(model, 0.003, {
        "allocator": system, "speculative": speculative,
        "scheduler": {"chunked_prefill": True, "max_num_batched_tokens": 256}})
    summary = _jump_as_stepping(data)
    scenario, _ = load(data)
    if system["kind"] == "paged":
        assert summary["preemptions"] > 0  # memory binds
        # 8,192 bytes of state and 1,024 a draft, over 512 a token of a layer: 20 tokens
        # (2 drafts) or 22 (3), in blocks of 32.
        assert allocation_unit(scenario, scenario.systems[0]) == 32


# ----------------------------------------------------------------- a prefix cache of states
# vLLM's mamba cache mode "align": prefill chunks end on block boundaries, the state at each
# boundary a step ends on is kept, and a hit ends where every state group's state is kept.

# Prompts of 500 tokens every request shares and 600 of its own, in 64-token blocks,
# prefilled 192 tokens a step at most: one request a second, each done before the next.
SHARED = {"name": "shared", "model": SMALL_HYBRID, "memory": {"kv_memory_gib": 0.05},
          "workload": {"arrival": {"process": "constant", "rate": 1},
                       "prompt_len": {"dist": "constant", "value": 600},
                       "output_len": {"dist": "constant", "value": 20},
                       "prefix_groups": {"groups": 1, "length": 500, "fraction": 1.0}},
          "systems": [{"name": "s", "allocator": {"kind": "paged", "block_size": 64,
                                                   "prefix_caching": True},
                       "scheduler": {"chunked_prefill": True,
                                     "max_num_batched_tokens": 192}}],
          "stop": {"num_requests": 4}, "engine": {"mode": "step", "debug_invariants": True}}


def test_prefill_chunks_end_on_block_boundaries_as_vllm_aligns_them():
    # _mamba_block_aligned_split on the first 1,100-token prompt: whole blocks while the
    # prompt's last boundary (1,088) lies beyond, then up to it, then the 12 tokens after.
    def first_prompts_chunks(overrides: dict) -> list[int]:
        steps = run(SHARED, overrides=overrides).systems["s"].steps
        return steps[steps["prefill_tokens"] > 0]["prefill_tokens"].tolist()[:7]

    off = {"systems[s].allocator.prefix_caching": False}
    assert first_prompts_chunks({}) == [192] * 5 + [128, 12]
    assert first_prompts_chunks(off)[:6] == [192] * 5 + [140]
    # 200 tokens a step: cut to 3 blocks' 192 all the same (unaligned: 200 five times).
    wider = {"systems[s].scheduler.max_num_batched_tokens": 200}
    assert first_prompts_chunks(wider) == [192] * 5 + [128, 12]
    assert first_prompts_chunks({**wider, **off})[:6] == [200] * 5 + [100]
    # Blocks of 256, larger than a step's 192: each chunk goes on to the next boundary.
    larger = {"systems[s].allocator.block_size": 256}
    assert first_prompts_chunks(larger) == [192, 64] * 3 + [192]


def test_a_hit_ends_at_the_last_boundary_whose_states_are_kept():
    # The first request's chunks end at 192, 384, 576 ...: its states there are kept. The
    # others share its first 500 tokens: attention finds 7 blocks (448) cached, but the
    # states were kept at 384, not 448, so each hits 384 tokens.
    result = run(SHARED).systems["s"]
    assert result.requests["prefix_hit_tokens"].tolist() == [0, 384, 384, 384]
    # Without state layers (the same attention) the hit is the attention's 448.
    attention_only = {**SMALL_HYBRID, "num_layers": 2}
    del attention_only["num_state_layers"], attention_only["state_bytes_per_layer"]
    plain = run(SHARED, overrides={"model": attention_only}).systems["s"]
    assert plain.requests["prefix_hit_tokens"].tolist() == [0, 448, 448, 448]
    # Off (the default for a state-space model), nothing hits.
    off = run(SHARED, overrides={"systems[s].allocator.prefix_caching": False}).systems["s"]
    assert off.requests["prefix_hit_tokens"].sum() == 0
    assert off.summary["prefix_hit_rate"] is None


def test_a_state_cache_under_memory_pressure_runs_as_stepping():
    # Sessions and shared prefixes in a small pool: kept states are evicted, hits found,
    # requests preempted; jump mode equals stepping, invariants checked at every step.
    data = _under_pressure(SMALL_HYBRID, 0.002, {
        "allocator": {"kind": "paged", "block_size": 32, "prefix_caching": True},
        "scheduler": {"chunked_prefill": True, "max_num_batched_tokens": 100}})
    data["workload"]["prefix_groups"] = {"groups": 2, "length": 160, "fraction": 0.9}
    summary = _jump_as_stepping(data)
    assert summary["prefix_hit_rate"] > 0.05
    assert summary["preemptions"] > 0 and summary["evictions"] > 0


@pytest.mark.parametrize(("change", "message"), [
    ({"systems[s].scheduler.chunked_prefill": False},
     "systems[s].allocator.prefix_caching: a prefix cache of small-hybrid's states needs "
     "scheduler.chunked_prefill: true"),
    ({"systems[s].speculative": MTP},
     "systems[s].allocator.prefix_caching: a prefix cache of small-hybrid's states under "
     "speculative decoding is not modelled"),
])
def test_what_a_state_cache_does_not_model_is_refused_in_one_line(change, message):
    assert_refused_in_one_line(SHARED, change, message)


def test_qwen3_5_blocks_are_raised_as_vllms_logs_say():
    # Qwen3.5-35B-A3B, one or two GPUs: "Setting attention block size to 1056 tokens" and
    # "Padding mamba page size by 0.76%" (a bf16 convolution state of 24 KiB and a float32
    # recurrent state of 1 MiB a GPU on two). Qwen3.5-27B: 784 tokens, padding 0.13 %.
    moe = MODEL_PRESETS["qwen3.5-35b-a3b"]
    assert moe.state_bytes_per_layer_per_gpu(2) == 24 * 1024 + 1024 * 1024
    dense = MODEL_PRESETS["qwen3.5-27b"]
    for model, tp, block, padding_pct in ((moe, 1, 1056, 0.76), (moe, 2, 1056, 0.76),
                                          (dense, 1, 784, 0.13)):
        assert model.state_block_size(tp) == block
        state = model.state_bytes_per_layer_per_gpu(tp)
        page = block * model.kv_bytes_per_token_per_gpu(tp) // model.kv_layers
        assert round(100 * (page - state) / state, 2) == padding_pct
    assert (moe.kv_layers, moe.kv_cache_groups()) == (10, (10, 1, 0, 3))
    assert (dense.kv_layers, dense.kv_cache_groups()) == (16, (16, 1, 0, 3))


@pytest.mark.parametrize("prompt", [1087, 1088, 1500, 2000, 2113])
def test_a_prompt_sent_again_hits_whole_blocks_before_its_last_token_as_measured(prompt):
    # Measured on Qwen3.5-35B-A3B on two GPUs with prefix caching (vLLM's align mode): a
    # prompt of L tokens sent again finds floor((L - 1) / 1056) × 1056 cached. Here the
    # second request shares all but the last of the first's tokens.
    data = {"name": "again", "model": "qwen3.5-35b-a3b", "gpu": "h100-80g",
            "parallel": {"tensor_parallel_size": 2}, "max_model_len": 8192,
            "memory": {"kv_memory_gib": 8},
            "workload": {"arrival": {"process": "constant", "rate": 0.5},
                         "prompt_len": {"dist": "constant", "value": 1},
                         "output_len": {"dist": "constant", "value": 8},
                         "prefix_groups": {"groups": 1, "length": prompt - 1,
                                           "fraction": 1.0}},
            "systems": [{"name": "s", "allocator": {"kind": "paged", "block_size": 16,
                                                     "prefix_caching": True},
                         "scheduler": {"chunked_prefill": True}}],
            "stop": {"num_requests": 2}}
    hits = run(data).systems["s"].requests["prefix_hit_tokens"].tolist()
    assert hits == [0, (prompt - 1) // 1056 * 1056]


# ------------------------------------------------------ vLLM's mamba cache mode "all"
# The Mamba-2 kernel writes a state at the end of each of its chunks inside a prefill, and
# mode "all" keeps one at every block boundary, in blocks of whole chunks: chunks need not
# end on boundaries, and a hit ends at the attention's last cached block.
ALL_STATES = {"systems[s].allocator.mamba_cache_mode": "all",
              "model": {**SMALL_HYBRID, "state_chunk_size": 64}}


def test_mode_all_keeps_a_state_at_every_boundary_and_chunks_are_not_cut():
    def chunks_and_hits(overrides: dict) -> tuple[list[int], list[int]]:
        result = run(SHARED, overrides=overrides).systems["s"]
        steps = result.steps
        chunks = steps[steps["prefill_tokens"] > 0]["prefill_tokens"].tolist()[:6]
        return chunks, result.requests["prefix_hit_tokens"].tolist()

    # align: chunks cut to end on boundaries; the states where they ended (384) bound hits.
    assert chunks_and_hits({}) == ([192] * 5 + [128], [0, 384, 384, 384])
    # all: the budget's chunks as without a cache; every boundary's state kept, so the hit
    # is the attention's 7 cached blocks (448), as without state layers.
    assert chunks_and_hits(ALL_STATES) == ([192] * 5 + [140], [0, 448, 448, 448])


def test_mode_all_under_memory_pressure_runs_as_stepping():
    model = {**SMALL_HYBRID, "state_chunk_size": 32}
    data = _under_pressure(model, 0.002, {
        "allocator": {"kind": "paged", "block_size": 32, "prefix_caching": True,
                      "mamba_cache_mode": "all"},
        "scheduler": {"chunked_prefill": True, "max_num_batched_tokens": 100}})
    data["workload"]["prefix_groups"] = {"groups": 2, "length": 160, "fraction": 0.9}
    summary = _jump_as_stepping(data)
    assert summary["prefix_hit_rate"] > 0.05
    assert summary["preemptions"] > 0 and summary["evictions"] > 0


def test_granite_4_blocks_are_whole_chunks_under_mode_all():
    # Granite-4.0-H-Tiny: a Mamba-2 state of 806,400 bytes a layer in bf16 is 394 tokens of
    # an attention layer's KV (2,048 bytes): blocks of 400 tokens (16-token alignment), or
    # of 512 under mode all (chunks of 256). Its 36 state and 4 attention layers make
    # 1 + 9 groups of 4; its bf16 weights are its checkpoint's 13.88 GB.
    granite = MODEL_PRESETS["granite-4.0-h-tiny"]
    assert granite.state_bytes_per_layer == 806_400
    assert granite.state_tokens_per_layer(1) == 394
    for tp in (1, 2, 4):
        assert (granite.state_block_size(tp), granite.state_block_size(tp, True)) == (400, 512)
    assert granite.kv_cache_groups() == (4, 1, 0, 9)
    assert round(granite.weight_bytes / 1e9, 2) == 13.88
    scenario, _ = load({**SHARED, "model": "granite-4.0-h-tiny", "gpu": "h100-80g"},
                       overrides={"systems[s].allocator.mamba_cache_mode": "all"})
    assert allocation_unit(scenario, scenario.systems[0]) == 512
    assert "(512 under mamba_cache_mode all)" in memory_summary(scenario)
    # vLLM's "maximum concurrency" on an H100 (7,701,505 slots: 19,253 blocks of 400, or
    # 15,042 of 512): a 131,072-token request takes 328 attention blocks and 9 states, or
    # 256 and 9.
    slots = 7_701_505
    assert max_concurrency(granite, slots, 131_072, 1) == 19_253 / 337
    assert max_concurrency(granite, slots, 131_072, 1, True) == 15_042 / 265


@pytest.mark.parametrize(("data", "change", "message"), [
    (SCENARIO, {"systems[paged].allocator.prefix_caching": True,
                "systems[paged].scheduler.chunked_prefill": True,
                "systems[paged].allocator.mamba_cache_mode": "all"},
     "systems[paged].allocator.mamba_cache_mode: all needs the Mamba-2 chunk of "
     "qwen3-next-80b-a3b's state-space layers (model.state_chunk_size), and vLLM refuses it "
     "for its Gated DeltaNet models (Qwen3-Next, Qwen3.5): use align"),
    (SHARED, {"systems[s].allocator.mamba_cache_mode": "all"},
     "needs the Mamba-2 chunk of small-hybrid's state-space layers"),
    (SHARED, {"model": {**SMALL_HYBRID, "num_state_layers": None,
                        "state_bytes_per_layer": None, "state_chunk_size": 64}},
     "model: state_chunk_size needs num_state_layers and state_bytes_per_layer"),
])
def test_mode_all_without_a_mamba_2_chunk_is_refused_in_one_line(data, change, message):
    assert_refused_in_one_line(data, change, message)
