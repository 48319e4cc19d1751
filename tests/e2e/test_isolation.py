"""Short prompts are served while the long-prompt bucket is saturated.

A dedicated server places the generation model's short-prompt bucket and its long-prompt bucket
on two device slices of one thread each (the design's "every bucket on its own slice"). While
clients keep the long bucket full of long prompts, short streamed requests each get their first
text and complete, and the long bucket stays saturated throughout. How much the short prompts'
TTFT grows under that load is a measurement, not a pass/fail: ``python -m bench.isolation``
against such a server prints the p99 ratio.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from bench.isolation import MIN_LONG_RUNNING, LongLoad, num_running, p99, short_ttfts, wait_saturated
from tests.e2e.conftest import CONFIG, GENERATE_MODEL, run_server

NUM_SAMPLES = 20
NUM_LONG_CLIENTS = 12
LONG_BUCKET = "le320"


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


def test_short_prompts_complete_while_the_long_bucket_is_saturated(two_slice_url: str) -> None:
    async def run() -> tuple[list[float], int, int, int]:
        async with httpx.AsyncClient(base_url=f"{two_slice_url}/v1", timeout=300) as client:
            load = LongLoad(client, GENERATE_MODEL, NUM_LONG_CLIENTS)
            running_before = await wait_saturated(client, two_slice_url, GENERATE_MODEL, LONG_BUCKET)
            ttfts = await short_ttfts(client, GENERATE_MODEL, NUM_SAMPLES)  # each asserts a 200 with text
            running_after = await num_running(client, two_slice_url, GENERATE_MODEL, LONG_BUCKET)
            await load.stop()
            return ttfts, running_before, running_after, load.num_done

    ttfts, running_before, running_after, num_long_done = asyncio.run(run())
    print(
        f"{len(ttfts)} short prompts served with the long bucket saturated (TTFT p99 {p99(ttfts) * 1000:.1f} ms); "
        f"long requests running {running_before} before, {running_after} after, finished {num_long_done}"
    )
    assert len(ttfts) == NUM_SAMPLES
    assert running_after >= MIN_LONG_RUNNING, "the long bucket was not saturated while the short prompts ran"
    assert num_long_done >= NUM_LONG_CLIENTS
