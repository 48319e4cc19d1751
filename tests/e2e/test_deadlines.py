"""Deadlines and hang-ups against a real server: a queued request past its ``timeout`` gets a 504
on time, a running one ends with ``finish_reason: "timeout"`` and what it generated, clients
that hang up (streaming or not) cancel their requests, and afterwards every KV block is back,
nothing is stuck, the other requests' outputs are right and resident memory is flat.

The server (shared with the metrics tests) runs one sequence at a time in its short-prompt
generation bucket (so a second request queues), eight in its long-prompt bucket.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import GENERATE_MODEL, MAX_TIMEOUT_S, Server, async_wait_for, resident_memory_bytes
from tests.e2e.reference import assert_greedy_close, greedy_reference

# How late a deadline may fire: the gateway's timer, plus scheduling noise on a loaded 2-core box.
MAX_LATENESS_S = 0.5
IDLE_WAIT_S = 20.0
# The deadline of the request that holds the short bucket while another waits out its 1 s.
BUSY_TIMEOUT_S = 5.0
# Resident memory may grow this much over a second round of 100 hang-ups and timeouts.
MAX_RSS_GROWTH_BYTES = 64 * 1024**2

# Over 48 tokens, so it routes to the long-prompt bucket (eight sequences at a time).
LONG_PROMPT = (
    "The history of the canal is a long one. Engineers drew plans for locks and weirs, merchants paid for the "
    "digging, and boatmen carried coal, grain and timber between the towns along its banks for two centuries. "
    "Write a short story about one of those boatmen:"
)


@pytest.fixture(scope="module")
def deadline_server(one_sequence_server: Server) -> tuple[str, Any]:
    """The shared server whose short generation bucket runs one sequence (timeouts up to 120 s)."""
    return one_sequence_server.url, one_sequence_server.proc


@pytest.fixture(scope="module")
def deadline_url(deadline_server: tuple[str, Any]) -> str:
    return deadline_server[0]


def _completion(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": GENERATE_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def _generate_stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/stats", timeout=10).json()[GENERATE_MODEL]  # type: ignore[no-any-return]


def _wait_idle(url: str) -> dict[str, Any]:
    """Poll ``/stats`` until no generation bucket has a waiting or running sequence or a used
    block; fail after ``IDLE_WAIT_S``."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        stats = _generate_stats(url)
        busy = {
            name: (b["num_waiting"], b["num_running"], b["kv_blocks_used"])
            for name, b in stats.items()
            if b["num_waiting"] or b["num_running"] or b["kv_blocks_used"]
        }
        if not busy:
            return stats
        if time.monotonic() > deadline:
            pytest.fail(f"buckets still busy after {IDLE_WAIT_S} s (waiting, running, blocks used): {busy}")
        time.sleep(0.1)


def test_a_queued_request_past_its_timeout_gets_504_on_time(deadline_url: str) -> None:
    async def run() -> tuple[httpx.Response, float, httpx.Response]:
        async with httpx.AsyncClient(base_url=f"{deadline_url}/v1", timeout=120) as client:
            # The short bucket runs one sequence: this one holds it past the other's deadline
            # (until its own, BUSY_TIMEOUT_S, or its 200th token: 28 s on a loaded 2-core box).
            body = _completion("Once upon a time", 200, timeout=BUSY_TIMEOUT_S)
            busy = asyncio.create_task(client.post("/completions", json=body))

            async def busy_is_running() -> bool:
                return bool((await client.get(f"{deadline_url}/stats")).json()[GENERATE_MODEL]["le48"]["num_running"])

            await async_wait_for(busy_is_running, IDLE_WAIT_S, "the first request holds the short bucket")
            started = time.monotonic()
            late = await client.post("/completions", json=_completion("Hello there", 8, timeout=1.0))
            elapsed_s = time.monotonic() - started
            return late, elapsed_s, await busy

    late, elapsed_s, busy = asyncio.run(run())
    assert late.status_code == 504, late.text
    assert late.json()["error"]["code"] == "timeout"
    assert late.json()["error"]["type"] == "timeout_error"
    assert 1.0 <= elapsed_s < 1.0 + MAX_LATENESS_S, elapsed_s
    assert busy.status_code == 200
    assert busy.json()["choices"][0]["finish_reason"] in ("length", "timeout")
    _wait_idle(deadline_url)


@pytest.mark.parametrize("stream", [False, True])
def test_a_running_request_past_its_timeout_returns_what_it_generated(deadline_url: str, stream: bool) -> None:
    body = _completion(LONG_PROMPT, 250, timeout=2.0, stream=stream, stream_options={"include_usage": True} if stream else None)
    started = time.monotonic()
    response = httpx.post(f"{deadline_url}/v1/completions", json=body, timeout=60)
    elapsed_s = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert 2.0 <= elapsed_s < 2.0 + MAX_LATENESS_S, elapsed_s
    if stream:
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] == "timeout" and finishes.count("timeout") == 1
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        usage = chunks[-1]["usage"]
    else:
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "timeout"
        text, usage = choice["text"], response.json()["usage"]
    assert 0 < usage["completion_tokens"] < 250
    assert text
    stats = _wait_idle(deadline_url)
    assert sum(b["num_timed_out"] for b in stats.values()) >= 1


# A stop string the story never contains: the output stage holds back its length less one
# character of text, which only the core's last (timeout) event releases.
NEVER_STOP = "<<no such stop string in any story here>>"


def _text_and_tokens(response: httpx.Response, stream: bool) -> tuple[str, int, str]:
    """``(text, completion tokens, finish_reason)`` of a completion, streamed (with usage) or not."""
    if not stream:
        choice = response.json()["choices"][0]
        return choice["text"], response.json()["usage"]["completion_tokens"], choice["finish_reason"]
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return text, chunks[-1]["usage"]["completion_tokens"], finishes[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_a_timeout_mid_generation_keeps_the_text_held_back_for_stop_strings(deadline_url: str, stream: bool) -> None:
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    body = _completion(LONG_PROMPT, 250, timeout=2.0, stop=[NEVER_STOP], **extra)
    timed_out = httpx.post(f"{deadline_url}/v1/completions", json=body, timeout=60)
    assert timed_out.status_code == 200, timed_out.text
    text, num_tokens, finish_reason = _text_and_tokens(timed_out, stream)
    assert finish_reason == "timeout" and 0 < num_tokens < 250
    # The same tokens again, with no deadline: the text of every token generated before it.
    whole = httpx.post(f"{deadline_url}/v1/completions", json=_completion(LONG_PROMPT, num_tokens, stop=[NEVER_STOP]), timeout=60)
    assert whole.json()["choices"][0]["finish_reason"] == "length"
    assert text == whole.json()["choices"][0]["text"]
    _wait_idle(deadline_url)


def test_a_timeout_over_the_models_cap_is_refused(deadline_url: str) -> None:
    response = httpx.post(f"{deadline_url}/v1/completions", json=_completion("Hi", 4, timeout=MAX_TIMEOUT_S + 1))
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("timeout", "timeout_exceeded")


async def _hang_up_streaming(client: httpx.AsyncClient, body: dict[str, Any], num_chunks: int) -> None:
    """Read ``num_chunks`` SSE events of a streamed completion, then close the connection."""
    async with client.stream("POST", "/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= num_chunks:
                break


async def _hang_up_waiting(base_url: str, body: dict[str, Any], after_s: float) -> None:
    """Send a non-streamed completion and give up on it (closing the connection) after ``after_s``."""
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(after_s, connect=10)) as client:
        try:
            response = await client.post("/completions", json=body)
        except httpx.ReadTimeout:
            return
    pytest.fail(f"the request finished before the client hung up: {response.status_code} {response.text[:300]}")


def test_fifty_hang_ups_leave_the_pool_whole_and_other_requests_right(deadline_url: str, hf_causal_lm: Any) -> None:
    model, tokenizer = hf_causal_lm
    prompts = [f"{LONG_PROMPT} The boatman's name was {name}." for name in ("Tom", "Ada", "Wil", "Meg")]
    base_url = f"{deadline_url}/v1"
    before = _wait_idle(deadline_url)
    rng = random.Random(7)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            keepers = [
                asyncio.create_task(client.post("/completions", json=_completion(p, 24, return_token_ids=True)))
                for p in prompts
            ]
            hang_ups = []
            for index in range(50):
                body = _completion(prompts[index % len(prompts)], 200)
                if index % 2:
                    hang_ups.append(_hang_up_streaming(client, body, rng.randint(2, 6)))
                else:
                    hang_ups.append(_hang_up_waiting(base_url, body, rng.uniform(0.3, 1.5)))
            await asyncio.gather(*hang_ups)
            return list(await asyncio.gather(*keepers))

    started = time.monotonic()
    keepers = asyncio.run(run())
    stats = _wait_idle(deadline_url)
    # 50 requests of 200 tokens each would take minutes; hung-up ones were dropped within a step.
    assert time.monotonic() - started < 120
    assert httpx.get(f"{deadline_url}/health").json()["status"] == "ok"
    cancelled = sum(b["num_cancelled"] for b in stats.values()) - sum(b["num_cancelled"] for b in before.values())
    assert cancelled == 50
    for prompt, response in zip(prompts, keepers):
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        ids = choice["prompt_token_ids"]
        assert_greedy_close(model, ids, choice["token_ids"], greedy_reference(model, ids, 24))
    del tokenizer


def _random_abort_round(base_url: str, rng: random.Random, num_requests: int) -> list[tuple[int, str | None]]:
    """``num_requests`` requests at once, each hanging up, timing out or finishing at random;
    returns the status and error code of those that got an answer."""

    async def one(client: httpx.AsyncClient, index: int) -> tuple[int, str | None] | None:
        prompt = LONG_PROMPT if index % 3 else "Tell me about rivers"
        kind = rng.choice(["stream_hang_up", "wait_hang_up", "timeout", "finish"])
        if kind == "stream_hang_up":
            await _hang_up_streaming(client, _completion(prompt, 100), rng.randint(1, 4))
            return None
        if kind == "wait_hang_up":
            await _hang_up_waiting(base_url, _completion(prompt, 100), rng.uniform(0.2, 1.0))
            return None
        timeout = rng.uniform(0.2, 2.0) if kind == "timeout" else None
        response = await client.post("/completions", json=_completion(prompt, rng.randint(1, 24), timeout=timeout))
        return response.status_code, response.json()["error"]["code"] if response.status_code != 200 else None

    async def run() -> list[tuple[int, str | None] | None]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=200)) as client:
            return list(await asyncio.gather(*(one(client, i) for i in range(num_requests))))

    return [s for s in asyncio.run(run()) if s is not None]


def test_two_hundred_random_hang_ups_and_timeouts_leak_nothing(deadline_server: tuple[str, Any]) -> None:
    url, proc = deadline_server
    rng = random.Random(11)
    statuses = _random_abort_round(f"{url}/v1", rng, 100)
    _wait_idle(url)
    warm_rss = resident_memory_bytes(proc)
    statuses += _random_abort_round(f"{url}/v1", rng, 100)
    stats = _wait_idle(url)
    growth = resident_memory_bytes(proc) - warm_rss
    print(f"resident memory after round 1: {warm_rss / 2**20:.1f} MiB; growth over round 2: {growth / 2**20:.1f} MiB")
    # A short timeout behind a busy queue may be refused at once (429) or expire queued (504).
    assert set(statuses) <= {(200, None), (429, "queue_wait_exceeds_timeout"), (504, "timeout")}, statuses
    assert growth < MAX_RSS_GROWTH_BYTES, f"resident memory grew {growth / 2**20:.1f} MiB over 100 requests"
    for bucket in stats.values():
        assert bucket["kv_blocks_used"] == 0
        assert bucket["num_waiting"] == 0 and bucket["num_running"] == 0
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
