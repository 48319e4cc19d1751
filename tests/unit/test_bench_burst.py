"""bench.burst's lean client against a small keep-alive HTTP server in this process."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.burst import percentile, request_bytes, send_burst, summary

NUM_REQUESTS = 8


class EchoHandler(BaseHTTPRequestHandler):
    """``GET /health``: 200; ``POST /echo``: 429 with ``Retry-After: 3`` and the body it got;
    ``POST /close``: closes the connection without answering."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._answer(200, b'{"status":"ok"}')

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/close":
            self.close_connection = True
            return
        self._answer(429, json.dumps({"got": json.loads(body), "type": self.headers["Content-Type"]}).encode())

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Retry-After", "3")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        return


@pytest.fixture
def url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), EchoHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_burst_gets_one_whole_response_per_connection_with_its_status_headers_and_body(url: str) -> None:
    results = send_burst(url, NUM_REQUESTS, "POST", "/echo", {"prompt": "hi"})
    assert [r.status for r in results] == [429] * NUM_REQUESTS
    assert all(r.headers["retry-after"] == "3" and r.elapsed_s >= 0 for r in results)
    assert all(r.json() == {"got": {"prompt": "hi"}, "type": "application/json"} for r in results)
    assert summary(results, 429).startswith(f"{NUM_REQUESTS} x 429 p50/p99 ") and summary(results, 200) == "0 x 200"


def test_a_connection_the_server_closes_unanswered_is_an_error(url: str) -> None:
    with pytest.raises(ConnectionError):
        send_burst(url, 2, "POST", "/close", {})


def test_the_request_is_http_1_1_with_its_length_and_json_type() -> None:
    assert request_bytes("h:1", "GET", "/health") == b"GET /health HTTP/1.1\r\nHost: h:1\r\nContent-Length: 0\r\n\r\n"
    assert request_bytes("h:1", "POST", "/p", {"a": 1}).endswith(b"Content-Type: application/json\r\n\r\n" + b'{"a": 1}')


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile([2.0], 0.99)) == (51.0, 100.0, 2.0)
