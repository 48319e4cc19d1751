"""gateway.http_edge: request ids, and compressed bodies inflated under a cap."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from typing import Any

import pytest

from gateway.http_edge import (
    REQUEST_ID_SCOPE_KEY, BodyDecoding, BodyTooLargeError, RequestIds, client_request_id, inflate,
)


def receiver(*chunks: bytes) -> Any:
    """An ASGI ``receive`` yielding ``chunks`` as one request body."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive() -> Any:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return receive


def test_inflate_reads_a_body_in_chunks() -> None:
    data = json.dumps({"prompt": "x" * 10_000}).encode()
    packed = gzip.compress(data)
    chunks = [packed[i:i + 100] for i in range(0, len(packed), 100)]
    assert asyncio.run(inflate(receiver(*chunks), 16 + zlib.MAX_WBITS, len(data))) == data


def test_a_zip_bomb_stops_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    bomb = zlib.compress(b"\0" * (256 * 1024 * 1024), 9)  # 256 MiB inflated, about 250 KiB packed
    largest: list[int] = []
    real = zlib.decompressobj

    class Spy:
        def __init__(self, wbits: int) -> None:
            self._inner = real(wbits)

        def decompress(self, data: bytes, max_length: int) -> bytes:
            out = self._inner.decompress(data, max_length)
            largest.append(len(out))
            return out

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    monkeypatch.setattr(zlib, "decompressobj", Spy)
    with pytest.raises(BodyTooLargeError):
        asyncio.run(inflate(receiver(bomb), zlib.MAX_WBITS, 1024 * 1024))
    assert max(largest) <= 1024 * 1024 + 1  # never more than the cap inflated at once


def test_a_truncated_or_bad_body_is_a_zlib_error() -> None:
    packed = gzip.compress(b'{"a": 1}')
    with pytest.raises(zlib.error):
        asyncio.run(inflate(receiver(packed[:-6]), 16 + zlib.MAX_WBITS, 1000))
    with pytest.raises(zlib.error):
        asyncio.run(inflate(receiver(b"plain"), 16 + zlib.MAX_WBITS, 1000))


@pytest.mark.parametrize(
    ("value", "expected"),
    [(b"abc-123", "abc-123"), (b"a b", "a b"), (b"x" * 128, "x" * 128), (b"x" * 129, None), (b"", None),
     (b"tab\t", None), ("é".encode(), None), (b"\x7f", None)],
)
def test_a_client_request_id_must_be_short_printable_ascii(value: bytes, expected: str | None) -> None:
    assert client_request_id([(b"X-Request-Id", value)]) == expected


def run_app(app: Any, headers: list[tuple[bytes, bytes]], *chunks: bytes) -> tuple[list[Any], dict[str, Any]]:
    """Call ``app`` with one HTTP request; the messages it sent and the scope it was given."""
    sent: list[Any] = []
    scope: dict[str, Any] = {"type": "http", "headers": headers}

    async def send(message: Any) -> None:
        sent.append(message)

    asyncio.run(app(scope, receiver(*chunks), send))
    return sent, scope


async def echo(scope: Any, receive: Any, send: Any) -> None:
    """An ASGI app answering 200 with the body it received and the request id in its scope."""
    message = await receive()
    body = json.dumps({"body": message["body"].decode(), "id": scope.get(REQUEST_ID_SCOPE_KEY)}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-request-id", b"app's own")]})
    await send({"type": "http.response.body", "body": body})


def test_request_ids_are_echoed_or_made() -> None:
    sent, scope = run_app(RequestIds(echo), [(b"x-request-id", b"mine")], b"{}")
    assert sent[0]["headers"] == [(b"x-request-id", b"mine")] and json.loads(sent[1]["body"])["id"] == "mine"
    assert scope["sluice.access"]["request_id"] == "mine"
    made = {run_app(RequestIds(echo), [], b"{}")[0][0]["headers"][0][1] for _ in range(3)}
    assert len(made) == 3


@pytest.mark.parametrize(("coding", "pack"), [("gzip", gzip.compress), ("deflate", zlib.compress), ("identity", bytes)])
def test_body_decoding_hands_the_app_the_inflated_body(coding: str, pack: Any) -> None:
    headers = [(b"content-encoding", coding.encode()), (b"content-length", b"5")]
    sent, _ = run_app(BodyDecoding(echo, 1000), headers, pack(b'{"a": 1}'))
    assert sent[0]["status"] == 200 and json.loads(sent[1]["body"])["body"] == '{"a": 1}'


@pytest.mark.parametrize(
    ("coding", "body", "status", "code"),
    [("br", b"x", 415, "unsupported_content_encoding"), ("gzip", gzip.compress(b"a" * 5000, mtime=0), 413, "request_too_large"),
     ("gzip", b"not gzip", 400, "invalid_content_encoding")],
)
def test_body_decoding_refusals_have_openai_bodies(coding: str, body: bytes, status: int, code: str) -> None:
    sent, _ = run_app(BodyDecoding(echo, 1000), [(b"content-encoding", coding.encode())], body)
    assert sent[0]["status"] == status
    assert json.loads(sent[1]["body"])["error"]["code"] == code
