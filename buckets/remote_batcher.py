"""The gateway's stand-in for a batcher that runs in a process slice's worker process."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from buckets.request import Request
from buckets.stats import BatchObserver, BucketStats, Counters

if TYPE_CHECKING:
    from buckets.process_slice import ProcessSlice


class RemoteBatcher:
    """Implements :class:`~buckets.batcher.Batcher` for a bucket whose real batcher lives in the
    worker process of ``device_slice`` (a :class:`~buckets.process_slice.ProcessSlice`).

    :meth:`submit` hands the request to the slice, which sends it to the worker and routes the
    worker's events back to the request's sink. The slice's worker steps the real batcher, so
    :meth:`seconds_until_ready` is always ``None`` here. :meth:`stats` is the latest snapshot the
    worker pushed (at most ``STATS_INTERVAL_S`` old while anything changes).

    Args:
        key: ``(model name, bucket name)``, the bucket's name in messages.
        kind: ``continuous`` or ``dynamic``, as the real batcher's.
        device_slice: the process slice the bucket is placed on.
        settings: the real batcher's settings at start (to refuse a change of fixed ones here).
        backend_info: the bucket's backend description, filled in from the worker's ``ready``.
    """

    def __init__(
        self,
        key: tuple[str, str],
        kind: str,
        device_slice: ProcessSlice,
        settings: Any,
        backend_info: dict[str, Any] | None = None,
    ):
        self.key = key
        self.kind = kind
        self.device_slice = device_slice
        self.settings = settings
        self.backend_info = backend_info if backend_info is not None else {}
        self._observers: list[BatchObserver] = []
        self._stats = Counters().snapshot(kind, num_waiting=0, num_running=0)
        self._lock = threading.Lock()

    def submit(self, request: Request) -> None:
        """Send ``request`` to the worker (thread-safe, never blocks).

        Raises:
            SliceUnavailableError: the worker is (re)starting; nothing queued.
        """
        self.device_slice.submit(self.key, request)

    def seconds_until_ready(self, now: float) -> float | None:
        return None

    def head_priority(self, now: float) -> float | None:
        return None

    def step(self) -> None:
        """Nothing to do here: the worker process steps the real batcher."""

    def update_settings(self, settings: Any) -> None:
        """Send new settings to the worker, which applies them from its next step or batch.

        Raises:
            ValueError: a continuous bucket's ``block_size`` or ``enable_prefix_caching`` differ.
        """
        fixed = ("block_size", "enable_prefix_caching")
        if self.kind == "continuous" and any(getattr(settings, f) != getattr(self.settings, f) for f in fixed):
            raise ValueError("block_size and enable_prefix_caching are fixed for a bucket's life")
        self.settings = settings
        self.device_slice.send_settings(self.key, settings)

    def add_batch_observer(self, observer: BatchObserver) -> None:
        """Call ``observer(num_seqs, num_tokens, num_padding_tokens)`` for every forward the worker
        reports (on the slice's reader thread)."""
        self._observers.append(observer)

    def stats(self) -> BucketStats:
        with self._lock:
            return self._stats

    def shutdown(self) -> None:
        """Fail this bucket's requests in flight with :class:`ShuttingDownError`."""
        self.device_slice.fail_bucket(self.key)

    def record_batch(self, num_seqs: int, num_tokens: int, num_padding_tokens: int) -> None:
        """A forward the worker ran (called by the slice's reader thread)."""
        for observer in self._observers:
            observer(num_seqs, num_tokens, num_padding_tokens)

    def set_stats(self, stats: BucketStats) -> None:
        """The worker's latest snapshot (called by the slice's reader thread)."""
        with self._lock:
            self._stats = stats
