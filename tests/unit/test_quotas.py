"""Quotas with plain numbers and an injected clock: policies/quotas.py and the gateway's book."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from litestar.response import Response, Stream

from gateway.config import ApiKeyConfig
from gateway.errors import APIError
from gateway.quotas import QuotaBook, format_reset, meter, rate_limit_headers
from gateway.tenants import ANONYMOUS, Tenant
from policies.quotas import (
    CONCURRENCY_RETRY_S, MAX_CONCURRENT_REQUESTS, REQUESTS_PER_MINUTE, TOKENS_PER_MINUTE, QuotaLimits,
    SlidingWindowLog, TenantUsage,
)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_requests_window_slides() -> None:
    usage, limits = TenantUsage(), QuotaLimits(requests_per_minute=3)
    for now_s in (0.0, 10.0, 20.0):
        assert usage.admit(limits, now_s) is None
    refusal = usage.admit(limits, 30.0)
    assert refusal is not None and refusal.limit == REQUESTS_PER_MINUTE
    assert refusal.retry_after_s == pytest.approx(30.0)  # the request of t=0 leaves the window at t=60
    assert refusal.state.remaining_requests == 0
    assert refusal.state.reset_requests_s == pytest.approx(50.0)  # the one of t=20 leaves at t=80
    assert usage.admit(limits, 59.9) is not None
    assert usage.admit(limits, 60.0) is None  # slid past t=0: one more
    assert usage.admit(limits, 60.0) is not None


def test_tokens_charged_as_produced_refuse_the_next_request_not_the_running_one() -> None:
    usage, limits = TenantUsage(), QuotaLimits(tokens_per_minute=100)
    assert usage.admit(limits, 0.0) is None  # the running request: admitted under the limit
    for k in range(15):  # a stream charged 10 tokens at a time, past its budget mid-way
        usage.charge_tokens(10, 1.0 + k)
    assert usage.tokens.total(15.0) == 150
    refusal = usage.admit(limits, 20.0)
    assert refusal is not None and refusal.limit == TOKENS_PER_MINUTE
    # under 100 once 60 tokens (those of t=1..6) have left: at t=66
    assert refusal.retry_after_s == pytest.approx(46.0)
    assert refusal.state.remaining_tokens == 0 and refusal.state.reset_tokens_s == pytest.approx(55.0)
    assert usage.admit(limits, 66.0) is None


def test_concurrency_counted_and_released() -> None:
    book = QuotaBook(lambda tenant, limit: None, FakeClock())
    tenant = Tenant("a", max_concurrent_requests=2)
    first, second = book.admit(tenant), book.admit(tenant)
    assert first is not None and second is not None
    with pytest.raises(APIError) as refused:
        book.admit(tenant)
    assert refused.value.status_code == 429 and refused.value.headers["Retry-After"] == str(int(CONCURRENCY_RETRY_S))
    first.release()
    first.release()  # idempotent: frees one slot, not two
    assert book.admit(tenant) is not None
    with pytest.raises(APIError):
        book.admit(tenant)


def test_refusal_names_the_longest_wait_and_counts_nothing() -> None:
    usage, limits = TenantUsage(), QuotaLimits(requests_per_minute=1, max_concurrent_requests=1)
    assert usage.admit(limits, 0.0) is None
    refusal = usage.admit(limits, 5.0)
    assert refusal is not None and refusal.limit == REQUESTS_PER_MINUTE and refusal.retry_after_s == pytest.approx(55.0)
    usage.release()
    refusal = usage.admit(limits, 5.0)
    assert refusal is not None and refusal.limit == REQUESTS_PER_MINUTE
    assert usage.requests.total(5.0) == 1 and usage.in_flight == 0
    assert usage.admit(limits, 60.0) is None and usage.in_flight == 1
    refusal = usage.admit(limits, 200.0)
    assert refusal is not None and refusal.limit == MAX_CONCURRENT_REQUESTS


def test_log_memory_is_bounded() -> None:
    log = SlidingWindowLog(window_s=60.0, slot_s=0.25)
    for k in range(100_000):
        log.charge(1, k * 0.01)  # 100 charges a second for 1000 s
    assert len(log) <= 60 / 0.25 + 2
    assert log.total(1000.0) == pytest.approx(6000, abs=25)
    # coalesced charges are held up to one slot long, never less
    assert log.seconds_until_empty(1000.0) == pytest.approx(60.0, abs=0.02)


def test_reset_header_format() -> None:
    assert format_reset(0.0) == "0s"
    assert format_reset(0.059) == "59ms"
    assert format_reset(1.0) == "1s"
    assert format_reset(1.5) == "1.5s"
    assert format_reset(17.4761) == "17.477s"  # to the millisecond, rounded up
    assert format_reset(360.0) == "6m0s"
    assert format_reset(61.25) == "1m1.25s"
    assert format_reset(3600.0) == "1h0m0s"


def test_headers_on_a_refusal_and_a_success() -> None:
    clock, refused = FakeClock(), []
    book = QuotaBook(lambda tenant, limit: refused.append((tenant, limit)), clock)
    tenant = Tenant("a", requests_per_minute=2, tokens_per_minute=1000)
    lease = book.admit(tenant)
    assert lease is not None
    response = lease.settle(Response({"usage": {"total_tokens": 40}}))
    assert response.headers == {
        "x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "1", "x-ratelimit-reset-requests": "1m0s",
        "x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "960", "x-ratelimit-reset-tokens": "1m0s",
    }
    clock.now_s += 0.5
    assert book.admit(tenant) is not None
    clock.now_s += 20.0
    with pytest.raises(APIError) as error:
        book.admit(tenant)
    assert refused == [("a", REQUESTS_PER_MINUTE)]
    assert error.value.body()["error"]["code"] == "rate_limit_exceeded"
    assert error.value.headers == {
        "Retry-After": "40", "retry-after-ms": "39500",
        "x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "40s",
        "x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "960", "x-ratelimit-reset-tokens": "39.5s",
    }


def test_only_the_limits_set_get_headers() -> None:
    state = TenantUsage().state(QuotaLimits(tokens_per_minute=10), 0.0)
    assert rate_limit_headers(state) == {
        "x-ratelimit-limit-tokens": "10", "x-ratelimit-remaining-tokens": "10", "x-ratelimit-reset-tokens": "0s",
    }
    assert rate_limit_headers(TenantUsage().state(QuotaLimits(max_concurrent_requests=1), 0.0)) == {}


def test_tenants_without_quotas_get_no_lease() -> None:
    book = QuotaBook(lambda tenant, limit: None, FakeClock())
    assert book.admit(ANONYMOUS) is None and book.admit(Tenant("b", weight=2.0)) is None


def test_stream_charged_as_chunks_go_out_and_released_at_its_end() -> None:
    book = QuotaBook(lambda tenant, limit: None, FakeClock())
    tenant = Tenant("a", tokens_per_minute=5, max_concurrent_requests=1)
    lease = book.admit(tenant)
    assert lease is not None
    produced = [3]  # the prompt's tokens, then one per chunk

    async def chunks() -> Any:
        for _ in range(4):
            produced[0] += 1
            yield "data: {}\n\n"

    meter(lease, lambda: produced[0])
    stream = lease.settle(Stream(chunks()))
    assert stream.headers["x-ratelimit-remaining-tokens"] == "2"

    async def drain() -> list[str]:
        return [chunk async for chunk in stream.iterator]  # type: ignore[union-attr]

    assert len(asyncio.run(drain())) == 4  # passes its budget mid-way and finishes
    with pytest.raises(APIError) as error:
        book.admit(tenant)  # released, but over the token budget
    assert error.value.headers["x-ratelimit-remaining-tokens"] == "0"


def test_stream_dropped_before_it_starts_releases() -> None:
    book = QuotaBook(lambda tenant, limit: None, FakeClock())
    tenant = Tenant("a", max_concurrent_requests=1)
    lease = book.admit(tenant)
    assert lease is not None

    async def chunks() -> Any:
        yield "data: [DONE]\n\n"

    stream = lease.settle(Stream(chunks()))
    del stream
    assert book.admit(tenant) is not None


def test_num_gateways_share() -> None:
    key = ApiKeyConfig(
        name="a", key_sha256="0" * 64, requests_per_minute=100, tokens_per_minute=1000, max_concurrent_requests=3,
    )
    tenant = Tenant.from_config(key, num_gateways=3)
    assert (tenant.requests_per_minute, tenant.tokens_per_minute, tenant.max_concurrent_requests) == (34, 334, 1)
    book = QuotaBook(lambda tenant, limit: None, FakeClock())
    assert book.admit(tenant) is not None
    with pytest.raises(APIError):
        book.admit(tenant)  # this gateway's share of 3 concurrent requests is 1
