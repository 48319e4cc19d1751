"""The layering of ARCHITECTURE.md, checked with ast: arrows point down only.

``models/`` never imports ``gateway/`` or ``buckets/``; ``policies/`` imports nothing of ours;
``buckets/`` never imports ``gateway/``; no core package imports ``bench/``. Imports inside
functions (lazy imports) count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "buckets", "models", "policies", "bench")

FORBIDDEN: dict[str, frozenset[str]] = {
    "models": frozenset({"gateway", "buckets", "policies", "bench"}),
    "policies": frozenset({"gateway", "buckets", "models", "bench"}),
    "buckets": frozenset({"gateway", "bench"}),
}


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` for every import in ``source``, the file of ``module``
    (dotted, e.g. ``buckets.scheduler``; relative imports resolve against it)."""
    found: list[tuple[int, str]] = []
    package_parts = module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return found


def python_files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts)  # "models.__init__": relative imports then resolve inside "models"


def violations(package: str) -> list[str]:
    bad: list[str] = []
    for path in python_files(package):
        for line, name in imported_modules(path.read_text(), module_name(path)):
            top = name.split(".")[0]
            if top in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return bad


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_is_there_and_parses(package: str) -> None:
    files = python_files(package)
    assert files, f"{package}/ has no Python files"
    for path in files:
        ast.parse(path.read_text(), filename=str(path))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down_only(package: str) -> None:
    assert violations(package) == []


def test_import_extraction_sees_lazy_and_relative_imports() -> None:
    source = (
        "import os\n"
        "import gateway.config as cfg\n"
        "from . import sibling\n"
        "from ..buckets import bucket\n"
        "from .step_io import SamplingParams\n"
        "def f():\n"
        "    from gateway.errors import ConfigError\n"
    )
    names = [name for _, name in imported_modules(source, "models.sub.thing")]
    assert names == ["os", "gateway.config", "models.sub", "models.buckets", "models.sub.step_io", "gateway.errors"]


def test_a_forbidden_import_is_reported() -> None:
    names = [n for _, n in imported_modules("def load():\n    from buckets.bucket import Bucket\n", "models.loader")]
    assert any(n.split(".")[0] in FORBIDDEN["models"] for n in names)
