"""Tenants sharing a bucket: closed-loop streaming clients per tenant, and what each was served.

A :class:`TenantLoad` runs ``num_clients`` clients for one API key, each sending a streamed
completion (``ignore_eos``, a fixed ``max_tokens`` and priority) and the next as soon as the last
ended, until stopped. Every request is recorded with its start, its first-token time and the
arrival time of each streamed token, so a window of the run gives each tenant's tokens per
second, its TTFT percentiles, and the longest a request went without a token
(:func:`longest_stall_s`: from its start to its first token, then between tokens).

``sluice bench fairness`` and ``sluice bench starvation`` (:mod:`bench.fairness`) build their
scenarios from these parts; ``tests/e2e/test_tenants.py`` asserts on them.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

PROMPT = "The keeper of the lock wrote down every barge that passed, and"


@dataclass
class StreamRecord:
    """One streamed request: when it started, when each token arrived (monotonic seconds), its
    HTTP status and how it ended (``done``: the stream closed normally)."""

    tenant: str
    priority: int | None
    start_s: float
    token_times_s: list[float] = field(default_factory=list)
    status: int = 0
    done: bool = False

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.start_s if self.token_times_s else None

    def stalls_s(self, until_s: float) -> list[float]:
        """Gaps without a token: start to first token, between tokens, and (for a request still
        open at ``until_s``) its last token, or its start, to ``until_s``."""
        times = [self.start_s, *self.token_times_s]
        gaps = [b - a for a, b in zip(times, times[1:])]
        if not self.done:
            gaps.append(until_s - times[-1])
        return gaps


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank ``q`` percentile (0 < q <= 100) of ``samples`` (not empty)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class TenantLoad:
    """``num_clients`` closed-loop streaming clients of one tenant.

    Args:
        client: an ``httpx.AsyncClient`` whose base URL is the gateway's ``/v1``.
        tenant: the name the records carry.
        api_key: sent as ``Authorization: Bearer``; ``None``: no header.
        priority: every request's ``priority`` (``None``: not sent, the key's default applies).
        max_tokens: tokens each request generates (``ignore_eos``).
    """

    def __init__(
        self, client: httpx.AsyncClient, model: str, tenant: str, api_key: str | None, num_clients: int,
        max_tokens: int, priority: int | None = None, prompt: str = PROMPT,
    ) -> None:
        self.client, self.model, self.tenant = client, model, tenant
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_tokens, self.priority, self.prompt = max_tokens, priority, prompt
        self.records: list[StreamRecord] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._client()) for _ in range(num_clients)]

    async def _client(self) -> None:
        while not self._stop.is_set():
            await self._one()

    async def _one(self) -> None:
        body: dict[str, Any] = {
            "model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
        }
        if self.priority is not None:
            body["priority"] = self.priority
        record = StreamRecord(self.tenant, self.priority, time.monotonic())
        self.records.append(record)
        async with self.client.stream("POST", "/completions", json=body, headers=self.headers) as response:
            record.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"{self.tenant}: HTTP {response.status_code}: {response.text[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    record.token_times_s.append(time.monotonic())
        record.done = True

    async def stop(self) -> None:
        """Let every client finish its request in flight, then end (a failed client's error is raised)."""
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def abandon(self) -> None:
        """Hang up every client now (the gateway drops their requests); a client that had
        already failed raises its error."""
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        for result in await asyncio.gather(*self._tasks, return_exceptions=True):
            if isinstance(result, Exception):
                raise result

    def tokens_between(self, start_s: float, end_s: float) -> int:
        """Tokens that arrived in ``[start_s, end_s)``."""
        return sum(1 for r in self.records for t in r.token_times_s if start_s <= t < end_s)

    def ttfts_s(self, start_s: float, end_s: float) -> list[float]:
        """TTFTs of the requests that started in ``[start_s, end_s)``; one still without a token
        at ``end_s`` counts ``end_s`` minus its start (a lower bound: a queue that never drains
        in the window must not look fast)."""
        return [
            r.ttft_s if r.ttft_s is not None else end_s - r.start_s
            for r in self.records
            if start_s <= r.start_s < end_s
        ]

    def longest_stall_s(self, start_s: float, end_s: float) -> float:
        """The longest gap without a token, within ``[start_s, end_s]``, of any of this load's
        requests open in that window (0.0 if none)."""
        stalls = [
            min(b, end_s) - max(a, start_s)
            for r in self.records
            for a, b in _gap_bounds(r, end_s)
            if b > start_s and a < end_s
        ]
        return max(stalls, default=0.0)


def _gap_bounds(record: StreamRecord, until_s: float) -> list[tuple[float, float]]:
    times = [record.start_s, *record.token_times_s]
    bounds = list(zip(times, times[1:]))
    if not record.done:
        bounds.append((times[-1], until_s))
    return bounds


@dataclass(frozen=True)
class TenantFigures:
    """One tenant's service over a window: tokens per second, TTFT p50/p99 (seconds) of the
    requests started in it, and the longest stall of any of its requests."""

    tenant: str
    tokens: int
    tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    longest_stall_s: float

    @classmethod
    def of(cls, load: TenantLoad, start_s: float, end_s: float) -> TenantFigures:
        tokens = load.tokens_between(start_s, end_s)
        ttfts = load.ttfts_s(start_s, end_s)
        return cls(
            load.tenant, tokens, tokens / (end_s - start_s),
            percentile(ttfts, 50) if ttfts else None, percentile(ttfts, 99) if ttfts else None,
            load.longest_stall_s(start_s, end_s),
        )

    def line(self) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value * 1000:.0f} ms"

        return (
            f"{self.tenant}: {self.tokens_per_s:.1f} tok/s ({self.tokens} tokens), TTFT p50 {ms(self.ttft_p50_s)} "
            f"p99 {ms(self.ttft_p99_s)}, longest stall {self.longest_stall_s:.2f} s"
        )
