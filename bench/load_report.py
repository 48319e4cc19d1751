"""The arithmetic of ``sluice bench load``: per-step statistics, goodput, knee detection,
per-bucket attribution, baseline comparison, the summary table and the plots.

Everything here but :func:`write_plots` is pure: plain values in, plain values out, so the
tests check it without a server. Times inside :class:`RequestResult` are seconds; every
statistic written out is in milliseconds (``*_ms``) or per second (``*_per_s``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The latency statistics each step reports, with the percentiles they carry.
PERCENTILES = (50, 95, 99)
# Fields compared with a baseline: (step field, statistic, which way is worse).
BASELINE_CHECKS = (
    ("requests_per_s", None, "lower"),
    ("ttft_ms", "p95", "higher"),
    ("tpot_ms", "p95", "higher"),
)


@dataclass
class RequestResult:
    """What one request measured, client side; times are seconds from the step's start.

    Fields:
        ok: the server answered 200 and the stream ended cleanly.
        status: the HTTP status, ``None`` when the transport failed.
        error: why it failed, ``None`` when ``ok``.
        start_s: when it was sent.
        ttft_s: first chunk with content, from ``start_s``; ``None`` if none came.
        e2e_s: the whole request, from ``start_s``.
        itl_s: gaps between consecutive content chunks.
        num_output_tokens: from the usage chunk, else the number of content chunks.
        num_prompt_tokens: from the usage chunk, ``None`` without one.
        bucket, queue_ms, prefill_ms: Sluice's ``x-sluice-*`` response headers, ``None`` elsewhere.
    """

    ok: bool
    status: int | None = None
    error: str | None = None
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None
    bucket: str | None = None
    queue_ms: float | None = None
    prefill_ms: float | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: ``(E2E - TTFT) / (output tokens - 1)``."""
        if self.ttft_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict[str, float] | None:
    """``{mean, p50, p95, p99}`` of ``values``, or ``None`` when there are none."""
    if not values:
        return None
    stats = {"mean": sum(values) / len(values)}
    stats.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return stats


def meets_slo(result: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Whether a finished request met both SLOs (an absent SLO, or an undefined TPOT, is met)."""
    if not result.ok or result.ttft_s is None:
        return False
    if slo_ttft_ms is not None and result.ttft_s * 1000 > slo_ttft_ms:
        return False
    tpot_s = result.tpot_s
    return slo_tpot_ms is None or tpot_s is None or tpot_s * 1000 <= slo_tpot_ms


def goodput_per_s(
    results: Sequence[RequestResult], duration_s: float, slo_ttft_ms: float | None, slo_tpot_ms: float | None
) -> float | None:
    """Requests per second meeting the SLOs; ``None`` when no SLO was given."""
    if slo_ttft_ms is None and slo_tpot_ms is None:
        return None
    return sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in results) / duration_s


def _ms(values: list[float | None]) -> dict[str, float] | None:
    return summarize([v * 1000 for v in values if v is not None])


def step_stats(
    load: float,
    results: Sequence[RequestResult],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    mean_queue_depth: float | None = None,
) -> dict[str, Any]:
    """One sweep step's report from its requests and wall ``duration_s``."""
    done = [r for r in results if r.ok]
    return {
        "load": load,
        "num_requests": len(results),
        "num_completed": len(done),
        "num_errors": sum(not r.ok and r.status != 429 for r in results),
        "num_429": sum(r.status == 429 for r in results),
        "duration_s": duration_s,
        "requests_per_s": len(done) / duration_s,
        "output_tokens_per_s": sum(r.num_output_tokens for r in done) / duration_s,
        "ttft_ms": _ms([r.ttft_s for r in done]),
        "tpot_ms": _ms([r.tpot_s for r in done]),
        "itl_ms": _ms([gap for r in done for gap in r.itl_s]),
        "e2e_ms": _ms([r.e2e_s for r in done]),
        "goodput_per_s": goodput_per_s(results, duration_s, slo_ttft_ms, slo_tpot_ms),
        "mean_queue_depth": mean_queue_depth,
        "buckets": bucket_stats(done, duration_s),
        # up to 3 distinct failure messages, so a step of errors says why
        "error_samples": sorted({r.error for r in results if not r.ok and r.error})[:3],
    }


def _mean_p95(values: list[float | None]) -> dict[str, float] | None:
    stats = summarize([v for v in values if v is not None])
    return None if stats is None else {"mean": stats["mean"], "p95": stats["p95"]}


def bucket_stats(done: Sequence[RequestResult], duration_s: float) -> dict[str, dict[str, Any]]:
    """Per ``x-sluice-bucket``: count, rate, and queue wait, prefill, decode (E2E - TTFT) and
    TTFT in ms. Empty when the server sent no bucket header."""
    groups: dict[str, list[RequestResult]] = {}
    for r in done:
        if r.bucket is not None:
            groups.setdefault(r.bucket, []).append(r)
    return {
        name: {
            "count": len(rs),
            "requests_per_s": len(rs) / duration_s,
            "queue_ms": _mean_p95([r.queue_ms for r in rs]),
            "prefill_ms": _mean_p95([r.prefill_ms for r in rs]),
            "decode_ms": _mean_p95([(r.e2e_s - r.ttft_s) * 1000 if r.ttft_s is not None else None for r in rs]),
            "ttft_ms": _mean_p95([r.ttft_s * 1000 if r.ttft_s is not None else None for r in rs]),
        }
        for name, rs in sorted(groups.items())
    }


def find_knee(
    qps: Sequence[float], p95_ttft_ms: Sequence[float | None], knee_gain: float = 0.10, knee_latency: float = 0.50
) -> int | None:
    """The index of the first step whose QPS grew by less than ``knee_gain`` (a fraction) over
    the step before while its p95 TTFT grew by more than ``knee_latency``: where more load stops
    buying throughput and starts costing latency. ``None`` when no step qualifies (or a step
    lacks data)."""
    for i in range(1, len(qps)):
        prev_qps, prev_ttft, ttft = qps[i - 1], p95_ttft_ms[i - 1], p95_ttft_ms[i]
        if prev_qps <= 0 or prev_ttft is None or ttft is None or prev_ttft <= 0:
            continue
        if qps[i] / prev_qps - 1 < knee_gain and ttft / prev_ttft - 1 > knee_latency:
            return i
    return None


def step_knee(steps: Sequence[dict[str, Any]], knee_gain: float, knee_latency: float) -> int | None:
    """:func:`find_knee` over a report's steps."""
    qps = [s["requests_per_s"] for s in steps]
    ttft = [s["ttft_ms"]["p95"] if s["ttft_ms"] else None for s in steps]
    return find_knee(qps, ttft, knee_gain, knee_latency)


def bucket_knees(steps: Sequence[dict[str, Any]], knee_gain: float, knee_latency: float) -> dict[str, float | None]:
    """Per bucket, the load at which that bucket's own QPS and p95 TTFT show a knee (``None``
    if none); only when the steps saw more than one bucket."""
    names = sorted({name for s in steps for name in s["buckets"]})
    if len(names) < 2:
        return {}
    knees: dict[str, float | None] = {}
    for name in names:
        rows = [(s["load"], s["buckets"].get(name)) for s in steps]
        qps = [b["requests_per_s"] if b else 0.0 for _, b in rows]
        ttft = [b["ttft_ms"]["p95"] if b and b["ttft_ms"] else None for _, b in rows]
        index = find_knee(qps, ttft, knee_gain, knee_latency)
        knees[name] = None if index is None else rows[index][0]
    return knees


def compare_with_baseline(
    steps: Sequence[dict[str, Any]], baseline_steps: Sequence[dict[str, Any]], tolerance: float
) -> tuple[list[str], int]:
    """Regressions of ``steps`` against ``baseline_steps`` matched by load: QPS lower, or p95
    TTFT or TPOT higher, by more than ``tolerance`` (a fraction). Returns (one line per
    regression, number of steps matched)."""
    base_by_load = {s["load"]: s for s in baseline_steps}
    regressions: list[str] = []
    matched = 0
    for step in steps:
        base = base_by_load.get(step["load"])
        if base is None:
            continue
        matched += 1
        for name, stat, worse in BASELINE_CHECKS:
            now, before = _stat(step, name, stat), _stat(base, name, stat)
            if now is None or before is None or before <= 0:
                continue
            change = now / before - 1
            if (worse == "lower" and change < -tolerance) or (worse == "higher" and change > tolerance):
                label = name if stat is None else f"{stat} {name}"
                regressions.append(f"load {_fmt_load(step['load'])}: {label} {before:.4g} -> {now:.4g} ({change:+.1%})")
    return regressions, matched


def _stat(step: dict[str, Any], name: str, stat: str | None) -> float | None:
    value = step.get(name)
    if stat is None or value is None:
        return value
    return value.get(stat)


def _fmt_load(load: float) -> str:
    return "inf" if math.isinf(load) else f"{load:g}"


def _cell(stats: dict[str, float] | None, key: str) -> str:
    return "-" if stats is None else f"{stats[key]:.1f}"


def format_table(steps: Sequence[dict[str, Any]], load_name: str, knee: int | None) -> str:
    """The summary table: one row per step; the knee's row is marked with ``<- knee``."""
    header = (
        f"{load_name:>11} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'p95':>8} {'p99':>8} "
        f"{'TPOT p50':>9} {'p95':>7} {'ITL p50':>8} {'p95':>7} {'p99':>7} {'E2E p95':>8} {'err':>4} {'429':>4} "
        f"{'good/s':>7} {'queue':>6}"
    )
    lines = [header, "-" * len(header)]
    for i, s in enumerate(steps):
        good = "-" if s["goodput_per_s"] is None else f"{s['goodput_per_s']:.2f}"
        queue = "-" if s["mean_queue_depth"] is None else f"{s['mean_queue_depth']:.1f}"
        lines.append(
            f"{_fmt_load(s['load']):>11} {s['requests_per_s']:>7.2f} {s['output_tokens_per_s']:>8.1f} "
            f"{_cell(s['ttft_ms'], 'p50'):>9} {_cell(s['ttft_ms'], 'p95'):>8} {_cell(s['ttft_ms'], 'p99'):>8} "
            f"{_cell(s['tpot_ms'], 'p50'):>9} {_cell(s['tpot_ms'], 'p95'):>7} {_cell(s['itl_ms'], 'p50'):>8} "
            f"{_cell(s['itl_ms'], 'p95'):>7} {_cell(s['itl_ms'], 'p99'):>7} "
            f"{_cell(s['e2e_ms'], 'p95'):>8} {s['num_errors']:>4} {s['num_429']:>4} {good:>7} {queue:>6}"
            + ("  <- knee" if i == knee else "")
        )
    return "\n".join(lines)


def format_buckets(steps: Sequence[dict[str, Any]], load_name: str) -> str | None:
    """Per-bucket attribution (ms, mean/p95), one row per step and bucket; ``None`` without buckets."""
    rows = [(s["load"], name, b) for s in steps for name, b in s["buckets"].items()]
    if not rows:
        return None
    header = f"{load_name:>11} {'bucket':<24} {'count':>5} {'queue mean/p95':>16} {'prefill mean/p95':>18} {'decode mean/p95':>17}"
    lines = [header, "-" * len(header)]
    for load, name, b in rows:
        cells = [
            "-" if b[key] is None else f"{b[key]['mean']:.1f}/{b[key]['p95']:.1f}"
            for key in ("queue_ms", "prefill_ms", "decode_ms")
        ]
        lines.append(f"{_fmt_load(load):>11} {name:<24} {b['count']:>5} {cells[0]:>16} {cells[1]:>18} {cells[2]:>17}")
    return "\n".join(lines)


def write_plots(
    steps: Sequence[dict[str, Any]], load_name: str, knee: int | None, folder: Path, knees_by_bucket: dict[str, float | None] | None = None
) -> list[Path]:
    """QPS, TTFT percentiles and TPOT percentiles against the load, knee marked, as PNGs in
    ``folder``; with buckets, also each bucket's p95 TTFT with its own knee. Returns the paths."""
    finite = [s for s in steps if not math.isinf(s["load"])]
    loads = [s["load"] for s in finite]
    knee_load = steps[knee]["load"] if knee is not None else None
    marks = {"knee": knee_load} if knee_load is not None else {}
    charts = [
        ("qps.png", "requests/s", [("requests/s", [s["requests_per_s"] for s in finite])], marks),
        ("ttft.png", "TTFT (ms)", [(f"p{q}", [_stat(s, "ttft_ms", f"p{q}") for s in finite]) for q in PERCENTILES], marks),
        ("tpot.png", "TPOT (ms)", [(f"p{q}", [_stat(s, "tpot_ms", f"p{q}") for s in finite]) for q in PERCENTILES], marks),
    ]
    names = sorted({name for s in finite for name in s["buckets"]})
    if names:
        series = [(name, [_bucket_p95_ttft(s, name) for s in finite]) for name in names]
        bucket_marks = {f"knee {name}": load for name, load in (knees_by_bucket or {}).items() if load is not None}
        charts.append(("buckets.png", "p95 TTFT per bucket (ms)", series, bucket_marks))
    paths = []
    for filename, ylabel, lines, knee_marks in charts:
        paths.append(folder / filename)
        _plot(paths[-1], load_name, ylabel, loads, lines, knee_marks)
    return paths


def _bucket_p95_ttft(step: dict[str, Any], name: str) -> float | None:
    bucket = step["buckets"].get(name)
    return bucket["ttft_ms"]["p95"] if bucket and bucket["ttft_ms"] else None


def _plot(
    path: Path, xlabel: str, ylabel: str, loads: list[float], lines: list[tuple[str, list[Any]]], marks: dict[str, float]
) -> None:
    """One line chart against the load, with a dashed vertical line at each of ``marks``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, values in lines:
        points = [(x, y) for x, y in zip(loads, values) if y is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    for (label, load), color in zip(marks.items(), ("red", "purple", "brown", "olive")):
        if not math.isinf(load):
            ax.axvline(load, color=color, linestyle="--", label=f"{label} ({_fmt_load(load)})")
    if len(loads) > 1 and min(loads) > 0 and max(loads) / min(loads) >= 8:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(loads, labels=[_fmt_load(x) for x in loads])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
