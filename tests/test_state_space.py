"""State-space hybrids (Qwen3-Next: Gated DeltaNet layers beside full attention): a state a
sequence instead of KV a token, in blocks vLLM raises to hold it, or at the head of every
contiguous extent; golden numbers from vLLM's logs, the engine, and what is refused."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from sim.api import load, run
from sim.engine import allocation_unit, build_allocator, scenario_pool_slots, scenario_trace
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


TINY = {"name": "m", "num_layers": 4, "num_heads": 4, "head_dim": 64, "num_params": 1e8,
        "max_model_len": 4096}


@pytest.mark.parametrize(("change", "message"), [
    ({"systems[paged].allocator.prefix_caching": True},
     "systems[paged].allocator.prefix_caching: qwen3-next-80b-a3b has state-space layers; "
     "prefix caching of a state"),
    ({"systems[paged].allocator.hybrid_kv_cache": False},
     "systems[paged].allocator.hybrid_kv_cache: qwen3-next-80b-a3b has state-space layers"),
    ({"systems[paged].allocator": {"kind": "virtual"}},
     "systems[paged].allocator.kind: qwen3-next-80b-a3b has state-space layers; virtual"),
    ({"systems[paged].speculative": {"method": "ngram", "num_speculative_tokens": 2,
                                     "acceptance_rate": 0.5}},
     "systems[paged].speculative: speculative decoding over qwen3-next-80b-a3b's"),
    ({"systems[paged].scheduler.preemption_mode": "swap"},
     "systems[paged].scheduler.preemption_mode: swapping qwen3-next-80b-a3b's state out"),
    ({"parallel.pipeline_parallel_size": 2}, "parallel.pipeline_parallel_size: pipeline"),
    ({"engine": {"replicas": 2, "disaggregation": {"prefill_replicas": 1}}},
     "engine.disaggregation: sending"),
    ({"model": {**TINY, "num_state_layers": 2}},
     "num_state_layers and state_bytes_per_layer go together"),
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
    with pytest.raises(ScenarioError) as caught:
        load(SCENARIO, overrides=change)
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
                "state_bytes_per_layer": 1097728}
    preset = run(SCENARIO).systems["paged"].summary
    given = run(SCENARIO, overrides={"model": explicit}).systems["paged"].summary
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
    data = {"name": "pressure", "model": SMALL_HYBRID, "memory": {"kv_memory_gib": 0.002},
            "workload": {"arrival": {"process": "poisson", "rate": 100},
                         "prompt_len": {"dist": "uniform", "low": 20, "high": 200},
                         "output_len": {"dist": "uniform", "low": 1, "high": 120},
                         "max_tokens": 150},
            "systems": [{"name": "s", "allocator": system, "scheduler": scheduler}],
            "stop": {"num_requests": 80}}
    runs = {}
    for mode in ("jump", "step"):
        data["engine"] = {"mode": mode, "debug_invariants": mode == "step"}
        runs[mode] = run(data).systems["s"]
    pd.testing.assert_frame_equal(runs["jump"].requests, runs["step"].requests)
    assert runs["jump"].summary["completed"] == 80
    if system["kind"] == "paged":  # memory binds: 131 blocks, a state of 3 a sequence
        assert runs["jump"].summary["peak_running"] <= 131 // 4


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
