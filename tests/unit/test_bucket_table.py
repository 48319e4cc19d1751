"""BucketTable routes a prompt length to the smallest bucket that holds it."""

from __future__ import annotations

import pytest

from buckets.bucket import Bucket, BucketTable
from buckets.request import Request
from buckets.settings import DynamicBatcherSettings
from buckets.slices.slice import BucketSpec
from buckets.slices.thread import ThreadSlice
from buckets.stats import BucketStats


class _DummyBatcher:
    """Satisfies the Batcher protocol; records what it was given and never runs anything."""

    kind = "dummy"

    def __init__(self) -> None:
        self.submitted: list[Request] = []

    def submit(self, request: Request) -> None:
        self.submitted.append(request)

    def seconds_until_ready(self, now: float) -> float | None:
        return None

    def step(self) -> None:
        raise AssertionError("a bucket table test never steps")

    def stats(self) -> BucketStats:
        raise AssertionError("not used")

    def shutdown(self) -> None:
        pass


def make_bucket(max_input_tokens: int, name: str | None = None, kv_capacity_tokens: int | None = None) -> Bucket:
    """A bucket on a thread slice (never started) whose batcher is a :class:`_DummyBatcher`
    (reach it with :func:`dummy_batcher`)."""
    bucket = Bucket(
        name=name or f"le{max_input_tokens}",
        model_name="m",
        max_input_tokens=max_input_tokens,
        device_slice=ThreadSlice("s", "cpu", num_threads=1),
        kind="dummy",
        kv_capacity_tokens=kv_capacity_tokens,
    )
    bucket.device_slice.attach(bucket.key, BucketSpec("dummy", DynamicBatcherSettings(1, 0.0), _DummyBatcher))
    return bucket


def dummy_batcher(bucket: Bucket) -> _DummyBatcher:
    """The dummy batcher of a bucket from :func:`make_bucket`."""
    batcher = bucket.device_slice._batchers[bucket.key]  # type: ignore[attr-defined]
    assert isinstance(batcher, _DummyBatcher)
    return batcher


def make_table(*limits: int) -> BucketTable:
    return BucketTable([make_bucket(limit) for limit in limits])


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [(1, 16), (15, 16), (16, 16), (17, 64), (64, 64), (65, 256), (256, 256)],
)
def test_pick_returns_smallest_bucket_holding_the_prompt(num_tokens: int, expected: int) -> None:
    table = make_table(16, 64, 256)
    bucket = table.pick(num_tokens)
    assert bucket is not None
    assert bucket.max_input_tokens == expected


def test_pick_returns_none_above_the_largest_limit() -> None:
    table = make_table(16, 64)
    assert table.pick(65) is None
    assert table.pick(10_000) is None


def test_buckets_are_sorted_by_limit_whatever_the_input_order() -> None:
    table = make_table(256, 16, 64)
    assert [b.max_input_tokens for b in table.buckets] == [16, 64, 256]
    assert table.max_input_tokens == 256
    picked = table.pick(20)
    assert picked is not None and picked.max_input_tokens == 64


def test_duplicate_limits_are_rejected() -> None:
    with pytest.raises(ValueError, match="differ"):
        make_table(64, 16, 64)


def test_empty_table_is_rejected() -> None:
    with pytest.raises(ValueError):
        BucketTable([])


def test_by_name_finds_a_bucket_or_none() -> None:
    table = BucketTable([make_bucket(16, "short"), make_bucket(64, "long")])
    found = table.by_name("long")
    assert found is not None and found.max_input_tokens == 64
    assert table.by_name("missing") is None


def test_submit_hands_the_request_to_the_batcher_and_tags_the_bucket() -> None:
    bucket = make_bucket(16)
    request = Request(request_id="r", prompt_token_ids=[1, 2], sink=lambda event: None)
    bucket.submit(request)
    assert dummy_batcher(bucket).submitted == [request]
    assert request.info["bucket"] == "le16"


def test_a_new_layout_may_reuse_a_bucket_name_on_the_same_slice() -> None:
    shared = ThreadSlice("s", "cpu", num_threads=1)  # never started
    old, new = (Bucket("le16", "m", 16, shared, "dummy", layout_no=n) for n in (0, 1))
    batchers = {0: _DummyBatcher(), 1: _DummyBatcher()}
    for bucket in (old, new):
        shared.attach(bucket.key, BucketSpec("dummy", DynamicBatcherSettings(1, 0.0), lambda n=bucket.layout_no: batchers[n]))
    assert old.key != new.key
    first, second = (Request(request_id=f"r{n}", prompt_token_ids=[1], sink=lambda event: None) for n in (0, 1))
    old.submit(first)
    new.submit(second)
    assert batchers[0].submitted == [first] and batchers[1].submitted == [second]
    shared.detach(old.key)  # the old layout drains away; the new one stays
    assert shared.backend_info(new.key) == {} and new.key in shared._batchers and old.key not in shared._batchers
