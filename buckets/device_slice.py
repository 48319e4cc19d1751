"""A device slice: one device, one worker thread, and the buckets that take turns on it.

The worker is the single owner of its buckets' queues, schedulers and runners, so the core
needs no locks beyond this condition variable, which only wakes the worker. Buckets with work
step in round-robin order (the priority arbiter replaces this rule later); a dynamic batcher
that is waiting out ``max_queue_delay`` sets how long the worker sleeps.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import structlog

from buckets.batcher import Batcher

log = structlog.get_logger(__name__)

IDLE_WAIT_S = 1.0


class DeviceSlice:
    """Runs its batchers' steps on a dedicated worker thread.

    Args:
        name: the slice's name in the config.
        device: ``cpu`` or ``cuda:N``.
        num_threads: torch intra-op threads on CPU (process-wide in torch: the last slice to
            start sets it).
        clock: seconds, monotonic.
    """

    def __init__(self, name: str, device: str, num_threads: int, clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.device = device
        self.num_threads = num_threads
        self.clock = clock
        self._batchers: list[Batcher] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._next = 0
        self._thread: threading.Thread | None = None

    def attach(self, batcher: Batcher) -> None:
        with self._wake:
            self._batchers.append(batcher)
            self._wake.notify()

    def notify(self) -> None:
        """Wake the worker: new work arrived (thread-safe)."""
        with self._wake:
            self._wake.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"slice-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the worker after its current step; fail what is still queued."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        for batcher in self._batchers:
            batcher.shutdown()

    def _run(self) -> None:
        if self.device == "cpu":
            import torch

            torch.set_num_threads(self.num_threads)
        while True:
            batcher = self._wait_for_ready()
            if batcher is None:
                return
            try:
                batcher.step()
            except Exception:  # the worker never dies silently; the batcher already failed its requests
                log.exception("slice_step_error", slice=self.name, batcher=batcher.kind)

    def _wait_for_ready(self) -> Batcher | None:
        """Block until some batcher is ready; return it (round-robin), or ``None`` on stop."""
        with self._wake:
            while not self._stopping:
                now = self.clock()
                waits = [b.seconds_until_ready(now) for b in self._batchers]
                count = len(waits)
                for offset in range(count):
                    index = (self._next + offset) % count
                    if waits[index] == 0.0:
                        self._next = index + 1
                        return self._batchers[index]
                pending = [w for w in waits if w is not None]
                self._wake.wait(min(pending) if pending else IDLE_WAIT_S)
            return None
