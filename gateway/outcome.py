"""How a request ended, derived once from its last event, for the request log and the metrics."""

from __future__ import annotations

from enum import Enum

from buckets.errors import DeadlineExceededError
from buckets.request import EmbeddingEvent, ErrorEvent, TokenEvent
from gateway.streams import ChannelItem, Interrupt, InterruptReason


class Outcome(str, Enum):
    """A request's outcome: the ``outcome`` label of ``sluice_requests_total`` and of the
    ``request_finished`` and ``http_request`` log events."""

    OK = "ok"
    REJECTED = "rejected"  # 429: its bucket's queue was full, or could not meet its deadline
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"  # the client hung up
    ERROR = "error"  # the core failed it (5xx)
    INVALID_REQUEST = "invalid_request"  # a 4xx before any bucket took it (400, 405, 413, 422)
    NOT_FOUND = "not_found"  # 404: an unknown model or path


def outcome_of(last: ChannelItem | None, cancel_reason: InterruptReason | None) -> Outcome:
    """The outcome of a request whose wait ended on ``last`` (``None``: before any event), with
    ``cancel_reason`` the watch's reason if it fired (deadline or hang-up).

    A final token event or an embedding is ``ok``, but one finished by ``timeout`` (the core's
    deadline) is ``timeout``, as is the watch's deadline :class:`Interrupt`; an error event is
    ``timeout`` for a passed deadline, else ``error``; a wait that stopped before a final event
    (a streaming client that went away) is ``timeout`` or ``cancelled`` by ``cancel_reason``.
    """
    if isinstance(last, Interrupt):
        return Outcome.TIMEOUT if last.reason is InterruptReason.TIMEOUT else Outcome.CANCELLED
    if isinstance(last, ErrorEvent):
        return Outcome.TIMEOUT if isinstance(last.error, DeadlineExceededError) else Outcome.ERROR
    if isinstance(last, TokenEvent) and last.finish_reason is not None:
        return Outcome.TIMEOUT if last.finish_reason == "timeout" else Outcome.OK
    if isinstance(last, EmbeddingEvent):
        return Outcome.OK
    return Outcome.TIMEOUT if cancel_reason is InterruptReason.TIMEOUT else Outcome.CANCELLED


def outcome_of_status(status_code: int) -> Outcome | None:
    """The outcome of a request answered with ``status_code`` before any bucket counted it:
    ``not_found`` (404) or ``invalid_request`` (another 4xx); ``None`` for the statuses a
    bucket counts (200, 429 rejected, 499 cancelled, 5xx, 504)."""
    if status_code == 404:
        return Outcome.NOT_FOUND
    if 400 <= status_code < 500 and status_code not in (429, 499):
        return Outcome.INVALID_REQUEST
    return None
