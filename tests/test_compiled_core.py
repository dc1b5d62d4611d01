"""The compiled core (mypyc) and the Python source must give the same results, and stale
compiled code must never run."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from sim import CORE
from sim.compiled import MANIFEST_NAME, PURE_PYTHON_ENV, SourceOnlyFinder, read_core_status

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
EXTENSION_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")
SEEDS = range(30)


def run_digests(seeds: range) -> dict[str, str]:
    """SHA-256 of every table and summary of the random equality scenarios, per seed, and
    of two state-space runs."""
    from test_engine_equality import random_scenario

    from sim.engine import run_scenario
    from sim.scenario import scenario_from_dict

    digests = {}
    scenarios = {str(seed): random_scenario(seed) for seed in seeds}
    # The random scenarios have no state-space model: a prefix cache of states under both
    # of vLLM's mamba cache modes, in a pool small enough to evict and preempt.
    for mode in ("align", "all"):
        scenarios[f"states-{mode}"] = {
            "name": "states", "memory": {"kv_memory_gib": 0.002},
            "model": {"name": "h", "num_layers": 8, "num_heads": 4, "num_kv_heads": 2,
                      "head_dim": 64, "num_params": 1e8, "max_model_len": 4096,
                      "num_state_layers": 6, "state_bytes_per_layer": 8192,
                      "state_chunk_size": 32},
            "workload": {"arrival": {"process": "poisson", "rate": 100},
                         "prompt_len": {"dist": "uniform", "low": 20, "high": 200},
                         "output_len": {"dist": "uniform", "low": 1, "high": 120},
                         "prefix_groups": {"groups": 2, "length": 160, "fraction": 0.9}},
            "systems": [{"name": "s", "allocator": {"kind": "paged", "block_size": 32,
                                                     "prefix_caching": True,
                                                     "mamba_cache_mode": mode},
                         "scheduler": {"chunked_prefill": True,
                                       "max_num_batched_tokens": 100}}],
            "stop": {"num_requests": 80}}
    for name, data in scenarios.items():
        result = run_scenario(scenario_from_dict(data)).systems["s"]
        blob = "".join(frame.to_csv() for frame in (result.requests, result.steps, result.memory))
        blob += json.dumps(result.summary, sort_keys=True)
        digests[name] = hashlib.sha256(blob.encode()).hexdigest()
    return digests


def test_pure_python_under_python_O_equals_this_core():
    """Also guards against work hidden in ``assert`` statements, which ``-O`` drops."""
    script = (f"import json, sys; sys.path.insert(0, {str(TESTS)!r}); "
              "from sim import CORE; from test_compiled_core import run_digests; "
              f"print(json.dumps([CORE.describe(), run_digests(range({SEEDS.stop}))]))")
    proc = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True,
                          env={**os.environ, PURE_PYTHON_ENV: "1"}, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    core, pure = json.loads(proc.stdout)
    assert core == f"pure-Python core ({PURE_PYTHON_ENV}=1)"
    assert pure == run_digests(SEEDS), f"{CORE.describe()} differs from the pure-Python core"


def test_version_names_the_core():
    proc = subprocess.run([sys.executable, "-m", "sim.cli", "--version"], capture_output=True,
                          text=True, env={**os.environ, PURE_PYTHON_ENV: "1"}, check=False)
    assert proc.stdout.strip().endswith(f", pure-Python core ({PURE_PYTHON_ENV}=1)")


def compiled_sources() -> list[str]:
    """setup.py's COMPILED_SOURCES, read from its text (importing it would run setup())."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == \
                "COMPILED_SOURCES":
            return list(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no COMPILED_SOURCES")


def test_the_compiled_modules_type_check():
    """mypyc compiles only code that type-checks (with everything it imports); otherwise pip
    quietly installs the pure-Python core, at half the speed."""
    sources = compiled_sources()
    assert "sim/scheduler.py" in sources and all((ROOT / s).is_file() for s in sources)
    proc = subprocess.run([sys.executable, "-m", "mypy", *sources], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # mypyc refuses even a note (mypy itself succeeds with one): none may appear.
    messages = [line for line in proc.stdout.splitlines() if ": note:" in line
                or ": error:" in line or ": warning:" in line]
    assert not messages, "\n".join(messages)


# ---------------------------------------------------------------- choosing the core
def fake_build(root: Path) -> Path:
    """A package ``sim`` under ``root`` with one compiled module as setup.py leaves it
    (the extension files are empty: finding them is all that is checked before import)."""
    package = root / "sim"
    package.mkdir()
    source = package / "scheduler.py"
    source.write_text("STEPS = 1\n")
    (package / f"scheduler{EXTENSION_SUFFIX}").write_bytes(b"")
    (package / f"compiled_core__mypyc{EXTENSION_SUFFIX}").write_bytes(b"")
    manifest = {"compiler": "mypyc 9.9", "shared_library": "sim.compiled_core__mypyc",
                "modules": {"sim.scheduler": hashlib.sha256(source.read_bytes()).hexdigest()}}
    (package / MANIFEST_NAME).write_text(json.dumps(manifest))
    return package


def test_a_build_matching_its_sources_runs_compiled(tmp_path):
    status = read_core_status(fake_build(tmp_path), environ={})
    assert (status.compiled, status.stale) == (True, False)
    assert status.describe() == "compiled core (mypyc 9.9)"


def test_an_edited_source_makes_the_whole_build_stale(tmp_path):
    package = fake_build(tmp_path)
    (package / "scheduler.py").write_text("STEPS = 2\n")
    status = read_core_status(package, environ={})
    assert (status.compiled, status.stale) == (False, True)
    assert status.detail == ("sim/scheduler.py changed since it was compiled; reinstall to "
                             "compile it again")


@pytest.mark.parametrize(("damage", "detail"), [
    ("no extension", "the compiled sim.scheduler is missing"),
    ("no shared library", "the compiled sim.compiled_core__mypyc is missing"),
    ("broken manifest", f"unreadable {MANIFEST_NAME}"),
])
def test_a_damaged_build_is_not_used(tmp_path, damage, detail):
    package = fake_build(tmp_path)
    if damage == "no extension":
        (package / f"scheduler{EXTENSION_SUFFIX}").unlink()
    elif damage == "no shared library":
        (package / f"compiled_core__mypyc{EXTENSION_SUFFIX}").unlink()
    else:
        (package / MANIFEST_NAME).write_text("{")
    status = read_core_status(package, environ={})
    assert (status.compiled, status.stale, status.detail) == (False, True, detail)


def test_no_build_or_the_environment_variable_means_pure_python(tmp_path):
    package = fake_build(tmp_path)
    status = read_core_status(package, environ={PURE_PYTHON_ENV: "1"})
    assert (status.compiled, status.stale) == (False, False)
    (package / MANIFEST_NAME).unlink()
    status = read_core_status(package, environ={})
    assert (status.compiled, status.stale) == (False, False)
    assert status.detail == "not compiled at install; pip install -v shows why"


def test_the_source_finder_passes_over_extensions(tmp_path):
    package = fake_build(tmp_path)
    finder = SourceOnlyFinder()
    spec = finder.find_spec("sim.scheduler", [str(package)])
    assert spec is not None and spec.origin == str(package / "scheduler.py")
    (package / "alone.py").write_text("")
    assert finder.find_spec("sim.alone", [str(package)]) is None  # the normal import does it
    assert finder.find_spec("numpy", None) is None  # only sim's own modules
