"""A slice whose buckets run in a worker process that the gateway starts and supervises.

The worker process loads the slice's models, builds their real batchers on a
:class:`~buckets.slices.thread.ThreadSlice` of its own and serves them through a
:class:`~buckets.slices.host.SliceHost`. This side needs no batcher: it owns what the gateway
knows of each remote bucket (its settings, latest stats, batch observers and backend info),
and a bucket is the handle ``(slice, key)``. Both sides talk over one ``multiprocessing`` pipe
(messages: :mod:`buckets.slices.messages`); the process is started with ``spawn`` (forking a
process that runs torch threads is unsafe).

This object owns the requests in flight on its worker. A reader thread routes the worker's
events to their requests' sinks; a sender thread writes to the pipe, so :meth:`submit` never
blocks; a cancellation (hang-up, deadline) reaches :meth:`cancel` through the request's
``on_cancel`` callback and is forwarded so the worker frees its KV blocks. When the worker dies
(end of file on the pipe) every request in flight fails with
:class:`~buckets.errors.WorkerCrashedError`, new ones get
:class:`~buckets.errors.SliceUnavailableError`, and a new worker is started (with backoff when
it keeps dying) until :meth:`stop`.
"""

from __future__ import annotations

import itertools
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

import structlog

from buckets.errors import ShuttingDownError, SliceUnavailableError, WorkerCrashedError
from buckets.request import ErrorEvent, Request
from buckets.slices.messages import Message, decode_event, decode_stats, encode_request, is_final
from buckets.slices.remote import InFlight, PendingRebuilds, RemoteBucket
from buckets.slices.slice import BatcherSettings, BucketKey, BucketSpec, SliceState, check_fixed_settings
from buckets.slices.worker import WorkerProcess, spawn
from buckets.stats import BatchObserver, BucketStats, Counters

log = structlog.get_logger(__name__)

START_TIMEOUT_S = 900.0
RESTART_BACKOFF_S = 0.2  # doubled after each worker that dies before it is ready, up to the max
MAX_RESTART_BACKOFF_S = 30.0
RETRY_AFTER_S = 5  # what a client is told while the worker restarts
REBUILD_TIMEOUT_S = 900.0


class ProcessSlice:
    """Implements :class:`~buckets.slices.slice.Slice` for ``isolation: process``: the
    gateway's side of a worker process that runs the slice's buckets.

    Args:
        name, device, num_threads: as the slice's config (the worker applies ``num_threads``).
        target: the worker's entry point, ``target(conn, *worker_args())``; a module-level
            function (it is pickled by name). The gateway passes it in: this module never
            imports the worker's code.
        worker_args: called in the gateway before each start; returns plain, picklable
            arguments (the current config, so a restart serves the current knobs).
        start_timeout_s: how long :meth:`start` waits for the first worker to be ready.
    """

    isolation = "process"
    needs_weights = False  # the worker loads the weights; the gateway tokenizes only

    def __init__(
        self, name: str, device: str, num_threads: int, target: Callable[..., None],
        worker_args: Callable[[], tuple[Any, ...]], start_timeout_s: float = START_TIMEOUT_S,
    ):
        self.name = name
        self.device = device
        self.num_threads = num_threads
        self.start_timeout_s = start_timeout_s
        self.state = SliceState.STOPPED
        self.num_restarts = 0
        self._target = target
        self._worker_args = worker_args
        self._buckets: dict[BucketKey, RemoteBucket] = {}
        self._in_flight: dict[int, InFlight] = {}
        self._request_nos: dict[int, int] = {}  # id(request) -> its number, while in flight
        self._lock = threading.Lock()
        self._worker: WorkerProcess | None = None
        self._stopping = threading.Event()
        self._next_request_no = itertools.count()
        self._num_failed_starts = 0
        self._busy_s_before = 0.0  # seconds stepped by workers gone
        self._busy_s = 0.0
        self._busy_ratio = 0.0
        self._rebuilds = PendingRebuilds()
        self.num_submitted = 0  # requests sent to workers so far (a gate's idle guard watches it)

    # -- the engine's side -------------------------------------------------------------------

    def attach(self, key: BucketKey, spec: BucketSpec) -> None:
        """Know bucket ``key`` (the worker builds its batcher; ``spec.make_batcher`` is not called)."""
        stats = Counters().snapshot(spec.kind, num_waiting=0, num_running=0)
        self._buckets[key] = RemoteBucket(spec.kind, spec.settings, spec.backend_info, stats, [])

    def detach(self, key: BucketKey) -> None:
        """Fail bucket ``key``'s requests in flight with :class:`ShuttingDownError` (the worker
        drops them) and forget it.

        Raises:
            KeyError: ``key`` is not attached here.
        """
        del self._buckets[key]
        error = ShuttingDownError("the bucket stopped before the request finished")
        for request_no in self._fail(lambda entry: entry.key == key, error):
            self._send(("cancel", request_no, "cancelled"))

    def start(self) -> None:
        """Start the worker process and wait until it is ready (slow: it loads its models).

        Raises:
            RuntimeError: the worker exited or was not ready within ``start_timeout_s``.
        """
        self._stopping.clear()
        if not self._buckets:
            return  # no bucket placed here: nothing to run
        self.state = SliceState.STARTING
        worker = self._launch()
        assert worker is not None  # nothing stops a slice that is not started yet
        if not worker.await_ready(self.start_timeout_s, self._stopping, self.name):
            self.stop()
            self.state = SliceState.FAILED
            raise RuntimeError(f"slice {self.name!r}: the worker process did not start (exit code {worker.process.exitcode})")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the worker after its current step (it fails what it holds); fail what is left."""
        with self._lock:
            self._stopping.set()
            worker = self._worker
        if worker is not None:
            worker.send(("stop",))
            worker.process.join(timeout_s)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout_s)
            if worker.reader is not None and worker.reader is not threading.current_thread():
                worker.reader.join(timeout_s)
            log.info("worker_stopped", slice=self.name, pid=worker.pid, exit_code=worker.process.exitcode)
        self._fail(lambda entry: True, ShuttingDownError("the bucket stopped before the request finished"))
        self.state = SliceState.STOPPED

    @property
    def busy_s(self) -> float:
        """Seconds the workers of this slice have spent in steps (as last reported)."""
        return self._busy_s_before + self._busy_s

    def busy_ratio(self, now: float | None = None) -> float:
        """The worker's share of the last seconds spent in steps (as last reported)."""
        return self._busy_ratio

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name, "device": self.device, "num_threads": self.num_threads, "isolation": self.isolation,
            "state": self.state.value, "worker_pid": self.worker_pid, "num_restarts": self.num_restarts,
            "busy_ratio": self._busy_ratio,
        }

    @property
    def worker_pid(self) -> int | None:
        worker = self._worker
        return worker.pid if worker is not None and self.state is SliceState.READY else None

    # -- the buckets' side -------------------------------------------------------------------

    def submit(self, key: BucketKey, request: Request) -> None:
        """Send ``request`` to the worker for bucket ``key`` (thread-safe, never blocks); its
        ``on_cancel`` forwards a later cancellation.

        Raises:
            SliceUnavailableError: the worker is not ready (starting, restarting, stopped).
        """
        request_no = next(self._next_request_no)
        wire = encode_request(request_no, request)
        with self._lock:
            worker = self._worker
            if self.state is not SliceState.READY or worker is None:
                raise SliceUnavailableError(f"the worker process of slice {self.name!r} is {self.state.value}", RETRY_AFTER_S)
            self._in_flight[request_no] = InFlight(key, request)
            self.num_submitted += 1
            self._request_nos[id(request)] = request_no
            worker.send(("submit", key, wire))
        request.on_cancel = self.cancel
        if request.is_cancelled:  # cancelled before on_cancel was set: forward it now
            self.cancel(request)

    def cancel(self, request: Request) -> None:
        """Tell the worker to drop ``request`` (it frees its blocks); the request leaves its
        queue here. Called by ``request.cancel()`` on the cancelling thread; does nothing for a
        request no longer in flight."""
        with self._lock:
            request_no = self._request_nos.get(id(request))
            if request_no is not None:
                self._take(request_no)
        if request_no is None:
            return
        self._send(("cancel", request_no, request.cancel_reason or "cancelled"))
        request.leave_queue()

    def stats(self, key: BucketKey) -> BucketStats:
        """Bucket ``key``'s latest snapshot from the worker (at most ``STATS_INTERVAL_S`` of
        :mod:`buckets.slices.host` old while anything changes)."""
        return self._buckets[key].stats

    def update_settings(self, key: BucketKey, settings: BatcherSettings) -> None:
        """Send new settings of bucket ``key`` to the worker, which applies them from its next
        step or batch (a restart reads them from the config).

        Raises:
            ValueError: a continuous bucket's ``block_size`` or ``enable_prefix_caching`` differ.
        """
        bucket = self._buckets[key]
        check_fixed_settings(bucket.settings, settings)
        bucket.settings = settings
        self._send(("settings", key, settings))

    def add_batch_observer(self, key: BucketKey, observer: BatchObserver) -> None:
        """Call ``observer`` for every forward the worker reports for bucket ``key`` (on the
        slice's reader thread)."""
        self._buckets[key].observers.append(observer)

    def backend_info(self, key: BucketKey) -> dict[str, Any]:
        """Bucket ``key``'s backend description, as the worker reported it when ready or rebuilt."""
        return self._buckets[key].backend_info

    @property
    def num_in_flight(self) -> int:
        """Requests sent to the worker whose last event has not come back."""
        return len(self._in_flight)

    def rebuild(self, key: BucketKey, timeout_s: float = REBUILD_TIMEOUT_S) -> dict[str, Any]:
        """Have the worker rebuild bucket ``key``'s batcher under the same key (its backend chosen
        again: a gate record written since counts), between batches: requests on the old batcher
        finish there, new ones go to the new one, none is dropped. Blocking (the worker builds and
        warms a backend). Returns the bucket's new backend info (also :meth:`backend_info` now).

        Raises:
            SliceUnavailableError: the worker is not ready.
            RuntimeError: the worker could not rebuild it (the message says why) or exited.
            TimeoutError: no answer within ``timeout_s``.
        """
        if self.state is not SliceState.READY:
            raise SliceUnavailableError(f"the worker process of slice {self.name!r} is {self.state.value}", RETRY_AFTER_S)
        future = self._rebuilds.start(key)
        self._send(("rebuild", key))
        info = future.result(timeout_s)
        self._buckets[key].backend_info.update(info)
        return info

    # -- the worker's life -------------------------------------------------------------------

    def _spawn(self) -> tuple[Any, Connection]:
        """Start a worker process; return it and the gateway's end of its pipe."""
        return spawn(self._target, self._worker_args(), f"sluice-slice-{self.name}")

    def _launch(self) -> WorkerProcess | None:
        """Start a worker and the threads that talk to it; ``None`` when :meth:`stop` came first
        (the new process is killed)."""
        process, conn = self._spawn()
        worker = WorkerProcess(process, conn, f"slice-{self.name}")
        with self._lock:
            stopped = self._stopping.is_set()
            if not stopped:
                self._worker = worker
        if stopped:
            process.kill()
            worker.close_outbox()
            conn.close()
            return None
        worker.reader = threading.Thread(target=self._read, args=(worker,), name=f"slice-{self.name}-reader", daemon=True)
        worker.reader.start()
        log.info("worker_started", slice=self.name, pid=worker.pid)
        return worker

    def _restart(self) -> None:
        delay_s = min(MAX_RESTART_BACKOFF_S, RESTART_BACKOFF_S * 2**self._num_failed_starts)
        self._num_failed_starts += 1
        if self._stopping.wait(delay_s):
            return
        worker = self._launch()
        if worker is not None:
            worker.await_ready(self.start_timeout_s, self._stopping, self.name)

    def _on_exit(self, worker: WorkerProcess) -> None:
        """The worker's pipe closed: fail its requests and, unless stopping, start a new one."""
        worker.process.join(5.0)
        with self._lock:
            if worker is not self._worker:
                return
            was = self.state
            restart = not self._stopping.is_set() and was in (SliceState.READY, SliceState.RESTARTING)
            self.state = SliceState.RESTARTING if restart else SliceState.STOPPED
            self._busy_s_before += self._busy_s
            self._busy_s, self._busy_ratio = 0.0, 0.0
        worker.close_outbox()
        self._rebuilds.fail_all(f"the worker process of slice {self.name!r} exited (code {worker.process.exitcode})")
        if self._stopping.is_set():
            return
        error = WorkerCrashedError(
            f"the worker process of slice {self.name!r} exited (code {worker.process.exitcode}) during the request"
        )
        failed = self._fail(lambda entry: True, error)
        log.error(
            "worker_crashed", slice=self.name, pid=worker.pid, exit_code=worker.process.exitcode, state=was.value,
            num_failed=len(failed),
        )
        if restart:
            threading.Thread(target=self._restart, name=f"slice-{self.name}-restart", daemon=True).start()

    def _fail(self, which: Callable[[InFlight], bool], error: Exception) -> list[int]:
        """Take the requests in flight that ``which`` picks and emit ``error`` to each."""
        with self._lock:
            picked = [no for no, entry in self._in_flight.items() if which(entry)]
            entries = [self._take(no) for no in picked]
        for entry in entries:
            entry.request.emit(ErrorEvent(error))
        return picked

    def _take(self, request_no: int) -> InFlight:
        """Remove request ``request_no`` from those in flight (call with the lock held)."""
        entry = self._in_flight.pop(request_no)
        self._request_nos.pop(id(entry.request), None)
        return entry

    def _send(self, message: Message) -> None:
        worker = self._worker
        if worker is not None:
            worker.send(message)

    def _read(self, worker: WorkerProcess) -> None:
        while True:
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._dispatch(worker, message)
            except Exception:  # a bad message must not stop the routing of the others
                log.exception("worker_message_error", slice=self.name, kind=message[0])
        self._on_exit(worker)

    # -- messages from the worker ----------------------------------------------------------

    def _dispatch(self, worker: WorkerProcess, message: Message) -> None:
        kind = message[0]
        if kind == "event":
            self._on_event(*message[1:])
        elif kind == "dequeued":
            entry = self._in_flight.get(message[1])
            if entry is not None:
                entry.request.timeline.update(message[2])
                entry.request.leave_queue()
        elif kind == "batch":
            bucket = self._buckets.get(message[1])
            for observer in bucket.observers if bucket is not None else []:
                observer(*message[2:])
        elif kind == "stats":
            for key, fields in message[1].items():
                if (bucket := self._buckets.get(key)) is not None:
                    bucket.stats = decode_stats(fields)
            self._busy_s, self._busy_ratio = message[2], message[3]
        elif kind == "ready":
            self._on_ready(worker, message[1], message[2])
        elif kind == "rebuilt":
            self._rebuilds.finish(*message[1:])

    def _on_event(self, request_no: int, wire: Message, timeline: dict[str, float], batches: list[Any] | None) -> None:
        event = decode_event(wire)
        with self._lock:
            entry = self._in_flight.get(request_no)
            if entry is not None and is_final(event):
                self._take(request_no)
        if entry is None:
            return  # cancelled here already
        request = entry.request
        request.timeline.update(timeline)
        if batches is not None:
            request.batches[:] = [tuple(b) for b in batches]
        request.emit(event)

    def _on_ready(self, worker: WorkerProcess, pid: int, backend_info: dict[BucketKey, dict[str, Any]]) -> None:
        for key, info in backend_info.items():
            if (bucket := self._buckets.get(key)) is not None:
                bucket.backend_info.update(info)
        with self._lock:
            if worker is not self._worker:
                return
            restarted = self.state is SliceState.RESTARTING
            self.state = SliceState.READY
            worker.pid = pid
            self._num_failed_starts = 0
            self.num_restarts += restarted
        worker.ready.set()
        if restarted:
            log.info("worker_restarted", slice=self.name, pid=pid, num_restarts=self.num_restarts)
