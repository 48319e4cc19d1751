"""DynamicBatcher with a fake clock and a fake runner: batch closing, failures, cancellation, stats."""

from __future__ import annotations

import pytest
import torch

from buckets.dynamic import DynamicBatcher
from buckets.errors import BatchFailedError, ShuttingDownError
from buckets.request import EmbeddingEvent, EmbeddingRequest, ErrorEvent
from buckets.settings import DynamicBatcherSettings
from tests.factories import FakeClock, events_of, make_requests

DIM = 3


class FakeRunner:
    """Embeds each input as ``[first token id, length, row index]``; pads to the longest input.

    Records the inputs of each call; raises while ``fail_next`` is set.
    """

    def __init__(self) -> None:
        self.calls: list[list[list[int]]] = []
        self.fail_next = False

    @property
    def batch_sizes(self) -> list[int]:
        return [len(call) for call in self.calls]

    def embed(self, batch_token_ids: list[list[int]]) -> tuple[torch.Tensor, int]:
        self.calls.append(batch_token_ids)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device on fire")
        rows = [[float(ids[0]), float(len(ids)), float(i)] for i, ids in enumerate(batch_token_ids)]
        longest = max(len(ids) for ids in batch_token_ids)
        num_padding = sum(longest - len(ids) for ids in batch_token_ids)
        return torch.tensor(rows), num_padding


def make_batcher(
    max_batch_size: int = 4, max_queue_delay_ms: float = 5.0, now: float = 0.0
) -> tuple[DynamicBatcher, FakeRunner, FakeClock]:
    clock = FakeClock(now)
    runner = FakeRunner()
    settings = DynamicBatcherSettings(max_batch_size=max_batch_size, max_queue_delay_ms=max_queue_delay_ms)
    return DynamicBatcher(runner, settings, clock=clock), runner, clock


def submit_all(batcher: DynamicBatcher, requests: list[EmbeddingRequest]) -> None:
    for request in requests:
        batcher.submit(request)


def test_empty_batcher_has_no_work() -> None:
    batcher, runner, clock = make_batcher()
    assert batcher.seconds_until_ready(clock()) is None
    batcher.step()
    assert runner.calls == []


def test_full_batch_leaves_without_waiting() -> None:
    batcher, runner, clock = make_batcher(max_batch_size=4, max_queue_delay_ms=1000)
    requests = make_requests(4)
    submit_all(batcher, requests)
    assert batcher.seconds_until_ready(clock()) == 0.0
    batcher.step()
    assert runner.batch_sizes == [4]
    for request in requests:
        (event,) = events_of(request)
        assert isinstance(event, EmbeddingEvent)
        assert event.num_prompt_tokens == request.num_prompt_tokens
        assert event.embedding[0] == request.prompt_token_ids[0]  # each request gets its own row


def test_more_than_max_batch_size_splits_in_arrival_order() -> None:
    batcher, runner, clock = make_batcher(max_batch_size=3, max_queue_delay_ms=1000)
    requests = make_requests(5)
    submit_all(batcher, requests)
    batcher.step()
    assert runner.batch_sizes == [3]
    assert [ids[0] for ids in runner.calls[0]] == [1, 2, 3]
    # Two are left: not a full batch, so they wait for the delay.
    assert batcher.seconds_until_ready(clock()) == pytest.approx(1.0)
    clock.advance(1.0)
    assert batcher.seconds_until_ready(clock()) == 0.0
    batcher.step()
    assert runner.batch_sizes == [3, 2]
    assert [ids[0] for ids in runner.calls[1]] == [4, 5]


def test_partial_batch_waits_for_the_delay_then_leaves_whole() -> None:
    batcher, runner, clock = make_batcher(max_batch_size=8, max_queue_delay_ms=5, now=100.0)
    first, second, third = make_requests(3)
    batcher.submit(first)
    assert batcher.seconds_until_ready(clock()) == pytest.approx(0.005)
    clock.advance(0.002)
    batcher.submit(second)
    # The wait counts from the oldest request, not the newest.
    assert batcher.seconds_until_ready(clock()) == pytest.approx(0.003)
    clock.advance(0.002)
    batcher.submit(third)
    assert batcher.seconds_until_ready(clock()) == pytest.approx(0.001)
    assert runner.calls == []
    clock.advance(0.0011)
    assert batcher.seconds_until_ready(clock()) == 0.0
    batcher.step()
    assert runner.batch_sizes == [3]
    assert all(isinstance(events_of(r)[0], EmbeddingEvent) for r in (first, second, third))
    assert batcher.seconds_until_ready(clock()) is None


def test_zero_delay_leaves_at_once() -> None:
    batcher, runner, clock = make_batcher(max_batch_size=8, max_queue_delay_ms=0)
    submit_all(batcher, make_requests(1))
    assert batcher.seconds_until_ready(clock()) == 0.0


def test_timeline_and_batch_positions_are_recorded() -> None:
    batcher, runner, clock = make_batcher(max_batch_size=2, now=7.0)
    requests = make_requests(2)
    submit_all(batcher, requests)
    clock.advance(0.5)
    batcher.step()
    for index, request in enumerate(requests):
        assert request.timeline["enqueued"] == 7.0
        assert request.timeline["finished"] == 7.5
        assert request.batches == [(0, index)]
        (event,) = events_of(request)
        assert isinstance(event, EmbeddingEvent)
    assert batcher.stats().num_finished == 2


def test_cancelled_requests_are_skipped() -> None:
    batcher, runner, clock = make_batcher(max_batch_size=3, max_queue_delay_ms=1000)
    requests = make_requests(4)
    submit_all(batcher, requests)
    requests[1].cancel()
    batcher.step()
    # The cancelled one is dropped and the next one fills its place.
    assert [ids[0] for ids in runner.calls[0]] == [1, 3, 4]
    assert events_of(requests[1]) == []
    assert batcher.stats().num_cancelled == 1


def test_all_cancelled_means_no_forward() -> None:
    batcher, runner, clock = make_batcher(max_batch_size=2)
    requests = make_requests(2)
    submit_all(batcher, requests)
    for request in requests:
        request.cancel()
    batcher.step()
    assert runner.calls == []
    assert batcher.stats().num_cancelled == 2
    assert batcher.seconds_until_ready(clock()) is None


def test_failed_batch_fails_every_request_and_the_next_batch_works() -> None:
    batcher, runner, clock = make_batcher(max_batch_size=2)
    failed = make_requests(2)
    submit_all(batcher, failed)
    runner.fail_next = True
    batcher.step()
    for request in failed:
        (event,) = events_of(request)
        assert isinstance(event, ErrorEvent)
        assert isinstance(event.error, BatchFailedError)
        assert "device on fire" in str(event.error)
    assert batcher.stats().num_failed == 2
    ok = make_requests(2, start_token=10)
    submit_all(batcher, ok)
    batcher.step()
    assert all(isinstance(events_of(r)[0], EmbeddingEvent) for r in ok)
    stats = batcher.stats()
    assert stats.num_failed == 2
    assert stats.num_finished == 2
    assert stats.num_steps == 1  # only successful forwards are counted as steps


def test_stats_count_steps_batch_sizes_and_padding() -> None:
    batcher, runner, clock = make_batcher(max_batch_size=3, max_queue_delay_ms=10)
    # lengths 2, 3, 4: padding to 4 costs 2 + 1 + 0 = 3 tokens
    submit_all(batcher, make_requests(3, length=2))
    batcher.step()
    submit_all(batcher, make_requests(1, start_token=50, length=5))
    clock.advance(0.010)
    batcher.step()
    stats = batcher.stats()
    assert stats.kind == "dynamic"
    assert stats.num_steps == 2
    assert stats.max_batch_seqs == 3
    assert stats.num_multi_seq_steps == 1
    assert stats.num_batch_seqs_total == 4
    assert stats.mean_batch_seqs == pytest.approx(2.0)
    assert stats.num_padding_tokens == 3
    assert stats.num_batched_tokens == (2 + 3 + 4 + 3) + 5
    assert stats.num_finished == 4
    assert stats.num_waiting == 0 and stats.num_running == 0


def test_stats_count_waiting_requests() -> None:
    batcher, runner, clock = make_batcher(max_batch_size=8)
    submit_all(batcher, make_requests(3))
    assert batcher.stats().num_waiting == 3


def test_shutdown_fails_queued_requests() -> None:
    batcher, runner, clock = make_batcher(max_batch_size=8)
    requests = make_requests(2)
    submit_all(batcher, requests)
    batcher.shutdown()
    for request in requests:
        (event,) = events_of(request)
        assert isinstance(event, ErrorEvent) and isinstance(event.error, ShuttingDownError)
    assert runner.calls == []
    assert batcher.seconds_until_ready(clock()) is None


def test_an_idle_batcher_remembers_no_tenants_counter() -> None:
    # VirtualTokenCounter drops every counter once no tenant is active; a request charged after it
    # left the queue would be remembered by an idle bucket (and lifted on its tenant's return).
    batcher, runner, _ = make_batcher(max_batch_size=4, max_queue_delay_ms=0.0)
    requests = make_requests(3)
    for request, tenant in zip(requests, ("a", "b", "a")):
        request.tenant = tenant
    submit_all(batcher, requests)
    batcher.step()
    assert runner.batch_sizes == [3]
    assert batcher.fair.num_remembered == 0
