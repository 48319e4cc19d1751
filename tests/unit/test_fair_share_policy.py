"""policies/fair_share.py and the fair admission refusal, with plain numbers."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.admission import fair_refusal_reason, refusal_reason
from policies.fair_share import FairQueue, VirtualTokenCounter, fair_share_victim
from policies.priority import AgingPriorityQueue


def serve_backlogged(weights: dict[str, float], num_picks: int, seed: int = 0) -> dict[str, int]:
    """Tokens served to each always-backlogged tenant when a loop picks the queue's head, serves
    it 10-30 tokens and queues its next request (one priority)."""
    rng = random.Random(seed)
    counters = VirtualTokenCounter()
    queue = FairQueue[tuple[str, int]](10.0, counters)
    served = dict.fromkeys(weights, 0)
    for tenant, weight in weights.items():
        counters.activate(tenant, weight)
        queue.push((tenant, 0), 0, 0.0, tenant)
    for pick in range(1, num_picks + 1):
        tenant, _ = queue.pop()
        num_tokens = rng.randint(10, 30)
        counters.charge(tenant, num_tokens, weights[tenant])
        served[tenant] += num_tokens
        queue.push((tenant, pick), 0, float(pick), tenant)
    return served


def test_backlogged_tenants_get_tokens_in_proportion_to_their_weights() -> None:
    served = serve_backlogged({"a": 1.0, "b": 2.0}, 3000)
    assert served["b"] / served["a"] == pytest.approx(2.0, rel=0.03)


def test_a_returning_tenant_is_lifted_to_the_active_ones_and_gets_no_burst() -> None:
    counters = VirtualTokenCounter()
    counters.activate("a", 1.0)
    counters.activate("b", 1.0)
    counters.charge("a", 100, 1.0)
    counters.charge("b", 100, 1.0)
    counters.deactivate("b")  # b goes idle while a keeps being served
    assert counters.num_remembered == 1  # b's 100 <= a's: forgotten, it would be lifted anyway
    counters.charge("a", 900, 1.0)
    counters.activate("b", 1.0)
    assert counters.counter("b") == 1000.0  # not 100: idle time earned no credit
    counters.deactivate("a")
    counters.deactivate("b")
    assert counters.num_remembered == 0  # an idle bucket keeps nothing


def test_a_tenant_ahead_of_the_others_keeps_its_counter_while_away() -> None:
    counters = VirtualTokenCounter()
    counters.activate("a", 1.0)
    counters.activate("b", 1.0)
    counters.charge("b", 500, 1.0)
    counters.deactivate("b")
    counters.activate("b", 1.0)
    assert counters.counter("b") == 500.0  # max(own, smallest active)
    counters.charge("c", 10, 2.0)
    assert counters.counter("c") == 5.0  # tokens / weight


def test_a_non_positive_weight_is_refused() -> None:
    with pytest.raises(ValueError, match="tenant_weight"):
        VirtualTokenCounter().activate("a", 0.0)


def test_a_more_urgent_band_goes_first_whatever_the_counters() -> None:
    counters = VirtualTokenCounter()
    queue = FairQueue[str](10.0, counters)
    for tenant in ("a", "b"):
        counters.activate(tenant, 1.0)
    counters.charge("a", 1000, 1.0)
    queue.push("b-low", 1, 0.0, "b")
    queue.push("a-urgent", 0, 1.0, "a")
    assert [queue.pop(), queue.pop()] == ["a-urgent", "b-low"]


def test_aging_lets_an_old_low_priority_band_overtake_as_today() -> None:
    queue = FairQueue[str](10.0, VirtualTokenCounter())
    queue.push("old-low", 2, 0.0, "a")  # key 2.0
    queue.push("new-urgent", 0, 25.0, "b")  # key 2.5: 25 s later is worth less than 2 levels
    queue.push("newer-urgent", 0, 15.0, "b")  # key 1.5
    assert [queue.pop(), queue.pop(), queue.pop()] == ["newer-urgent", "old-low", "new-urgent"]
    assert queue.peek_key() is None


def test_within_a_band_the_smallest_counter_goes_then_the_oldest_of_that_tenant() -> None:
    counters = VirtualTokenCounter()
    queue = FairQueue[str](10.0, counters)
    for tenant in ("a", "b"):
        counters.activate(tenant, 1.0)
    queue.push("a0", 0, 0.0, "a")
    queue.push("a1", 0, 1.0, "a")
    queue.push("b0", 0, 2.0, "b")
    assert queue.peek() == "a0"  # equal counters: the older head
    counters.charge("a", 10, 1.0)
    assert queue.peek() == "b0"
    assert queue.peek_key() == pytest.approx(0.0)  # the oldest waiting, whatever goes next
    queue.remove("b0")
    assert list(queue) == ["a0", "a1"]


def test_starved_is_the_item_idle_longest_before_the_threshold() -> None:
    queue = FairQueue[str](10.0)
    queue.push("x", 0, 0.0, progress_s=3.0)
    queue.push("y", 5, 1.0, progress_s=2.0)
    assert queue.starved(2.0) is None  # before, strictly
    assert queue.starved(2.5) == "y"
    queue.remove("y")
    assert queue.starved(2.5) is None
    assert queue.starved(10.0) == "x"


ops = st.lists(
    st.tuples(st.sampled_from(["push", "pop", "remove"]), st.integers(-2, 2), st.floats(0, 100), st.sampled_from("abc")),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.booleans())
def test_with_fair_share_off_or_one_tenant_the_order_is_aging_priority_queues(
    operations: list[tuple[str, int, float, str]], one_tenant: bool
) -> None:
    old = AgingPriorityQueue[int](10.0)
    new = FairQueue[int](10.0, VirtualTokenCounter() if one_tenant else None)
    queued: list[int] = []
    for number, (op, priority, arrival_s, tenant) in enumerate(operations):
        if op == "push" or not queued:
            old.push(number, priority, arrival_s)
            new.push(number, priority, arrival_s, "t" if one_tenant else tenant)
            queued.append(number)
        elif op == "pop":
            assert new.peek_key() == old.peek_key()
            popped = old.pop()
            assert new.pop() == popped
            queued.remove(popped)
        else:
            item = queued.pop(priority % len(queued))
            old.remove(item)
            new.remove(item)
        assert len(new) == len(old)
    assert [new.pop() for _ in range(len(new))] == [old.pop() for _ in range(len(old))]


def test_fair_share_victim_takes_from_the_tenant_furthest_over_its_share() -> None:
    weights = {"a": 1.0, "b": 1.0, "c": 2.0}  # shares of 8: 2, 2, 4
    seats = [("a", 1)] * 5 + [("c", 3)]
    assert fair_share_victim("b", seats, weights, 8, ["a", "c"]) == "a"
    assert fair_share_victim("b", seats, weights, 8, ["c"]) is None  # c holds 3 < 4 + 1
    assert fair_share_victim("a", seats, weights, 8, ["c"]) is None  # a is over its share
    assert fair_share_victim("d", seats, weights, 8, ["a"]) is None  # not active


def test_fair_share_victim_leaves_fractional_shares_alone() -> None:
    weights = dict.fromkeys("abc", 1.0)  # 8 / 3 = 2.67 each
    seats = [("a", 3), ("b", 3), ("c", 2)]
    assert all(fair_share_victim(t, seats, weights, 8, list("abc")) is None for t in "abc")
    assert fair_share_victim("c", [("a", 4), ("b", 2), ("c", 2)], weights, 8, list("abc")) is None


def test_a_full_queue_refuses_the_tenant_over_its_share_and_admits_the_quiet_one() -> None:
    # max_queue_len 8, all 8 queued by a; b (same weight) has nothing queued.
    full = (8, 80, 10, 8, None, 1)
    assert fair_refusal_reason(*full, (8, 80), 1.0, [1.0]) is not None  # a
    assert fair_refusal_reason(*full, (0, 0), 1.0, [1.0]) is None  # b
    # Both queued: b, at 2 of its share 4 (weight 1 of 2 tenants), still gets in.
    full = (10, 100, 10, 8, None, 1)
    assert fair_refusal_reason(*full, (2, 20), 1.0, [1.0]) is None
    reason = fair_refusal_reason(*full, (8, 80), 1.0, [1.0])
    assert reason is not None and "max_queue_len 8" in reason and "share 4.0" in reason
    # Tokens: a holds 90 of 100 (share 50 of the two).
    assert fair_refusal_reason(9, 90, 20, 100, 100, 1, (8, 90), 1.0, [1.0]) is not None


def test_with_one_tenant_the_fair_refusal_is_the_plain_one() -> None:
    for limits in [(4, 40, 10, 4, None, 1), (8, 90, 20, 10, 100, 1), (8, 10, 1, 10, None, 3), (2, 2, 1, 10, None, 1)]:
        plain = refusal_reason(*limits)
        fair = fair_refusal_reason(*limits, (limits[0], limits[1]), 1.0, [])
        assert (plain is None) == (fair is None)


def test_starved_with_less_urgent_than_skips_the_more_urgent_ones() -> None:
    queue: FairQueue[str] = FairQueue(aging_s=10.0)
    queue.push("urgent-old", 0, arrival_s=0.0)
    queue.push("low-old", 5, arrival_s=1.0)
    queue.push("low-new", 5, arrival_s=8.0)
    assert queue.starved(5.0) == "urgent-old"
    assert queue.starved(5.0, less_urgent_than=0) == "low-old"
    assert queue.starved(5.0, less_urgent_than=5) is None
    assert queue.starved(0.5, less_urgent_than=0) is None


def test_under_share_tenants_go_first_in_their_band_whatever_their_counters() -> None:
    from policies.fair_share import under_share_tenants

    weights = {"a": 1.0, "b": 1.0}
    assert under_share_tenants([("a", 1)] * 5 + [("b", 1)] * 3, weights, 8) == frozenset({"b"})
    assert under_share_tenants([("a", 1)] * 4 + [("b", 1)] * 4, weights, 8) == frozenset()
    assert under_share_tenants([("a", 1)] * 3, {"a": 1.0}, 8) == frozenset()  # one tenant: nothing to share
    counters = VirtualTokenCounter()
    queue: FairQueue[str] = FairQueue(aging_s=10.0, counters=counters)
    for tenant, item in (("a", "a0"), ("b", "b0")):
        counters.activate(tenant, 1.0)
        queue.push(item, 0, arrival_s=0.0, tenant=tenant)
    counters.charge("b", 50, 1.0)  # b is ahead in tokens
    assert queue.peek() == "a0"
    assert queue.peek(frozenset({"b"})) == "b0"  # but under its share of seats
