"""A rebuilt bucket (a backend switch, a new layout keeping the name) carries the cumulative
counters of the builds it replaced over, while its queue and KV pool figures are its own; after
the old build leaves its slice, the counters it kept stay counted."""

from __future__ import annotations

from dataclasses import replace

from buckets.bucket import Bucket
from buckets.request import Request
from buckets.settings import DynamicBatcherSettings
from buckets.slices.slice import BucketSpec
from buckets.slices.thread import ThreadSlice
from buckets.stats import BucketStats, carry_over

ZERO = BucketStats(
    kind="continuous", num_waiting=0, num_running=0, num_steps=0, num_multi_seq_steps=0, max_batch_seqs=0,
    num_batch_seqs_total=0, num_batched_tokens=0, num_padding_tokens=0, num_finished=0, num_cancelled=0,
    num_failed=0, num_timed_out=0,
)


class StatsBatcher:
    """A batcher that never runs; :attr:`snapshot` is what it reports."""

    kind = "continuous"

    def __init__(self) -> None:
        self.snapshot = ZERO

    def submit(self, request: Request) -> None:
        raise AssertionError("not used")

    def seconds_until_ready(self, now: float) -> float | None:
        return None

    def step(self) -> None:
        raise AssertionError("never stepped")

    def stats(self) -> BucketStats:
        return self.snapshot

    def shutdown(self) -> None:
        pass


def _bucket(device_slice: ThreadSlice, layout_no: int) -> tuple[Bucket, StatsBatcher]:
    batcher = StatsBatcher()
    bucket = Bucket(name="le64", model_name="m", max_input_tokens=64, device_slice=device_slice, kind="continuous",
                    layout_no=layout_no)
    device_slice.attach(bucket.key, BucketSpec("continuous", DynamicBatcherSettings(1, 0.0), lambda: batcher))
    return bucket, batcher


def test_carry_over_sums_counters_keeps_the_largest_batch_and_the_current_pool() -> None:
    old = replace(ZERO, num_steps=10, num_finished=4, max_batch_seqs=8, prefix_cache_hits=3, num_rejected=2,
                  num_running=5, kv_blocks_total=100, kv_blocks_used=40)
    new = replace(ZERO, num_steps=1, num_finished=1, max_batch_seqs=2, prefix_cache_hits=1, num_rejected=1,
                  num_running=1, kv_blocks_total=50, kv_blocks_used=7)
    both = carry_over(old, new)
    assert (both.num_steps, both.num_finished, both.max_batch_seqs, both.prefix_cache_hits, both.num_rejected) == (11, 5, 8, 4, 3)
    assert (both.num_running, both.kv_blocks_total, both.kv_blocks_used) == (1, 50, 7)


def test_a_rebuilt_bucket_keeps_counting_from_its_predecessor_through_its_drain_and_after() -> None:
    device_slice = ThreadSlice("s", "cpu", num_threads=1)
    old, old_batcher = _bucket(device_slice, 0)
    old_batcher.snapshot = replace(ZERO, num_finished=7, num_steps=20, num_running=2)
    new, new_batcher = _bucket(device_slice, 1)
    new.predecessor = old
    new_batcher.snapshot = replace(ZERO, num_finished=1, num_steps=3)
    assert (new.stats().num_finished, new.stats().num_steps, new.stats().num_running) == (8, 23, 0)
    old_batcher.snapshot = replace(ZERO, num_finished=8, num_steps=22, num_running=1)  # still draining
    assert new.stats().num_finished == 9
    old.freeze_stats(num_failed=1)  # the one left fails as it leaves its slice
    device_slice.detach(old.key)
    stats = new.stats()
    assert (stats.num_finished, stats.num_steps, stats.num_failed, stats.num_running) == (9, 25, 1, 0)
    third, third_batcher = _bucket(device_slice, 2)
    third.predecessor = new  # a second rebuild carries both
    assert third.stats().num_finished == 9
