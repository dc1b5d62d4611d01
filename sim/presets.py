"""Model and GPU presets, and the arithmetic that turns them into a KV pool.

Think of the GPU as a warehouse: the model's weights are the fixed shelving, and what floor
space is left (times the share the engine may use) is the KV pool, measured in *token slots*
whose size is :func:`ModelSpec.kv_bytes_per_token`. Tensor parallelism rents several
warehouses side by side: each holds 1/N of the shelving and 1/N of every token's KV heads, so
a token slot spans all N of them (see :func:`kv_pool_slots`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer, as far as KV memory and step time need it."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: float
    max_model_len: int
    dtype_bytes: int = 2
    # Bytes of one cached K or V element when the cache is stored narrower than the weights
    # (vLLM's --kv-cache-dtype fp8: 1); None: the weights' dtype.
    kv_dtype_bytes: int | None = None

    @property
    def kv_element_bytes(self) -> int:
        """Bytes of one cached K or V element."""
        return self.kv_dtype_bytes or self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head: 2 × layers × kv_heads × head_dim × KV dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_element_bytes

    @property
    def weight_bytes(self) -> float:
        """Weights stored in the same dtype as the KV cache."""
        return self.num_params * self.dtype_bytes

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_dim

    def kv_heads_per_gpu(self, tensor_parallel_size: int) -> int:
        """KV heads each GPU holds under tensor parallelism. With more GPUs than KV heads
        (GQA) every GPU keeps one whole head, replicated, as vLLM does."""
        return max(1, self.num_kv_heads // tensor_parallel_size)

    def kv_bytes_per_token_per_gpu(self, tensor_parallel_size: int) -> int:
        """One token's K and V on one GPU of a tensor-parallel group."""
        return (2 * self.num_layers * self.kv_heads_per_gpu(tensor_parallel_size)
                * self.head_dim * self.kv_element_bytes)

    def tokens_per_page(self, page_bytes: int, tensor_parallel_size: int) -> int:
        """Tokens one physical page holds when, as vAttention lays KV out, every layer's K and
        every layer's V is a virtual tensor of its own on each GPU: a page backs one of them,
        so it holds ``page_bytes`` / (KV heads per GPU × head_dim × KV dtype) tokens."""
        per_token = (self.kv_heads_per_gpu(tensor_parallel_size) * self.head_dim
                     * self.kv_element_bytes)
        return page_bytes // per_token

    def slots_in_gib(self, gib: float, tensor_parallel_size: int) -> int:
        """Token slots ``gib`` GiB hold when spread over a tensor-parallel group's GPUs."""
        return int(gib * GIB // (self.kv_bytes_per_token_per_gpu(tensor_parallel_size)
                                 * tensor_parallel_size))

    def tensor_parallel_problem(self, tensor_parallel_size: int) -> str | None:
        """Why the model cannot be split over ``tensor_parallel_size`` GPUs, or None.

        vLLM's rule: the query heads divide evenly, and the KV heads either divide evenly or
        are replicated, which needs the GPU count to be a multiple of them.
        """
        tp, kv = tensor_parallel_size, self.num_kv_heads
        if self.num_heads % tp:
            return f"{self.name}'s {self.num_heads} attention heads do not divide over {tp} GPUs"
        if (kv % tp) if kv >= tp else (tp % kv):
            return (f"{self.name}'s {kv} KV heads neither divide over {tp} GPUs nor replicate "
                    f"evenly onto them")
        return None


@dataclass(frozen=True)
class GpuSpec:
    """Memory size, HBM bandwidth, dense bf16/fp16 tensor throughput and GPU-to-GPU link
    bandwidth (one direction, what a ring all-reduce is limited by) of one GPU, and how many
    GPUs that link joins (``None``: as many as asked)."""

    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    peak_flops: float
    interconnect_bytes_per_s: float | None = None
    interconnect_gpus: int | None = None
    host_link_bytes_per_s: float | None = None  # to CPU memory, one direction (PCIe)


# Shapes from each model's config.json on its Hugging Face model card.
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec("llama-2-7b", 32, 32, 32, 128, 6.74e9, 4096),
        ModelSpec("llama-2-13b", 40, 40, 40, 128, 13.0e9, 4096),
        # Llama-2-70B uses grouped-query attention: 64 query heads share 8 KV heads.
        ModelSpec("llama-2-70b", 80, 64, 8, 128, 68.98e9, 4096),
        ModelSpec("llama-3-8b", 32, 32, 8, 128, 8.03e9, 8192),
        # Llama-3.1-8B: Llama-3-8B's shapes with a 128K context (long traces such as Mooncake).
        ModelSpec("llama-3.1-8b", 32, 32, 8, 128, 8.03e9, 131072),
        ModelSpec("mistral-7b", 32, 32, 8, 128, 7.24e9, 32768),
        # OPT-13B: 800 KB per token, the figure the vLLM paper (SOSP'23, §3) quotes.
        ModelSpec("opt-13b", 40, 40, 40, 128, 12.85e9, 2048),
    ]
}

# Memory as the driver reports it (nvidia-smi), bandwidth and dense (non-sparse) bf16 tensor
# FLOP/s from NVIDIA's datasheets: A100 datasheet (2021, SXM), H100 datasheet (SXM5, 2023),
# H200 product brief (SXM, 2024). NVLink: the datasheets' 600 GB/s (A100) and 900 GB/s
# (H100, H200) count both directions; one direction is half. It joins the 8 GPUs of one HGX
# board; tensor parallelism beyond a board would run over the (far slower) network. PCIe to
# host memory: the datasheets' 64 GB/s (A100, Gen4 x16) and 128 GB/s (H100, H200, Gen5 x16)
# count both directions too.
GPU_PRESETS: dict[str, GpuSpec] = {
    g.name: g
    for g in [
        GpuSpec("a100-40g", 40960 * MIB, 1555e9, 312e12, 300e9, 8, 32e9),
        GpuSpec("a100-80g", 81920 * MIB, 2039e9, 312e12, 300e9, 8, 32e9),
        GpuSpec("h100-80g", 81559 * MIB, 3.35e12, 989e12, 450e9, 8, 64e9),
        GpuSpec("h200-141g", 143771 * MIB, 4.8e12, 989e12, 450e9, 8, 64e9),
    ]
}


# vLLM's --kv-cache-dtype values that store the cache narrower than a 16-bit model: bytes
# per element. "auto" (absent here) keeps the model's dtype.
KV_CACHE_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
KV_CACHE_DTYPES = ("auto", *KV_CACHE_DTYPE_BYTES)


class SizingError(ValueError):
    """A pool that cannot hold what it must hold."""


def kv_pool_slots(
    model: ModelSpec,
    gpu: GpuSpec,
    *,
    kv_memory_gib: float | None = None,
    gpu_memory_utilization: float = 0.9,
    tensor_parallel_size: int = 1,
) -> int:
    """Token slots in one engine's KV pool: an explicit KV size (all the engine's GPUs
    together), or, per GPU, GPU memory × utilization − its share of the weights.

    Under tensor parallelism every GPU holds every token, each with its own KV heads, so the
    slot count is one GPU's pool over one GPU's bytes per token.
    """
    problem = model.tensor_parallel_problem(tensor_parallel_size)
    if problem:
        raise SizingError(problem)
    if kv_memory_gib is not None:
        if kv_memory_gib <= 0:
            raise SizingError(f"kv_memory_gib must be > 0, got {kv_memory_gib}")
        return model.slots_in_gib(kv_memory_gib, tensor_parallel_size)
    if not 0 < gpu_memory_utilization <= 1:
        raise SizingError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
        )
    weight_bytes_per_gpu = model.weight_bytes / tensor_parallel_size
    usable_bytes = gpu.memory_bytes * gpu_memory_utilization
    pool_bytes = usable_bytes - weight_bytes_per_gpu
    if pool_bytes <= 0:
        share = "" if tensor_parallel_size == 1 else f" (1/{tensor_parallel_size} of them)"
        needed = math.ceil(model.weight_bytes / usable_bytes)
        hint = (f"; shard them over more GPUs (parallel.tensor_parallel_size, at least "
                f"{needed}) or give memory.kv_memory_gib" if needed > tensor_parallel_size
                else "")
        raise SizingError(
            f"{model.name} weights{share} ({weight_bytes_per_gpu / GIB:.1f} GiB) do not fit in "
            f"{gpu_memory_utilization:.0%} of {gpu.name} ({usable_bytes / GIB:.1f} GiB): no KV "
            f"pool left{hint}"
        )
    return int(pool_bytes // model.kv_bytes_per_token_per_gpu(tensor_parallel_size))


def lookup_model(name: str) -> ModelSpec:
    """A preset by name (case-insensitive), or a KeyError listing the known ones."""
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODEL_PRESETS)}") from None


def lookup_gpu(name: str) -> GpuSpec:
    """A preset by name (case-insensitive), or a KeyError listing the known ones."""
    try:
        return GPU_PRESETS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown gpu {name!r}; known: {', '.join(GPU_PRESETS)}") from None
