"""A background gate's builds and measurements in a child process of the gateway.

Candidate builds (an ONNX export, int8 quantization, ``torch.compile``) cannot pause for
requests the way timed rounds do, and in the gateway's process they hold the GIL and the cores
the slices serve on. So the gate thread (:mod:`gateway.background_gates`) starts one child per
gate (``spawn``: forking a process that runs torch threads is unsafe) at the lowest CPU priority
(nice ``GATE_NICE``) with the slice's ``num_threads``. The child loads the model itself from its
source, builds the candidates, measures them and saves the record in the cache dir, where the
ONNX files it exported stay cached for the gateway's own build of the winner (``torch.compile``'s
inductor cache, by default one folder per user under the temp dir, is shared the same way).

Its idle guard (:class:`PipeIdleGuard`) asks the gate thread over a pipe, which answers with the
gateway's :class:`~gateway.background_gates.SliceIdleGuard`, so rounds still pause while the
slice serves. The builds cannot pause that way, and a low priority alone does not keep them off
the slice's cores (two vCPUs may be one core's two hyperthreads, where a sibling at nice 19
still halves the other's speed), so the whole child is paused: the gate thread stops it
(``SIGSTOP``) whenever the slice has work and continues it (``SIGCONT``) when the slice is idle
again (:class:`ChildPauser`); a timed round it interrupts is measured again, like any disturbed
one. Messages, child -> gateway: ``("wait_idle",)``, ``("disturbed",)``,
``("done", record)``, ``("failed", error)``; gateway -> child: ``("idle",)``, ``("cancel",)``,
``("disturbed", bool)``. The child exits when the gateway goes away (end of file on the pipe, or
its parent changed); :func:`measure_in_child` ends it when the gateway stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol, TypeVar

import structlog

from models.backends.measure import GateCancelledError, IdleGuard

log = structlog.get_logger(__name__)

# The lowest CPU priority there is.
T = TypeVar("T")
GATE_NICE = 19
POLL_S = 0.05
END_GRACE_S = 1.0
PARENT_WATCH_S = 1.0


class SliceGuard(IdleGuard, Protocol):
    """The gate thread's guard of a slice: :class:`IdleGuard`, and whether the slice is idle now."""

    def is_idle(self) -> bool:
        """Whether the slice serves nothing now."""


class ChildPauser:
    """Keeps a gate's child process stopped while its slice has work: :meth:`update` stops it
    (``SIGSTOP``) when ``is_idle()`` is false and continues it (``SIGCONT``) when it is true
    again, logging ``gate_child_paused`` once per pause and ``gate_child_resumed`` with its
    ``paused_s``; :meth:`resume` continues it for good (before it is ended or reaped). Signals
    to a process that has exited already are ignored.

    Args:
        pid: the child's process id.
        is_idle: whether the slice serves nothing now (thread-safe).
        fields: log fields (model, bucket).
    """

    def __init__(self, pid: int, is_idle: Any, fields: dict[str, Any]) -> None:
        self._pid = pid
        self._is_idle = is_idle
        self._fields = fields
        self._paused_at: float | None = None
        self.num_pauses = 0

    @property
    def paused(self) -> bool:
        return self._paused_at is not None

    def update(self) -> None:
        idle = self._is_idle()
        if not idle and self._paused_at is None and self._signal(signal.SIGSTOP):
            self._paused_at = time.monotonic()
            self.num_pauses += 1
            log.info("gate_child_paused", **self._fields, reason="requests on the slice")
        elif idle:
            self.resume()

    def resume(self) -> None:
        if self._paused_at is None:
            return
        self._signal(signal.SIGCONT)
        log.info("gate_child_resumed", **self._fields, paused_s=round(time.monotonic() - self._paused_at, 3))
        self._paused_at = None

    def _signal(self, signum: int) -> bool:
        try:
            os.kill(self._pid, signum)
        except ProcessLookupError:
            return False
        return True


class GateChildError(Exception):
    """The gate's child process failed, crashed or was killed (the message says how)."""


@dataclass(frozen=True)
class GateTask:
    """One bucket's gate as plain, picklable values: the model's config (``ModelConfig`` as
    JSON data), the bucket's name, the gate's config (``GateConfig`` as JSON data), the cache
    dir, the slice's device and ``num_threads``, the log level and why the gate runs."""

    model: dict[str, Any]
    bucket_name: str
    gate: dict[str, Any]
    cache_dir: str
    device: str
    num_threads: int
    log_level: str
    reason: str


BUILD_SWITCH_INTERVAL_S = 0.0002


def lower_thread_priority(nice: int = GATE_NICE) -> int | None:
    """Give the calling thread the CPU priority ``nice`` and return it (``None`` where it cannot
    be set: not Linux, or refused).

    Linux schedules each thread by its own nice value (``setpriority`` on the thread's id), and
    threads and processes inherit it when they are created: called first thing in the gate's
    child, it covers the OpenMP team torch starts there and the ONNX Runtime sessions it builds.
    """
    if not sys.platform.startswith("linux"):
        return None
    thread_id = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread_id, nice)
    except OSError:
        return None
    return os.getpriority(os.PRIO_PROCESS, thread_id)


@contextlib.contextmanager
def short_gil_switch_interval(interval_s: float = BUILD_SWITCH_INTERVAL_S) -> Iterator[None]:
    """Python's GIL switch interval at ``interval_s`` inside (``sys.setswitchinterval``; the
    default is 5 ms), put back after. A build in the gateway (Dynamo tracing a torch.compile is
    pure Python) holds the GIL for up to the interval each time a serving thread asks for it, and
    a decode step asks hundreds of times (every op dispatched from Python): at 5 ms a later
    start's first completion took 7 s while a compiled encoder was built, at 0.2 ms 0.7 s.

    Scopes may overlap on several threads (a build and a model's load on demand): the interval
    is counted, set by the first to enter and put back by the last to leave, so one ending first
    does not lengthen it under the other."""
    global _short_scopes, _interval_before_s
    with _short_scopes_lock:
        if _short_scopes == 0:
            _interval_before_s = sys.getswitchinterval()
        _short_scopes += 1
        sys.setswitchinterval(min(interval_s, sys.getswitchinterval()))
    try:
        yield
    finally:
        with _short_scopes_lock:
            _short_scopes -= 1
            if _short_scopes == 0:
                sys.setswitchinterval(_interval_before_s)


# The scopes of short_gil_switch_interval open now, and the interval before the first.
_short_scopes = 0
_interval_before_s = 0.005
_short_scopes_lock = threading.Lock()


async def in_low_priority_thread(name: str, nice: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a new thread called ``name`` at CPU priority ``nice``
    (:func:`lower_thread_priority`; threads it starts inherit it) with a short GIL switch interval
    (:func:`short_gil_switch_interval`), awaited without blocking the event loop: a build or a
    model's load in the gateway yields the cores and the GIL to the serving threads. A thread
    of its own, since a pool thread would keep the priority for its next task.

    Raises:
        What ``fn`` raises.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, exc: BaseException | None) -> None:
        if future.cancelled():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        lower_thread_priority(nice)
        try:
            with short_gil_switch_interval():
                result = fn(*args)
        except BaseException as exc:  # noqa: BLE001  (handed to the awaiting coroutine)
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


class PipeIdleGuard:
    """The child's :class:`~models.backends.measure.IdleGuard`: asks the gateway at the other end
    of ``conn`` and waits for its answer.

    Raises (from both methods):
        GateCancelledError: the gateway said cancel (it is stopping) or is gone.
    """

    def __init__(self, conn: Connection):
        self._conn = conn

    def wait_until_idle(self) -> None:
        """Block until the gateway says the slice is idle."""
        self._ask(("wait_idle",))

    def disturbed(self) -> bool:
        """Whether the gateway saw work since the last :meth:`wait_until_idle` returned."""
        return bool(self._ask(("disturbed",))[1])

    def _ask(self, message: tuple[Any, ...]) -> tuple[Any, ...]:
        try:
            self._conn.send(message)
            reply: tuple[Any, ...] = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise GateCancelledError("the gateway is gone") from exc
        if reply[0] == "cancel":
            raise GateCancelledError("the gateway is stopping")
        return reply


def serve_guard(
    conn: Connection, guard: IdleGuard, alive: Any, stopping: threading.Event, pauser: ChildPauser | None = None
) -> dict[str, Any]:
    """Answer the child's guard questions at the other end of ``conn`` with ``guard`` until it
    sends its record, and return the record.

    Args:
        alive: called when the pipe is quiet: whether the child still runs.
        stopping: set when the gateway stops.
        pauser: updated whenever the pipe is quiet for ``POLL_S`` (the child builds or times a
            round): it stops the child while the slice has work.
    Raises:
        GateCancelledError: ``stopping`` was set (the child was told, when it was waiting).
        GateChildError: the child failed, or exited (crashed, killed) without a record.
    """
    while True:
        if stopping.is_set():
            raise GateCancelledError("the gateway is stopping")
        if not conn.poll(POLL_S):
            if not alive() and not conn.poll():
                raise GateChildError("the gate's child process exited without a record")
            if pauser is not None:
                pauser.update()
            continue
        if pauser is not None:
            pauser.resume()  # a message stopped half-written would block the read below
        try:
            message = conn.recv()
        except (EOFError, OSError) as exc:
            raise GateChildError("the gate's child process exited without a record") from exc
        kind = message[0]
        if kind == "wait_idle":
            try:
                guard.wait_until_idle()
            except GateCancelledError:
                conn.send(("cancel",))
                raise
            conn.send(("idle",))
        elif kind == "disturbed":
            conn.send(("disturbed", guard.disturbed()))
        elif kind == "done":
            return dict(message[1])
        else:
            raise GateChildError(f"the gate's child process failed: {message[1]}")


def measure_in_child(task: GateTask, guard: SliceGuard, stopping: threading.Event) -> dict[str, Any]:
    """Run ``task``'s gate in a child process (:func:`run_gate_child`), answering its guard with
    ``guard`` and keeping it stopped while the slice has work (:class:`ChildPauser`); return the
    record it saved. The child is continued and ended (terminated, then killed) before this
    returns or raises, so none outlives it.

    Raises:
        GateCancelledError: ``stopping`` was set.
        GateChildError: the child failed, crashed or was killed (its exit code said).
    """
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=run_gate_child, args=(theirs, task), name=f"sluice-gate-{task.bucket_name}", daemon=True)
    process.start()
    theirs.close()
    fields = {"model": task.model["name"], "bucket": task.bucket_name}
    log.info("gate_child_started", **fields, pid=process.pid)
    assert process.pid is not None  # started
    pauser = ChildPauser(process.pid, guard.is_idle, fields)
    try:
        return serve_guard(ours, guard, process.is_alive, stopping, pauser)
    except GateChildError as exc:
        process.join(END_GRACE_S)
        raise GateChildError(f"{exc} (exit code {process.exitcode})") from None
    finally:
        pauser.resume()
        end_process(process)
        ours.close()
        log.info("gate_child_ended", **fields, pid=process.pid, exit_code=process.exitcode)


def end_process(process: Any, grace_s: float = END_GRACE_S) -> None:
    """End ``process`` (a ``multiprocessing`` process): wait ``grace_s`` for it to exit, then
    ``SIGTERM``, then ``SIGKILL``; it is reaped (no zombie) when this returns."""
    for end in (None, process.terminate, process.kill):
        if end is not None:
            end()
        process.join(grace_s)
        if not process.is_alive():
            return


def run_gate_child(conn: Connection, task: GateTask) -> None:
    """The gate's child process's main: lower its priority, load the model from its source on
    the slice's device with the slice's threads, run and save the gate, send the record."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group; the gateway ends us
    lower_thread_priority()
    device = task.device
    if device.startswith("MIG-"):  # before CUDA starts in this process
        os.environ["CUDA_VISIBLE_DEVICES"], device = device, "cuda:0"
    _exit_with_parent(os.getppid())
    from gateway.logging import configure_logging

    configure_logging(task.log_level)
    structlog.contextvars.bind_contextvars(gate_child=os.getpid())
    try:
        record = _gate(task, device, PipeIdleGuard(conn))
    except GateCancelledError:
        return
    except Exception as exc:  # said to the gateway, which logs gate_failed
        log.exception("gate_child_failed", model=task.model["name"], bucket=task.bucket_name)
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("done", record))


def _gate(task: GateTask, device: str, guard: IdleGuard) -> dict[str, Any]:
    import torch

    from gateway import gate
    from gateway.config import GateConfig, ModelConfig
    from models.loader import load_model

    model = ModelConfig.model_validate(task.model)
    bucket = next(b for b in model.buckets if b.bucket_name == task.bucket_name)
    gate_config = GateConfig.model_validate(task.gate)
    if device == "cpu":
        torch.set_num_threads(task.num_threads)
    cache_dir = Path(task.cache_dir)
    loaded = load_model(model.name, model.source, model.task, model.dtype, device, cache_dir)
    return gate.run_and_save(loaded, model, bucket, gate_config, cache_dir, task.num_threads, task.reason, guard)


def _exit_with_parent(parent_pid: int) -> None:
    """Exit at once when the process that started us is gone (killed: it could not end us)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_WATCH_S)
        os._exit(1)

    threading.Thread(target=watch, name="gate-child-parent-watch", daemon=True).start()
