"""Turning a generation request's token events into OpenAI responses (whole or SSE chunks)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from buckets.request import ErrorEvent, GenerationRequest, TokenEvent
from gateway.engine import ServedModel
from gateway.errors import APIError
from gateway.logging import log_request_finished
from gateway.streams import EventChannel


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(served: ServedModel, request: GenerationRequest, chat: bool, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": request.request_id, "object": kind, "created": int(time.time()), "model": served.config.name}


async def collect_response(
    served: ServedModel, request: GenerationRequest, channel: EventChannel, chat: bool, return_token_ids: bool = False
) -> dict[str, Any]:
    """Wait for the whole generation; return the completion object.

    Raises:
        APIError: 500 when the core failed the request.
    """
    pieces: list[str] = []
    token_ids: list[int] = []
    last: TokenEvent | None = None
    try:
        async for event in channel.events():
            if isinstance(event, ErrorEvent):
                log_request_finished(served.config.name, request, 0, "error")
                raise APIError(500, f"generation failed: {event.error}", "server_error")
            assert isinstance(event, TokenEvent)
            pieces.append(event.text)
            token_ids.extend(event.token_ids)
            last = event
    finally:
        request.cancel()  # no-op once finished; frees the sequence if the client went away
    assert last is not None
    log_request_finished(served.config.name, request, last.num_completion_tokens, "ok")
    text = "".join(pieces)
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": last.finish_reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
    if return_token_ids:
        choice.update(prompt_token_ids=request.prompt_token_ids, token_ids=token_ids)
    body = _envelope(served, request, chat, chunk=False)
    body.update(choices=[choice], usage=_usage(last.num_prompt_tokens, last.num_completion_tokens))
    return body


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
    served: ServedModel, request: GenerationRequest, channel: EventChannel, chat: bool, include_usage: bool
) -> AsyncIterator[str]:
    """SSE events: a chunk per text delta, the last one with ``finish_reason``, optionally a
    usage chunk, then ``data: [DONE]``. A client that disconnects cancels the request."""
    outcome, completion_tokens = "cancelled", 0
    try:
        if chat:
            yield _chunk(served, request, chat, "", None, role=True)
        async for event in channel.events():
            if isinstance(event, ErrorEvent):
                outcome = "error"
                error = APIError(500, f"generation failed: {event.error}", "server_error")
                yield _sse(error.body())
                break
            assert isinstance(event, TokenEvent)
            completion_tokens = event.num_completion_tokens
            if event.text or event.finish_reason:
                yield _chunk(served, request, chat, event.text, event.finish_reason)
            if event.finish_reason is not None:
                outcome = "ok"
                if include_usage:
                    usage = _envelope(served, request, chat, chunk=True)
                    usage.update(choices=[], usage=_usage(event.num_prompt_tokens, event.num_completion_tokens))
                    yield _sse(usage)
        yield _sse("[DONE]")
    finally:
        request.cancel()
        log_request_finished(served.config.name, request, completion_tokens, outcome)
