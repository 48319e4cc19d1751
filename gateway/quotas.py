"""API keys' quotas on this gateway: admission, token charges, and OpenAI's rate-limit headers.

:class:`QuotaBook` keeps each tenant's usage (:class:`policies.quotas.TenantUsage`) by name. The
counters are this gateway's own: with ``auth.num_gateways`` gateways behind one balancer, each
enforces its share of a key's quotas, ``ceil(limit / num_gateways)``, which
:meth:`gateway.tenants.Tenant.from_config` has already worked out; nothing is shared between them.

A request of a tenant with quotas is admitted in :func:`gateway.routes.openai._served_call`, after
the model and priority checks and before the model is loaded, and holds a :class:`QuotaLease` until
its response ends. A whole response charges its ``usage.total_tokens`` when it is built; a stream
charges its prompt and generated tokens as its chunks go out (the lease's ``meter``), so a stream
that passes the key's ``tokens_per_minute`` finishes and the key's next request gets the 429.
Requests of tenants without quotas (anonymous ones included) get no lease and no headers.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from litestar.response import Response, Stream

from gateway.errors import rate_limited
from gateway.tenants import Tenant
from policies.quotas import QuotaLimits, RateLimitState, TenantUsage


class QuotaBook:
    """Every tenant's usage on this gateway, keyed by tenant name (bounded by the configured keys).

    Thread-safe (one lock): leases are charged on the event loop, and one may be released by the
    garbage collector in any thread (:meth:`QuotaLease.settle`).

    Args:
        on_refusal: called with ``(tenant name, limit name)`` for each request refused
            (the ``sluice_rate_limited_total`` counter).
        clock: monotonic seconds.
    """

    def __init__(self, on_refusal: Callable[[str, str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._on_refusal = on_refusal
        self._clock = clock
        self._lock = threading.Lock()
        self._usage: dict[str, TenantUsage] = {}

    def admit(self, tenant: Tenant) -> QuotaLease | None:
        """Admit one HTTP request of ``tenant``: ``None`` for a tenant without quotas, else a lease
        the caller settles or releases when the response ends.

        Raises:
            APIError: 429 ``rate_limit_exceeded`` with ``Retry-After``, ``retry-after-ms`` and the
                ``x-ratelimit-*`` headers, naming the limit reached.
        """
        if not tenant.has_quotas:
            return None
        limits = QuotaLimits(tenant.requests_per_minute, tenant.tokens_per_minute, tenant.max_concurrent_requests)
        with self._lock:
            usage = self._usage.setdefault(tenant.name, TenantUsage())
            refusal = usage.admit(limits, self._clock())
        if refusal is not None:
            self._on_refusal(tenant.name, refusal.limit)
            raise rate_limited(tenant.name, refusal.limit, refusal.retry_after_s, rate_limit_headers(refusal.state))
        return QuotaLease(self, usage, limits)

    def charge(self, usage: TenantUsage, num_tokens: int) -> None:
        with self._lock:
            usage.charge_tokens(num_tokens, self._clock())

    def release(self, usage: TenantUsage) -> None:
        with self._lock:
            usage.release()

    def state(self, usage: TenantUsage, limits: QuotaLimits) -> RateLimitState:
        with self._lock:
            return usage.state(limits, self._clock())


class QuotaLease:
    """One admitted HTTP request's hold on its tenant's quotas, from admission to the response's end.

    ``meter``: set by the route once the request's tokens can be counted: the prompt and
    generated tokens so far (a stream is charged from it as its chunks go out).
    """

    def __init__(self, book: QuotaBook, usage: TenantUsage, limits: QuotaLimits) -> None:
        self._book = book
        self._usage = usage
        self._limits = limits
        self._charged_tokens = 0
        self._released = False
        self.meter: Callable[[], int] | None = None

    def charge_to(self, total_tokens: int) -> None:
        """Charge what ``total_tokens`` (the request's tokens so far) adds to what was charged."""
        if total_tokens > self._charged_tokens:
            self._book.charge(self._usage, total_tokens - self._charged_tokens)
            self._charged_tokens = total_tokens

    def release(self) -> None:
        """The response ended (finished, failed or dropped): charge the meter's last count and
        free the concurrency slot. Idempotent."""
        if self._released:
            return
        self._released = True
        if self.meter is not None:
            self.charge_to(self.meter())
        self._book.release(self._usage)

    def headers(self) -> dict[str, str]:
        """The ``x-ratelimit-*`` headers of the tenant's limits now."""
        return rate_limit_headers(self._book.state(self._usage, self._limits))

    def settle(self, response: Response[Any] | Stream) -> Response[Any] | Stream:
        """Add the rate-limit headers to ``response``; a whole response charges its
        ``usage.total_tokens`` and releases the lease now, a stream is charged as its chunks go
        out and releases it when it ends, fails or is dropped (unstarted, too)."""
        if isinstance(response, Stream):
            response.iterator = self._metered(response.iterator)
            weakref.finalize(response.iterator, self.release)  # a stream dropped before it started
            response.headers.update(self.headers())
            return response
        try:
            usage = response.content.get("usage") if isinstance(response.content, dict) else None
            if isinstance(usage, dict):
                self.charge_to(int(usage.get("total_tokens", 0)))
            response.headers.update(self.headers())
        finally:
            self.release()
        return response

    async def _metered(self, chunks: Any) -> AsyncIterator[Any]:
        try:
            async for chunk in chunks:
                if self.meter is not None:
                    self.charge_to(self.meter())  # the chunk's tokens are counted before it is built
                yield chunk
        finally:
            self.release()


def meter(lease: QuotaLease | None, count_tokens: Callable[[], int]) -> None:
    """Charge ``lease`` (``None``: no quotas, nothing to do) from ``count_tokens``, the request's
    prompt and generated tokens so far: now (the prompt, once it is known) and as it goes on."""
    if lease is not None:
        lease.meter = count_tokens
        lease.charge_to(count_tokens())


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` headers write it (Go's ``Duration.String``
    to the millisecond, rounded up): ``"59ms"``, ``"1s"``, ``"1.5s"``, ``"6m0s"``, ``"1h0m0s"``."""
    ms = math.ceil(round(seconds * 1000, 6))
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest_ms = divmod(ms, 3_600_000)
    minutes, rest_ms = divmod(rest_ms, 60_000)
    secs = f"{rest_ms // 1000}.{rest_ms % 1000:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    return f"{minutes}m{secs}" if minutes else secs


def rate_limit_headers(state: RateLimitState) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the limits set."""
    headers: dict[str, str] = {}
    for kind, limit, remaining, reset_s in (
        ("requests", state.limit_requests, state.remaining_requests, state.reset_requests_s),
        ("tokens", state.limit_tokens, state.remaining_tokens, state.reset_tokens_s),
    ):
        if limit is not None and remaining is not None and reset_s is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(remaining)
            headers[f"x-ratelimit-reset-{kind}"] = format_reset(reset_s)
    return headers
