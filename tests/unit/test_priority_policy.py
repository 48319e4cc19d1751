"""policies.priority with plain values and a fake clock: order, aging, no starvation, arbiter fairness."""

from __future__ import annotations

import pytest

from policies.priority import AgingPriorityQueue, SliceArbiter, effective_priority, priority_key


def test_lower_priority_value_goes_first_then_arrival() -> None:
    queue: AgingPriorityQueue[str] = AgingPriorityQueue(aging_s=10.0)
    queue.push("late-normal", 0, arrival_s=2.0)
    queue.push("early-normal", 0, arrival_s=1.0)
    queue.push("urgent", -1, arrival_s=3.0)
    queue.push("background", 5, arrival_s=0.0)
    assert list(queue) == ["urgent", "early-normal", "late-normal", "background"]
    assert [queue.pop() for _ in range(len(queue))] == ["urgent", "early-normal", "late-normal", "background"]


def test_waiting_is_worth_one_level_per_aging_period() -> None:
    assert effective_priority(3, arrival_s=0.0, now_s=20.0, aging_s=10.0) == pytest.approx(1.0)
    queue: AgingPriorityQueue[str] = AgingPriorityQueue(aging_s=10.0)
    queue.push("old-low", 1, arrival_s=0.0)
    queue.push("new-high", 0, arrival_s=10.5)  # arrived more than one aging period later
    assert queue.peek() == "old-low"
    queue.push("newer-high", 0, arrival_s=9.5)  # within the period: still more urgent
    assert queue.peek() == "newer-high"


def test_equal_keys_keep_push_order_and_remove_works() -> None:
    queue: AgingPriorityQueue[list[str]] = AgingPriorityQueue(aging_s=1.0)
    a, b, c = ["a"], ["b"], ["c"]  # removal is by identity, as for queued sequences
    for item in (a, b, c):
        queue.push(item, 0, arrival_s=0.0)
    queue.remove(b)
    assert list(queue) == [a, c]
    with pytest.raises(ValueError):
        queue.remove(["b"])
    assert queue.peek_key() == priority_key(0, 0.0, 1.0)


def test_aging_must_be_positive() -> None:
    with pytest.raises(ValueError, match="aging_s"):
        AgingPriorityQueue(aging_s=0.0)


def test_no_starvation_under_a_steady_stream_of_urgent_requests() -> None:
    """One server taking one request per second; an urgent request arrives every second. A
    background request (priority 5) must be served within (5 - 0) * aging_s plus one drain."""
    aging_s = 4.0
    queue: AgingPriorityQueue[str] = AgingPriorityQueue(aging_s)
    queue.push("background", 5, arrival_s=0.0)
    served_at = None
    for second in range(200):
        queue.push(f"urgent-{second}", 0, arrival_s=float(second))
        if queue.pop() == "background":
            served_at = second
            break
    bound = (5 - 0) * aging_s + 1
    assert served_at is not None and served_at <= bound


def test_arbiter_picks_the_most_urgent_head() -> None:
    arbiter = SliceArbiter(max_consecutive_steps=100)
    assert arbiter.pick([None, None]) is None
    assert arbiter.pick([1.0, -2.0, 0.0]) == 1
    assert arbiter.pick([1.0, None, 0.0]) == 2
    assert arbiter.pick([0.0, None, 0.0]) == 0  # ties to the lower index


def test_arbiter_never_runs_one_bucket_more_than_the_cap_while_another_waits() -> None:
    arbiter = SliceArbiter(max_consecutive_steps=3)
    picks = [arbiter.pick([-10.0, 5.0]) for _ in range(12)]
    assert picks == [0, 0, 0, 1] * 3
    longest = max(len(run) for run in "".join(map(str, picks)).replace("1", " ").split())
    assert longest <= 3
    # Alone, a bucket runs as long as it has work.
    solo = SliceArbiter(max_consecutive_steps=2)
    assert [solo.pick([0.0, None]) for _ in range(5)] == [0] * 5


def test_arbiter_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_consecutive_steps"):
        SliceArbiter(0)
