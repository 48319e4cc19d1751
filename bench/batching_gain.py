"""``sluice bench batching``: what batching buys on a running Sluice gateway.

The same sweep (any ``sluice bench load`` options) runs twice against one model: first as the
gateway is configured, then with every bucket of the model serving one request at a time
(``max_num_seqs: 1`` for continuous buckets; ``max_batch_size: 1`` and ``max_queue_delay_ms: 0``
for dynamic ones), set through the admin API and put back afterwards. Both runs use the same
prompts (same seed) and the same server process, one after the other. It prints the peak
goodput (requests/s within ``--slo-ttft-ms`` / ``--slo-tpot-ms``) and peak QPS of each, their
ratios, and the knees, and writes ``batched/`` and ``one_at_a_time/`` (each a ``bench load``
output folder), ``summary.json`` and ``versus.png`` (goodput and p95 TTFT of both) to ``--output``.

``--model``, ``--output`` and ``--slo-ttft-ms`` and/or ``--slo-tpot-ms`` are required; an
embedding model is sent to ``/v1/embeddings`` whatever ``--endpoint`` says. The admin token comes
from ``--admin-token`` or ``SLUICE_ADMIN_TOKEN``. Exit codes: 0 done, 1 the admin API refused (a
bad token, a change), 2 bad options, 130 stopped by SIGINT or SIGTERM (knobs put back).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from bench import load, load_report
from bench.tune import TuneError, patch_bucket, run_stoppable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``bench load``'s options plus ``--admin-token``; ``--output`` and an SLO are required."""
    load.add_arguments(parser)
    parser.add_argument("--admin-token", default=os.environ.get("SLUICE_ADMIN_TOKEN"), help="default $SLUICE_ADMIN_TOKEN")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run both sweeps; return the exit code."""
    parser = argparse.ArgumentParser(prog="sluice bench batching", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Both sweeps and the comparison (see the module docstring)."""
    if not args.model or args.output is None or (args.slo_ttft_ms is None and args.slo_tpot_ms is None):
        print("sluice bench batching: error: give --model, --output and --slo-ttft-ms and/or --slo-tpot-ms", file=sys.stderr)
        return 2
    code, summary = run_stoppable(_compare(args), "sluice bench batching")
    if code == 0:
        print(format_summary(summary))
    return code


async def _compare(args: argparse.Namespace) -> dict[str, Any]:
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.admin_token}"} if args.admin_token else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30) as admin:
        response = await admin.get(f"/admin/models/{args.model}")
        if response.status_code != 200:
            refused = response.status_code in (401, 403)
            raise TuneError(f"GET /admin/models/{args.model}: HTTP {response.status_code}: {response.text[:300]}", 1 if refused else 2)
        described = response.json()
        task = described["config"]["task"]
        if task == "embed" and args.endpoint != "embeddings":
            print(f"{args.model} is an embedding model: sending to /v1/embeddings", file=sys.stderr)
            args.endpoint = "embeddings"
        elif task == "generate" and args.endpoint == "embeddings":
            raise TuneError(f"{args.model} generates text: use --endpoint completions or chat")
        reports = {"batched": await load.run_sweep(args)}
        originals = {}
        try:
            for entry, config in zip(described["buckets"], described["config"]["buckets"]):
                single, original = _one_at_a_time(entry["kind"], config["batcher"])
                await patch_bucket(admin, args.model, entry["name"], single)
                originals[entry["name"]] = original
            reports["one_at_a_time"] = await load.run_sweep(args)
        finally:
            for name, original in originals.items():
                await patch_bucket(admin, args.model, name, original)
    args.output.mkdir(parents=True, exist_ok=True)
    load_name = "rate (req/s)" if reports["batched"]["mode"] == "rate" else "concurrency"
    for name, report in reports.items():
        print(f"\n{name.replace('_', ' ')}:\n" + load_report.format_table(report["steps"], load_name, report["knee"]))
    for name, report in reports.items():
        folder = args.output / name
        folder.mkdir(exist_ok=True)
        plots = load_report.write_plots(report["steps"], load_name, report["knee"], folder, report["bucket_knees"])
        (folder / "results.json").write_text(json.dumps({**report, "plots": [p.name for p in plots]}, indent=2) + "\n")
    summary = summarize(reports, args)
    (args.output / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_versus_plot(reports, load_name, args.output / "versus.png")
    return summary


def _one_at_a_time(kind: str, batcher: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The PATCH that makes a bucket serve one request at a time, and the one that undoes it."""
    if kind == "continuous":
        return {"max_num_seqs": 1}, {"max_num_seqs": batcher["max_num_seqs"]}
    knobs = ("max_batch_size", "max_queue_delay_ms")
    return {"max_batch_size": 1, "max_queue_delay_ms": 0}, {k: batcher[k] for k in knobs}


def summarize(reports: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Peak goodput, peak QPS and the knee of each run, and the batched / one-at-a-time ratios."""
    runs = {}
    for name, report in reports.items():
        steps = report["steps"]
        best = max(steps, key=lambda s: s["goodput_per_s"] or 0.0)
        knee = report["knee"]
        runs[name] = {
            "peak_goodput_per_s": best["goodput_per_s"] or 0.0,
            "peak_goodput_load": best["load"],
            "peak_requests_per_s": max(s["requests_per_s"] for s in steps),
            "knee_load": None if knee is None else steps[knee]["load"],
        }
    batched, single = runs["batched"], runs["one_at_a_time"]
    return {
        "model": args.model,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "runs": runs,
        "goodput_ratio": _ratio(batched["peak_goodput_per_s"], single["peak_goodput_per_s"]),
        "requests_per_s_ratio": _ratio(batched["peak_requests_per_s"], single["peak_requests_per_s"]),
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def format_summary(summary: dict[str, Any]) -> str:
    """The comparison as a few lines of text."""
    slo = ", ".join(f"{k.removesuffix('_ms').upper()} <= {v:g} ms" for k, v in summary["slo"].items() if v is not None)
    lines = [f"\n{summary['model']}: batched vs one request at a time (SLO {slo})"]
    for name, run in summary["runs"].items():
        knee = "none" if run["knee_load"] is None else f"{run['knee_load']:g}"
        lines.append(
            f"  {name:14s} peak goodput {run['peak_goodput_per_s']:7.2f}/s at {run['peak_goodput_load']:g}, "
            f"peak QPS {run['peak_requests_per_s']:7.2f}, knee {knee}"
        )
    for key, label in (("goodput_ratio", "peak goodput"), ("requests_per_s_ratio", "peak QPS")):
        value = summary[key]
        lines.append(f"  {label} ratio: " + ("n/a (0 one at a time)" if value is None else f"{value:.2f}x"))
    return "\n".join(lines)


def write_versus_plot(reports: dict[str, dict[str, Any]], load_name: str, path: Path) -> None:
    """Goodput (left) and p95 TTFT (right, log scale) against the load, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, report in reports.items():
        steps = report["steps"]
        loads = [s["load"] for s in steps]
        label = name.replace("_", " ")
        left.plot(loads, [s["goodput_per_s"] or 0.0 for s in steps], marker="o", label=label)
        ttft = [(s["load"], s["ttft_ms"]["p95"]) for s in steps if s["ttft_ms"]]
        right.plot([t[0] for t in ttft], [t[1] for t in ttft], marker="o", label=label)
    loads = [s["load"] for s in reports["batched"]["steps"]]
    for ax, ylabel in ((left, "goodput (requests/s within SLO)"), (right, "p95 TTFT (ms)")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(loads, labels=[f"{x:g}" for x in loads])
        ax.set_xlabel(load_name)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    if any(line.get_ydata().size for line in right.get_lines()):
        right.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
