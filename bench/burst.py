"""A burst of identical HTTP requests sent at once by a client lean enough to time the server.

Each request has its own keep-alive connection, opened (and answered once, by ``GET /health``)
before the burst. The request bytes are built once; the burst writes them on every connection
in turn and then waits on all of them with one ``selectors`` loop in one thread, so the client's
own work per request is a ``send``, a few ``recv`` and a header parse (microseconds), and the times
it sees are the server's. One ``httpx.AsyncClient`` per request, in one process on the server's
2 cores, measured a burst of 404s (no model work) at p99 0.12-0.22 s where this client measured
0.04-0.06 s.

Usage (against a running gateway)::

    python -m bench.burst --url http://127.0.0.1:8000 --model smollm2-135m-instruct --requests 400
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# The longest a burst waits for its last answer, in seconds.
DEFAULT_TIMEOUT_S = 300.0
RECV_BYTES = 65536


@dataclass(frozen=True)
class BurstResult:
    """One request of a burst: its status, headers (lower-case names), body, and the seconds
    from its bytes written to its whole response read (``elapsed_s``)."""

    status: int
    headers: dict[str, str]
    body: bytes
    elapsed_s: float

    def json(self) -> Any:
        """The body parsed as JSON."""
        return json.loads(self.body)


def request_bytes(host: str, method: str, path: str, body: object | None = None) -> bytes:
    """An HTTP/1.1 keep-alive request, with ``body`` as JSON when given."""
    payload = b"" if body is None else json.dumps(body).encode()
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(payload)}\r\n"
    if body is not None:
        head += "Content-Type: application/json\r\n"
    return (head + "\r\n").encode() + payload


class _Exchange:
    """The response being read on one connection."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = b""
        self.started_s = 0.0
        self.result: BurstResult | None = None

    def feed(self, data: bytes) -> None:
        """Add received bytes; sets ``result`` once the whole response (``Content-Length``) is in.

        Raises:
            ConnectionError: the server closed the connection before answering in full.
        """
        if not data:
            raise ConnectionError("the server closed a connection before its response ended")
        self.buffer += data
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return
        lines = self.buffer[:head_end].decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        body = self.buffer[head_end + 4:]
        if len(body) >= int(headers.get("content-length", "0")):
            self.result = BurstResult(int(lines[0].split()[1]), headers, body, time.monotonic() - self.started_s)


def _exchange_all(exchanges: list[_Exchange], payload: bytes, timeout_s: float) -> list[BurstResult]:
    """Write ``payload`` on every connection, then read every response. Returns them in order.

    Raises:
        TimeoutError: some response had not ended after ``timeout_s``.
    """
    with selectors.DefaultSelector() as selector:
        for exchange in exchanges:
            exchange.buffer, exchange.result = b"", None
            selector.register(exchange.sock, selectors.EVENT_READ, exchange)
        for exchange in exchanges:
            exchange.started_s = time.monotonic()
            exchange.sock.sendall(payload)
        pending = len(exchanges)
        deadline_s = time.monotonic() + timeout_s
        while pending:
            events = selector.select(max(0.0, deadline_s - time.monotonic()))
            if not events:
                raise TimeoutError(f"{pending} of {len(exchanges)} responses missing after {timeout_s} s")
            for key, _ in events:
                exchange = key.data
                exchange.feed(exchange.sock.recv(RECV_BYTES))
                if exchange.result is not None:
                    selector.unregister(exchange.sock)
                    pending -= 1
    return [e.result for e in exchanges if e.result is not None]


def send_burst(url: str, num_requests: int, method: str, path: str, body: object | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> list[BurstResult]:
    """The same request on ``num_requests`` connections at once; its results, one per connection.

    The connections are opened, and each answered once by ``GET /health``, right before the burst
    (uvicorn closes a keep-alive connection idle for 5 s), and closed after it.

    Raises:
        TimeoutError: a response had not ended within ``timeout_s``.
        ConnectionError: the server closed a connection.
    """
    parts = urlsplit(url)
    address = (parts.hostname or "127.0.0.1", parts.port or 80)
    exchanges: list[_Exchange] = []
    try:
        for _ in range(num_requests):
            exchanges.append(_Exchange(socket.create_connection(address)))
            exchanges[-1].sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _exchange_all(exchanges, request_bytes(parts.netloc, "GET", "/health"), timeout_s)
        return _exchange_all(exchanges, request_bytes(parts.netloc, method, path, body), timeout_s)
    finally:
        for exchange in exchanges:
            exchange.sock.close()


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(results: list[BurstResult], status: int) -> str:
    """``count x status p50/p99 X/Y s`` for the results of ``status``."""
    elapsed_s = [r.elapsed_s for r in results if r.status == status]
    if not elapsed_s:
        return f"0 x {status}"
    return f"{len(elapsed_s)} x {status} p50/p99 {percentile(elapsed_s, 0.5):.3f}/{percentile(elapsed_s, 0.99):.3f} s"


def main(argv: list[str] | None = None) -> int:
    """Send a burst of 404s (an unknown model), then of completions; print each one's times."""
    parser = argparse.ArgumentParser(prog="python -m bench.burst", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt", default="Write a short list of fruits:")
    parser.add_argument("--rounds", type=int, default=1, help="bursts of each kind, one after the other")
    args = parser.parse_args(argv)
    body = {"model": args.model, "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    for _ in range(args.rounds):
        not_found = send_burst(args.url, args.requests, "POST", "/v1/completions", {**body, "model": "no-such-model"})
        completions = send_burst(args.url, args.requests, "POST", "/v1/completions", body)
        statuses = sorted({r.status for r in completions})
        print(f"404 burst: {summary(not_found, 404)}; completions: {summary(completions, 429)}, "
              f"{summary(completions, 200)} (statuses {statuses})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
