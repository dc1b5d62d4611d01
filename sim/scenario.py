"""Scenario files: the validated description of one experiment.

A scenario is a recipe card: which model on which GPU, what requests arrive (the workload),
which systems (allocator + scheduler settings) to compare on exactly those requests, when to
stop, and where to write results. :func:`load_scenario` turns a YAML file into a
:class:`Scenario` or raises :class:`ScenarioError` with a one-line message naming the file,
the field path and what was expected.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import math
import re
from collections.abc import Iterable
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import ErrorDetails

from sim.memory import EVICTION_POLICIES, PLACEMENTS, RESERVE_POLICIES
from sim.presets import (
    FP4_KV_BLOCK,
    FP4_KV_CACHE_DTYPES,
    GPU_PRESETS,
    KV_CACHE_DTYPE_BYTES,
    MODEL_PRESETS,
    GpuSpec,
    ModelSpec,
)
from sim.router import DYNAMO_TTL_S, VLLM_DP_STATS_INTERVAL_S
from sim.timing import DEFAULT_ALLREDUCE_LATENCY_S, DEFAULT_PIPELINE_NETWORK_GBPS
from sim.yaml_file import read_yaml
from workloads.distributions import MAX_LENGTH, ConfigModel, YamlFlag
from workloads.spec import (
    MAX_REQUESTS,
    MAX_SAMPLES,
    SyntheticWorkload,
    Workload,
    clients_time_out,
)


class ScenarioError(ValueError):
    """A scenario that cannot be loaded; ``str()`` is the one-line message for the user."""


# Bounds on a model given by its shape, far past any model (a trillion-parameter one has
# 10^12 parameters, 10^5 of any dimension): beyond them a step's FLOPs and bytes leave a
# float, and the run's times with them.
MAX_MODEL_COUNT = 1 << 24
MAX_PARAMS = 1e15
ParamCount = Annotated[float, Field(gt=0, le=MAX_PARAMS)]
ModelCount = Annotated[int, Field(gt=0, le=MAX_MODEL_COUNT)]
StateBytes = Annotated[int, Field(gt=0, le=1 << 40)]


class ModelConfig(ConfigModel):
    """A model given explicitly (instead of a preset name), in its config.json's terms."""

    name: str
    num_layers: ModelCount
    num_heads: ModelCount
    num_kv_heads: ModelCount | None = Field(
        default=None, description="KV heads (grouped-query attention); absent: num_heads")
    head_dim: ModelCount
    num_params: ParamCount = Field(description="all parameters, every expert's included")
    max_model_len: int = Field(ge=2, le=MAX_LENGTH)
    dtype_bytes: Literal[1, 2, 4] = Field(
        default=2, description="bytes of an activation and, unless memory.kv_cache_dtype says "
        "otherwise, of a cached K or V element")
    hidden_size: ModelCount | None = Field(
        default=None, description="width of the residual stream; absent: num_heads × head_dim")
    kv_latent_dim: ModelCount | None = Field(
        default=None, description="multi-head latent attention (MLA): elements of the latent "
        "a token caches per layer, kv_lora_rank + qk_rope_head_dim (DeepSeek: 576)")
    active_params: ParamCount | None = Field(
        default=None, description="mixture of experts: parameters each token passes through")
    num_experts: ModelCount | None = Field(
        default=None, description="mixture of experts: routed experts per MoE layer (a step "
        "reads only those its tokens choose); absent: every step reads every expert")
    experts_per_token: ModelCount | None = Field(
        default=None, description="mixture of experts: routed experts each token goes to")
    num_dense_layers: int = Field(
        default=0, ge=0, le=MAX_MODEL_COUNT, description="mixture of experts: the first "
        "layers whose MLP is dense (config.json's first_k_dense_replace; DeepSeek-V3: 3), "
        "which send no tokens to experts")
    weight_dtype_bytes: float | None = Field(
        default=None, gt=0, le=4, description="bytes of a stored weight when the checkpoint "
        "is quantized (FP8: 1, 4-bit: 0.5, with its scales a little more); absent: "
        "dtype_bytes")
    expert_weight_dtype_bytes: float | None = Field(
        default=None, gt=0, le=4, description="mixture of experts: bytes of a stored "
        "routed-expert weight where the experts are quantized apart from the rest (GPT-OSS's "
        "MXFP4: 0.53125, 4.25 bits with the scales); absent: weight_dtype_bytes")
    vocab_size: ModelCount | None = Field(
        default=None, description="mixture of experts: the vocabulary, where active_params "
        "leave out the input embedding (vocab_size × hidden_size, looked up rather than "
        "multiplied), as GPT-OSS's model card counts them; absent: active_params count "
        "every parameter outside the routed experts")
    fp8_share: float = Field(
        default=0.0, ge=0, le=1, description="the share of the weights a token is multiplied "
        "by that run on FP8 tensor cores where the GPU has them (an FP8 checkpoint's linear "
        "layers, W8A8: 1 if all of them; set weight_dtype_bytes too); 0: bf16")
    fp4_share: float = Field(
        default=0.0, ge=0, le=1, description="the share that runs on FP4 tensor cores where "
        "the GPU has them (an NVFP4 checkpoint's linear layers, W4A4; weight_dtype_bytes "
        "0.5625 for those); a GPU without them multiplies it in bf16; 0: none")
    sliding_window: int | None = Field(
        default=None, ge=2, description="sliding-window attention: the tokens a sliding "
        "layer sees (Gemma-3: 1024); absent: every layer sees every token")
    num_sliding_layers: ModelCount | None = Field(
        default=None, description="sliding-window attention: how many layers see only the "
        "window (Gemma-3-27B: 52 of 62); absent: all of them")
    num_state_layers: ModelCount | None = Field(
        default=None, description="state-space (linear-attention) layers: how many layers "
        "keep one recurrent state a sequence instead of K and V a token (Mamba-2, Gated "
        "DeltaNet; Qwen3-Next-80B-A3B: 36 of 48); absent: none")
    state_bytes_per_layer: StateBytes | None = Field(
        default=None, description="state-space layers: bytes of one sequence's state in one "
        "layer, on one GPU, in the dtypes it is kept in (Gated DeltaNet: (conv_kernel - 1) "
        "× (2 × key heads × key dim + value heads × value dim) elements of convolution "
        "state and value heads × key dim × value dim of recurrent state; Qwen3-Next in "
        "bf16: 1,097,728; vLLM's mamba page size, unpadded)")
    state_bytes_per_draft_per_layer: StateBytes | None = Field(
        default=None, description="state-space layers under speculative decoding: bytes "
        "one layer's state grows by for each draft a step verifies (Gated DeltaNet's "
        "convolution state keeps one more input a draft: 2 × key heads × key dim + value "
        "heads × value dim elements; Qwen3-Next in bf16: 16,384); absent: none")
    state_chunk_size: int | None = Field(
        default=None, ge=1, le=MAX_MODEL_COUNT, description="state-space layers: Mamba-2's "
        "chunk (config.json's mamba_chunk_size; Granite-4.0-H: 256), which "
        "allocator.mamba_cache_mode all needs; absent: mode align only (as vLLM's Gated "
        "DeltaNet models)")

    @model_validator(mode="after")
    def _consistent(self):  # type: ignore[no-untyped-def]
        if (self.num_state_layers is None) != (self.state_bytes_per_layer is None):
            raise ValueError("num_state_layers and state_bytes_per_layer go together")
        if self.state_chunk_size is not None and self.num_state_layers is None:
            raise ValueError("state_chunk_size needs num_state_layers and "
                             "state_bytes_per_layer (the Mamba-2 layers it chunks)")
        if self.state_bytes_per_draft_per_layer is not None and self.num_state_layers is None:
            raise ValueError("state_bytes_per_draft_per_layer needs num_state_layers and "
                             "state_bytes_per_layer (the state it grows)")
        if self.num_state_layers is not None:
            if self.num_state_layers >= self.num_layers:
                raise ValueError(f"num_state_layers ({self.num_state_layers}) leaves no "
                                 f"attention layer of num_layers ({self.num_layers}); a model "
                                 "of state-space layers only is not modelled")
            for other in ("sliding_window", "kv_latent_dim"):
                if getattr(self, other) is not None:
                    raise ValueError(f"num_state_layers with {other} is not modelled (state-"
                                     "space layers beside full attention of K and V only)")
        if self.num_sliding_layers is not None:
            if self.sliding_window is None:
                raise ValueError("num_sliding_layers needs sliding_window (the tokens those "
                                 "layers see)")
            if self.num_sliding_layers > self.num_layers:
                raise ValueError(f"num_sliding_layers ({self.num_sliding_layers}) exceeds "
                                 f"num_layers ({self.num_layers})")
        if self.active_params is not None and self.active_params > self.num_params:
            raise ValueError(f"active_params ({self.active_params:g}) exceeds num_params "
                             f"({self.num_params:g})")
        routing = (self.num_experts, self.experts_per_token)
        if routing.count(None) == 1:
            raise ValueError("num_experts and experts_per_token go together")
        for moe_only in ("expert_weight_dtype_bytes", "vocab_size", "num_dense_layers"):
            if getattr(self, moe_only) and self.num_experts is None:
                raise ValueError(f"{moe_only} applies to a mixture of experts (num_experts, "
                                 "experts_per_token, active_params)")
        if self.num_experts is not None:
            if self.active_params is None:
                raise ValueError("num_experts needs active_params (the parameters each token "
                                 "passes through)")
            embedding = (self.vocab_size or 0) * (self.hidden_size
                                                  or self.num_heads * self.head_dim)
            if self.active_params + embedding >= self.num_params:
                raise ValueError(f"num_params ({self.num_params:g}) leaves no routed experts "
                                 f"beside active_params ({self.active_params:g}) and the "
                                 f"input embedding (vocab_size × hidden_size, {embedding:g})")
            if self.num_dense_layers >= self.num_layers:
                raise ValueError(f"num_dense_layers ({self.num_dense_layers}) leaves no MoE "
                                 f"layer of num_layers ({self.num_layers})")
            if self.experts_per_token >= self.num_experts:  # type: ignore[operator]
                raise ValueError(f"experts_per_token ({self.experts_per_token}) must be fewer "
                                 f"than num_experts ({self.num_experts})")
        if self.fp8_share + self.fp4_share > 1:
            raise ValueError(f"fp8_share ({self.fp8_share:g}) and fp4_share "
                             f"({self.fp4_share:g}) add up to more than all the weights (1)")
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        return self


# A GPU's or a link's rates (GB/s, TFLOP/s), from a millionth of any real GPU's to a
# billion times its (1e12: "a link that costs nothing"): a step timed by a rate past them
# takes no time or for ever (an infinite float).
MIN_RATE = 1e-3
MAX_RATE = 1e12
# The most engines one system runs (a million, past any deployment; each is simulated, so
# 2^32 of them would take the machine's memory before a pool's cap could refuse them).
MAX_REPLICAS = 1 << 20
# The most memory any one setting gives (GiB), 2^40: far past any machine (the pools' own
# caps refuse much less, in words), but short of 1e300, whose slots leave a float as NaN.
MAX_GIB = 1 << 40
GpuRate = Annotated[float, Field(ge=MIN_RATE, le=MAX_RATE)]


class GpuConfig(ConfigModel):
    """A GPU given explicitly (instead of a preset name)."""

    name: str
    memory_gib: float = Field(ge=0.001, le=MAX_GIB,
                              description="GiB of device memory (at least 1 MiB)")
    hbm_bandwidth_gbps: GpuRate = Field(description="GB/s (10^9 bytes per second)")
    peak_tflops: GpuRate = Field(description="dense bf16/fp16 TFLOP/s")
    peak_fp8_tflops: GpuRate | None = Field(
        default=None, description="dense FP8 TFLOP/s, for a model's FP8 weights (fp8_share); "
        "absent: no FP8 tensor cores, FP8 weights multiply at the bf16 rate")
    peak_fp4_tflops: GpuRate | None = Field(
        default=None, description="dense FP4 TFLOP/s, for a model's FP4 weights (fp4_share); "
        "absent: no FP4 tensor cores, FP4 weights multiply at the bf16 rate")
    interconnect_gbps: GpuRate | None = Field(
        default=None, description="GPU-to-GPU GB/s in one direction (NVLink: half the "
        "datasheet figure); needed for tensor parallelism, and for pipeline stages without "
        "parallel.pipeline_link_gbps")
    host_link_gbps: GpuRate | None = Field(
        default=None, description="GPU-to-host-memory GB/s in one direction (PCIe); needed "
        "only for a host cache")


class MemoryConfig(ConfigModel):
    """The KV pool: ``kv_memory_gib`` if given, else GPU memory × utilization − weights;
    ``kv_cache_dtype`` as vLLM's ``--kv-cache-dtype`` (fp8: half the bytes per token of a
    16-bit model, so twice the tokens in the same memory and half the bytes to read), or an
    FP4 cache (SGLang's ``fp4_e2m1``, TensorRT-LLM's ``nvfp4``: 4.5 bits, scales included)."""

    kv_memory_gib: float | None = Field(default=None, gt=0, le=MAX_GIB)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "nvfp4"] = Field(
        default="auto", description="auto: the model's dtype; fp8 variants: one byte; "
        "fp4_e2m1 (SGLang's) or nvfp4 (TensorRT-LLM's): 4-bit values with an 8-bit scale a "
        "block of 16, 0.5625 bytes (a GPU with FP4 tensor cores: Blackwell)")


class ParallelConfig(ConfigModel):
    """How one engine spreads over GPUs: tensor parallelism, as vLLM's
    ``--tensor-parallel-size`` (weights and KV heads split N ways, two all-reduces a layer),
    pipeline parallelism, as ``--pipeline-parallel-size`` (the layers split into stages, a
    batch in flight on each), and for a mixture of experts data parallelism, as
    ``--data-parallel-size`` (ranks of their own KV cache and batch, the experts spread over
    every rank's GPUs) with or without ``--enable-expert-parallel``."""

    tensor_parallel_size: PositiveInt = 1
    data_parallel_size: PositiveInt = Field(
        default=1, description="a mixture of experts: data-parallel ranks of one engine, as "
        "vLLM's --data-parallel-size; each rank has tensor_parallel_size GPUs, its own "
        "scheduler and KV cache, and the routed experts spread over all ranks' GPUs")
    expert_parallel: bool = Field(
        default=False, description="a mixture of experts: whole experts on each GPU and each "
        "token dispatched to its experts' GPUs and combined back (all-to-all), as vLLM's "
        "--enable-expert-parallel; false: every expert split over the GPUs, every rank's "
        "tokens gathered to all of them")
    allreduce_latency_s: float = Field(default=DEFAULT_ALLREDUCE_LATENCY_S, ge=0,
                                       description="fixed cost of one all-reduce (or one "
                                       "dispatch, or combine, of the experts' tokens)")
    expert_load_imbalance: float = Field(
        default=1.0, ge=1, description="under expert_parallel: the busiest GPU's share of "
        "the routed tokens over the mean GPU's (1: the router spreads them evenly, as "
        "vLLM's EPLB aims to; real routers choose some experts more), which every other GPU "
        "waits for in each MoE layer; at most the GPUs the experts spread over")

    pipeline_parallel_size: PositiveInt = Field(
        default=1, description="pipeline stages, as vLLM's --pipeline-parallel-size: each "
        "holds a share of the layers (their weights and KV) on tensor_parallel_size GPUs of "
        "its own; a batch passes stage to stage, and as many batches as stages are in flight")
    pipeline_link_gbps: GpuRate | None = Field(
        default=None, description="GB/s one GPU sends a batch's activations to the next "
        "stage at (one direction); absent: NVLink where every stage is on one board, else "
        f"{DEFAULT_PIPELINE_NETWORK_GBPS:g} (a 400 Gb/s InfiniBand NIC a GPU, as DGX "
        "boards have)")

    @property
    def gpus(self) -> int:
        """The GPUs of one engine: its stages' and ranks' tensor-parallel groups."""
        return self.stage_gpus * self.pipeline_parallel_size

    @property
    def stage_gpus(self) -> int:
        """The GPUs one layer spans: its ranks' tensor-parallel groups (a MoE layer's
        experts spread over all of them)."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def spreads_experts(self) -> bool:
        """Whether a MoE layer spans other GPUs than the tensor-parallel group's."""
        return self.stage_gpus > 1 and (self.data_parallel_size > 1 or self.expert_parallel)


class PredictorConfig(ConfigModel):
    """An output-length predictor a system consults: a contiguous ``predicted`` reservation
    is sized by it (S3), a ``shortest_predicted`` waiting line ordered by it. Its guess is
    the true output × exp(sigma·z), z ~ N(0, 1) per request (``source: model``), or a real
    predictor's from the trace (``source: trace``); × (1 + headroom), within max_tokens."""

    source: Literal["model", "trace"] = Field(
        default="model", description="model: the truth blurred by a log-normal error; trace: "
        "the trace's predicted_output column (workload.columns.predicted_output)")
    sigma: float = Field(default=0.5, ge=0, le=5, description="spread of the log-normal "
                         "prediction error (0: a perfect predictor)")
    headroom: float = Field(default=0.0, ge=0, le=10, description="share added to every "
                            "guess (0.2: 20 % more), to make reservations fall short less")

    @model_validator(mode="after")
    def _sigma_for_the_model(self):  # type: ignore[no-untyped-def]
        if self.source == "trace" and "sigma" in self.model_fields_set:
            raise ValueError("sigma applies to source: model only (source: trace takes the "
                             "trace's own predictions)")
        return self

    @model_serializer(mode="wrap")
    def _without_an_unused_sigma(self, handler: SerializerFunctionWrapHandler
                                 ) -> dict[str, Any]:
        # The trace's predictions have no sigma: left out, so that the scenario read back
        # (a sweep's points, a capacity search's loads) is not refused for giving one.
        data: dict[str, Any] = handler(self)
        if self.source == "trace":
            data.pop("sigma", None)
        return data


class ContiguousConfig(ConfigModel):
    """Contiguous max-length reservation (one extent per request)."""

    kind: Literal["contiguous"]
    reserve_policy: Literal["max_model_len", "request_max", "pow2", "oracle", "predicted"] = (
        Field(default="max_model_len", description="predicted: the final length the "
              "system's predictor expects; a request that outgrows it is preempted and "
              "seated again with a larger reservation (on_overflow)"))
    placement: Literal["first_fit", "best_fit"] = "first_fit"
    on_overflow: Literal["double", "request_max"] | None = Field(
        default=None, description="reserve_policy predicted: what a request that outgrew its "
        "reservation reserves when seated again: double: twice the predicted output (absent: "
        "this); request_max: its max_tokens, so that it never outgrows it again")

    @model_validator(mode="after")
    def _overflow_of_a_prediction(self):  # type: ignore[no-untyped-def]
        if self.on_overflow is not None and self.reserve_policy != "predicted":
            raise ValueError(f"on_overflow applies to reserve_policy: predicted, not "
                             f"{self.reserve_policy} (which no request outgrows)")
        return self


class PagedConfig(ConfigModel):
    """Paged blocks with block tables, ref counts, prefix caching and eviction."""

    kind: Literal["paged"]
    block_size: int = Field(default=16, ge=1, le=256)
    prefix_caching: bool = True
    eviction: Literal["lru", "lfu", "fifo", "sharing_aware"] = "lru"
    watermark: float = Field(default=0.01, ge=0, lt=1,
                             description="share of blocks admission keeps free (vLLM v0)")
    host_cache_gib: float = Field(
        default=0, ge=0, le=MAX_GIB, description="host (CPU) memory per replica that keeps the "
        "blocks the GPU evicts, to load them back instead of recomputing them; 0: none")
    host_load: Literal["serial", "layerwise"] = Field(
        default="serial", description="serial: a step's host loads finish before it "
        "computes; layerwise: layer i+1 loads while layer i computes (LMCache, HiCache)")
    hybrid_kv_cache: bool = Field(
        default=True, description="for a model with sliding-window layers, vLLM v1's hybrid "
        "KV cache manager: each kind of layer keeps its own block tables in the one pool, "
        "and sliding-window layers give back the blocks their window has passed; false: "
        "every layer keeps every token, as --disable-hybrid-kv-cache-manager")
    mamba_cache_mode: Literal["align", "all"] = Field(
        default="align", description="for a state-space hybrid's prefix cache, vLLM's "
        "--mamba-cache-mode: align keeps the states at block boundaries a step ends on, "
        "prefill chunks cut to end there; all keeps one at every block boundary, the Mamba-2 "
        "kernel writing them inside a chunk too, in blocks of whole chunks")

    @model_validator(mode="after")
    def _host_cache_finds_by_content(self):  # type: ignore[no-untyped-def]
        if self.host_cache_gib and not self.prefix_caching:
            raise ValueError("host_cache_gib needs prefix_caching: true (blocks are found by "
                             "their content)")
        return self


class VirtualConfig(ConfigModel):
    """Contiguous virtual memory backed by physical pages on demand (vAttention): each
    request's KV is contiguous in virtual address space, so attention reads it without a
    block table (no paging overhead), while physical memory is mapped a page at a time as it
    grows. A page backs one layer's K or V: with 2 MB pages it holds hundreds of tokens."""

    kind: Literal["virtual"]
    page_kib: int = Field(default=2048, ge=4, le=1 << 20, description="physical page size "
                          "in KiB: 2048 (CUDA's 2 MB), or 64, 128, 256 (vAttention's driver)")
    watermark: float = Field(default=0.01, ge=0, lt=1,
                             description="share of pages admission keeps free, as paged")


AllocatorConfig = Annotated[ContiguousConfig | PagedConfig | VirtualConfig,
                            Field(discriminator="kind")]


# SGLang's new-token ratio at its start, before --schedule-conservativeness scales it (its
# SGLANG_INIT_NEW_TOKEN_RATIO); the scheduler's NewTokenRatio follows its course.
NEW_TOKEN_RATIO_INIT = 0.7


class SchedulerConfig(ConfigModel):
    """Iteration-level continuous batching, the same for every allocator."""

    max_num_seqs: PositiveInt = 256
    max_num_batched_tokens: PositiveInt = 8192
    chunked_prefill: bool = False
    prefill_allocation: Literal["whole_prompt", "per_chunk"] = Field(
        default="whole_prompt", description="under chunked_prefill: claim memory for the whole "
        "prompt when a request is seated, so that its prefill never waits (vLLM v0), or only "
        "for the chunk each step computes (vLLM v1): more requests start, and a chunk that "
        "finds memory short preempts as a decode step does. Without chunked prefill a prompt "
        "is one chunk, and the two are the same")
    long_prefill_token_threshold: NonNegativeInt | None = Field(
        default=None, description="under chunked_prefill: the most prompt tokens one request "
        "reads in a step, as vLLM's --long-prefill-token-threshold: a long prompt is read in "
        "chunks of at most this many, leaving the rest of the step's budget to other "
        "prompts, so that one long prompt does not hold up the prompts behind it; absent or "
        "0 (vLLM's default): a request may take the whole budget")
    policy: Literal["fcfs", "priority", "shortest_predicted", "lpm", "dfs_weight",
                    "random", "lof"] = Field(
        default="fcfs", description="as vLLM's --scheduling-policy: first come, first served, "
        "or by each request's priority (lower first, then arrival): the waiting request with "
        "the best priority is seated first and the running one with the worst is preempted; "
        "or shortest_predicted: the waiting request with the fewest tokens the system's "
        "predictor expects it still to generate is seated first (shortest job first); or "
        "lpm, longest prefix match (SGLang's --schedule-policy lpm): the waiting request "
        "with the most prompt tokens in the prefix cache now is seated first, the line "
        "sorted stably each step with a seat to fill (first come, first served without a "
        "prefix cache); or dfs_weight (SGLang's dfs-weight): each step with a seat to fill, "
        "the line in the order of a depth-first walk down the prefix cache's tree, the "
        "branch with the most requests waiting first, so that the requests sharing a cached "
        "prefix are seated together (first come, first served without a prefix cache); or "
        "random (SGLang's): the line shuffled each step with a seat to fill, with draws "
        "seeded by the scenario's seed; or lof (SGLang's): the request that may generate "
        "most (its max_tokens) first, the line sorted stably each step with a seat to fill")
    max_lpm_queue_size: int | None = Field(
        default=None, ge=0, description="under lpm: a line longer than this is not ranked, as "
        "SGLang's past 128, the default (ranking looks up every request waiting): it keeps "
        "the order its last ranking left, arrivals behind; 0: always ranked")
    priority_preemption: bool = Field(
        default=False, description="under priority: a waiting request that finds no seat or "
        "memory preempts running requests of a worse priority to take theirs (vLLM v0); "
        "without it, as vLLM v1, it waits until memory runs short elsewhere")
    max_wait_s: float | None = Field(
        default=None, gt=0, description="under shortest_predicted: a request that has waited "
        "this long since it arrived is seated before shorter ones, the oldest first (aging, "
        "against the starvation of long requests)")
    aging_tokens_per_s: float | None = Field(
        default=None, gt=0, description="under shortest_predicted: each second a request has "
        "waited counts as this many predicted tokens fewer (linear aging: a long request "
        "moves up the line as it waits, however long the line)")
    preemption_victim: Literal["last_admitted", "fewest_generated"] = Field(
        default="last_admitted", description="under every policy but priority: which running "
        "request is preempted when memory runs short: the last seated (vLLM's), or the one "
        "that has generated the fewest tokens, the longest prompt among equals, then the "
        "last seated (SGLang's retraction order); priority always preempts the worst "
        "priority, latest arrival")
    preempted_rejoin: Literal["front", "back"] = Field(
        default="front", description="where a preempted request rejoins the waiting line: "
        "at its front, to be seated again first (vLLM's), or at its back, behind every "
        "request waiting (SGLang's retraction appends to its queue); a line ordered by a "
        "key (priority, predicted length) puts it in its place either way")
    preempted_cache: Literal["computed", "prompt"] = Field(
        default="computed", description="what a request preempted while decoding leaves in "
        "the prefix cache: every full block it computed, its answer's too (vLLM's blocks "
        "are cached as they fill), or its prompt's alone (SGLang's retraction frees the "
        "tokens it generated without putting them in its tree: seated again, it computes "
        "them again)")
    preemption_mode: Literal["recompute", "swap", "swap_groups"] = Field(
        default="recompute", description="as vLLM v0's: drop a victim's KV and recompute it "
        "when it is seated again (vLLM v1's only mode); swap: copy it to host memory and back "
        "over the host link (a victim that does not fit there is still recomputed; a group of "
        "forked samples goes whole, the blocks they share once); swap_groups: recompute a "
        "request of one sequence, swap a group of samples or beams (vLLM v0's default)")
    swap_space_gib: float = Field(default=4.0, gt=0, le=MAX_GIB, description="host memory per "
                                  "GPU for swapped KV, as vLLM's --swap-space")
    swap_copy_overhead_s: float = Field(
        default=5e-6, ge=0, description="seconds to issue one copy of a swap: vLLM v0 copies "
        "each block (page, contiguous extent) layer by layer, K and V apart, one "
        "cudaMemcpyAsync each (about 5-7 us a call, DualPath 2026); a swap takes as long as "
        "its bytes over the host link or its copies, whichever is longer; 0: bytes only")
    @property
    def swaps(self) -> bool:
        """Whether preemption swaps some victims to host memory (swap space is set aside)."""
        return self.preemption_mode != "recompute"

    parallel_sampling: Literal["fork", "fan_out"] = Field(
        default="fork", description="how a request of n samples (workload.sampling.n) runs: "
        "fork (vLLM v0, the PagedAttention paper), its samples seated, preempted and "
        "finished together, forks sharing the prompt's blocks, a shared partial block copied "
        "on write; or fan_out (vLLM v1), each sample a request of its own, seated, preempted "
        "and finished on its own, finding the prompt's full blocks through the prefix cache "
        "(each reads it without one); either way a request's row in the results is all its "
        "samples (from the first seated and first token to the last finish)")
    admission: Literal["memory", "new_token_ratio"] = Field(
        default="memory", description="when a waiting request is seated: memory, as soon as "
        "the memory its prompt (or first chunk) needs is free (vLLM: a running request that "
        "later finds none is preempted); new_token_ratio, SGLang's: only if memory is also "
        "left for the tokens the running requests may still generate, each reserving its "
        "max_tokens left (at most 4,096) times a ratio, and the newcomer its whole prompt "
        "and max_tokens; the ratio starts at 0.7 × schedule_conservativeness (at most 1), "
        "falls to 0.14 of that over 600 steps that read no prompt, jumps back after a "
        "preemption to what the survivors have generated (plus 20 steps each) over their "
        "max_tokens, and starts over when nothing runs; a newcomer refused so holds the "
        "line until memory is freed")
    schedule_conservativeness: float | None = Field(
        default=None, ge=0, le=100, description="under admission new_token_ratio: SGLang's "
        "--schedule-conservativeness, the factor on the ratio's start (1 by default; 0.3 "
        "seats more and preempts more, 1.43 and over reserves every max_tokens at first)")
    batching: Literal["mixed", "prefill_first"] = Field(
        default="mixed", description="what a step computes: mixed (vLLM's, and SGLang's "
        "--enable-mixed-chunk), the running requests' next tokens and, within the rest of "
        "the budget, prompts (or their chunks); prefill_first (SGLang's default), prompts "
        "alone whenever there are any to read (a prompt's next chunk, or a request the step "
        "seats), with the whole budget, while the running requests wait for the next step "
        "without one to decode: first tokens sooner, longer gaps between the next. Under "
        "disaggregation, a decode replica seats the requests handed over into its decode "
        "steps")
    max_queued_requests: PositiveInt | None = Field(
        default=None, description="a bounded waiting line, as SGLang's --max-queued-requests "
        "(Ray Serve's max_queued_requests, TGI's --max-concurrent-requests less the batch): a "
        "request that arrives when this many wait for a seat is turned away at once (503 or "
        "429, which a client's retry follows), counted as shed and missing every SLO; "
        "absent: the line is unbounded")

    @model_validator(mode="after")
    def _victim_under_priority(self):  # type: ignore[no-untyped-def]
        if self.policy == "priority" and self.preemption_victim != "last_admitted":
            raise ValueError("preemption_victim applies to policy fcfs only: under priority the "
                             "running request with the worst priority is preempted")
        if self.priority_preemption and self.policy != "priority":
            raise ValueError("priority_preemption needs policy: priority")
        for aging in ("max_wait_s", "aging_tokens_per_s"):
            if getattr(self, aging) is not None and self.policy != "shortest_predicted":
                raise ValueError(f"{aging} needs policy: shortest_predicted")
        if self.max_lpm_queue_size is not None and self.policy != "lpm":
            raise ValueError("max_lpm_queue_size needs policy: lpm")
        if self.schedule_conservativeness is not None and self.admission != "new_token_ratio":
            raise ValueError("schedule_conservativeness needs admission: new_token_ratio")
        if self.preempted_cache == "prompt" and self.preemption_mode != "recompute":
            raise ValueError("preempted_cache prompt needs preemption_mode: recompute (SGLang "
                             "retracts and computes again; a swapped request's KV comes back)")
        if self.long_prefill_token_threshold and not self.chunked_prefill:
            raise ValueError("long_prefill_token_threshold needs chunked_prefill: true (it "
                             "cuts prompts into chunks)")
        return self

    @property
    def prefill_chunk_tokens(self) -> int:
        """The most prompt tokens one request reads in a step under chunked prefill: the
        step's budget, or less under long_prefill_token_threshold."""
        return min(self.long_prefill_token_threshold or self.max_num_batched_tokens,
                   self.max_num_batched_tokens)


# [bs_lo, bs_hi, K] ranges (tuples, so that a configuration holding them stays hashable).
BatchSizeSchedule = tuple[tuple[PositiveInt, PositiveInt, NonNegativeInt], ...]


class SpeculativeConfig(ConfigModel):
    """Speculative decoding, as vLLM's ``--speculative-config``: each decode step verifies
    ``num_speculative_tokens`` drafted tokens after the request's last one and keeps the
    accepted ones, ``mean_acceptance_length`` tokens a step on average (vLLM logs it), bonus
    token included.

    The drafts' acceptance is not drawn per request: a replica's token clock reads ⌊s·τ⌋
    after s steps (τ the mean acceptance length as a fraction), and every request decoding
    there keeps what the clock moves on by, so that the lazy accounting stays exact and runs
    are deterministic. A step claims memory for
    its last token, the k drafts and, for a drafter model, k lookahead slots more (vLLM's
    ``num_lookahead_tokens``). An EAGLE or MTP drafter is ``draft_layers`` decoder layers of
    the target's shape, a draft model (``draft_model``) a model of its own: their weights and
    KV take memory and their k passes take time; n-gram drafting (prompt lookup) costs
    neither. An EAGLE head is dense even where its target is a mixture of experts (a Llama
    layer, its fc and its own lm_head): given ``draft_params``, or for a MoE target, it is a
    dense model of its own on the target's attention shape, so that its passes read the
    same weights whatever the batch, where a share of a MoE layer would read more experts
    the more tokens it drafts for. (An MTP module, DeepSeek-V3's, is a layer of the target's
    own kind, experts included.)

    ``num_speculative_tokens_per_batch_size`` makes it dynamic (vLLM's dynamic speculative
    decoding): after a step of B requests, the next verifies K(B) drafts, keeping τ(K) tokens
    (from ``acceptance_rate`` where K is not k), so that large batches, whose verify GEMMs
    are no longer free, may speculate less or not at all. Memory is still claimed for k
    drafts (vLLM sizes its lookahead and CUDA graphs for the most).
    """

    method: Literal["ngram", "eagle", "eagle3", "mtp", "draft_model"] = Field(
        description="ngram: drafts looked up in the prompt (no model, no KV, no lookahead); "
        "eagle / eagle3 / mtp: a head of the target's layers that runs k times a step; "
        "draft_model: a smaller model of the same tokenizer (draft_model), run k times a step")
    draft_model: str | ModelConfig | None = Field(
        default=None, description="method draft_model: the drafting model, a preset name or "
        "its shape (as the scenario's model)")
    num_speculative_tokens: int = Field(ge=1, le=64, description="k: drafts a step verifies")
    mean_acceptance_length: float | None = Field(
        default=None, ge=1, description="τ: tokens a decode step keeps for a request, the "
        "bonus token included (vLLM's 'Mean acceptance length'); 1 to k + 1")
    acceptance_rate: float | None = Field(
        default=None, ge=0, le=1, description="instead of mean_acceptance_length: the chance "
        "that each draft is accepted once those before it were (i.i.d.), which gives "
        "τ = (1 − α^(k+1)) / (1 − α)")
    draft_layers: int | None = Field(
        default=None, ge=0, le=16, description="decoder layers of the drafter, each the size "
        "of one of the target's (default: 1 for eagle, eagle3 and mtp; ngram has none, and a "
        "draft model its own)")
    draft_params: float | None = Field(
        default=None, gt=0, description="eagle / eagle3: parameters one pass of the head "
        "multiplies by (its layers, fc and own lm_head; not an embedding it shares with the "
        "target, as vLLM does): the head is then a dense model of its own, stored in the "
        "activations' dtype, on the target's attention shape, timed by its roofline. "
        "Default: a share of the target's layers, dense for a MoE target (a layer's share of "
        "the active parameters; real EAGLE-3 heads are often twice that)")
    draft_calibration: str | None = Field(
        default=None, description="method draft_model: a calibration file of the draft model "
        "(kvsim calibrate --model it; relative to the scenario) for its passes' times "
        "(default: its roofline)")
    num_speculative_tokens_per_batch_size: BatchSizeSchedule | Literal["auto"] | None = (
        Field(default=None, description="dynamic speculative decoding (vLLM's, as its config "
              "writes it): [[bs_lo, bs_hi, K], ...], K drafts a step after a step of bs_lo to "
              "bs_hi requests (K 0: none); ranges sorted, the first from 1, a gap or beyond "
              "the last keeps the K before it; K at most num_speculative_tokens. auto: for "
              "each batch size the K whose steps keep the most tokens a second in the "
              "step-time model (default: always k)"))

    @field_validator("num_speculative_tokens_per_batch_size", mode="before")
    @classmethod
    def _entries_of_three(cls, schedule: Any) -> Any:
        if not isinstance(schedule, list) and schedule not in ("auto", None):
            raise ValueError(f"expected auto or [[bs_lo, bs_hi, K], ...] (got {schedule!r})")
        for entry in schedule if isinstance(schedule, list) else ():
            if not isinstance(entry, list | tuple) or len(entry) != 3:
                raise ValueError(f"entry {entry!r}: expected [bs_lo, bs_hi, K] (vLLM's "
                                 "context-length form, five items, is not modelled)")
        return schedule

    @model_validator(mode="after")
    def _one_acceptance(self):  # type: ignore[no-untyped-def]
        given = [name for name in ("mean_acceptance_length", "acceptance_rate")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of mean_acceptance_length (tokens a step "
                             "keeps, as vLLM logs it) and acceptance_rate (per draft)")
        k = self.num_speculative_tokens
        if self.mean_acceptance_length is not None and self.mean_acceptance_length > k + 1:
            raise ValueError(f"mean_acceptance_length {self.mean_acceptance_length:g}: a step "
                             f"keeps at most num_speculative_tokens + 1 = {k + 1} tokens; "
                             f"expected 1 to {k + 1}")
        if self.method == "ngram" and self.draft_layers:
            raise ValueError("draft_layers: n-gram drafting uses no model; expected 0")
        if (self.method == "draft_model") != (self.draft_model is not None):
            raise ValueError("draft_model: give it with method draft_model, and only then "
                             "(the drafting model, e.g. llama-3.2-1b)")
        if self.draft_calibration is not None and self.method != "draft_model":
            raise ValueError("draft_calibration: the times of a draft model (method "
                             "draft_model); an EAGLE or MTP head takes its share of the "
                             "target's, from timing.calibration")
        if self.draft_params is not None and self.method not in ("eagle", "eagle3"):
            raise ValueError(f"draft_params: for an EAGLE head (method eagle or eagle3); "
                             f"{self.method} " + (
                                 "drafts with no model" if self.method == "ngram" else
                                 "takes the draft model's shape" if self.method == "draft_model"
                                 else "drafts with draft_layers of the target's own kind"))
        if self.draft_params is not None and self.draft_layers == 0:
            raise ValueError("draft_params: a head of no layers (draft_layers 0) has no "
                             "parameters to run; expected draft_layers of 1 or more")
        if self.method == "draft_model" and self.draft_layers is not None:
            raise ValueError("draft_layers: a draft model has its own layers (draft_layers is "
                             "for eagle, eagle3 and mtp)")
        if isinstance(self.draft_model, str) and self.draft_model.lower() not in MODEL_PRESETS:
            raise ValueError(f"draft_model: {unknown_preset(self.draft_model, MODEL_PRESETS)} "
                             "(or give the model's shape)")
        if self.draft_model is not None and _model_spec(self.draft_model).sliding_window:
            raise ValueError("draft_model: a draft model with sliding-window layers is not "
                             "modelled")
        self._check_batch_size_schedule()
        return self

    def _check_batch_size_schedule(self) -> None:
        schedule = self.num_speculative_tokens_per_batch_size
        if schedule is None or schedule == "auto":
            return
        field = "num_speculative_tokens_per_batch_size"
        if not schedule:
            raise ValueError(f"{field}: expected [[bs_lo, bs_hi, K], ...], got an empty list")
        end = 0
        for lo, hi, drafts in schedule:
            entry = f"[{lo}, {hi}, {drafts}]"
            if lo > hi:
                raise ValueError(f"{field}: {entry} ends before it starts; expected "
                                 "bs_lo <= bs_hi")
            if lo <= end:
                raise ValueError(f"{field}: {entry} starts at or before the end of the "
                                 f"range before it ({end}); expected sorted ranges that "
                                 "do not overlap")
            if drafts > self.num_speculative_tokens:
                raise ValueError(f"{field}: {entry} drafts more than num_speculative_tokens "
                                 f"= {self.num_speculative_tokens}; expected K 0 to "
                                 f"{self.num_speculative_tokens}")
            if (self.mean_acceptance_length is not None
                    and drafts not in (0, self.num_speculative_tokens)):
                raise ValueError(f"{field}: {entry}: mean_acceptance_length is for "
                                 f"{self.num_speculative_tokens} drafts; for K = {drafts} "
                                 "give acceptance_rate instead (per draft)")
            end = hi
        if schedule[0][0] != 1:
            raise ValueError(f"{field}: the first range starts at {schedule[0][0]}; expected 1, "
                             "so that every batch size has a K")

    def drafter_spec(self, target: ModelSpec) -> ModelSpec | None:
        """The drafter as a model of its own: the draft model's shape (method draft_model),
        or an EAGLE head's (given ``draft_params``, or of a MoE ``target``); None where the
        drafter is a share of the target's layers (or there is none)."""
        if self.draft_model is not None:
            return _model_spec(self.draft_model)
        layers = self.drafter_layers
        dense_head = self.method in ("eagle", "eagle3") and (
            self.draft_params is not None or target.is_moe)
        if not (layers and dense_head):
            return None
        # The target's attention, a dense MLP: every pass multiplies by all its parameters.
        params = self.draft_params or layers * target.flops_params / target.num_layers
        return ModelSpec(
            f"{self.method} head of {target.name}", layers, target.num_heads,
            target.num_kv_heads, target.head_dim, params, target.max_model_len,
            dtype_bytes=target.dtype_bytes, kv_dtype_bytes=target.kv_dtype_bytes,
            model_dim=target.model_dim, kv_latent_dim=target.kv_latent_dim)

    @property
    def tokens_per_step(self) -> Fraction:
        """τ as an exact fraction (of denominator at most 1,000), the rate of the token
        clock the scheduler advances decoding requests by."""
        return self.tokens_per_step_with(self.num_speculative_tokens)

    def tokens_per_step_with(self, drafts: int) -> Fraction:
        """τ of a step that verifies ``drafts`` drafts (1 for none), as :attr:`tokens_per_step`
        (for fewer than k drafts, from the acceptance rate)."""
        if not drafts:
            return Fraction(1)
        if self.mean_acceptance_length is not None:
            assert drafts == self.num_speculative_tokens, "checked at validation"
            tau = self.mean_acceptance_length
        else:
            alpha = self.acceptance_rate or 0.0
            tau = float(drafts + 1) if alpha == 1 else (
                1 - alpha ** (drafts + 1)) / (1 - alpha)
        return min(max(Fraction(tau).limit_denominator(1000), Fraction(1)),
                   Fraction(drafts + 1))

    def drafts_after(self, batch_size: int) -> int:
        """K: drafts a step verifies after a step of ``batch_size`` requests (vLLM proposes
        a step's drafts by the size of that step's batch)."""
        schedule = self.num_speculative_tokens_per_batch_size
        if schedule is None:
            return self.num_speculative_tokens
        assert schedule != "auto", "the engine chooses an auto schedule first"
        index = bisect.bisect_right([lo for lo, _, _ in schedule], max(batch_size, 1)) - 1
        return schedule[index][2]

    @property
    def draft_counts(self) -> list[int]:
        """Every K a step may verify, ascending (for ``auto``, every K it may choose: 0 to k
        from an acceptance rate, 0 or k from a mean acceptance length)."""
        schedule = self.num_speculative_tokens_per_batch_size
        k = self.num_speculative_tokens
        if schedule is None:
            return [k]
        if schedule == "auto":
            return [0, k] if self.mean_acceptance_length is not None else list(range(k + 1))
        return sorted({drafts for _, _, drafts in schedule})

    def with_schedule(self, schedule: list[tuple[int, int, int]]) -> SpeculativeConfig:
        """This configuration with K by batch size as ``schedule`` (an auto one, chosen)."""
        return self.model_copy(update={"num_speculative_tokens_per_batch_size": tuple(
            tuple(entry) for entry in schedule)})

    @property
    def lookahead_slots(self) -> int:
        """Slots claimed past the drafts (vLLM's num_lookahead_tokens: k for a drafter model
        that writes its drafts' KV, 0 for n-gram lookup)."""
        return 0 if self.method == "ngram" else self.num_speculative_tokens

    @property
    def drafter_layers(self) -> int:
        """Decoder layers of an EAGLE or MTP drafter, of the target's shape (0: n-gram
        lookup, or a draft model, which has its own)."""
        if self.draft_layers is not None:
            return self.draft_layers
        return 1 if self.method in ("eagle", "eagle3", "mtp") else 0


class SystemConfig(ConfigModel):
    """One system to compare: a name, an allocator and scheduler settings."""

    name: str = Field(min_length=1)
    allocator: AllocatorConfig
    scheduler: SchedulerConfig = SchedulerConfig()
    predictor: PredictorConfig | None = Field(
        default=None, description="the output-length predictor reserve_policy predicted and "
        "scheduler.policy shortest_predicted consult (default: source model, sigma 0.5)")
    speculative: SpeculativeConfig | None = Field(
        default=None, description="speculative decoding (default: none, a token a step)")

    @model_validator(mode="after")
    def _predictor_is_consulted(self):  # type: ignore[no-untyped-def]
        if self.predictor is not None and not self.uses_predictor:
            raise ValueError("predictor: nothing in this system consults it (set "
                             "allocator.reserve_policy: predicted or scheduler.policy: "
                             "shortest_predicted)")
        return self

    @model_validator(mode="after")
    def _chunks_hold_a_decode_step(self):  # type: ignore[no-untyped-def]
        threshold = self.scheduler.long_prefill_token_threshold
        step = 1 + (self.speculative.num_speculative_tokens if self.speculative else 0)
        if threshold and threshold < step:
            raise ValueError(f"scheduler.long_prefill_token_threshold: {threshold} is fewer "
                             f"than the {step} tokens a decode step reads for a request (its "
                             f"last token and {step - 1} drafts), which vLLM's cap would cut; "
                             f"give at least {step}")
        return self

    @property
    def uses_predictor(self) -> bool:
        """Whether the allocator or the scheduler consults a length predictor."""
        return (self.predicts_reservations
                or self.scheduler.policy == "shortest_predicted")

    @property
    def predicts_reservations(self) -> bool:
        """Whether contiguous extents are sized by the predictor."""
        return getattr(self.allocator, "reserve_policy", None) == "predicted"

    @property
    def length_predictor(self) -> PredictorConfig:
        """The predictor, with its defaults where the scenario gives none."""
        return self.predictor or PredictorConfig()


class StopConfig(ConfigModel):
    """When to stop: after ``num_requests`` requests, or arrivals up to ``duration_s``
    (in-flight requests always run to completion); neither, at a trace file's end (a
    synthetic workload has none, see :meth:`Scenario._synthetic_stops`)."""

    num_requests: PositiveInt | None = Field(default=None, le=MAX_REQUESTS)
    duration_s: PositiveFloat | None = None

    @property
    def open_ended(self) -> bool:
        """Whether nothing bounds the requests but the workload's own end."""
        return self.num_requests is None and self.duration_s is None


class TimingConfig(ConfigModel):
    """Step-time model: the GPU roofline unless a ``calibration`` file (relative to the
    scenario) is given; ``paged_alpha`` sets ρ(bs) = 1 + alpha/bs without calibration."""

    calibration: str | None = None
    step_overhead_s: float = Field(default=1.0e-3, ge=0)
    paged_alpha: float = Field(default=2.0, ge=0)


class CostConfig(ConfigModel):
    """What the GPUs cost, to put a price on the tokens they serve: every GPU of every
    replica is paid for the whole run, busy or not."""

    usd_per_gpu_hour: PositiveFloat = Field(
        description="the price of one GPU for an hour (cloud list or amortised), in USD")


class RouterConfig(ConfigModel):
    """Which replica serves each new request (a session's later turns stay with its first).
    ``vllm_dp`` is vLLM's balancer of its data-parallel ranks until July 2026: the replica of
    the lowest 4 × waiting (taken in, not yet seated, or preempted) + running requests, as
    its coordinator last published them, each front end adding what it sent since.
    ``vllm_dp_2026`` is its balancer since: the lowest waiting + running, never under the
    requests the front end has in flight there (× front_ends), plus, while any wait, waiting
    × 6 × how far the replica's KV cache usage is over a half, its scan for the lowest
    starting one replica further at each route. ``cache_aware`` is
    SGLang's router: the replica holding the longest prefix of the prompt when that is over
    ``cache_threshold`` of it, else the one caching least; the least loaded whenever loads
    differ by more than ``balance_abs_threshold`` requests and ``balance_rel_threshold``
    times. ``kv_aware`` is NVIDIA Dynamo's KV router: the replica with the lowest cost,
    ``overlap_score_weight`` × the prompt tokens it would compute (its queue's and this
    prompt's, less what its cache holds) + the prompt tokens it would then hold in flight,
    or one drawn by ``temperature``; it believes a replica caches what it sent there within
    the last ``ttl_s``, or, with ``kv_events``, knows what it caches. Every router but round
    robin learns what the replicas report every ``stats_interval_s`` (round robin heeds
    none of it, so that a sweep may set it for every policy)."""

    policy: Literal["round_robin", "least_loaded", "vllm_dp", "vllm_dp_2026", "cache_aware",
                    "kv_aware"] = "round_robin"
    cache_threshold: float = Field(default=0.5, ge=0, le=1)
    balance_abs_threshold: int = Field(default=32, ge=0)
    balance_rel_threshold: float = Field(default=1.0001, ge=1)
    # The kv_aware settings are null by default (meaning Dynamo's defaults), so that
    # scenarios without them keep their keys.
    overlap_score_weight: float | None = Field(
        default=None, ge=0, description="kv_aware: the weight of the prompt tokens a replica "
        "would compute against those it holds in flight (higher: follow the cache; 0: "
        "balance load alone); 1 when omitted, as Dynamo")
    track_prefill_tokens: bool | None = Field(
        default=None, description="kv_aware: count the prompt tokens a replica has yet to "
        "prefill (sent there, first token not out yet) in what it would compute, as Dynamo's "
        "--router-track-prefill-tokens; true when omitted, as Dynamo")
    temperature: float | None = Field(
        default=None, ge=0, description="kv_aware: draw the replica at random, with "
        "probabilities a softmax of minus the costs scaled to [0, 1] over this temperature "
        "(Dynamo's --router-temperature; seeded by the scenario's seed); 0 when omitted: "
        "the cheapest")
    ttl_s: PositiveFloat | None = Field(
        default=None, description="kv_aware: how long the router believes a prefix it sent "
        "to a replica stays cached there (Dynamo's --router-ttl-secs, its mode without KV "
        "events); 120 when omitted, as Dynamo")
    kv_events: bool | None = Field(
        default=None, description="kv_aware: the router knows which prompt blocks each "
        "replica's GPU cache holds, from the KV events its engine publishes (blocks stored "
        "and removed, as vLLM sends them to Dynamo's router, Dynamo's default mode), instead "
        "of believing what it sent for ttl_s; false when omitted")
    stats_interval_s: float | None = Field(
        default=None, ge=0, description="how often what the replicas report (intakes, "
        "seatings, first tokens, finishes, KV events) reaches the router: each fact at the next "
        "multiple of this interval, while what it sends it counts at once (vLLM's balancers: "
        "until the next publication); when omitted 0.1 for vllm_dp "
        "and vllm_dp_2026 (vLLM's DP coordinator publishes its ranks' counts every 100 ms), "
        "else 0 (a router in the request path sees each answer end as it happens)")
    front_ends: PositiveInt = Field(
        default=1, le=1024, description="vllm_dp, vllm_dp_2026: front ends balancing at "
        "once (vLLM's --api-server-count), each request reaching one drawn at random: each "
        "knows what the others sent only from the coordinator's publications, counts what it "
        "sent since front_ends times, and starts its scan for the least loaded replica at its "
        "own share of them")

    @model_validator(mode="after")
    def _settings_for_their_policy(self):  # type: ignore[no-untyped-def]
        if self.front_ends > 1 and self.policy not in ("vllm_dp", "vllm_dp_2026"):
            raise ValueError(f"front_ends is for policies vllm_dp and vllm_dp_2026 (vLLM's "
                             f"API servers), not {self.policy}")
        if self.policy != "kv_aware":
            for name in ("overlap_score_weight", "track_prefill_tokens", "temperature",
                         "ttl_s", "kv_events"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is for policy kv_aware, not {self.policy}")
        if self.kv_events and self.ttl_s is not None:
            raise ValueError("ttl_s is how long a router without kv_events believes a prefix "
                             "stays cached; with kv_events it knows: give one or the other")
        return self

    @property
    def overlap_weight(self) -> float:
        """The weight ``kv_aware`` uses: ``overlap_score_weight``, or Dynamo's 1 if omitted."""
        return 1.0 if self.overlap_score_weight is None else self.overlap_score_weight

    @property
    def tracks_prefill(self) -> bool:
        """Whether ``kv_aware`` counts the prompts queued on a replica (Dynamo's default)."""
        return self.track_prefill_tokens is not False

    @property
    def sampling_temperature(self) -> float:
        """The temperature ``kv_aware`` draws with: 0 (the cheapest) if omitted."""
        return self.temperature or 0.0

    @property
    def prefix_ttl_s(self) -> float:
        """How long ``kv_aware`` believes a prefix it sent stays cached: Dynamo's 120 s if
        omitted."""
        return DYNAMO_TTL_S if self.ttl_s is None else self.ttl_s

    @property
    def report_interval_s(self) -> float:
        """How often the replicas' reports reach the router: ``stats_interval_s``, or if
        omitted vLLM's 100 ms for its balancers and at once (0) for the others."""
        if self.stats_interval_s is not None:
            return self.stats_interval_s
        return (VLLM_DP_STATS_INTERVAL_S if self.policy in ("vllm_dp", "vllm_dp_2026")
                else 0.0)


class SloConfig(ConfigModel):
    """Service-level objectives: a request is served *in time* when its TTFT, its TPOT
    (mean time between output tokens), its end-to-end latency and its longest wait between
    two tokens (``max_itl_s``: a preemption's stall, a handover's) are within the bounds
    given (an absent bound always holds; a request with one output token has no gap to
    miss).
    ``attainment`` is the share of requests that must be in time for a load to count as
    sustained: DistServe's 90 % by default (``kvsim capacity`` searches for that load).
    Judged by ``percentiles`` instead, each bound holds on its own for that share: MLPerf's
    "p99 TTFT ≤ 2 s and p99 TPOT ≤ 200 ms" is attainment 0.99 of that kind. With
    ``priorities``, only requests of those levels are judged (and count in the goodput)."""

    ttft_s: PositiveFloat | None = None
    tpot_s: PositiveFloat | None = None
    e2e_s: PositiveFloat | None = None
    max_itl_s: PositiveFloat | None = Field(
        default=None, description="bound on each request's longest wait between two of its "
        "tokens (seconds): a streaming client's stall")
    attainment: float = Field(default=0.9, gt=0, le=1)
    judge: Literal["requests", "percentiles"] = Field(
        default="requests", description="requests: the attainment share meets every bound at "
        "once (DistServe); percentiles: each bound alone (MLPerf's p99 TTFT and TPOT)")
    priorities: list[int] | None = Field(
        default=None, min_length=1, description="judge only the requests of these priority "
        "levels (workload.priorities), the others being best effort; all when omitted")

    @model_validator(mode="after")
    def _some_bound(self):  # type: ignore[no-untyped-def]
        if (self.ttft_s, self.tpot_s, self.e2e_s, self.max_itl_s) == (None,) * 4:
            raise ValueError("give at least one of ttft_s, tpot_s, e2e_s, max_itl_s "
                             "(seconds)")
        return self


class DisaggregationConfig(ConfigModel):
    """Prefill/decode disaggregation (DistServe, Splitwise, Mooncake): the first
    ``prefill_replicas`` replicas (all their data-parallel ranks) only read prompts and give
    each request its first token; its KV then travels to a decode replica's rank
    (``kv_transfer_gbps`` per GPU, one direction, plus ``kv_transfer_latency_s``), which
    generates the rest."""

    prefill_replicas: int = Field(gt=0, le=MAX_REPLICAS)
    kv_transfer_gbps: GpuRate = Field(
        default=25.0, description="GB/s per GPU between prefill and decode replicas (one "
        "200 Gb/s RDMA NIC per GPU: 25)")
    kv_transfer_latency_s: float = Field(default=1e-3, ge=0,
                                         description="fixed cost of one request's transfer")
    kv_transfer: Literal["after_prefill", "layerwise"] = Field(
        default="after_prefill", description="after_prefill: a request's KV leaves once its "
        "prefill step ends (vLLM's P/D connectors); layerwise: each layer's KV leaves as soon "
        "as that layer is computed (DistServe, Mooncake), so a step's computation C and the "
        "transfer T end after max(C, T) + min(C, T) / layers")
    decode_router: Literal["round_robin", "least_loaded"] = Field(
        default="round_robin", description="which decode replica takes a request: in turn by "
        "its index, or the one with the fewest requests in flight (handed over and not yet "
        "finished), as Splitwise's join-the-shortest-queue")
    prefill_parallel: ParallelConfig | None = Field(
        default=None, description="how each prefill replica spreads over GPUs, where it "
        "differs from the decode replicas' (the scenario's parallel), e.g. tensor "
        "parallelism to read prompts fast and data-parallel ranks to hold many decodes")


class EngineConfig(ConfigModel):
    """How the simulation runs: replicas and their router change results; ``mode`` does not
    (jump and step give identical request tables), nor the sampling and checks."""

    mode: Literal["jump", "step"] = "jump"
    replicas: int = Field(default=1, gt=0, le=MAX_REPLICAS)
    router: RouterConfig = RouterConfig()
    disaggregation: DisaggregationConfig | None = None
    sample_interval_s: float = Field(default=0.0, ge=0,
                                     description="0 = one memory sample per scheduling point")
    debug_invariants: bool = False

    @model_validator(mode="after")
    def _a_decode_replica_left(self):  # type: ignore[no-untyped-def]
        split = self.disaggregation
        if split is not None and split.prefill_replicas >= self.replicas:
            raise ValueError(f"disaggregation.prefill_replicas ({split.prefill_replicas}) "
                             f"must leave decode replicas among engine.replicas "
                             f"({self.replicas})")
        return self


def uses_hybrid_kv_cache(model: ModelSpec, system: SystemConfig) -> bool:
    """Whether the system keeps a sliding-window or state-space model's layers in groups of
    block tables (vLLM v1's hybrid KV cache manager) rather than every layer's every
    token."""
    cfg = system.allocator
    return isinstance(cfg, PagedConfig) and bool(
        (model.sliding_window and cfg.hybrid_kv_cache) or model.has_state_layers)


def parallel_problem(value: ParallelConfig, model: ModelSpec,
                     gpu: str | GpuConfig | None) -> str | None:
    """What is wrong with spreading ``model`` over GPUs as ``value`` says (None: nothing; a
    ``gpu`` of None is not checked, as one already refused)."""
    pp = value.pipeline_parallel_size
    if pp > model.num_layers:
        return (f"pipeline_parallel_size {pp}: {model.name} has {model.num_layers} layers, "
                "fewer than the stages")
    if pp > 1 and value.data_parallel_size > 1:
        return (f"pipeline_parallel_size {pp} with data_parallel_size "
                f"{value.data_parallel_size}: pipeline stages of data-parallel ranks are not "
                "modelled")
    if pp > 1 and isinstance(gpu, GpuConfig) and (
            value.pipeline_link_gbps is None and gpu.interconnect_gbps is None):
        return (f"pipeline_parallel_size {pp}: sending activations from stage to stage "
                "needs pipeline_link_gbps or gpu.interconnect_gbps (GB/s, one direction)")
    tp, gpus = value.tensor_parallel_size, value.stage_gpus  # (a stage's)
    if gpus == 1 and not value.expert_parallel:
        return None  # nothing to split within a stage
    if (value.data_parallel_size > 1 or value.expert_parallel) and not model.is_moe:
        what = ("expert_parallel" if value.data_parallel_size == 1
                else f"data_parallel_size {value.data_parallel_size}")
        return (f"{what}: {model.name} is dense, it has no experts to spread over GPUs "
                "(ranks of a dense model share nothing: engine.replicas runs independent "
                "engines)")
    if value.expert_load_imbalance > gpus:
        return (f"expert_load_imbalance {value.expert_load_imbalance:g}: the busiest GPU "
                f"holds at most all the routed tokens, {gpus} times the mean over {gpus} GPUs")
    if gpus == 1 or gpu is None:
        return None
    problem = model.tensor_parallel_problem(tp)
    if problem:
        return f"tensor_parallel_size {tp}: {problem}"
    split = (f"tensor_parallel_size {tp}" if gpus == tp else
             f"data_parallel_size {value.data_parallel_size} × tensor_parallel_size {tp}")
    if isinstance(gpu, GpuConfig):
        if gpu.interconnect_gbps is None:
            needs = "all-reduces" if gpus == tp else "all-reduces and expert dispatches"
            return (f"{split}: the {needs} need gpu.interconnect_gbps (GPU-to-GPU GB/s, one "
                    "direction)")
        return None
    preset = GPU_PRESETS[gpu.lower()]
    joined, domain = preset.interconnect_gpus, preset.link_domain
    if joined is not None and gpus > joined:
        return (f"{split}: {preset.interconnect_kind} joins {joined} {gpu} GPUs (one "
                f"{domain}) and the simulator models no network between {domain}s within a "
                f"layer; use at most {joined} GPUs a pipeline stage "
                f"(parallel.pipeline_parallel_size spreads stages over {domain}s), or "
                "engine.replicas for more GPUs, or give gpu explicitly with the "
                "interconnect_gbps you have")
    return None


class Scenario(ConfigModel):
    """One experiment: the same trace replayed against every system."""

    name: str = Field(min_length=1)
    description: str = ""
    model: str | ModelConfig = "llama-2-7b"
    max_model_len: int | None = Field(
        default=None, ge=2, description="the context limit, as vLLM's --max-model-len: the "
        "most tokens (prompt and output) a request may reach, and what a contiguous "
        "max_model_len reservation reserves; at most the model's context (the default)")
    gpu: str | GpuConfig = "a100-80g"
    memory: MemoryConfig = MemoryConfig()
    parallel: ParallelConfig = ParallelConfig()
    workload: Workload
    systems: list[SystemConfig] = Field(min_length=1)
    stop: StopConfig = StopConfig()
    seed: int = Field(default=0, ge=0)
    timing: TimingConfig = TimingConfig()
    engine: EngineConfig = EngineConfig()
    slo: SloConfig | None = None
    cost: CostConfig | None = None
    output_dir: str | None = None
    sweep: dict[str, Any] | None = Field(
        default=None, description="grid/zip/seeds for kvsim sweep (see sim/sweep.py)")

    @field_validator("model", "gpu")
    @classmethod
    def _known_preset(cls, value: Any, info: ValidationInfo) -> Any:
        presets, explicit = ((MODEL_PRESETS, "the model's shape") if info.field_name == "model"
                             else (GPU_PRESETS, "the GPU's figures"))
        if isinstance(value, str) and value.lower() not in presets:
            raise ValueError(f"{unknown_preset(value, presets)} (or give {explicit})")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _no_stop(cls, value: Any) -> Any:
        return {} if value is None else value  # ("stop:" left empty: none, as if not given)

    @field_validator("parallel")
    @classmethod
    def _splits_evenly(cls, value: ParallelConfig, info: ValidationInfo) -> ParallelConfig:
        if "model" not in info.data:
            return value  # the model already refused
        problem = parallel_problem(value, _model_spec(info.data["model"]), info.data.get("gpu"))
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("max_model_len")
    @classmethod
    def _within_the_models_context(cls, value: int | None, info: ValidationInfo
                                   ) -> int | None:
        if value is None or "model" not in info.data:
            return value  # the model's own, or the model already refused
        model = _model_spec(info.data["model"])
        if value > model.max_model_len:
            raise ValueError(f"{value:,} exceeds {model.name}'s context of "
                             f"{model.max_model_len:,} tokens; expected at most that (vLLM "
                             "refuses a longer --max-model-len too)")
        return value

    @model_validator(mode="after")
    def _shared_prefixes_fit_the_context(self):  # type: ignore[no-untyped-def]
        if isinstance(self.workload, SyntheticWorkload):
            problem = self.workload.context_problem(self.model_spec().max_model_len)
            if problem:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _retry_follows_a_failure(self):  # type: ignore[no-untyped-def]
        workload = self.workload
        if workload.retry is None or clients_time_out(workload) or any(
                s.scheduler.max_queued_requests is not None for s in self.systems):
            return self
        raise ValueError("workload.retry: a client retries a request it gave up on or that was "
                         "turned away; give workload.queue_timeout_s, ttft_timeout_s, "
                         "e2e_timeout_s or itl_timeout_s (how long it waits before giving "
                         "up), or a system's "
                         "scheduler.max_queued_requests (a full line turns requests away)")

    @model_validator(mode="after")
    def _disaggregation_has_one_sample(self):  # type: ignore[no-untyped-def]
        if self.engine.disaggregation is not None and self.workload.sampling.forks > 1 and any(
                s.scheduler.parallel_sampling == "fork" for s in self.systems):
            raise ValueError("engine.disaggregation: one sample per request (workload."
                             "sampling n and beam_width 1), or samples that are requests of "
                             "their own (every system's scheduler.parallel_sampling: "
                             "fan_out); forks across a prefill/decode split are not modelled")
        return self

    @model_validator(mode="after")
    def _synthetic_stops(self):  # type: ignore[no-untyped-def]
        workload = self.workload
        if not isinstance(workload, SyntheticWorkload):
            return self
        if workload.arrival.process == "closed_loop" and self.stop.num_requests is None:
            raise ValueError("stop.num_requests: a closed_loop workload needs it (its users "
                             "send requests for ever, each after the last is answered)")
        if not self.stop.open_ended:
            return self
        raise ValueError("stop: give num_requests, duration_s or both (a synthetic workload "
                         "draws requests for ever; a trace file's workload stops at its end)")

    @model_validator(mode="after")
    def _forks_are_few_enough(self):  # type: ignore[no-untyped-def]
        sampling = self.workload.sampling
        forked = [s.name for s in self.systems if s.scheduler.parallel_sampling == "fork"]
        if sampling.forks <= MAX_SAMPLES or not forked:
            return self
        if sampling.beam_width > MAX_SAMPLES:
            raise ValueError(f"workload.sampling.beam_width: at most {MAX_SAMPLES} beams (got "
                             f"{sampling.beam_width})")
        raise ValueError(f"workload.sampling.n: at most {MAX_SAMPLES} samples of one request "
                         f"run together (got {sampling.n}, forked by system {forked[0]!r}); "
                         "scheduler.parallel_sampling: fan_out runs more, each a request of "
                         "its own")

    @model_validator(mode="after")
    def _samples_fanned_out(self):  # type: ignore[no-untyped-def]
        fanned = [s.name for s in self.systems if s.scheduler.parallel_sampling == "fan_out"]
        if not fanned:
            return self
        where = f"system {fanned[0]!r}: scheduler.parallel_sampling: fan_out"
        workload = self.workload
        if workload.sampling.beam_width > 1:
            raise ValueError(f"{where} makes each of n samples a request of its own; beam "
                             "search (workload.sampling.beam_width) keeps its beams together")
        if isinstance(workload, SyntheticWorkload) and workload.sampling.n > 1 and (
                workload.sessions is not None or workload.arrival.process == "closed_loop"):
            raise ValueError(f"{where} makes each of n samples a request of its own; a "
                             "session's next turn (a closed-loop user's next request) follows "
                             "one request, and which of its samples is unknown")
        unmodelled = self.fanned_out_samples_unmodelled()
        if unmodelled and workload.sampling.n > 1:  # a trace's own n: told when it is read
            raise ValueError(f"{where} (workload.sampling.n: {workload.sampling.n}): "
                             f"{unmodelled}")
        return self

    def fanned_out_samples_unmodelled(self) -> str | None:
        """What of this scenario is not modelled where the samples of one request run as
        requests of their own (``parallel_sampling: fan_out``), in words; None if nothing."""
        # A whole answer's deadline is every sample's: they are given up together; a seat,
        # a first token or a next token is any sample's, a full line turns them away
        # together, and a client who tries again sends them all again, those done in time
        # too, as long as they share an engine (and its line: no pipeline stages).
        workload = self.workload
        routed = self.prefill_ranks or self.ranks
        policy = self.engine.router.policy
        spread = routed > 1 and policy in ("vllm_dp", "vllm_dp_2026")
        ranks_apart = "where vLLM's balancer places each sample on a data-parallel rank of its own"
        waits_for_first = (workload.queue_timeout_s, workload.ttft_timeout_s) != (None, None)
        bounded = any(s.scheduler.max_queued_requests is not None for s in self.systems)
        if spread and (waits_for_first or bounded):
            what = ("a client's wait for a seat or a first token (queue_timeout_s, "
                    "ttft_timeout_s)" if waits_for_first
                    else "a bounded line (scheduler.max_queued_requests)")
            return (f"not modelled with {what} {ranks_apart} (engine.router.policy "
                    f"{policy}): the client waits for, or is turned away with, its samples "
                    "together, which ranks stepping apart do not know")
        if spread and workload.retry is not None and workload.e2e_timeout_s is not None:
            return ("not modelled with retries of answers given up (workload.retry with "
                    f"e2e_timeout_s) {ranks_apart} (engine.router.policy {policy}): the "
                    "client sends every sample again together, which ranks stepping apart "
                    "do not know")
        if workload.itl_timeout_s is not None and (
                spread or self.engine.disaggregation is not None
                or self.parallel.pipeline_parallel_size > 1):
            where = (ranks_apart if spread else "across a prefill/decode split"
                     if self.engine.disaggregation is not None else "with pipeline stages")
            return (f"not modelled with a client's wait for a next token (itl_timeout_s) "
                    f"{where}: the client waits for one of any sample, and gives up on all "
                    "at once, which engines stepping apart do not know")
        return None

    @model_validator(mode="before")
    @classmethod
    def _state_keeps_no_prefix_cache(cls, data: Any) -> Any:
        """A state-space model's paged systems keep no prefix cache unless told otherwise,
        as vLLM leaves it off for them (its caching of states is experimental)."""
        if not isinstance(data, dict) or not isinstance(data.get("systems"), list):
            return data
        model = data.get("model", "llama-2-7b")
        if isinstance(model, str):
            preset = MODEL_PRESETS.get(model.lower())
            stateful = preset is not None and preset.has_state_layers
        elif isinstance(model, dict):
            stateful = bool(model.get("num_state_layers"))
        else:
            stateful = isinstance(model, ModelConfig) and bool(model.num_state_layers)
        if not stateful:
            return data
        systems = []
        for system in data["systems"]:
            allocator = system.get("allocator") if isinstance(system, dict) else None
            if (isinstance(allocator, dict) and allocator.get("kind") == "paged"
                    and "prefix_caching" not in allocator):
                system = {**system, "allocator": {**allocator, "prefix_caching": False}}
            systems.append(system)
        return {**data, "systems": systems}

    @model_validator(mode="after")
    def _state_space_limits(self):  # type: ignore[no-untyped-def]
        model = _model_spec(self.model)
        if not model.has_state_layers:
            return self
        if self.parallel.pipeline_parallel_size > 1:
            raise ValueError(f"parallel.pipeline_parallel_size: pipeline stages are not "
                             f"modelled for {model.name}'s state-space layers")
        if self.engine.disaggregation is not None:
            raise ValueError(f"engine.disaggregation: sending {model.name}'s state-space "
                             "layers' state from prefill to decode replicas is not modelled")
        if self.engine.router.kv_events:
            raise ValueError(f"engine.router.kv_events: KV events of a cache that keeps "
                             f"{model.name}'s state-space layers' states are not modelled")
        # Allocator fields a state-space model cannot take: when, and why.
        unmodelled = {
            "hybrid_kv_cache": (lambda a: isinstance(a, PagedConfig) and not a.hybrid_kv_cache,
                                "state-space layers need the hybrid KV cache manager (vLLM "
                                "has no other for them): leave it out or set it true"),
            "kind": (lambda a: isinstance(a, VirtualConfig),
                     "virtual memory (vAttention) for state-space layers is not modelled: "
                     "use paged or contiguous"),
            "host_cache_gib": (lambda a: isinstance(a, PagedConfig) and bool(a.host_cache_gib),
                               "a host tier of a cache that keeps states is not modelled: "
                               "leave it out"),
        }
        for system in self.systems:
            for field, (used, why) in unmodelled.items():
                if used(system.allocator):
                    raise ValueError(f"systems[{system.name}].allocator.{field}: {model.name} "
                                     f"has state-space layers; {why}")
            if isinstance(system.allocator, PagedConfig) and system.allocator.prefix_caching:
                # vLLM's mamba cache modes: it asserts chunked prefill, whose chunks align
                # ends on block boundaries.
                if not system.scheduler.chunked_prefill:
                    raise ValueError(f"systems[{system.name}].allocator.prefix_caching: a "
                                     f"prefix cache of {model.name}'s states needs "
                                     "scheduler.chunked_prefill: true (vLLM's mamba cache "
                                     "modes chunk prefills)")
                if system.allocator.mamba_cache_mode == "all" and not model.state_chunk_size:
                    raise ValueError(f"systems[{system.name}].allocator.mamba_cache_mode: all "
                                     f"needs the Mamba-2 chunk of {model.name}'s state-space "
                                     "layers (model.state_chunk_size), and vLLM refuses it "
                                     "for its Gated DeltaNet models (Qwen3-Next, Qwen3.5): "
                                     "use align")
                if system.speculative is not None:
                    raise ValueError(f"systems[{system.name}].allocator.prefix_caching: a "
                                     f"prefix cache of {model.name}'s states under "
                                     "speculative decoding is not modelled; set it false or "
                                     "drop speculative")
            if system.speculative is not None and system.speculative.draft_model is not None:
                raise ValueError(f"systems[{system.name}].speculative.draft_model: a draft "
                                 f"model of its own beside {model.name}'s state-space layers "
                                 "is not modelled; use method mtp (its own MTP layer), "
                                 "eagle, eagle3 or ngram")
            if system.scheduler.swaps:
                raise ValueError(f"systems[{system.name}].scheduler.preemption_mode: swapping "
                                 f"{model.name}'s state out is not modelled; use recompute")
        return self

    @model_validator(mode="after")
    def _hybrid_kv_cache_limits(self):  # type: ignore[no-untyped-def]
        model = _model_spec(self.model)
        if not model.sliding_window:
            return self
        unmodelled = {
            "a host tier (allocator.host_cache_gib)": lambda s: s.allocator.host_cache_gib,
            "preemption by swap (scheduler.preemption_mode)": lambda s: s.scheduler.swaps,
            "engine.router.kv_events": lambda s: bool(self.engine.router.kv_events),
        }
        for system in self.systems:
            if isinstance(system.allocator, PagedConfig) and system.allocator.hybrid_kv_cache:
                for what, used in unmodelled.items():
                    if used(system):
                        raise ValueError(
                            f"system {system.name!r}: {what} is not modelled with the hybrid "
                            f"KV cache manager that {model.name}'s sliding-window layers "
                            "use; set allocator.hybrid_kv_cache: false (every layer keeps "
                            "every token)")
        return self

    @model_validator(mode="after")
    def _sglang_scheduling_where_modelled(self):  # type: ignore[no-untyped-def]
        """SGLang's admission reserves blocks and its retraction forgets cached ones: each
        needs a paged pool outside the hybrid manager (the retraction, a prefix cache)."""
        model = _model_spec(self.model)
        hybrid_manager = (f"the hybrid KV cache manager that {model.name}'s "
                          f"{'state-space' if model.has_state_layers else 'sliding-window'} "
                          "layers use")
        for system in self.systems:
            allocator = system.allocator
            hybrid = uses_hybrid_kv_cache(model, system)
            refused = []  # (the setting, why it is not modelled here)
            if system.scheduler.admission == "new_token_ratio":
                if isinstance(allocator, ContiguousConfig):
                    refused.append(("admission: new_token_ratio", "contiguous memory, whose "
                                    "extents are reserved at admission already (use paged or "
                                    "virtual memory)"))
                elif hybrid:
                    refused.append(("admission: new_token_ratio", hybrid_manager))
            if system.scheduler.preempted_cache == "prompt":
                if not isinstance(allocator, PagedConfig):
                    refused.append(("preempted_cache: prompt", f"{allocator.kind} memory, "
                                    "which keeps no prefix cache of blocks"))
                elif not allocator.prefix_caching:
                    refused.append(("preempted_cache: prompt", "allocator.prefix_caching: "
                                    "false (nothing is cached to forget)"))
                elif hybrid:
                    refused.append(("preempted_cache: prompt", hybrid_manager))
            if refused:
                setting, why = refused[0]
                raise ValueError(f"system {system.name!r}: scheduler.{setting} (SGLang's) is "
                                 f"not modelled with {why}")
        return self

    @model_validator(mode="after")
    def _fp4_kv_cache_readable(self):  # type: ignore[no-untyped-def]
        dtype = self.memory.kv_cache_dtype
        if dtype not in FP4_KV_CACHE_DTYPES:
            return self
        gpu = self.gpu_spec()
        if gpu.fp4_peak_flops is None:
            # Only Blackwell's kernels (FlashInfer's trtllm-gen, TensorRT-LLM's) read FP4 K
            # and V in attention; elsewhere SGLang widens them first, at a cost not modelled.
            raise ValueError(f"memory.kv_cache_dtype: {dtype} is read by attention kernels "
                             f"of GPUs with FP4 tensor cores (Blackwell) only; {gpu.name} "
                             "has none (an explicit gpu states peak_fp4_tflops)")
        model = _model_spec(self.model)
        elements = model.kv_latent_dim or model.head_dim
        if elements % FP4_KV_BLOCK:
            what = "kv_latent_dim" if model.kv_latent_dim else "head_dim"
            raise ValueError(f"memory.kv_cache_dtype: {dtype} scales blocks of "
                             f"{FP4_KV_BLOCK} elements of a head; {model.name}'s {what} "
                             f"{elements} is not a multiple of {FP4_KV_BLOCK}")
        return self

    @model_validator(mode="after")
    def _experts_spread_alone(self):  # type: ignore[no-untyped-def]
        split = self.engine.disaggregation
        prefill = split.prefill_parallel if split else None
        if prefill is not None:
            problem = parallel_problem(prefill, self.model_spec(), self.gpu)
            if problem:
                raise ValueError(f"engine.disaggregation.prefill_parallel: {problem}")
        spread = any(p.spreads_experts for p in (self.parallel, prefill) if p is not None)
        if spread and self.timing.calibration:
            raise ValueError("timing.calibration: a calibration times one tensor-parallel "
                             "group, not experts spread over other GPUs "
                             "(parallel.data_parallel_size, expert_parallel); drop it to "
                             "use the roofline")
        return self

    @model_validator(mode="after")
    def _pipeline_stages_alone(self):  # type: ignore[no-untyped-def]
        split = self.engine.disaggregation
        prefill = split.prefill_parallel if split else None
        if prefill is not None and prefill.pipeline_parallel_size > 1:
            raise ValueError("engine.disaggregation.prefill_parallel.pipeline_parallel_size: "
                             "pipeline stages under disaggregation are not modelled")
        stages = self.parallel.pipeline_parallel_size
        if stages == 1:
            return self
        if split is not None:
            raise ValueError(f"parallel.pipeline_parallel_size {stages}: pipeline stages "
                             "under engine.disaggregation are not modelled")
        model = _model_spec(self.model)
        unmodelled = {
            "speculative decoding": lambda s: s.speculative is not None,
            "preemption by swap (scheduler.preemption_mode)": lambda s: s.scheduler.swaps,
            "a host tier (allocator.host_cache_gib)": lambda s: getattr(
                s.allocator, "host_cache_gib", 0),
            "the hybrid KV cache manager (sliding-window layers; allocator."
            "hybrid_kv_cache: false keeps every token in every layer)": lambda s: bool(
                model.sliding_window and isinstance(s.allocator, PagedConfig)
                and s.allocator.hybrid_kv_cache),
        }
        for system in self.systems:
            for what, used in unmodelled.items():
                if used(system):
                    raise ValueError(f"system {system.name!r}: {what} is not modelled with "
                                     f"pipeline stages (parallel.pipeline_parallel_size "
                                     f"{stages})")
        return self

    def prefill_view(self) -> Scenario:
        """The scenario as its prefill replicas see it: their own parallelism in place of
        ``parallel`` (the decode replicas'), where disaggregation gives one."""
        split = self.engine.disaggregation
        if split is None or split.prefill_parallel is None:
            return self
        alone = split.model_copy(update={"prefill_parallel": None})  # (a view of itself)
        return self.model_copy(update={
            "parallel": split.prefill_parallel,
            "engine": self.engine.model_copy(update={"disaggregation": alone})})

    @property
    def ranks(self) -> int:
        """The engines the simulation runs side by side: every data-parallel rank of every
        replica (a rank schedules its own batch over its own KV cache)."""
        split = self.engine.disaggregation
        decode_replicas = self.engine.replicas - (split.prefill_replicas if split else 0)
        return self.prefill_ranks + decode_replicas * self.parallel.data_parallel_size

    @property
    def prefill_ranks(self) -> int:
        """Of :attr:`ranks`, those of the prefill replicas under disaggregation (the
        first ones; 0 without it)."""
        split = self.engine.disaggregation
        if split is None:
            return 0
        return split.prefill_replicas * self.prefill_view().parallel.data_parallel_size

    @property
    def gpus(self) -> int:
        """Every GPU of every replica."""
        split = self.engine.disaggregation
        if split is None:
            return self.engine.replicas * self.parallel.gpus
        return (split.prefill_replicas * self.prefill_view().parallel.gpus
                + (self.engine.replicas - split.prefill_replicas) * self.parallel.gpus)

    @model_validator(mode="before")
    @classmethod
    def _ranks_balanced_as_vllm_balances_them(cls, data: Any) -> Any:
        """Where no ``engine.router.policy`` is given, data-parallel ranks are routed by
        vLLM's balancer (vllm_dp), written into the scenario so that it stays when the
        scenario is saved and read again (a sweep's points, a capacity search's loads)."""
        if not isinstance(data, dict):
            return data
        engine = data.get("engine") or {}
        if not isinstance(engine, dict):
            return data
        # The ranks new requests go to: the prefill replicas' under disaggregation.
        parallel = data.get("parallel") or {}
        split = engine.get("disaggregation")
        if isinstance(split, dict) and split.get("prefill_parallel") is not None:
            parallel = split["prefill_parallel"]
        if not isinstance(parallel, dict):
            return data
        try:
            ranks = int(parallel.get("data_parallel_size", 1))
        except (TypeError, ValueError):
            return data  # (the field's own check says what is wrong)
        router = engine.get("router") or {}
        if ranks > 1 and isinstance(router, dict) and "policy" not in router:
            data = {**data, "engine": {**engine, "router": {**router, "policy": "vllm_dp"}}}
        return data

    @model_validator(mode="after")
    def _draft_models_split_evenly(self):  # type: ignore[no-untyped-def]
        tp = self.parallel.tensor_parallel_size
        for system in self.systems:
            spec = system.speculative
            draft = spec.drafter_spec(_model_spec(self.model)) if spec else None
            problem = draft.tensor_parallel_problem(tp) if draft and tp > 1 else None
            if problem:
                raise ValueError(f"system {system.name!r}: speculative.draft_model on "
                                 f"tensor_parallel_size {tp}: {problem}")
        return self

    @field_validator("systems")
    @classmethod
    def _unique_names(cls, systems: list[SystemConfig]) -> list[SystemConfig]:
        names = [s.name for s in systems]
        if len(set(names)) != len(names):
            raise ValueError(f"system names must be unique, got {names}")
        return systems

    @field_validator("systems")
    @classmethod
    def _host_memory_has_a_link(cls, systems: list[SystemConfig], info: ValidationInfo
                               ) -> list[SystemConfig]:
        gpu = info.data.get("gpu")
        if not isinstance(gpu, GpuConfig) or gpu.host_link_gbps is not None:
            return systems
        for system in systems:
            if isinstance(system.allocator, PagedConfig) and system.allocator.host_cache_gib:
                raise ValueError(f"system {system.name!r}: a host cache needs "
                                 "gpu.host_link_gbps (GPU-to-host GB/s, one direction)")
            if system.scheduler.swaps:
                raise ValueError(f"system {system.name!r}: preemption_mode "
                                 f"{system.scheduler.preemption_mode} needs "
                                 "gpu.host_link_gbps (GPU-to-host GB/s, one direction)")
        return systems

    def setting_notes(self) -> list[str]:
        """What a reader of this scenario's results should know of its settings: those that
        change nothing here (:meth:`idle_settings`), and decode batches the token budget
        cannot hold (:meth:`budget_overruns`)."""
        return [*self.idle_settings(), *self.budget_overruns()]

    def budget_overruns(self) -> list[str]:
        """Systems whose decode steps may feed more tokens than ``max_num_batched_tokens``:
        ``max_num_seqs`` decoding requests, each its last token and k drafts. vLLM then
        leaves running requests out of a step (and refuses a budget below max_num_seqs);
        here every running request decodes every step, and such a step admits no prompt."""
        notes = []
        for system in self.systems:
            scheduler = system.scheduler
            per_request = 1 + (system.speculative.num_speculative_tokens
                               if system.speculative else 0)
            decode = scheduler.max_num_seqs * per_request
            if decode > scheduler.max_num_batched_tokens:
                each = f" × {per_request} tokens" if per_request > 1 else ""
                notes.append(
                    f"system {system.name!r}: {scheduler.max_num_seqs} decoding requests"
                    f"{each} make {decode:,} tokens, more than max_num_batched_tokens "
                    f"{scheduler.max_num_batched_tokens:,}; where a batch grows so large, "
                    "every running request still decodes every step here (and the step "
                    "admits no prompt), where vLLM would leave some out of the step")
        return notes

    def idle_settings(self) -> list[str]:
        """Settings given that change nothing in this scenario, each as a sentence: valid
        (a sweep may set them for some points only), but a reader comparing runs that differ
        only in them should know they cannot differ."""
        notes = []
        router = self.engine.router.policy
        routed = self.prefill_ranks or self.ranks
        parallel = self.parallel
        if parallel.pipeline_link_gbps is not None and parallel.pipeline_parallel_size == 1:
            notes.append("parallel.pipeline_link_gbps changes nothing here: one pipeline "
                         "stage sends nothing on")
        if parallel.expert_parallel and parallel.stage_gpus == 1:
            notes.append("parallel.expert_parallel changes nothing here: one GPU holds every "
                         "expert")
        if parallel.expert_load_imbalance > 1 and not parallel.expert_parallel:
            notes.append("parallel.expert_load_imbalance changes nothing here: without "
                         "expert_parallel every expert is split evenly over the GPUs")
        if router != "round_robin" and routed == 1:
            notes.append(f"engine.router.policy {router} changes nothing here: one replica "
                         f"takes every new request")
        elif router == "round_robin" and self.engine.router.stats_interval_s:
            notes.append("engine.router.stats_interval_s changes nothing here: round_robin "
                         "heeds nothing the replicas report")
        if router != "cache_aware" and routed > 1:
            notes += [f"engine.router.{name} changes nothing here: it is SGLang's router's "
                      f"(policy cache_aware), not {router}'s"
                      for name in ("cache_threshold", "balance_abs_threshold",
                                   "balance_rel_threshold")
                      if _not_default(self.engine.router, name)]
        split = self.engine.disaggregation
        if (split is not None and self.ranks - self.prefill_ranks == 1
                and _not_default(split, "decode_router")):
            notes.append(f"engine.disaggregation.decode_router {split.decode_router} changes "
                         "nothing here: one decode replica takes every request handed over")
        memory = self.memory
        if memory.kv_memory_gib is not None and _not_default(memory, "gpu_memory_utilization"):
            notes.append("memory.gpu_memory_utilization changes nothing here: "
                         "memory.kv_memory_gib sizes the KV pool")
        model = _model_spec(self.model)
        for system in self.systems:
            scheduler = system.scheduler
            allocator = system.allocator
            where = f"system {system.name!r}: "
            if not scheduler.swaps and _not_default(scheduler, "swap_space_gib"):
                notes.append(f"{where}scheduler.swap_space_gib changes nothing without "
                             "preemption_mode swap or swap_groups (preemption recomputes)")
            if isinstance(allocator, PagedConfig):
                if not allocator.prefix_caching and _not_default(allocator, "eviction"):
                    notes.append(f"{where}allocator.eviction changes nothing without "
                                 "prefix_caching (no block stays cached to evict)")
                if not allocator.host_cache_gib and _not_default(allocator, "host_load"):
                    notes.append(f"{where}allocator.host_load changes nothing without "
                                 "host_cache_gib (nothing is loaded from host memory)")
                if not (model.sliding_window or model.has_state_layers) and _not_default(
                        allocator, "hybrid_kv_cache"):
                    notes.append(f"{where}allocator.hybrid_kv_cache changes nothing for "
                                 f"{model.name}, whose layers all attend to every token")
                if not (model.has_state_layers and allocator.prefix_caching) and _not_default(
                        allocator, "mamba_cache_mode"):
                    notes.append(f"{where}allocator.mamba_cache_mode changes nothing without "
                                 "a prefix cache of a state-space hybrid's states")
            if scheduler.policy in ("lpm", "dfs_weight") and not (
                    isinstance(system.allocator, PagedConfig)
                    and system.allocator.prefix_caching):
                notes.append(f"system {system.name!r}: scheduler.policy {scheduler.policy} is "
                             f"first come, first served here: its memory has no prefix cache "
                             f"to rank the line by")
            if scheduler.policy == "lof" and isinstance(self.workload, SyntheticWorkload):
                notes.append(f"system {system.name!r}: scheduler.policy lof orders by each "
                             f"request's max_tokens, which a synthetic workload gives all "
                             f"alike but where the context limit cuts it (nearly first come, "
                             f"first served); a trace's columns.max_tokens gives each its own")
            conservativeness = scheduler.schedule_conservativeness
            if conservativeness is not None and conservativeness * NEW_TOKEN_RATIO_INIT > 1:
                notes.append(f"system {system.name!r}: scheduler.schedule_conservativeness "
                             f"{conservativeness:g} starts the ratio at 1, as any from "
                             f"{1 / NEW_TOKEN_RATIO_INIT:.3g} does (SGLang caps it there)")
            if scheduler.preempted_rejoin == "back" and scheduler.policy in (
                    "priority", "shortest_predicted"):
                notes.append(f"system {system.name!r}: scheduler.preempted_rejoin back changes "
                             f"nothing under policy {scheduler.policy}: the line puts a "
                             "preempted request in its place by its key")
            if scheduler.batching == "prefill_first" and self.engine.disaggregation is not None:
                notes.append(f"system {system.name!r}: scheduler.batching prefill_first "
                             "changes nothing under disaggregation: prefill replicas never "
                             "decode, and decode replicas read no prompts")
            threshold = scheduler.long_prefill_token_threshold
            if threshold and threshold >= scheduler.max_num_batched_tokens:
                notes.append(f"system {system.name!r}: scheduler.long_prefill_token_threshold "
                             f"{threshold:,} changes nothing: a step's whole budget "
                             f"(max_num_batched_tokens {scheduler.max_num_batched_tokens:,}) "
                             "is no more")
            if scheduler.prefill_allocation != "per_chunk":
                continue
            if not scheduler.chunked_prefill:
                notes.append(f"system {system.name!r}: prefill_allocation per_chunk changes "
                             f"nothing without chunked_prefill (a prompt is one chunk)")
            elif isinstance(system.allocator, ContiguousConfig):
                notes.append(f"system {system.name!r}: prefill_allocation per_chunk changes "
                             f"nothing for a contiguous reservation (placed whole)")
        return notes

    def model_spec(self) -> ModelSpec:
        """The model, with its KV cache stored as ``memory.kv_cache_dtype`` says and its
        context limited to ``max_model_len``."""
        model = _model_spec(self.model)
        changes: dict[str, Any] = {}
        kv_bytes = KV_CACHE_DTYPE_BYTES.get(self.memory.kv_cache_dtype)
        if kv_bytes:
            changes["kv_dtype_bytes"] = kv_bytes
        if self.max_model_len is not None:
            changes["max_model_len"] = self.max_model_len
        return dataclasses.replace(model, **changes) if changes else model

    def gpu_spec(self) -> GpuSpec:
        if isinstance(self.gpu, str):
            return GPU_PRESETS[self.gpu.lower()]
        g = self.gpu
        return GpuSpec(g.name, int(g.memory_gib * 1024**3), g.hbm_bandwidth_gbps * 1e9,
                       g.peak_tflops * 1e12,
                       interconnect_bytes_per_s=_scaled(g.interconnect_gbps, 1e9),
                       host_link_bytes_per_s=_scaled(g.host_link_gbps, 1e9),
                       fp8_peak_flops=_scaled(g.peak_fp8_tflops, 1e12),
                       fp4_peak_flops=_scaled(g.peak_fp4_tflops, 1e12))


def _not_default(config: ConfigModel, field: str) -> bool:
    """Whether ``config``'s ``field`` holds other than its default."""
    return bool(getattr(config, field) != type(config).model_fields[field].default)


def _scaled(value: float | None, unit: float) -> float | None:
    """``value`` in ``unit`` (GB/s: 1e9, TFLOP/s: 1e12) as a plain number; None stays."""
    return None if value is None else value * unit


def _model_spec(model: str | ModelConfig) -> ModelSpec:
    if isinstance(model, str):
        return MODEL_PRESETS[model.lower()]
    fields = model.model_dump()
    fields["model_dim"] = fields.pop("hidden_size")
    if fields["num_kv_heads"] is None:
        fields["num_kv_heads"] = model.num_heads
    fields["sliding_window"] = model.sliding_window or 0
    fields["num_sliding_layers"] = (
        0 if model.sliding_window is None else model.num_sliding_layers or model.num_layers)
    fields["num_state_layers"] = model.num_state_layers or 0
    fields["state_bytes_per_layer"] = model.state_bytes_per_layer or 0
    fields["state_bytes_per_draft_per_layer"] = model.state_bytes_per_draft_per_layer or 0
    fields["state_chunk_size"] = model.state_chunk_size or 0
    return ModelSpec(**fields)


# Keep the names importable for documentation and the sweep's validation.
__all__ = ["EVICTION_POLICIES", "PLACEMENTS", "RESERVE_POLICIES", "Scenario", "ScenarioError",
           "load_scenario", "scenario_from_dict"]


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _loc(loc: tuple[Any, ...], data: Any) -> str:
    """``systems[1].allocator.block_size`` from a pydantic error location, union tags dropped."""
    parts: list[str] = []
    node = data
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
            node = node[item] if isinstance(node, list) and item < len(node) else None
            continue
        key = str(item)
        if isinstance(node, dict) and key not in node:
            tags = {str(v) for v in node.values() if isinstance(v, str)}
            if key in tags or key in ("synthetic", "trace") or key in _TYPE_TAGS or (
                    "[" in key or key[:1].isupper()):
                continue  # a union member's tag, not a field
        elif not isinstance(node, dict) and ("[" in key or key in ("synthetic", "trace")
                                             or key in _TYPE_TAGS):
            continue  # a union member's tag (list[...], literal[...]) over a list or a value
        parts.append(f".{key}" if parts else key)
        node = node.get(key) if isinstance(node, dict) else None
    return "".join(parts) or "(top level)"


def _format_error(error: ErrorDetails, data: Any) -> str:
    loc = tuple(error["loc"])
    where = _loc(loc, data)
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"{where}: unknown key{_unknown_key_hint(str(loc[-1]), loc, data)}"
    if kind == "missing":
        return f"{where}: required field is missing"
    message = error["msg"].removeprefix("Value error, ")
    value = error.get("input")
    context = error.get("ctx") or {}
    # pydantic's words for a section given as something else, or a kind not named, speak of
    # its classes and tags; say what the file should hold instead.
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        fields = " of fields" if kind != "dict_type" else ""
        return f"{where}: expected a mapping{fields} (got {_shown(value)})"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tag = str(context.get("discriminator", "kind")).strip("'")
        section = re.sub(r"\[\d+\]", "[]", where)
        expected = _one_of(sorted(_TAG_VALUES.get((section, tag), ())))
        if kind == "union_tag_not_found" or tag not in value:
            return f"{where}.{tag}: required field is missing ({expected})"
        return f"{where}.{tag}: expected {expected} (got {_shown(value[tag])})"
    if kind == "string_type" and loc[-1:] == ("str",):  # a preset's name or its shape
        return f"{where}: expected a preset's name or a mapping of fields (got {_shown(value)})"
    if kind == "too_short":
        least = context.get("min_length", 1)
        return (f"{where}: expected at least {least} item{'s' if least != 1 else ''} (got "
                f"{context.get('actual_length', 0)})")
    if kind == "list_type":
        shown = "a mapping" if isinstance(value, dict) else _shown(value)
        return f"{where}: expected a list (got {shown})"
    if kind == "int_parsing" and isinstance(value, str) and _is_number(value):
        # YAML 1.1 reads e-notation as a number only with a dot and a signed exponent
        # (1.0e+5): 1e5 is text, which an integer field will not parse.
        whole = float(value)
        written = f"{int(whole)}" if whole.is_integer() else "a whole number"
        return (f"{where}: expected a whole number, got the text {value!r} (YAML takes "
                f"e-notation for a number only as 1.0e+5): write {written}")
    if kind == "int_parsing_size":  # pydantic's words speak of a string, whatever it got
        return f"{where}: expected a whole number, got {_shown(value)}, far too large"
    if isinstance(value, YamlFlag):
        return (f"{where}: expected a number, got a yes/no flag ({value}: YAML reads yes, "
                "no, on, off, true and false so)")
    if kind != "value_error":
        return f"{where}: {message} (got {_shown(value)})"
    if not loc:  # a check across sections: its message names the fields it is about
        return message
    return f"{where}: {message}"


def _is_number(text: str) -> bool:
    """Whether ``text`` reads as a finite float (``1e5``, ``2.5``)."""
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _shown(value: Any) -> str:
    """A value as an error message quotes it: short ones as written, long ones by kind."""
    text = repr(value)
    if len(text) <= 40:
        return text
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return "a long string" if isinstance(value, str) else text[:40]


def _one_of(names: list[str]) -> str:
    """``'a', 'b' or 'c'``: the choices of a kind, as pydantic lists a literal's."""
    quoted = [repr(name) for name in names]
    if len(quoted) < 2:
        return "".join(quoted) or "a kind"
    return "one of " + ", ".join(quoted[:-1]) + " or " + quoted[-1]


def _unknown_key_hint(key: str, loc: tuple[Any, ...], data: Any) -> str:
    """What to tell of an unknown ``key``: the section or kind it belongs to, when it is a
    field elsewhere; else the closest field of this section, or of another (and where)."""
    section = re.sub(r"\[\d+\]", "[]", _loc(loc[:-1], data))
    section = "" if section == "(top level)" else section
    homes = _FIELD_HOMES.get(key, [])
    members = sorted({tag for home, tag in homes if home == section and tag})
    if members:  # a field of another member of this section's union
        tag_names = " or ".join(sorted({member.split(":")[0] for member in members}))
        return f" for this {tag_names} ({' or '.join(members)} has it)"
    if homes:
        return f" here; it belongs under {_homes_text(homes)}"
    here = [f for f, places in _FIELD_HOMES.items() if any(h == section for h, _ in places)]
    near = difflib.get_close_matches(key, here, n=1, cutoff=0.6)
    anywhere = difflib.get_close_matches(key, list(_FIELD_HOMES), n=1, cutoff=0.6)
    if near and (not anywhere or _likeness(key, near[0]) >= _likeness(key, anywhere[0])):
        return f"; did you mean {near[0]!r}?"
    if anywhere:  # a closer field of another section: say where it goes
        return f"; did you mean {anywhere[0]!r} (under {_homes_text(_FIELD_HOMES[anywhere[0]])})?"
    return ""


def unknown_preset(name: str, presets: Iterable[str]) -> str:
    """Why ``name`` is no preset, in words: the nearest preset where one is near (a typo,
    a version left out), and every one known."""
    known = list(presets)
    near = difflib.get_close_matches(name.lower(), known, n=1, cutoff=0.6)
    guess = f"; did you mean {near[0]!r}?" if near else ""
    return f"unknown preset {name!r}{guess} (known: {', '.join(known)})"


def _likeness(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _homes_text(homes: list[tuple[str, str]]) -> str:
    sections = sorted({home or "the top level" for home, _ in homes})
    return " or ".join(sections[:3]) + (" ..." if len(sections) > 3 else "")


def _collect_fields() -> tuple[dict[str, list[tuple[str, str]]],
                               dict[tuple[str, str], set[str]]]:
    """Where each field of the config models may stand: (section path, as ``systems[].
    allocator``, and the tag of the union member that has it, as "kind: paged", or ""
    where a section is of one shape), for the hints on unknown keys; and the values each
    tag field of a section takes (its members' one-value literals), for the errors on a kind
    not named."""
    from typing import get_args, get_origin

    from pydantic import BaseModel

    homes: dict[str, list[tuple[str, str]]] = {}
    tags: dict[tuple[str, str], set[str]] = {}

    def listed(annotation: Any) -> bool:
        return get_origin(annotation) in (list, tuple) or any(
            listed(arg) for arg in get_args(annotation))

    def tag_of(model: type[BaseModel]) -> str:
        # The field a tagged union tells its members by (kind, process, dist), as
        # "process: closed_loop"; "" for a section of one shape.
        for name, info in model.model_fields.items():
            values = get_args(info.annotation)
            if get_origin(info.annotation) is Literal and len(values) == 1:
                return f"{name}: {values[0]}"
        return ""

    def walk(model: type[BaseModel], section: str) -> None:
        tag = tag_of(model)
        for name, info in model.model_fields.items():
            homes.setdefault(name, []).append((section, tag))
            values = get_args(info.annotation)
            if get_origin(info.annotation) is Literal and len(values) == 1:
                tags.setdefault((section, name), set()).add(str(values[0]))
            inner = f"{section}.{name}" if section else name
            inner += "[]" if listed(info.annotation) else ""
            for sub in _models_in(info.annotation):
                walk(sub, inner)

    walk(Scenario, "")
    return homes, tags


def _models_in(annotation: Any) -> list[type]:
    from typing import get_args

    from pydantic import BaseModel

    found = []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        found.append(annotation)
    for arg in get_args(annotation):
        found += _models_in(arg)
    return found


# Each field's homes; and the kinds a tagged section takes, (section path, tag field) ->
# its values, as ("systems[].allocator", "kind") -> {"contiguous", "paged", "virtual"}.
_FIELD_HOMES, _TAG_VALUES = _collect_fields()


def _encloses(outer: str, path: str) -> bool:
    """Whether field path ``outer`` is ``path`` or one of its parents."""
    return path == outer or path.startswith((outer + ".", outer + "["))


def scenario_from_dict(data: Any, source: str = "<scenario>") -> Scenario:
    """Validate ``data`` (parsed YAML); errors become one-line :class:`ScenarioError`."""
    if not isinstance(data, dict):
        raise ScenarioError(f"{source}: expected a mapping of scenario fields at the top level")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(f"{source}: {validation_message(exc, data)}") from None


def validation_message(exc: ValidationError, data: Any) -> str:
    """pydantic's complaints about ``data`` as one line: the one that says most, where it
    is, and how many more there are."""
    errors = exc.errors()
    # In a union every member complains; the deepest complaint is the useful one, and a
    # member that took the value's type but refused the value beats one of another type
    # ("should be a valid string" for a model given as a mapping). An unknown key
    # explains the rest (a misspelt required field is also "missing").
    errors.sort(key=lambda e: (e["type"] != "extra_forbidden", e["type"].endswith("_type"),
                               -len(e["loc"])))
    first = _format_error(errors[0], data)
    # A complaint about an enclosing value is another union member refusing the same
    # input (``gpu`` as a preset name when the mapping misses a field): not one more.
    path = _loc(tuple(errors[0]["loc"]), data)
    others = [e for e in errors[1:] if not _encloses(_loc(tuple(e["loc"]), data), path)]
    more = f" (and {len(others)} more)" if others else ""
    return f"{first}{more}"


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML file."""
    return scenario_from_dict(read_scenario_file(path), str(path))


def read_scenario_file(path: str | Path) -> Any:
    """A scenario YAML file as parsed, not yet validated (one-line errors for a missing or
    unreadable file and bad YAML)."""
    return read_yaml(Path(path), "a scenario YAML file", ScenarioError)
