"""Deadlines: the timeout policy, the scheduler and both batchers dropping expired requests, and
deadline-aware admission, all with plain values and fake clocks."""

from __future__ import annotations

import pytest

from buckets.admission import AdmissionControl
from buckets.errors import DeadlineExceededError, DeadlineUnmeetableError, QueueFullError
from buckets.request import EmbeddingEvent, EmbeddingRequest, ErrorEvent, TokenEvent
from buckets.dynamic import DynamicBatcher
from buckets.settings import DynamicBatcherSettings
from policies.admission import BusyDrainRate
from policies.deadlines import (
    TimeoutOverCapError, can_meet_deadline, expected_wait_s, is_expired, resolve_timeout_s,
)
from buckets.sequence import FinishReason
from tests.factories import FakeClock, Recorder, events_of, make_request, make_sequence
from tests.unit.test_scheduler import FakeRunner, make_batcher, make_core, run_step


# --- policy -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "default", "cap", "expected"),
    [
        (None, None, None, None),
        (None, 30.0, None, 30.0),
        (None, 30.0, 10.0, 10.0),  # the default is clipped to the cap
        (None, None, 10.0, 10.0),  # a cap alone bounds every request
        (5.0, 30.0, 10.0, 5.0),
        (10.0, None, 10.0, 10.0),
        (0.25, None, None, 0.25),
    ],
)
def test_resolve_timeout(requested: float | None, default: float | None, cap: float | None, expected: float | None) -> None:
    assert resolve_timeout_s(requested, default, cap) == expected


def test_a_timeout_over_the_cap_is_refused() -> None:
    with pytest.raises(TimeoutOverCapError, match="over the cap of 10 s"):
        resolve_timeout_s(10.5, None, 10.0)


def test_expiry_and_expected_wait() -> None:
    assert not is_expired(None, 1e9)
    assert not is_expired(10.0, 9.999)
    assert is_expired(10.0, 10.0)
    assert expected_wait_s(0, 0.0) == 0.0
    assert expected_wait_s(5, 0.0) is None  # nothing drained yet: unknown
    assert expected_wait_s(6, 2.0) == 3.0
    assert can_meet_deadline(6, 2.0, None)
    assert can_meet_deadline(6, 2.0, 3.5)
    assert not can_meet_deadline(6, 2.0, 3.0)
    assert can_meet_deadline(6, 0.0, 0.1)  # unknown wait never refuses


# --- deadline-aware admission -------------------------------------------------------------------


def test_admission_refuses_a_request_whose_timeout_the_queue_cannot_meet() -> None:
    clock = FakeClock(100.0)
    admission = AdmissionControl(max_queue_len=100, clock=clock, window_s=10.0)
    assert admission.admit(1, timeout_s=1e-9) is not None  # an empty queue starts at once
    tickets = [admission.admit(1, timeout_s=1e-9) for _ in range(9)]  # drain rate unknown: no refusal
    clock.now += 600.0  # a long idle stretch before the queue got busy must not count as slow
    tickets = [admission.admit(1) for _ in range(10)] + tickets
    admission = AdmissionControl(max_queue_len=100, clock=clock, window_s=10.0)
    busy = [admission.admit(1) for _ in range(10)]
    for ticket in busy[:6]:  # one leaves every 2 s while the queue is busy: 0.5 a second
        clock.now += 2.0
        ticket.release()
    assert admission.admit(1, timeout_s=10.5) is not None  # 4 ahead at 0.5/s: 8 s
    with pytest.raises(DeadlineUnmeetableError) as refused:
        admission.admit(1, timeout_s=9.0)  # 5 ahead: 10 s
    assert isinstance(refused.value, QueueFullError)  # a 429 like a full queue
    assert "exceeds the request's timeout of 9 s" in str(refused.value)
    assert 1 <= refused.value.retry_after_s <= 11
    assert admission.num_rejected == 1
    assert admission.num_queued == 5  # the refused one was never counted
    assert admission.admit(1) is not None  # without a deadline the limits alone apply
    del tickets


def test_busy_drain_rate_leaves_idle_time_out_and_counts_a_stuck_queue_as_slow() -> None:
    rate = BusyDrainRate(window=8, min_samples=2)
    rate.on_enqueue(0.0, 0)
    rate.on_dequeue(1.0, 0)  # busy 0..1
    assert rate.rate_per_s(1.0) == 0.0  # one interval: unknown yet
    rate.on_enqueue(50.0, 0)  # idle 1..50 is not counted
    rate.on_enqueue(50.0, 1)
    rate.on_dequeue(51.0, 1)
    assert rate.rate_per_s(51.0) == pytest.approx(1.0)
    assert rate.rate_per_s(55.0) == pytest.approx(2 / 6)  # 4 s without a dequeue so far


# --- the continuous batcher ---------------------------------------------------------------------


def test_a_queued_sequence_past_its_deadline_gets_an_error_and_never_runs() -> None:
    core = make_core(max_num_seqs=1)
    clock = core.scheduler.clock
    assert isinstance(clock, FakeClock)
    running = make_sequence(make_request(4, max_tokens=50, name="running"))
    late = make_request(4, max_tokens=5, name="late")
    late.deadline_s = 2.0
    queued = make_sequence(late)
    core.add(running)
    core.add(queued)
    run_step(core)
    clock.now = 1.9
    assert core.drop_ended(clock.now) == []
    run_step(core)
    clock.now = 2.0
    assert core.drop_ended(clock.now) == [queued]
    [event] = events_of(late)
    assert isinstance(event, ErrorEvent) and isinstance(event.error, DeadlineExceededError)
    assert queued.finish_reason is FinishReason.TIMEOUT
    assert queued not in core.scheduler.waiting
    assert all(queued.seq_id != s.seq_id for s in core.schedule().forward.sequences)


def test_a_running_sequence_past_its_deadline_ends_with_timeout_and_frees_its_blocks() -> None:
    core = make_core()
    clock = core.scheduler.clock
    assert isinstance(clock, FakeClock)
    request = make_request(6, max_tokens=50, name="slow")
    request.deadline_s = 5.0
    seq = make_sequence(request)
    other = make_sequence(make_request(3, max_tokens=50, name="other"))
    core.add(seq)
    core.add(other)
    for _ in range(3):
        run_step(core)
    used_before = core.scheduler.block_manager.stats().num_used_blocks
    clock.now = 5.0
    assert core.drop_ended(clock.now) == [seq]
    events = events_of(request)
    assert [e.finish_reason for e in events if isinstance(e, TokenEvent)] == [None, None, None, "timeout"]
    last = events[-1]
    assert isinstance(last, TokenEvent) and last.token_ids == [] and last.num_completion_tokens == 3
    assert core.scheduler.block_manager.stats().num_used_blocks < used_before
    assert core.scheduler.running == [other]
    assert seq.finish_reason is FinishReason.TIMEOUT
    core.scheduler.block_manager.check_invariants()


def test_a_timeout_releases_the_text_held_back_for_stop_strings() -> None:
    core = make_core()
    clock = core.scheduler.clock
    assert isinstance(clock, FakeClock)
    request = make_request(2, max_tokens=50, stop=("XYZ",), name="held")
    request.deadline_s = 1.0
    core.add(make_sequence(request))
    for token_id in (1, 2, 3):  # 'b', 'c', 'd'; the last 2 characters stay held for "XYZ"
        run_step(core, token_id=token_id)
    assert "".join(e.text for e in events_of(request) if isinstance(e, TokenEvent)) == "b"
    clock.now = 1.0
    core.drop_ended()
    last = events_of(request)[-1]
    assert isinstance(last, TokenEvent) and last.finish_reason == "timeout" and last.text == "cd"
    assert request.timeline["finished"] == 1.0


def test_a_sequence_in_prefill_past_its_deadline_gets_an_error() -> None:
    core = make_core(max_num_batched_tokens=4)
    clock = core.scheduler.clock
    assert isinstance(clock, FakeClock)
    request = make_request(20, max_tokens=4, name="long")
    request.deadline_s = 1.0
    seq = make_sequence(request)
    core.add(seq)
    run_step(core)  # the first chunk of 4 of its 20 prompt tokens
    assert core.scheduler.block_manager.stats().num_used_blocks > 0
    clock.now = 1.5
    assert core.drop_ended(clock.now) == [seq]
    [event] = events_of(request)
    assert isinstance(event, ErrorEvent) and isinstance(event.error, DeadlineExceededError)
    assert core.scheduler.block_manager.stats().num_used_blocks == 0


def test_the_batcher_counts_timeouts_and_tells_the_runner_to_release() -> None:
    runner = FakeRunner()
    batcher = make_batcher(runner)
    clock = batcher.clock
    assert isinstance(clock, FakeClock)
    request = make_request(3, max_tokens=50, name="a")
    request.deadline_s = 1.0
    batcher.submit(request)
    batcher.step()
    seq_id = runner.calls[0].sequences[0].seq_id
    clock.now = 1.0
    batcher.step()
    assert runner.calls[-1].released_seq_ids == [seq_id]
    assert batcher.stats().num_timed_out == 1
    assert batcher.seconds_until_ready(clock.now) is None
    assert runner.live == set()


# --- the dynamic batcher ------------------------------------------------------------------------


class FakeEncoder:
    def __init__(self) -> None:
        self.batches: list[list[list[int]]] = []

    def embed(self, inputs: list[list[int]]) -> tuple[object, int]:
        import torch

        self.batches.append(inputs)
        return torch.zeros(len(inputs), 2), 0


def test_the_dynamic_batcher_fails_expired_requests_instead_of_running_them() -> None:
    clock = FakeClock()
    runner = FakeEncoder()
    batcher = DynamicBatcher(runner, DynamicBatcherSettings(8, 100.0), clock=clock)
    fresh = EmbeddingRequest(request_id="fresh", prompt_token_ids=[1, 2], sink=Recorder())
    stale = EmbeddingRequest(request_id="stale", prompt_token_ids=[3], sink=Recorder(), deadline_s=0.05)
    batcher.submit(stale)
    batcher.submit(fresh)
    clock.now = 0.1
    batcher.step()
    assert runner.batches == [[[1, 2]]]
    [stale_event] = stale.sink.events  # type: ignore[attr-defined]
    assert isinstance(stale_event, ErrorEvent) and isinstance(stale_event.error, DeadlineExceededError)
    [fresh_event] = fresh.sink.events  # type: ignore[attr-defined]
    assert isinstance(fresh_event, EmbeddingEvent)
    assert batcher.stats().num_timed_out == 1
