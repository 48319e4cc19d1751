"""Tenants sharing a bucket (issue 36 §4): the fair share keeps a quiet tenant's first token fast
and splits tokens by weight; low-priority streams keep making progress under urgent load.

One server of :func:`bench.fairness.tenants_config` (SmolLM2-135M as three one-bucket models,
four API keys); the scenarios are :func:`bench.fairness.fairness_run` and
:func:`bench.fairness.starvation_run` (``sluice bench fairness`` prints the same figures).
Solo: the bounds compare latencies of one run, which another worker's load would distort.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from bench.fairness import FairnessResult, StarvationResult, fairness_run, new_keys, starvation_run, tenants_config
from tests.e2e.conftest import run_server

pytestmark = pytest.mark.solo

MAX_STARVATION_S = 10.0


@pytest.fixture(scope="module")
def tenants_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    keys = new_keys()
    folder: Path = tmp_path_factory.mktemp("tenants")
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(tenants_config(keys, max_starvation_s=MAX_STARVATION_S)))
    with run_server(path, folder / "server.log") as url:
        yield url, keys


def _client(url: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    return httpx.AsyncClient(base_url=f"{url}/v1", timeout=300, limits=limits)


def test_fair_share_keeps_the_quiet_tenants_ttft_and_splits_tokens_by_weight(tenants_server: tuple[str, dict[str, str]]) -> None:
    url, keys = tenants_server

    async def run() -> FairnessResult:
        async with _client(url) as client:
            return await fairness_run(client, keys)

    result = asyncio.run(run())
    print("\n".join(result.lines()))
    alone = result.b_alone.ttft_p50_s
    (_, b_fair), (_, b_unfair) = result.fair, result.unfair
    assert alone is not None and b_fair.ttft_p50_s is not None and b_unfair.ttft_p50_s is not None
    assert b_fair.ttft_p50_s <= 2 * alone, "with the policy, B's TTFT p50 must stay within 2x of its TTFT alone"
    share = FairnessResult.b_share(result.fair)
    assert 0.4 <= share <= 0.6, f"equal weights: each tenant within 20 % of half the tokens; B got {share:.1%}"
    assert b_unfair.ttft_p50_s > 2 * alone, "without the policy B queues behind A's backlog (the policy is what helps)"


def test_low_priority_streams_progress_every_max_starvation_s_under_urgent_load(
    tenants_server: tuple[str, dict[str, str]],
) -> None:
    url, keys = tenants_server

    async def run() -> StarvationResult:
        async with _client(url) as client:
            return await starvation_run(client, keys)

    result = asyncio.run(run())
    print("\n".join(result.lines()))
    assert result.low.tokens > 0
    assert result.low.longest_stall_s <= MAX_STARVATION_S, "a low-priority stream went longer than max_starvation_s without a token"
    assert result.ttft_ratio <= 2.0, "urgent requests must keep their TTFT within 2x of idle"
