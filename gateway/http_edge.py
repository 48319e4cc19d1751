"""ASGI wrappers at the HTTP edge, around the whole app (unknown paths included): a request id
on every request and response, and compressed request bodies inflated under the body limit.

:class:`RequestIds` gives each request an id: the client's ``X-Request-Id`` when it is valid
(printable ASCII, at most :data:`MAX_REQUEST_ID_CHARS`), otherwise a new unique one. The id goes
back in the ``x-request-id`` response header, into the access-log line (``request_id``), and
into the generation response's ``id`` (``cmpl-<id>``, ``chatcmpl-<id>``, as vLLM builds it).

:class:`BodyDecoding` inflates ``Content-Encoding: gzip`` or ``deflate`` bodies incrementally,
so a body whose inflated size passes ``max_request_body_bytes`` is a 413 once that many bytes
are out, never an allocation of its whole size; another encoding is a 415.
"""

from __future__ import annotations

import json
import uuid
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.access_log import note
from gateway.errors import APIError

# The scope key holding a request's id.
REQUEST_ID_SCOPE_KEY = "sluice.request_id"
MAX_REQUEST_ID_CHARS = 128
# zlib's window bits for each content coding: gzip's header and trailer; zlib's (RFC 9110's deflate).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


def request_id_of(scope: Any) -> str:
    """The id :class:`RequestIds` gave the request of ``scope`` (a new one outside it)."""
    return scope.setdefault(REQUEST_ID_SCOPE_KEY, uuid.uuid4().hex)  # type: ignore[no-any-return]


def client_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The client's ``X-Request-Id`` when it is 1 to 128 printable ASCII characters, else ``None``."""
    for name, value in headers:
        if name.lower() == b"x-request-id":
            if 0 < len(value) <= MAX_REQUEST_ID_CHARS and all(0x20 <= byte < 0x7F for byte in value):
                return value.decode("ascii")
            return None
    return None


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    return next((value for key, value in headers if key.lower() == name), None)


async def send_error(send: Any, error: APIError) -> None:
    """Answer with ``error``'s OpenAI-style JSON body and headers, from outside the app."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestIds:
    """An ASGI wrapper giving each HTTP request an id (see the module's docstring)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = client_request_id(scope.get("headers", [])) or uuid.uuid4().hex
        scope[REQUEST_ID_SCOPE_KEY] = request_id
        note(scope, request_id=request_id)
        header = (b"x-request-id", request_id.encode("ascii"))

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodyTooLargeError(Exception):
    """A request body (compressed, or once inflated) is over the limit."""


class BodyDecoding:
    """An ASGI wrapper inflating gzip and deflate request bodies (see the module's docstring).

    Args:
        app: the ASGI app to wrap.
        max_body_bytes: the most bytes a body may have, compressed and inflated.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        encoding = _header(scope.get("headers", []), b"content-encoding") if scope["type"] == "http" else None
        coding = (encoding or b"identity").decode("latin-1").strip().lower()
        if coding == "identity":
            await self.app(scope, receive, send)
            return
        if coding not in _WBITS:
            error = APIError(415, f"Content-Encoding '{coding}' is not supported; use gzip, deflate or none",
                             "invalid_request_error", code="unsupported_content_encoding")
            await send_error(send, error)
            return
        try:
            body = await inflate(receive, _WBITS[coding], self.max_body_bytes)
        except BodyTooLargeError:
            error = APIError(413, f"The request body is over {self.max_body_bytes} bytes once decompressed",
                             "invalid_request_error", code="request_too_large")
            await send_error(send, error)
            return
        except zlib.error as exc:
            await send_error(send, APIError(400, f"The {coding} request body does not decompress: {exc}",
                                            "invalid_request_error", code="invalid_content_encoding"))
            return
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"content-encoding", b"content-length")]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        await self.app(scope, _replay(body, receive), send)


async def inflate(receive: Any, wbits: int, max_bytes: int) -> bytes:
    """The whole request body from ``receive``, inflated; at most ``max_bytes + 1`` bytes are
    ever inflated (zlib's ``max_length``), whatever the compression ratio.

    Raises:
        BodyTooLargeError: the compressed or the inflated body is over ``max_bytes``.
        zlib.error: the body is not valid ``wbits`` data, or it is truncated.
    """
    inflater = zlib.decompressobj(wbits)
    out = bytearray()
    num_compressed_bytes = 0
    more_body = True
    while more_body:
        message = await receive()
        if message["type"] != "http.request":
            break  # the client left: the app sees the empty body and the disconnect
        more_body = bool(message.get("more_body", False))
        data = message.get("body", b"")
        num_compressed_bytes += len(data)
        if num_compressed_bytes > max_bytes:
            raise BodyTooLargeError
        while data:
            out += inflater.decompress(data, max_bytes + 1 - len(out))
            if len(out) > max_bytes:
                raise BodyTooLargeError
            data = inflater.unconsumed_tail
    out += inflater.flush()
    if len(out) > max_bytes:
        raise BodyTooLargeError
    if not inflater.eof:
        raise zlib.error("the compressed body is truncated")
    return bytes(out)


def _replay(body: bytes, receive: Any) -> Callable[[], Awaitable[Any]]:
    """A ``receive`` that yields ``body`` as one message, then waits on the client's (its hang-up)."""
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
