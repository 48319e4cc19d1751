"""Dashboards: ``GET /dashboard`` lists every servable model (loaded or not) with its status and
resident bytes, the gateway's memory budget, and every bucket with its headline figures, all from
``GET /dashboard/api``; ``GET /dashboard/{model}/{bucket}`` draws live charts from ``GET /dashboard/api/{model}/{bucket}``,
which the page polls every second.

The pages work offline: the charts are drawn by Plotly, whose minified bundle the ``plotly``
package ships (``plotly/package_data/plotly.min.js``), served here with our own script from
``gateway/static/``. Model names may hold ``/``, bucket names may not, so the last path segment
is the bucket and the rest the model.
"""

from __future__ import annotations

import functools
import hashlib
import html
import math
import time
from dataclasses import asdict
from importlib import metadata, resources
from pathlib import Path
from typing import Any
from urllib.parse import quote

from litestar import Controller, MediaType, Request, get
from litestar.response import File

from buckets.bucket import Bucket
from gateway import memory
from gateway.engine import Engine, ServedModel
from gateway.errors import APIError, model_not_found
from gateway.metrics import Metrics, RequestTiming
from gateway.outcome import Outcome
from gateway.residency import Residency, describe_state
from models.kv_plan import format_bytes

# Latency percentiles over the requests finished in the last minute; throughput over 10 s.
LATENCY_WINDOW_S = 60.0
RATE_WINDOW_S = 10.0
# The static files never change within a version; their URLs carry it, so caches may keep them.
STATIC_CACHE_CONTROL = "public, max-age=31536000, immutable"
STATIC_DIR = Path(__file__).parent / "static"
# The page reloads itself this often (seconds); the bucket pages poll every second instead.
INDEX_REFRESH_S = 5


def plotly_js_path() -> Path:
    """The minified Plotly bundle the ``plotly`` package ships."""
    return Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))


def _static_files() -> dict[str, Path]:
    return {"plotly.min.js": plotly_js_path(), "dashboard.js": STATIC_DIR / "dashboard.js"}


@functools.cache
def _static_version() -> str:
    """Part of the static files' URLs: Plotly's version and a digest of our script."""
    digest = hashlib.sha256((STATIC_DIR / "dashboard.js").read_bytes()).hexdigest()[:12]
    return f"{metadata.version('plotly')}-{digest}"


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``; ``None`` when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(timings: list[RequestTiming], now_s: float) -> dict[str, Any]:
    """Latency percentiles (seconds) of the ``ok`` requests finished in the last ``LATENCY_WINDOW_S``,
    and the requests and generated tokens per second finished in the last ``RATE_WINDOW_S``
    (``now_s`` on the same monotonic clock as ``finished_s``)."""
    recent = [t for t in timings if now_s - t.finished_s <= LATENCY_WINDOW_S and t.outcome == Outcome.OK]
    ttft = [t.ttft_s for t in recent if t.ttft_s is not None]
    tpot = [t.tpot_s for t in recent if t.tpot_s is not None]
    in_rate_window = [t for t in timings if now_s - t.finished_s <= RATE_WINDOW_S]
    return {
        "window_s": LATENCY_WINDOW_S,
        "num_requests": len(recent),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "rate_window_s": RATE_WINDOW_S,
        "requests_per_s": len(in_rate_window) / RATE_WINDOW_S,
        "tokens_per_s": sum(t.completion_tokens for t in in_rate_window) / RATE_WINDOW_S,
    }


def bucket_snapshot(served: ServedModel, bucket: Bucket, metrics: Metrics, now_s: float) -> dict[str, Any]:
    """Everything the bucket page draws: current state, cumulative counters (the page turns
    them into rates between polls), recent latencies and throughput, the bucket's config, and its backend (configured, running,
    gate record in brief, gate state: ``pending`` while a background gate has yet to run,
    ``building`` while its record's backend has yet to be built).
    ``time_s`` is the server's monotonic clock, so the page divides counter deltas by it."""
    stats = bucket.stats()
    config = next((b for b in served.config.buckets if b.bucket_name == bucket.name), None)
    return {
        "model": served.config.name,
        "bucket": bucket.name,
        "task": served.config.task,
        "state": served.state,
        "kind": stats.kind,
        "slice": bucket.device_slice.name,
        "slice_busy_ratio": bucket.device_slice.busy_ratio(),
        "max_input_tokens": bucket.max_input_tokens,
        "time_s": now_s,
        "num_waiting": stats.num_waiting,
        "num_running": stats.num_running,
        "kv_usage": stats.kv_usage,
        "mean_batch_seqs": stats.mean_batch_seqs,
        "counters": asdict(stats),
        "recent": summarize(metrics.recent(served.config.name, bucket.name), now_s),
        "config": config.model_dump(mode="json") if config is not None else None,
        "backend": bucket.backend_info,
    }


def model_rows(residency: Residency, resident_bytes: dict[str, int]) -> list[dict[str, Any]]:
    """One row per servable model, loaded or not: its ``status`` (:func:`describe_state`), its
    bucket names and ``resident_bytes`` (from ``resident_bytes``, :meth:`Residency.resident_bytes`);
    no buckets and ``resident_bytes`` None while it is not loaded."""
    rows = []
    for model in list(residency.engine.config.models):
        served = residency.engine.models.get(model.name)
        rows.append({
            "model": model.name,
            "task": model.task,
            "load": model.load,
            "status": describe_state(residency, model.name),
            "buckets": [b.name for b in served.table.buckets] if served is not None else [],
            "resident_bytes": resident_bytes.get(model.name),
        })
    return rows


def overview(residency: Residency, metrics: Metrics, now_s: float) -> dict[str, Any]:
    """Everything the overview page shows: every servable model (:func:`model_rows`), every
    bucket of the loaded ones (:func:`bucket_snapshot`), the gateway's ``memory_budget_bytes``
    and the bytes the loaded models hold together (``resident_bytes``)."""
    resident_bytes = residency.resident_bytes()
    return {
        "models": model_rows(residency, resident_bytes),
        "buckets": [
            bucket_snapshot(served, bucket, metrics, now_s)
            for served in list(residency.engine.models.values())
            for bucket in served.table.buckets
        ],
        "memory_budget_bytes": residency.budgets[memory.GATEWAY_SCOPE],
        "resident_bytes": sum(resident_bytes.values()),
    }


def find_bucket(engine: Engine, target: str) -> tuple[ServedModel, Bucket]:
    """``"model/bucket"`` (a leading ``/`` allowed) to the served model and its bucket.

    Raises:
        APIError: 404 ``model_not_found`` or ``bucket_not_found``.
    """
    model, _, bucket_name = target.strip("/").rpartition("/")
    served = engine.models.get(model)
    if served is None:
        raise model_not_found(model or target.strip("/"))
    bucket = served.table.by_name(bucket_name)
    if bucket is None:
        raise APIError(
            404, f"The bucket '{bucket_name}' of model '{model}' does not exist", "not_found_error", "bucket", "bucket_not_found"
        )
    return served, bucket


def bucket_path(model: str, bucket: str) -> str:
    return f"/dashboard/{quote(model, safe='/:')}/{quote(bucket)}"


class DashboardController(Controller):
    """The dashboard pages, their JSON, and their scripts. Not part of the OpenAPI document."""

    path = "/dashboard"
    include_in_schema = False

    @get("/", media_type=MediaType.HTML)
    async def index(self, request: Request[Any, Any, Any]) -> str:
        return render_index(overview(request.app.state.residency, request.app.state.metrics, time.monotonic()))

    @get("/api")
    async def overview_api(self, request: Request[Any, Any, Any]) -> dict[str, Any]:
        return overview(request.app.state.residency, request.app.state.metrics, time.monotonic())

    @get("/api/{target:path}")
    async def bucket_api(self, request: Request[Any, Any, Any], target: str) -> dict[str, Any]:
        served, bucket = find_bucket(request.app.state.engine, target)
        return bucket_snapshot(served, bucket, request.app.state.metrics, time.monotonic())

    @get("/static/{name:str}")
    async def static(self, name: str) -> File:
        path = _static_files().get(name)
        if path is None:
            raise APIError(404, f"No static file '{name}'", "not_found_error")
        return File(
            path=path,
            media_type="text/javascript",  # litestar adds the charset to a text/* type
            content_disposition_type="inline",
            headers={"Cache-Control": STATIC_CACHE_CONTROL},
        )

    @get("/{target:path}", media_type=MediaType.HTML)
    async def bucket_page(self, request: Request[Any, Any, Any], target: str) -> str:
        served, bucket = find_bucket(request.app.state.engine, target)
        return render_bucket_page(served.config.name, bucket.name)


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5rem; color: #222; }
table { border-collapse: collapse; } td, th { padding: .3rem .7rem; border-bottom: 1px solid #ddd; text-align: right; }
th { background: #f4f4f4; } td:nth-child(-n+5), th:nth-child(-n+5) { text-align: left; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(420px, 1fr)); gap: .5rem; }
.chart { height: 230px; border: 1px solid #eee; }
pre { background: #f7f7f7; padding: .7rem; overflow: auto; } .muted { color: #777; }
"""


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}"


def _index_row(row: dict[str, Any]) -> str:
    recent = row["recent"]
    throughput = (
        f"{_fmt(recent['tokens_per_s'])} tok/s" if row["task"] == "generate" else f"{_fmt(recent['requests_per_s'])} req/s"
    )
    cells = [
        f'<a href="{html.escape(bucket_path(row["model"], row["bucket"]))}">{html.escape(row["model"])}</a>',
        html.escape(row["bucket"]),
        html.escape(row["kind"]),
        html.escape(row["slice"]),
        html.escape(row["state"]),
        str(row["num_waiting"]),
        str(row["num_running"]),
        throughput,
        _fmt(recent["ttft_p99_s"], 1000),
        _fmt(row["kv_usage"], 100),
    ]
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def _model_row(row: dict[str, Any]) -> str:
    status = row["status"]
    links = [f'<a href="{html.escape(bucket_path(row["model"], b))}">{html.escape(b)}</a>' for b in row["buckets"]]
    cells = [
        html.escape(row["model"]),
        html.escape(row["task"]),
        html.escape(row["load"]),
        html.escape(status["value"] + (f": {status['reason']}" if "reason" in status else "")),
        ", ".join(links),
        "" if row["resident_bytes"] is None else format_bytes(row["resident_bytes"]),
    ]
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def _table(table_id: str, head: list[str], rows: list[str]) -> str:
    return (
        f'<table id="{table_id}"><thead><tr>{"".join(f"<th>{h}</th>" for h in head)}</tr></thead>'
        f'<tbody>{"".join(rows)}</tbody></table>'
    )


def render_index(data: dict[str, Any]) -> str:
    """The overview page (from :func:`overview`): one row per servable model, linking to its
    buckets' pages while it is loaded, then one row per bucket, each linking to its page."""
    model_head = ["model", "task", "load", "status", "buckets", "resident"]
    head = ["model", "bucket", "batcher", "slice", "state", "queue", "running", "throughput", "TTFT p99 ms", "KV %"]
    memory_text = (
        f"{format_bytes(data['resident_bytes'])} resident, of the gateway's memory budget of "
        f"{format_bytes(data['memory_budget_bytes'])}."
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="{INDEX_REFRESH_S}">
<title>Sluice dashboard</title><style>{_STYLE}</style></head>
<body><h1>Sluice</h1>
<p class="muted">Throughput over the last {RATE_WINDOW_S:g} s, TTFT p99 over the last {LATENCY_WINDOW_S:g} s.
Refreshes every {INDEX_REFRESH_S} s.</p>
<h2>Models</h2>
<p id="memory">{memory_text}</p>
{_table("models", model_head, [_model_row(r) for r in data["models"]])}
<h2>Buckets</h2>
{_table("buckets", head, [_index_row(r) for r in data["buckets"]])}
</body></html>"""


def render_bucket_page(model: str, bucket: str) -> str:
    """A bucket's page: empty chart panels that ``dashboard.js`` fills from the JSON endpoint."""
    version = quote(_static_version())
    api = f"/dashboard/api/{quote(model, safe='/:')}/{quote(bucket)}"
    title = html.escape(f"{model} / {bucket}")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Sluice: {title}</title><style>{_STYLE}</style>
<script src="/dashboard/static/plotly.min.js?v={version}"></script>
<script src="/dashboard/static/dashboard.js?v={version}" defer></script></head>
<body data-api="{html.escape(api)}">
<p><a href="/dashboard">all buckets</a></p>
<h1>{title}</h1>
<p id="status" class="muted">connecting…</p>
<div class="charts" id="charts"></div>
<h2>Backend and gate</h2>
<pre id="backend">loading…</pre>
<h2>Config</h2>
<pre id="config">loading…</pre>
</body></html>"""
