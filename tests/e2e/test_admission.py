"""Admission control against a real server: a full bucket answers 429 at once, with Retry-After
and an OpenAI-style body, for embeddings, completions and chat (streamed or not); never a hang.

A server with tiny queues (shared with the dashboard tests) runs here, so the default server's
limits stay as they are.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.e2e.conftest import EMBED_MODEL, GENERATE_MODEL, SMALL_EMBED_QUEUE_LEN, SMALL_GENERATE_QUEUE_LEN, Server

EMBED_QUEUE_LEN = SMALL_EMBED_QUEUE_LEN
GENERATE_QUEUE_LEN = SMALL_GENERATE_QUEUE_LEN
MAX_429_S = 0.5


@pytest.fixture(scope="module")
def small_queue_url(small_queue_server: Server) -> str:
    """A server with ``max_queue_len`` 2 on the first embedding bucket (whose batches wait 2 s)
    and 1 on the first generation bucket (one sequence at a time)."""
    return small_queue_server.url


async def _timed_post(client: httpx.AsyncClient, path: str, body: dict) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    response = await client.post(path, json=body)
    return response, time.monotonic() - start


def _burst(url: str, requests: list[tuple[str, dict]]) -> list[tuple[httpx.Response, float]]:
    async def all_at_once() -> list[tuple[httpx.Response, float]]:
        async with httpx.AsyncClient(base_url=f"{url}/v1", timeout=120) as client:
            return await asyncio.gather(*(_timed_post(client, p, b) for p, b in requests))

    return asyncio.run(all_at_once())


def _check_burst(results: list[tuple[httpx.Response, float]], max_queue_len: int) -> None:
    statuses = [r.status_code for r, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 1, statuses
    assert statuses.count(200) >= max_queue_len, statuses
    for response, elapsed_s in results:
        if response.status_code != 429:
            continue
        assert elapsed_s < MAX_429_S, f"429 took {elapsed_s:.3f} s"
        retry_after = response.headers["Retry-After"]
        assert retry_after.isdigit() and int(retry_after) >= 1, retry_after
        error = response.json()["error"]
        assert error["type"] == "rate_limit_error"
        assert error["code"] == "queue_full"
        assert error["param"] is None
        assert "max_queue_len" in error["message"]


def test_embedding_burst_gets_429_with_retry_after(small_queue_url: str) -> None:
    body = {"model": EMBED_MODEL, "input": "a short sentence"}
    before = httpx.get(f"{small_queue_url}/stats").json()[EMBED_MODEL]["le16"]["num_rejected"]
    results = _burst(small_queue_url, [("/embeddings", body)] * (10 * EMBED_QUEUE_LEN))
    _check_burst(results, EMBED_QUEUE_LEN)
    stats = httpx.get(f"{small_queue_url}/stats").json()[EMBED_MODEL]
    assert stats["le16"]["num_rejected"] - before == sum(r.status_code == 429 for r, _ in results)


def test_generation_burst_gets_429_for_completions_and_chat(small_queue_url: str) -> None:
    completion = {"model": GENERATE_MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    messages = [{"role": "user", "content": "Say hello"}]
    chat = {"model": GENERATE_MODEL, "messages": messages, "max_tokens": 24, "temperature": 0}
    streamed = {**chat, "stream": True}
    requests = [("/completions", completion), ("/chat/completions", chat), ("/chat/completions", streamed)] * 4
    results = _burst(small_queue_url, requests)
    _check_burst(results, GENERATE_QUEUE_LEN)
    for (response, _), (_, body) in zip(results, requests):
        if response.status_code == 200 and body.get("stream"):
            assert response.text.rstrip().endswith("data: [DONE]")


def test_a_bucket_accepts_again_once_its_queue_drains(small_queue_url: str) -> None:
    body = {"model": EMBED_MODEL, "input": "a short sentence"}
    deadline = time.monotonic() + 30
    while True:
        response = httpx.post(f"{small_queue_url}/v1/embeddings", json=body, timeout=60)
        if response.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert response.status_code == 200


def test_a_retrying_client_gets_every_request_through_without_a_storm(small_queue_url: str) -> None:
    """bench.retry against the real server: 8 requests into a queue of 2. Every one ends in 200,
    some only after 429s, and no request tries more than its policy allows."""
    import random

    from bench.retry import RetryPolicy, send_with_retry

    policy = RetryPolicy(max_attempts=12, base_delay_s=0.5, max_delay_s=3.0)

    async def all_with_retry() -> list[tuple[httpx.Response, int]]:
        async with httpx.AsyncClient(base_url=small_queue_url, timeout=60) as client:
            body = {"model": EMBED_MODEL, "input": "retry me"}
            return await asyncio.gather(
                *(
                    send_with_retry(lambda: client.post("/v1/embeddings", json=body), policy, random.Random(seed))
                    for seed in range(8)
                )
            )

    results = asyncio.run(all_with_retry())
    assert [r.status_code for r, _ in results] == [200] * 8
    attempts = [n for _, n in results]
    assert max(attempts) > 1 and max(attempts) <= policy.max_attempts
