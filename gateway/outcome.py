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
    UNAVAILABLE = "unavailable"  # 503 before any bucket took it: the model draining, its slice restarting
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


_OUTCOMES_BY_STATUS = {
    404: Outcome.NOT_FOUND, 429: Outcome.REJECTED, 499: Outcome.CANCELLED, 503: Outcome.UNAVAILABLE, 504: Outcome.TIMEOUT,
}


def outcome_of_status(status_code: int) -> Outcome:
    """The outcome of an HTTP answer known only by its ``status_code`` (the ``http_request`` log
    event of a request whose route noted none, and the count of requests no bucket took):
    ``ok`` below 400, ``not_found`` (404), ``rejected`` (429), ``cancelled`` (499: the client
    closed the connection first), ``unavailable`` (503), ``timeout`` (504), ``error`` (any other
    5xx) and ``invalid_request`` (any other 4xx)."""
    if status_code in _OUTCOMES_BY_STATUS:
        return _OUTCOMES_BY_STATUS[status_code]
    if status_code >= 500:
        return Outcome.ERROR
    return Outcome.INVALID_REQUEST if status_code >= 400 else Outcome.OK
