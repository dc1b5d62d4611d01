"""Build kvsim, compiling its hot modules with mypyc where this machine can.

The allocators and the scheduler are plain, typed Python. mypyc (mypy's compiler) turns the
very same source files into C extensions that run the engine about twice as fast; nothing is
written twice. Where compiling is impossible (no C compiler) or unwanted
(``KVSIM_PURE_PYTHON=1`` at install time), the package installs as pure Python and computes
identical results, only slower.

Beside the extensions the build writes ``sim/compiled_core.json``: the SHA-256 of each source
it compiled. At import, :mod:`sim.compiled` uses the extensions only while every one of those
sources is unchanged, so editing a module in an editable install never runs stale code.
Everything else about the package is declared in ``pyproject.toml``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

# The hot path of a run: every block crossing, admission and free goes through these.
COMPILED_SOURCES = (
    "sim/memory/content.py",
    "sim/memory/host_cache.py",
    "sim/memory/block_pool.py",
    "sim/memory/paged.py",
    "sim/memory/contiguous.py",
    "sim/memory/hybrid.py",
    "sim/scheduler.py",
)
MANIFEST_NAME = "compiled_core.json"  # as in sim/compiled.py, which reads it
PURE_PYTHON_ENV = "KVSIM_PURE_PYTHON"  # as in sim/compiled.py
SHARED_LIBRARY = "sim.compiled_core"  # mypyc adds "__mypyc" to the module name
ROOT = Path(__file__).resolve().parent
BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}


class BuildCompiledCore(build_ext):
    """build_ext that leaves pure Python when compiling fails, and records what it built."""

    def run(self) -> None:
        if not self.extensions:
            return
        super().run()  # the extensions are optional: a compiler error only warns
        missing = [ext.name for ext in self.extensions
                   if not Path(self.get_ext_fullpath(ext.name)).exists()]
        if missing:
            self.warn(f"kvsim: mypyc could not build {', '.join(missing)}; installing pure "
                      "Python (identical results, about half the speed)")
            return
        self._write_manifest()

    def _write_manifest(self) -> None:
        if self.inplace:
            package_dir = Path(self.get_finalized_command("build_py").get_package_dir("sim"))
        else:
            package_dir = Path(self.build_lib) / "sim"
        from mypy.version import __version__ as mypy_version

        modules = {
            source[:-3].replace("/", "."): hashlib.sha256((ROOT / source).read_bytes()).hexdigest()
            for source in COMPILED_SOURCES
        }
        # The compiled code lives in one shared library; each module's extension is a shim.
        manifest = {"compiler": f"mypyc {mypy_version}", "modules": modules,
                    "shared_library": f"{SHARED_LIBRARY}__mypyc"}
        package_dir.mkdir(parents=True, exist_ok=True)
        (package_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")


def compiled_extensions() -> list:
    """mypyc's extensions for the hot modules, or none (pure Python) where it cannot run."""
    if os.environ.get(PURE_PYTHON_ENV) == "1":
        return []
    if set(sys.argv[1:]) & {"egg_info", "dist_info"} and not set(sys.argv[1:]) & BUILDS:
        return []  # metadata only (pip asks for it before building): no need to compile
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("kvsim: mypyc is not available; installing pure Python")
        return []
    try:
        # One group named inside the package: its shared library, sim/compiled_core__mypyc,
        # then imports from an editable install too (a top-level one would not).
        extensions = mypycify(list(COMPILED_SOURCES), opt_level="3",
                              separate=[(list(COMPILED_SOURCES), SHARED_LIBRARY)])
    except (Exception, SystemExit) as exc:  # mypy reports type errors by exiting
        print(f"kvsim: mypyc refused the core ({exc}); installing pure Python")
        return []
    for extension in extensions:
        extension.optional = True  # a compiler error leaves the pure-Python package
    return extensions


setup(ext_modules=compiled_extensions(), cmdclass={"build_ext": BuildCompiledCore})
