"""What the decode-attention kernel accepts, and how a launch is put together.

One kernel source (``decode_attention.cu``) runs on two backends: CuPy on a CUDA device
(:class:`gpu_validate.harness.Kernels`) and the CPU emulation (:class:`gpu_validate.emulation.
HostKernels`). Both take their inputs and launch arguments from here, so the tests that run
the emulation exercise the very argument lists the GPU gets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gpu_validate.reference import DecodeInputs

KERNEL_SOURCE = Path(__file__).with_name("decode_attention.cu")

# Mirrors of the kernel's compile-time limits (tests check them against the #defines).
LANE_ELEMS = 4  # head_dim must be a multiple of this: one 8-byte load per lane
MAX_HEAD_DIM = 256  # MAX_SLICES * SLICE
MAX_THREADS = 256  # 32 * MAX_WARPS
THREADS = 128  # 4 warps per (query head, sequence)
TOKENS_PER_WARP = 4  # the kernel's default; other values are a build option for tuning


def build_defines(tokens_per_warp: int = TOKENS_PER_WARP) -> tuple[str, ...]:
    """Compiler options that set the kernel's tuning knobs (both backends pass them)."""
    if not 1 <= tokens_per_warp <= 16:
        raise ValueError(f"tokens_per_warp {tokens_per_warp}: expected 1..16")
    return (f"-DTOKENS_PER_WARP={tokens_per_warp}",)


class KernelBackend(Protocol):
    """Something that runs the two entry points: a CUDA device or the CPU emulation."""

    xp: Any  # cupy or numpy: where arrays live

    def run(self, dev: dict[str, Any], paged: bool) -> Any:
        """Launch one entry point on ``dev`` (from :func:`device_inputs`); the output array."""
        ...

    def to_host(self, array: Any) -> np.ndarray:
        """A numpy copy of a backend array."""
        ...


def check_problem(*, num_heads: int, num_kv_heads: int, head_dim: int,
                  context_lens: Any, block_size: int | None,
                  threads: int = THREADS) -> None:
    """Raise ValueError, naming the argument, for a shape the kernel does not handle."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    if head_dim < LANE_ELEMS or head_dim % LANE_ELEMS or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim}: expected a multiple of {LANE_ELEMS} "
                         f"up to {MAX_HEAD_DIM}")
    if threads < 32 or threads % 32 or threads > MAX_THREADS:
        raise ValueError(f"threads {threads}: expected whole warps up to {MAX_THREADS}")
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size {block_size}: expected a positive number of tokens")
    if int(np.min(context_lens)) < 1:
        raise ValueError("context_lens: every sequence needs at least one token")


def device_inputs(inputs: DecodeInputs, xp: Any) -> dict[str, Any]:
    """Both layouts of ``inputs`` as ``xp`` arrays, with an fp32 output buffer."""
    seqs, heads, head_dim = inputs.q.shape
    check_problem(num_heads=heads, num_kv_heads=inputs.k.shape[1], head_dim=head_dim,
                  context_lens=inputs.context_lens, block_size=inputs.block_size)

    def put(a: np.ndarray) -> Any:
        return xp.asarray(np.ascontiguousarray(a))

    return {
        "q": put(inputs.q), "k": put(inputs.k), "v": put(inputs.v),
        "k_pages": put(inputs.k_pages), "v_pages": put(inputs.v_pages),
        # Unused table entries (-1) are never read; 0 keeps any stray read in bounds.
        "block_tables": put(np.maximum(inputs.block_tables, 0).astype(np.int32)),
        "context_lens": put(inputs.context_lens.astype(np.int32)),
        "block_size": inputs.block_size,
        "out": xp.empty((seqs, heads, head_dim), dtype=xp.float32),
    }


def launch_args(dev: dict[str, Any], paged: bool,
                threads: int = THREADS) -> tuple[tuple[int, int], tuple[int], tuple[Any, ...]]:
    """(grid, block, arguments) for one launch, arguments in the kernel's own order."""
    seqs, heads, head_dim = dev["q"].shape
    kv_heads = dev["k_pages" if paged else "k"].shape[1]
    scale = np.float32(1.0 / np.sqrt(head_dim))
    shape = (np.int32(heads), np.int32(kv_heads), np.int32(head_dim))
    args: tuple[Any, ...]
    if paged:
        args = (dev["out"], dev["q"], dev["k_pages"], dev["v_pages"], dev["block_tables"],
                dev["context_lens"], *shape, np.int32(dev["block_size"]),
                np.int32(dev["block_tables"].shape[1]), scale)
    else:
        args = (dev["out"], dev["q"], dev["k"], dev["v"], dev["context_lens"], *shape,
                np.int32(dev["k"].shape[2]), scale)
    return (heads, seqs), (threads,), args
