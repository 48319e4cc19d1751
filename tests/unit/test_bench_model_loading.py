"""bench.model_loading's pure parts: the generated config, log-event parsing, the summaries and
the table. No server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench.load_report import RequestResult
from bench.model_loading import ON_DEMAND, SERVED, format_table, gateway_config, latency_summary, log_events, ratio, spread
from gateway.config import GatewayConfig


def test_the_config_serves_one_model_at_start_and_loads_the_others_on_demand() -> None:
    config = gateway_config(num_threads=3)
    loads = {m["name"]: m["load"] for m in config["models"]}
    assert loads == {SERVED: "at_start", **dict.fromkeys(ON_DEMAND, "on_demand")}
    assert config["slices"] == [{"name": "cpu0", "device": "cpu", "num_threads": 3, "kv_cache_memory_bytes": "256MiB"}]
    assert config["admin_allow_loopback_without_token"] is True
    validated = GatewayConfig.model_validate(config)
    assert [m.task for m in validated.models] == ["generate", "generate", "embed"]


def test_log_events_keeps_the_named_events_of_the_model_in_order() -> None:
    lines = [
        "INFO:     Uvicorn running on http://127.0.0.1:8000",
        json.dumps({"event": "model_resident", "model": "loaded", "duration_s": 1.5}),
        json.dumps({"event": "model_evicted", "model": "loaded", "duration_s": 0.2}),
        "{not json, but starts like it: \"model_resident\"",
        json.dumps({"event": "model_resident", "model": "minilm", "duration_s": 0.4}),
        json.dumps({"event": "model_resident", "model": "loaded", "duration_s": 1.1}),
    ]
    text = "\n".join(lines)
    assert [e["duration_s"] for e in log_events(text, "model_resident", "loaded")] == [1.5, 1.1]
    assert [e["model"] for e in log_events(text, "model_resident")] == ["loaded", "minilm", "loaded"]
    assert log_events(text, "model_evicted", "minilm") == []


def test_spread_is_min_median_max_and_none_for_nothing() -> None:
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"min_s": 1.0, "median_s": 2.5, "max_s": 10.0}
    assert spread([]) is None


def test_latency_summary_pools_successful_requests_only() -> None:
    results = [
        RequestResult(ok=True, ttft_s=0.1, itl_s=[0.01, 0.02]),
        RequestResult(ok=True, ttft_s=0.3, itl_s=[0.03]),
        RequestResult(ok=False, ttft_s=9.0, itl_s=[9.0], error="HTTP 503"),
    ]
    summary = latency_summary(results)
    assert summary["num_requests"] == 2 and summary["num_failed"] == 1
    assert summary["ttft_p50_ms"] == pytest.approx(200.0)
    assert summary["ttft_p99_ms"] == pytest.approx(298.0)  # linear between ranks
    assert summary["itl_p50_ms"] == pytest.approx(20.0)
    assert latency_summary([])["ttft_p99_ms"] is None


def test_ratio_is_none_without_both_figures() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None


def test_the_table_shows_every_section() -> None:
    cold: dict[str, Any] = {"endpoint": "completions", "ttft_s": spread([1.0, 2.0]), "load_duration_s": spread([0.9]),
            "unload_s": spread([0.1]), "evicted_duration_s": None, "cycles": []}
    phase = latency_summary([RequestResult(ok=True, ttft_s=0.1, itl_s=[0.01])])
    results = {
        "cold": {"loaded": cold},
        "interference": {"A": phase, "B": phase, "ttft_p99_ratio": 1.0, "itl_p99_ratio": 1.0, "num_loads_in_b": 4},
        "rss": {"num_cycles": 5, "first_bytes": 2**30, "last_bytes": 2**30 + 2**20, "ratio": 1.001},
    }
    table = format_table(results)
    assert "loaded first-request TTFT" in table and "1.500" in table
    assert "p99 TTFT B/A 1.00x" in table and "4 loads during B" in table
    assert "after cycle 5 1025 MiB: 1.001x" in table
