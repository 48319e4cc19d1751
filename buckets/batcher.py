"""The interface every batcher offers to its bucket and device slice."""

from __future__ import annotations

from typing import Any, Protocol

from buckets.request import Request
from buckets.stats import BatchObserver, BucketStats


class Batcher(Protocol):
    """A queue of requests plus the loop body that turns them into forwards.

    ``submit`` is called from the event loop thread; everything else from the slice's worker.
    """

    kind: str

    def submit(self, request: Request) -> None:
        """Queue a request (thread-safe, never blocks)."""

    def seconds_until_ready(self, now: float) -> float | None:
        """``None``: no work. ``0.0``: :meth:`step` has work now. Else seconds until it will."""

    def head_priority(self, now: float) -> float | None:
        """The best (lowest) effective priority among its queued and running requests at ``now``
        (:func:`policies.priority.effective_priority`); ``None`` without any. The slice's arbiter
        compares buckets by it."""

    def step(self) -> None:
        """Run one forward (a continuous step or a dynamic batch) and emit its results."""

    def update_settings(self, settings: Any) -> None:
        """Use new settings of the same kind from the next step or batch on (thread-safe).

        Raises:
            ValueError: a setting that cannot change for a running batcher differs.
        """

    def add_batch_observer(self, observer: BatchObserver) -> None:
        """Call ``observer(num_seqs, num_tokens, num_padding_tokens)`` after every forward (worker thread)."""

    def stats(self) -> BucketStats:
        """A snapshot of counters and queue state."""

    def shutdown(self) -> None:
        """Fail every queued or running request with :class:`ShuttingDownError`."""
