"""Admission control: the pure limits and Retry-After, the bucket's admission control, and the queued count
returning to zero through the continuous and dynamic batchers (fake runners, no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from buckets.admission import AdmissionControl
from buckets.dynamic import DynamicBatcher
from buckets.errors import QueueFullError
from buckets.request import EmbeddingRequest
from buckets.sequence import SequenceStatus
from buckets.settings import DynamicBatcherSettings
from policies.admission import RateWindow, refusal_reason, retry_after_s
from tests.unit.test_bucket_table import dummy_batcher, make_bucket
from tests.factories import FakeClock, Recorder, make_request
from tests.unit.test_scheduler import FakeRunner, drain, make_batcher

# --- policies ---------------------------------------------------------------------------------


def test_refusal_names_the_queue_length_limit() -> None:
    assert refusal_reason(1, 10, 5, max_queue_len=2, max_queued_tokens=None) is None
    reason = refusal_reason(2, 10, 5, max_queue_len=2, max_queued_tokens=None)
    assert reason is not None and "max_queue_len 2" in reason


def test_refusal_names_the_token_limit_but_an_empty_queue_takes_anything() -> None:
    assert refusal_reason(1, 60, 40, max_queue_len=10, max_queued_tokens=100) is None
    reason = refusal_reason(1, 60, 41, max_queue_len=10, max_queued_tokens=100)
    assert reason is not None and "max_queued_tokens 100" in reason
    assert refusal_reason(0, 0, 500, max_queue_len=10, max_queued_tokens=100) is None


@pytest.mark.parametrize(
    ("num_queued", "drain_per_s", "expected"),
    [(10, 5.0, 2), (11, 5.0, 3), (1, 100.0, 1), (0, 2.0, 1), (1000, 1.0, 60), (5, 0.0, 60)],
)
def test_retry_after_is_queue_over_drain_rate_clamped(num_queued: int, drain_per_s: float, expected: int) -> None:
    assert retry_after_s(num_queued, drain_per_s) == expected


def test_retry_after_bounds_are_parameters() -> None:
    assert retry_after_s(3, 0.0, min_s=2, max_s=9) == 9
    assert retry_after_s(1, 10.0, min_s=2, max_s=9) == 2


def test_rate_window_counts_recent_events_only() -> None:
    window = RateWindow(window_s=10.0, start_s=0.0)
    assert window.rate_per_s(0.0) == 0.0
    for t in (0.5, 1.0, 1.5, 2.0):
        window.record(t)
    assert window.rate_per_s(2.0) == pytest.approx(4 / 2.0)  # over the 2 s since start
    assert window.rate_per_s(10.0) == pytest.approx(4 / 10.0)
    assert window.rate_per_s(11.2) == pytest.approx(2 / 10.0)  # 0.5 and 1.0 slid out
    assert window.rate_per_s(100.0) == 0.0


def test_rate_window_span_is_at_least_a_second() -> None:
    window = RateWindow(window_s=30.0, start_s=5.0)
    window.record(5.1)
    assert window.rate_per_s(5.2) == pytest.approx(1.0)


# --- the admission -----------------------------------------------------------------------------------


def test_admission_admits_up_to_the_limits_and_refuses_beyond() -> None:
    admission = AdmissionControl(max_queue_len=3, max_queued_tokens=100, clock=FakeClock())
    tickets = [admission.admit(30), admission.admit(30)]
    with pytest.raises(QueueFullError, match="max_queued_tokens 100") as info:
        admission.admit(41)
    assert info.value.retry_after_s == 60  # nothing has drained yet
    tickets.append(admission.admit(40))
    with pytest.raises(QueueFullError, match="max_queue_len 3"):
        admission.admit(1)
    assert (admission.num_queued, admission.num_queued_tokens, admission.num_rejected) == (3, 100, 2)
    tickets[0].release()
    assert (admission.num_queued, admission.num_queued_tokens) == (2, 70)
    admission.admit(1)


def test_ticket_release_is_idempotent() -> None:
    admission = AdmissionControl(max_queue_len=2, clock=FakeClock())
    ticket = admission.admit(7)
    admission.admit(3)
    ticket.release()
    ticket.release()
    assert (admission.num_queued, admission.num_queued_tokens) == (1, 3)


def test_retry_after_follows_the_drain_rate() -> None:
    clock = FakeClock()
    admission = AdmissionControl(max_queue_len=4, clock=clock, window_s=10.0)
    tickets = [admission.admit(1) for _ in range(4)]
    clock.now = 2.0
    tickets[0].release()
    tickets[1].release()  # 2 left the queue in 2 s: 1 per second
    admission.admit(1)
    admission.admit(1)
    with pytest.raises(QueueFullError) as info:
        admission.admit(1)
    assert info.value.retry_after_s == 4  # 4 queued at 1 per second


# --- the bucket ---------------------------------------------------------------------------------


def test_bucket_submit_raises_queue_full_and_queues_nothing() -> None:
    bucket = make_bucket(16)
    bucket.admission = AdmissionControl(max_queue_len=2, clock=FakeClock())
    requests = [make_request(3, name=f"r{i}") for i in range(3)]
    bucket.submit(requests[0])
    bucket.submit(requests[1])
    with pytest.raises(QueueFullError) as info:
        bucket.submit(requests[2])
    assert info.value.retry_after_s >= 1
    assert dummy_batcher(bucket).submitted == requests[:2]
    requests[0].leave_queue()
    bucket.submit(requests[2])
    assert bucket.admission.num_queued == 2


def test_bucket_limits_come_from_its_fields() -> None:
    bucket = make_bucket(16)
    bucket.max_queue_len, bucket.max_queued_tokens = 5, 50
    bucket.__post_init__()
    assert (bucket.admission.max_queue_len, bucket.admission.max_queued_tokens) == (5, 50)


# --- through the batchers -----------------------------------------------------------------------


def admit_all(admission: AdmissionControl, requests: list) -> None:  # type: ignore[type-arg]
    for request in requests:
        request.on_dequeue = admission.admit(request.num_prompt_tokens).release


def test_continuous_requests_leave_the_queue_when_they_start() -> None:
    admission = AdmissionControl(max_queue_len=10, clock=FakeClock())
    batcher = make_batcher(FakeRunner(), max_num_seqs=1)
    requests = [make_request(3, max_tokens=2, name=f"r{i}") for i in range(3)]
    admit_all(admission, requests)
    for request in requests:
        batcher.submit(request)
    batcher.step()  # only r0 fits in max_num_seqs
    assert (admission.num_queued, admission.num_queued_tokens) == (2, 6)
    drain(batcher)
    assert (admission.num_queued, admission.num_queued_tokens) == (0, 0)


def test_a_chunked_prefill_leaves_the_queue_before_its_first_token() -> None:
    admission = AdmissionControl(max_queue_len=10, clock=FakeClock())
    batcher = make_batcher(FakeRunner(), max_num_batched_tokens=4)
    request = make_request(10, max_tokens=2)
    admit_all(admission, [request])
    batcher.submit(request)
    batcher.step()
    assert request.sink.events == []  # type: ignore[attr-defined]  # still prefilling
    assert admission.num_queued == 0


def test_continuous_requests_cancelled_while_queued_leave_the_queue() -> None:
    admission = AdmissionControl(max_queue_len=10, clock=FakeClock())
    batcher = make_batcher(FakeRunner(), max_num_seqs=1)
    running, queued = make_request(3, max_tokens=3, name="a"), make_request(3, max_tokens=3, name="b")
    admit_all(admission, [running, queued])
    batcher.submit(running)
    batcher.submit(queued)
    batcher.step()
    assert admission.num_queued == 1
    queued.cancel()
    batcher.step()
    assert admission.num_queued == 0
    drain(batcher)
    assert batcher.stats().num_cancelled == 1 and admission.num_queued == 0


def test_a_preempted_sequence_does_not_release_twice() -> None:
    # 3 blocks of 2 tokens: both 2-token prompts prefill; the decodes need a 4th block, so one is
    # preempted back to the waiting queue and resumed later.
    admission = AdmissionControl(max_queue_len=10, clock=FakeClock())
    batcher = make_batcher(FakeRunner(num_blocks=3, block_size=2))
    a, b, c = (make_request(2, max_tokens=3, name=n) for n in "abc")
    admit_all(admission, [a, b])
    batcher.submit(a)
    batcher.submit(b)
    batcher.step()
    batcher.step()
    assert any(s.status is SequenceStatus.PREEMPTED for s in batcher.scheduler.waiting)
    assert admission.num_queued == 0
    admit_all(admission, [c])  # a newcomer's ticket must survive the preempted one's return
    batcher.submit(c)
    assert admission.num_queued == 1
    drain(batcher)
    assert batcher.scheduler.counters.num_preemptions >= 1
    assert (admission.num_queued, admission.num_queued_tokens) == (0, 0)


def test_shutdown_releases_queued_requests() -> None:
    admission = AdmissionControl(max_queue_len=10, clock=FakeClock())
    batcher = make_batcher(FakeRunner(), max_num_seqs=1)
    requests = [make_request(3, name=f"r{i}") for i in range(3)]
    admit_all(admission, requests)
    for request in requests:
        batcher.submit(request)
    batcher.step()
    batcher.shutdown()
    assert admission.num_queued == 0


def make_embedding(num_tokens: int = 3) -> EmbeddingRequest:
    return EmbeddingRequest(request_id="e", prompt_token_ids=list(range(1, num_tokens + 1)), sink=Recorder())


def test_dynamic_requests_leave_the_queue_when_their_batch_is_taken() -> None:
    import torch

    runner = SimpleNamespace(embed=lambda rows: (torch.zeros(len(rows), 2), 0))
    batcher = DynamicBatcher(runner, DynamicBatcherSettings(2, 0.0), clock=FakeClock())
    admission = AdmissionControl(max_queue_len=10, clock=FakeClock())
    requests = [make_embedding() for _ in range(3)]
    admit_all(admission, requests)
    for request in requests:
        batcher.submit(request)
    requests[2].cancel()
    batcher.step()
    assert admission.num_queued == 1
    batcher.step()  # the cancelled one is dropped
    assert (admission.num_queued, admission.num_queued_tokens) == (0, 0)
