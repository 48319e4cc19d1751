"""Turning a request's events into OpenAI responses (whole or SSE chunks), deadlines and hang-ups included.

Each request is logged once, with the outcome derived from the last item its wait saw
(:func:`gateway.outcome.outcome_of`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from buckets.request import ErrorEvent, GenerationRequest, Request as CoreRequest, RequestEvent, TokenEvent
from gateway.engine import ServedModel
from gateway.errors import APIError, deadline_exceeded, to_api_error
from gateway.logprobs_format import ChoiceLogprobs
from gateway.outcome import outcome_of
from gateway.response_format import ResponseFormat
from gateway.streams import ChannelItem, EventChannel, Interrupt, InterruptReason, RequestWatch


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(served: ServedModel, request: GenerationRequest, fmt: ResponseFormat, is_chunk: bool) -> dict[str, Any]:
    return {"id": request.request_id, "object": fmt.object_name(is_chunk), "created": int(time.time()), "model": served.config.name}


def finish(served: ServedModel, request: CoreRequest, completion_tokens: int, last: ChannelItem | None, watch: RequestWatch) -> None:
    """Log ``request`` once, its outcome derived from ``last``, the final item its wait saw."""
    served.finish(request, completion_tokens, outcome_of(last, watch.reason).value)


async def first_event(
    served: ServedModel, request: CoreRequest, channel: EventChannel, watch: RequestWatch
) -> RequestEvent:
    """Wait for the request's first event (its first token, or its embedding).

    Raises:
        APIError: 504 ``timeout`` when the deadline passed first; 499 when the client hung up
            first; 500 (503 for a crashed worker) when the core failed the request. In each case
            the request is cancelled, the watch closed and the outcome logged.
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
        raise _failure(served, request, item, watch)
    return item


def _failure(served: ServedModel, request: CoreRequest, item: Interrupt | ErrorEvent, watch: RequestWatch) -> APIError:
    """Log a request that ended without a result, and the error its client gets."""
    finish(served, request, 0, item, watch)
    if isinstance(item, Interrupt) and item.reason is InterruptReason.DISCONNECTED:
        return APIError(499, "the client closed the request", "invalid_request_error", code="client_closed_request")
    waited_s = time.monotonic() - request.timeline.get("arrival", time.monotonic())
    if isinstance(item, Interrupt):
        return deadline_exceeded(waited_s)
    return to_api_error(item.error, waited_s=waited_s)


async def collect_response(
    served: ServedModel,
    request: GenerationRequest,
    channel: EventChannel,
    fmt: ResponseFormat,
    first: TokenEvent,
    watch: RequestWatch,
    return_token_ids: bool = False,
    echo_text: str = "",
    logprobs: ChoiceLogprobs | None = None,
) -> dict[str, Any]:
    """Gather the whole generation, from its ``first`` event on; return the completion object.

    A deadline that passes mid-generation ends it with ``finish_reason="timeout"`` and what was
    generated so far. ``echo_text`` comes before the generated text; ``logprobs`` (when the
    request asked) fills the choice's ``logprobs``.

    Raises:
        APIError: 500 when the core failed the request; 499 when the client hung up.
    """
    pieces: list[str] = [echo_text]
    token_ids: list[int] = []
    num_completion_tokens = 0
    finish_reason: str | None = None
    item: ChannelItem = first
    try:
        while True:
            if isinstance(item, Interrupt) and item.reason is InterruptReason.TIMEOUT:
                finish_reason = "timeout"
                break
            if isinstance(item, (Interrupt, ErrorEvent)):
                raise _failure(served, request, item, watch)
            assert isinstance(item, TokenEvent)
            pieces.append(item.text)
            token_ids.extend(item.token_ids)
            if logprobs is not None:
                logprobs.add(item)
            num_completion_tokens = item.num_completion_tokens
            if item.finish_reason is not None:
                finish_reason = item.finish_reason
                break
            item = await channel.next()
    finally:
        watch.close()
        request.cancel()  # no-op once finished; frees the sequence if the client went away
    finish(served, request, num_completion_tokens, item, watch)
    choice = fmt.choice("".join(pieces), finish_reason)
    if logprobs is not None:
        choice["logprobs"] = logprobs.whole()
    if return_token_ids:
        choice.update(prompt_token_ids=request.prompt_token_ids, token_ids=token_ids)
    body = _envelope(served, request, fmt, is_chunk=False)
    body.update(choices=[choice], usage=_usage(request.num_prompt_tokens, num_completion_tokens))
    return body


def _sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def _chunk(
    served: ServedModel, request: GenerationRequest, fmt: ResponseFormat, text: str | None, finish_reason: str | None,
    has_role: bool = False, logprobs: dict[str, Any] | None = None,
) -> str:
    body = _envelope(served, request, fmt, is_chunk=True)
    choice = fmt.chunk_choice(text, finish_reason, has_role)
    if logprobs is not None:
        choice["logprobs"] = logprobs
    body["choices"] = [choice]
    return _sse(body)


async def stream_response(
    served: ServedModel,
    request: GenerationRequest,
    channel: EventChannel,
    fmt: ResponseFormat,
    include_usage: bool,
    first: TokenEvent,
    watch: RequestWatch,
    echo_text: str = "",
    logprobs: ChoiceLogprobs | None = None,
) -> AsyncIterator[str]:
    """SSE events from the ``first`` event on: a chunk per text delta (per event with tokens
    when the request asked for ``logprobs``, each chunk carrying its tokens'), the first
    beginning with ``echo_text``, the last one with ``finish_reason`` (``timeout`` when the
    deadline passed mid-generation), optionally a usage chunk, then ``data: [DONE]``. A client
    that disconnects cancels the request."""
    completion_tokens = 0
    prefix = echo_text
    item: ChannelItem = first
    try:
        if fmt is ResponseFormat.CHAT:
            yield _chunk(served, request, fmt, "", None, has_role=True)
        while True:
            if isinstance(item, Interrupt) and item.reason is InterruptReason.DISCONNECTED:
                break  # the client hung up before the stream began
            finish_reason: str | None
            if isinstance(item, Interrupt):
                finish_reason = "timeout"
                yield _chunk(served, request, fmt, None if fmt is ResponseFormat.CHAT else "", finish_reason)
            elif isinstance(item, ErrorEvent):
                yield _sse(to_api_error(item.error).body())
                break
            else:
                assert isinstance(item, TokenEvent)
                completion_tokens = item.num_completion_tokens
                finish_reason = item.finish_reason
                text, prefix = prefix + item.text, ""
                if text or finish_reason or (logprobs is not None and item.token_ids):
                    chunk_logprobs = None if logprobs is None else logprobs.chunk(item)
                    yield _chunk(served, request, fmt, text, finish_reason, logprobs=chunk_logprobs)
            if finish_reason is not None:
                if include_usage:
                    usage = _envelope(served, request, fmt, is_chunk=True)
                    usage.update(choices=[], usage=_usage(request.num_prompt_tokens, completion_tokens))
                    yield _sse(usage)
                break
            item = await channel.next()
        yield _sse("[DONE]")
    finally:
        watch.close()
        request.cancel()
        finish(served, request, completion_tokens, item, watch)
