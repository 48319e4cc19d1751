"""The admin API against a real server: bearer-token auth, model inspection, and unloading a
model under load: new requests get 503 with Retry-After while admitted ones finish, then the
model is gone and its memory (weights and KV pools) is returned."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.admin import check_admin_token
from gateway.errors import APIError
from tests.e2e.conftest import (
    ADMIN_TOKEN,
    DRAIN_RETRY_AFTER_S,
    EMBED_MODEL,
    GENERATE_MODEL,
    Server,
    async_wait_for,
    resident_memory_bytes,
)

TOKEN = ADMIN_TOKEN
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WAIT_S = 120.0


@pytest.fixture(scope="module")
def server(admin_server: Server) -> Iterator[Server]:
    """The shared admin server; the generate model that the unload test takes away is loaded
    again afterwards, with the config it had, for the modules that share the server next."""
    generate_config = httpx.get(f"{admin_server.url}/admin/models/{GENERATE_MODEL}", headers=AUTH, timeout=30).json()["config"]
    yield admin_server
    if GENERATE_MODEL not in httpx.get(f"{admin_server.url}/health", timeout=30).json()["models"]:
        loaded = httpx.post(f"{admin_server.url}/admin/models", json=generate_config, headers=AUTH, timeout=600)
        assert loaded.status_code == 201, loaded.text


def _unavailable_count(url: str) -> float:
    """``sluice_requests_total`` of the generate model's requests refused with a 503 before any bucket."""
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text)}
    return sum(
        s.value for s in families["sluice_requests"].samples
        if s.name == "sluice_requests_total" and s.labels == {"model": GENERATE_MODEL, "bucket": "", "outcome": "unavailable"}
    )


def _audit(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines if '"admin_audit"' in line]


def test_admin_calls_need_the_bearer_token(server: Server) -> None:
    url = server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"}):
        response = httpx.get(f"{url}/admin/models", headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"]["code"] == "invalid_api_key"
    response = httpx.get(f"{url}/admin/models", headers=AUTH)
    assert response.status_code == 200
    models = {m["name"]: m for m in response.json()["models"]}
    assert set(models) == {GENERATE_MODEL, EMBED_MODEL}
    assert models[GENERATE_MODEL]["state"] == "ready"
    assert [b["name"] for b in models[GENERATE_MODEL]["buckets"]] == ["le48", "le320"]
    one = httpx.get(f"{url}/admin/models/{EMBED_MODEL}", headers=AUTH).json()
    assert one["config"]["task"] == "embed" and one["buckets"][0]["kind"] == "dynamic"
    assert httpx.get(f"{url}/admin/models/nope", headers=AUTH).status_code == 404


def test_the_admin_api_is_off_without_a_token_unless_loopback_is_allowed() -> None:
    with pytest.raises(APIError) as off:
        check_admin_token(f"Bearer {TOKEN}", None, "127.0.0.1", allow_loopback=False)
    assert (off.value.status_code, off.value.code) == (403, "admin_api_disabled")
    check_admin_token(None, None, "127.0.0.1", allow_loopback=True)
    check_admin_token(None, "", "::1", allow_loopback=True)
    with pytest.raises(APIError) as remote:
        check_admin_token(None, None, "10.1.2.3", allow_loopback=True)
    assert (remote.value.status_code, remote.value.code) == (403, "admin_api_disabled")
    check_admin_token(f"Bearer {TOKEN}", TOKEN, "10.1.2.3", allow_loopback=False)


def test_unloading_a_model_drains_it_with_503s_then_frees_its_memory(server: Server) -> None:
    url, proc, log_path = server.url, server.proc, server.log_path
    body = {"model": GENERATE_MODEL, "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    rss_before = resident_memory_bytes(proc)
    num_log_lines_before = len(log_path.read_text().splitlines())
    num_unavailable_before = _unavailable_count(url)

    def new_log_lines() -> list[str]:
        return log_path.read_text().splitlines()[num_log_lines_before:]

    async def run() -> tuple[list[httpx.Response], httpx.Response, list[httpx.Response], float]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            in_flight = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(4)]

            async def admitted_and_running() -> bool:
                buckets = (await client.get("/stats")).json()[GENERATE_MODEL].values()
                num_running = sum(b["num_running"] for b in buckets)
                return num_running >= 1 and num_running + sum(b["num_waiting"] for b in buckets) == len(in_flight)

            await async_wait_for(admitted_and_running, WAIT_S, "the four completions are admitted and running")
            unload = asyncio.create_task(client.delete(f"/admin/models/{GENERATE_MODEL}", headers=AUTH))

            async def draining() -> bool:
                return any(a["after"] == "draining" for a in _audit(new_log_lines()))

            await async_wait_for(draining, WAIT_S, "the unload has started draining the model")
            refused = []
            while not unload.done():
                refused.append(await client.post("/v1/completions", json=body))
                await asyncio.sleep(0.2)
            drained_at = time.monotonic()
            return list(await asyncio.gather(*in_flight)), await unload, refused, drained_at

    in_flight, unload, refused, _ = asyncio.run(run())
    assert [r.status_code for r in in_flight] == [200] * 4
    assert all(r.json()["usage"]["completion_tokens"] == 64 for r in in_flight)
    assert unload.status_code == 200, unload.text
    assert unload.json()["state"] == "unloaded" and unload.json()["num_unfinished"] == 0
    statuses = [r.status_code for r in refused]
    # 503 while draining; the last may land after the unload finished (404: no such model).
    assert 503 in statuses and statuses == sorted(statuses, reverse=True) and set(statuses) <= {503, 404}, statuses
    for response in refused:
        if response.status_code == 404:
            continue
        assert response.headers["Retry-After"] == str(DRAIN_RETRY_AFTER_S)
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("service_unavailable_error", "model_unavailable", "model")
    assert _unavailable_count(url) - num_unavailable_before == statuses.count(503)  # counted, though no bucket took them
    after = httpx.post(f"{url}/v1/completions", json=body)
    assert after.status_code == 404
    assert GENERATE_MODEL not in httpx.get(f"{url}/health").json()["models"]
    assert httpx.post(f"{url}/v1/embeddings", json={"model": EMBED_MODEL, "input": "still here"}).status_code == 200
    freed = rss_before - resident_memory_bytes(proc)
    # The generate model's two KV pools (256 MiB together) and its weights (~500 MiB in float32) go.
    print(f"resident memory freed by the unload: {freed / 2**20:.0f} MiB")
    assert freed > 256 * 2**20
    audit = _audit(new_log_lines())
    assert [(a["action"], a["before"], a["after"]) for a in audit] == [
        ("unload_model", "ready", "draining"), ("unload_model", "draining", "unloaded"),
    ]
    assert audit[0]["who"] == "127.0.0.1"


def test_a_new_layout_keeping_a_buckets_name_keeps_its_counters(server: Server) -> None:
    url = server.url
    embedded = httpx.post(f"{url}/v1/embeddings", json={"model": EMBED_MODEL, "input": ["one", "two"]}, timeout=60)
    assert embedded.status_code == 200 and embedded.headers["x-sluice-bucket"] == "le16"

    def counters() -> dict[str, dict[str, int]]:
        model = httpx.get(f"{url}/admin/models/{EMBED_MODEL}", headers=AUTH, timeout=30).json()
        return {b["name"]: b["stats"] for b in model["buckets"]}

    before = counters()
    assert before["le16"]["num_finished"] >= 2
    layout = httpx.get(f"{url}/admin/models/{EMBED_MODEL}", headers=AUTH, timeout=30).json()["config"]["buckets"]
    swapped = httpx.put(f"{url}/admin/models/{EMBED_MODEL}/buckets", json={"buckets": layout}, headers=AUTH, timeout=120)
    assert swapped.status_code == 200, swapped.text
    after = counters()
    for name, stats in before.items():
        assert after[name]["num_finished"] >= stats["num_finished"] and after[name]["num_steps"] >= stats["num_steps"]
