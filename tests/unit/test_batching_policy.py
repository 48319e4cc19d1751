"""policies.batching: when a dynamic batch leaves (full, or the oldest has waited long enough)."""

from __future__ import annotations

import pytest

from policies.batching import seconds_until_batch_closes


@pytest.mark.parametrize("num_queued", [0, -1])
def test_nothing_queued_means_no_work(num_queued: int) -> None:
    assert seconds_until_batch_closes(num_queued, 0.0, max_batch_size=4, max_queue_delay_s=0.01) is None


@pytest.mark.parametrize("num_queued", [4, 5, 100])
def test_a_full_batch_leaves_at_once(num_queued: int) -> None:
    assert seconds_until_batch_closes(num_queued, 0.0, max_batch_size=4, max_queue_delay_s=10.0) == 0.0


def test_a_partial_batch_waits_the_rest_of_the_delay() -> None:
    wait = seconds_until_batch_closes(2, 0.25, max_batch_size=4, max_queue_delay_s=1.0)
    assert wait == pytest.approx(0.75)


@pytest.mark.parametrize("oldest_wait_s", [1.0, 1.5])
def test_a_partial_batch_leaves_once_the_delay_has_passed(oldest_wait_s: float) -> None:
    assert seconds_until_batch_closes(1, oldest_wait_s, max_batch_size=4, max_queue_delay_s=1.0) == 0.0


def test_zero_delay_never_waits() -> None:
    assert seconds_until_batch_closes(1, 0.0, max_batch_size=32, max_queue_delay_s=0.0) == 0.0


def test_batch_size_one_never_waits() -> None:
    assert seconds_until_batch_closes(1, 0.0, max_batch_size=1, max_queue_delay_s=5.0) == 0.0


def test_wait_shrinks_as_the_oldest_request_ages() -> None:
    waits = [seconds_until_batch_closes(1, age, 8, 0.5) for age in (0.0, 0.1, 0.2, 0.4)]
    assert all(w is not None and w > 0 for w in waits)
    assert waits == sorted(waits, reverse=True)
