"""A bucket (a length range of one model with its own batcher) and a model's table of them.

Shape bucketing: requests of similar length batch together, so little is wasted on padding
and a short request never waits behind a long prefill in the same queue.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any

from buckets.admission import AdmissionControl
from buckets.errors import BucketClosedError
from buckets.request import Request
from buckets.slices.slice import BatcherSettings, BucketKey, Slice
from buckets.stats import BatchObserver, BucketStats, carry_over


@dataclass
class Bucket:
    """Requests of one model whose prompts hold at most ``max_input_tokens`` tokens
    (and more than the previous bucket's limit), run by a ``kind`` batcher (``continuous`` or
    ``dynamic``) on ``device_slice``, which hosts it under :attr:`key`: the bucket is the handle
    ``(slice, key)`` whatever the slice's kind, and asks the slice for everything about its
    batcher. ``kv_capacity_tokens`` bounds prompt + ``max_tokens`` of one request (a continuous
    bucket's whole KV pool, :func:`gateway.memory.kv_capacity_tokens`); ``None``: no such bound.
    ``max_queue_len`` and ``max_queued_tokens`` (``None``: unlimited) bound the requests submitted
    and not yet started, and their prompt tokens (:class:`AdmissionControl`). ``predecessor`` is
    the bucket of the same name this one replaced (a rebuild, a new layout), whose cumulative
    counters :meth:`stats` carries over."""

    name: str
    model_name: str
    max_input_tokens: int
    device_slice: Slice
    kind: str
    kv_capacity_tokens: int | None = None
    max_queue_len: int = 1024
    max_queued_tokens: int | None = None
    layout_no: int = 0  # which bucket layout of its model it belongs to (a reconfiguration adds one)
    fair_share: bool = False  # a full queue refuses the tenant over its weighted share first
    predecessor: Bucket | None = field(default=None, repr=False)
    admission: AdmissionControl = field(init=False, repr=False)
    _final_stats: BucketStats | None = field(default=None, init=False, repr=False)
    closed: bool = field(default=False, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.admission = AdmissionControl(self.max_queue_len, self.max_queued_tokens, fair_share=self.fair_share)

    @property
    def key(self) -> BucketKey:
        """The bucket's name on its slice: ``(model name, bucket name, layout number)``."""
        return (self.model_name, self.name, self.layout_no)

    @property
    def backend_info(self) -> dict[str, Any]:
        """How its forward runs: ``{"configured", "running", "gate" (a gate record in brief) ...}``."""
        return self.device_slice.backend_info(self.key)

    def close(self) -> None:
        """Take no new requests (a new layout replaced this bucket); those admitted run on."""
        with self._lock:
            self.closed = True

    def is_idle(self) -> bool:
        """Nothing queued (admission tickets included) or running."""
        stats = self.device_slice.stats(self.key)
        return not (stats.num_waiting or stats.num_running or self.admission.num_queued)

    def set_queue_limits(self, max_queue_len: int, max_queued_tokens: int | None, fair_share: bool | None = None) -> None:
        """New admission limits (and fair share, ``None``: unchanged), for the next request on
        (requests already queued stay)."""
        self.admission.set_limits(max_queue_len, max_queued_tokens, fair_share)
        self.fair_share = self.fair_share if fair_share is None else fair_share
        self.max_queue_len, self.max_queued_tokens = max_queue_len, max_queued_tokens

    def update_settings(self, settings: BatcherSettings) -> None:
        """New batcher settings, from its next step or batch on.

        Raises:
            ValueError: a setting fixed for the bucket's life differs (``block_size``).
        """
        self.device_slice.update_settings(self.key, settings)

    def add_batch_observer(self, observer: BatchObserver) -> None:
        """Call ``observer(num_seqs, num_tokens, num_padding_tokens)`` after each of its forwards."""
        self.device_slice.add_batch_observer(self.key, observer)

    def submit(self, request: Request) -> None:
        """Queue a request on this bucket's slice, which wakes its worker (thread-safe).

        Raises:
            QueueFullError: the queue is at ``max_queue_len`` or ``max_queued_tokens``; nothing queued.
            DeadlineUnmeetableError: (a ``QueueFullError``) the queue's expected wait is past the
                request's deadline; nothing queued.
            BucketClosedError: the bucket was replaced; nothing queued.
            SliceUnavailableError: its slice's worker is (re)starting; nothing queued.
        """
        timeout_s = None if request.deadline_s is None else request.deadline_s - self.admission.clock()
        with self._lock:  # a close() either sees this ticket counted or this submit sees it closed
            if self.closed:
                raise BucketClosedError(f"bucket {self.name!r} of {self.model_name!r} was replaced")
            ticket = self.admission.admit(
                request.num_prompt_tokens, timeout_s, request.num_seqs, request.tenant, request.tenant_weight
            )
        request.info["bucket"] = self.name
        request.on_dequeue = ticket.release
        try:
            self.device_slice.submit(self.key, request)
        except BaseException:
            ticket.release()
            raise

    def stats(self) -> BucketStats:
        """Its snapshot, with the cumulative counters of its predecessors carried over
        (:func:`buckets.stats.carry_over`); once it has left its slice, the one :meth:`freeze_stats` kept."""
        if self._final_stats is not None:
            return self._final_stats
        try:
            own = replace(self.device_slice.stats(self.key), num_rejected=self.admission.num_rejected)
        except KeyError:  # taken off its slice since the check above
            if self._final_stats is None:
                raise
            return self._final_stats
        predecessor = self.predecessor
        return own if predecessor is None else carry_over(predecessor.stats(), own)

    def freeze_stats(self, num_failed: int = 0) -> None:
        """Keep its stats as they are, plus ``num_failed`` requests about to fail, before it leaves
        its slice: a bucket that replaced it goes on reading them (its predecessors' included)."""
        final = self.stats()
        self._final_stats = replace(final, num_failed=final.num_failed + num_failed, num_waiting=0, num_running=0)
        self.predecessor = None


class BucketTable:
    """A model's buckets ordered by ``max_input_tokens``; :meth:`pick` routes by prompt length.

    Raises:
        ValueError: no buckets, or two buckets with the same limit.
    """

    def __init__(self, buckets: list[Bucket]):
        if not buckets:
            raise ValueError("a bucket table needs at least one bucket")
        self.buckets = sorted(buckets, key=lambda b: b.max_input_tokens)
        limits = [b.max_input_tokens for b in self.buckets]
        if len(set(limits)) != len(limits):
            raise ValueError(f"bucket limits must differ, got {limits}")

    @property
    def max_input_tokens(self) -> int:
        return self.buckets[-1].max_input_tokens

    def pick(self, num_tokens: int) -> Bucket | None:
        """The smallest bucket whose ``max_input_tokens`` holds ``num_tokens``; ``None`` if none does."""
        for bucket in self.buckets:
            if num_tokens <= bucket.max_input_tokens:
                return bucket
        return None

    def by_name(self, name: str) -> Bucket | None:
        return next((b for b in self.buckets if b.name == name), None)
