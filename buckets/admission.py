"""Counting a bucket's queued requests and refusing newcomers over its limits.

Queued means submitted to the bucket and not yet started: a continuous request starts when the
scheduler first admits its sequence, a dynamic one when its batch is taken. The event loop admits
(:meth:`AdmissionControl.admit`), the worker releases (:meth:`Ticket.release`), so the counts sit
behind a lock. The counts are kept per tenant too: with fair share, a full queue refuses only a
tenant holding its weighted share of the limit (:func:`policies.admission.fair_refusal_reason`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from buckets.errors import DeadlineUnmeetableError, QueueFullError
from policies.admission import BusyDrainRate, RateWindow, fair_refusal_reason, refusal_reason, retry_after_s
from policies.deadlines import can_meet_deadline, expected_wait_s


class Ticket:
    """One admitted request's place in the queue; :meth:`release` gives it back, once."""

    def __init__(self, admission: AdmissionControl, num_tokens: int, num_seqs: int = 1, tenant: str = "anonymous"):
        self._admission = admission
        self.num_tokens = num_tokens
        self.num_seqs = num_seqs
        self.tenant = tenant
        self.is_released = False

    def release(self) -> None:
        """Leave the queue (started, cancelled, failed or shut down). Idempotent, thread-safe."""
        self._admission._release(self)


class AdmissionControl:
    """A bucket's ``max_queue_len`` and ``max_queued_tokens`` (``None``: unlimited), and the
    queue's drain rate: over busy time (:class:`BusyDrainRate`) for deadline-aware refusals and
    ``Retry-After``, else over the last ``window_s`` seconds for ``Retry-After``.

    With ``fair_share``, a full queue still admits a tenant under its weighted share of the limit
    reached among the tenants queued (:func:`policies.admission.fair_refusal_reason`): the queue
    may then exceed ``max_queue_len`` or ``max_queued_tokens`` by at most the shares of the
    tenants under theirs. Without it, every tenant counts as one.

    Args:
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        max_queue_len: int,
        max_queued_tokens: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        window_s: float = 30.0,
        fair_share: bool = False,
    ):
        self.max_queue_len = max_queue_len
        self.fair_share = fair_share
        # Tenants with requests queued: [sequences, prompt tokens, weight] (none left: removed).
        self._by_tenant: dict[str, list[float]] = {}
        self.max_queued_tokens = max_queued_tokens
        self.clock = clock
        self.num_queued = 0
        self.num_queued_tokens = 0
        self.num_rejected = 0
        self._drained = RateWindow(window_s, start_s=clock())
        self._busy_drain = BusyDrainRate()
        self._lock = threading.Lock()

    def set_limits(self, max_queue_len: int, max_queued_tokens: int | None, fair_share: bool | None = None) -> None:
        """New limits (and ``fair_share``, ``None``: unchanged) for the next admission (thread-safe)."""
        with self._lock:
            self.max_queue_len, self.max_queued_tokens = max_queue_len, max_queued_tokens
            self.fair_share = self.fair_share if fair_share is None else fair_share

    def admit(
        self, num_tokens: int, timeout_s: float | None = None, num_seqs: int = 1, tenant: str = "anonymous", weight: float = 1.0
    ) -> Ticket:
        """Count a request of ``num_tokens`` prompt tokens (that must start within ``timeout_s``
        seconds; ``None``: no deadline) as queued: as ``num_seqs`` sequences in ``max_queue_len``
        (a request with ``n`` choices counts ``n``), its prompt tokens once, for ``tenant`` of
        fair-share ``weight``.

        Raises:
            DeadlineUnmeetableError: the queue's expected wait (requests ahead over the recent
                drain rate) is already past ``timeout_s``.
            QueueFullError: a limit would be exceeded; carries the reason and a retry delay.
        """
        with self._lock:
            now = self.clock()
            refusal = self._refusal(num_tokens, timeout_s, now, num_seqs, tenant, weight)
            if refusal is not None:
                self.num_rejected += 1
                raise refusal
            self._busy_drain.on_enqueue(now, self.num_queued)
            self.num_queued += num_seqs
            self.num_queued_tokens += num_tokens
            counts = self._by_tenant.setdefault(tenant, [0, 0, weight])
            counts[0], counts[1], counts[2] = counts[0] + num_seqs, counts[1] + num_tokens, weight
            return Ticket(self, num_tokens, num_seqs, tenant)

    def refusal(
        self, num_tokens: int, timeout_s: float | None = None, num_seqs: int = 1, tenant: str | None = None, weight: float = 1.0
    ) -> QueueFullError | None:
        """The error :meth:`admit` would raise now for a request of at least ``num_tokens`` prompt
        tokens and ``num_seqs`` sequences of ``tenant`` (``None``: not known yet, so with fair
        share one with nothing queued), without admitting or counting anything; ``None``: it
        would be admitted. Lets the router refuse a prompt before tokenizing it (thread-safe)."""
        with self._lock:
            return self._refusal(num_tokens, timeout_s, self.clock(), num_seqs, tenant, weight)

    def count_refusal(self) -> None:
        """Count a request refused on the strength of :meth:`refusal` (thread-safe)."""
        with self._lock:
            self.num_rejected += 1

    def _refusal(
        self, num_tokens: int, timeout_s: float | None, now: float, num_seqs: int, tenant: str | None, weight: float
    ) -> QueueFullError | None:
        limits = (self.num_queued, self.num_queued_tokens, num_tokens, self.max_queue_len, self.max_queued_tokens, num_seqs)
        if self.fair_share:
            held = self._by_tenant.get(tenant, [0, 0]) if tenant is not None else [0, 0]
            others = [counts[2] for name, counts in self._by_tenant.items() if name != tenant]
            reason = fair_refusal_reason(*limits, (int(held[0]), int(held[1])), weight, others)
        else:
            reason = refusal_reason(*limits)
        busy_drain_per_s = self._busy_drain.rate_per_s(now)
        drain_per_s = busy_drain_per_s or self._drained.rate_per_s(now)
        if reason is not None:
            return QueueFullError(reason, retry_after_s(self.num_queued, drain_per_s))
        if not can_meet_deadline(self.num_queued, busy_drain_per_s, timeout_s):
            wait_s = expected_wait_s(self.num_queued, busy_drain_per_s) or 0.0
            return DeadlineUnmeetableError(
                f"the expected queue wait of {wait_s:.1f} s ({self.num_queued} requests ahead) exceeds "
                f"the request's timeout of {timeout_s:g} s",
                retry_after_s(self.num_queued, drain_per_s),
            )
        return None

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.is_released:
                return
            ticket.is_released = True
            self.num_queued -= ticket.num_seqs
            self.num_queued_tokens -= ticket.num_tokens
            counts = self._by_tenant[ticket.tenant]
            counts[0] -= ticket.num_seqs
            counts[1] -= ticket.num_tokens
            if counts[0] <= 0:
                del self._by_tenant[ticket.tenant]
            assert self.num_queued >= 0 and self.num_queued_tokens >= 0, "queue counts went negative"
            now = self.clock()
            self._drained.record(now)
            self._busy_drain.on_dequeue(now, self.num_queued)
