"""The layering of ARCHITECTURE.md, checked with ast: arrows point down only, and no circles.

``models/`` never imports ``gateway/`` or ``buckets/``; ``policies/`` imports nothing of ours;
``buckets/`` never imports ``gateway/``; no core package imports ``bench/``. No import circle
among our modules, inside a package too. ``bench/`` imports nothing of ours but itself and the
engine's public API (:data:`ENGINE_PUBLIC_API`). Every import counts: inside functions (lazy
imports) and under ``if TYPE_CHECKING:`` too, since a circle that is only hidden at run time
is still a circle in the design.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
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


# What bench/ may import of ours (besides bench/ itself): the engine's public API. The engine
# benchmark drives the core directly, as a library user would: load a model, build a runner or
# a batcher with its settings, submit requests, read stats; the load generator and the tuner
# talk HTTP, and read only the tuner's policy. The HTTP app, routes, admin, the slices, the
# scheduler and block manager, and the model backends' internals are not part of it. The gate
# benchmark (bench/gate_load.py) starts the gateway's command with a gate run the way it ran
# before its child process: it uses the gate's API (what ``sluice gate`` runs) and its seam. The
# KV dtype benchmark (bench/kv_dtype.py) calls the paged-attention kernel and the KV pool's
# quantizer directly, and the KV accuracy measure the gate uses. The auth benchmark
# (bench/auth_cost.py) times the API-key check and a request's quota book-keeping in process.
ENGINE_PUBLIC_API = frozenset({
    "gateway.engine", "gateway.config", "gateway.build", "gateway.memory",
    "gateway.auth", "gateway.quotas", "gateway.tenants",
    "gateway.cli", "gateway.gate", "gateway.gate_process",
    "models.loader", "models.source", "models.cpu_memory", "models.causal_lm", "models.step_io", "models.logprobs",
    "models.structured", "models.structured_sampling", "models.step_split", "models.lora",
    "models.paged_attention", "models.kv_cache", "models.kv_accuracy", "models.cuda_graphs",
    "buckets.continuous", "buckets.dynamic", "buckets.request", "buckets.settings", "buckets.stats",
    "policies.tuning",
})


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


# -- import circles ---------------------------------------------------------------------------


def our_modules() -> set[str]:
    """Every module of ours, dotted; a package is named by its folder (``buckets.slices``)."""
    names = set()
    for package in PACKAGES:
        for path in python_files(package):
            name = module_name(path)
            names.add(name.removesuffix(".__init__"))
    return names


def import_targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> list[str]:
    """Our modules that one import statement of ``module`` loads: the module named, a submodule
    for ``from package import submodule``, and each enclosing package whose ``__init__`` runs
    first (except those enclosing ``module`` itself, which are already loading)."""
    base = module if is_package else module.rpartition(".")[0]
    if isinstance(node, ast.Import):
        named = [alias.name for alias in node.names]
    elif node.level:
        parts = base.split(".")
        root = ".".join(parts[: len(parts) - (node.level - 1)])
        named = [f"{root}.{node.module}" if node.module else root]
    else:
        named = [node.module or ""]
    if isinstance(node, ast.ImportFrom):
        named += [f"{named[0]}.{alias.name}" for alias in node.names if f"{named[0]}.{alias.name}" in known]
    own_packages = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1 + is_package)}
    targets = []
    for name in named:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in known and prefix not in own_packages and prefix != module:
                targets.append(prefix)
    return targets


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """``module -> our modules it imports`` (lazy and ``TYPE_CHECKING`` imports included) for
    ``sources``: ``module -> (its source, whether it is a package's __init__)``."""
    known = set(sources)
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, (source, is_package) in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(import_targets(node, name, is_package, known))
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one
    module (Tarjan's algorithm), each sorted, as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def our_sources() -> dict[str, tuple[str, bool]]:
    sources = {}
    for package in PACKAGES:
        for path in python_files(package):
            sources[module_name(path).removesuffix(".__init__")] = (path.read_text(), path.name == "__init__.py")
    return sources


def test_there_is_no_import_circle_among_our_modules() -> None:
    assert circles(import_graph(our_sources())) == []


def test_a_circle_hidden_in_a_function_or_under_type_checking_is_found() -> None:
    sources = {
        "gateway": ("", True),
        "gateway.engine": ("from gateway import runners\n", False),
        "gateway.runners": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gateway.engine import Engine\n", False),
        "gateway.worker": ("def main():\n    from .engine import Engine\n", False),
        "gateway.app": ("import gateway.worker\n", False),
        "buckets": ("from buckets.slices import thread\n", True),
        "buckets.slices": ("", True),
        "buckets.slices.thread": ("from ..bucket import Bucket\n", False),
        "buckets.bucket": ("from buckets.slices.thread import ThreadSlice\n", False),
    }
    graph = import_graph(sources)
    assert graph["gateway.app"] == {"gateway.worker"} and graph["gateway.worker"] == {"gateway.engine"}
    assert "buckets" not in graph["buckets.bucket"]  # its own package is already loading
    assert circles(graph) == [["buckets.bucket", "buckets.slices.thread"], ["gateway.engine", "gateway.runners"]]


def test_a_package_init_that_imports_its_submodules_is_no_circle() -> None:
    sources = {"models": ("from .loader import load\n", True), "models.loader": ("from models.source import x\n", False),
               "models.source": ("", False)}
    assert circles(import_graph(sources)) == []


# -- bench/ uses the engine's public API only ---------------------------------------------------


def bench_violations(modules: Iterable[tuple[str, str, int, str]]) -> list[str]:
    """``file:line imports name`` for each import of ours that is neither bench/ nor in
    :data:`ENGINE_PUBLIC_API`; ``modules`` holds ``(file, module, line, imported name)``."""
    ours = {p for p in PACKAGES if p != "bench"}
    bad = []
    for file, _, line, name in modules:
        if name.split(".")[0] in ours and name not in ENGINE_PUBLIC_API:
            bad.append(f"{file}:{line} imports {name}")
    return bad


def bench_imports() -> list[tuple[str, str, int, str]]:
    found = []
    for path in python_files("bench"):
        module = module_name(path)
        for line, name in imported_modules(path.read_text(), module):
            found.append((str(path.relative_to(ROOT)), module, line, name))
    return found


def test_bench_imports_only_the_engines_public_api() -> None:
    assert bench_violations(bench_imports()) == []


def test_a_bench_import_of_an_engine_internal_is_reported() -> None:
    imports = [("bench/x.py", "bench.x", 3, "buckets.scheduler"), ("bench/x.py", "bench.x", 4, "gateway.config"),
               ("bench/x.py", "bench.x", 5, "bench.workload"), ("bench/x.py", "bench.x", 6, "torch")]
    assert bench_violations(imports) == ["bench/x.py:3 imports buckets.scheduler"]
