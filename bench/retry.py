"""Client-side retries for load tools: exponential backoff with full jitter, honouring Retry-After.

A client that retries a 429 or 503 at once, or after a fixed pause, turns one overload into a
retry storm: every refused client comes back together. Full jitter spreads the retries
uniformly over ``[0, min(max_delay_s, base_delay_s * 2**attempt)]`` (Brooker, "Exponential
Backoff and Jitter", AWS Architecture Blog, 2015); a server's ``Retry-After`` is a floor on the
wait; and ``max_attempts`` bounds how long one request keeps trying.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class RetryPolicy:
    """When and how long to retry.

    Fields:
        max_attempts: tries in all, the first included (1: never retry).
        base_delay_s: the backoff's first ceiling; it doubles each retry.
        max_delay_s: the most one wait may last, ``Retry-After`` included.
        retry_statuses: the HTTP statuses worth retrying (overload, not bad input).
    """

    max_attempts: int = 5
    base_delay_s: float = 0.5
    max_delay_s: float = 30.0
    retry_statuses: frozenset[int] = frozenset({429, 503})

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError(f"invalid retry policy: {self}")


def retry_after_s(response: httpx.Response) -> float | None:
    """The ``Retry-After`` header in seconds (the delta-seconds form), or ``None`` if absent or
    not a number (an HTTP date is not honoured: our gateway sends seconds)."""
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def backoff_delay_s(retry: int, policy: RetryPolicy, rng: random.Random, server_hint_s: float | None) -> float:
    """Seconds to wait before retry number ``retry`` (0 for the first retry): full jitter over
    ``[0, min(max_delay_s, base_delay_s * 2**retry)]``, raised to the server's hint, capped at
    ``max_delay_s``."""
    ceiling = min(policy.max_delay_s, policy.base_delay_s * 2**retry)
    delay = rng.uniform(0.0, ceiling)
    if server_hint_s is not None:
        delay = max(delay, server_hint_s)
    return min(delay, policy.max_delay_s)


async def send_with_retry(
    send: Callable[[], Awaitable[httpx.Response]],
    policy: RetryPolicy,
    rng: random.Random,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> tuple[httpx.Response, int]:
    """Call ``send`` until its response is not retryable or ``policy.max_attempts`` is spent.

    Returns ``(last response, attempts made)``. Transport errors are not retried here: they
    propagate, since a dead server is not an overloaded one.
    """
    for attempt in range(policy.max_attempts):
        response = await send()
        if response.status_code not in policy.retry_statuses or attempt + 1 == policy.max_attempts:
            return response, attempt + 1
        await response.aclose()
        await sleep(backoff_delay_s(attempt, policy, rng, retry_after_s(response)))
    raise AssertionError("unreachable: the loop returns on its last attempt")
