"""The router's core is pure (DESIGN §9): the simulator runs the same objects on a virtual clock.

- A fresh interpreter that imports every module of engine.router.core has loaded no torch,
  grpc, HTTP framework, pydantic, store SDK, and nothing of engine outside the core.
- The core's source never reads a clock, starts a thread, or draws from the global random
  generator: time is the `now` argument and randomness an `rng` passed in. The checker reads
  source with `ast`, and is run against synthetic snippets so a rule that stops firing fails.
(The import-linter contracts in pyproject.toml state the import half for CI as well.)
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
CORE = REPO_ROOT / "engine" / "router" / "core"
HEAVY = ("torch", "triton", "numpy", "grpc", "fastapi", "starlette", "uvicorn", "pydantic", "httpx")
OURS_FORBIDDEN = ("client", "kvstore", "kvstore_pb", "loadtests", "strata_cli")
CLOCK_CALLS = {
    ("time", "time"),
    ("time", "monotonic"),
    ("time", "perf_counter"),
    ("time", "sleep"),
    ("time", "time_ns"),
    ("time", "monotonic_ns"),
    ("time", "perf_counter_ns"),
    ("datetime", "now"),
    ("datetime", "utcnow"),
    ("datetime", "today"),
    ("date", "today"),
}
FORBIDDEN_IMPORTS = ("threading", "asyncio", "socket", "multiprocessing", "concurrent", "time")

PROBE = """
import importlib, json, pkgutil, sys
import engine.router.core as core
names = [m.name for m in pkgutil.walk_packages(core.__path__, core.__name__ + ".")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "loaded": sorted(sys.modules)}))
"""


def core_modules() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def test_fresh_interpreter_loads_nothing_heavy() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(out.stdout)
    imported = set(report["modules"])
    expected = {
        "engine.router.core." + str(p.relative_to(CORE).with_suffix("")).replace("/", ".")
        for p in core_modules()
        if p.name != "__init__.py"
    }
    assert expected <= imported, expected - imported
    loaded = report["loaded"]
    heavy = [m for m in loaded if m.split(".")[0] in HEAVY + OURS_FORBIDDEN]
    assert heavy == []
    outside = [
        m
        for m in loaded
        if m.startswith("engine.")
        and m not in ("engine.router",)
        and not m.startswith("engine.router.core")
    ]
    assert outside == []
    assert "engine.model" not in loaded


def impurities(source: str, filename: str = "<core>") -> list[str]:
    """Clock reads, threads and global-random draws in one core source file."""
    tree = ast.parse(source, filename=filename)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FORBIDDEN_IMPORTS:
                    found.append(f"{filename}:{node.lineno}: imports {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            top = node.module.split(".")[0]
            if top in FORBIDDEN_IMPORTS:
                found.append(f"{filename}:{node.lineno}: imports from {node.module}")
            if top == "random" and any(a.name != "Random" for a in node.names):
                found.append(f"{filename}:{node.lineno}: takes the global random generator")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            pair = (node.value.id, node.attr)
            if pair in CLOCK_CALLS:
                found.append(
                    f"{filename}:{node.lineno}: reads the clock ({node.value.id}.{node.attr})"
                )
            if node.value.id == "random" and node.attr != "Random":
                found.append(f"{filename}:{node.lineno}: uses random.{node.attr} (pass an rng)")
    return found


@pytest.mark.parametrize(
    "snippet",
    [
        "import time\nx = time.monotonic()",
        "from datetime import datetime\nx = datetime.now()",
        "import threading",
        "import random\nx = random.random()",
        "from random import choice",
        "import asyncio",
    ],
)
def test_checker_catches(snippet: str) -> None:
    assert impurities(snippet) != []


def test_checker_allows_a_passed_rng() -> None:
    assert (
        impurities("import random\ndef f(rng: random.Random) -> int:\n    return rng.randint(0, 3)")
        == []
    )


def test_core_source_is_pure() -> None:
    found: list[str] = []
    for path in core_modules():
        found += impurities(path.read_text(encoding="utf-8"), str(path.relative_to(REPO_ROOT)))
    assert found == []
