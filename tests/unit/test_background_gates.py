"""The pause logic of a gate beside serving, with fake callables: the guard waits while the slice
has work and logs one pause, a sample during which work ran is void, a stop ends the wait, and
the interleaved measurement stops a disturbed round and measures it again, and a gate whose
bucket was replaced meanwhile is dropped (no clock, no sleep: the fakes say when the slice is
busy)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import structlog

from buckets.slices.process import ProcessSlice
from gateway import gate, gate_process
from gateway.background_gates import BackgroundGates, GateJob, SliceIdleGuard
from gateway.gate_process import GATE_NICE, lower_thread_priority
from models.backends.measure import GateCancelledError, interleaved_times_ms

FIELDS = {"model": "m", "bucket": "le32"}


def scripted(values: list[bool]) -> Iterator[bool]:
    """``values`` in turn, then the last one for ever."""
    yield from values
    while True:
        yield values[-1]


def test_the_guard_waits_while_the_slice_is_busy_and_logs_one_pause() -> None:
    looks = scripted([False, False, False, True])
    with structlog.testing.capture_logs() as logs:
        guard = SliceIdleGuard(lambda: next(looks), lambda: 0, threading.Event(), FIELDS, poll_s=0.0)
        guard.wait_until_idle()
    events = [e["event"] for e in logs]
    assert events == ["gate_paused", "gate_resumed"]
    assert guard.num_pauses == 1 and logs[1]["model"] == "m" and logs[1]["paused_s"] >= 0


def test_an_idle_slice_is_measured_at_once_without_a_pause() -> None:
    with structlog.testing.capture_logs() as logs:
        guard = SliceIdleGuard(lambda: True, lambda: 0, threading.Event(), FIELDS, poll_s=0.0)
        guard.wait_until_idle()
    assert logs == [] and guard.num_pauses == 0 and not guard.disturbed()


def test_a_sample_is_void_when_work_ran_or_is_there() -> None:
    steps = [0]
    idle = [True]
    guard = SliceIdleGuard(lambda: idle[0], lambda: steps[0], threading.Event(), FIELDS, poll_s=0.0)
    guard.wait_until_idle()
    steps[0] += 1  # a request came and went: one forward ran
    with structlog.testing.capture_logs() as logs:
        assert guard.disturbed()
    guard.wait_until_idle()  # the mark moves on
    assert not guard.disturbed()
    idle[0] = False  # a request is queued now
    assert guard.disturbed()
    assert guard.num_discarded == 2
    assert [(e["event"], e["num_discarded"]) for e in logs] == [("gate_samples_discarded", 1)]


def test_a_stop_ends_the_wait_of_a_busy_slice() -> None:
    stopping = threading.Event()
    looked = threading.Event()

    def busy() -> bool:
        looked.set()
        return False

    guard = SliceIdleGuard(busy, lambda: 0, stopping, FIELDS, poll_s=60.0)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            guard.wait_until_idle()
        except GateCancelledError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert looked.wait(30)
    stopping.set()  # wakes the guard's wait on the event at once
    waiter.join(30)
    assert not waiter.is_alive() and len(errors) == 1


class OneDisturbance:
    """A guard asked after every timed call; work arrived during the ``disturb_at``-th call
    (counted from 1)."""

    def __init__(self, disturb_at: int):
        self.disturb_at = disturb_at
        self.num_waits = 0
        self.num_looks = 0

    def wait_until_idle(self) -> None:
        self.num_waits += 1

    def disturbed(self) -> bool:
        self.num_looks += 1
        return self.num_looks == self.disturb_at


def test_a_disturbed_round_stops_at_once_and_is_measured_again() -> None:
    calls: dict[str, list[int]] = {"eager": [], "onnx": []}
    fns = {name: (lambda shape, name=name: calls[name].append(shape)) for name in calls}
    guard = OneDisturbance(disturb_at=1)  # during the first timed call: its round stops there
    times = interleaved_times_ms(fns, num_shapes=2, repeats=3, guard=guard)
    assert all(len(per_shape) == 3 for name in times for per_shape in times[name])
    # 2 warm-up calls per backend, 6 kept rounds of both, and the first call of the stopped round.
    assert sorted(len(c) for c in calls.values()) == [8, 9]
    assert guard.num_looks == 1 + 6 * 2
    assert guard.num_waits == 2 + 7  # before each shape's warm-up, and before every round


def test_without_a_guard_nothing_is_discarded() -> None:
    counted = {"eager": 0}

    def call(_: int) -> None:
        counted["eager"] += 1

    times = interleaved_times_ms({"eager": call}, num_shapes=1, repeats=4)
    assert len(times["eager"][0]) == 4 and counted["eager"] == 5


@pytest.mark.parametrize("disturb_at", [1, 3])
def test_paired_rounds_stay_paired_after_a_discard(disturb_at: int) -> None:
    order: list[str] = []
    fns = {name: (lambda shape, name=name: order.append(name)) for name in ("a", "b")}
    times = interleaved_times_ms(fns, num_shapes=1, repeats=4, guard=OneDisturbance(disturb_at))
    assert len(times["a"][0]) == len(times["b"][0]) == 4
    assert len(order) == 2 + 4 * 2 + 1  # warm-ups, kept rounds, and the stopped round's one call


class FakeBucket:
    def __init__(self, name: str) -> None:
        self.name = name
        self.backend_info: dict[str, object] = {"configured": "auto", "running": "eager", "gate_state": "pending"}


def test_a_gate_whose_bucket_was_replaced_before_it_ran_is_dropped_unmeasured(monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_measure(*_: object, **__: object) -> None:
        raise AssertionError("a dropped gate measured")

    monkeypatch.setattr(gate_process, "measure_in_child", must_not_measure)
    queued, replacement = FakeBucket("le32"), FakeBucket("le32")
    served = SimpleNamespace(draining=False, table=SimpleNamespace(by_name=lambda name: replacement))
    gates = BackgroundGates(SimpleNamespace(models={"m": served}))  # type: ignore[arg-type]
    with structlog.testing.capture_logs() as logs:
        gates._gate(GateJob("m", queued))  # type: ignore[arg-type]
    assert [e["event"] for e in logs] == ["gate_result_dropped"]
    assert queued.backend_info["gate_state"] == "dropped" and replacement.backend_info["gate_state"] == "pending"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_the_gate_thread_runs_at_the_lowest_priority_and_the_others_keep_theirs() -> None:
    seen: dict[str, int | None] = {}

    def gate_thread() -> None:
        seen["returned"] = lower_thread_priority()
        seen["own"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        child = threading.Thread(target=lambda: seen.update(child=os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        child.start()
        child.join()

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=gate_thread)
    thread.start()
    thread.join()
    assert seen == {"returned": GATE_NICE, "own": GATE_NICE, "child": GATE_NICE}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_a_process_slice_bucket_is_queued_as_built_and_gated_only_when_its_worker_says_pending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured: list[str] = []
    monkeypatch.setattr(gate_process, "measure_in_child", lambda task, guard, stopping: measured.append(task.bucket_name))
    remote = ProcessSlice("cpu-p", "cpu", 1, target=print, worker_args=lambda: ())
    found, pending, configured = FakeBucket("le32"), FakeBucket("le64"), FakeBucket("le128")
    found.backend_info = {"configured": "auto", "isolation": "process"}  # as built: the worker has not said yet
    pending.backend_info = dict(found.backend_info)
    configured.backend_info = {"configured": "onnx", "isolation": "process"}
    buckets = {b.name: b for b in (found, pending, configured)}
    for bucket in buckets.values():
        bucket.device_slice = remote  # type: ignore[attr-defined]
    served = SimpleNamespace(draining=False, table=SimpleNamespace(by_name=buckets.get))
    gates = BackgroundGates(SimpleNamespace(models={"m": served}))  # type: ignore[arg-type]
    for bucket in buckets.values():
        gates.on_bucket("m", bucket)  # type: ignore[arg-type]
    jobs = [gates._queue.get_nowait() for _ in range(gates._queue.qsize())]
    assert [job.bucket.name for job in jobs] == ["le32", "le64"]
    found.backend_info.update(gate_state="done", running="onnx-fp32")  # the worker's ready message
    pending.backend_info.update(gate_state="pending", running="eager")
    monkeypatch.setattr(BackgroundGates, "_task", lambda self, job: SimpleNamespace(bucket_name=job.bucket.name))
    monkeypatch.setattr(BackgroundGates, "_guard", lambda self, job: None)
    monkeypatch.setattr(gate, "chosen_backend", lambda record, config: "eager")
    monkeypatch.setattr(gate, "summary", lambda record, config: None)
    gates.engine.config = SimpleNamespace(gate=None)  # type: ignore[attr-defined]
    for job in jobs:
        gates._gate(job)
    assert measured == ["le64"] and pending.backend_info["gate_state"] == "done"
