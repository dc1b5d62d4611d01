"""The CUDA kernel's own source, compiled as C++ and run on the CPU.

``cuda_on_host.h`` supplies the little of CUDA the kernel uses (thread and block indices, warp
shuffles, ``__syncthreads``, fp16 conversion), running each block's threads as fibers that
take turns; ``entry.cpp`` includes ``decode_attention.cu`` and gives each kernel a C entry
point. :class:`HostKernels` builds that once with the system's C++ compiler and launches it
through ctypes, with the same inputs and argument lists as the GPU backend. The test suite runs
the kernel's indexing and arithmetic this way on machines without a GPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from gpu_validate.launch import (
    KERNEL_SOURCE,
    THREADS,
    TOKENS_PER_WARP,
    build_defines,
    launch_args,
)

HERE = Path(__file__).parent
SOURCES = (HERE / "cuda_on_host.h", HERE / "entry.cpp", KERNEL_SOURCE)
COMPILE_FLAGS = ("-std=c++17", "-O2", "-shared", "-fPIC", "-Wall", "-Wno-unknown-pragmas",
                 "-DKVSIM_HOST_EMULATION")
LAUNCH_ERRORS = {-1: "the threads of a block deadlocked at a barrier",
                 -2: "the block is not a whole number of warps"}


class EmulationError(RuntimeError):
    """The emulation could not be built or a launch failed."""


def find_compiler() -> str | None:
    """The C++ compiler to use: $CXX, else c++, g++ or clang++ on the PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def build(cache_dir: Path | None = None, tokens_per_warp: int = TOKENS_PER_WARP) -> Path:
    """Compile the emulation once per source version and options; returns the shared
    library's path."""
    compiler = find_compiler()
    if compiler is None:
        raise EmulationError("no C++ compiler found (set CXX, or install g++)")
    flags = (*COMPILE_FLAGS, *build_defines(tokens_per_warp))
    digest = hashlib.sha256()
    for path in SOURCES:
        digest.update(path.read_bytes())
    digest.update(" ".join((compiler, *flags)).encode())
    cache = Path(cache_dir or Path(tempfile.gettempdir()) / "kvsim-emulation")
    cache.mkdir(parents=True, exist_ok=True)
    library = cache / f"decode_attention-{digest.hexdigest()[:16]}.so"
    if library.is_file():
        return library
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    proc = subprocess.run([compiler, *flags, "-o", str(partial),
                           str(HERE / "entry.cpp")], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise EmulationError(f"building the kernel emulation failed:\n{proc.stderr}")
    partial.replace(library)  # atomic: parallel test workers never load a half-written file
    return library


def _c_argument(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if not value.flags.c_contiguous:
            raise EmulationError("kernel arrays must be C-contiguous")
        return ctypes.c_void_p(value.ctypes.data)
    if isinstance(value, np.int32):
        return ctypes.c_int(int(value))
    if isinstance(value, np.float32):
        return ctypes.c_float(float(value))
    raise EmulationError(f"unexpected kernel argument of type {type(value).__name__}")


class HostKernels:
    """The two entry points on the CPU, with the same interface as the CuPy ``Kernels``."""

    xp = np

    def __init__(self, cache_dir: Path | None = None, threads: int = THREADS,
                 tokens_per_warp: int = TOKENS_PER_WARP) -> None:
        path = build(cache_dir, tokens_per_warp)
        self.library_dir = path.parent
        self.library = ctypes.CDLL(str(path))
        self.threads = threads
        for name in ("kvsim_host_decode_contiguous", "kvsim_host_decode_paged"):
            getattr(self.library, name).restype = ctypes.c_int

    def run(self, dev: dict[str, Any], paged: bool) -> np.ndarray:
        """Launch once; the output is poisoned (NaN) first, as on the GPU."""
        dev["out"].fill(np.nan)
        self.launch(paged, *launch_args(dev, paged, self.threads))
        return dev["out"]

    def launch(self, paged: bool, grid: tuple[int, int], block: tuple[int],
               args: tuple[Any, ...]) -> None:
        """One launch with the kernel's own argument list (see :func:`launch_args`)."""
        entry = (self.library.kvsim_host_decode_paged if paged
                 else self.library.kvsim_host_decode_contiguous)
        status = entry(ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), ctypes.c_uint(block[0]),
                       *(_c_argument(a) for a in args))
        if status != 0:
            raise EmulationError(LAUNCH_ERRORS.get(status, f"launch failed ({status})"))

    def to_host(self, array: np.ndarray) -> np.ndarray:
        """A copy, so a later launch into the same buffer cannot change it."""
        return array.copy()
