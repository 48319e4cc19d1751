"""API keys' quotas on one real server (the generate model alone, forked from the zygote) whose
``auth`` section holds a key per test, each with small limits: OpenAI's 429 with ``Retry-After``
and the ``x-ratelimit-*`` headers, those headers on a 200, a stream that passes its token budget
finishing, a concurrency limit held by a stream, and the ``openai`` client retrying through a
rate limit to success.

Each test uses its own key, so the usage one leaves behind (a window lasts a minute) does not
reach the others. Quotas are per minute; the tests that need a limit to free up use the
concurrency limit, which frees when a stream ends, so nothing waits out a window.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import GENERATE_MODEL, Server, wait_for

KEYS = {
    "rpm": ("sk-sluice-quota-rpm", {"requests_per_minute": 2, "tokens_per_minute": 100_000}),
    "tpm": ("sk-sluice-quota-tpm", {"requests_per_minute": 100, "tokens_per_minute": 20}),
    "concurrent": ("sk-sluice-quota-concurrent", {"max_concurrent_requests": 1}),
    "retry": ("sk-sluice-quota-retry", {"max_concurrent_requests": 1}),
}
RATE_LIMIT_HEADERS = [f"x-ratelimit-{what}-{kind}" for kind in ("requests", "tokens") for what in ("limit", "remaining", "reset")]
# OpenAI's reset durations: Go's Duration.String ("59ms", "1s", "17.5s", "6m0s").
DURATION = re.compile(r"^(\d+ms|(\d+h)?(\d+m)?\d+(\.\d+)?s)$")
# Long enough that a held stream is still generating when the test is done with it (it is closed).
HELD_MAX_TOKENS = 250
TIMEOUT_S = 60


def _config(config: dict[str, Any]) -> None:
    config["models"] = [m for m in config["models"] if m["name"] == GENERATE_MODEL]
    config["auth"] = {"api_keys": [
        {"name": name, "key_sha256": hashlib.sha256(key.encode()).hexdigest(), **limits}
        for name, (key, limits) in KEYS.items()
    ]}


@pytest.fixture(scope="module")
def url(server_with: Callable[..., Server]) -> str:
    return server_with(_config).url


def _auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name][0]}"}


def _completion(url: str, name: str, **extra: Any) -> httpx.Response:
    body = {"model": GENERATE_MODEL, "prompt": "Hi", "max_tokens": 1, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, headers=_auth(name), timeout=TIMEOUT_S)


def _check_429(response: httpx.Response, limit: str) -> None:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("rate_limit_error", "rate_limit_exceeded", None)
    assert limit in error["message"]
    retry_after_s, retry_after_ms = int(response.headers["Retry-After"]), int(response.headers["retry-after-ms"])
    assert 1 <= retry_after_s <= 60 and retry_after_s == -(-retry_after_ms // 1000)


def _check_headers(response: httpx.Response) -> dict[str, str]:
    """The six ``x-ratelimit-*`` headers, checked for OpenAI's formats."""
    headers = {name: response.headers[name] for name in RATE_LIMIT_HEADERS}
    for kind in ("requests", "tokens"):
        assert headers[f"x-ratelimit-limit-{kind}"].isdigit() and headers[f"x-ratelimit-remaining-{kind}"].isdigit()
        assert DURATION.match(headers[f"x-ratelimit-reset-{kind}"]), headers
    return headers


def test_over_requests_per_minute_openais_429_and_headers_on_each_200(url: str) -> None:
    first, second, third = (_completion(url, "rpm") for _ in range(3))
    assert (first.status_code, second.status_code) == (200, 200), (first.text, second.text)
    assert _check_headers(first)["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    used = first.json()["usage"]["total_tokens"]
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 100_000 - used
    _check_429(third, "requests_per_minute")
    assert _check_headers(third)["x-ratelimit-remaining-requests"] == "0"
    assert int(third.headers["Retry-After"]) >= 50  # the first request leaves the window a minute after it came
    metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text
    assert 'sluice_rate_limited_total{limit="requests_per_minute",tenant="rpm"} 1.0' in metrics


def _stream_events(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_stream_past_its_token_budget_finishes_and_the_next_request_is_refused(url: str) -> None:
    body = {"model": GENERATE_MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=_auth("tpm"), timeout=TIMEOUT_S) as stream:
        assert stream.status_code == 200
        assert _check_headers(stream)["x-ratelimit-limit-tokens"] == "20"
        events = _stream_events(stream)
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 24 and usage["total_tokens"] > 20  # all its tokens, over the budget
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    refused = _completion(url, "tpm")
    _check_429(refused, "tokens_per_minute")
    assert _check_headers(refused)["x-ratelimit-remaining-tokens"] == "0"


@contextlib.contextmanager
def _held_stream(url: str, name: str) -> Iterator[httpx.Response]:
    """A stream of key ``name`` that has sent its first chunk and is still generating; closed
    (the client hangs up) on exit."""
    body = {"model": GENERATE_MODEL, "prompt": "Once upon a time", "max_tokens": HELD_MAX_TOKENS,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=_auth(name), timeout=TIMEOUT_S) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()  # kept: dropping it closes the response (a hang-up)
        next(lines)
        yield stream


def test_max_concurrent_requests_counts_a_stream_until_it_ends(url: str) -> None:
    with _held_stream(url, "concurrent"):
        refused = _completion(url, "concurrent")
        _check_429(refused, "max_concurrent_requests")
        assert refused.headers["Retry-After"] == "1" and refused.headers["retry-after-ms"] == "1000"
        assert "x-ratelimit-limit-requests" not in refused.headers  # no per-minute limit: no such headers
    # the hang-up released the stream's slot
    wait_for(lambda: _completion(url, "concurrent").status_code == 200, TIMEOUT_S, "a request after the stream ended")


def _refusals(url: str, tenant: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text
    found = re.search(rf'^sluice_rate_limited_total{{limit="max_concurrent_requests",tenant="{tenant}"}} (\S+)$', metrics, re.M)
    return float(found.group(1)) if found else 0.0


def test_the_openai_client_retries_through_a_rate_limit_to_success(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["retry"][0], max_retries=5, timeout=TIMEOUT_S)
    result: list[Any] = []
    with _held_stream(url, "retry"):
        call = threading.Thread(
            target=lambda: result.append(client.completions.create(model=GENERATE_MODEL, prompt="Hi", max_tokens=1))
        )
        call.start()
        wait_for(lambda: _refusals(url, "retry") >= 1, TIMEOUT_S, "the client's first try refused")
    # the stream is closed: the client's retry, retry-after-ms later, finds its slot free
    call.join(TIMEOUT_S)
    assert len(result) == 1 and result[0].choices[0].finish_reason == "length"
