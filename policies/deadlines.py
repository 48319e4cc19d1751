"""Request deadlines: the timeout a request runs under, and whether a queue can still meet it.

A request's ``timeout`` (seconds, from its body) is bounded by its model's cap and defaults to
the model's default; its deadline is arrival + timeout on the monotonic clock. A queue whose
expected wait already exceeds a newcomer's timeout refuses it at once (429) rather than let it
time out after waiting: the expected wait is the requests ahead over the queue's recent drain
rate (Little's law, ``W = L / lambda``), as for ``Retry-After``.
"""

from __future__ import annotations


class TimeoutOverCapError(ValueError):
    """A requested timeout above the model's ``max_timeout_s``."""


def resolve_timeout_s(requested_s: float | None, default_s: float | None, cap_s: float | None) -> float | None:
    """The timeout a request runs under: ``requested_s``, else ``default_s`` clipped to ``cap_s``.

    ``None`` everywhere means no deadline.

    Raises:
        TimeoutOverCapError: ``requested_s`` exceeds ``cap_s``.
    """
    if requested_s is None:
        if default_s is None:
            return cap_s
        return default_s if cap_s is None else min(default_s, cap_s)
    if cap_s is not None and requested_s > cap_s:
        raise TimeoutOverCapError(f"timeout is {requested_s:g} s, over the cap of {cap_s:g} s")
    return requested_s


def is_expired(deadline_s: float | None, now_s: float) -> bool:
    """Whether a deadline (monotonic seconds; ``None``: none) has passed at ``now_s``."""
    return deadline_s is not None and now_s >= deadline_s


def expected_wait_s(num_queued: int, drain_per_s: float) -> float | None:
    """Seconds until ``num_queued`` requests ahead have left a queue draining ``drain_per_s`` a
    second; ``0`` for an empty queue, ``None`` when the queue has not drained yet (unknown)."""
    if num_queued == 0:
        return 0.0
    if drain_per_s <= 0:
        return None
    return num_queued / drain_per_s


def can_meet_deadline(num_queued: int, drain_per_s: float, timeout_s: float | None) -> bool:
    """Whether a request with ``timeout_s`` (``None``: none) can start before it expires, by the
    queue's expected wait. An unknown wait (nothing drained yet) never refuses."""
    if timeout_s is None:
        return True
    wait_s = expected_wait_s(num_queued, drain_per_s)
    return wait_s is None or wait_s < timeout_s
