"""The GPU side: compile the kernel with CuPy, check it, time it, time the layer's GEMMs.

Needs CuPy and a CUDA device (``pip install 'kvsim[gpu]'``); :func:`cuda_status` says plainly
why not when either is missing. Timings are CUDA-event medians after warm-up; every KV
working set is at least :data:`MIN_WORKING_SET_BYTES` (several times any current L2) so the
kernel streams from HBM, and achieved GB/s are reported against a measured device-to-device
copy.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from gpu_validate.reference import (
    MAX_RELATIVE_ERROR,
    attention_reference,
    make_inputs,
    relative_error,
)
from sim.presets import ModelSpec

KERNEL_SOURCE = Path(__file__).with_name("decode_attention.cu")
MIN_WORKING_SET_BYTES = 256 * 1024**2
THREADS = 128  # 4 warps per (head, sequence)


def cuda_status() -> tuple[bool, str]:
    """(True, device name) when CuPy sees a CUDA device, else (False, the reason)."""
    try:
        import cupy
    except ImportError:
        return False, "CuPy is not installed (pip install 'kvsim[gpu]')"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device
        return False, f"no CUDA device found ({type(exc).__name__}: {exc})"
    if count < 1:
        return False, "no CUDA device found"
    props = cupy.cuda.runtime.getDeviceProperties(0)
    return True, props["name"].decode() if isinstance(props["name"], bytes) else props["name"]


class Kernels:
    """The compiled module's two entry points, with numpy-friendly launchers."""

    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        module = cupy.RawModule(code=KERNEL_SOURCE.read_text(), options=("--std=c++17",))
        self.contiguous = module.get_function("decode_contiguous")
        self.paged = module.get_function("decode_paged")

    def run(self, dev: dict[str, Any], paged: bool) -> Any:
        """Launch once on device arrays ``dev``; the output is poisoned (NaN) first."""
        cp = self.cp
        out = dev["out"]
        out.fill(cp.nan)
        seqs, heads, head_dim = dev["q"].shape
        kv_heads = dev["k_pages" if paged else "k"].shape[1]
        grid, block = (heads, seqs), (THREADS,)
        scale = np.float32(1.0 / np.sqrt(head_dim))
        if paged:
            self.paged(grid, block, (out, dev["q"], dev["k_pages"], dev["v_pages"],
                                     dev["block_tables"], dev["context_lens"], np.int32(heads),
                                     np.int32(kv_heads), np.int32(head_dim),
                                     np.int32(dev["block_size"]),
                                     np.int32(dev["block_tables"].shape[1]), scale))
        else:
            self.contiguous(grid, block, (out, dev["q"], dev["k"], dev["v"],
                                          dev["context_lens"], np.int32(heads),
                                          np.int32(kv_heads), np.int32(head_dim),
                                          np.int32(dev["k"].shape[2]), scale))
        return out


def to_device(inputs, cp) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    seqs, heads, head_dim = inputs.q.shape
    return {
        "q": cp.asarray(inputs.q), "k": cp.asarray(inputs.k), "v": cp.asarray(inputs.v),
        "k_pages": cp.asarray(inputs.k_pages), "v_pages": cp.asarray(inputs.v_pages),
        "block_tables": cp.asarray(np.maximum(inputs.block_tables, 0)),
        "context_lens": cp.asarray(inputs.context_lens),
        "block_size": inputs.block_size,
        "out": cp.empty((seqs, heads, head_dim), dtype=cp.float32),
    }


def random_device_inputs(cp, rng: np.random.Generator, model: ModelSpec, batch: int,  # type: ignore[no-untyped-def]
                         context: int, block_size: int | None) -> dict[str, Any]:
    """Timing inputs drawn on the device (gigabytes: no host copy), contiguous when
    ``block_size`` is None, else paged through a shuffled block table."""
    heads, kv_heads, head_dim = model.num_heads, model.num_kv_heads, model.head_dim

    def draw(*shape: int):  # type: ignore[no-untyped-def]
        return (cp.random.random(shape, dtype=cp.float32) + 0.05).astype(cp.float16)

    dev: dict[str, Any] = {
        "q": draw(batch, heads, head_dim),
        "context_lens": cp.full(batch, context, dtype=cp.int32),
        "out": cp.empty((batch, heads, head_dim), dtype=cp.float32),
        "block_size": block_size or 0,
    }
    if block_size is None:
        dev["k"] = draw(batch, kv_heads, context, head_dim)
        dev["v"] = draw(batch, kv_heads, context, head_dim)
        return dev
    per_seq = -(-context // block_size)
    tables = rng.permutation(batch * per_seq).astype(np.int32).reshape(batch, per_seq)
    dev["block_tables"] = cp.asarray(tables)
    dev["k_pages"] = draw(batch * per_seq, kv_heads, block_size, head_dim)
    dev["v_pages"] = draw(batch * per_seq, kv_heads, block_size, head_dim)
    return dev


def check_correctness(kernels: Kernels, seed: int = 0) -> pd.DataFrame:
    """Both entry points against float64 numpy on fresh random inputs, per block size."""
    rows = []
    rng = np.random.default_rng(seed)
    for block_size in (8, 16, 32, 64, 128):
        for heads, kv_heads in ((8, 8), (8, 2)):
            inputs = make_inputs(rng, seqs=5, num_heads=heads, num_kv_heads=kv_heads,
                                 head_dim=128, context_lens=[1, 17, 255, 1000, 2049],
                                 block_size=block_size)
            reference = attention_reference(inputs)
            dev = to_device(inputs, kernels.cp)
            contiguous = kernels.cp.asnumpy(kernels.run(dev, paged=False)).copy()
            paged = kernels.cp.asnumpy(kernels.run(dev, paged=True)).copy()
            rows.append({
                "block_size": block_size, "num_heads": heads, "num_kv_heads": kv_heads,
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


def time_it(cp, fn, repeats: int = 30, warmup: int = 5) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of ``fn()`` by CUDA events."""
    for _ in range(warmup):
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    samples = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return float(np.median(samples))


def copy_bandwidth(cp, nbytes: int = 2 * 1024**3) -> float:  # type: ignore[no-untyped-def]
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = cp.empty(nbytes, dtype=cp.uint8)
    dst = cp.empty_like(src)
    seconds = time_it(cp, lambda: dst.data.copy_from_device(src.data, nbytes), repeats=20)
    return 2 * nbytes / seconds


def layer_gemm_shapes(model: ModelSpec) -> list[tuple[int, int]]:
    """(in, out) of one layer's GEMMs: QKV, O, and an MLP sized from the parameter count."""
    hidden = model.hidden_size
    qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    per_layer = model.num_params / model.num_layers
    intermediate = max(hidden, int((per_layer - hidden * qkv - hidden * hidden) / (3 * hidden)))
    return [(hidden, qkv), (hidden, hidden), (hidden, 2 * intermediate), (intermediate, hidden)]


def run_timings(kernels: Kernels, model: ModelSpec, *, quick: bool = False,
                device: str = "") -> pd.DataFrame:
    """Attention (both layouts, every block size) and GEMM timings, per layer."""
    cp = kernels.cp
    rng = np.random.default_rng(1)
    copy_bps = copy_bandwidth(cp)
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    driver = cp.cuda.runtime.driverGetVersion()
    rows: list[dict[str, Any]] = [{"kind": "copy", "time_s": np.nan, "gbps": copy_bps / 1e9}]
    batches = (8, 32, 128) if quick else (4, 8, 16, 32, 64, 128, 256)
    contexts = (512, 2048, 8192) if quick else (256, 512, 1024, 2048, 4096, 8192)
    block_sizes = (8, 16, 32, 64, 128)
    per_token_bytes = 2 * model.num_kv_heads * model.head_dim * 2  # K and V, one layer, fp16
    for batch in batches:
        for context in contexts:
            if batch * context * per_token_bytes < MIN_WORKING_SET_BYTES:
                continue  # would sit in L2: not what a serving GPU sees
            if batch * context * per_token_bytes > 24 * 1024**3:
                continue
            dev = random_device_inputs(cp, rng, model, batch, context, block_size=None)
            kv_bytes = batch * context * per_token_bytes
            seconds = time_it(cp, lambda d=dev: kernels.run(d, paged=False))
            rows.append({"kind": "attention", "layout": "contiguous", "block_size": 0,
                         "batch": batch, "context_len": context, "time_s": seconds,
                         "bytes": kv_bytes, "gbps": kv_bytes / seconds / 1e9})
            for block_size in block_sizes:
                pdev = random_device_inputs(cp, rng, model, batch, context, block_size)
                seconds = time_it(cp, lambda d=pdev: kernels.run(d, paged=True))
                rows.append({"kind": "attention", "layout": "paged",
                             "block_size": block_size, "batch": batch, "context_len": context,
                             "time_s": seconds, "bytes": kv_bytes,
                             "gbps": kv_bytes / seconds / 1e9})
                del pdev
            del dev
            cp.get_default_memory_pool().free_all_blocks()
    shapes = layer_gemm_shapes(model)
    for tokens in sorted({*batches, 256, 512, 1024, 2048, 4096}):
        weights = [cp.asarray(rng.uniform(-1, 1, s).astype(np.float16)) for s in shapes]
        acts = [cp.asarray(rng.uniform(-1, 1, (tokens, s[0])).astype(np.float16))
                for s in shapes]

        def layer(ws=weights, xs=acts):  # type: ignore[no-untyped-def]
            for w, x in zip(ws, xs, strict=True):
                cp.matmul(x, w)

        seconds = time_it(cp, layer)
        flops = sum(2.0 * tokens * i * o for i, o in shapes)
        rows.append({"kind": "gemm", "tokens": tokens, "time_s": seconds, "flops": flops,
                     "tflops": flops / seconds / 1e12,
                     "bytes": sum(2 * i * o for i, o in shapes)})
    table = pd.DataFrame(rows)
    table["copy_gbps"] = copy_bps / 1e9
    table["pct_of_copy"] = table["gbps"] / table["copy_gbps"] * 100
    table["device"] = device
    table["driver"] = driver
    table["date"] = stamp
    table["model"] = model.name
    return table
