"""The dashboards against a real server: ``/dashboard`` lists every model with its status and
resident bytes and every bucket, ``/dashboard/api`` carries the same, the bucket's JSON endpoint
carries what the charts draw, Plotly is served by the gateway itself (no CDN), and a bucket's
page, open in headless Chromium while requests run, plots points on every chart.

The browser is Debian's ``chromium`` driven by Playwright (never ``playwright install``); the
browser test skips where either is missing. Set ``SLUICE_UPDATE_SCREENSHOT=1`` to copy the
screenshot to ``docs/dashboard.png`` for the README.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.dashboard import LATENCY_WINDOW_S, percentile, plotly_js_path, summarize
from gateway.metrics import RequestTiming
from tests.e2e.conftest import CONFIG, EMBED_MODEL, GENERATE_MODEL, SMALL_GENERATE_QUEUE_LEN, Server, wait_for

CHROMIUM = Path("/usr/bin/chromium")
DOCS_SCREENSHOT = Path(__file__).parents[2] / "docs" / "dashboard.png"
BUCKET = "le48"
CHART_IDS = ("queue", "batch", "ttft", "tpot", "throughput", "kv", "padding", "rejections")
# Short queue and one sequence at a time in the bucket under load (the small-queue server shared
# with the admission tests), so some requests are rejected and the chart shows it.
MAX_QUEUE_LEN = SMALL_GENERATE_QUEUE_LEN
MAX_NUM_SEQS = 1
WAIT_S = 60.0
NUM_CLIENTS = 6
MIN_POLLS = 5
# Polls before the screenshot that goes to the README: longer lines.
MIN_POLLS_FOR_DOCS = 20


@pytest.fixture(scope="module")
def dashboard_url(small_queue_server: Server) -> str:
    """A server whose short generation bucket runs one sequence at a time behind a short queue."""
    return small_queue_server.url


class Load:
    """Clients sending short completions (and embeddings) in threads until :meth:`stop`."""

    def __init__(self, url: str, num_clients: int):
        self.url = url
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._generate, daemon=True) for _ in range(num_clients)]
        self._threads.append(threading.Thread(target=self._embed, daemon=True))

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def _generate(self) -> None:
        body = {"model": GENERATE_MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self._stop.is_set():
                status = client.post("/v1/completions", json=body).status_code
                self.statuses.append(status)
                if status == 429:
                    time.sleep(0.2)

    def _embed(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self._stop.wait(0.1):
                client.post("/v1/embeddings", json={"model": EMBED_MODEL, "input": ["a short one", "two"]})


def external_urls(html: str, origin: str) -> list[str]:
    """The http(s) URLs in ``html`` outside ``origin``."""
    return [u for u in re.findall(r"https?://[^\s\"'<>)]+", html) if not u.startswith(origin)]


def test_percentiles_are_nearest_rank_over_the_window() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(v) for v in range(1, 101)], 99) == 99.0
    assert percentile([1.0, 2.0], 99) == 2.0
    now_s = 1000.0
    old = RequestTiming(now_s - LATENCY_WINDOW_S - 1, "ok", 9.0, 9.0, 9.0, 0.0, 10)
    failed = RequestTiming(now_s - 1, "error", 5.0, None, 5.0, 0.0, 0)
    fresh = [RequestTiming(now_s - i, "ok", 0.1 * i, 0.01, 1.0, 0.0, 4) for i in range(1, 5)]
    summary = summarize([old, failed, *fresh], now_s)
    assert summary["num_requests"] == 4
    assert summary["ttft_p50_s"] == pytest.approx(0.2) and summary["ttft_p99_s"] == pytest.approx(0.4)
    assert summary["requests_per_s"] == pytest.approx(5 / summary["rate_window_s"])
    assert summary["tokens_per_s"] == pytest.approx(16 / summary["rate_window_s"])


def test_index_lists_every_model_and_bucket(dashboard_url: str) -> None:
    response = httpx.get(f"{dashboard_url}/dashboard", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    config = yaml.safe_load(CONFIG.read_text())
    for model in config["models"]:
        for bucket in model["buckets"]:
            assert f'href="/dashboard/{model["name"]}/le{bucket["max_input_tokens"]}"' in response.text
    models_table, buckets_table = response.text.split('<table id="models">')[1].split('<table id="buckets">')
    assert models_table.count("<tr>") == 1 + len(config["models"])
    assert buckets_table.count("<tr>") == 1 + sum(len(m["buckets"]) for m in config["models"])
    for model in config["models"]:
        row = re.search(rf"<tr><td>{re.escape(model['name'])}</td>(.*?)</tr>", models_table)
        assert row is not None and "<td>loaded</td>" in row[1] and re.search(r"<td>[\d.]+ [KMG]iB</td>$", row[1]), model
    assert re.search(r'<p id="memory">[\d.]+ [KMG]iB resident, of the gateway\'s memory budget of [\d.]+ [KMG]iB', response.text)
    assert external_urls(response.text, dashboard_url) == []


def test_overview_api_has_every_model_with_its_status_and_resident_bytes(dashboard_url: str) -> None:
    overview = httpx.get(f"{dashboard_url}/dashboard/api", timeout=30).json()
    config = yaml.safe_load(CONFIG.read_text())
    models = {row["model"]: row for row in overview["models"]}
    assert sorted(models) == sorted(m["name"] for m in config["models"])
    for model in config["models"]:
        row = models[model["name"]]
        assert row["status"] == {"value": "loaded"}, row
        assert row["buckets"] == [f"le{b['max_input_tokens']}" for b in model["buckets"]]
        assert isinstance(row["resident_bytes"], int) and row["resident_bytes"] > 0, row
    assert overview["resident_bytes"] == sum(row["resident_bytes"] for row in models.values())
    assert 0 < overview["resident_bytes"] <= overview["memory_budget_bytes"]
    assert {(b["model"], b["bucket"]) for b in overview["buckets"]} == {
        (m["name"], f"le{b['max_input_tokens']}") for m in config["models"] for b in m["buckets"]
    }


def test_bucket_api_has_what_the_charts_draw(dashboard_url: str) -> None:
    body = {"model": GENERATE_MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    api_url = f"{dashboard_url}/dashboard/api/{GENERATE_MODEL}/{BUCKET}"
    num_finished_before = httpx.get(api_url, timeout=30).json()["counters"]["num_finished"]
    assert httpx.post(f"{dashboard_url}/v1/completions", json=body, timeout=60).status_code == 200

    def observed() -> dict[str, Any] | None:
        """The bucket's snapshot once the request is in it (it is observed as its response closes)."""
        snapshot = httpx.get(api_url, timeout=30).json()
        is_in = snapshot["counters"]["num_finished"] > num_finished_before and snapshot["recent"]["num_requests"] >= 1
        return snapshot if is_in else None

    snapshot = wait_for(observed, WAIT_S, "the completion is in the bucket's recent requests")
    assert (snapshot["model"], snapshot["bucket"], snapshot["state"], snapshot["kind"]) == (
        GENERATE_MODEL, BUCKET, "ready", "continuous"
    )
    for key in ("time_s", "num_waiting", "num_running", "kv_usage", "mean_batch_seqs", "slice_busy_ratio"):
        assert isinstance(snapshot[key], (int, float)), key
    counters = snapshot["counters"]
    for key in ("num_steps", "num_batch_seqs_total", "num_batched_tokens", "num_padding_tokens", "num_finished",
                "num_rejected", "num_timed_out", "num_cancelled", "num_failed"):
        assert isinstance(counters[key], int), key
    assert counters["num_finished"] >= 1 and counters["num_steps"] >= 1
    recent = snapshot["recent"]
    assert recent["num_requests"] >= 1
    assert 0 < recent["ttft_p50_s"] <= recent["ttft_p99_s"]
    assert 0 < recent["tpot_p50_s"] <= recent["tpot_p99_s"]
    assert recent["tokens_per_s"] > 0 and recent["requests_per_s"] > 0
    assert snapshot["config"]["max_input_tokens"] == 48
    assert snapshot["config"]["max_queue_len"] == MAX_QUEUE_LEN
    assert snapshot["config"]["batcher"]["max_num_seqs"] == MAX_NUM_SEQS
    embed = httpx.get(f"{dashboard_url}/dashboard/api/{EMBED_MODEL}/le16", timeout=30).json()
    assert embed["kind"] == "dynamic" and embed["config"]["batcher"]["kind"] == "dynamic"


@pytest.mark.parametrize("path", ["api/no-such-model/le48", f"api/{GENERATE_MODEL}/le999", f"{GENERATE_MODEL}/le999", "nomodel"])
def test_unknown_model_or_bucket_is_a_404_in_openai_shape(dashboard_url: str, path: str) -> None:
    response = httpx.get(f"{dashboard_url}/dashboard/{path}", timeout=30)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


def test_plotly_is_served_by_the_gateway(dashboard_url: str) -> None:
    page = httpx.get(f"{dashboard_url}/dashboard/{GENERATE_MODEL}/{BUCKET}", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert external_urls(page.text, dashboard_url) == []
    scripts = re.findall(r'<script src="([^"]+)"', page.text)
    assert any(s.startswith("/dashboard/static/plotly.min.js") for s in scripts), scripts
    for src in scripts:
        response = httpx.get(f"{dashboard_url}{src}", timeout=30)
        assert response.status_code == 200, src
        assert "javascript" in response.headers["content-type"], response.headers["content-type"]
        assert "max-age=31536000" in response.headers["cache-control"]
    plotly = httpx.get(f"{dashboard_url}/dashboard/static/plotly.min.js", timeout=30)
    assert plotly.content == plotly_js_path().read_bytes()
    assert httpx.get(f"{dashboard_url}/dashboard/static/nothing.js", timeout=30).status_code == 404


def test_bucket_page_plots_live_data_in_chromium(dashboard_url: str, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} missing (Debian package chromium)")
    with Load(dashboard_url, NUM_CLIENTS) as load, sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            requested: list[str] = []
            page.on("request", lambda r: requested.append(r.url))
            page.goto(f"{dashboard_url}/dashboard/{GENERATE_MODEL}/{BUCKET}")
            min_polls = MIN_POLLS_FOR_DOCS if os.environ.get("SLUICE_UPDATE_SCREENSHOT") else MIN_POLLS
            page.wait_for_function(f"window.sluiceDashboard && window.sluiceDashboard.numPolls >= {min_polls}", timeout=60_000)
            charts = page.evaluate(
                "ids => Object.fromEntries(ids.map(id => [id, document.getElementById('chart-' + id).data"
                ".map(t => ({name: t.name, n: t.x.length, ys: Array.from(t.y).filter(v => v !== null)}))]))",
                list(CHART_IDS),
            )
            state = page.evaluate("window.sluiceDashboard")
            config_text = page.text_content("#config")
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        finally:
            browser.close()
    assert state["numErrors"] == 0, state
    for chart_id, traces in charts.items():
        for trace in traces:
            assert trace["n"] >= MIN_POLLS, (chart_id, trace)
    queue, running = charts["queue"]
    assert max(running["ys"]) > 0, running
    assert all(v > 0 for v in charts["ttft"][1]["ys"]), charts["ttft"]
    assert any(v > 0 for v in charts["throughput"][0]["ys"]), charts["throughput"]
    assert any(v > 0 for v in charts["kv"][0]["ys"]), charts["kv"]
    assert any(v > 0 for v in charts["rejections"][0]["ys"]), charts["rejections"]
    assert 429 in load.statuses and 200 in load.statuses
    assert f'"max_queue_len": {MAX_QUEUE_LEN}' in (config_text or "")
    assert [u for u in requested if not u.startswith(dashboard_url)] == []
    print(f"{state['numPolls']} polls, {state['numPoints']} points; screenshot {tmp_path / 'dashboard.png'}")
    if os.environ.get("SLUICE_UPDATE_SCREENSHOT"):
        DOCS_SCREENSHOT.parent.mkdir(exist_ok=True)
        shutil.copyfile(tmp_path / "dashboard.png", DOCS_SCREENSHOT)
