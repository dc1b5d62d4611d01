"""Which code runs the hot modules: their mypyc-compiled extensions or their Python source.

Like a printed timetable pinned beside the live board: the print (the compiled extension) is
fast to read, but only trustworthy while the board (the source) has not changed since it was
printed. ``setup.py`` compiles the allocators and the scheduler with mypyc and leaves a
manifest, ``compiled_core.json``, of the SHA-256 of every source it compiled. At import,
before any other ``sim`` module loads, :func:`select_core` checks it:

- the manifest matches every source: the compiled extensions run;
- otherwise — no compiled build, a source edited since (an editable install), or
  ``KVSIM_PURE_PYTHON=1`` — every ``sim`` module loads from its ``.py`` file, even where an
  extension sits beside it, so stale compiled code can never run.

Both cores compute identical results; the compiled one is about twice as fast.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

MANIFEST_NAME = "compiled_core.json"  # written by setup.py's build_ext (same name there)
PURE_PYTHON_ENV = "KVSIM_PURE_PYTHON"  # also read by setup.py
PACKAGE_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class CoreStatus:
    """Whether the compiled core runs, and why (or why not) in words."""

    compiled: bool
    detail: str  # "mypyc 2.4.1", or why the source runs
    stale: bool = False  # an extension exists but its source changed since it was built

    def describe(self) -> str:
        if self.compiled:
            return f"compiled core ({self.detail})"
        return f"pure-Python core ({self.detail})"


def read_core_status(package_dir: Path = PACKAGE_DIR,
                     environ: Mapping[str, str] = os.environ) -> CoreStatus:
    """Decide, from the manifest and the sources under ``package_dir``, which core may run."""
    if environ.get(PURE_PYTHON_ENV) == "1":
        return CoreStatus(False, f"{PURE_PYTHON_ENV}=1")
    manifest_path = package_dir / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text())
        compiler = str(manifest["compiler"])
        modules = dict(manifest["modules"])
        shared = str(manifest["shared_library"])
    except FileNotFoundError:
        return CoreStatus(False, "not compiled at install; pip install -v shows why")
    except (OSError, ValueError, KeyError, TypeError):
        return CoreStatus(False, f"unreadable {MANIFEST_NAME}", stale=True)
    root = package_dir.parent
    for module, digest in sorted(modules.items()):
        source = root / (module.replace(".", "/") + ".py")
        try:
            current = hashlib.sha256(source.read_bytes()).hexdigest()
        except OSError:
            current = None
        if current != digest:
            relative = source.relative_to(root).as_posix()
            return CoreStatus(False, f"{relative} changed since it was compiled; reinstall "
                                     "to compile it again", stale=True)
        if not _is_extension(module, [str(source.parent)]):
            return CoreStatus(False, f"the compiled {module} is missing", stale=True)
    if not _is_extension(shared, [str(package_dir)]):
        return CoreStatus(False, f"the compiled {shared} is missing", stale=True)
    return CoreStatus(True, compiler)


def _is_extension(module: str, path: list[str]) -> bool:
    """Whether ``module`` would load from a compiled extension found in ``path``."""
    spec = importlib.machinery.PathFinder.find_spec(module, path)
    return spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader)


class SourceOnlyFinder(importlib.abc.MetaPathFinder):
    """Import finder that loads ``sim`` modules from their ``.py`` source, never from a
    compiled extension lying beside it."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if not fullname.startswith("sim.") or path is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            return None
        source = Path(str(spec.origin)).parent / (fullname.rpartition(".")[2] + ".py")
        if not source.exists():
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def select_core() -> CoreStatus:
    """Decide which core runs and, unless it is the compiled one, keep extensions out."""
    status = read_core_status()
    if not status.compiled and not any(isinstance(f, SourceOnlyFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, SourceOnlyFinder())
    return status


__all__ = ["CoreStatus", "SourceOnlyFinder", "read_core_status", "select_core"]
