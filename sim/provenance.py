"""Where a result came from: the kvsim build that made it, and the files it read.

Like the batch number printed on a medicine box: two boxes of the same name and strength may
come from different batches, and only the number tells them apart. ``kvsim 0.1.0`` names
the release; :func:`build_id` is the batch number, a hash of the very source that computed
the numbers (every ``.py`` of the ``sim`` and ``workloads`` packages), so an edited checkout
or another release is told apart from this one. Every run folder's ``summary.json`` carries
it (:func:`made_by`), and a resumed sweep compares it with its own.

The files a scenario reads (a trace, a file of lengths, a calibration) are named in it by
path, not content: :func:`input_digests` hashes what each holds, so an edited trace makes a
new sweep point rather than keeping the runs of the file as it was.
"""

from __future__ import annotations

import hashlib
import importlib
from functools import cache
from pathlib import Path
from typing import Any

from sim import __version__

# The packages whose code computes a run's numbers (the reports only draw them).
_SOURCE_PACKAGES = ("sim", "workloads")
# Scenario fields (at any depth) that name a calibration file, relative to the scenario.
_CALIBRATION_FIELDS = ("calibration", "draft_calibration")


@cache
def build_id() -> str:
    """Hash of the source of this kvsim (12 hex digits): equal for the same code wherever it
    is installed; any edit of the simulator's code changes it."""
    digest = hashlib.sha256()
    for package in _SOURCE_PACKAGES:
        root = Path(str(importlib.import_module(package).__file__)).resolve().parent
        for source in sorted(root.rglob("*.py")):
            if "__pycache__" in source.parts:
                continue
            text = source.read_bytes()
            relative = source.relative_to(root.parent).as_posix()
            digest.update(f"{relative}\0{len(text)}\0".encode() + text)
    return digest.hexdigest()[:12]


def made_by() -> dict[str, str]:
    """What a run folder records of the kvsim that wrote it."""
    return {"kvsim": __version__, "build": build_id()}


def input_files(resolved: dict[str, Any]) -> dict[str, str]:
    """The files a resolved scenario reads, by the field that names each (``workload.path``,
    ``workload.prompt_len.path``, ``timing.calibration``, ...), as written there."""
    found: dict[str, str] = {}

    def walk(value: Any, where: str) -> None:
        if isinstance(value, dict):
            names_file = value.get("kind") == "trace" or value.get("dist") == "empirical"
            if names_file and isinstance(value.get("path"), str):
                found[f"{where}.path".lstrip(".")] = value["path"]
            for key, item in value.items():
                if key in _CALIBRATION_FIELDS and isinstance(item, str):
                    found[f"{where}.{key}".lstrip(".")] = item
                else:
                    walk(item, f"{where}.{key}")
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(item, f"{where}[{index}]")

    walk(resolved, "")
    return found


def input_digests(resolved: dict[str, Any], base_dir: Path) -> dict[str, str]:
    """SHA-256 of each file :func:`input_files` names, by field; a file that cannot be read
    is left out (reading the scenario's files refuses it, in words, before anything runs)."""
    from workloads.importers import resolve_path

    digests = {}
    for field, text in input_files(resolved).items():
        try:
            path = resolve_path(text, base_dir)
            digests[field] = _file_sha256(path.resolve(), path.stat().st_mtime_ns,
                                          path.stat().st_size)
        except (OSError, ValueError):
            continue
    return digests


@cache
def _file_sha256(path: Path, mtime_ns: int, size_bytes: int) -> str:
    """A file's SHA-256, read once while it keeps its size and modification time."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
