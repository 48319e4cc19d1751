"""``summary.json`` of ``bench/gpu_check.sh``: the figures of every stage's report, in one file.

The check's stages leave their reports in a work folder:

- ``stages.jsonl``: one line per stage (``stage``, ``status``: ok, failed, timed_out or skipped,
  ``rc``, ``wall_s``, ``timeout_s``, ``note``);
- ``versions.json``: Python, torch, CUDA, Triton, transformers, the GPU's name, driver, memory;
- ``pytest.xml``: the JUnit report of ``pytest -m gpu``;
- ``engine-<N>.json``: ``sluice bench engine`` at ``N`` sequences;
- ``decode.json``: :mod:`bench.gpu_decode`'s batch-1 decode step, graphs off and on;
- ``load-<C>/results.json``: ``sluice bench load`` at concurrency ``C``.

:func:`build_summary` keeps the figures the issue asks for (tokens/s against Hugging Face and the
ratios, the decode step and its graphs speed-up, TTFT and TPOT p50/p99), checks them against the
targets (:data:`TARGETS`), and puts the GPU's name and the versions at the top and beside each
figure group. A stage whose report is missing appears as ``None`` (its status says why).
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

MODEL = "random weights, SmolLM2-135M architecture (bench/gpu_model.py: seed 0, saved in bfloat16)"
# The targets for a lent machine's run: (figure, at least).
TARGETS = {"sluice_vs_sequential": 10.0, "sluice_vs_best_hf": 2.0, "cuda_graphs_decode_speedup": 3.0}


def build_summary(work: Path, dry_run: bool) -> dict[str, Any]:
    """The summary of the check whose stage reports are in ``work`` (see the module docstring)."""
    provenance = _read_json(work / "versions.json") or {}
    stages = _read_lines(work / "stages.jsonl")
    engine = {level: engine_figures(_read_json(work / f"engine-{level}.json")) for level in _levels(stages, "engine-")}
    load = {level: load_figures(_read_json(work / f"load-{level}" / "results.json")) for level in _levels(stages, "load-")}
    decode = _read_json(work / "decode.json")
    decode_figures = None if decode is None else {k: decode.get(k) for k in ("graphs_off", "graphs_on", "speedup", "workload")}
    return {
        "gpu_name": provenance.get("gpu_name"),
        "versions": provenance,
        "dry_run": dry_run,
        "model": MODEL,
        "stages": stages,
        "pytest_gpu": pytest_counts(work / "pytest.xml"),
        "engine": {"provenance": provenance, "by_num_seqs": engine},
        "decode_batch_1": {"provenance": provenance, **(decode_figures or {"figures": None})},
        "load": {"provenance": provenance, "by_concurrency": load},
        "targets": targets(engine, decode_figures),
    }


def engine_figures(report: dict[str, Any] | None) -> dict[str, Any] | None:
    """Tokens/s of each system, Sluice's ratios, the best HF system, greedy agreement, workload."""
    if report is None:
        return None
    ratios = report.get("ratios", {})
    best = report.get("best_hf")
    return {
        "tokens_per_s": report["tokens_per_s"],
        "sluice_vs_sequential": ratios.get("sluice_vs_sequential"),
        "sluice_vs_best_hf": ratios.get("sluice_vs_best_hf"),
        "best_hf_system": None if best is None else best["system"],
        "sluice_matches_sequential": report.get("sluice_matches_sequential"),
        "compared": report.get("compared"),
        "skipped": report.get("skipped", {}),
        "failed": report.get("failed", {}),
        "sluice_runner_options": report.get("sluice_runner_options"),
        "workload": report.get("workload"),
    }


def load_figures(report: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per step: requests and output tokens per second, TTFT and TPOT p50/p99 (ms), errors."""
    if report is None:
        return None
    steps = []
    for step in report["steps"]:
        latency = {
            f"{name}_{q}": None if step[name] is None else step[name][q]
            for name in ("ttft_ms", "tpot_ms") for q in ("p50", "p99")
        }
        steps.append({
            "concurrency": step["load"], "num_requests": step["num_requests"], "num_completed": step["num_completed"],
            "num_errors": step["num_errors"], "requests_per_s": step["requests_per_s"],
            "output_tokens_per_s": step["output_tokens_per_s"], **latency, "error_samples": step["error_samples"],
        })
    return steps[0] if len(steps) == 1 else {"steps": steps}


def pytest_counts(path: Path) -> dict[str, int] | None:
    """Tests, failures, errors and skipped of a JUnit XML report (``None`` without one)."""
    if not path.exists():
        return None
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def targets(engine: dict[str, Any], decode: dict[str, Any] | None) -> dict[str, Any]:
    """Each target of :data:`TARGETS` with its measured values and whether every one meets it
    (``met``: ``None`` when nothing was measured)."""
    measured: dict[str, dict[str, float | None]] = {
        name: {level: (figures or {}).get(name) for level, figures in engine.items()}
        for name in ("sluice_vs_sequential", "sluice_vs_best_hf")
    }
    measured["cuda_graphs_decode_speedup"] = {"1": None if decode is None else decode.get("speedup")}
    report = {}
    for name, at_least in TARGETS.items():
        values = [v for v in measured[name].values() if v is not None]
        report[name] = {"at_least": at_least, "measured": measured[name], "met": all(v >= at_least for v in values) if values else None}
    return report


def _levels(stages: list[dict[str, Any]], prefix: str) -> list[str]:
    """The levels of the stages named ``<prefix><level>`` (``engine-16``: ``16``), in run order."""
    return [s["stage"].removeprefix(prefix) for s in stages if s["stage"].startswith(prefix)]


def _read_json(path: Path) -> Any:
    """The JSON in ``path``, or ``None`` when it is missing or unreadable (a failed stage)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
