"""Turning a request's events into OpenAI responses (whole or SSE chunks), deadlines and hang-ups included."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from buckets.errors import DeadlineExceededError, WorkerCrashedError
from buckets.request import ErrorEvent, GenerationRequest, Request as CoreRequest, RequestEvent, TokenEvent
from gateway.engine import ServedModel
from gateway.errors import APIError, deadline_exceeded, worker_crashed
from gateway.streams import ChannelItem, EventChannel, Interrupt, RequestWatch


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(served: ServedModel, request: GenerationRequest, chat: bool, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": request.request_id, "object": kind, "created": int(time.time()), "model": served.config.name}


async def first_event(
    served: ServedModel, request: CoreRequest, channel: EventChannel, watch: RequestWatch
) -> RequestEvent:
    """Wait for the request's first event (its first token, or its embedding).

    Raises:
        APIError: 504 ``timeout`` when the deadline passed first; 499 when the client hung up
            first; 500 when the core failed the request. In each case the request is cancelled,
            the watch closed and the outcome logged.
    """
    try:
        item = await channel.next()
    except BaseException:
        request.cancel()
        watch.close()
        raise
    if isinstance(item, (Interrupt, ErrorEvent)):
        request.cancel()
        watch.close()
        raise _failure(served, request, item)
    return item


def _failure(served: ServedModel, request: CoreRequest, item: Interrupt | ErrorEvent) -> APIError:
    """Log a request that ended without a result, and the error its client gets."""
    if isinstance(item, Interrupt) and item.reason == "disconnected":
        served.finish(request, 0, "cancelled")
        return APIError(499, "the client closed the request", "invalid_request_error", code="client_closed_request")
    if isinstance(item, Interrupt) or isinstance(item.error, DeadlineExceededError):
        served.finish(request, 0, "timeout")
        waited_s = time.monotonic() - request.timeline.get("arrival", time.monotonic())
        return deadline_exceeded(waited_s)
    served.finish(request, 0, "error")
    return core_failure(item.error)


def core_failure(error: Exception) -> APIError:
    """The API error of a request the core failed: 503 with ``Retry-After`` when its slice's
    worker process died (:class:`WorkerCrashedError`), else 500."""
    if isinstance(error, WorkerCrashedError):
        return worker_crashed(error)
    return APIError(500, f"request failed: {error}", "server_error")


async def collect_response(
    served: ServedModel,
    request: GenerationRequest,
    channel: EventChannel,
    chat: bool,
    first: TokenEvent,
    watch: RequestWatch,
    return_token_ids: bool = False,
) -> dict[str, Any]:
    """Gather the whole generation, from its ``first`` event on; return the completion object.

    A deadline that passes mid-generation ends it with ``finish_reason="timeout"`` and what was
    generated so far.

    Raises:
        APIError: 500 when the core failed the request; 499 when the client hung up.
    """
    pieces: list[str] = []
    token_ids: list[int] = []
    num_completion_tokens = 0
    finish_reason: str | None = None
    item: ChannelItem = first
    try:
        while True:
            if isinstance(item, Interrupt) and item.reason == "timeout":
                finish_reason = "timeout"
                break
            if isinstance(item, (Interrupt, ErrorEvent)):
                raise _failure(served, request, item)
            assert isinstance(item, TokenEvent)
            pieces.append(item.text)
            token_ids.extend(item.token_ids)
            num_completion_tokens = item.num_completion_tokens
            if item.finish_reason is not None:
                finish_reason = item.finish_reason
                break
            item = await channel.next()
    finally:
        watch.close()
        request.cancel()  # no-op once finished; frees the sequence if the client went away
    served.finish(request, num_completion_tokens, _outcome(finish_reason))
    text = "".join(pieces)
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if return_token_ids:
        choice.update(prompt_token_ids=request.prompt_token_ids, token_ids=token_ids)
    body = _envelope(served, request, chat, chunk=False)
    body.update(choices=[choice], usage=_usage(request.num_prompt_tokens, num_completion_tokens))
    return body


def _outcome(finish_reason: str | None) -> str:
    return "timeout" if finish_reason == "timeout" else "ok"


def _sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def _chunk(served: ServedModel, request: GenerationRequest, chat: bool, text: str | None, finish: str | None, role: bool = False) -> str:
    body = _envelope(served, request, chat, chunk=True)
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    body["choices"] = [choice]
    return _sse(body)


async def stream_response(
    served: ServedModel,
    request: GenerationRequest,
    channel: EventChannel,
    chat: bool,
    include_usage: bool,
    first: TokenEvent,
    watch: RequestWatch,
) -> AsyncIterator[str]:
    """SSE events from the ``first`` event on: a chunk per text delta, the last one with
    ``finish_reason`` (``timeout`` when the deadline passed mid-generation), optionally a usage
    chunk, then ``data: [DONE]``. A client that disconnects cancels the request."""
    outcome, completion_tokens = "cancelled", 0
    item: ChannelItem = first
    try:
        if chat:
            yield _chunk(served, request, chat, "", None, role=True)
        while True:
            if isinstance(item, Interrupt) and item.reason != "timeout":
                break  # the client hung up before the stream began
            if isinstance(item, Interrupt):
                outcome = "timeout"
                yield _chunk(served, request, chat, None if chat else "", "timeout")
                finish_reason: str | None = "timeout"
            elif isinstance(item, ErrorEvent):
                outcome = "error"
                error = core_failure(item.error)
                yield _sse(error.body())
                break
            else:
                completion_tokens = item.num_completion_tokens
                finish_reason = item.finish_reason
                if item.text or finish_reason:
                    yield _chunk(served, request, chat, item.text, finish_reason)
                if finish_reason is not None:
                    outcome = _outcome(finish_reason)
            if finish_reason is not None:
                if include_usage:
                    usage = _envelope(served, request, chat, chunk=True)
                    usage.update(choices=[], usage=_usage(request.num_prompt_tokens, completion_tokens))
                    yield _sse(usage)
                break
            item = await channel.next()
        yield _sse("[DONE]")
    finally:
        watch.close()
        request.cancel()
        served.finish(request, completion_tokens, outcome)
