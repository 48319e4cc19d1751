"""Bucket isolation: how much a saturated long-prompt bucket slows the short prompts' first token.

Against any running gateway: the short prompts' p99 time to first token (streamed completions,
one after another) is measured alone, then again while ``--long-clients`` clients keep the
long-prompt bucket full; the script prints both and their ratio. Isolation shows when the two
buckets run on separate slices (say ``slices: [{name: short, device: cpu, num_threads: 1},
{name: long, device: cpu, num_threads: 1}]`` with the generation model's first bucket on
``short`` and its last on ``long``, as ``tests/e2e/test_isolation.py``'s server does); on one
slice the buckets take turns and the ratio grows with the long bucket's load.

Run: ``python -m bench.isolation --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct``.
With ``--max-ratio R`` it exits 1 when the ratio is over ``R``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

SHORT_PROMPT = "Name a river:"
LONG_PROMPT = " ".join(["The barges moved slowly through the locks while the keepers counted the tolls."] * 14)
# Clients keep the long bucket this full (running sequences) before the loaded samples start.
MIN_LONG_RUNNING = 4
SATURATE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class IsolationResult:
    """The short prompts' p99 TTFT in seconds, alone and with the long bucket saturated, their
    ratio, the long bucket's running sequences when the loaded samples started, and the long
    requests finished meanwhile."""

    unloaded_p99_s: float
    loaded_p99_s: float
    num_long_running: int
    num_long_done: int

    @property
    def ratio(self) -> float:
        return self.loaded_p99_s / self.unloaded_p99_s


def p99(samples: list[float]) -> float:
    """The nearest-rank 99th percentile of ``samples`` (not empty)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def short_body(model: str) -> dict[str, Any]:
    """A short greedy completion of two tokens."""
    return {"model": model, "prompt": SHORT_PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True}


def long_body(model: str) -> dict[str, Any]:
    """A long-prompt greedy completion of 48 tokens (over 48 prompt tokens: the long bucket)."""
    return {"model": model, "prompt": LONG_PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}


async def ttft_s(client: httpx.AsyncClient, body: dict[str, Any]) -> float:
    """Seconds from sending ``body`` as a streamed completion to its first chunk with text.

    Raises:
        AssertionError: the response is not 200, or the stream ended without text.
    """
    started = time.monotonic()
    async with client.stream("POST", "/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"text":""' not in line.replace(" ", ""):
                return time.monotonic() - started
    raise AssertionError("the stream ended without text")


async def short_ttfts(client: httpx.AsyncClient, model: str, num_samples: int, pause_s: float = 0.05) -> list[float]:
    """``num_samples`` short-prompt TTFTs in seconds, one request after another, ``pause_s`` apart."""
    samples = []
    for _ in range(num_samples):
        samples.append(await ttft_s(client, short_body(model)))
        await asyncio.sleep(pause_s)
    return samples


class LongLoad:
    """``num_clients`` clients sending long-prompt completions back to back until :meth:`stop`;
    every response must be a 200."""

    def __init__(self, client: httpx.AsyncClient, model: str, num_clients: int) -> None:
        self.num_done = 0
        self._client = client
        self._body = long_body(model)
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._loop()) for _ in range(num_clients)]

    async def _loop(self) -> None:
        while not self._stop.is_set():
            response = await self._client.post("/completions", json=self._body)
            assert response.status_code == 200, response.text
            self.num_done += 1

    async def stop(self) -> None:
        """Let each client finish its request in flight, then return (raising what one raised)."""
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def num_running(client: httpx.AsyncClient, base_url: str, model: str, bucket: str) -> int:
    """The running sequences of ``model``'s ``bucket``, from ``/stats``."""
    stats = (await client.get(f"{base_url}/stats")).json()
    return int(stats[model][bucket]["num_running"])


async def wait_saturated(client: httpx.AsyncClient, base_url: str, model: str, bucket: str) -> int:
    """Wait until ``bucket`` runs at least ``MIN_LONG_RUNNING`` sequences; return how many.

    Raises:
        TimeoutError: not within ``SATURATE_TIMEOUT_S``.
    """
    deadline = time.monotonic() + SATURATE_TIMEOUT_S
    while (running := await num_running(client, base_url, model, bucket)) < MIN_LONG_RUNNING:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{bucket} runs {running} sequences after {SATURATE_TIMEOUT_S} s")
        await asyncio.sleep(0.05)
    return running


async def measure(base_url: str, model: str, long_bucket: str, num_samples: int, num_long_clients: int) -> IsolationResult:
    """Warm up, measure the short prompts alone, saturate ``long_bucket``, measure again."""
    async with httpx.AsyncClient(base_url=f"{base_url}/v1", timeout=300) as client:
        await short_ttfts(client, model, num_samples)  # warm-up
        unloaded = await short_ttfts(client, model, num_samples)
        load = LongLoad(client, model, num_long_clients)
        running = await wait_saturated(client, base_url, model, long_bucket)
        loaded = await short_ttfts(client, model, num_samples)
        await load.stop()
    return IsolationResult(p99(unloaded), p99(loaded), running, load.num_done)


def main(argv: list[str] | None = None) -> int:
    """Print the short prompts' TTFT p99 alone and under load, and the ratio; 1 if over ``--max-ratio``."""
    parser = argparse.ArgumentParser(prog="python -m bench.isolation", description="Short prompts' TTFT with and without a saturated long-prompt bucket.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--long-bucket", default="le256", help="the bucket the long prompts land in")
    parser.add_argument("--samples", type=int, default=40, help="short requests per measurement")
    parser.add_argument("--long-clients", type=int, default=12)
    parser.add_argument("--max-ratio", type=float, default=None)
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.base_url, args.model, args.long_bucket, args.samples, args.long_clients))
    print(f"{'short-prompt TTFT p99':<32}{'ms':>10}")
    print(f"{'alone':<32}{result.unloaded_p99_s * 1000:>10.1f}")
    print(f"{f'{args.long_bucket} saturated':<32}{result.loaded_p99_s * 1000:>10.1f}")
    print(f"ratio {result.ratio:.2f}x; long requests running {result.num_long_running}, finished {result.num_long_done}")
    return 1 if args.max_ratio is not None and result.ratio > args.max_ratio else 0


if __name__ == "__main__":
    sys.exit(main())
