"""Backend gates run beside serving: one thread for the whole gateway, one gate at a time, in
the order the buckets were built.

An ``auto`` bucket without a current gate record is built on eager with its gate ``pending``
(:func:`gateway.runners.backend_label`), and the gateway is ready without waiting for it. The
gate thread then runs its gate in a child process (:mod:`gateway.gate_process`: the candidate
builds, which cannot pause, hold neither the gateway's GIL nor its priority), answering the
child's idle guard with :class:`SliceIdleGuard`: it measures only while the bucket's slice
serves nothing (it pauses when work arrives, resumes after, and a sample during which work
arrived is measured again). The child saves the record; when the record enables a backend other
than what the bucket runs, the gateway switches the bucket to it between batches through the
path of a live reconfiguration: a new bucket built with the now current record (from the files
the child cached), swapped into the model's table in one reference assignment, the old one
closed and retired (drained, nothing dropped), under the lock the admin API and the SLO tuner
take. One ``backend_switched`` event says so, with ``switch_build_s``, what the build in the
gateway cost. A child that fails, crashes or is killed leaves its bucket on eager
(``gate_failed``).

An ``auto`` bucket whose record is current is not gated again, but when the record enables a
backend other than eager the bucket is built on eager too, ``building``
(:func:`gateway.runners.backend_label`), and the gate thread switches it the same way without
measuring: a later start is as quick as the first (a ``compiled`` encoder took 9 s per bucket to
compile and warm before ready, Inductor's cache notwithstanding).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from buckets.bucket import Bucket
from buckets.slices.process import ProcessSlice
from gateway import gate, gate_process
from gateway.engine import Engine
from gateway.errors import ConfigError
from gateway.gate_process import GATE_NICE, GateTask, in_low_priority_thread, lower_thread_priority
from gateway.runners import GateState
from models.backends.measure import GateCancelledError

log = structlog.get_logger(__name__)

IDLE_POLL_S = 0.05
STOP_JOIN_S = 5.0
DISCARD_LOG_INTERVAL_S = 10.0
# A bucket in one of these waits for the gate thread: its gate to run, or its record's backend to be built.
WAITING_STATES = frozenset({GateState.PENDING.value, GateState.BUILDING.value})


class SliceIdleGuard:
    """The :class:`~models.backends.measure.IdleGuard` of a gate beside serving: idle while
    ``is_idle()`` (no request waiting, running or holding an admission ticket in any bucket of
    the slice); disturbed when ``activity()`` (the slice's forwards so far) moved since the wait
    returned, or work is there now. Logs ``gate_paused`` once per pause, ``gate_resumed`` with
    its ``paused_s``, and ``gate_samples_discarded`` (the count so far) at most every
    ``DISCARD_LOG_INTERVAL_S``: under steady traffic whose gaps are shorter than one round the
    gate waits (its bucket stays on eager), and this says why it takes long.

    Args:
        is_idle: whether the slice serves nothing now (thread-safe).
        activity: a count that grows with every forward on the slice.
        stopping: set when the gateway stops: a wait raises :class:`GateCancelledError`.
        fields: the model and bucket, for the log events.
        poll_s: seconds between looks at a busy slice.
    """

    def __init__(
        self, is_idle: Callable[[], bool], activity: Callable[[], int], stopping: threading.Event,
        fields: dict[str, str], poll_s: float = IDLE_POLL_S,
    ):
        self._is_idle = is_idle
        self._activity = activity
        self._stopping = stopping
        self._fields = fields
        self._poll_s = poll_s
        self._mark = activity()
        self.num_pauses = 0
        self.num_discarded = 0
        self._discards_logged_at: float | None = None

    def is_idle(self) -> bool:
        """Whether the slice serves nothing now (the gate's child may run)."""
        return self._is_idle()

    def wait_until_idle(self) -> None:
        """Block until the slice is idle.

        Raises:
            GateCancelledError: ``stopping`` was set.
        """
        paused_at: float | None = None
        while True:
            if self._stopping.is_set():
                raise GateCancelledError("the gateway is stopping")
            if self._is_idle():
                break
            if paused_at is None:
                paused_at = time.monotonic()
                self.num_pauses += 1
                log.info("gate_paused", **self._fields, reason="requests on the slice")
            self._stopping.wait(self._poll_s)
        if paused_at is not None:
            log.info("gate_resumed", **self._fields, paused_s=round(time.monotonic() - paused_at, 3))
        self._mark = self._activity()

    def disturbed(self) -> bool:
        """Whether work ran or arrived since :meth:`wait_until_idle` returned."""
        if self._activity() == self._mark and self._is_idle():
            return False
        self.num_discarded += 1
        now = time.monotonic()
        if self._discards_logged_at is None or now - self._discards_logged_at >= DISCARD_LOG_INTERVAL_S:
            self._discards_logged_at = now
            log.info("gate_samples_discarded", **self._fields, num_discarded=self.num_discarded)
        return True


@dataclass
class GateJob:
    """One bucket to gate: the model's name and the bucket as built."""

    model: str
    bucket: Bucket


class BackgroundGates:
    """The gateway's gate thread. :meth:`on_bucket` (an engine bucket hook) queues each bucket
    whose gate is ``pending``; :meth:`start` starts the thread (after the gateway is ready) with
    the event loop and the config lock a switch takes; :meth:`stop` ends it (a gate waiting for
    an idle slice stops at once; its child process is ended, within ``STOP_JOIN_S``)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._queue: queue.Queue[GateJob | None] = queue.Queue()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None

    def on_bucket(self, model: str, bucket: Bucket) -> None:
        """Queue ``bucket``'s gate when it is pending, or the build of its record's backend; an
        ``auto`` bucket of a process slice is queued as it is built (its worker says where its
        gate stands when ready, before the gate thread starts) and looked at again when its turn
        comes."""
        info = bucket.backend_info
        remote = isinstance(bucket.device_slice, ProcessSlice)
        if info.get("gate_state") not in WAITING_STATES and not (remote and info.get("configured") == "auto"):
            return
        if not remote:
            self._log_waiting(model, bucket)
        self._queue.put(GateJob(model, bucket))

    def start(self, loop: asyncio.AbstractEventLoop, lock: asyncio.Lock) -> None:
        self._loop, self._lock = loop, lock
        self._thread = threading.Thread(target=self._run, name="background-gates", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(STOP_JOIN_S)

    def _run(self) -> None:
        log.info("gate_thread_started", nice=lower_thread_priority())
        while not self._stopping.is_set():
            job = self._queue.get()
            if job is None:
                return
            try:
                self._gate(job)
            except GateCancelledError:
                return
            except Exception as exc:  # a gate that fails leaves its bucket on eager, said so
                log.exception("gate_failed", model=job.model, bucket=job.bucket.name, error=repr(exc), running="eager")
                job.bucket.backend_info["gate_state"] = GateState.FAILED.value

    def _log_waiting(self, model: str, bucket: Bucket) -> None:
        info = bucket.backend_info
        if info.get("gate_state") == GateState.BUILDING.value:
            log.info("backend_build_pending", model=model, bucket=bucket.name, running=info.get("running"),
                     to=(info.get("gate") or {}).get("chosen"))
        else:
            log.info("gate_pending", model=model, bucket=bucket.name, running=info.get("running"))

    def _gate(self, job: GateJob) -> None:
        """Measure and record ``job``'s gate, or with a current record (``building``) go straight
        to the switch; switch its bucket when the record enables a backend other than the one it
        runs, else show the record on the bucket."""
        if not self._current(job):
            self._drop(job, "its bucket was replaced before the gate ran")
            return
        info = job.bucket.backend_info
        if info.get("gate_state") not in WAITING_STATES:
            return  # a process slice's worker found a current record and built its backend
        if isinstance(job.bucket.device_slice, ProcessSlice):
            self._log_waiting(job.model, job.bucket)
        if info.get("gate_state") == GateState.PENDING.value:
            info["gate_state"] = GateState.RUNNING.value
            record = gate_process.measure_in_child(self._task(job), self._guard(job), self._stopping)
            if gate.chosen_backend(record, self.engine.config.gate) == info.get("running"):
                info.update(gate=gate.summary(record, self.engine.config.gate), gate_state=GateState.DONE.value)
                return
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(self._switch(job), self._loop)
        while not self._stopping.is_set():
            try:
                future.result(timeout=IDLE_POLL_S * 10)
                return
            except concurrent.futures.TimeoutError:
                continue
        future.cancel()

    def _task(self, job: GateJob) -> GateTask:
        """What the gate's child process needs to gate ``job``'s bucket on its slice's device."""
        served = self.engine.models[job.model]
        device_slice = job.bucket.device_slice
        return GateTask(
            model=served.config.model_dump(mode="json"), bucket_name=job.bucket.name,
            gate=self.engine.config.gate.model_dump(mode="json"), cache_dir=str(self.engine.cache_dir),
            device=device_slice.device, num_threads=device_slice.num_threads,
            log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
            reason="no current gate record (background)",
        )

    def _guard(self, job: GateJob) -> SliceIdleGuard:
        device_slice = job.bucket.device_slice

        def on_slice() -> list[Bucket]:
            tables = [b for served in list(self.engine.models.values()) for b in served.table.buckets]
            return [b for b in tables + list(self.engine.retiring) if b.device_slice is device_slice]

        def is_idle() -> bool:
            in_flight = device_slice.num_in_flight if isinstance(device_slice, ProcessSlice) else 0
            return in_flight == 0 and all(b.is_idle() for b in on_slice())

        def activity() -> int:
            submitted = device_slice.num_submitted if isinstance(device_slice, ProcessSlice) else 0
            return submitted + sum(b.stats().num_steps for b in on_slice())

        return SliceIdleGuard(is_idle, activity, self._stopping, {"model": job.model, "bucket": job.bucket.name})

    def _current(self, job: GateJob) -> bool:
        """Whether ``job``'s bucket is still its model's bucket of that name (no layout change,
        no unload meanwhile)."""
        served = self.engine.models.get(job.model)
        return served is not None and not served.draining and served.table.by_name(job.bucket.name) is job.bucket

    def _drop(self, job: GateJob, reason: str) -> None:
        log.info("gate_result_dropped", model=job.model, bucket=job.bucket.name, reason=reason)
        job.bucket.backend_info["gate_state"] = GateState.DROPPED.value

    def _rebuild(self, job: GateJob) -> dict[str, Any]:
        """Rebuild ``job``'s bucket with the record now current and return its backend info (what
        it runs, its gate): a process slice's worker rebuilds it under the same key; else a new
        bucket is swapped into the table and the old one retired (drained). Blocking.

        Raises:
            ConfigError, KeyError: from :meth:`Engine.rebuild_bucket`.
            RuntimeError, TimeoutError: from :meth:`ProcessSlice.rebuild`.
        """
        device_slice = job.bucket.device_slice
        if isinstance(device_slice, ProcessSlice):
            return device_slice.rebuild(job.bucket.key)
        old, new = self.engine.rebuild_bucket(job.model, job.bucket.name)
        self.engine.retire([old], self.engine.config.drain_timeout_s)
        return new.backend_info

    async def _switch(self, job: GateJob) -> None:
        """Under the config lock: rebuild ``job``'s bucket with the record now current, swap it
        in, retire the old one; log ``backend_switched`` when the backend changed."""
        assert self._lock is not None
        async with self._lock:
            if not self._current(job):
                self._drop(job, "its bucket was replaced while the gate ran")
                return
            before = job.bucket.backend_info.get("running")
            started = time.perf_counter()
            try:
                info = await in_low_priority_thread("backend-build", GATE_NICE, self._rebuild, job)
            except (ConfigError, KeyError, RuntimeError, TimeoutError) as exc:
                log.warning("gate_switch_failed", model=job.model, bucket=job.bucket.name, error=str(exc), running=before)
                job.bucket.backend_info["gate_state"] = GateState.FAILED.value
                return
        build_s = round(time.perf_counter() - started, 3)
        after = info.get("running")
        if after != before:
            speedups = {row["backend"]: row["speedup"] for row in (info.get("gate") or {}).get("candidates", [])}
            log.info(
                "backend_switched", model=job.model, bucket=job.bucket.name, to=after,
                speedup=speedups.get(str(after)), switch_build_s=build_s, **{"from": before},
            )


def gate_states(engine: Engine) -> list[dict[str, str]]:
    """Every ``auto`` bucket's gate: ``{"model", "bucket", "state"}`` (a :class:`GateState` value)."""
    return [
        {"model": name, "bucket": bucket.name, "state": str(bucket.backend_info.get("gate_state"))}
        for name, served in sorted(engine.models.items())
        for bucket in served.table.buckets
        if bucket.backend_info.get("configured") == "auto"
    ]
