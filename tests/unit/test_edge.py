"""The edge without a server: one mapping of errors to HTTP, outcomes from the last event, the
access log and the metrics of requests no bucket took, the admin API's refusals and 422 params."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
from litestar.exceptions import NotFoundException
from pydantic import ValidationError

from buckets.errors import (
    BatchFailedError, BucketClosedError, DeadlineExceededError, DeadlineUnmeetableError, QueueFullError,
    SliceUnavailableError, WorkerCrashedError,
)
from buckets.request import EmbeddingEvent, ErrorEvent, TokenEvent
from gateway.access_log import AccessLog, note, note_outcome
from gateway.admin import BucketPatch, check_admin_token, knob_path
from gateway.build import continuous_settings, dynamic_settings
from gateway.config import ContinuousBatcherConfig, DynamicBatcherConfig, GatewayConfig
from gateway.errors import APIError, ConfigError, config_validation_error, is_domain_error, to_api_error
from gateway.metrics import Metrics
from gateway.outcome import Outcome, outcome_of, outcome_of_status
from gateway.response_format import ResponseFormat
from gateway.streams import Interrupt, InterruptReason
from models.errors import ModelSourceError
from tests.unit.test_config import make_config_data


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (QueueFullError("max_queue_len 2 reached", 3), 429, "queue_full"),
        (DeadlineUnmeetableError("wait too long", 4), 429, "queue_wait_exceeds_timeout"),
        (SliceUnavailableError("restarting", 5), 503, "slice_unavailable"),
        (WorkerCrashedError("exited"), 503, "worker_crashed"),
        (DeadlineExceededError("late"), 504, "timeout"),
        (BucketClosedError("replaced"), 503, "model_unavailable"),
        (BatchFailedError("forward failed"), 500, None),
        (ConfigError("slices.0.memory_budget_bytes: over", "slices.0.memory_budget_bytes", "memory_budget_exceeded"), 422, "memory_budget_exceeded"),
        (ConfigError("slices.0.device: no such device"), 422, "invalid_config"),
        (ModelSourceError("nowhere"), 422, "invalid_model_source"),
        (NotFoundException(), 404, None),
        (RuntimeError("boom"), 500, None),
    ],
)
def test_every_domain_error_maps_to_one_http_error(error: Exception, status: int, code: str | None) -> None:
    api_error = to_api_error(error, "m", "le64", waited_s=1.5)
    assert (api_error.status_code, api_error.code) == (status, code)
    if status in (429, 503) and code != "model_unavailable":
        assert int(api_error.headers["Retry-After"]) >= 1
    assert is_domain_error(error) is not isinstance(error, RuntimeError)
    assert set(api_error.body()["error"]) == {"message", "type", "param", "code"}


def test_an_api_error_maps_to_itself_and_a_config_error_names_its_path() -> None:
    error = APIError(400, "bad", "invalid_request_error", "prompt")
    assert to_api_error(error) is error
    mapped = to_api_error(ConfigError("x", "slices.0.memory_budget_bytes", "memory_budget_exceeded"))
    assert mapped.param == "slices.0.memory_budget_bytes"


def test_the_outcome_comes_from_the_last_event() -> None:
    done = TokenEvent(text="a", token_ids=[1], finish_reason="stop", num_prompt_tokens=1, num_completion_tokens=1)
    late = TokenEvent(text="", token_ids=[], finish_reason="timeout", num_prompt_tokens=1, num_completion_tokens=1)
    partial = TokenEvent(text="a", token_ids=[1], finish_reason=None, num_prompt_tokens=1, num_completion_tokens=1)
    assert outcome_of(done, None) is Outcome.OK
    assert outcome_of(late, None) is Outcome.TIMEOUT  # the core's deadline, after some tokens
    assert outcome_of(EmbeddingEvent(embedding=[0.0], num_prompt_tokens=1), None) is Outcome.OK
    assert outcome_of(Interrupt(InterruptReason.TIMEOUT), InterruptReason.TIMEOUT) is Outcome.TIMEOUT
    assert outcome_of(Interrupt(InterruptReason.DISCONNECTED), InterruptReason.DISCONNECTED) is Outcome.CANCELLED
    assert outcome_of(ErrorEvent(DeadlineExceededError("late")), None) is Outcome.TIMEOUT
    assert outcome_of(ErrorEvent(BatchFailedError("x")), None) is Outcome.ERROR
    assert outcome_of(partial, None) is Outcome.CANCELLED  # a streaming client that went away
    assert outcome_of(partial, InterruptReason.TIMEOUT) is Outcome.TIMEOUT
    assert outcome_of(None, None) is Outcome.CANCELLED


def test_every_status_has_an_outcome() -> None:
    assert outcome_of_status(404) is Outcome.NOT_FOUND
    assert {outcome_of_status(s) for s in (400, 405, 413, 422)} == {Outcome.INVALID_REQUEST}
    assert [outcome_of_status(s) for s in (200, 429, 499, 500, 503, 504)] == [
        Outcome.OK, Outcome.REJECTED, Outcome.CANCELLED, Outcome.ERROR, Outcome.UNAVAILABLE, Outcome.TIMEOUT,
    ]


def test_response_formats_shape_their_objects() -> None:
    assert ResponseFormat.CHAT.object_name(is_chunk=True) == "chat.completion.chunk"
    assert ResponseFormat.COMPLETION.object_name(is_chunk=True) == "text_completion"
    assert ResponseFormat.CHAT.choice("hi", "stop")["message"] == {"role": "assistant", "content": "hi"}
    assert ResponseFormat.COMPLETION.chunk_choice(None, "timeout")["text"] == ""
    assert ResponseFormat.CHAT.chunk_choice(None, "timeout")["delta"] == {}
    assert ResponseFormat.CHAT.chunk_choice("", None, has_role=True)["delta"] == {"role": "assistant", "content": ""}
    assert (ResponseFormat.CHAT.id_prefix, ResponseFormat.COMPLETION.id_prefix) == ("chatcmpl", "cmpl")


def _serve(app: Any, path: str) -> list[tuple[str, int, str | None, bool]]:
    finished: list[tuple[str, int, str | None, bool]] = []
    wrapped = AccessLog(app, lambda *args: finished.append(args))
    scope = {"type": "http", "method": "POST", "path": path}

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(_: Any) -> None:
        return None

    asyncio.run(wrapped(scope, receive, send))
    return finished


def test_every_request_is_logged_once_with_status_model_and_duration() -> None:
    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        note(scope, model="m")
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def vanish(scope: Any, receive: Any, send: Any) -> None:
        return None

    async def time_out(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 504, "headers": []})

    async def log_request() -> None:
        note_outcome("timeout")

    async def time_out_in_a_bucket(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.ensure_future(log_request())  # noted in a task the request started, as a stream's
        await send({"type": "http.response.start", "status": 200, "headers": []})

    with structlog.testing.capture_logs() as logs:
        assert _serve(refuse, "/v1/completions") == [("/v1/completions", 400, "m", False)]
        assert _serve(vanish, "/v1/chat/completions") == [("/v1/chat/completions", 499, None, False)]
        assert _serve(time_out, "/v1/completions") == [("/v1/completions", 504, None, False)]
        assert _serve(time_out_in_a_bucket, "/v1/completions") == [("/v1/completions", 200, None, True)]
    events = [e for e in logs if e["event"] == "http_request"]
    assert [(e["status"], e["model"], e["outcome"]) for e in events] == [
        (400, "m", "invalid_request"), (499, None, "cancelled"), (504, None, "timeout"), (200, None, "timeout"),
    ]
    assert all(e["duration_ms"] >= 0 and e["method"] == "POST" for e in events)


def test_requests_no_bucket_took_are_counted_with_a_bounded_model_label() -> None:
    config = SimpleNamespace(models=[SimpleNamespace(name="m"), SimpleNamespace(name="unloaded")])
    engine: Any = SimpleNamespace(models={"m": SimpleNamespace(table=SimpleNamespace(buckets=[]))}, slices={}, config=config)
    metrics = Metrics(engine)
    metrics.observe_http("/v1/completions", 400, "m", False)
    metrics.observe_http("/v1/completions", 404, "no-such-model", False)
    metrics.observe_http("/v1/nope", 404, None, False)
    metrics.observe_http("/v1/completions", 503, "m", False)  # the model drains: no bucket took it
    metrics.observe_http("/v1/completions", 429, "m", False)  # its bucket's admission counts it
    metrics.observe_http("/v1/completions", 504, "m", True)  # its bucket counts it
    metrics.observe_http("/health", 404, None, False)  # not the API
    metrics.observe_http("/v1/completions", 503, "unloaded", False)  # servable, its load failed
    metrics.observe_load_refusal("unloaded")  # too many wait for its load: no bucket counted the 429
    assert metrics.unrouted_counts() == {
        ("m", "invalid_request"): 1, ("", "not_found"): 2, ("m", "unavailable"): 1, ("unloaded", "unavailable"): 1,
        ("unloaded", "rejected"): 1,
    }
    text = metrics.render().decode()
    assert 'sluice_requests_total{bucket="",model="m",outcome="invalid_request"} 1.0' in text


def test_without_a_token_the_admin_api_says_how_to_enable_it() -> None:
    with pytest.raises(APIError) as off:
        check_admin_token(None, None, "10.0.0.1", allow_loopback=True)
    assert (off.value.status_code, off.value.code) == (403, "admin_api_disabled")
    assert "SLUICE_ADMIN_TOKEN" in off.value.message and "admin_allow_loopback_without_token" in off.value.message


def test_a_patch_knob_error_names_its_config_path() -> None:
    data = make_config_data()
    config = GatewayConfig.model_validate(data)
    model = config.models[0]
    served = SimpleNamespace(config=model)
    engine: Any = SimpleNamespace(models={model.name: served}, config=config)
    bucket = model.buckets[0].bucket_name
    with pytest.raises(ValidationError) as invalid:
        BucketPatch.model_validate({"max_num_seqs": 0})
    error = config_validation_error(invalid.value, lambda knob: knob_path(engine, model.name, bucket, knob))
    assert (error.status_code, error.code, error.param) == (422, "invalid_config", "models.0.buckets.0.batcher.max_num_seqs")
    assert knob_path(engine, model.name, bucket, "max_queue_len") == "models.0.buckets.0.max_queue_len"


def test_a_patch_takes_the_chunked_prefill_knobs() -> None:
    patch = BucketPatch.model_validate({"chunked_prefill": "fixed", "tpot_target_ms": None})
    assert patch.model_dump(exclude_unset=True) == {"chunked_prefill": "fixed", "tpot_target_ms": None}
    with pytest.raises(ValidationError):
        BucketPatch.model_validate({"tpot_target_ms": 0})


def test_the_fair_share_knobs_reach_the_settings_and_a_patch_takes_them() -> None:
    patch = BucketPatch.model_validate({"fair_share": False, "max_starvation_s": 4.0})
    assert patch.model_dump(exclude_unset=True) == {"fair_share": False, "max_starvation_s": 4.0}
    with pytest.raises(ValidationError):
        BucketPatch.model_validate({"max_starvation_s": 0})
    continuous = continuous_settings(ContinuousBatcherConfig(kind="continuous", fair_share=False, max_starvation_s=4.0))
    dynamic = dynamic_settings(DynamicBatcherConfig(kind="dynamic", fair_share=False, max_starvation_s=3.0))
    assert (continuous.fair_share, continuous.max_starvation_s, dynamic.fair_share, dynamic.max_starvation_s) == (False, 4.0, False, 3.0)
    assert ContinuousBatcherConfig(kind="continuous").fair_share


def test_a_whole_config_error_leaves_out_the_batcher_kind_tag() -> None:
    data = make_config_data()
    data["models"][0]["buckets"][0]["batcher"] = {"kind": "continuous", "max_num_seqs": 0}
    with pytest.raises(ValidationError) as invalid:
        GatewayConfig.model_validate(data)
    error = config_validation_error(invalid.value)
    assert (error.code, error.param) == ("invalid_config", "models.0.buckets.0.batcher.max_num_seqs")


def _admin_app(monkeypatch: pytest.MonkeyPatch, token: str | None) -> Any:
    """The gateway app on a config whose models never load (no lifespan runs in these tests)."""
    from gateway.app import create_app

    if token is None:
        monkeypatch.delenv("SLUICE_ADMIN_TOKEN", raising=False)
    else:
        monkeypatch.setenv("SLUICE_ADMIN_TOKEN", token)
    return create_app(GatewayConfig.model_validate(make_config_data()))


@pytest.mark.parametrize(("method", "path"), [("GET", "/admin/models"), ("GET", "/admin/no-such-path"), ("GET", "/admin"),
                                              ("POST", "/admin/slices"), ("DELETE", "/admin/config")])
def test_with_the_admin_api_off_every_admin_request_gets_the_disabled_error(
    monkeypatch: pytest.MonkeyPatch, method: str, path: str
) -> None:
    from litestar.testing import TestClient

    response = TestClient(_admin_app(monkeypatch, None)).request(method, path)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "admin_api_disabled"


def test_with_the_admin_api_on_an_unknown_admin_path_needs_the_token_then_is_a_404(monkeypatch: pytest.MonkeyPatch) -> None:
    from litestar.testing import TestClient

    client = TestClient(_admin_app(monkeypatch, "secret"))
    assert client.get("/admin/no-such-path").status_code == 401
    found = client.get("/admin/no-such-path", headers={"Authorization": "Bearer secret"})
    assert found.status_code == 404 and set(found.json()["error"]) == {"message", "type", "param", "code"}
    assert client.post("/admin/slices", headers={"Authorization": "Bearer secret"}).status_code == 405
