"""A thread slice: one device, one worker thread in this process, and the buckets that take
turns on it.

The worker is the single owner of its buckets' queues, schedulers and runners, so the core
needs no locks beyond this condition variable, which only wakes the worker. Among the buckets
with work ready, the slice's :class:`policies.priority.SliceArbiter` picks the one whose most
urgent request has the best effective priority, and never lets one bucket run more than
``max_consecutive_steps`` steps in a row while another waits; a dynamic batcher that is waiting
out ``max_queue_delay`` sets how long the worker sleeps.

On a ``cuda:N`` device the worker makes that device its thread's current one and runs every step
on a CUDA stream of its own (:func:`device_stream`), so two slices on one GPU run their steps in
parallel instead of queueing behind each other on the default stream.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
import time
from typing import Any, Callable

import structlog

from buckets.batcher import Batcher
from buckets.continuous import ContinuousBatcher
from buckets.request import Request
from buckets.slices.slice import BatcherSettings, BucketKey, BucketSpec, SliceState
from buckets.stats import BatchObserver, BucketStats
from policies.priority import SliceArbiter

log = structlog.get_logger(__name__)

IDLE_WAIT_S = 1.0
BUSY_WINDOW_S = 10.0
DEFAULT_MAX_CONSECUTIVE_STEPS = 4


class ThreadSlice:
    """Implements :class:`~buckets.slices.slice.Slice` with a dedicated worker thread that runs
    its batchers' steps; :meth:`attach` builds each bucket's batcher here.

    Args:
        name: the slice's name in the config.
        device: ``cpu`` or ``cuda:N``.
        num_threads: torch intra-op threads on CPU (process-wide in torch: the last slice to
            start sets it).
        max_consecutive_steps: the most steps one bucket runs in a row while another has work.
        clock: seconds, monotonic.
    """

    isolation = "thread"
    needs_weights = True

    def __init__(
        self,
        name: str,
        device: str,
        num_threads: int,
        max_consecutive_steps: int = DEFAULT_MAX_CONSECUTIVE_STEPS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.name = name
        self.device = device
        self.num_threads = num_threads
        self.clock = clock
        self._batchers: dict[BucketKey, Batcher] = {}
        self._backend_info: dict[BucketKey, dict[str, Any]] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._arbiter = SliceArbiter(max_consecutive_steps)
        self._thread: threading.Thread | None = None
        self._stepping: Batcher | None = None
        self.busy_s = 0.0  # seconds spent in steps since start (worker-written)
        self.stream: Any = None  # the worker's torch.cuda.Stream on a cuda device, from its start; None on a CPU
        self._recent_steps: collections.deque[tuple[float, float]] = collections.deque()  # (end, seconds)

    @property
    def state(self) -> SliceState:
        return SliceState.READY if self._thread is not None and self._thread.is_alive() else SliceState.STOPPED

    def describe(self) -> dict[str, Any]:
        """The slice for the admin API: name, device, threads, isolation, state, busy ratio."""
        return {
            "name": self.name, "device": self.device, "num_threads": self.num_threads,
            "isolation": self.isolation, "state": self.state.value, "busy_ratio": self.busy_ratio(),
        }

    def attach(self, key: BucketKey, spec: BucketSpec) -> None:
        """Build bucket ``key``'s batcher (``spec.make_batcher``: slow) and step it from now on."""
        batcher = spec.make_batcher()
        if self.device.startswith("cuda"):  # what the build queued on this thread's stream ends before the worker's reads it
            import torch

            # That stream only: a device-wide sync could meet another build's graph capture.
            torch.cuda.current_stream(self.device).synchronize()
        if isinstance(batcher, ContinuousBatcher):  # by key: a detached batcher then holds no cycle through the slice
            batcher.watch_neighbours(functools.partial(self._num_running_beside, key))
        with self._wake:
            self._batchers[key] = batcher
            self._backend_info[key] = spec.backend_info
            self._wake.notify_all()

    def detach(self, key: BucketKey) -> None:
        """Take bucket ``key`` off this slice, waiting out a step of it already under way (the
        worker never steps it again), and fail what it still holds. Thread-safe; call it off
        the worker thread.

        Raises:
            KeyError: ``key`` is not attached here.
        """
        with self._wake:
            batcher = self._batchers.pop(key)
            self._backend_info.pop(key, None)
            while self._stepping is batcher:
                self._wake.wait()
        batcher.shutdown()

    def _num_running_beside(self, key: BucketKey) -> int:
        """The sequences the slice's other continuous batchers run: they wait out each step of
        bucket ``key``'s (the worker steps one bucket at a time). Worker thread."""
        return sum(b.num_running for k, b in list(self._batchers.items()) if k != key and isinstance(b, ContinuousBatcher))

    def submit(self, key: BucketKey, request: Request) -> None:
        """Queue ``request`` on bucket ``key``'s batcher and wake the worker (thread-safe); a
        later ``request.cancel()`` wakes it too (:meth:`cancel`)."""
        request.on_cancel = self.cancel
        self._batchers[key].submit(request)
        self.notify()

    def cancel(self, request: Request) -> None:
        """Wake the worker: its batcher drops ``request`` at its next step and frees its blocks."""
        self.notify()

    def stats(self, key: BucketKey) -> BucketStats:
        return self._batchers[key].stats()

    def update_settings(self, key: BucketKey, settings: BatcherSettings) -> None:
        """Bucket ``key``'s batcher uses ``settings`` from its next step (raises as it does)."""
        self._batchers[key].update_settings(settings)
        self.notify()

    def add_batch_observer(self, key: BucketKey, observer: BatchObserver) -> None:
        self._batchers[key].add_batch_observer(observer)

    def backend_info(self, key: BucketKey) -> dict[str, Any]:
        return self._backend_info[key]

    def notify(self) -> None:
        """Wake the worker: new work arrived (thread-safe)."""
        with self._wake:
            self._wake.notify_all()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"slice-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the worker after its current step; fail what is still queued."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        for batcher in list(self._batchers.values()):
            batcher.shutdown()

    def _run(self) -> None:
        import torch

        if self.device == "cpu":
            torch.set_num_threads(self.num_threads)
        self.stream = device_stream(self.device)
        with torch.cuda.stream(self.stream):  # a no-op for None
            self._serve()

    def _serve(self) -> None:
        """Step the ready batchers until :meth:`stop`."""
        while True:
            batcher = self._wait_for_ready()
            if batcher is None:
                return
            started = self.clock()
            try:
                batcher.step()
            except Exception:  # the worker never dies silently; the batcher already failed its requests
                log.exception("slice_step_error", slice=self.name, batcher=batcher.kind)
            finally:
                self._record_busy(started, self.clock())
                with self._wake:
                    self._stepping = None
                    self._wake.notify_all()

    def _record_busy(self, started: float, ended: float) -> None:
        self.busy_s += ended - started
        self._recent_steps.append((ended, ended - started))
        while self._recent_steps and self._recent_steps[0][0] < ended - BUSY_WINDOW_S:
            self._recent_steps.popleft()

    def busy_ratio(self, now: float | None = None) -> float:
        """The share of the last ``BUSY_WINDOW_S`` seconds the worker spent in steps (0 to 1;
        a step is counted whole when it ended inside the window). Thread-safe enough for metrics."""
        now = self.clock() if now is None else now
        recent = list(self._recent_steps)
        busy = sum(seconds for ended, seconds in recent if ended >= now - BUSY_WINDOW_S)
        return min(1.0, busy / BUSY_WINDOW_S)

    @staticmethod
    def _head(batcher: Batcher, now: float) -> float:
        """A ready batcher's best effective priority; housekeeping only (no request) ranks last."""
        head = batcher.head_priority(now)
        return math.inf if head is None else head

    def _wait_for_ready(self) -> Batcher | None:
        """Block until some batcher is ready; return the one the arbiter picks, or ``None`` on stop."""
        with self._wake:
            while not self._stopping:
                now = self.clock()
                batchers = list(self._batchers.values())
                waits = [b.seconds_until_ready(now) for b in batchers]
                heads = [self._head(b, now) if w == 0.0 else None for b, w in zip(batchers, waits)]
                index = self._arbiter.pick(heads)
                if index is not None:
                    self._stepping = batchers[index]
                    return self._stepping
                pending = [w for w in waits if w is not None]
                self._wake.wait(min(pending) if pending else IDLE_WAIT_S)
            return None


def device_stream(device: str) -> Any:
    """A new ``torch.cuda.Stream`` on ``device`` (``cuda:N``) for a slice worker's steps, after
    making ``device`` the calling thread's current one; ``None`` for ``cpu``. Call it on the
    worker thread. The batchers are built on other threads: :meth:`ThreadSlice.attach`
    synchronises the building thread's stream after each build, before the worker may step it."""
    if not device.startswith("cuda"):
        return None
    import torch

    torch.cuda.set_device(device)
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
