"""Numpy twins of the CUDA kernel: inputs, the paged layout, and float64 attention.

Everything the kernel is checked against lives here and runs without a GPU: building random
fp16 inputs (never zeros), scattering a contiguous cache into blocks through a random block
table, reading it back exactly as the kernel addresses it, and decode attention in float64 (the
reference). The kernel itself runs on the CPU under :mod:`gpu_validate.emulation`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# fp16 inputs, fp32 accumulation: the output may differ from float64 on the same fp16 inputs
# by accumulated fp32 rounding, far below this bound; it is the tolerance the GPU run must meet
# (max |out - ref| / max |ref|).
MAX_RELATIVE_ERROR = 2e-3


@dataclass
class DecodeInputs:
    """One decode-attention problem in both layouts.

    ``k``/``v`` are contiguous ``[seqs, kv_heads, max_len, head_dim]``; ``k_pages``/``v_pages``
    are paged ``[blocks, kv_heads, block_size, head_dim]`` with ``block_tables`` int32
    ``[seqs, max_blocks]`` (unused entries are -1).
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    context_lens: np.ndarray
    k_pages: np.ndarray
    v_pages: np.ndarray
    block_tables: np.ndarray
    block_size: int

    @property
    def scale(self) -> float:
        return 1.0 / float(np.sqrt(self.q.shape[-1]))


def make_inputs(rng: np.random.Generator, *, seqs: int, num_heads: int, num_kv_heads: int,
                head_dim: int, context_lens: list[int] | np.ndarray, block_size: int,
                spare_blocks: int = 3) -> DecodeInputs:
    """Random fp16 inputs (uniform in ±1, no zeros) and a shuffled block table."""
    if num_heads % num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    lens = np.asarray(context_lens, dtype=np.int32)
    max_len = int(lens.max())

    def fp16(*shape: int) -> np.ndarray:
        x = rng.uniform(0.05, 1.0, shape) * rng.choice([-1.0, 1.0], shape)
        return x.astype(np.float16)

    q = fp16(seqs, num_heads, head_dim)
    k = fp16(seqs, num_kv_heads, max_len, head_dim)
    v = fp16(seqs, num_kv_heads, max_len, head_dim)
    blocks_per_seq = [-(-int(n) // block_size) for n in lens]
    max_blocks = max(blocks_per_seq)
    total = sum(blocks_per_seq) + spare_blocks
    physical = rng.permutation(total)  # scattered, as after a long run
    tables = np.full((seqs, max_blocks), -1, dtype=np.int32)
    k_pages = fp16(total, num_kv_heads, block_size, head_dim)  # garbage where unused
    v_pages = fp16(total, num_kv_heads, block_size, head_dim)
    cursor = 0
    for s, count in enumerate(blocks_per_seq):
        for b in range(count):
            block = int(physical[cursor])
            cursor += 1
            tables[s, b] = block
            lo, hi = b * block_size, min((b + 1) * block_size, int(lens[s]))
            k_pages[block, :, : hi - lo] = k[s, :, lo:hi]
            v_pages[block, :, : hi - lo] = v[s, :, lo:hi]
    return DecodeInputs(q, k, v, lens, k_pages, v_pages, tables, block_size)


def gather_paged(pages: np.ndarray, block_tables: np.ndarray, context_lens: np.ndarray,
                 block_size: int) -> np.ndarray:
    """Read a paged cache back into ``[seqs, kv_heads, max_len, head_dim]`` exactly as the
    kernel addresses it: token t of sequence s is row ``t % bs`` of block
    ``block_tables[s, t // bs]``."""
    seqs = len(context_lens)
    max_len = int(context_lens.max())
    out = np.zeros((seqs, pages.shape[1], max_len, pages.shape[3]), dtype=pages.dtype)
    for s in range(seqs):
        t = np.arange(int(context_lens[s]))
        blocks = block_tables[s, t // block_size]
        out[s, :, : len(t)] = pages[blocks, :, t % block_size].transpose(1, 0, 2)
    return out


def attention_reference(inputs: DecodeInputs, *, paged: bool = False) -> np.ndarray:
    """Decode attention in float64: ``[seqs, num_heads, head_dim]``."""
    k, v = inputs.k, inputs.v
    if paged:
        k = gather_paged(inputs.k_pages, inputs.block_tables, inputs.context_lens,
                         inputs.block_size)
        v = gather_paged(inputs.v_pages, inputs.block_tables, inputs.context_lens,
                         inputs.block_size)
    seqs, num_heads, head_dim = inputs.q.shape
    group = num_heads // k.shape[1]
    out = np.empty((seqs, num_heads, head_dim))
    for s in range(seqs):
        n = int(inputs.context_lens[s])
        for h in range(num_heads):
            keys = k[s, h // group, :n].astype(np.float64)
            values = v[s, h // group, :n].astype(np.float64)
            scores = keys @ inputs.q[s, h].astype(np.float64) * inputs.scale
            weights = np.exp(scores - scores.max())
            out[s, h] = weights @ values / weights.sum()
    return out


def relative_error(out: np.ndarray, reference: np.ndarray) -> float:
    """max |out − reference| / max |reference|."""
    return float(np.abs(out - reference).max() / np.abs(reference).max())
