"""The arithmetic of ``sluice bench peers``: per-system records, the ratios, the README table and
the plots.

Everything here but :func:`write_plots` is pure. A system's record is ``{"status": "ok" |
"failed", "error", "version", "startup_s", "steps"}``, each step ``{"concurrency",
"output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p50",
"itl_ms_p99", "num_completed", "num_errors", "error_samples"}`` (milliseconds, tokens per second;
ITL: the gaps between a stream's chunks, over every stream; absent in records from before it was
measured). A ratio is
``None`` when either side has no figure (a failed peer, a step with no completed request).
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

SLUICE = "sluice"
LLAMA_SERVER = "llama-server"
# The figures compared Sluice / peer, per concurrency, with which way is better for Sluice.
RATIO_FIGURES = ("output_tokens_per_s", "tpot_ms_p50", "ttft_ms_p50")


class SystemStatus(str, Enum):
    """How a system's turn ended: measured, or failed to build, install or start."""

    OK = "ok"
    FAILED = "failed"


def step_record(load_step: dict[str, Any]) -> dict[str, Any]:
    """One step of a system's record from a ``sluice bench load`` step (``load_report.step_stats``)."""
    ttft, tpot, itl = load_step["ttft_ms"] or {}, load_step["tpot_ms"] or {}, load_step.get("itl_ms") or {}
    return {
        "concurrency": int(load_step["load"]),
        "output_tokens_per_s": load_step["output_tokens_per_s"],
        "ttft_ms_p50": ttft.get("p50"),
        "ttft_ms_p99": ttft.get("p99"),
        "tpot_ms_p50": tpot.get("p50"),
        "tpot_ms_p99": tpot.get("p99"),
        "itl_ms_p50": itl.get("p50"),
        "itl_ms_p99": itl.get("p99"),
        "num_completed": load_step["num_completed"],
        "num_errors": load_step["num_errors"],
        "error_samples": load_step["error_samples"],
    }


def ok_record(version: dict[str, Any], startup_s: float, load_steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The record of a system that served: its version, seconds to serve and its steps."""
    steps = [step_record(s) for s in load_steps]
    return {"status": SystemStatus.OK.value, "error": None, "version": version, "startup_s": startup_s, "steps": steps}


def failed_record(version: dict[str, Any], error: str) -> dict[str, Any]:
    """The record of a system that could not be built, installed or started: ``error`` says why."""
    return {"status": SystemStatus.FAILED.value, "error": error, "version": version, "startup_s": None, "steps": []}


def figure(record: dict[str, Any] | None, concurrency: int, name: str) -> float | None:
    """One figure of a system at ``concurrency``, ``None`` when it has none (or no completed request)."""
    if record is None:
        return None
    for step in record["steps"]:
        if step["concurrency"] == concurrency and step["num_completed"] > 0:
            value = step.get(name)
            return None if value is None else float(value)
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def best_peer(systems: dict[str, dict[str, Any]], concurrency: int) -> str | None:
    """The peer (not Sluice) with the most output tokens/s at ``concurrency``; ``None`` if none measured."""
    scored = [(v, name) for name, rec in systems.items() if name != SLUICE
              if (v := figure(rec, concurrency, "output_tokens_per_s")) is not None]
    return max(scored)[1] if scored else None


def ratio_table(systems: dict[str, dict[str, Any]], concurrencies: list[int]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Sluice / each peer: ``{peer: {concurrency: {figure: ratio}}}`` over ``RATIO_FIGURES``
    (tokens/s above 1 and milliseconds below 1 are Sluice ahead)."""
    sluice = systems.get(SLUICE)
    return {
        name: {
            str(c): {f: _ratio(figure(sluice, c, f), figure(rec, c, f)) for f in RATIO_FIGURES} for c in concurrencies
        }
        for name, rec in systems.items()
        if name != SLUICE
    }


def headline_ratios(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets: Sluice's c1 TPOT p50 over llama-server's, Sluice's output tokens/s
    over the best peer's at concurrency 16 and 32 (with that peer's name), and Sluice's ITL p99 over
    its ITL p50 at concurrency 4 and 16 (how far its streams stall)."""
    sluice = systems.get(SLUICE)
    ratios: dict[str, Any] = {
        "c1_tpot_p50_sluice_over_llama_server": _ratio(
            figure(sluice, 1, "tpot_ms_p50"), figure(systems.get(LLAMA_SERVER), 1, "tpot_ms_p50")
        ),
    }
    for c in (16, 32):
        peer = best_peer(systems, c)
        peer_tps = None if peer is None else figure(systems[peer], c, "output_tokens_per_s")
        ratios[f"c{c}_output_tps_sluice_over_best_peer"] = _ratio(figure(sluice, c, "output_tokens_per_s"), peer_tps)
        ratios[f"c{c}_best_peer"] = peer
    for c in (4, 16):
        ratios[f"c{c}_itl_p99_over_p50"] = _ratio(figure(sluice, c, "itl_ms_p99"), figure(sluice, c, "itl_ms_p50"))
    return ratios


def _cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def format_readme(results: dict[str, Any]) -> str:
    """docs/peers/README.md: the machine, the workload, one table row per system and concurrency,
    the ratios and each failed system's error."""
    cpu, work = results["cpu"], results["workload"]
    lines = [
        "# Sluice against its peers (`sluice bench peers`)",
        "",
        f"Written by `sluice bench peers` at {results['finished_at']} (load average {results['load_average']}).",
        f"CPU: {cpu['model_name']}, {cpu['num_cores']} cores; flags {', '.join(cpu['key_flags']) or 'none'}. "
        f"Model: {results['model']}.",
        f"Workload: {work['prompt_tokens_min']}-{work['prompt_tokens_max']} prompt tokens (mean "
        f"{work['prompt_tokens_mean']:.0f}) of `pydoc_data` prose, {work['output_tokens']} new tokens, greedy, "
        f"end-of-sequence ignored, seed {work['seed']}, {work['step_duration_s']:g} s per step. "
        "All figures in `results.json`.",
        "",
        "| system | concurrency | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
        "| ITL p50 ms | ITL p99 ms | done | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, rec in results["systems"].items():
        if rec["status"] != SystemStatus.OK.value:
            lines.append(f"| {name} | - | failed | - | - | - | - | - | - | - | - |")
            continue
        for s in rec["steps"]:
            lines.append(
                f"| {name} | {s['concurrency']} | {_cell(s['output_tokens_per_s'])} | {_cell(s['ttft_ms_p50'])} | "
                f"{_cell(s['ttft_ms_p99'])} | {_cell(s['tpot_ms_p50'])} | {_cell(s['tpot_ms_p99'])} | "
                f"{_cell(s.get('itl_ms_p50'))} | {_cell(s.get('itl_ms_p99'))} | {s['num_completed']} | {s['num_errors']} |"
            )
    lines += ["", "Ratios (targets: c1 TPOT ≤ 1.0, c16 and c32 tokens/s ≥ 2.0, c4 and c16 ITL p99/p50 ≤ 3):", ""]
    lines += [f"- `{k}`: {_cell(v, 2) if isinstance(v, float) else v}" for k, v in results["ratios"].items()]
    failed = [(n, r) for n, r in results["systems"].items() if r["status"] != SystemStatus.OK.value]
    for name, rec in failed:
        lines += ["", f"**{name} failed:**", "", "```", rec["error"].strip(), "```"]
    lines += ["", "![output tokens/s](output_tps.png) ![TPOT p50](tpot_p50.png)", ""]
    return "\n".join(lines)


def write_plots(systems: dict[str, dict[str, Any]], folder: Path) -> list[Path]:
    """``output_tps.png`` and ``tpot_p50.png`` in ``folder``: one line per measured system against
    the concurrency (log 2 axis). Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    paths = []
    for filename, name, ylabel in (
        ("output_tps.png", "output_tokens_per_s", "output tokens/s"),
        ("tpot_p50.png", "tpot_ms_p50", "TPOT p50 (ms)"),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        loads: list[int] = []
        for system, rec in systems.items():
            points = [(s["concurrency"], s[name]) for s in rec["steps"] if s[name] is not None and s["num_completed"]]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=system)
                loads = sorted(set(loads) | {p[0] for p in points})
        if loads:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticks(loads, labels=[str(x) for x in loads])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        paths.append(folder / filename)
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths
