"""The edge against a real server: every request logged once (4xx included) and counted, a
``/metrics`` Content-Type that strict parsers take, no generation-only series for embedding
buckets, the admin API saying how to enable it, and 422s naming the config path with a code (on
the shared admin server)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import ADMIN_TOKEN, EMBED_MODEL, GENERATE_MODEL, Server, wait_for

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _requests_total(url: str) -> dict[tuple[str, str, str], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {
        (s.labels["model"], s.labels["bucket"], s.labels["outcome"]): s.value
        for s in families["sluice_requests"].samples
        if s.name == "sluice_requests_total"
    }


def _access_events(log_path: Path, path: str) -> list[dict[str, object]]:
    events = [json.loads(line) for line in log_path.read_text().splitlines() if '"http_request"' in line]
    return [e for e in events if e["path"] == path]


def test_4xx_requests_are_logged_and_counted(server_url: str, server_log: Path) -> None:
    before = _requests_total(server_url)
    bad = httpx.post(f"{server_url}/v1/completions", json={"model": GENERATE_MODEL, "prompt": ""}, timeout=30)
    unknown = httpx.post(f"{server_url}/v1/completions", json={"model": "no-such-model", "prompt": "hi"}, timeout=30)
    assert (bad.status_code, unknown.status_code) == (400, 404)
    after = _requests_total(server_url)
    assert after[(GENERATE_MODEL, "", "invalid_request")] - before.get((GENERATE_MODEL, "", "invalid_request"), 0) == 1
    assert after[("", "", "not_found")] - before.get(("", "", "not_found"), 0) == 1  # no label for a made-up model
    wanted = {(400, GENERATE_MODEL, "invalid_request"), (404, "no-such-model", "not_found")}

    def logged() -> list[dict[str, object]]:  # each access line is written once its response is sent
        events = _access_events(server_log, "/v1/completions")
        return events if wanted <= {(e["status"], e["model"], e["outcome"]) for e in events} else []

    events = wait_for(logged, 10, "the access log lines of the 400 and the 404")
    assert all(isinstance(e["duration_ms"], float) and e["route"] == "/v1/completions" for e in events)


def test_an_unknown_path_is_logged_too(server_url: str, server_log: Path) -> None:
    assert httpx.get(f"{server_url}/v1/no-such-path", timeout=30).status_code == 404
    # The access line is written once the response is sent: the client may read it first.
    [event] = wait_for(lambda: _access_events(server_log, "/v1/no-such-path"), 10, "the 404's access log line")
    assert (event["status"], event["route"], event["outcome"]) == (404, None, "not_found")


def test_an_embedding_input_too_long_names_input_and_the_bucket_limit(server_url: str) -> None:
    long_input = "word " * 700  # over the largest bucket (256 tokens) and max_model_len (512)
    response = httpx.post(f"{server_url}/v1/embeddings", json={"model": EMBED_MODEL, "input": long_input}, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("input", "prompt_too_long")
    assert "max_tokens" not in error["message"] and "at most 256 input tokens" in error["message"]


def test_metrics_content_type_has_one_charset(server_url: str) -> None:
    content_type = httpx.get(f"{server_url}/metrics", timeout=30).headers["content-type"]
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"


def test_embedding_buckets_export_no_generation_only_series(server_url: str) -> None:
    assert httpx.post(f"{server_url}/v1/embeddings", json={"model": EMBED_MODEL, "input": "one"}, timeout=60).status_code == 200
    text = httpx.get(f"{server_url}/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    generation_only = [
        "sluice_time_to_first_token_seconds", "sluice_inter_token_latency_seconds", "sluice_generation_tokens",
        "sluice_preemptions", "sluice_kv_cache_usage_ratio",
    ]
    for name in generation_only:
        models = {s.labels.get("model") for s in families[name].samples} if name in families else set()
        assert EMBED_MODEL not in models, name
    e2e = families["sluice_e2e_request_latency_seconds"].samples
    assert any(s.labels["model"] == EMBED_MODEL for s in e2e)


def test_the_admin_api_off_says_how_to_enable_it(server_url: str) -> None:
    response = httpx.get(f"{server_url}/admin/models", timeout=30)
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "admin_api_disabled"
    assert "SLUICE_ADMIN_TOKEN" in error["message"] and "admin_allow_loopback_without_token" in error["message"]
    unknown_path = httpx.get(f"{server_url}/admin/no-such-path", timeout=30)
    wrong_method = httpx.post(f"{server_url}/admin/slices", timeout=30)
    assert [r.status_code for r in (unknown_path, wrong_method)] == [403, 403]
    assert unknown_path.json() == wrong_method.json() == response.json()


@pytest.fixture(scope="module")
def admin_url(admin_server: Server) -> str:
    """The shared admin server: a refused patch leaves it as it was."""
    return admin_server.url


@pytest.mark.parametrize(
    ("knobs", "param"),
    [
        ({"max_num_seqs": 0}, "buckets.0.batcher.max_num_seqs"),
        ({"max_queue_len": 0}, "buckets.0.max_queue_len"),
        ({"max_batch_size": 8}, "buckets.0.batcher.max_batch_size"),
    ],
)
def test_a_422_names_the_config_path_and_a_code(admin_url: str, knobs: dict[str, int], param: str) -> None:
    # The model's place in the config: the shared server's other modules unload and load models.
    models = httpx.get(f"{admin_url}/admin/config", headers=AUTH, timeout=30).json()["models"]
    path = f"models.{[m['name'] for m in models].index(GENERATE_MODEL)}.{param}"
    response = httpx.patch(f"{admin_url}/admin/models/{GENERATE_MODEL}/buckets/le48", json=knobs, headers=AUTH, timeout=30)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (path, "invalid_config")
    assert error["message"].startswith(f"{path}: ")
