"""policies/eviction.py with plain numbers: LRU order, idle before busy, pins, scopes, idle-out."""

from __future__ import annotations

from policies.eviction import ResidentModel, choose_victims, eviction_order, idled_out

GB = 1_000_000_000


def model(name: str, last_used_s: float, num_gb: int = 1, pinned: bool = False, busy: bool = False, **scopes: int) -> ResidentModel:
    return ResidentModel(
        name=name, bytes_by_scope={"gateway": num_gb * GB, **scopes}, last_used_s=last_used_s, is_pinned=pinned, is_busy=busy
    )


def test_nothing_is_evicted_when_the_model_fits() -> None:
    assert choose_victims([model("a", 1.0)], {"gateway": GB}, {"gateway": GB}) == []


def test_the_least_recently_used_go_first_and_only_as_many_as_needed() -> None:
    resident = [model("a", 3.0), model("b", 1.0), model("c", 2.0)]
    assert choose_victims(resident, {"gateway": 2 * GB}, {"gateway": 0}) == ["b", "c"]
    assert choose_victims(resident, {"gateway": GB}, {"gateway": 0}) == ["b"]


def test_idle_models_go_before_busy_ones_whatever_their_age() -> None:
    resident = [model("old-busy", 1.0, busy=True), model("new-idle", 9.0)]
    assert [m.name for m in eviction_order(resident)] == ["new-idle", "old-busy"]
    assert choose_victims(resident, {"gateway": 2 * GB}, {"gateway": 0}) == ["new-idle", "old-busy"]


def test_a_pinned_model_is_never_a_victim() -> None:
    resident = [model("pinned", 0.0, pinned=True), model("b", 5.0)]
    assert choose_victims(resident, {"gateway": GB}, {"gateway": 0}) == ["b"]
    assert choose_victims(resident, {"gateway": 2 * GB}, {"gateway": 0}) is None


def test_a_slice_scope_short_takes_only_models_on_that_slice() -> None:
    resident = [
        model("other-slice", 0.0, **{"slice:b": GB}),
        model("same-slice", 5.0, **{"slice:a": GB}),
    ]
    needed = {"gateway": GB, "slice:a": GB}
    # The gateway has room; slice a does not: the older model elsewhere frees nothing there.
    assert choose_victims(resident, needed, {"gateway": 10 * GB, "slice:a": 0}) == ["same-slice"]


def test_a_scope_without_a_budget_never_asks_for_victims() -> None:
    assert choose_victims([model("a", 0.0)], {"gateway": GB, "slice:x": 50 * GB}, {"gateway": GB}) == []


def test_idled_out_lists_idle_unpinned_models_past_their_limit() -> None:
    resident = [model("a", 0.0), model("b", 0.0, busy=True), model("c", 0.0, pinned=True), model("d", 8.0)]
    limits = {"a": 5.0, "b": 5.0, "c": 5.0, "d": 5.0}
    assert idled_out(resident, limits, now_s=10.0) == ["a"]
    assert idled_out(resident, limits, now_s=4.0) == []
    assert idled_out(resident, {}, now_s=100.0) == []
