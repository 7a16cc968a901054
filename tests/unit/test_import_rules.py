"""DESIGN §2 import rules that the import-linter contracts in pyproject.toml cannot express.

- Inside kvstore/, only service.py, server.py, lane.py (the server edge) and cli.py import grpc, grpc_health or the
  generated *_pb2_grpc stubs.
- Inside kvstore/, only the GPU tier (kvstore/tiers/gpu.py) imports torch.
- engine/ imports from `client` only the names in `client.__all__`: never a submodule
  (`from client.contract.scope import ...`), and never the store's wire code (kvstore_pb) directly; its
  own wire contract, kvstore_pb.engine_pb2 and engine_pb2_grpc (the workers' gRPC edge), is
  the one exception.
- client/ never imports torch, triton or numpy.

The checker reads source with `ast` (nothing is imported), so it sees imports inside functions
and `if TYPE_CHECKING:` blocks, relative imports and `importlib.import_module("...")` literals.
It is tested against a synthetic tree below, so a rule that stops firing fails too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]

# The daemon's edge: the servicer, the process, the lane, the CLI and the TLS credentials it serves with.
GRPC_ALLOWED = ("kvstore.service", "kvstore.server", "kvstore.lane", "kvstore.cli", "kvstore.tls")
ENGINE_WIRE = ("kvstore_pb.engine_pb2", "kvstore_pb.engine_pb2_grpc")
TORCH_ALLOWED = ("kvstore.tiers.gpu",)
CLIENT_FORBIDDEN = ("torch", "triton", "numpy")


@dataclass(frozen=True, slots=True)
class Import:
    """One imported module: `import a.b` -> a.b; `from a import b` -> a (names ("b",))."""

    module: str
    names: tuple[str, ...]
    line: int
    alias: str | None = None  # the local name bound by `import module [as alias]`


@dataclass(frozen=True, slots=True)
class Violation:
    path: str
    line: int
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.detail}"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _top(module: str) -> str:
    return module.partition(".")[0]


def imports_of(root: Path, path: Path) -> list[Import]:
    """Every import in a file, with relative imports resolved to absolute module names."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    here = module_name(root, path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or (alias.name if "." not in alias.name else None)
                found.append(Import(alias.name, (), node.lineno, bound))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append(Import(module, tuple(a.name for a in node.names), node.lineno))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            arg = node.args[0]
            if (
                name in ("import_module", "__import__")
                and isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
            ):
                found.append(Import(arg.value, (), node.lineno))
    return found


def _candidates(imp: Import) -> list[str]:
    """The modules an import may load: the module itself and `module.name` for from-imports."""
    return [imp.module, *(f"{imp.module}.{n}" for n in imp.names if n != "*")]


def _engine_wire_only(imp: Import) -> bool:
    """The import loads the engine's own generated wire modules and nothing else of kvstore_pb."""
    if imp.module in ENGINE_WIRE:
        return True
    return (
        imp.module == "kvstore_pb"
        and bool(imp.names)
        and all(f"kvstore_pb.{n}" in ENGINE_WIRE for n in imp.names)
    )


def _is_grpc(module: str) -> bool:
    if _top(module) in ("grpc", "grpc_health"):
        return True
    return _top(module) == "kvstore_pb" and any(p.endswith("_pb2_grpc") for p in module.split("."))


def client_exports(root: Path) -> set[str] | None:
    """`client.__all__` read from client/__init__.py without importing it; None if absent."""
    init = root / "client" / "__init__.py"
    if not init.is_file():
        return None
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            value = node.value
            if isinstance(value, ast.List | ast.Tuple):
                return {e.value for e in value.elts if isinstance(e, ast.Constant)}
    return None


def _engine_attribute_uses(tree: ast.AST, alias: str) -> list[tuple[str, int]]:
    return [
        (node.attr, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == alias
    ]


def check_tree(root: Path) -> list[Violation]:
    """All violations of the rules above in the kvstore/, client/ and engine/ folders of root."""
    violations: list[Violation] = []
    exports = client_exports(root)

    def files(package: str) -> list[Path]:
        folder = root / package
        return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)

    def report(path: Path, line: int, rule: str, detail: str) -> None:
        violations.append(Violation(path.relative_to(root).as_posix(), line, rule, detail))

    def parsed(path: Path) -> list[Import] | None:
        try:
            return imports_of(root, path)
        except SyntaxError as exc:
            report(path, exc.lineno or 0, "syntax", f"cannot parse: {exc.msg}")
            return None

    for path in files("kvstore"):
        mod = module_name(root, path)
        for imp in parsed(path) or []:
            for target in _candidates(imp):
                if _is_grpc(target) and not _within(mod, GRPC_ALLOWED):
                    report(
                        path,
                        imp.line,
                        "kvstore-grpc",
                        f"{mod} imports {target}; only {', '.join(GRPC_ALLOWED)} may use grpc",
                    )
                    break
                if _top(target) == "torch" and not _within(mod, TORCH_ALLOWED):
                    report(
                        path,
                        imp.line,
                        "kvstore-torch",
                        f"{mod} imports {target}; only {', '.join(TORCH_ALLOWED)} may use torch",
                    )
                    break

    for path in files("client"):
        mod = module_name(root, path)
        for imp in parsed(path) or []:
            if _top(imp.module) in CLIENT_FORBIDDEN:
                report(
                    path,
                    imp.line,
                    "client-heavy",
                    f"{mod} imports {imp.module}; the SDK never imports torch, triton or numpy",
                )

    engine_files = files("engine")
    if engine_files and exports is None:
        report(
            root / "client" / "__init__.py", 0, "engine-client", "client/__init__.py has no __all__"
        )
    allowed = exports or set()
    for path in engine_files:
        mod = module_name(root, path)
        imports = parsed(path)
        if imports is None:
            continue
        for imp in imports:
            if _top(imp.module) == "kvstore_pb" and not _engine_wire_only(imp):
                report(
                    path,
                    imp.line,
                    "engine-client",
                    f"{mod} imports {imp.module}; engines reach the store only through client",
                )
            elif imp.module.startswith("client."):
                report(
                    path,
                    imp.line,
                    "engine-client",
                    f"{mod} imports {imp.module}; import from `client` itself (client.__all__)",
                )
            elif imp.module == "client":
                for name in imp.names:
                    if name != "*" and name not in allowed:
                        report(
                            path,
                            imp.line,
                            "engine-client",
                            f"{mod} imports client.{name}, which client.__all__ does not export",
                        )
                if imp.alias is not None:
                    tree = ast.parse(path.read_text(encoding="utf-8"))
                    for attr, line in _engine_attribute_uses(tree, imp.alias):
                        if attr not in allowed:
                            report(
                                path,
                                line,
                                "engine-client",
                                f"{mod} uses client.{attr}, which client.__all__ does not export",
                            )
    return violations


# ---- the real tree -----------------------------------------------------------------------------


def test_repository_follows_the_import_rules() -> None:
    violations = check_tree(REPO_ROOT)
    assert not violations, "DESIGN §2 import rules broken:\n" + "\n".join(map(str, violations))


def test_the_checker_reads_the_real_tree() -> None:
    """Guard against a vacuous pass: the packages are found and client.__all__ is read."""
    exports = client_exports(REPO_ROOT)
    assert exports is not None and {"Scope", "page_keys", "InvalidArgument"} <= exports
    client_files = list((REPO_ROOT / "client").rglob("*.py"))
    assert len(client_files) >= 4
    init_imports = imports_of(REPO_ROOT, REPO_ROOT / "client" / "__init__.py")
    assert {"client.contract.scope", "client.contract.page", "client.contract.errors"} <= {i.module for i in init_imports}


def test_import_linter_contracts_are_kept() -> None:
    exe = Path(sys.executable).parent / "lint-imports"
    assert exe.is_file(), f"{exe} missing: install the dev extra (scripts/bootstrap.sh)"
    result = subprocess.run(
        [str(exe), "--no-cache", "--no-logo"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, f"lint-imports failed:\n{result.stdout}\n{result.stderr}"
    assert "0 broken" in result.stdout


# ---- the checker on a synthetic tree -----------------------------------------------------------

CLIENT_INIT = """
from client.contract.scope import KVLayout, Scope, page_keys
from client.wire import pack_keys
__all__ = ["KVLayout", "Scope", "page_keys"]
"""

SYNTHETIC: dict[str, str] = {
    "client/__init__.py": CLIENT_INIT,
    "client/contract/scope.py": "import struct\nfrom . import errors\n",
    "client/wire.py": "from kvstore_pb import store_pb2\n",
    # allowed
    "kvstore/__init__.py": "",
    "kvstore/service.py": "import grpc\nfrom kvstore_pb import store_pb2_grpc\n",
    "kvstore/server.py": "from grpc_health.v1 import health\nimport grpc.aio\n",
    "kvstore/cli.py": "import grpc\n",
    "kvstore/tiers/__init__.py": "",
    "kvstore/tiers/gpu.py": "import torch\nfrom torch import cuda\n",
    "kvstore/store.py": "from kvstore_pb import store_pb2\nfrom client.contract.scope import Scope\n",
    "engine/__init__.py": "",
    "engine/good.py": (
        "import torch\nimport client\nfrom client import Scope, page_keys\nfrom client import *\n"
        "x = client.KVLayout\n"
    ),
    "engine/edge.py": (
        "from kvstore_pb import engine_pb2, engine_pb2_grpc\nimport kvstore_pb.engine_pb2_grpc\n"
    ),
}

VIOLATIONS: dict[str, tuple[str, str]] = {
    # path: (source, rule); the offending import is always on the line marked "# <-"
    "kvstore/index.py": ("import os\nimport grpc  # <-\n", "kvstore-grpc"),
    "kvstore/mover.py": (
        "def f():\n    from grpc import aio  # <-\n    return aio\n",
        "kvstore-grpc",
    ),
    "kvstore/policy.py": ("from kvstore_pb import store_pb2_grpc  # <-\n", "kvstore-grpc"),
    "kvstore/leases.py": ("from grpc_health.v1 import health_pb2  # <-\n", "kvstore-grpc"),
    "kvstore/tiers/dram.py": ("import torch.cuda  # <-\n", "kvstore-torch"),
    "kvstore/tiers/ssd.py": (
        "import importlib\nT = importlib.import_module('torch')  # <-\n",
        "kvstore-torch",
    ),
    "kvstore/config.py": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from torch import Tensor  # <-\n",
        "kvstore-torch",
    ),
    "kvstore/tiers/buddy.py": ("from .. import torch  # <-\n", "kvstore-torch-relative-ok"),
    "client/contract/page.py": ("import numpy as np  # <-\n", "client-heavy"),
    "client/transports/shm.py": ("from torch import Tensor  # <-\n", "client-heavy"),
    "client/kernels.py": ("import triton.language as tl  # <-\n", "client-heavy"),
    "engine/a.py": ("from client import Scope, pack_keys  # <-\n", "engine-client"),
    "engine/b.py": ("from client.contract.scope import page_keys  # <-\n", "engine-client"),
    "engine/c.py": ("import client.contract.page  # <-\n", "engine-client"),
    "engine/d.py": ("import client as c\nk = c.pack_keys  # <-\n", "engine-client"),
    "engine/e.py": ("from kvstore_pb import store_pb2  # <-\n", "engine-client"),
    "engine/f.py": ("from kvstore_pb import engine_pb2, store_pb2_grpc  # <-\n", "engine-client"),
    "engine/g.py": ("import kvstore_pb  # <-\n", "engine-client"),
    "engine/sub/__init__.py": ("from client.contract.errors import Corrupt  # <-\n", "engine-client"),
}


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_a_clean_synthetic_tree_passes(tmp_path: Path) -> None:
    _write(tmp_path, SYNTHETIC)
    assert check_tree(tmp_path) == []


def test_every_violation_is_reported(tmp_path: Path) -> None:
    _write(tmp_path, SYNTHETIC)
    _write(tmp_path, {rel: source for rel, (source, _) in VIOLATIONS.items()})
    found = {(v.path, v.line, v.rule) for v in check_tree(tmp_path)}
    expected = set()
    for rel, (source, rule) in VIOLATIONS.items():
        if rule.endswith("-ok"):
            continue
        line = next(i for i, text in enumerate(source.splitlines(), 1) if "# <-" in text)
        expected.add((rel, line, rule))
    assert found == expected
    # `from .. import torch` inside kvstore/tiers resolves to kvstore.torch, not torch
    assert not any(v.path == "kvstore/tiers/buddy.py" for v in check_tree(tmp_path))


def test_each_violation_alone_fails_a_clean_tree(tmp_path: Path) -> None:
    for i, (rel, (source, rule)) in enumerate(VIOLATIONS.items()):
        if rule.endswith("-ok"):
            continue
        root = tmp_path / str(i)
        _write(root, {**SYNTHETIC, rel: source})
        violations = check_tree(root)
        assert [(v.path, v.rule) for v in violations] == [(rel, rule)], violations
        assert rel in str(violations[0])


def test_missing_all_is_reported(tmp_path: Path) -> None:
    _write(tmp_path, {**SYNTHETIC, "client/__init__.py": "from client.contract.scope import Scope\n"})
    violations = check_tree(tmp_path)
    assert ("client/__init__.py", "engine-client") in {(v.path, v.rule) for v in violations}


def test_unparseable_file_is_reported(tmp_path: Path) -> None:
    _write(tmp_path, {**SYNTHETIC, "kvstore/broken.py": "def f(:\n"})
    assert [(v.path, v.rule) for v in check_tree(tmp_path)] == [("kvstore/broken.py", "syntax")]


def test_relative_imports_resolve() -> None:
    root = Path("/r")
    assert module_name(root, root / "kvstore" / "tiers" / "__init__.py") == "kvstore.tiers"
    assert module_name(root, root / "kvstore" / "tiers" / "gpu.py") == "kvstore.tiers.gpu"


def test_relative_import_resolution(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "kvstore/tiers/gpu.py": "from . import dram\nfrom ..store import Store\nfrom ...x import y\n",
            "kvstore/tiers/__init__.py": "from .gpu import GpuTier\n",
        },
    )
    gpu = imports_of(tmp_path, tmp_path / "kvstore" / "tiers" / "gpu.py")
    assert [(i.module, i.names) for i in gpu] == [
        ("kvstore.tiers", ("dram",)),
        ("kvstore.store", ("Store",)),
        ("x", ("y",)),
    ]
    init = imports_of(tmp_path, tmp_path / "kvstore" / "tiers" / "__init__.py")
    assert [(i.module, i.names) for i in init] == [("kvstore.tiers.gpu", ("GpuTier",))]
