"""When a dynamic batch leaves (Triton's dynamic batcher rule, Ray Serve's wait-from-first).

A batch closes as soon as ``max_batch_size`` requests are queued, or when the oldest queued
request has waited ``max_queue_delay_s``. The average batch is then about
``min(arrival_rate * max_queue_delay_s, max_batch_size)``.
"""

from __future__ import annotations


def seconds_until_batch_closes(
    num_queued: int, oldest_wait_s: float, max_batch_size: int, max_queue_delay_s: float
) -> float | None:
    """How long to wait before running the next batch.

    Args:
        num_queued: requests waiting now.
        oldest_wait_s: how long the oldest of them has waited, in seconds.
        max_batch_size: the most requests in one batch.
        max_queue_delay_s: the longest the oldest request may wait for company.
    Returns:
        ``None`` when nothing is queued, ``0.0`` when a batch should run now, else the seconds
        until the oldest request's delay runs out.
    """
    if num_queued <= 0:
        return None
    if num_queued >= max_batch_size or oldest_wait_s >= max_queue_delay_s:
        return 0.0
    return max_queue_delay_s - oldest_wait_s
