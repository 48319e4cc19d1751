"""Per-tenant quotas over a sliding minute: requests, tokens, and requests in flight.

The algorithm is a sliding-window log, not GCRA: GCRA (a token bucket) refills continuously, so
after a burst that spends the whole limit at once it admits a request every ``60 / limit`` s, and
a 60-s span can hold almost twice the limit. A log admits at most ``limit`` requests (tokens)
in any 60-s span, which is what ``requests_per_minute`` says to the person who set it, and its
``remaining``/``reset`` values are OpenAI's (``reset``: until the window holds nothing again).

Memory is bounded per tenant: charges within :data:`SLOT_S` of a log entry's first charge join
that entry, so a log holds at most ``window_s / slot_s + 2`` entries whatever the rates. An entry
expires :data:`WINDOW_S` after its *last* charge, so a charge may be counted up to ``slot_s`` too
long, never too short: the limit holds exactly, the waits it answers are up to ``slot_s`` long.

Pure: plain numbers, the time passed in (``now_s``, any monotonic clock's seconds); the gateway
(:mod:`gateway.quotas`) keeps one :class:`TenantUsage` per tenant and locks around it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WINDOW_S = 60.0
SLOT_S = 0.25
# Seconds a request refused for concurrency is asked to wait: when one of the tenant's requests in
# flight ends is unknown, and a second is short enough for a client's retry to find the slot.
CONCURRENCY_RETRY_S = 1.0

REQUESTS_PER_MINUTE = "requests_per_minute"
TOKENS_PER_MINUTE = "tokens_per_minute"
MAX_CONCURRENT_REQUESTS = "max_concurrent_requests"


class _Entry:
    __slots__ = ("first_s", "last_s", "amount")

    def __init__(self, now_s: float, amount: int) -> None:
        self.first_s = now_s
        self.last_s = now_s
        self.amount = amount


class SlidingWindowLog:
    """Amounts charged over the last ``window_s`` seconds, in at most ``window_s / slot_s + 2`` entries.

    Args:
        window_s: the window's length in seconds.
        slot_s: charges this close (seconds) to an entry's first charge join that entry.
    """

    def __init__(self, window_s: float = WINDOW_S, slot_s: float = SLOT_S) -> None:
        self._window_s = window_s
        self._slot_s = slot_s
        self._entries: deque[_Entry] = deque()
        self._total = 0

    def charge(self, amount: int, now_s: float) -> None:
        """Add ``amount`` (>= 0) at ``now_s``."""
        self._expire(now_s)
        last = self._entries[-1] if self._entries else None
        if last is not None and now_s - last.first_s < self._slot_s:
            last.amount += amount
            last.last_s = max(last.last_s, now_s)
        else:
            self._entries.append(_Entry(now_s, amount))
        self._total += amount

    def total(self, now_s: float) -> int:
        """What was charged in the window ending at ``now_s``."""
        self._expire(now_s)
        return self._total

    def seconds_until_under(self, limit: int, now_s: float) -> float:
        """Seconds from ``now_s`` until the window's total is below ``limit`` (0: it is now), as
        the oldest entries expire."""
        total = self.total(now_s)
        wait_s = 0.0
        for entry in self._entries:
            if total < limit:
                break
            total -= entry.amount
            wait_s = entry.last_s + self._window_s - now_s
        return wait_s

    def seconds_until_empty(self, now_s: float) -> float:
        """Seconds from ``now_s`` until every charge has left the window (0: none is in it)."""
        self._expire(now_s)
        return self._entries[-1].last_s + self._window_s - now_s if self._entries else 0.0

    def __len__(self) -> int:
        """Entries held (at most ``window_s / slot_s + 2``)."""
        return len(self._entries)

    def _expire(self, now_s: float) -> None:
        while self._entries and self._entries[0].last_s + self._window_s <= now_s:
            self._total -= self._entries.popleft().amount


@dataclass(frozen=True)
class QuotaLimits:
    """One tenant's limits on this gateway (``None``: no limit); each >= 1.

    Fields:
        requests_per_minute: requests admitted in any 60-s span.
        tokens_per_minute: prompt + generated tokens charged in any 60-s span; checked at
            admission only, so a running request may pass it (the next one is refused).
        max_concurrent_requests: requests from admission to the end of their response.
    """

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None


@dataclass(frozen=True)
class RateLimitState:
    """What OpenAI's ``x-ratelimit-*`` headers say, for the limits that are set (``None`` fields
    for one that is not): each limit, what remains of it now, and the seconds until the window
    holds nothing again (``reset``)."""

    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float | None
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_s: float | None


@dataclass(frozen=True)
class Refusal:
    """A request refused at admission.

    Fields:
        limit: the limit that refused it (:data:`REQUESTS_PER_MINUTE`, :data:`TOKENS_PER_MINUTE`
            or :data:`MAX_CONCURRENT_REQUESTS`); of several, the one with the longest wait.
        retry_after_s: seconds until every limit that refused it admits a request again (for
            concurrency, :data:`CONCURRENCY_RETRY_S`).
        state: the header values at the refusal.
    """

    limit: str
    retry_after_s: float
    state: RateLimitState


class TenantUsage:
    """One tenant's usage on this gateway: a log of admissions, a log of tokens, requests in flight.

    The limits are passed to each call, not kept, so a key's new limits (a reload) apply at once.
    Not thread-safe: the caller serialises calls.
    """

    def __init__(self, window_s: float = WINDOW_S, slot_s: float = SLOT_S) -> None:
        self.requests = SlidingWindowLog(window_s, slot_s)
        self.tokens = SlidingWindowLog(window_s, slot_s)
        self.in_flight = 0

    def admit(self, limits: QuotaLimits, now_s: float) -> Refusal | None:
        """Admit one request at ``now_s`` (counted in the requests log and in flight: the caller
        calls :meth:`release` when its response ends) or refuse it, counting nothing.

        A request is refused when the tenant has ``max_concurrent_requests`` in flight, has been
        admitted ``requests_per_minute`` times in the last minute, or has been charged
        ``tokens_per_minute`` tokens or more in it.
        """
        waits: list[tuple[float, str]] = []
        if limits.max_concurrent_requests is not None and self.in_flight >= limits.max_concurrent_requests:
            waits.append((CONCURRENCY_RETRY_S, MAX_CONCURRENT_REQUESTS))
        if limits.requests_per_minute is not None and self.requests.total(now_s) >= limits.requests_per_minute:
            waits.append((self.requests.seconds_until_under(limits.requests_per_minute, now_s), REQUESTS_PER_MINUTE))
        if limits.tokens_per_minute is not None and self.tokens.total(now_s) >= limits.tokens_per_minute:
            waits.append((self.tokens.seconds_until_under(limits.tokens_per_minute, now_s), TOKENS_PER_MINUTE))
        if waits:
            retry_after_s, limit = max(waits)
            return Refusal(limit, retry_after_s, self.state(limits, now_s))
        self.requests.charge(1, now_s)
        self.in_flight += 1
        return None

    def charge_tokens(self, num_tokens: int, now_s: float) -> None:
        """Charge ``num_tokens`` (prompt or generated) at ``now_s``."""
        self.tokens.charge(num_tokens, now_s)

    def release(self) -> None:
        """One admitted request's response ended (the caller calls this once per admission)."""
        self.in_flight = max(0, self.in_flight - 1)

    def state(self, limits: QuotaLimits, now_s: float) -> RateLimitState:
        """The header values at ``now_s`` for the limits set."""
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        return RateLimitState(
            limit_requests=rpm,
            remaining_requests=None if rpm is None else max(0, rpm - self.requests.total(now_s)),
            reset_requests_s=None if rpm is None else self.requests.seconds_until_empty(now_s),
            limit_tokens=tpm,
            remaining_tokens=None if tpm is None else max(0, tpm - self.tokens.total(now_s)),
            reset_tokens_s=None if tpm is None else self.tokens.seconds_until_empty(now_s),
        )
