"""The replica routing policy (policies/replica_routing.py) with plain numbers: two choices on
load, load counted between pushes, prefix affinity and its bounds."""

from __future__ import annotations

import random
import statistics

import pytest

from policies.replica_routing import ReplicaLoad, ReplicaRouter, RoutingSettings

REPLICAS = ["r0", "r1", "r2", "r3"]


def router(**settings: object) -> ReplicaRouter:
    return ReplicaRouter(RoutingSettings(**settings), random.Random(7))  # type: ignore[arg-type]


def test_of_two_replicas_the_less_loaded_serves() -> None:
    routing = router()
    routing.update_load("a", ReplicaLoad(queued_prompt_tokens=900, running_seqs=2))
    routing.update_load("b", ReplicaLoad(queued_prompt_tokens=100, running_seqs=10))
    assert routing.load_tokens("a") == 900 + 2 * 64 and routing.load_tokens("b") == 100 + 10 * 64
    assert {routing.pick(["a", "b"], [], 10) for _ in range(5)} == {"b"}


def test_a_burst_between_pushes_spreads_over_the_replicas() -> None:
    routing = router()
    for replica in REPLICAS:
        routing.update_load(replica, ReplicaLoad(0, 0))
    counts = {r: 0 for r in REPLICAS}
    for _ in range(40):  # no push in between: only what the router sent counts
        counts[routing.pick(REPLICAS, [], 200)] += 1
    assert min(counts.values()) >= 5, counts


def test_under_steady_load_every_replica_serves_within_a_quarter_of_the_mean() -> None:
    routing = router()
    outstanding = {r: [] for r in REPLICAS}  # prompt tokens of the requests each replica holds
    rng = random.Random(3)
    served = {r: 0 for r in REPLICAS}
    for step in range(200):
        replica = routing.pick(REPLICAS, [], tokens := rng.randint(50, 500))
        served[replica] += 1
        outstanding[replica].append(tokens)
        for r in REPLICAS:  # each replica finishes its oldest request every 4 steps, then pushes
            if step % 4 == REPLICAS.index(r) % 4 and outstanding[r]:
                outstanding[r].pop(0)
            routing.update_load(r, ReplicaLoad(sum(outstanding[r]), len(outstanding[r])))
    mean = statistics.mean(served.values())
    assert all(abs(count - mean) <= 0.25 * mean for count in served.values()), served


def test_requests_sharing_a_long_prefix_go_to_the_replica_that_holds_it() -> None:
    routing = router(min_prefix_blocks=4)
    shared = list(range(100, 108))
    first = routing.pick(REPLICAS, shared, 128)
    for i in range(20):
        for replica in REPLICAS:  # each request is served before the next comes
            routing.update_load(replica, ReplicaLoad(0, 0))
        assert routing.pick(REPLICAS, [*shared, 1000 + i], 144) == first
    assert routing.matched_blocks(first, [*shared, 5]) == len(shared)


def test_a_short_shared_prefix_does_not_pin_requests() -> None:
    routing = router(min_prefix_blocks=4)
    chosen = {routing.pick(REPLICAS, [1, 2, 2000 + i], 48) for i in range(40)}
    assert len(chosen) > 1


def test_an_overloaded_holder_loses_the_prefix_to_the_two_choices() -> None:
    routing = router(min_prefix_blocks=2, max_affinity_load_ratio=2.0, affinity_slack_tokens=100)
    shared = [11, 12, 13]
    holder = routing.pick(["a", "b"], shared, 48)
    other = "b" if holder == "a" else "a"
    routing.update_load(holder, ReplicaLoad(queued_prompt_tokens=5000, running_seqs=0))
    routing.update_load(other, ReplicaLoad(queued_prompt_tokens=1000, running_seqs=0))
    assert routing.pick(["a", "b"], shared, 48) == other  # 5000 > 2 * 1000 + 100
    routing.update_load(holder, ReplicaLoad(queued_prompt_tokens=2000, running_seqs=0))
    routing.update_load(other, ReplicaLoad(queued_prompt_tokens=1000, running_seqs=0))
    assert routing.pick(["a", "b"], shared, 48) in {"a", "b"}
    assert routing.matched_blocks(holder, shared) == 3  # both hold it now


def test_of_two_holders_the_longer_run_wins() -> None:
    routing = router(min_prefix_blocks=2)
    routing.pick(["a"], [1, 2], 32)  # a holds two blocks
    routing.pick(["b"], [1, 2, 3, 4], 64)  # b holds four
    routing.update_load("a", ReplicaLoad(0, 0))
    routing.update_load("b", ReplicaLoad(300, 0))
    assert routing.pick(["a", "b"], [1, 2, 3, 4, 5], 80) == "b"


def test_a_gone_replica_is_forgotten_and_never_picked() -> None:
    routing = router(min_prefix_blocks=1)
    routing.pick(["a"], [1, 2, 3], 48)
    routing.forget("a")
    assert routing.matched_blocks("a", [1, 2, 3]) == 0
    assert routing.pick(["b", "c"], [1, 2, 3], 48) in {"b", "c"}


def test_the_prefix_index_keeps_its_bounds() -> None:
    routing = router(prefix_index_blocks=10, max_owners_per_block=2)
    for i in range(30):
        routing.pick(REPLICAS, [i], 16)
    assert len(routing._prefix_owners) == 10 and min(routing._prefix_owners) == 20
    for replica in REPLICAS:
        routing.pick([replica], [99], 16)
    assert routing._prefix_owners[99] == ["r3", "r2"]


def test_no_replica_is_an_error() -> None:
    with pytest.raises(ValueError, match="no replica"):
        router().pick([], [], 1)
