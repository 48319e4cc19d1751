"""The dynamic batcher for encoder work (Triton's ``dynamic_batching``, Ray Serve's ``@batch``).

Requests wait in a :class:`policies.fair_share.FairQueue`; a batch leaves when
``max_batch_size`` are queued or the oldest has waited ``max_queue_delay_ms``
(:func:`policies.batching.seconds_until_batch_closes`), and takes first any request waiting
more than ``max_starvation_s / 2``, then the others by priority band, fair share between tenants
(prompt tokens batched per weight, :class:`policies.fair_share.VirtualTokenCounter`; with
``fair_share`` off all tenants are one) and aging. One padded forward per batch; each request
gets its own row back.
"""

from __future__ import annotations

import collections
import itertools
import math
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
from policies.fair_share import FairQueue, VirtualTokenCounter

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
        self._inbox: collections.deque[EmbeddingRequest] = collections.deque()  # the event loop appends
        self.fair = VirtualTokenCounter()  # tenants' prompt tokens batched, per weight
        self._queue = self._new_queue(settings)  # the worker's
        self._counters = Counters()
        self._tokens_by_tenant: collections.Counter[str] = collections.Counter()
        self._pending_settings: DynamicBatcherSettings | None = None
        self._batch_ids = itertools.count()

    def submit(self, request: Request) -> None:
        assert isinstance(request, EmbeddingRequest)
        request.timeline["enqueued"] = self.clock()
        self._inbox.append(request)

    def _new_queue(self, settings: DynamicBatcherSettings) -> FairQueue[EmbeddingRequest]:
        return FairQueue(settings.priority_aging_s, self.fair if settings.fair_share else None)

    def _take_inbox(self) -> None:
        """Apply settings from :meth:`update_settings` and move submitted requests into the fair
        queue (worker thread, before each look at the queue)."""
        self._apply_settings()
        while self._inbox:
            request = self._inbox.popleft()
            self.fair.activate(request.tenant, request.tenant_weight)
            self._enqueue(request)

    def _enqueue(self, request: EmbeddingRequest) -> None:
        self._queue.push(request, request.priority, request.timeline["enqueued"], request.tenant)

    def seconds_until_ready(self, now: float) -> float | None:
        self._take_inbox()
        oldest = self._queue.starved(math.inf)
        if oldest is None:
            return None
        oldest_wait_s = now - oldest.timeline["enqueued"]
        return seconds_until_batch_closes(
            len(self._queue), oldest_wait_s, self.settings.max_batch_size, self.settings.max_queue_delay_s
        )

    def head_priority(self, now: float) -> float | None:
        self._take_inbox()
        head_key = self._queue.peek_key()
        return None if head_key is None else head_key - now / self.settings.priority_aging_s

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
        """Use ``settings`` from the next batch on (thread-safe: the worker applies them)."""
        self._pending_settings = settings

    def add_batch_observer(self, observer: BatchObserver) -> None:
        """Call ``observer(num_seqs, num_tokens, num_padding_tokens)`` after every forward (worker thread)."""
        self._counters.observers.append(observer)

    def stats(self) -> BucketStats:
        return self._counters.snapshot(
            self.kind, num_waiting=len(self._queue) + len(self._inbox), num_running=0,
            tokens_served_by_tenant=dict(self._tokens_by_tenant),
        )

    def shutdown(self) -> None:
        self._take_inbox()
        pending = list(self._queue)
        for request in pending:
            self._leave(request)
        self._fail(pending, ShuttingDownError("the bucket stopped before the request finished"))

    def _apply_settings(self) -> None:
        """Settings from :meth:`update_settings`, the queue re-keyed when aging or fair share changed."""
        settings, self._pending_settings = self._pending_settings, None
        if settings is None:
            return
        if (settings.priority_aging_s, settings.fair_share) != (self.settings.priority_aging_s, self.settings.fair_share):
            queued, self._queue = list(self._queue), self._new_queue(settings)
            for request in queued:
                self._enqueue(request)
        self.settings = settings

    def _leave(self, request: EmbeddingRequest) -> None:
        """``request`` leaves the queue (batched, dropped or failed): no longer active for fair share."""
        self._queue.remove(request)
        self.fair.deactivate(request.tenant)
        request.leave_queue()

    def _take_batch(self) -> list[EmbeddingRequest]:
        """Up to ``max_batch_size`` queued requests, starved ones first, then in the queue's
        order, each charged its prompt tokens to its tenant; cancelled ones are skipped and
        expired ones failed (:class:`~buckets.errors.DeadlineExceededError`)."""
        self._take_inbox()
        batch: list[EmbeddingRequest] = []
        now = self.clock()
        starved_before_s = now - self.settings.max_starvation_s / 2
        while self._queue and len(batch) < self.settings.max_batch_size:
            request = self._queue.starved(starved_before_s) or self._queue.peek()
            if not request.is_cancelled and not is_expired(request.deadline_s, now):
                # Charged while still active: once no tenant is, the counter forgets them all.
                self.fair.charge(request.tenant, request.num_prompt_tokens, request.tenant_weight)
            self._leave(request)
            if request.is_cancelled:
                self._counters.count_cancelled(request)
            elif is_expired(request.deadline_s, now):
                self._counters.num_timed_out += 1
                waited_s = now - request.timeline["enqueued"]
                request.emit(ErrorEvent(DeadlineExceededError(f"the request's deadline passed after {waited_s:.3f} s queued")))
            else:
                request.timeline["started"] = now
                self._tokens_by_tenant[request.tenant] += request.num_prompt_tokens
                batch.append(request)
        return batch

    def _fail(self, requests: list[EmbeddingRequest], error: Exception) -> None:
        self._counters.num_failed += len(requests)
        for request in requests:
            request.emit(ErrorEvent(error))
