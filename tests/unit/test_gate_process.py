"""The pipe between a gate's child process and the gateway's gate thread: the child's guard
waits for the gateway's answer, a sample is void when the gateway's guard says so, the record
comes back, a stop cancels a waiting child, and a child that fails or goes away without a
record is an error; a child that ignores its end is terminated and reaped. The two ends run on
two threads of this process over a real ``multiprocessing`` pipe (no sleep: each side blocks on
the other)."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from gateway.gate_process import ChildPauser, GateChildError, PipeIdleGuard, end_process, serve_guard
from models.backends.measure import GateCancelledError


class ScriptedGuard:
    """The gateway's guard: counts waits, answers ``disturbed`` from ``answers`` in turn, and
    blocks a wait on ``release`` when one is given."""

    def __init__(self, answers: list[bool], release: threading.Event | None = None, stopping: threading.Event | None = None):
        self.answers = answers
        self.num_waits = 0
        self.release = release
        self.stopping = stopping
        self.waiting = threading.Event()

    def wait_until_idle(self) -> None:
        self.num_waits += 1
        self.waiting.set()
        if self.release is not None:
            while not self.release.wait(0.01):
                if self.stopping is not None and self.stopping.is_set():
                    raise GateCancelledError("stopping")

    def disturbed(self) -> bool:
        return self.answers.pop(0)


def run_child(body: Callable[[PipeIdleGuard, Any], None]) -> tuple[Any, threading.Thread, list[BaseException]]:
    """The gateway's end of a pipe whose other end ``body(guard, conn)`` runs on a thread."""
    ours, theirs = multiprocessing.Pipe()
    errors: list[BaseException] = []

    def child() -> None:
        try:
            body(PipeIdleGuard(theirs), theirs)
        except BaseException as exc:  # noqa: BLE001  # the test looks at what the child raised
            errors.append(exc)
        finally:
            theirs.close()

    thread = threading.Thread(target=child)
    thread.start()
    return ours, thread, errors


def test_the_child_waits_for_idle_asks_about_disturbance_and_sends_its_record() -> None:
    seen: list[bool] = []

    def body(guard: PipeIdleGuard, conn: Any) -> None:
        guard.wait_until_idle()
        seen.append(guard.disturbed())
        guard.wait_until_idle()
        seen.append(guard.disturbed())
        conn.send(("done", {"chosen": "onnx-fp32"}))

    conn, thread, errors = run_child(body)
    guard = ScriptedGuard([True, False])
    record = serve_guard(conn, guard, thread.is_alive, threading.Event())
    thread.join(30)
    assert record == {"chosen": "onnx-fp32"} and seen == [True, False] and guard.num_waits == 2 and errors == []


def test_a_stop_while_the_child_waits_cancels_it_on_both_sides() -> None:
    def body(guard: PipeIdleGuard, conn: Any) -> None:
        guard.wait_until_idle()

    stopping = threading.Event()
    guard = ScriptedGuard([], release=threading.Event(), stopping=stopping)
    conn, thread, errors = run_child(body)
    threading.Thread(target=lambda: guard.waiting.wait(30) and stopping.set()).start()
    with pytest.raises(GateCancelledError):
        serve_guard(conn, guard, thread.is_alive, stopping)
    thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], GateCancelledError)


def test_a_child_that_failed_is_an_error_with_its_reason() -> None:
    conn, thread, _ = run_child(lambda guard, conn: conn.send(("failed", "RuntimeError: no onnx")))
    with pytest.raises(GateChildError, match="no onnx"):
        serve_guard(conn, ScriptedGuard([]), thread.is_alive, threading.Event())
    thread.join(30)


def test_a_child_gone_without_a_record_is_an_error() -> None:
    conn, thread, _ = run_child(lambda guard, conn: guard.wait_until_idle())
    with pytest.raises(GateChildError, match="without a record"):
        serve_guard(conn, ScriptedGuard([]), thread.is_alive, threading.Event())
    thread.join(30)


def test_the_childs_guard_is_cancelled_when_the_gateway_is_gone() -> None:
    ours, theirs = multiprocessing.Pipe()
    ours.close()
    with pytest.raises(GateCancelledError):
        PipeIdleGuard(theirs).wait_until_idle()


def test_a_child_that_does_not_exit_is_terminated_and_reaped() -> None:
    process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=True)
    process.start()
    end_process(process, grace_s=0.1)
    assert not process.is_alive() and process.exitcode is not None and process.exitcode < 0


def _state(pid: int) -> str:
    """The process's state letter from ``/proc`` (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_pauser_stops_the_child_while_the_slice_has_work_and_continues_it_after() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        idle = [False]
        pauser = ChildPauser(child.pid, lambda: idle[0], {"bucket": "le32"})
        pauser.update()
        assert pauser.paused and _until(lambda: _state(child.pid) == "T")
        pauser.update()  # still busy: one pause, not two
        assert pauser.num_pauses == 1
        idle[0] = True
        pauser.update()
        assert not pauser.paused and _until(lambda: _state(child.pid) != "T")
        idle[0] = False
        pauser.update()
        pauser.resume()  # the gate ends: continued for good
        assert not pauser.paused and _until(lambda: _state(child.pid) != "T") and pauser.num_pauses == 2
    finally:
        child.kill()
        child.wait()
    gone = ChildPauser(child.pid, lambda: False, {})
    gone.update()  # the process has exited: nothing to stop, no error
    assert not gone.paused


def test_a_message_from_the_child_continues_it_before_it_is_read() -> None:
    class RecordingPauser(ChildPauser):
        def __init__(self) -> None:
            super().__init__(0, lambda: False, {})
            self.calls: list[str] = []

        def update(self) -> None:
            self.calls.append("update")

        def resume(self) -> None:
            self.calls.append("resume")

    pauser = RecordingPauser()
    conn, thread, errors = run_child(lambda guard, end: end.send(("done", {"chosen": "eager"})))
    assert serve_guard(conn, ScriptedGuard([]), thread.is_alive, threading.Event(), pauser) == {"chosen": "eager"}
    thread.join()
    assert pauser.calls and pauser.calls[-1] == "resume" and not errors
