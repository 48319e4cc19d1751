"""The dynamic batcher for encoder work (Triton's ``dynamic_batching``, Ray Serve's ``@batch``).

Requests wait in a FIFO; a batch leaves when ``max_batch_size`` are queued or the oldest has
waited ``max_queue_delay_ms`` (:func:`policies.batching.seconds_until_batch_closes`). One padded
forward per batch; each request gets its own row back.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable

import structlog

from buckets.errors import BatchFailedError, DeadlineExceededError, ShuttingDownError
from buckets.request import EmbeddingEvent, EmbeddingRequest, ErrorEvent, Request
from buckets.runner import EncoderRunner
from buckets.settings import DynamicBatcherSettings
from buckets.stats import BatchObserver, BucketStats, Counters
from policies.batching import seconds_until_batch_closes
from policies.deadlines import is_expired
from policies.priority import effective_priority

log = structlog.get_logger(__name__)


class DynamicBatcher:
    """Batches embedding requests for an :class:`EncoderRunner` (``embed(list[list[int]]) -> (rows, num_padding)``).

    Args:
        runner: for example :class:`models.encoder.EmbeddingRunner`.
        settings: ``max_batch_size`` and ``max_queue_delay_ms``.
        clock: seconds, monotonic (tests pass a fake one).
    """

    kind = "dynamic"

    def __init__(
        self, runner: EncoderRunner, settings: DynamicBatcherSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.runner = runner
        self.settings = settings
        self.clock = clock
        self._queue: collections.deque[EmbeddingRequest] = collections.deque()
        self._counters = Counters()
        self._batch_ids = itertools.count()

    def submit(self, request: Request) -> None:
        assert isinstance(request, EmbeddingRequest)
        request.timeline["enqueued"] = self.clock()
        self._queue.append(request)

    def seconds_until_ready(self, now: float) -> float | None:
        if not self._queue:
            return None
        oldest_wait_s = now - self._queue[0].timeline["enqueued"]
        return seconds_until_batch_closes(
            len(self._queue), oldest_wait_s, self.settings.max_batch_size, self.settings.max_queue_delay_s
        )

    def head_priority(self, now: float) -> float | None:
        aging_s = self.settings.priority_aging_s
        queued = list(self._queue)  # a C-level copy: safe while the event loop appends
        if not queued:
            return None
        return min(effective_priority(r.priority, r.timeline["enqueued"], now, aging_s) for r in queued)

    def step(self) -> None:
        batch = self._take_batch()
        if not batch:
            return
        batch_id = next(self._batch_ids)
        for index, request in enumerate(batch):
            request.batches.append((batch_id, index))
        try:
            embeddings, num_padding = self.runner.embed([r.prompt_token_ids for r in batch])
        except Exception as exc:  # a failed batch fails its requests, never the loop
            log.exception("batch_failed", batch_id=batch_id, batch_size=len(batch))
            self._fail(batch, BatchFailedError(f"forward failed: {exc}"))
            return
        num_tokens = sum(r.num_prompt_tokens for r in batch) + num_padding
        self._counters.record_batch(len(batch), num_tokens, num_padding)
        now = self.clock()
        for request, row in zip(batch, embeddings.tolist()):
            request.timeline["first_token"] = request.timeline["finished"] = now
            request.emit(EmbeddingEvent(embedding=row, num_prompt_tokens=request.num_prompt_tokens))
        self._counters.num_finished += len(batch)

    def update_settings(self, settings: DynamicBatcherSettings) -> None:
        """Use ``settings`` from the next batch on (one reference swap: thread-safe)."""
        self.settings = settings

    def add_batch_observer(self, observer: BatchObserver) -> None:
        """Call ``observer(num_seqs, num_tokens, num_padding_tokens)`` after every forward (worker thread)."""
        self._counters.observers.append(observer)

    def stats(self) -> BucketStats:
        return self._counters.snapshot(self.kind, num_waiting=len(self._queue), num_running=0)

    def shutdown(self) -> None:
        pending = list(self._queue)
        self._queue.clear()
        self._fail(pending, ShuttingDownError("the bucket stopped before the request finished"))

    def _take_batch(self) -> list[EmbeddingRequest]:
        """Up to ``max_batch_size`` queued requests, skipping cancelled ones and failing expired
        ones (:class:`~buckets.errors.DeadlineExceededError`)."""
        batch: list[EmbeddingRequest] = []
        now = self.clock()
        while self._queue and len(batch) < self.settings.max_batch_size:
            request = self._queue.popleft()
            request.leave_queue()
            if request.is_cancelled:
                self._counters.count_cancelled(request)
            elif is_expired(request.deadline_s, now):
                self._counters.num_timed_out += 1
                waited_s = now - request.timeline["enqueued"]
                request.emit(ErrorEvent(DeadlineExceededError(f"the request's deadline passed after {waited_s:.3f} s queued")))
            else:
                request.timeline["started"] = now
                batch.append(request)
        return batch

    def _fail(self, requests: list[EmbeddingRequest], error: Exception) -> None:
        self._counters.num_failed += len(requests)
        for request in requests:
            request.emit(ErrorEvent(error))
