"""API keys (:mod:`gateway.auth`): a key resolves to its tenant through a constant-time compare
with every configured hash; a missing, malformed or unknown key is OpenAI's 401; the config and
the keys file hold hashes only; a bad keys file on reload keeps the old keys; ``sluice keys``."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
import yaml

import gateway.auth
import gateway.key_routes
from gateway.auth import ApiKeys, KeyRing, key_sha256, needs_key, read_keys_file, warn_if_open
from gateway.cli import main
from gateway.config import ApiKeyConfig, AuthConfig, GatewayConfig
from gateway.errors import APIError, ConfigError
from gateway.metrics import Metrics
from gateway.routes.bodies import resolve_priority
from gateway.schemas import CompletionBody
from gateway.tenants import ANONYMOUS, SCOPE_KEY, Tenant, tenant_of
from tests.unit.test_config import make_config_data

ALICE_KEY, BOB_KEY, CAROL_KEY = "sk-sluice-alice", "sk-sluice-bob", "sk-sluice-carol"


def _config(auth: dict[str, Any] | None = None) -> GatewayConfig:
    data = make_config_data()
    if auth is not None:
        data["auth"] = auth
    return GatewayConfig.model_validate(data)


def _auth() -> dict[str, Any]:
    return {"api_keys": [
        {"name": "alice", "key_sha256": key_sha256(ALICE_KEY), "models": ["gen"], "priority": 5, "max_priority": 0},
        {"name": "bob", "key_sha256": key_sha256(BOB_KEY), "weight": 3},
    ]}


def _write_keys(path: Path, *entries: tuple[str, str]) -> Path:
    path.write_text(yaml.safe_dump([{"name": name, "key_sha256": key_sha256(key)} for name, key in entries]))
    return path


def _ring(tmp_path: Path, *file_entries: tuple[str, str]) -> KeyRing:
    keys_file = _write_keys(tmp_path / "keys.yaml", *file_entries)
    ring = KeyRing.from_config(_config(_auth()), {"SLUICE_API_KEYS_FILE": str(keys_file)})
    assert ring is not None
    return ring


def test_a_key_resolves_to_its_tenant(tmp_path: Path) -> None:
    ring = _ring(tmp_path, ("carol", CAROL_KEY))
    alice = ring.resolve(f"Bearer {ALICE_KEY}")
    assert (alice.name, alice.models, alice.priority, alice.max_priority) == ("alice", frozenset({"gen"}), 5, 0)
    assert ring.resolve(f"bearer  {BOB_KEY} ").weight == 3
    assert ring.resolve(f"Bearer {CAROL_KEY}").name == "carol"
    assert ring.tenant_names() == {"alice", "bob", "carol"}


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer   ", f"Basic {ALICE_KEY}", ALICE_KEY, "Bearer sk-wrong"])
def test_a_missing_malformed_or_unknown_key_is_openais_401(tmp_path: Path, header: str | None) -> None:
    with pytest.raises(APIError) as refused:
        _ring(tmp_path).resolve(header)
    error = refused.value
    assert (error.status_code, error.headers) == (401, {"WWW-Authenticate": "Bearer"})
    body = error.body()["error"]
    assert (body["type"], body["param"], body["code"]) == ("invalid_request_error", None, "invalid_api_key")
    assert str(body["message"]).startswith("Incorrect API key provided") and ALICE_KEY not in str(body["message"])


def test_every_configured_hash_is_compared_in_constant_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One ``hmac.compare_digest`` per configured key, whichever matches (the first here), and
    for an unknown key too: no early exit."""
    ring = _ring(tmp_path, ("carol", CAROL_KEY))
    calls: list[tuple[bytes, bytes]] = []
    compare_digest = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(gateway.auth.hmac, "compare_digest", counting)
    assert ring.resolve(f"Bearer {ALICE_KEY}").name == "alice"
    assert len(calls) == 3 and {a for a, _ in calls} == {hashlib.sha256(ALICE_KEY.encode()).hexdigest().encode()}
    with pytest.raises(APIError):
        ring.resolve("Bearer sk-unknown")
    assert len(calls) == 6


def test_reload_swaps_the_file_and_a_bad_file_keeps_the_old_keys(tmp_path: Path) -> None:
    ring = _ring(tmp_path, ("carol", CAROL_KEY))
    keys_file = tmp_path / "keys.yaml"
    for bad in ("- name: dave\n  key_sha256: [", "- {name: dave, key_sha256: sk-plain-key-pasted}\n"):
        keys_file.write_text(bad)
        with pytest.raises(ConfigError) as failed:
            ring.reload()
        assert str(keys_file) in str(failed.value) and "sk-plain-key-pasted" not in str(failed.value)
        assert ring.resolve(f"Bearer {CAROL_KEY}").name == "carol"
    _write_keys(keys_file, ("dave", "sk-sluice-dave"))
    assert ring.reload() == ["alice", "bob", "dave"]
    assert ring.resolve("Bearer sk-sluice-dave").name == "dave"
    with pytest.raises(APIError):
        ring.resolve(f"Bearer {CAROL_KEY}")


def test_file_errors_name_the_file_and_the_entrys_field(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump([{"name": "ok", "key_sha256": "0" * 64}, {"name": "x", "key_sha256": "abc"}]))
    with pytest.raises(ConfigError) as bad:
        read_keys_file(path)
    assert f"{path}: invalid API keys" in str(bad.value) and "1.key_sha256" in str(bad.value)
    assert bad.value.param == "1.key_sha256"


@pytest.mark.parametrize("clash", [("alice", CAROL_KEY), ("carol", BOB_KEY)])
def test_a_name_or_hash_in_both_sources_is_refused(tmp_path: Path, clash: tuple[str, str]) -> None:
    with pytest.raises(ConfigError) as refused:
        _ring(tmp_path, clash)
    assert "auth.api_keys." in str(refused.value) and "keys.yaml: 0" in str(refused.value)


def test_a_file_keys_priority_must_lie_in_the_configs_range(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump([{"name": "x", "key_sha256": "0" * 64, "priority": -5000}]))
    with pytest.raises(ConfigError, match=r"keys.yaml: 0.priority: -5000 lies outside"):
        KeyRing.from_config(_config(), {"SLUICE_API_KEYS_FILE": str(path)})


def test_without_auth_or_a_keys_file_there_is_no_key_ring() -> None:
    assert KeyRing.from_config(_config(), {}) is None
    assert tenant_of({}) is ANONYMOUS


def test_keys_add_prints_a_key_once_and_an_entry_holding_its_hash_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys_file = tmp_path / "keys.yaml"
    assert main(["keys", "add", "erin", "--models", "gen, emb", "--priority", "2", "--weight", "0.5", "--append", str(keys_file)]) == 0
    key, *entry_lines = capsys.readouterr().out.splitlines()
    assert key.startswith("sk-sluice-") and len(key) > 40
    entry_text = "\n".join(entry_lines)
    assert key not in entry_text and key not in keys_file.read_text()
    (entry,) = yaml.safe_load(entry_text)
    assert entry == {"name": "erin", "key_sha256": hashlib.sha256(key.encode()).hexdigest(), "models": ["gen", "emb"],
                     "priority": 2, "weight": 0.5}
    assert main(["keys", "add", "frank", "--append", str(keys_file)]) == 0
    assert [e.name for e in read_keys_file(keys_file)] == ["erin", "frank"]
    assert main(["keys", "add", "bad name!"]) == 2


def test_keys_hash_reads_a_key_on_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{ALICE_KEY}\n"))
    assert main(["keys", "hash"]) == 0
    assert capsys.readouterr().out.strip() == key_sha256(ALICE_KEY)


def test_which_paths_need_a_key() -> None:
    for path in ("/v1/completions", "/v1/models", "/v1/models/a/b", "/tokenize", "/detokenize"):
        assert needs_key(path, protect_metrics=False)
    for path in ("/health", "/metrics", "/stats", "/dashboard/m/b", "/admin/models", "/v1/load_lora_adapter"):
        assert not needs_key(path, protect_metrics=False)
    assert all(needs_key(p, protect_metrics=True) for p in ("/metrics", "/stats", "/dashboard", "/dashboard/m/b"))
    assert not needs_key("/health", protect_metrics=True)


def test_paths_the_router_normalises_need_a_key_as_theirs_do() -> None:
    # litestar routes "//v1/models" as "/v1/models" and "/tokenize/" as "/tokenize": neither may skip the key.
    for path in ("//v1/models", "///v1/completions", "/tokenize/", "//detokenize", "/v1/models/"):
        assert needs_key(path, protect_metrics=False), path
    assert needs_key("/metrics/", protect_metrics=True) and needs_key("//stats", protect_metrics=True)
    assert not needs_key("/v1/load_lora_adapter/", protect_metrics=False)
    assert not needs_key("//health/", protect_metrics=True)


def _serve(keys: KeyRing, path: str, authorization: str | None) -> tuple[int, dict[bytes, bytes], Tenant | None]:
    """One request through :class:`ApiKeys` around an app that answers 200: (status, headers,
    the tenant the app saw, ``None`` when it was not called)."""
    seen: list[Tenant] = []
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(tenant_of(scope))
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [] if authorization is None else [(b"authorization", authorization.encode("utf-8", "surrogateescape"))]
    scope = {"type": "http", "path": path, "headers": headers}
    asyncio.run(ApiKeys(app, keys)(scope, None, send))
    return sent[0]["status"], dict(sent[0]["headers"]), seen[0] if seen else None


def test_the_middleware_leaves_the_tenant_in_the_scope_or_answers_401(tmp_path: Path) -> None:
    ring = _ring(tmp_path)
    status, headers, tenant = _serve(ring, "/v1/completions", None)
    assert (status, headers[b"www-authenticate"], tenant) == (401, b"Bearer", None)
    status, _, tenant = _serve(ring, "/v1/completions", f"Bearer {BOB_KEY}")
    assert status == 200 and tenant is not None and tenant.name == "bob"
    assert _serve(ring, "/health", None)[1:] == ({}, ANONYMOUS)
    assert SCOPE_KEY == "sluice.tenant"


def test_a_non_ascii_key_matches_its_utf8_hash(tmp_path: Path) -> None:
    # key_sha256 hashes a key's UTF-8 text, and clients (curl) send it as UTF-8 bytes.
    key = "sk-clé-ключ"
    ring = KeyRing(AuthConfig(api_keys=[ApiKeyConfig(name="u", key_sha256=key_sha256(key))]), -10, 10)
    status, _, tenant = _serve(ring, "/v1/models", f"Bearer {key}")
    assert status == 200 and tenant is not None and tenant.name == "u"
    assert _serve(ring, "/v1/models", "Bearer sk-\udcff")[0] == 401  # not UTF-8: no key of ours


def test_priority_defaults_to_the_tenants_and_is_bounded_by_its_max() -> None:
    router: Any = SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(min_priority=-10, max_priority=10)))
    tenant = Tenant("t", priority=4, max_priority=-2)
    assert resolve_priority(router, tenant, CompletionBody.model_validate({"model": "m", "prompt": "x"})) == 4
    assert resolve_priority(router, tenant, CompletionBody.model_validate({"model": "m", "prompt": "x", "priority": None})) == 4
    assert resolve_priority(router, tenant, CompletionBody.model_validate({"model": "m", "prompt": "x", "priority": -2})) == -2
    assert resolve_priority(router, ANONYMOUS, CompletionBody.model_validate({"model": "m", "prompt": "x"})) == 0
    with pytest.raises(APIError) as urgent:
        resolve_priority(router, tenant, CompletionBody.model_validate({"model": "m", "prompt": "x", "priority": -3}))
    assert (urgent.value.status_code, urgent.value.param, urgent.value.code) == (400, "priority", "priority_not_allowed")


def test_a_keys_default_priority_is_never_more_urgent_than_its_max() -> None:
    router: Any = SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(min_priority=-10, max_priority=10)))
    body = CompletionBody.model_validate({"model": "m", "prompt": "x"})
    assert resolve_priority(router, Tenant("t", max_priority=5), body) == 5  # not the API's 0, which it may not ask
    assert resolve_priority(router, Tenant("t", max_priority=-5), body) == 0
    with pytest.raises(ValueError, match="priority"):
        ApiKeyConfig(name="t", key_sha256="0" * 64, priority=0, max_priority=5)


def test_serve_on_a_network_host_without_keys_warns_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    import gateway.app
    import gateway.logging
    from tests.unit.test_config import write_config

    monkeypatch.setattr(gateway.app, "create_app", lambda config: "app")
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
    monkeypatch.setattr(gateway.logging, "configure_logging", lambda level: None)
    monkeypatch.setattr("models.cpu_memory.keep_freed_memory_in_heap", lambda: None)
    monkeypatch.delenv("SLUICE_API_KEYS_FILE", raising=False)
    data = make_config_data()
    for model in data["models"]:
        model["source"] = str(tmp_path)  # exists (create_app, which would read it, is faked)
    config_path = str(write_config(tmp_path, data))
    with structlog.testing.capture_logs() as logs:
        assert main(["serve", "--config", config_path, "--host", "0.0.0.0"]) == 0
        assert main(["serve", "--config", config_path]) == 0  # 127.0.0.1
        assert not warn_if_open(_config(), "127.0.0.1", {})
        assert not warn_if_open(_config(), "localhost", {})
        assert not warn_if_open(_config(_auth()), "0.0.0.0", {})
        assert not warn_if_open(_config(), "::", {"SLUICE_API_KEYS_FILE": "keys.yaml"})
    warnings = [e for e in logs if e["event"] == "api_open_to_network"]
    assert len(warnings) == 1 and "/v1 is open to anyone" in warnings[0]["message"]


def test_the_tenant_label_holds_configured_names_and_anonymous_only() -> None:
    from buckets.request import GenerationRequest

    engine: Any = SimpleNamespace(models={}, slices={}, config=SimpleNamespace(models=[]))
    metrics = Metrics(engine, lambda: frozenset({"alice"}))
    for tenant in ("alice", "removed-by-reload"):
        request = GenerationRequest(request_id="r", prompt_token_ids=[1], sink=lambda e: None, tenant=tenant)
        request.info["bucket"] = "le32"
        metrics.observe_request("gen", request, 1, "ok")
    text = metrics.render().decode()
    assert 'sluice_tenant_requests_total{model="gen",outcome="ok",tenant="alice"} 1.0' in text
    assert 'sluice_tenant_requests_total{model="gen",outcome="ok",tenant="anonymous"} 1.0' in text
    assert "removed-by-reload" not in text


def test_sighup_with_keys_but_no_keys_file_logs_instead_of_ending_the_gateway() -> None:
    # `sluice keys add --append` says "reload with SIGHUP": without a keys file SIGHUP's default
    # action would end the process; it logs that there is no file to reload instead.
    ring = KeyRing(AuthConfig(api_keys=[ApiKeyConfig(name="u", key_sha256="0" * 64)]), -10, 10)

    async def send_sighup(logs: list[Any]) -> None:
        with gateway.key_routes.reloading_on_sighup(ring):
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(1000):  # until the loop has run the handler it woke for
                if logs:
                    break
                await asyncio.sleep(0)

    with structlog.testing.capture_logs() as logs:
        asyncio.run(send_sighup(logs))
    assert [entry["event"] for entry in logs] == ["api_keys_reload_failed"]
    assert "SLUICE_API_KEYS_FILE" in logs[0]["error"]
