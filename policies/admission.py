"""Admission limits for a bucket's queue and the ``Retry-After`` a refused client is told.

A bucket refuses a request when its queue (submitted, not yet started) would hold more than
``max_queue_len`` requests or more than ``max_queued_tokens`` prompt tokens (Triton's
``max_queue_size`` with a reject action). The wait it suggests is the queue's length over its
recent drain rate: the time the requests ahead need to leave the queue.

With fair share (:func:`fair_refusal_reason`), a full queue refuses only a tenant that already
holds its weighted share of the limit reached, so a noisy tenant gets the 429s, not a quiet one.
"""

from __future__ import annotations

import collections
import math


def refusal_reason(
    num_queued: int,
    num_queued_tokens: int,
    num_tokens: int,
    max_queue_len: int,
    max_queued_tokens: int | None,
    num_seqs: int = 1,
) -> str | None:
    """Why a request of ``num_tokens`` prompt tokens may not join a queue; ``None``: it may.

    Args:
        num_queued: sequences queued now (a request with ``n`` choices counts ``n``).
        num_queued_tokens: their prompt tokens (a prompt counts once, however many choices).
        num_tokens: the newcomer's prompt tokens.
        max_queue_len: the most queued sequences. A request with more choices than the whole
            limit is still let into an empty queue, or it could never run.
        max_queued_tokens: the most queued prompt tokens; ``None``: no limit. A request larger
            than the whole limit is still let into an empty queue, or it could never run.
    Returns:
        A reason naming the limit and its value, or ``None``.
    """
    is_len_full, is_tokens_full = full_limits(num_queued, num_queued_tokens, num_tokens, max_queue_len, max_queued_tokens, num_seqs)
    if is_len_full:
        return f"max_queue_len {max_queue_len} reached ({num_queued} requests queued)"
    if is_tokens_full:
        return (
            f"max_queued_tokens {max_queued_tokens} would be exceeded "
            f"({num_queued_tokens} prompt tokens queued, {num_tokens} more asked)"
        )
    return None


def full_limits(
    num_queued: int, num_queued_tokens: int, num_tokens: int, max_queue_len: int, max_queued_tokens: int | None, num_seqs: int
) -> tuple[bool, bool]:
    """Whether the newcomer would exceed ``max_queue_len``, and ``max_queued_tokens`` (arguments
    as :func:`refusal_reason`'s; an empty queue takes any request, or it could never run)."""
    is_len_full = num_queued + num_seqs > max_queue_len and (num_queued > 0 or max_queue_len < 1)
    is_tokens_full = max_queued_tokens is not None and num_queued > 0 and num_queued_tokens + num_tokens > max_queued_tokens
    return is_len_full, is_tokens_full


def fair_refusal_reason(
    num_queued: int,
    num_queued_tokens: int,
    num_tokens: int,
    max_queue_len: int,
    max_queued_tokens: int | None,
    num_seqs: int,
    tenant_queued: tuple[int, int],
    weight: float,
    other_weights: list[float],
) -> str | None:
    """:func:`refusal_reason` under fair share: a full limit refuses only a tenant that has
    requests queued and would hold more than its weighted share of that limit with this one,
    ``limit * weight / (weight + sum(other_weights))`` over the tenants queued (itself
    included); a tenant within its share of every full limit (or with nothing queued) is
    admitted. The queue may thus exceed a limit, by at most the shares of the tenants under
    theirs (and one request of each tenant that had none queued). With one tenant it is
    :func:`refusal_reason` exactly.

    Args:
        tenant_queued: the newcomer's tenant's queued ``(sequences, prompt tokens)``.
        weight: its weight (> 0).
        other_weights: the weights of the other tenants with requests queued.
    Returns:
        A reason naming the limit, its value and the tenant's share, or ``None``.
    """
    reason = refusal_reason(num_queued, num_queued_tokens, num_tokens, max_queue_len, max_queued_tokens, num_seqs)
    if reason is None:
        return None
    is_len_full, is_tokens_full = full_limits(num_queued, num_queued_tokens, num_tokens, max_queue_len, max_queued_tokens, num_seqs)
    fraction = weight / (weight + sum(other_weights))
    over = [
        (name, held, limit * fraction)
        for name, is_full, held, asked, limit in (
            ("max_queue_len", is_len_full, tenant_queued[0], num_seqs, max_queue_len),
            ("max_queued_tokens", is_tokens_full, tenant_queued[1], num_tokens, max_queued_tokens or 0),
        )
        if is_full and tenant_queued[0] > 0 and held + asked > limit * fraction
    ]
    if not over:
        return None
    name, held, share = over[0]
    return (
        f"{reason}; this tenant holds {held} of its weighted share {share:.1f} of {name} (a tenant within "
        "its share is still admitted, so the queue may exceed the limit by the other tenants' shares)"
    )


def retry_after_s(num_queued: int, drain_per_s: float, min_s: int = 1, max_s: int = 60) -> int:
    """Whole seconds until ``num_queued`` requests leave a queue draining ``drain_per_s`` a second,
    ``ceil(num_queued / drain_per_s)`` clamped to ``[min_s, max_s]``; ``max_s`` when nothing drained."""
    if drain_per_s <= 0:
        return max_s
    return max(min_s, min(max_s, math.ceil(num_queued / drain_per_s)))


class RateWindow:
    """Events per second over the last ``window_s`` seconds (a sliding window of timestamps).

    Args:
        window_s: how far back events count.
        start_s: when counting began (same clock as :meth:`record`); before ``window_s`` has
            passed the rate is over the time since then (at least one second), not the whole window.
    """

    def __init__(self, window_s: float = 30.0, start_s: float = 0.0):
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self.start_s = start_s
        self._times: collections.deque[float] = collections.deque()

    def record(self, now: float) -> None:
        self._times.append(now)
        self._prune(now)

    def rate_per_s(self, now: float) -> float:
        self._prune(now)
        span_s = max(1.0, min(self.window_s, now - self.start_s))
        return len(self._times) / span_s

    def _prune(self, now: float) -> None:
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()


class BusyDrainRate:
    """How fast a queue drains while it holds requests: dequeues per second of busy time over the
    last ``window`` dequeues, idle stretches left out (a bucket idle for most of a minute would
    otherwise look slow). The interval in progress counts too, so a stuck queue looks slow.

    The caller reports each enqueue and dequeue with the queue length around it.

    Args:
        window: how many recent dequeue intervals count.
        min_samples: fewer recorded intervals than this give a rate of 0 (unknown).
    """

    def __init__(self, window: int = 32, min_samples: int = 4):
        if window < 1 or min_samples < 1:
            raise ValueError(f"window and min_samples must be at least 1, got {window}, {min_samples}")
        self.min_samples = min_samples
        self._intervals: collections.deque[float] = collections.deque(maxlen=window)
        self._busy_since: float | None = None

    def on_enqueue(self, now: float, num_queued_before: int) -> None:
        if num_queued_before == 0 and self._busy_since is None:
            self._busy_since = now

    def on_dequeue(self, now: float, num_queued_after: int) -> None:
        if self._busy_since is not None:
            self._intervals.append(max(0.0, now - self._busy_since))
        self._busy_since = now if num_queued_after > 0 else None

    def rate_per_s(self, now: float) -> float:
        """Dequeues per busy second; 0.0 while fewer than ``min_samples`` intervals are known."""
        if len(self._intervals) < self.min_samples:
            return 0.0
        in_progress_s = now - self._busy_since if self._busy_since is not None else 0.0
        busy_s = sum(self._intervals) + in_progress_s
        return len(self._intervals) / busy_s if busy_s > 0 else float("inf")
