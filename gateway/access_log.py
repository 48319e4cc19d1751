"""One ``http_request`` log event for every HTTP request (4xx and unknown paths included), with
its status, model, tenant (:func:`gateway.tenants.tenant_of`: ``anonymous`` without a key), path,
route (the matched path template; ``None`` for an unknown path) and durations, and its outcome;
and a hook for the metrics of the requests no bucket counts.

The outcome is the one the request's route derived from its last event (:func:`note_outcome`,
called where the request is logged), else the status's (:func:`gateway.outcome.outcome_of_status`:
a 499 is ``cancelled``, a 504 ``timeout``). A request whose route noted an outcome reached a
bucket, which counts it in ``sluice_requests_total``; the hook counts the others.

Wraps the app's ASGI handler rather than being a litestar middleware, which runs only on matched
routes and so misses 404s and 405s. Handlers add fields (the body's ``model``) with :func:`note`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

import structlog

from gateway.outcome import Outcome, outcome_of_status
from gateway.tenants import tenant_of

# The scope key under which a request's access-log fields are gathered.
SCOPE_KEY = "sluice.access"
# Status logged for a request whose handler ended before sending a response (the client left).
CLIENT_CLOSED_STATUS = 499

# An ASGI callable: (scope, receive, send); typed loosely, as litestar's own scope types are narrower.
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]
# (path, status, model from the body or None, whether a bucket took it) -> None, once per
# finished HTTP request.
FinishHook = Callable[[str, int, str | None, bool], None]

log = structlog.get_logger("sluice.access")

# The access-log fields of the HTTP request being served in this context (its task and the tasks
# it starts); None outside a request.
_current_fields: ContextVar[dict[str, Any] | None] = ContextVar("sluice_access_fields", default=None)


def note(scope: Any, **fields: Any) -> None:
    """Add ``fields`` to the access-log event of the request of ``scope``."""
    scope.setdefault(SCOPE_KEY, {}).update(fields)


def note_outcome(outcome: str) -> None:
    """Record the outcome of a core request of the HTTP request being served (no-op outside one).
    Of several (an embeddings call's inputs), the first that is not ``ok`` stays."""
    fields = _current_fields.get()
    if fields is not None and fields.get("outcome") in (None, Outcome.OK.value):
        fields["outcome"] = outcome


def _ms(seconds: float) -> float:
    return round(max(0.0, seconds) * 1000, 3)


class AccessLog:
    """An ASGI wrapper logging each HTTP request once, when its response has been sent:
    ``duration_ms`` from the app's call (the request's head read) to the response's end,
    ``answer_ms`` from the whole request received (its body read) to the response's start,
    which a slow client's body does not stretch.

    Args:
        app: the ASGI handler to wrap.
        on_finish: called after logging, with the path, status, noted model and whether a
            bucket took the request (its route noted an outcome).
    """

    def __init__(self, app: ASGIApp, on_finish: FinishHook):
        self.app = app
        self.on_finish = on_finish

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Serve the request through the wrapped app, then log it and call ``on_finish``."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started_s = time.monotonic()
        fields: dict[str, Any] = scope.setdefault(SCOPE_KEY, {})
        context_token = _current_fields.set(fields)
        times_s = {"received": started_s}

        async def receive_and_note() -> Any:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                times_s["received"] = time.monotonic()
            return message

        async def send_and_note(message: Any) -> None:
            if message["type"] == "http.response.start":
                fields["status"] = message["status"]
                times_s["answered"] = time.monotonic()
            await send(message)

        try:
            await self.app(scope, receive_and_note, send_and_note)
        except Exception:
            fields.setdefault("status", 500)  # the server answers a handler that raised with a 500
            raise
        finally:
            _current_fields.reset(context_token)
            status = int(fields.pop("status", CLIENT_CLOSED_STATUS))
            model = fields.pop("model", None)
            noted = fields.pop("outcome", None)
            answered_s = times_s.get("answered")
            log.info(
                "http_request", method=scope.get("method"), path=scope.get("path"), route=scope.get("path_template"),
                status=status, model=model, tenant=tenant_of(scope).name, duration_ms=_ms(time.monotonic() - started_s),
                answer_ms=None if answered_s is None else _ms(answered_s - times_s["received"]),
                outcome=noted or outcome_of_status(status).value, **fields,
            )
            self.on_finish(str(scope.get("path", "")), status, model, noted is not None)
