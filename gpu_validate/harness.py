"""The GPU side: compile the kernel with CuPy, check it, time it, time the layer's GEMMs.

Needs CuPy and a CUDA device (``pip install 'kvsim[gpu]'``, or ``'kvsim[gpu-cuda13]'``);
:func:`cuda_status` says plainly why not when either is missing. Timings are CUDA-event
medians after warm-up; every KV working set is at least :data:`MIN_WORKING_SET_BYTES` (several
times any current L2) so the kernel streams from HBM, and achieved GB/s are reported against a
measured device-to-device copy.
"""

from __future__ import annotations

import datetime as dt
import functools
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from gpu_validate.launch import (
    KERNEL_SOURCE,
    THREADS,
    TOKENS_PER_WARP,
    build_defines,
    check_problem,
    launch_args,
)
from sim.presets import ModelSpec

MIN_WORKING_SET_BYTES = 256 * 1024**2


def cuda_status() -> tuple[bool, str]:
    """(True, device name) when CuPy sees a CUDA device, else (False, the reason)."""
    try:
        import cupy
    except ImportError:
        return False, ("CuPy is not installed (pip install 'kvsim[gpu]', or 'kvsim[gpu-cuda13]' "
                       "for a CUDA 13 driver)")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device
        return False, f"no CUDA device found ({type(exc).__name__}: {exc})"
    if count < 1:
        return False, "no CUDA device found"
    props = cupy.cuda.runtime.getDeviceProperties(0)
    return True, props["name"].decode() if isinstance(props["name"], bytes) else props["name"]


class Kernels:
    """The compiled module's two entry points on the CUDA device (CuPy ``RawModule``)."""

    def __init__(self, threads: int = THREADS, tokens_per_warp: int = TOKENS_PER_WARP) -> None:
        import cupy

        self.xp = cupy
        self.threads = threads
        # CuPy adds the device's -arch; the source needs no CUDA headers (NVRTC-safe).
        module = cupy.RawModule(code=KERNEL_SOURCE.read_text(),
                                options=("--std=c++17", *build_defines(tokens_per_warp)))
        self.contiguous = module.get_function("decode_contiguous")
        self.paged = module.get_function("decode_paged")

    def run(self, dev: dict[str, Any], paged: bool) -> Any:
        """Launch once on device arrays ``dev``; the output is poisoned (NaN) first."""
        dev["out"].fill(self.xp.nan)
        grid, block, args = launch_args(dev, paged, self.threads)
        (self.paged if paged else self.contiguous)(grid, block, args)
        return dev["out"]

    def to_host(self, array: Any) -> np.ndarray:
        """Copy a device array to the host (synchronises)."""
        return self.xp.asnumpy(array)


def random_device_inputs(cp, rng: np.random.Generator, model: ModelSpec, batch: int,  # type: ignore[no-untyped-def]
                         context: int, block_size: int | None) -> dict[str, Any]:
    """Timing inputs drawn on the device (gigabytes: no host copy), contiguous when
    ``block_size`` is None, else paged through a shuffled block table."""
    heads, kv_heads, head_dim = model.num_heads, model.num_kv_heads, model.head_dim
    check_problem(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                  context_lens=[context], block_size=block_size)

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


class Timing(NamedTuple):
    """A median time and how much the repeats spread around it."""

    median_s: float
    spread: float  # (90th − 10th percentile) / median


def time_it(cp, fn, repeats: int = 30, warmup: int = 5) -> Timing:  # type: ignore[no-untyped-def]
    """Median seconds of ``fn()`` by CUDA events, after ``warmup`` untimed calls (module
    load, cuBLAS handles and clocks settle there)."""
    for _ in range(warmup):
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    samples = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()  # raises here if the launch failed
        samples.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    p10, median, p90 = np.percentile(samples, [10, 50, 90])
    return Timing(float(median), float((p90 - p10) / median))


def copy_bandwidth(cp, nbytes: int = 2 * 1024**3) -> float:  # type: ignore[no-untyped-def]
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = cp.empty(nbytes, dtype=cp.uint8)
    dst = cp.empty_like(src)
    timing = time_it(cp, lambda: dst.data.copy_from_device(src.data, nbytes), repeats=20)
    return 2 * nbytes / timing.median_s


def model_problem(model: ModelSpec) -> str | None:
    """Why the harness cannot time ``model``, or None. Its kernel is MHA/GQA decode attention
    and its GEMMs are a dense layer's in fp16, sized from the parameter count: an MLA model's
    latent attention, a mixture of experts' routed MLPs, quantized (FP8, 4-bit) weights and
    state-space layers' recurrences would be timed as something else."""
    quantized = (model.weight_dtype_bytes is not None or model.fp8_share > 0
                 or model.fp4_share > 0)
    kinds = [kind for kind, applies in (("MLA attention", model.uses_mla),
                                        ("a mixture of experts", model.is_moe),
                                        ("quantized weights", quantized),
                                        ("state-space layers", model.has_state_layers))
             if applies]
    if kinds:
        return (f"{model.name} uses {' and '.join(kinds)}; the harness times dense models "
                "with multi-head or grouped-query attention and 16-bit weights only "
                "(llama-2-7b, llama-3-8b, ...)")
    return None


def layer_gemm_shapes(model: ModelSpec) -> list[tuple[int, int]]:
    """(in, out) of one layer's GEMMs: QKV, O, and an MLP sized from the parameter count."""
    hidden = model.hidden_size
    qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    per_layer = model.num_params / model.num_layers
    intermediate = max(hidden, int((per_layer - hidden * qkv - hidden * hidden) / (3 * hidden)))
    return [(hidden, qkv), (hidden, hidden), (hidden, 2 * intermediate), (intermediate, hidden)]


def driver_version() -> str:
    """The NVIDIA driver's version as nvidia-smi prints it, or "" where it cannot be read."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout else ""


def attention_shapes(model: ModelSpec, quick: bool) -> list[tuple[int, int]]:
    """(batch, context) points whose per-layer KV working set streams from HBM: at least
    :data:`MIN_WORKING_SET_BYTES` (several times any L2) and at most 24 GiB."""
    batches = (8, 32, 128) if quick else (4, 8, 16, 32, 64, 128, 256)
    contexts = (512, 2048, 8192) if quick else (256, 512, 1024, 2048, 4096, 8192)
    per_token_bytes = 2 * model.num_kv_heads * model.head_dim * 2  # K and V, one layer, fp16
    return [(b, c) for b in batches for c in contexts
            if MIN_WORKING_SET_BYTES <= b * c * per_token_bytes <= 24 * 1024**3]


def run_timings(kernels: Kernels, model: ModelSpec, *, quick: bool = False, device: str = "",
                partial_csv: Path | None = None, log: Callable[[str], None] = print,
                variants: tuple[int, ...] = (1, 2, 8)) -> pd.DataFrame:
    """Attention (both layouts, every block size) and GEMM timings, per layer, and a few
    points for kernel builds with other ``variants`` of rows in flight per warp.

    With ``partial_csv`` the table so far is rewritten after every point, so a run cut short
    keeps what it measured; ``log`` gets one line per point.
    """
    cp = kernels.xp
    rng = np.random.default_rng(1)
    copy_bps = copy_bandwidth(cp)
    log(f"device-to-device copy: {copy_bps / 1e9:.0f} GB/s (read + write)")
    context = {"copy_gbps": copy_bps / 1e9, "device": device, "driver": driver_version(),
               "cuda_driver_api": cp.cuda.runtime.driverGetVersion(),
               "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "model": model.name}
    rows: list[dict[str, Any]] = [{"kind": "copy", "time_s": np.nan, "gbps": copy_bps / 1e9}]

    def table() -> pd.DataFrame:
        frame = pd.DataFrame(rows).assign(**context)
        frame["pct_of_copy"] = frame["gbps"] / frame["copy_gbps"] * 100
        return frame

    def record(row: dict[str, Any]) -> None:
        rows.append(row)
        if partial_csv is not None:
            table().to_csv(partial_csv, index=False)

    per_token_bytes = 2 * model.num_kv_heads * model.head_dim * 2

    def attention(backend: Kernels, batch: int, context_len: int,
                  block_size: int | None, **extra: Any) -> dict[str, Any]:
        """Time one layout on fresh device inputs and record the row."""
        kv_bytes = batch * context_len * per_token_bytes
        dev = random_device_inputs(cp, rng, model, batch, context_len, block_size)
        timing = time_it(cp, functools.partial(backend.run, dev, block_size is not None))
        row = {"kind": "attention", **extra,
               "layout": "contiguous" if block_size is None else "paged",
               "block_size": block_size or 0, "batch": batch, "context_len": context_len,
               "time_s": timing.median_s, "spread": timing.spread, "bytes": kv_bytes,
               "gbps": kv_bytes / timing.median_s / 1e9}
        del dev  # drop the inputs, then hand their memory back to the device
        cp.get_default_memory_pool().free_all_blocks()
        record(row)
        return row

    shapes = attention_shapes(model, quick)
    for i, (batch, context_len) in enumerate(shapes, 1):
        base, *paged = [attention(kernels, batch, context_len, bs)
                        for bs in (None, 8, 16, 32, 64, 128)]
        log(f"[{i}/{len(shapes)}] attention batch {batch} x context {context_len}: "
            f"contiguous {base['time_s'] * 1e6:.0f} us ({base['gbps']:.0f} GB/s), "
            "paged/contiguous " + " ".join(
                f"{r['block_size']}:{r['time_s'] / base['time_s']:.3f}" for r in paged))
    # Tuning data for the next kernel version: other numbers of rows in flight per warp, at
    # a small, a middle and the largest batch of the sweep (kind "variant": not fitted).
    picks = sorted({shapes[0], shapes[len(shapes) // 2], shapes[-1]})
    for tokens_per_warp in variants:
        variant = Kernels(kernels.threads, tokens_per_warp)
        for batch, context_len in picks:
            contiguous, paged16 = [
                attention(variant, batch, context_len, bs, kind="variant",
                          tokens_per_warp=tokens_per_warp) for bs in (None, 16)]
            log(f"variant tokens_per_warp={tokens_per_warp}, batch {batch} x context "
                f"{context_len}: contiguous {contiguous['gbps']:.0f} GB/s, paged-16 "
                f"{paged16['gbps']:.0f} GB/s")
    layer_shapes = layer_gemm_shapes(model)
    weights = [(cp.random.random(s, dtype=cp.float32) - 0.5).astype(cp.float16)
               for s in layer_shapes]
    batches = sorted({b for b, _ in shapes})
    for tokens in sorted({*batches, 256, 512, 1024, 2048, 4096}):
        acts = [(cp.random.random((tokens, s[0]), dtype=cp.float32) - 0.5).astype(cp.float16)
                for s in layer_shapes]

        def layer(xs=acts):  # type: ignore[no-untyped-def]
            for w, x in zip(weights, xs, strict=True):
                cp.matmul(x, w)

        timing = time_it(cp, layer)
        flops = sum(2.0 * tokens * i * o for i, o in layer_shapes)
        record({"kind": "gemm", "tokens": tokens, "time_s": timing.median_s,
                "spread": timing.spread, "flops": flops,
                "tflops": flops / timing.median_s / 1e12,
                "bytes": sum(2 * i * o for i, o in layer_shapes)})
        log(f"layer GEMMs at {tokens} tokens: {timing.median_s * 1e6:.0f} us "
            f"({flops / timing.median_s / 1e12:.0f} TFLOP/s)")
    return table()
