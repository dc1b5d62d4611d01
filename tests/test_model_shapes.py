"""Model shapes beyond dense multi-head attention: grouped-query and multi-head latent
attention (MLA), mixtures of experts (MoE), quantized weights."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from gpu_validate.__main__ import main as gpu_validate_main
from gpu_validate.harness import model_problem
from sim.engine import build_timing, run_scenario
from sim.presets import GIB, GPU_PRESETS, MODEL_PRESETS, kv_pool_slots
from sim.scenario import ScenarioError, scenario_from_dict
from sim.timing import roofline

H100 = GPU_PRESETS["h100-80g"]


@pytest.mark.parametrize("name, kv_bytes", [
    # Published config.json shapes, by hand: MLA caches kv_lora_rank 512 + qk_rope_head_dim 64
    # elements a layer, once (no separate V); GQA caches K and V for each KV head.
    ("deepseek-v2-lite", 27 * (512 + 64) * 2),
    ("deepseek-v3", 61 * (512 + 64) * 2),
    ("qwen3-30b-a3b", 2 * 48 * 4 * 128 * 2),
    ("llama-3-8b", 2 * 32 * 8 * 128 * 2),
    ("gpt-oss-20b", 2 * 24 * 8 * 64 * 2),
    ("gpt-oss-120b", 2 * 36 * 8 * 64 * 2),
    ("llama-3.1-70b", 2 * 80 * 8 * 128 * 2),
    ("llama-3.1-405b", 2 * 126 * 8 * 128 * 2),
    ("qwen3-8b", 2 * 36 * 8 * 128 * 2),
    ("qwen3-32b", 2 * 64 * 8 * 128 * 2),
    ("qwen3-235b-a22b", 2 * 94 * 4 * 128 * 2),
])
def test_bytes_a_token_caches(name, kv_bytes):
    assert MODEL_PRESETS[name].kv_bytes_per_token == kv_bytes


def config_json_params(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                       mlp: int, vocab: int, experts: int = 0, experts_per_token: int = 0
                       ) -> tuple[int, int]:
    """(all, active) parameters of a Llama-style decoder from its config.json, by hand: Q,
    K, V and O projections, a gated MLP of three matrices (each expert one, of ``mlp``
    wide, behind a router), untied input and output embeddings; norms left out."""
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    one_mlp = 3 * hidden * mlp
    if experts:
        layer = attention + hidden * experts + experts * one_mlp
        active = attention + hidden * experts + experts_per_token * one_mlp
    else:
        layer = active = attention + one_mlp
    embeddings = 2 * vocab * hidden
    return layers * layer + embeddings, layers * active + embeddings


@pytest.mark.parametrize("name, config", [
    ("llama-3.1-70b", (80, 8192, 64, 8, 128, 28672, 128256)),
    ("llama-3.1-405b", (126, 16384, 128, 8, 128, 53248, 128256)),
    ("qwen3-8b", (36, 4096, 32, 8, 128, 12288, 151936)),
    ("qwen3-32b", (64, 5120, 64, 8, 128, 25600, 151936)),
    # moe_intermediate_size 1,536; 128 experts, 8 a token, in every layer.
    ("qwen3-235b-a22b", (94, 4096, 64, 4, 128, 1536, 151936, 128, 8)),
])
def test_the_parameters_are_their_config_json_shapes(name, config):
    model = MODEL_PRESETS[name]
    total, active = config_json_params(*config)
    assert model.num_params == pytest.approx(total, rel=2e-4)
    assert model.flops_params == pytest.approx(active, rel=2e-4)
    assert model.hidden_size == config[1]
    assert model.num_heads * model.head_dim == config[2] * config[4]
    if model.is_moe:  # the routed experts the weights hold: all 128 of each layer's
        assert model.routed_expert_params == pytest.approx(94 * 128 * 3 * 4096 * 1536,
                                                           rel=1e-3)


def test_llama_70b_in_fp8_keeps_its_embeddings_in_bf16_and_reads_and_multiplies_faster():
    bf16, fp8 = MODEL_PRESETS["llama-3.1-70b"], MODEL_PRESETS["llama-3.1-70b-fp8"]
    embeddings = 2 * 128256 * 8192  # the input embedding and the LM head
    assert fp8.weight_bytes == pytest.approx((bf16.num_params - embeddings) + 2 * embeddings)
    # Two H100s an engine: 6 GiB a GPU for KV in bf16, 38 in FP8; each decode step reads
    # half the bytes.
    pools = [kv_pool_slots(m, H100, tensor_parallel_size=2) for m in (bf16, fp8)]
    assert pools[0] == pytest.approx(39_176, abs=1) and pools[1] > 6 * pools[0]
    steps = [roofline(m, H100, tensor_parallel_size=2) for m in (bf16, fp8)]
    saved = (bf16.weight_bytes - fp8.weight_bytes) / 2  # a GPU's share
    assert saved > 0.48 * bf16.weight_bytes / 2
    assert steps[0].a - steps[1].a == pytest.approx(saved / H100.hbm_bandwidth_bytes_per_s)
    # Its linear layers multiply on FP8 tensor cores (1,979 TFLOP/s), the embeddings' share
    # in bf16 (989); the two all-reduces a layer cost what they did; attention and its KV
    # stay 16-bit.
    fp8_share = (bf16.num_params - embeddings) / bf16.num_params
    link_s = steps[0].b - 2 * bf16.num_params / 2 / 989e12
    assert steps[1].b == pytest.approx(2 * bf16.num_params / 2 * (
        (1 - fp8_share) / 989e12 + fp8_share / 1979e12) + link_s)
    assert steps[1].c == steps[0].c and steps[1].e == steps[0].e
    # An A100 has no FP8 tensor cores: the FP8 weights multiply at its bf16 rate.
    a100 = GPU_PRESETS["a100-80g"]
    assert roofline(fp8, a100, tensor_parallel_size=2).b == roofline(
        bf16, a100, tensor_parallel_size=2).b


def test_llama_405b_in_fp8_leaves_attention_and_the_outer_layers_in_bf16():
    bf16, fp8 = MODEL_PRESETS["llama-3.1-405b"], MODEL_PRESETS["llama-3.1-405b-fp8"]
    fp8_mlp = 124 * 3 * 16384 * 53248  # all MLPs but the first and last layers'
    assert fp8.weight_bytes == pytest.approx((bf16.num_params - fp8_mlp) * 2 + fp8_mlp)
    assert fp8.weight_bytes / 1e9 == pytest.approx(487.2, abs=0.1)
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token  # the cache stays 16-bit
    # One board of eight H100s holds the FP8 weights, not the bf16 ones: those want two
    # boards, as pipeline stages.
    assert kv_pool_slots(fp8, H100, tensor_parallel_size=8) > 100_000
    with pytest.raises(ValueError, match=r"split the layers over boards as 2 pipeline"):
        kv_pool_slots(bf16, H100, tensor_parallel_size=8)
    assert kv_pool_slots(bf16, GPU_PRESETS["b200-180g"], tensor_parallel_size=8) > 1_000_000


def test_nvfp4_checkpoints_read_a_quarter_and_multiply_in_fp4_on_a_b200_only():
    # NVIDIA's FP4 checkpoints: every linear layer in 4 bits with an FP8 scale per 16
    # (4.5 bits a weight), the input embedding and the LM head in bf16.
    bf16, fp4 = MODEL_PRESETS["llama-3.1-70b"], MODEL_PRESETS["llama-3.3-70b-fp4"]
    embeddings = 2 * 128256 * 8192
    linear = bf16.num_params - embeddings
    assert fp4.weight_bytes == pytest.approx(linear * 4.5 / 8 + 2 * embeddings)
    assert fp4.weight_bytes / 1e9 == pytest.approx(42.70, abs=0.01)
    assert fp4.kv_bytes_per_token == bf16.kv_bytes_per_token  # the cache stays 16-bit
    big = MODEL_PRESETS["llama-3.1-405b-fp4"]
    assert big.weight_bytes / 1e9 == pytest.approx(234.3, abs=0.1)
    b200, h200 = GPU_PRESETS["b200-180g"], GPU_PRESETS["h200-141g"]
    # Two B200s hold the 405B in FP4, one does not; in FP8 it wants four.
    assert kv_pool_slots(big, b200, tensor_parallel_size=2) > 200_000
    with pytest.raises(ValueError, match="do not fit"):
        kv_pool_slots(big, b200, tensor_parallel_size=1)
    with pytest.raises(ValueError, match="do not fit"):
        kv_pool_slots(MODEL_PRESETS["llama-3.1-405b-fp8"], b200, tensor_parallel_size=2)
    # On a B200 the linear layers multiply at its FP4 rate (9,000 TFLOP/s), the
    # embeddings' share at bf16 (2,250); an H200 has no FP4 tensor cores: bf16 throughout
    # (and the same as the bf16 model's products, to the bit), though it reads the 4-bit
    # weights.
    share = linear / bf16.num_params
    on_b200 = [roofline(m, b200) for m in (bf16, fp4)]
    assert on_b200[1].b == pytest.approx(2 * bf16.num_params * (
        (1 - share) / 2250e12 + share / 9000e12))
    assert on_b200[0].b > 3.5 * on_b200[1].b
    assert on_b200[1].c == on_b200[0].c and on_b200[1].e == on_b200[0].e
    on_h200 = [roofline(m, h200) for m in (bf16, fp4)]
    assert on_h200[1].b == on_h200[0].b
    assert on_h200[0].a - on_h200[1].a == pytest.approx(
        (bf16.weight_bytes - fp4.weight_bytes) / h200.hbm_bandwidth_bytes_per_s)


def test_an_mla_latent_is_whole_on_every_gpu_of_a_tensor_parallel_group():
    v3 = MODEL_PRESETS["deepseek-v3"]
    assert v3.tensor_parallel_problem(8) is None
    assert "128 attention heads" in v3.tensor_parallel_problem(3)
    # Each GPU holds every token's whole latent: eight GPUs, eight copies.
    assert v3.kv_bytes_per_token_per_gpu(8) == v3.kv_bytes_per_token == 70_272
    assert v3.slots_in_gib(80, 8) == 80 * GIB // (8 * 70_272)
    # Whereas GQA's KV heads split: Llama-3-8B's 8 heads, 2 a GPU over 4.
    llama = MODEL_PRESETS["llama-3-8b"]
    assert llama.kv_bytes_per_token_per_gpu(4) == llama.kv_bytes_per_token // 4
    # vAttention: a page backs one layer's latent, 576 two-byte elements a token.
    assert v3.tokens_per_page(2 * 1024**2, 8) == 2 * 1024**2 // 1152 == 1820


def test_fp8_weights_leave_the_pool_what_they_save():
    v3 = MODEL_PRESETS["deepseek-v3"]  # shipped in FP8: a byte a weight
    bf16 = dataclasses.replace(v3, weight_dtype_bytes=None)
    assert v3.weight_bytes == 671e9 and bf16.weight_bytes == 2 * 671e9
    h200 = GPU_PRESETS["h200-141g"]
    per_gpu = h200.memory_bytes * 0.9 - 671e9 / 8
    assert kv_pool_slots(v3, h200, tensor_parallel_size=8) == int(per_gpu // 70_272)
    # In 16-bit its weights do not fit eight H200s at all.
    with pytest.raises(ValueError, match="do not fit"):
        kv_pool_slots(bf16, h200, tensor_parallel_size=8)


@pytest.mark.parametrize("name, mlp_params, checkpoint_gib", [
    # OpenAI's model card: MLP (routed experts) parameters, and the checkpoint's size.
    ("gpt-oss-20b", 19.12e9, 12.8),
    ("gpt-oss-120b", 114.71e9, 60.8),
])
def test_gpt_oss_experts_in_mxfp4_and_the_rest_in_bf16_make_its_checkpoint(
        name, mlp_params, checkpoint_gib):
    model = MODEL_PRESETS[name]
    # Total less active less the input embedding (201,088 × 2,880) is the unchosen 28/32
    # (or 124/128) of the experts.
    assert model.routed_expert_params == pytest.approx(mlp_params, rel=2e-3)
    assert model.routed_expert_bytes == pytest.approx(mlp_params * 4.25 / 8, rel=2e-3)
    assert model.weight_bytes / GIB == pytest.approx(checkpoint_gib, rel=5e-3)
    # Every other layer sees 128 tokens: one group of each kind.
    assert model.kv_cache_groups() == (model.num_layers // 2, 1, 1, 0)
    # Counting the embedding as active would take it for 4-bit experts: a lighter model.
    counted = dataclasses.replace(model, vocab_size=None)
    assert counted.routed_expert_params > model.routed_expert_params
    assert counted.weight_bytes < model.weight_bytes


def test_gpt_oss_in_its_config_json_terms_is_the_preset():
    shape = {"name": "gpt-oss-20b", "num_layers": 24, "num_heads": 64, "num_kv_heads": 8,
             "head_dim": 64, "hidden_size": 2880, "num_params": 20.91e9,
             "max_model_len": 131072, "active_params": 3.61e9, "num_experts": 32,
             "experts_per_token": 4, "expert_weight_dtype_bytes": 0.53125,
             "vocab_size": 201088, "sliding_window": 128, "num_sliding_layers": 12}
    data = explicit()
    data["model"] = shape
    assert scenario_from_dict(data).model_spec() == MODEL_PRESETS["gpt-oss-20b"]


def test_a_mixture_of_experts_multiplies_by_the_active_weights_and_reads_the_chosen_ones():
    moe = MODEL_PRESETS["qwen3-30b-a3b"]
    dense = dataclasses.replace(moe, active_params=None, num_experts=None,
                                experts_per_token=None)
    moe_t, dense_t = roofline(moe, H100), roofline(dense, H100)
    assert moe_t.a == dense_t.a  # all 30.5 B weights, when every expert is chosen
    assert moe_t.b == pytest.approx(dense_t.b * 3.3 / 30.5)
    assert moe_t.d == pytest.approx(dense_t.d * 3.3 / 30.5)
    assert moe_t.c == dense_t.c and moe_t.e == dense_t.e
    # The routed experts are what the active parameters leave out, over the 120 of 128
    # experts a token does not choose: (30.5 − 3.3) B / (120/128), two bytes each.
    routed_bytes = (30.5e9 - 3.3e9) / (120 / 128) * 2
    assert moe_t.expert_s == pytest.approx(routed_bytes / H100.hbm_bandwidth_bytes_per_s)
    # T tokens, each to 8 of 128 experts, leave (120/128)^T of them unread.
    for tokens in (1, 8, 64, 512):
        unread = moe_t.expert_s * (120 / 128) ** tokens
        assert moe_t.fixed_s(tokens) == pytest.approx(moe_t.a - unread)
    assert moe_t.min_fixed_s < 0.2 * moe_t.a
    assert moe_t.fixed_s(64) > 0.98 * moe_t.a
    # A step's cost counts decoding and prefilled tokens alike.
    assert moe_t.step_time(4, 0, 60, 0, 1.0) == pytest.approx(
        moe_t.fixed_s(64) + 4 * moe_t.b + 60 * moe_t.d)
    assert dense_t.fixed_s(1) == dense_t.a  # a dense model reads all its weights
    # Active parameters without routing: every step reads every expert.
    unrouted = dataclasses.replace(moe, num_experts=None, experts_per_token=None)
    assert roofline(unrouted, H100).fixed_s(1) == moe_t.a
    # Prefill attention spans heads × head_dim (32 × 128), not the 2,048-wide residual
    # stream; tensor parallelism all-reduces the residual stream.
    assert moe_t.e == pytest.approx(2 * 48 * 4096 / H100.peak_flops)
    wide = dataclasses.replace(moe, model_dim=4096)
    assert roofline(wide, H100, tensor_parallel_size=2).b > roofline(
        moe, H100, tensor_parallel_size=2).b


def test_few_tokens_a_step_read_few_experts():
    # At a trickle of requests the batch is small and a step reads a few experts only: each
    # output token comes far sooner than if every step read all 30.5 B weights.
    def tpot_ms(**routing):
        scenario = {"name": "moe", "model": "qwen3-30b-a3b", "gpu": "h100-80g",
                    "workload": {"arrival": {"process": "poisson", "rate": 0.5},
                                 "prompt_len": {"dist": "constant", "value": 200},
                                 "output_len": {"dist": "constant", "value": 100}},
                    "systems": [{"name": "paged", "allocator": {"kind": "paged"}}],
                    "stop": {"num_requests": 20}}
        if routing:
            scenario["model"] = {"name": "qwen3-30b-a3b-unrouted", "num_layers": 48,
                                 "num_heads": 32, "num_kv_heads": 4, "head_dim": 128,
                                 "num_params": 30.5e9, "max_model_len": 40960,
                                 "hidden_size": 2048, "active_params": 3.3e9, **routing}
        result = run_scenario(scenario_from_dict(scenario)).systems["paged"]
        return result.summary["tpot_p50_s"] * 1e3

    preset = tpot_ms()
    assert tpot_ms(num_experts=128, experts_per_token=8) == pytest.approx(preset)
    assert preset < 0.5 * tpot_ms(num_experts=None)  # every step reading every expert


def explicit(**model) -> dict:
    shape = {"name": "custom", "num_layers": 27, "num_heads": 16, "head_dim": 192,
             "num_params": 15.7e9, "max_model_len": 8192, **model}
    return {"name": "shapes", "model": shape, "gpu": "h100-80g",
            "workload": {"arrival": {"process": "poisson", "rate": 20},
                         "prompt_len": {"dist": "constant", "value": 500},
                         "output_len": {"dist": "constant", "value": 200}},
            "systems": [{"name": "paged", "allocator": {"kind": "paged"}}],
            "stop": {"num_requests": 40}}


def test_an_explicit_model_in_its_config_json_terms():
    mla = scenario_from_dict(explicit(hidden_size=2048, kv_latent_dim=576,
                                      active_params=2.4e9, num_experts=64,
                                      experts_per_token=6,
                                      num_dense_layers=1)).model_spec()
    assert mla == dataclasses.replace(MODEL_PRESETS["deepseek-v2-lite"], name="custom",
                                      max_model_len=8192)
    mha = scenario_from_dict(explicit()).model_spec()
    assert mha.num_kv_heads == 16 and mha.hidden_size == 16 * 192  # HF's defaults
    assert mha.kv_bytes_per_token == 2 * 27 * 16 * 192 * 2
    int4 = scenario_from_dict(explicit(weight_dtype_bytes=0.5)).model_spec()
    assert int4.weight_bytes == 15.7e9 / 2


def test_fp8_weights_multiply_at_the_fp8_rate_a_gpu_states():
    gpu = {"name": "mine", "memory_gib": 80, "hbm_bandwidth_gbps": 3000, "peak_tflops": 1000}
    fp8 = explicit(weight_dtype_bytes=1, fp8_share=1.0)

    def per_token_s(data: dict, tmp: Path) -> float:
        return build_timing(scenario_from_dict(data), tmp).b

    here = Path()
    bf16_rate = per_token_s({**fp8, "gpu": gpu}, here)
    assert bf16_rate == pytest.approx(2 * 15.7e9 / 1000e12)  # no FP8 tensor cores stated
    assert per_token_s({**fp8, "gpu": {**gpu, "peak_fp8_tflops": 2000}}, here) == (
        pytest.approx(bf16_rate / 2))
    half = explicit(weight_dtype_bytes=1.5, fp8_share=0.5)
    assert per_token_s({**half, "gpu": {**gpu, "peak_fp8_tflops": 2000}}, here) == (
        pytest.approx(bf16_rate * 0.75))
    # FP4 at its own rate where stated, beside FP8; bf16 where not.
    mixed = explicit(weight_dtype_bytes=1, fp8_share=0.25, fp4_share=0.5)
    both = {**gpu, "peak_fp8_tflops": 2000, "peak_fp4_tflops": 4000}
    assert per_token_s({**mixed, "gpu": both}, here) == pytest.approx(
        bf16_rate * (0.25 + 0.25 / 2 + 0.5 / 4))
    assert per_token_s({**mixed, "gpu": {**gpu, "peak_fp8_tflops": 2000}}, here) == (
        pytest.approx(bf16_rate * (0.75 + 0.25 / 2)))


@pytest.mark.parametrize("model, message", [
    ({"active_params": 20e9}, "model: active_params (2e+10) exceeds num_params (1.57e+10)"),
    ({"num_kv_heads": 5}, "num_heads (16) must be a multiple of num_kv_heads (5)"),
    ({"weight_dtype_bytes": 8}, "model.weight_dtype_bytes: Input should be less than or equal"),
    ({"fp8_share": 1.5}, "model.fp8_share: Input should be less than or equal to 1"),
    ({"fp8_share": 0.5, "fp4_share": 0.6},
     "fp8_share (0.5) and fp4_share (0.6) add up to more than all the weights (1)"),
    ({"kv_latent_dim": 0}, "model.kv_latent_dim"),
    ({"num_experts": 8}, "num_experts and experts_per_token go together"),
    ({"num_experts": 8, "experts_per_token": 2}, "num_experts needs active_params"),
    ({"num_experts": 8, "experts_per_token": 8, "active_params": 1e9},
     "experts_per_token (8) must be fewer than num_experts (8)"),
    ({"vocab_size": 32000}, "vocab_size applies to a mixture of experts"),
    ({"expert_weight_dtype_bytes": 0.5}, "expert_weight_dtype_bytes applies to a mixture"),
    ({"num_experts": 8, "experts_per_token": 2, "active_params": 5e9, "vocab_size": 4_000_000},
     "num_params (1.57e+10) leaves no routed experts beside active_params (5e+09)"),
])
def test_inconsistent_shapes_are_one_line_errors(model, message):
    with pytest.raises(ScenarioError, match=message.replace("(", r"\(").replace(
            ")", r"\)").replace("+", r"\+")) as caught:
        scenario_from_dict(explicit(**model))
    assert "\n" not in str(caught.value)


def test_a_smaller_latent_serves_more_from_the_same_pool():
    # The same 27-layer model with 1 GiB of KV: MHA caches 20 × what MLA does per token, so
    # the pool holds far fewer requests at once and they wait for memory.
    def run(**model):
        data = explicit(**model)
        data["memory"] = {"kv_memory_gib": 1}
        scenario = scenario_from_dict(data)
        return run_scenario(scenario).systems["paged"].summary

    mla, mha = run(kv_latent_dim=576), run()
    assert mla["peak_batch"] > 3 * mha["peak_batch"]
    assert mla["throughput_tok_s"] > mha["throughput_tok_s"]


def test_mla_decode_reads_its_latent():
    scenario = scenario_from_dict(explicit(kv_latent_dim=576))
    timing = build_timing(scenario, Path())
    assert timing.c == pytest.approx(27 * 576 * 2 / H100.hbm_bandwidth_bytes_per_s)


@pytest.mark.parametrize("name, words", [
    ("deepseek-v3", "MLA attention and a mixture of experts and quantized weights"),
    ("qwen3-30b-a3b", "uses a mixture of experts;"),
    ("llama-3.1-70b-fp8", "uses quantized weights; the harness times dense models with "
     "multi-head or grouped-query attention and 16-bit weights only"),
    ("llama-3.3-70b-fp4", "uses quantized weights;"),
    ("qwen3-next-80b-a3b", "uses a mixture of experts and state-space layers;"),
])
def test_the_gpu_harness_refuses_what_its_kernel_does_not_time(name, words, capsys, tmp_path):
    assert words in model_problem(MODEL_PRESETS[name])
    assert model_problem(MODEL_PRESETS["llama-3-8b"]) is None
    assert gpu_validate_main(["--model", name, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_the_readme_names_every_preset():
    # The scenario reference lists the presets a scenario's model: and gpu: take.
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if line.startswith("| | `model`, `gpu`"))
    named = set(re.findall(r"`([a-z0-9.\-]+)`", row))
    assert [name for name in MODEL_PRESETS if name not in named] == []
    assert [name for name in GPU_PRESETS if name not in named] == []
