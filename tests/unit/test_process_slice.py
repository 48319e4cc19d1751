"""Process slices without processes: the wire messages, the gateway's ProcessSlice against a
fake worker on a thread (crash, restart, cancellation through the request's callback, stats it
owns for its buckets), and the worker's SliceHost against a real dynamic batcher on a thread
slice, through the Slice protocol alone."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from dataclasses import asdict
from typing import Any, Callable

import pytest

from buckets.batcher import Batcher
from buckets.dynamic import DynamicBatcher
from buckets.errors import (
    BatchFailedError,
    DeadlineExceededError,
    QueueFullError,
    ShuttingDownError,
    SliceUnavailableError,
    WorkerCrashedError,
)
from buckets.request import EmbeddingEvent, EmbeddingRequest, ErrorEvent, GenerationRequest, RequestEvent, TokenEvent
from buckets.settings import ContinuousBatcherSettings, DynamicBatcherSettings
from buckets.slices import process as process_slice_module
from buckets.slices.host import SliceHost
from buckets.slices.messages import (
    decode_error,
    decode_event,
    decode_request,
    decode_stats,
    encode_event,
    encode_request,
    encode_stats,
)
from buckets.slices.process import ProcessSlice
from buckets.slices.slice import BatcherSettings, BucketSpec, Slice, SliceState
from buckets.slices.thread import ThreadSlice
from buckets.stats import Counters
from models.step_io import SamplingParams

KEY = ("model-a", "le16", 0)
TIMEOUT_S = 10.0


def remote_spec(kind: str, settings: BatcherSettings) -> BucketSpec:
    """A spec for a bucket a worker runs: the gateway side never builds its batcher."""

    def make_batcher() -> Batcher:
        raise AssertionError("a process slice never builds a batcher here")

    return BucketSpec(kind, settings, make_batcher)


def wait_for(condition: Callable[[], Any], timeout_s: float = TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)
    return value


# -- messages -------------------------------------------------------------------------------


def test_a_generation_request_crosses_whole() -> None:
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=4, seed=7)
    request = GenerationRequest(
        "cmpl-1", [1, 2, 3], sink=lambda e: None, priority=-2, deadline_s=123.5, max_tokens=9, params=params,
        stop=("\n", "END"), ignore_eos=True, tenant="acme", tenant_weight=2.5,
    )
    request.timeline["arrival"] = 100.0
    request.info["bucket"] = "le16"
    wire = encode_request(4, request)
    events: list[RequestEvent] = []
    copy = decode_request(multiprocessing.reduction.ForkingPickler.loads(multiprocessing.reduction.ForkingPickler.dumps(wire)), events.append)
    assert isinstance(copy, GenerationRequest)
    assert wire["request_no"] == 4
    assert (copy.request_id, copy.prompt_token_ids, copy.priority, copy.deadline_s) == ("cmpl-1", [1, 2, 3], -2, 123.5)
    assert (copy.max_tokens, copy.params, copy.stop, copy.ignore_eos) == (9, params, ("\n", "END"), True)
    assert copy.timeline == {"arrival": 100.0} and copy.info == {"bucket": "le16"}
    assert (copy.tenant, copy.tenant_weight) == ("acme", 2.5)  # fair share and the tenant label in the worker
    copy.emit(TokenEvent("a", [5], None, 3, 1))
    assert events == [TokenEvent("a", [5], None, 3, 1)]


def test_an_embedding_request_crosses_whole() -> None:
    request = EmbeddingRequest("emb-1", [7, 8], sink=lambda e: None, tenant="acme", tenant_weight=0.5)
    copy = decode_request(encode_request(0, request), lambda e: None)
    assert isinstance(copy, EmbeddingRequest) and not isinstance(copy, GenerationRequest)
    assert copy.prompt_token_ids == [7, 8] and copy.deadline_s is None
    assert (copy.tenant, copy.tenant_weight) == ("acme", 0.5)


@pytest.mark.parametrize(
    "event",
    [
        TokenEvent("hi", [1, 2], "stop", 4, 2),
        TokenEvent("", [], None, 4, 0),
        EmbeddingEvent([0.25, -1.0], 3),
    ],
)
def test_events_round_trip(event: RequestEvent) -> None:
    assert decode_event(encode_event(event)) == event


def test_errors_come_back_as_their_class_or_a_batch_failure() -> None:
    back = decode_event(encode_event(ErrorEvent(DeadlineExceededError("too late"))))
    assert isinstance(back, ErrorEvent) and type(back.error) is DeadlineExceededError and str(back.error) == "too late"
    assert type(decode_error("WorkerCrashedError", "gone")) is WorkerCrashedError
    odd = decode_error("ZeroDivisionError", "division by zero")
    assert type(odd) is BatchFailedError and "ZeroDivisionError: division by zero" in str(odd)
    assert type(decode_error(QueueFullError.__name__, "full")) is BatchFailedError  # needs more than a message


def test_stats_round_trip() -> None:
    stats = Counters(num_steps=3, num_finished=2).snapshot("continuous", 1, 2, kv_blocks_total=10, kv_blocks_used=4)
    assert decode_stats(encode_stats(stats)) == stats


# -- ProcessSlice against a fake worker ----------------------------------------------------------


class FakeProcess:
    """A thread standing in for a worker process: answers ``ready``, embeds prompts whose first
    token is not 0 at once (the embedding is ``[len(prompt)]``), holds the others, records
    cancellations, answers a rebuild with ONNX FP32 running (unless ``hold_rebuilds``);
    :meth:`crash` closes its pipe as a dying process would."""

    def __init__(self, conn: Any, pid: int, is_ready: bool = True):
        self.conn = conn
        self.pid = pid
        self.is_ready = is_ready
        self.exitcode: int | None = None
        self.received: list[tuple[Any, ...]] = []
        self.hold_rebuilds = False  # True: a rebuild is never answered
        self._crash = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self.is_ready:
            self.conn.send(("ready", self.pid, {KEY: {"running": "eager"}}))
        while not self._crash.is_set():
            if not self.conn.poll(0.005):
                continue
            message = self.conn.recv()
            self.received.append(message)
            if message[0] == "stop":
                break
            if message[0] == "rebuild" and not self.hold_rebuilds:
                self.conn.send(("rebuilt", message[1], {"running": "onnx-fp32", "gate_state": "done"}, None))
            if message[0] == "submit" and message[2]["prompt_token_ids"][0] != 0:
                wire = message[2]
                self.conn.send(("dequeued", wire["request_no"], {"started": 5.0}))
                event = encode_event(EmbeddingEvent([float(len(wire["prompt_token_ids"]))], len(wire["prompt_token_ids"])))
                self.conn.send(("event", wire["request_no"], event, {"started": 5.0, "first_token": 6.0}, [(0, 0)]))
        self.exitcode = -9 if self._crash.is_set() else 0
        self.conn.close()

    def crash(self) -> None:
        self._crash.set()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def kill(self) -> None:
        self.crash()


class FakeProcessSlice(ProcessSlice):
    """Its workers are :class:`FakeProcess` threads; ``never_ready`` numbers those (from 0) that
    never say ready."""

    def __init__(self, never_ready: tuple[int, ...] = (), start_timeout_s: float = TIMEOUT_S) -> None:
        super().__init__("cpu-p", "cpu", 1, target=print, worker_args=lambda: (), start_timeout_s=start_timeout_s)
        self.processes: list[FakeProcess] = []
        self.never_ready = never_ready

    def _spawn(self) -> tuple[Any, Any]:
        ours, theirs = multiprocessing.Pipe()
        number = len(self.processes)
        self.processes.append(FakeProcess(theirs, 1000 + number, is_ready=number not in self.never_ready))
        return self.processes[-1], ours


@pytest.fixture
def fake_slice() -> Any:
    device_slice = FakeProcessSlice()
    device_slice.attach(KEY, remote_spec("dynamic", DynamicBatcherSettings(4, 5.0)))
    device_slice.start()
    yield device_slice
    device_slice.stop(timeout_s=2.0)


def make_request(first_token: int, events: list[RequestEvent]) -> EmbeddingRequest:
    request = EmbeddingRequest(f"emb-{first_token}", [first_token, 1, 2], sink=events.append)
    request.timeline["arrival"] = 1.0
    return request


def test_a_request_goes_to_the_worker_and_its_event_comes_back(fake_slice: Any) -> None:
    device_slice = fake_slice
    assert device_slice.state is SliceState.READY and device_slice.worker_pid == 1000
    assert device_slice.backend_info(KEY) == {"running": "eager"}
    events: list[RequestEvent] = []
    dequeued: list[bool] = []
    request = make_request(1, events)
    request.on_dequeue = lambda: dequeued.append(True)
    device_slice.submit(KEY, request)
    wait_for(lambda: events)
    assert events == [EmbeddingEvent([3.0], 3)]
    assert request.timeline == {"arrival": 1.0, "started": 5.0, "first_token": 6.0}
    assert request.batches == [(0, 0)] and dequeued == [True]
    assert not device_slice._in_flight


def test_a_rebuild_asks_the_worker_and_shows_the_new_backend(fake_slice: Any) -> None:
    device_slice = fake_slice
    assert device_slice.rebuild(KEY, timeout_s=TIMEOUT_S) == {"running": "onnx-fp32", "gate_state": "done"}
    assert device_slice.backend_info(KEY) == {"running": "onnx-fp32", "gate_state": "done"}
    assert [m for m in device_slice.processes[0].received if m[0] == "rebuild"] == [("rebuild", KEY)]


def test_a_rebuild_fails_when_the_worker_dies_before_it_answers(fake_slice: Any) -> None:
    device_slice = fake_slice
    process = device_slice.processes[0]
    process.hold_rebuilds = True
    errors: list[BaseException] = []

    def rebuild() -> None:
        try:
            device_slice.rebuild(KEY, timeout_s=TIMEOUT_S)
        except RuntimeError as exc:
            errors.append(exc)

    caller = threading.Thread(target=rebuild)
    caller.start()
    wait_for(lambda: [m for m in process.received if m[0] == "rebuild"])
    process.crash()
    caller.join(TIMEOUT_S)
    assert len(errors) == 1 and "exited" in str(errors[0])
    assert device_slice.backend_info(KEY) == {"running": "eager"}


def test_the_in_flight_count_and_the_submitted_count_follow_requests(fake_slice: Any) -> None:
    device_slice = fake_slice
    held = make_request(0, [])
    device_slice.submit(KEY, held)
    assert (device_slice.num_in_flight, device_slice.num_submitted) == (1, 1)
    answered: list[RequestEvent] = []
    device_slice.submit(KEY, make_request(1, answered))
    wait_for(lambda: answered)
    assert (device_slice.num_in_flight, device_slice.num_submitted) == (1, 2)
    held.cancel("cancelled")
    assert device_slice.num_in_flight == 0


def test_a_cancelled_request_is_forwarded_and_leaves_its_queue(fake_slice: Any) -> None:
    device_slice = fake_slice
    dequeued: list[bool] = []
    request = make_request(0, [])
    request.on_dequeue = lambda: dequeued.append(True)
    device_slice.submit(KEY, request)
    request.cancel("timeout")
    process = device_slice.processes[0]
    cancel = wait_for(lambda: [m for m in process.received if m[0] == "cancel"])
    assert cancel[0][2] == "timeout" and dequeued == [True]
    assert not device_slice._in_flight


def test_a_request_cancelled_before_its_callback_was_set_is_forwarded_at_submit(fake_slice: Any) -> None:
    device_slice = fake_slice
    request = make_request(0, [])
    request.cancel("cancelled")  # the client went away between admission and the slice
    device_slice.submit(KEY, request)
    process = device_slice.processes[0]
    cancel = wait_for(lambda: [m for m in process.received if m[0] == "cancel"])
    assert cancel[0][2] == "cancelled" and not device_slice._in_flight and not device_slice._request_nos


def test_cancel_is_a_callback_not_a_poll(fake_slice: Any) -> None:
    device_slice = fake_slice
    assert not [t for t in threading.enumerate() if t.name.endswith("-cancel")]
    request = make_request(0, [])
    device_slice.submit(KEY, request)
    assert request.on_cancel == device_slice.cancel
    request.cancel("timeout")
    request.cancel("cancelled")  # only the first cancel calls back
    assert not device_slice._in_flight  # forwarded on the cancelling thread, at once
    process = device_slice.processes[0]
    wait_for(lambda: [m for m in process.received if m[0] == "cancel"])
    assert [m[2] for m in process.received if m[0] == "cancel"] == ["timeout"]


def test_detaching_a_bucket_fails_its_requests_and_forgets_it(fake_slice: Any) -> None:
    device_slice = fake_slice
    events: list[RequestEvent] = []
    device_slice.submit(KEY, make_request(0, events))
    device_slice.detach(KEY)
    assert len(events) == 1 and isinstance(events[0], ErrorEvent) and isinstance(events[0].error, ShuttingDownError)
    with pytest.raises(KeyError):
        device_slice.stats(KEY)


def test_a_crash_fails_requests_in_flight_refuses_new_ones_and_restarts(fake_slice: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process_slice_module, "RESTART_BACKOFF_S", 1.0)
    device_slice = fake_slice
    events: list[RequestEvent] = []
    device_slice.submit(KEY, make_request(0, events))
    device_slice.submit(KEY, make_request(0, events))
    wait_for(lambda: len(device_slice.processes[0].received) == 2)
    device_slice.processes[0].crash()
    wait_for(lambda: len(events) == 2)
    assert all(isinstance(e, ErrorEvent) and isinstance(e.error, WorkerCrashedError) for e in events)
    assert device_slice.state is SliceState.RESTARTING and device_slice.worker_pid is None
    with pytest.raises(SliceUnavailableError):
        device_slice.submit(KEY, make_request(1, []))
    wait_for(lambda: device_slice.state is SliceState.READY)
    assert device_slice.num_restarts == 1 and device_slice.worker_pid == 1001
    served: list[RequestEvent] = []
    device_slice.submit(KEY, make_request(2, served))
    wait_for(lambda: served)
    assert isinstance(served[0], EmbeddingEvent)


def test_stats_and_batches_pushed_by_the_worker_show_here(fake_slice: Any) -> None:
    device_slice = fake_slice
    seen: list[tuple[int, int, int]] = []
    device_slice.add_batch_observer(KEY, lambda *args: seen.append(args))
    stats = Counters(num_steps=4).snapshot("dynamic", 2, 0)
    device_slice.processes[0].conn.send(("stats", {KEY: asdict(stats)}, 1.5, 0.25))
    device_slice.processes[0].conn.send(("batch", KEY, 2, 10, 1))
    wait_for(lambda: seen)
    assert device_slice.stats(KEY) == stats and seen == [(2, 10, 1)]
    assert device_slice.busy_s == 1.5 and device_slice.busy_ratio() == 0.25


def test_stop_fails_what_is_in_flight(fake_slice: Any) -> None:
    device_slice = fake_slice
    events: list[RequestEvent] = []
    device_slice.submit(KEY, make_request(0, events))
    device_slice.stop(timeout_s=2.0)
    assert len(events) == 1 and isinstance(events[0], ErrorEvent) and isinstance(events[0].error, ShuttingDownError)
    assert device_slice.state is SliceState.STOPPED
    assert ("stop",) in device_slice.processes[0].received


def test_a_continuous_bucket_refuses_a_new_block_size() -> None:
    device_slice = FakeProcessSlice()
    device_slice.attach(KEY, remote_spec("continuous", ContinuousBatcherSettings(8, 64, block_size=16)))
    with pytest.raises(ValueError, match="block_size"):
        device_slice.update_settings(KEY, ContinuousBatcherSettings(8, 64, block_size=32))
    device_slice.update_settings(KEY, ContinuousBatcherSettings(4, 64, block_size=16))
    assert device_slice._buckets[KEY].settings.max_num_seqs == 4  # type: ignore[union-attr]


# -- SliceHost with a real dynamic batcher ---------------------------------------------------


class Rows(list):  # type: ignore[type-arg]
    def tolist(self) -> list[list[float]]:
        return list(self)


class LengthRunner:
    def embed(self, batch: list[list[int]]) -> tuple[Rows, int]:
        return Rows([[float(len(ids))] for ids in batch]), 0


def test_the_host_serves_a_batcher_over_the_pipe() -> None:
    settings = DynamicBatcherSettings(4, 0.0)
    local_slice: Slice = ThreadSlice("cpu-w", "cpu", 1)
    local_slice.attach(KEY, BucketSpec("dynamic", settings, lambda: DynamicBatcher(LengthRunner(), settings), {"running": "eager"}))
    local_slice.start()
    ours, theirs = multiprocessing.Pipe()
    host = SliceHost(theirs, local_slice, [KEY], stats_interval_s=0.01)
    serving = threading.Thread(target=host.serve, daemon=True)
    serving.start()
    try:
        assert ours.recv() == ("ready", os.getpid(), {KEY: {"running": "eager"}})
        request = make_request(3, [])
        ours.send(("submit", KEY, encode_request(11, request)))
        got: dict[str, Any] = {}
        while "event" not in got or "batch" not in got:
            message = ours.recv()
            got.setdefault(message[0], message)
        assert got["dequeued"][1] == 11
        _, request_no, wire, timeline, batches = got["event"]
        assert request_no == 11 and decode_event(wire) == EmbeddingEvent([3.0], 3)
        assert {"arrival", "enqueued", "started", "first_token", "finished"} <= set(timeline)
        assert batches == [(0, 0)] and got["batch"][1:] == (KEY, 1, 3, 0)
        while True:
            message = ours.recv()
            if message[0] == "stats" and message[1][KEY]["num_finished"] == 1:
                break
    finally:
        ours.send(("stop",))
        serving.join(TIMEOUT_S)
        local_slice.stop()
        host.close()
    assert not serving.is_alive()


class ScaledRunner:
    """Embeds a prompt as ``[len(prompt) * scale]``: which batcher served it shows."""

    def __init__(self, scale: float):
        self.scale = scale

    def embed(self, batch: list[list[int]]) -> tuple[Rows, int]:
        return Rows([[float(len(ids)) * self.scale] for ids in batch]), 0


def test_the_host_rebuilds_a_bucket_under_the_gateways_key() -> None:
    settings = DynamicBatcherSettings(4, 0.0)
    local_slice: Slice = ThreadSlice("cpu-w", "cpu", 1)
    local_slice.attach(KEY, BucketSpec("dynamic", settings, lambda: DynamicBatcher(ScaledRunner(1.0), settings), {"running": "eager"}))
    local_slice.start()
    new_key = (KEY[0], KEY[1], 1)
    retired: list[Any] = []

    def rebuild(local_key: Any) -> tuple[Any, dict[str, Any], Callable[[], None]]:
        info = {"running": "onnx-fp32"}
        local_slice.attach(new_key, BucketSpec("dynamic", settings, lambda: DynamicBatcher(ScaledRunner(10.0), settings), info))
        return new_key, info, lambda: (retired.append(local_key), local_slice.detach(local_key)) and None

    ours, theirs = multiprocessing.Pipe()
    host = SliceHost(theirs, local_slice, [KEY], stats_interval_s=0.01, rebuild=rebuild)
    serving = threading.Thread(target=host.serve, daemon=True)
    serving.start()

    def embedding_of(request_no: int) -> Any:
        ours.send(("submit", KEY, encode_request(request_no, make_request(3, []))))
        while True:
            message = ours.recv()
            if message[0] == "event" and message[1] == request_no:
                return decode_event(message[2])

    try:
        assert ours.recv()[0] == "ready"
        assert embedding_of(1) == EmbeddingEvent([3.0], 3)
        ours.send(("rebuild", KEY))
        while (message := ours.recv())[0] != "rebuilt":
            pass
        assert message == ("rebuilt", KEY, {"running": "onnx-fp32"}, None) and retired == [KEY]
        assert embedding_of(2) == EmbeddingEvent([30.0], 3)
        while not ((message := ours.recv())[0] == "stats" and message[1][KEY]["num_finished"] == 1):
            pass  # the gateway's key now reports the new batcher's counters
        ours.send(("rebuild", ("model-a", "le99", 0)))
        while (message := ours.recv())[0] != "rebuilt":
            pass
        assert message[2] is None and "no bucket" in message[3]
    finally:
        ours.send(("stop",))
        serving.join(TIMEOUT_S)
        local_slice.stop()
        host.close()


def test_a_worker_that_never_gets_ready_is_killed_and_another_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process_slice_module, "RESTART_BACKOFF_S", 0.01)
    device_slice = FakeProcessSlice(never_ready=(1,), start_timeout_s=0.5)
    device_slice.attach(KEY, remote_spec("dynamic", DynamicBatcherSettings(4, 5.0)))
    device_slice.start()
    try:
        device_slice.processes[0].crash()
        wait_for(lambda: device_slice.num_restarts == 1)
        assert device_slice.state is SliceState.READY and device_slice.worker_pid == 1002
        assert not device_slice.processes[1].is_alive()
    finally:
        device_slice.stop(timeout_s=2.0)


def test_stop_during_a_restart_starts_no_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process_slice_module, "RESTART_BACKOFF_S", 0.5)
    device_slice = FakeProcessSlice()
    device_slice.attach(KEY, remote_spec("dynamic", DynamicBatcherSettings(4, 5.0)))
    device_slice.start()
    device_slice.processes[0].crash()
    wait_for(lambda: device_slice.state is SliceState.RESTARTING)
    device_slice.stop(timeout_s=2.0)
    time.sleep(1.0)
    assert len(device_slice.processes) == 1 and device_slice.state is SliceState.STOPPED


def test_a_first_worker_that_dies_fails_the_start() -> None:
    device_slice = FakeProcessSlice(never_ready=(0,), start_timeout_s=0.3)
    device_slice.attach(KEY, remote_spec("dynamic", DynamicBatcherSettings(4, 5.0)))
    with pytest.raises(RuntimeError, match="did not start"):
        device_slice.start()
    assert device_slice.state is SliceState.FAILED and len(device_slice.processes) == 1
