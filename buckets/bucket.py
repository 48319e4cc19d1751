"""A bucket (a length range of one model with its own batcher) and a model's table of them.

Shape bucketing: requests of similar length batch together, so little is wasted on padding
and a short request never waits behind a long prefill in the same queue.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any

from buckets.admission import AdmissionControl
from buckets.batcher import Batcher
from buckets.device_slice import DeviceSlice
from buckets.process_slice import ProcessSlice
from buckets.errors import BucketClosedError
from buckets.request import Request
from buckets.stats import BucketStats


@dataclass
class Bucket:
    """Requests of one model whose prompts hold at most ``max_input_tokens`` tokens
    (and more than the previous bucket's limit). ``max_seq_tokens`` bounds prompt + ``max_tokens``
    of one request (a continuous bucket's whole KV pool); ``None``: no such bound.
    ``max_queue_len`` and ``max_queued_tokens`` (``None``: unlimited) bound the requests submitted
    and not yet started, and their prompt tokens (:class:`AdmissionControl`)."""

    name: str
    model_name: str
    max_input_tokens: int
    batcher: Batcher
    device_slice: DeviceSlice | ProcessSlice
    max_seq_tokens: int | None = None
    max_queue_len: int = 1024
    max_queued_tokens: int | None = None
    # How its forward runs: {"configured", "running", "gate" (a gate record in brief) ...}.
    backend_info: dict[str, Any] = field(default_factory=dict)
    admission: AdmissionControl = field(init=False, repr=False)
    closed: bool = field(default=False, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.admission = AdmissionControl(self.max_queue_len, self.max_queued_tokens)

    def close(self) -> None:
        """Take no new requests (a new layout replaced this bucket); those admitted run on."""
        with self._lock:
            self.closed = True

    def is_idle(self) -> bool:
        """Nothing queued (admission tickets included) or running."""
        stats = self.batcher.stats()
        return not (stats.num_waiting or stats.num_running or self.admission.num_queued)

    def set_queue_limits(self, max_queue_len: int, max_queued_tokens: int | None) -> None:
        """New admission limits, for the next request on (requests already queued stay)."""
        self.admission.set_limits(max_queue_len, max_queued_tokens)
        self.max_queue_len, self.max_queued_tokens = max_queue_len, max_queued_tokens

    def submit(self, request: Request) -> None:
        """Queue a request on this bucket's batcher and wake its slice (thread-safe).

        Raises:
            QueueFullError: the queue is at ``max_queue_len`` or ``max_queued_tokens``; nothing queued.
            DeadlineUnmeetableError: (a ``QueueFullError``) the queue's expected wait is past the
                request's deadline; nothing queued.
            BucketClosedError: the bucket was replaced; nothing queued.
        """
        timeout_s = None if request.deadline_s is None else request.deadline_s - self.admission.clock()
        with self._lock:  # a close() either sees this ticket counted or this submit sees it closed
            if self.closed:
                raise BucketClosedError(f"bucket {self.name!r} of {self.model_name!r} was replaced")
            ticket = self.admission.admit(request.num_prompt_tokens, timeout_s)
        request.info["bucket"] = self.name
        request.on_dequeue = ticket.release
        try:
            self.batcher.submit(request)
        except BaseException:
            ticket.release()
            raise
        self.device_slice.notify()

    def stats(self) -> BucketStats:
        return replace(self.batcher.stats(), num_rejected=self.admission.num_rejected)


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
