"""bench.retry: backoff bounds, Retry-After as a floor, attempt cap, what is and is not retried."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from bench.retry import RetryPolicy, backoff_delay_s, retry_after_s, send_with_retry


def test_full_jitter_stays_under_the_doubling_ceiling_and_the_cap() -> None:
    policy = RetryPolicy(base_delay_s=0.5, max_delay_s=4.0)
    rng = random.Random(0)
    for retry in range(8):
        ceiling = min(4.0, 0.5 * 2**retry)
        delays = [backoff_delay_s(retry, policy, rng, None) for _ in range(200)]
        assert all(0.0 <= d <= ceiling for d in delays)
        assert max(delays) > 0.8 * ceiling  # spread over the whole range, not bunched
        assert min(delays) < 0.2 * ceiling


def test_retry_after_is_a_floor_but_never_beyond_the_cap() -> None:
    policy = RetryPolicy(base_delay_s=0.1, max_delay_s=10.0)
    rng = random.Random(1)
    assert all(backoff_delay_s(0, policy, rng, 3.0) == 3.0 for _ in range(20))
    assert backoff_delay_s(0, policy, rng, 60.0) == 10.0


def test_retry_after_header_parsing() -> None:
    assert retry_after_s(httpx.Response(429, headers={"Retry-After": "7"})) == 7.0
    assert retry_after_s(httpx.Response(429)) is None
    assert retry_after_s(httpx.Response(429, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})) is None


def run(responses: list[httpx.Response], policy: RetryPolicy) -> tuple[httpx.Response, int, list[float]]:
    waits: list[float] = []
    queue = list(responses)

    async def send() -> httpx.Response:
        return queue.pop(0)

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    response, attempts = asyncio.run(send_with_retry(send, policy, random.Random(2), sleep))
    return response, attempts, waits


def test_429_and_503_are_retried_until_success() -> None:
    responses = [httpx.Response(429, headers={"Retry-After": "2"}), httpx.Response(503), httpx.Response(200)]
    response, attempts, waits = run(responses, RetryPolicy(max_attempts=5, base_delay_s=0.5))
    assert (response.status_code, attempts) == (200, 3)
    assert waits[0] == 2.0 and 0.0 <= waits[1] <= 1.0


def test_attempts_are_capped_and_the_last_refusal_is_returned() -> None:
    responses = [httpx.Response(429) for _ in range(10)]
    response, attempts, waits = run(responses, RetryPolicy(max_attempts=3))
    assert (response.status_code, attempts, len(waits)) == (429, 3, 2)


@pytest.mark.parametrize("status", [200, 400, 404, 413, 500])
def test_other_statuses_are_not_retried(status: int) -> None:
    response, attempts, waits = run([httpx.Response(status), httpx.Response(200)], RetryPolicy())
    assert (response.status_code, attempts, waits) == (status, 1, [])


def test_a_policy_must_be_sane() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)
