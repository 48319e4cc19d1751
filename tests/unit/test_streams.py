"""The edge's waits without a server: a deadline that passes mid-generation leaves the end to the
core (its last event carries the text held back for stop strings), the edge's own deadline is a
backstop; a queued request's deadline interrupts at once; a hang-up logs the tokens generated."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from buckets.request import GenerationRequest, TokenEvent
from gateway.errors import APIError
from gateway.response_format import ResponseFormat
from gateway.routes.choices import PromptSource
from gateway.routes.generation import collect_response, first_event, stream_response
from gateway.streams import EventChannel, Interrupt, InterruptReason, RequestWatch


class FakeServed:
    """What the response code reads of a served model, recording each finished request."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(name="m")
        self.loaded = SimpleNamespace(tokenizer=None)  # no request here asks for logprobs
        self.finished: list[tuple[int, str]] = []

    def finish(self, request: Any, completion_tokens: int, outcome: str) -> None:
        self.finished.append((completion_tokens, outcome))


def _request(channel: EventChannel, deadline_s: float | None = None) -> GenerationRequest:
    return GenerationRequest(request_id="cmpl-1", prompt_token_ids=[1, 2], sink=channel.sink, deadline_s=deadline_s)


def _token(text: str, n: int, finish_reason: str | None = None) -> TokenEvent:
    return TokenEvent(text=text, token_ids=[] if finish_reason == "timeout" else [n], finish_reason=finish_reason,
                      num_prompt_tokens=2, num_completion_tokens=n)


async def _until(condition: Any) -> None:
    """Yield to the loop until ``condition()`` holds (its timers and call_soon callbacks run)."""
    while not condition():
        await asyncio.sleep(0)


def test_a_deadline_mid_generation_waits_for_the_cores_last_event() -> None:
    async def run() -> tuple[dict[str, Any], FakeServed, GenerationRequest]:
        served, channel = FakeServed(), EventChannel()
        request = _request(channel, deadline_s=time.monotonic())
        channel.sink(_token("Hello", 1))
        first = await channel.next()
        watch = RequestWatch([request], [channel], request.deadline_s, None, backstop_s=60.0)
        await _until(lambda: watch.reason is not None)  # the deadline has passed on the edge
        assert not request.is_cancelled  # the core ends it, with what it held back
        channel.sink(_token(" wor", 2))
        channel.sink(_token("ld", 3, finish_reason="timeout"))  # the core's drop at its next step
        assert isinstance(first, TokenEvent)
        body = await collect_response(served, "cmpl-1", [PromptSource(request, channel, "", 0)], [first], 1, ResponseFormat.COMPLETION, watch)
        return body, served, request

    body, served, request = asyncio.run(run())
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("Hello world", "timeout")
    assert body["usage"]["completion_tokens"] == 3
    assert served.finished == [(3, "timeout")]


def test_a_streamed_deadline_mid_generation_sends_the_held_back_text() -> None:
    async def run() -> list[str]:
        served, channel = FakeServed(), EventChannel()
        request = _request(channel, deadline_s=time.monotonic())
        channel.sink(_token("Hi", 1))
        first = await channel.next()
        assert isinstance(first, TokenEvent)
        watch = RequestWatch([request], [channel], request.deadline_s, None, backstop_s=60.0)
        await _until(lambda: watch.reason is not None)
        channel.sink(_token(" there", 2, finish_reason="timeout"))
        sources = [PromptSource(request, channel, "", 0)]
        return [chunk async for chunk in stream_response(served, "cmpl-1", sources, [first], 1, ResponseFormat.COMPLETION, False, watch)]

    chunks = asyncio.run(run())
    assert '" there"' in chunks[-2] and '"timeout"' in chunks[-2] and chunks[-1] == "data: [DONE]\n\n"


def test_the_edge_ends_a_generating_request_itself_when_the_core_is_late() -> None:
    async def run() -> tuple[Any, GenerationRequest]:
        channel = EventChannel()
        request = _request(channel, deadline_s=time.monotonic())
        channel.sink(_token("Hi", 1))
        await channel.next()
        RequestWatch([request], [channel], request.deadline_s, None, backstop_s=0.0)
        return await channel.next(), request

    item, request = asyncio.run(run())
    assert item == Interrupt(InterruptReason.TIMEOUT)
    assert request.cancel_reason == "timeout"


def test_a_queued_request_past_its_deadline_is_interrupted_at_once() -> None:
    async def run() -> tuple[APIError, FakeServed, GenerationRequest]:
        served, channel = FakeServed(), EventChannel()
        request = _request(channel, deadline_s=time.monotonic())
        watch = RequestWatch([request], [channel], request.deadline_s, None, backstop_s=60.0)
        with pytest.raises(APIError) as refused:
            await first_event(served, request, channel, watch)
        return refused.value, served, request

    error, served, request = asyncio.run(run())
    assert (error.status_code, error.code) == (504, "timeout")
    assert request.cancel_reason == "timeout" and served.finished == [(0, "timeout")]


def test_a_hang_up_mid_generation_logs_the_tokens_generated() -> None:
    async def run() -> FakeServed:
        served, channel = FakeServed(), EventChannel()
        request = _request(channel)
        watch = RequestWatch([request], [channel], None, None)
        channel.sink(_token("a", 1))
        channel.sink(_token("b", 2))
        first = await channel.next()
        assert isinstance(first, TokenEvent)
        await _until(lambda: channel.has_events)
        watch._fire(InterruptReason.DISCONNECTED)  # what the disconnect watch does on http.disconnect
        with pytest.raises(APIError) as closed:
            await collect_response(served, "cmpl-1", [PromptSource(request, channel, "", 0)], [first], 1, ResponseFormat.COMPLETION, watch)
        assert closed.value.status_code == 499
        return served

    served = asyncio.run(run())
    assert served.finished == [(2, "cancelled")]
