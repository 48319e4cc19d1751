"""The worker process's side of a process slice: serves a local slice's buckets over the pipe.

The gateway's :class:`~buckets.slices.process.ProcessSlice` sends requests, cancellations and
settings; this host rebuilds each request with a sink that sends its events back, submits it
to the worker's own slice (a :class:`~buckets.slices.thread.ThreadSlice`, through the
:class:`~buckets.slices.slice.Slice` protocol alone), and pushes the buckets' stats snapshots
(every ``stats_interval_s`` while they change, and once a second regardless, for the slice's
busy ratio). Messages: :mod:`buckets.slices.messages`.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

import structlog

from buckets.errors import BatchFailedError
from buckets.request import ErrorEvent, Request, RequestEvent
from buckets.slices.messages import Message, decode_request, encode_event, encode_stats, is_final
from buckets.slices.slice import BucketKey, Slice
from buckets.stats import BatchObserver

log = structlog.get_logger(__name__)

STATS_INTERVAL_S = 0.05
STATS_REFRESH_S = 1.0

# Rebuild the batcher now serving a bucket (its local key given); returns the new batcher's local
# key, its backend info, and what retires the old one once new requests go to the new one.
Rebuild = Callable[[BucketKey], tuple[BucketKey, dict[str, Any], Callable[[], None]]]


class SliceHost:
    """Serves the buckets ``keys`` (``(model name, bucket name)``) of ``local_slice`` (they are
    attached and it is started) to the gateway at the other end of ``conn``.

    Call :meth:`serve` on the process's main thread; it returns when the gateway says stop or
    its end of the pipe closes. Then stop the slice (which fails what is queued: those events
    still go out) and call :meth:`close`.

    ``rebuild`` serves the gateway's ``("rebuild", key)`` on a thread of its own: once the new
    batcher is built, requests for ``key`` go to it (the gateway's key stays; the host maps it to
    the batcher's local key), and the old one drains what it holds.
    """

    def __init__(
        self,
        conn: Connection,
        local_slice: Slice,
        keys: list[BucketKey],
        stats_interval_s: float = STATS_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        rebuild: Rebuild | None = None,
    ):
        self.conn = conn
        self.local_slice = local_slice
        self.keys = keys
        self._rebuild = rebuild
        self._local: dict[BucketKey, BucketKey] = {key: key for key in keys}  # the gateway's key -> the batcher's
        self._local_lock = threading.Lock()
        self.stats_interval_s = stats_interval_s
        self.clock = clock
        self._requests: dict[int, Request] = {}
        self._outbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._sender = threading.Thread(target=self._write, name="slice-host-sender", daemon=True)
        self._stats = threading.Thread(target=self._push_stats, name="slice-host-stats", daemon=True)

    def serve(self) -> None:
        """Announce readiness, then handle the gateway's messages until stop or end of file."""
        for key in self.keys:
            self.local_slice.add_batch_observer(key, self._batch_reporter(key))
        self._sender.start()
        backend_info = {key: dict(self.local_slice.backend_info(key)) for key in self.keys}
        self._outbox.put(("ready", os.getpid(), backend_info))
        self._stats.start()
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            if message[0] == "stop":
                return
            try:
                self._handle(message)
            except Exception:  # one bad message must not take the worker down
                log.exception("slice_host_message_error", kind=message[0])

    def _batch_reporter(self, key: BucketKey) -> BatchObserver:
        """A batch observer that sends bucket ``key``'s forwards to the gateway."""

        def report(num_seqs: int, num_tokens: int, num_padding_tokens: int) -> None:
            self._outbox.put(("batch", key, num_seqs, num_tokens, num_padding_tokens))

        return report

    def close(self, timeout_s: float = 5.0) -> None:
        """Send the last stats and events, then stop the sender."""
        self._closed.set()
        self._stats.join(timeout_s)
        self._outbox.put(None)
        self._sender.join(timeout_s)

    def _handle(self, message: Message) -> None:
        kind = message[0]
        if kind == "submit":
            self._submit(message[1], message[2])
        elif kind == "cancel":
            request = self._requests.pop(message[1], None)
            if request is not None:
                request.cancel(message[2])
        elif kind == "settings":
            self.local_slice.update_settings(self._local[message[1]], message[2])
        elif kind == "rebuild":
            threading.Thread(target=self._rebuild_bucket, args=(message[1],), name="slice-host-rebuild", daemon=True).start()

    def _rebuild_bucket(self, key: BucketKey) -> None:
        """Build a new batcher for the gateway's bucket ``key``, send new requests to it, retire
        the old one, and answer ``("rebuilt", ...)``."""
        try:
            if self._rebuild is None or key not in self._local:
                raise KeyError(f"no bucket {key} to rebuild in this worker")
            new_key, info, retire_old = self._rebuild(self._local[key])
            self.local_slice.add_batch_observer(new_key, self._batch_reporter(key))
            with self._local_lock:
                self._local[key] = new_key
            retire_old()
        except Exception as exc:  # the bucket keeps its batcher; the gateway is told why
            log.exception("slice_host_rebuild_failed", bucket=list(key))
            self._outbox.put(("rebuilt", key, None, f"{type(exc).__name__}: {exc}"))
            return
        self._outbox.put(("rebuilt", key, dict(info), None))

    def _submit(self, key: BucketKey, wire: dict[str, Any]) -> None:
        request_no = wire["request_no"]
        request = decode_request(wire, lambda event: self._emit(request_no, request, event))
        request.on_dequeue = lambda: self._outbox.put(("dequeued", request_no, dict(request.timeline)))
        if key not in self._local:
            request.emit(ErrorEvent(BatchFailedError(f"no bucket {key} in this worker")))
            return
        self._requests[request_no] = request
        with self._local_lock:  # a rebuild switches the key between two submits, never during one
            self.local_slice.submit(self._local[key], request)

    def _emit(self, request_no: int, request: Request, event: RequestEvent) -> None:
        """The sink of a worker-side request (the slice's worker thread): queue the event with the
        request's timeline; a final event also carries its batches."""
        batches = None
        if is_final(event):
            request.timeline.setdefault("finished", self.clock())
            self._requests.pop(request_no, None)
            batches = list(request.batches)
        self._outbox.put(("event", request_no, encode_event(event), dict(request.timeline), batches))

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.conn.send(message)
            except (OSError, ValueError):
                return  # the gateway is gone

    def _push_stats(self) -> None:
        last: dict[BucketKey, dict[str, Any]] = {}
        last_sent = 0.0
        while True:
            closing = self._closed.wait(self.stats_interval_s)
            with self._local_lock:
                local = dict(self._local)
            snapshot = {key: encode_stats(self.local_slice.stats(local[key])) for key in self.keys}
            now = self.clock()
            if closing or snapshot != last or now - last_sent >= STATS_REFRESH_S:
                self._outbox.put(("stats", snapshot, self.local_slice.busy_s, self.local_slice.busy_ratio()))
                last, last_sent = snapshot, now
            if closing:
                return
