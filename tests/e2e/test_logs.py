"""One structured log event per finished request, with its timeline."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx

from tests.e2e.conftest import EMBED_MODEL, GENERATE_MODEL, async_wait_for, wait_for


def _finished_events(log_path: Path) -> list[dict]:
    events = []
    for line in log_path.read_text().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == "request_finished":
                events.append(event)
    return events


def _wait_for_event(log_path: Path, request_id: str) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [e for e in _finished_events(log_path) if e["request_id"] == request_id]
        if found:
            assert len(found) == 1, f"logged {len(found)} times"
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no request_finished event for {request_id}")


def test_generation_request_logs_its_timeline(openai_client, server_log: Path) -> None:
    out = openai_client.completions.create(model=GENERATE_MODEL, prompt="Hello there", max_tokens=3, temperature=0)
    event = _wait_for_event(server_log, out.id)
    assert event["model"] == GENERATE_MODEL and event["bucket"] == "le48" and event["outcome"] == "ok"
    assert event["prompt_tokens"] == out.usage.prompt_tokens and event["completion_tokens"] == 3
    timeline = event["timeline_ms"]
    assert timeline["arrival"] == 0 <= timeline["enqueued"] <= timeline["first_token"] <= timeline["finished"]
    assert event["num_batches"] == 3 and {"id", "index"} <= set(event["batches"][0])


def test_embedding_request_logs_its_batch(openai_client, server_log: Path) -> None:
    before = len([e for e in _finished_events(server_log) if e["model"] == EMBED_MODEL])
    openai_client.embeddings.create(model=EMBED_MODEL, input="a sentence to embed")
    deadline = time.monotonic() + 10
    while len([e for e in _finished_events(server_log) if e["model"] == EMBED_MODEL]) == before:
        assert time.monotonic() < deadline, "no request_finished event for the embedding"
        time.sleep(0.1)
    event = [e for e in _finished_events(server_log) if e["model"] == EMBED_MODEL][-1]
    assert event["outcome"] == "ok" and event["num_batches"] == 1 and "finished" in event["timeline_ms"]


def _events(log_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in log_path.read_text().splitlines() if f'"event": "{name}"' in line]


def test_a_hang_up_mid_generation_logs_its_tokens_and_outcome(server_url: str, server_log: Path) -> None:
    """A non-streamed client that hangs up while its request generates: its ``request_finished``
    counts the tokens generated, and its ``http_request`` has status 499 and outcome ``cancelled``."""
    num_cancelled_before = len([e for e in _events(server_log, "request_finished") if e["outcome"] == "cancelled"])
    body = {"model": GENERATE_MODEL, "prompt": "Once upon a time", "max_tokens": 250, "temperature": 0, "ignore_eos": True}

    async def hang_up() -> None:
        async with httpx.AsyncClient(base_url=server_url, timeout=120) as client:
            steps_before = (await client.get("/stats")).json()[GENERATE_MODEL]["le48"]["num_steps"]
            waiting = asyncio.ensure_future(client.post("/v1/completions", json=body))

            async def has_decoded() -> bool:  # a prefill and a few decodes since it was sent
                return bool((await client.get("/stats")).json()[GENERATE_MODEL]["le48"]["num_steps"] >= steps_before + 4)

            await async_wait_for(has_decoded, 60, "the request generates")
            waiting.cancel()  # the connection closes under it

    asyncio.run(hang_up())
    finished = wait_for(
        lambda: [e for e in _events(server_log, "request_finished") if e["outcome"] == "cancelled"][num_cancelled_before:],
        30, "the hung-up request is logged",
    )
    assert finished[-1]["completion_tokens"] > 0
    access = wait_for(
        lambda: [e for e in _events(server_log, "http_request") if e["path"] == "/v1/completions" and e["status"] == 499],
        30, "its http_request event",
    )
    assert access[-1]["outcome"] == "cancelled"
