"""Is the kernel right? Both entry points against float64 numpy, on fresh random inputs.

Every case draws new fp16 inputs (never zeros), poisons the output with NaN before each launch
so an unwritten element shows, and compares contiguous and paged with the float64 reference and
with each other. It runs on any :class:`~gpu_validate.launch.KernelBackend`: the GPU through
CuPy, or the CPU emulation in the test suite.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd

from gpu_validate.launch import KernelBackend, device_inputs
from gpu_validate.reference import (
    MAX_RELATIVE_ERROR,
    attention_reference,
    make_inputs,
    relative_error,
)


class Case(NamedTuple):
    """One correctness problem: head layout, head size, block size and context lengths."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    context_lens: tuple[int, ...]


# On the GPU: every block size, MHA and GQA, short and long sequences (partial last blocks,
# tokens that do not fill a warp group), and the head sizes around the 128-element slice.
GPU_CASES = tuple(
    [Case(8, kv, 128, bs, (1, 17, 255, 1000, 2049)) for bs in (8, 16, 32, 64, 128)
     for kv in (8, 2)]
    + [Case(4, 1, hd, 16, (3, 130, 777)) for hd in (64, 80, 256)]
)


def check_correctness(kernels: KernelBackend, cases: tuple[Case, ...] = GPU_CASES,
                      seed: int = 0) -> pd.DataFrame:
    """One row per case: errors against float64, unwritten elements, paged == contiguous."""
    rows = []
    rng = np.random.default_rng(seed)
    for case in cases:
        inputs = make_inputs(rng, seqs=len(case.context_lens), num_heads=case.num_heads,
                             num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                             context_lens=list(case.context_lens), block_size=case.block_size)
        reference = attention_reference(inputs)
        dev = device_inputs(inputs, kernels.xp)
        contiguous = kernels.to_host(kernels.run(dev, paged=False))
        paged = kernels.to_host(kernels.run(dev, paged=True))
        rows.append({
            **case._asdict(), "context_lens": " ".join(map(str, case.context_lens)),
            "unwritten": int(np.isnan(contiguous).sum() + np.isnan(paged).sum()),
            "rel_error_contiguous": relative_error(contiguous, reference),
            "rel_error_paged": relative_error(paged, reference),
            "paged_equals_contiguous": bool(np.array_equal(contiguous, paged)),
        })
    table = pd.DataFrame(rows)
    table["ok"] = ((table["unwritten"] == 0) & table["paged_equals_contiguous"]
                   & (table[["rel_error_contiguous", "rel_error_paged"]].max(axis=1)
                      <= MAX_RELATIVE_ERROR))
    return table
