"""Short prompts keep their TTFT while the long-prompt bucket is saturated.

A dedicated server places the generation model's short-prompt bucket and its long-prompt bucket
on two device slices of one thread each (the design's "every bucket on its own slice"). The
short requests' p99 TTFT is measured alone, then again while clients keep the long bucket full
of long prompts; the loaded p99 must stay within 3x of the unloaded one.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.conftest import CONFIG, GENERATE_MODEL, run_server

NUM_SAMPLES = 40
MAX_TTFT_RATIO = 3.0
NUM_LONG_CLIENTS = 12
SHORT_PROMPT = "Name a river:"
LONG_PROMPT = " ".join(["The barges moved slowly through the locks while the keepers counted the tolls."] * 14)


@pytest.fixture(scope="module")
def two_slice_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = yaml.safe_load(CONFIG.read_text())
    config["slices"] = [
        {"name": "short", "device": "cpu", "num_threads": 1, "kv_cache_memory_bytes": "64MiB"},
        {"name": "long", "device": "cpu", "num_threads": 1, "kv_cache_memory_bytes": "192MiB"},
    ]
    model = next(m for m in config["models"] if m["name"] == GENERATE_MODEL)
    model["buckets"][0]["slice"] = "short"
    model["buckets"][1]["slice"] = "long"
    config["models"] = [model]
    folder: Path = tmp_path_factory.mktemp("isolation")
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with run_server(path, folder / "server.log") as url:
        yield url


def p99(samples: list[float]) -> float:
    """The nearest-rank 99th percentile."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


async def _ttft_s(client: httpx.AsyncClient, body: dict[str, Any]) -> float:
    """Seconds from sending a streamed completion to its first chunk with text."""
    started = time.monotonic()
    async with client.stream("POST", "/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"text":""' not in line.replace(" ", ""):
                return time.monotonic() - started
    raise AssertionError("the stream ended without text")


async def _short_ttfts(client: httpx.AsyncClient) -> list[float]:
    body = {"model": GENERATE_MODEL, "prompt": SHORT_PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    samples = []
    for _ in range(NUM_SAMPLES):
        samples.append(await _ttft_s(client, body))
        await asyncio.sleep(0.05)
    return samples


def test_short_prompt_ttft_holds_while_the_long_bucket_is_saturated(two_slice_url: str) -> None:
    long_body = {"model": GENERATE_MODEL, "prompt": LONG_PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}

    async def run() -> tuple[list[float], list[float], int, int]:
        async with httpx.AsyncClient(base_url=f"{two_slice_url}/v1", timeout=300) as client:
            await _short_ttfts(client)  # warm-up
            unloaded = await _short_ttfts(client)
            stop = asyncio.Event()
            done = 0

            async def long_client() -> None:
                nonlocal done
                while not stop.is_set():
                    response = await client.post("/completions", json=long_body)
                    assert response.status_code == 200, response.text
                    done += 1

            long_clients = [asyncio.create_task(long_client()) for _ in range(NUM_LONG_CLIENTS)]
            await asyncio.sleep(3.0)  # let the long bucket fill up
            stats = (await client.get(f"{two_slice_url}/stats")).json()[GENERATE_MODEL]
            running_long = stats["le256"]["num_running"]
            loaded = await _short_ttfts(client)
            stop.set()
            await asyncio.gather(*long_clients)
            return unloaded, loaded, running_long, done

    unloaded, loaded, running_long, num_long_done = asyncio.run(run())
    ratio = p99(loaded) / p99(unloaded)
    print(
        f"short-prompt TTFT p99: unloaded {p99(unloaded) * 1000:.1f} ms, with the long bucket saturated "
        f"{p99(loaded) * 1000:.1f} ms ({ratio:.2f}x); long requests running {running_long}, finished {num_long_done}"
    )
    assert running_long >= 4, "the long bucket was not saturated"
    assert num_long_done >= NUM_LONG_CLIENTS
    assert ratio <= MAX_TTFT_RATIO
