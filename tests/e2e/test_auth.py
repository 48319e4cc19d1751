"""API keys on one real server (the test config, forked from the zygote) with two keys in its
``auth`` section and a third in ``SLUICE_API_KEYS_FILE``: 401s in OpenAI's body, a model outside
a key's list answered as unknown, a key's default and most urgent priority, the ``tenant`` in
the logs and metrics, reloads (admin route and SIGHUP), and the ``openai`` client with a key."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.auth import key_sha256
from tests.e2e.conftest import CONFIG, EMBED_MODEL, GENERATE_MODEL, ServerProcess, run_server_process, wait_for

ADMIN_TOKEN = "e2e-auth-admin-token"
# alice: the generate model only, priority 7 by default, 0 at the most urgent; bob: everything.
ALICE_KEY, BOB_KEY = "sk-sluice-e2e-alice", "sk-sluice-e2e-bob"
# In the keys file at start (carol), and put there by a reload (dave).
CAROL_KEY, DAVE_KEY = "sk-sluice-e2e-carol", "sk-sluice-e2e-dave"
ALICE_PRIORITY = 7
COMPLETION = {"model": GENERATE_MODEL, "prompt": "Hi", "max_tokens": 1}


@dataclass(frozen=True)
class AuthServer:
    url: str
    proc: ServerProcess
    log_path: Path
    keys_file: Path


def _keys_file_text(*entries: tuple[str, str]) -> str:
    return yaml.safe_dump([{"name": name, "key_sha256": key_sha256(key)} for name, key in entries])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    folder = tmp_path_factory.mktemp("auth")
    config = yaml.safe_load(CONFIG.read_text())
    config["auth"] = {"api_keys": [
        {"name": "alice", "key_sha256": key_sha256(ALICE_KEY), "models": [GENERATE_MODEL],
         "priority": ALICE_PRIORITY, "max_priority": 0},
        {"name": "bob", "key_sha256": key_sha256(BOB_KEY)},
    ]}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    keys_file = folder / "keys.yaml"
    keys_file.write_text(_keys_file_text(("carol", CAROL_KEY)))
    env = {"SLUICE_API_KEYS_FILE": str(keys_file), "SLUICE_ADMIN_TOKEN": ADMIN_TOKEN}
    with run_server_process(folder / "config.yaml", folder / "server.log", env) as (url, proc):
        yield AuthServer(url, proc, folder / "server.log", keys_file)


def _headers(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def _events(log_path: Path, name: str) -> list[dict[str, Any]]:
    lines = [line for line in log_path.read_text().splitlines() if line.startswith("{")]
    return [event for event in map(json.loads, lines) if event.get("event") == name]


@pytest.mark.parametrize("key", [None, "sk-sluice-wrong"])
def test_without_a_valid_key_v1_and_the_tokenizer_answer_openais_401(server: AuthServer, key: str | None) -> None:
    calls = [("POST", "/v1/completions", COMPLETION), ("GET", "/v1/models", None),
             ("POST", "/tokenize", {"model": GENERATE_MODEL, "prompt": "Hi"})]
    for method, path, body in calls:
        response = httpx.request(method, f"{server.url}{path}", json=body, headers=_headers(key), timeout=30)
        assert response.status_code == 401, (path, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["message"].startswith("Incorrect API key provided")
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "invalid_api_key")
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 200  # protect_metrics is off


def test_a_model_outside_the_keys_list_is_answered_as_an_unknown_one(server: AuthServer) -> None:
    alice = _headers(ALICE_KEY)

    def error(method: str, path: str, body: dict[str, Any] | None, model: str) -> dict[str, Any]:
        response = httpx.request(method, f"{server.url}{path}", json=body, headers=alice, timeout=30)
        assert response.status_code == 404, (path, response.text)
        return json.loads(response.text.replace(model, "MODEL"))

    for method, path, body in (
        ("POST", "/v1/embeddings", {"model": "{m}", "input": "Hi"}), ("GET", "/v1/models/{m}", None),
        ("POST", "/tokenize", {"model": "{m}", "prompt": "Hi"}), ("POST", "/v1/completions", {**COMPLETION, "model": "{m}"}),
    ):
        def named(model: str) -> tuple[str, dict[str, Any] | None]:
            filled = None if body is None else {k: (model if v == "{m}" else v) for k, v in body.items()}
            return path.replace("{m}", model), filled

        forbidden = error(method, *named(EMBED_MODEL), EMBED_MODEL)
        assert forbidden == error(method, *named("no-such-model"), "no-such-model")
        assert forbidden["error"]["code"] == "model_not_found"
    listed = httpx.get(f"{server.url}/v1/models", headers=alice, timeout=30).json()["data"]
    assert [card["id"] for card in listed] == [GENERATE_MODEL]
    every = httpx.get(f"{server.url}/v1/models", headers=_headers(BOB_KEY), timeout=30).json()["data"]
    assert {card["id"] for card in every} == {GENERATE_MODEL, EMBED_MODEL}


def test_a_keys_priority_is_the_default_and_its_max_the_most_urgent(server: AuthServer) -> None:
    headers = {**_headers(ALICE_KEY), "X-Request-Id": "auth-default-priority"}
    assert httpx.post(f"{server.url}/v1/completions", json=COMPLETION, headers=headers, timeout=60).status_code == 200
    finished = wait_for(
        lambda: [e for e in _events(server.log_path, "request_finished") if e["request_id"] == "cmpl-auth-default-priority"],
        30, "the request's request_finished event",
    )
    assert (finished[0]["priority"], finished[0]["tenant"]) == (ALICE_PRIORITY, "alice")
    access = wait_for(lambda: [e for e in _events(server.log_path, "http_request")
                               if e.get("request_id") == "auth-default-priority"], 30, "the access log line")
    assert access[0]["tenant"] == "alice"
    urgent = httpx.post(f"{server.url}/v1/completions", json={**COMPLETION, "priority": -1}, headers=headers, timeout=30)
    assert urgent.status_code == 400
    assert (urgent.json()["error"]["param"], urgent.json()["error"]["code"]) == ("priority", "priority_not_allowed")
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert f'sluice_tenant_requests_total{{model="{GENERATE_MODEL}",outcome="ok",tenant="alice"}}' in metrics
    assert 'tenant="alice"' in next(line for line in metrics.splitlines() if line.startswith("sluice_time_to_first_token_seconds_count"))


def _models_status(server: AuthServer, key: str) -> int:
    return httpx.get(f"{server.url}/v1/models", headers=_headers(key), timeout=30).status_code


def test_reloading_the_keys_file_by_the_admin_route_and_by_sighup(server: AuthServer) -> None:
    admin = _headers(ADMIN_TOKEN)
    assert _models_status(server, CAROL_KEY) == 200 and _models_status(server, DAVE_KEY) == 401
    server.keys_file.write_text("- name: broken\n  key_sha256: [")
    bad = httpx.post(f"{server.url}/admin/keys/reload", headers=admin, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_keys_file"
    assert str(server.keys_file) in bad.json()["error"]["message"]
    assert _models_status(server, CAROL_KEY) == 200  # the old keys stay
    server.keys_file.write_text(_keys_file_text(("dave", DAVE_KEY)))
    assert httpx.post(f"{server.url}/admin/keys/reload", timeout=30).status_code == 401  # the admin token's own check
    reloaded = httpx.post(f"{server.url}/admin/keys/reload", headers=admin, timeout=30)
    assert reloaded.status_code == 200 and reloaded.json()["tenants"] == ["alice", "bob", "dave"]
    assert _models_status(server, DAVE_KEY) == 200 and _models_status(server, CAROL_KEY) == 401
    server.keys_file.write_text(_keys_file_text(("carol", CAROL_KEY)))
    server.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: _models_status(server, CAROL_KEY) == 200, 30, "carol's key works after SIGHUP")
    assert _models_status(server, DAVE_KEY) == 401
    logged = _events(server.log_path, "api_keys_reloaded")
    assert [e["num_keys"] for e in logged] == [3, 3] and not any(CAROL_KEY in json.dumps(e) for e in logged)


def test_the_openai_client_sends_its_api_key(server: AuthServer) -> None:
    from openai import AuthenticationError, OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=BOB_KEY, max_retries=0, timeout=60)
    completion = client.completions.create(model=GENERATE_MODEL, prompt="Hi", max_tokens=1)
    assert completion.usage is not None and completion.usage.completion_tokens == 1
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0, timeout=60).models.list()
