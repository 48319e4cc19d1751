"""The client half of ``sluice bench load``: send one request, time it, read the server's queue.

Completions and chat stream (``stream_options.include_usage``): TTFT at the first chunk with
content, ITL between content chunks, output tokens from the usage chunk. Embeddings do not
stream: the whole answer is the first (and only) result, so TTFT equals E2E and there is no
TPOT. Sluice's ``x-sluice-bucket``, ``x-sluice-queue-ms`` and ``x-sluice-prefill-ms`` headers,
where present, are kept for per-bucket attribution.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from bench.load_report import RequestResult
from bench.retry import RetryPolicy, send_with_retry

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "embeddings": "/v1/embeddings"}
QUEUE_METRICS = ("sluice_requests_waiting", "vllm:num_requests_waiting")
QUEUE_POLL_S = 0.5


class Sender:
    """Sends one request of ``args.endpoint`` and times it, with or without retries (``--retry``).

    ``step_start`` (``time.perf_counter`` seconds) is the origin of each result's ``start_s``;
    ``on_done`` is called once per finished request (the progress bar).
    """

    def __init__(self, client: httpx.AsyncClient, args: argparse.Namespace, rng: random.Random) -> None:
        self.client, self.args, self.rng = client, args, rng
        self.path = ENDPOINTS[args.endpoint]
        self.streams = args.endpoint != "embeddings"
        self.policy = RetryPolicy() if args.retry else RetryPolicy(max_attempts=1)
        self.step_start = 0.0
        self.on_done: Callable[[], object] = lambda: None

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        """The JSON body for ``prompt``; ``max_tokens`` is ignored for embeddings."""
        if self.args.endpoint == "embeddings":
            return {"model": self.args.model, "input": prompt}
        body: dict[str, Any] = {
            "model": self.args.model,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.args.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        # A peer's own fields (bench peers); a None value removes a field the peer refuses.
        for key, value in (getattr(self.args, "extra_body", None) or {}).items():
            if value is None:
                body.pop(key, None)
            else:
                body[key] = value
        return body

    async def send(self, prompt: str, max_tokens: int) -> RequestResult:
        """Send one request and wait for all of it; transport errors become a failed result."""
        request = self.client.build_request("POST", self.path, json=self.body(prompt, max_tokens))
        start = time.perf_counter()
        result = RequestResult(ok=False, start_s=start - self.step_start)
        try:
            response, _ = await send_with_retry(
                lambda: self.client.send(request, stream=self.streams), self.policy, self.rng
            )
            try:
                if self.streams:
                    await _read_stream(response, result, start)
                else:
                    await _read_whole(response, result, start)
            finally:
                await response.aclose()
        except (httpx.HTTPError, ValueError) as e:
            result.error = f"{type(e).__name__}: {e}"
        result.e2e_s = time.perf_counter() - start
        self.on_done()
        return result


async def _read_whole(response: httpx.Response, result: RequestResult, start: float) -> None:
    """Fill ``result`` from a non-streamed (embeddings) answer: its arrival is the first result."""
    result.status = response.status_code
    body = await response.aread()
    if response.status_code != 200:
        result.error = f"HTTP {response.status_code}: {body[:200].decode(errors='replace')}"
        return
    result.ttft_s = time.perf_counter() - start
    _read_headers(response.headers, result)
    usage = json.loads(body).get("usage") or {}
    result.num_prompt_tokens = usage.get("prompt_tokens")
    result.ok = True


async def _read_stream(response: httpx.Response, result: RequestResult, start: float) -> None:
    """Fill ``result`` from a streamed response: status, headers, content-chunk times, usage.

    A stream is whole at ``data: [DONE]``, or, for servers that never send it (``transformers
    serve``), when it closes after content and a chunk with a ``finish_reason``."""
    result.status = response.status_code
    if response.status_code != 200:
        body = await response.aread()
        result.error = f"HTTP {response.status_code}: {body[:200].decode(errors='replace')}"
        return
    _read_headers(response.headers, result)
    last = None
    num_chunks = 0
    finished = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            result.ok = result.ttft_s is not None
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = str(chunk["error"])
            return
        if chunk.get("usage"):
            result.num_output_tokens = chunk["usage"].get("completion_tokens") or num_chunks
            result.num_prompt_tokens = chunk["usage"].get("prompt_tokens")
        finished = finished or any(c.get("finish_reason") for c in chunk.get("choices") or [])
        if _has_content(chunk):
            now = time.perf_counter()
            num_chunks += 1
            if last is None:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
    if not result.num_output_tokens:
        result.num_output_tokens = num_chunks
    if not result.ok and finished and result.ttft_s is not None:
        result.ok = True
    if not result.ok and result.error is None:
        result.error = "stream ended without [DONE] or content"


def _has_content(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


def _read_headers(headers: httpx.Headers, result: RequestResult) -> None:
    result.bucket = headers.get("x-sluice-bucket")
    result.queue_ms = _float_or_none(headers.get("x-sluice-queue-ms"))
    result.prefill_ms = _float_or_none(headers.get("x-sluice-prefill-ms"))


def _float_or_none(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


async def sample_queue_depth(client: httpx.AsyncClient) -> float | None:
    """Poll ``/metrics`` until cancelled; return the mean summed waiting-request gauge, or
    ``None`` when the server has no such metric."""
    samples: list[float] = []
    try:
        while (depth := await _queue_depth(client)) is not None:
            samples.append(depth)
            await asyncio.sleep(QUEUE_POLL_S)
    except asyncio.CancelledError:
        pass
    return sum(samples) / len(samples) if samples else None


async def _queue_depth(client: httpx.AsyncClient) -> float | None:
    try:
        response = await client.get("/metrics", timeout=5)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in response.text.splitlines()
        if line.split("{", 1)[0].split(" ", 1)[0] in QUEUE_METRICS
    ]
    return sum(values) if values else None
