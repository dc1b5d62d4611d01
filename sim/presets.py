"""Model and GPU presets, and the arithmetic that turns them into a KV pool.

Think of the GPU as a warehouse: the model's weights are the fixed shelving, and what floor
space is left (times the share the engine may use) is the KV pool, measured in *token slots*
whose size is :func:`ModelSpec.kv_bytes_per_token`.
"""

from __future__ import annotations

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

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head: 2 × layers × kv_heads × head_dim × dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        """Weights stored in the same dtype as the KV cache."""
        return self.num_params * self.dtype_bytes

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class GpuSpec:
    """Memory size, HBM bandwidth and dense bf16/fp16 tensor throughput of one GPU."""

    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    peak_flops: float


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
# H200 product brief (SXM, 2024).
GPU_PRESETS: dict[str, GpuSpec] = {
    g.name: g
    for g in [
        GpuSpec("a100-40g", 40960 * MIB, 1555e9, 312e12),
        GpuSpec("a100-80g", 81920 * MIB, 2039e9, 312e12),
        GpuSpec("h100-80g", 81559 * MIB, 3.35e12, 989e12),
        GpuSpec("h200-141g", 143771 * MIB, 4.8e12, 989e12),
    ]
}


class SizingError(ValueError):
    """A pool that cannot hold what it must hold."""


def kv_pool_slots(
    model: ModelSpec,
    gpu: GpuSpec,
    *,
    kv_memory_gib: float | None = None,
    gpu_memory_utilization: float = 0.9,
) -> int:
    """Token slots in the KV pool: an explicit KV size, or GPU memory × utilization − weights."""
    if kv_memory_gib is not None:
        if kv_memory_gib <= 0:
            raise SizingError(f"kv_memory_gib must be > 0, got {kv_memory_gib}")
        pool_bytes = kv_memory_gib * GIB
    else:
        if not 0 < gpu_memory_utilization <= 1:
            raise SizingError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        pool_bytes = gpu.memory_bytes * gpu_memory_utilization - model.weight_bytes
        if pool_bytes <= 0:
            raise SizingError(
                f"{model.name} weights ({model.weight_bytes / GIB:.1f} GiB) do not fit in "
                f"{gpu_memory_utilization:.0%} of {gpu.name} "
                f"({gpu.memory_bytes * gpu_memory_utilization / GIB:.1f} GiB): no KV pool left"
            )
    return int(pool_bytes // model.kv_bytes_per_token)


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
