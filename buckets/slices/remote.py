"""What the gateway's side of a process slice keeps about its worker's buckets: each bucket as
the gateway knows it, each request in flight, and each rebuild asked of the worker and not yet
answered."""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Any

from buckets.request import Request
from buckets.slices.slice import BatcherSettings, BucketKey
from buckets.stats import BatchObserver, BucketStats


@dataclass
class InFlight:
    key: BucketKey
    request: Request


@dataclass
class RemoteBucket:
    """What the gateway knows of one bucket run by the worker; written by the process slice
    alone (settings on the caller's thread, stats and info on the reader thread)."""

    kind: str
    settings: BatcherSettings
    backend_info: dict[str, Any]
    stats: BucketStats
    observers: list[BatchObserver]


class PendingRebuilds:
    """The rebuilds asked of a worker, one at a time per bucket, each a future of the bucket's
    new backend info (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: dict[BucketKey, concurrent.futures.Future[dict[str, Any]]] = {}

    def start(self, key: BucketKey) -> concurrent.futures.Future[dict[str, Any]]:
        """A future for bucket ``key``'s rebuild.

        Raises:
            RuntimeError: one is already under way for ``key``.
        """
        with self._lock:
            if key in self._futures:
                raise RuntimeError(f"bucket {key} is being rebuilt already")
            future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
            self._futures[key] = future
        return future

    def finish(self, key: BucketKey, info: dict[str, Any] | None, error: str | None) -> None:
        """The worker's answer for ``key``: the new backend info, or why it could not rebuild."""
        with self._lock:
            future = self._futures.pop(key, None)
        if future is None:
            return
        if error is not None or info is None:
            future.set_exception(RuntimeError(f"the worker could not rebuild bucket {key}: {error}"))
        else:
            future.set_result(info)

    def fail_all(self, reason: str) -> None:
        """Fail every rebuild still waiting (the worker exited)."""
        with self._lock:
            futures, self._futures = list(self._futures.values()), {}
        for future in futures:
            future.set_exception(RuntimeError(reason))
