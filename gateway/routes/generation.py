"""Turning a request's events into OpenAI responses (whole or SSE chunks), deadlines and hang-ups included.

Each request is logged once, with the outcome derived from the last item its wait saw
(:func:`gateway.outcome.outcome_of`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from buckets.request import ErrorEvent, Request as CoreRequest, RequestEvent, TokenEvent
from gateway.access_log import note_outcome
from gateway.engine import ServedModel
from gateway.errors import APIError, deadline_exceeded, to_api_error
from gateway.logprobs_format import choice_logprobs
from gateway.outcome import outcome_of
from gateway.response_format import ResponseFormat
from gateway.routes.choices import Choice, PromptSource, make_choices, merged_events, record
from gateway.streams import ChannelItem, EventChannel, Interrupt, InterruptReason, RequestWatch
from gateway.tool_format import call_deltas, finish_reason_of, message_with_calls
from gateway.tools import ToolPlan


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(served: ServedModel, response_id: str, fmt: ResponseFormat, is_chunk: bool) -> dict[str, Any]:
    return {"id": response_id, "object": fmt.object_name(is_chunk), "created": int(time.time()), "model": served.config.name}


def finish(served: ServedModel, request: CoreRequest, completion_tokens: int, last: ChannelItem | None, watch: RequestWatch) -> None:
    """Log ``request`` once, its outcome derived from ``last``, the final item its wait saw; the
    HTTP request's access-log event gets the same outcome."""
    outcome = outcome_of(last, watch.reason).value
    note_outcome(outcome)
    served.finish(request, completion_tokens, outcome)


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


def _failure(
    served: ServedModel, request: CoreRequest, item: Interrupt | ErrorEvent, watch: RequestWatch, completion_tokens: int = 0
) -> APIError:
    """Log a request that ended without a result (after ``completion_tokens`` generated), and the
    error its client gets."""
    finish(served, request, completion_tokens, item, watch)
    if isinstance(item, Interrupt) and item.reason is InterruptReason.DISCONNECTED:
        return APIError(499, "the client closed the request", "invalid_request_error", code="client_closed_request")
    waited_s = time.monotonic() - request.timeline.get("arrival", time.monotonic())
    if isinstance(item, Interrupt):
        return deadline_exceeded(waited_s)
    return to_api_error(item.error, waited_s=waited_s)


async def first_events(served: ServedModel, sources: list[PromptSource], watch: RequestWatch) -> list[ChannelItem]:
    """The first event of each prompt's request (:func:`first_event`): every prompt has started,
    or the call fails with the first failure's error, its other requests cancelled and logged."""
    firsts: list[ChannelItem] = []
    for k, source in enumerate(sources):
        try:
            firsts.append(await first_event(served, source.request, source.channel, watch))
        except BaseException:
            for other in sources[:k] + sources[k + 1 :]:
                other.request.cancel()
                finish(served, other.request, other.num_completion_tokens, other.last, watch)
            raise
        record(source, firsts[-1])
    return firsts


def _finish_all(served: ServedModel, sources: list[PromptSource], watch: RequestWatch) -> None:
    """Close the watch, cancel what still runs (a no-op once finished) and log each request."""
    watch.close()
    for source in sources:
        source.request.cancel()
        finish(served, source.request, source.num_completion_tokens, source.last, watch)


def _usage_of(sources: list[PromptSource]) -> dict[str, int]:
    """Usage over the whole call: each prompt's tokens once, every choice's completion tokens."""
    return _usage(sum(s.request.num_prompt_tokens for s in sources), sum(s.num_completion_tokens for s in sources))


def _choices(
    served: ServedModel, sources: list[PromptSource], n: int, fmt: ResponseFormat, tools: ToolPlan | None
) -> dict[int, Choice]:
    """Every choice of the call by ``index``, each with its own logprobs view when asked and
    its own reader of tool calls when its text may hold them."""
    choices = make_choices(sources, n)
    for choice in choices.values():
        choice.logprobs = choice_logprobs(choice.source.request, served.loaded.tokenizer, is_chat=fmt is ResponseFormat.CHAT)
        choice.tool_reader = tools.reader() if tools is not None else None
    return choices


def _choice_body(fmt: ResponseFormat, choice: Choice, echo: bool, return_token_ids: bool) -> dict[str, Any]:
    """One choice of a whole response; with ``echo`` the prompt's text comes first (the prompt's
    token ids are ``choice.source.request.prompt_token_ids``), and with ``logprobs`` its
    logprobs (the prompt's first, when echoed)."""
    text = choice.source.prompt_text + choice.text if echo else choice.text
    body = fmt.choice(text, choice.finish_reason)
    body["index"] = choice.index
    if choice.logprobs is not None:
        body["logprobs"] = choice.logprobs.whole()
    if return_token_ids:
        body.update(prompt_token_ids=choice.source.request.prompt_token_ids, token_ids=choice.token_ids)
    if choice.tool_reader is not None:
        parsed = choice.tool_reader.read_whole(choice.text)
        body.update(message=message_with_calls(parsed), finish_reason=finish_reason_of(parsed, choice.finish_reason))
    return body


async def collect_response(
    served: ServedModel,
    response_id: str,
    sources: list[PromptSource],
    firsts: list[ChannelItem],
    n: int,
    fmt: ResponseFormat,
    watch: RequestWatch,
    echo: bool = False,
    return_token_ids: bool = False,
    tools: ToolPlan | None = None,
) -> dict[str, Any]:
    """Gather every choice of every prompt, from their ``firsts`` events on; return the
    completion object, ``choices`` sorted by ``index`` (with ``tools``, a choice's tool calls
    read out of its text).

    A deadline that passes mid-generation ends each unfinished choice with
    ``finish_reason="timeout"`` and what it generated so far.

    Raises:
        APIError: 500 when the core failed a request; 499 when the client hung up.
    """
    choices = _choices(served, sources, n, fmt, tools)
    failed: PromptSource | None = None
    try:
        async for source, item in merged_events(sources, firsts):
            record(source, item)
            if isinstance(item, Interrupt) and item.reason is InterruptReason.TIMEOUT:
                for choice in choices.values():
                    choice.finish_reason = choice.finish_reason or "timeout"
                break
            if isinstance(item, (Interrupt, ErrorEvent)):
                failed = source
                source.request.cancel()
                raise _failure(served, source.request, item, watch, source.num_completion_tokens)  # logs it
            assert isinstance(item, TokenEvent)
            choice = choices[source.first_index + item.index]
            choice.pieces.append(item.text)
            choice.token_ids.extend(item.token_ids)
            choice.finish_reason = item.finish_reason or choice.finish_reason
            if choice.logprobs is not None:
                choice.logprobs.add(item)
    finally:
        _finish_all(served, [s for s in sources if s is not failed], watch)
    body = _envelope(served, response_id, fmt, is_chunk=False)
    body.update(
        choices=[_choice_body(fmt, choices[i], echo, return_token_ids) for i in sorted(choices)],
        usage=_usage_of(sources),
    )
    return body


@dataclass(frozen=True)
class EchoOnlyResponse:
    """``max_tokens: 0`` with ``echo``: each prompt's ``n`` choices are its text alone, with
    ``finish_reason`` ``length``; usage counts the prompts' tokens and no completion token."""

    served: ServedModel
    response_id: str
    prompt_texts: list[str]
    num_prompt_tokens: int
    n: int
    fmt: ResponseFormat

    def _choices(self) -> list[dict[str, Any]]:
        choices = []
        for p, text in enumerate(self.prompt_texts):
            for j in range(self.n):
                choice = self.fmt.choice(text, "length")
                choice["index"] = p * self.n + j
                choices.append(choice)
        return choices

    def body(self) -> dict[str, Any]:
        body = _envelope(self.served, self.response_id, self.fmt, is_chunk=False)
        body.update(choices=self._choices(), usage=_usage(self.num_prompt_tokens, 0))
        return body

    async def chunks(self, include_usage: bool) -> AsyncIterator[str]:
        """The same as SSE: a chunk per choice, optionally usage, then ``data: [DONE]``."""
        for choice in self._choices():
            yield _chunk(self.served, self.response_id, self.fmt, choice["index"], choice["text"], "length")
        if include_usage:
            usage = _envelope(self.served, self.response_id, self.fmt, is_chunk=True)
            usage.update(choices=[], usage=_usage(self.num_prompt_tokens, 0))
            yield _sse(usage)
        yield _sse("[DONE]")


def _sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def _chunk(
    served: ServedModel, response_id: str, fmt: ResponseFormat, index: int, text: str | None, finish_reason: str | None,
    has_role: bool = False, logprobs: dict[str, Any] | None = None,
) -> str:
    body = _envelope(served, response_id, fmt, is_chunk=True)
    choice = fmt.chunk_choice(text, finish_reason, has_role)
    choice["index"] = index
    if logprobs is not None:
        choice["logprobs"] = logprobs
    body["choices"] = [choice]
    return _sse(body)


def _opening_chunks(
    served: ServedModel, response_id: str, choices: dict[int, Choice], fmt: ResponseFormat, echo: bool
) -> tuple[list[str], dict[int, str]]:
    """The chunks that open a stream's choices, in ``index`` order (a chat choice's role, an
    ``echo`` choice's prompt text), and the prompt text of each ``echo`` choice with logprobs,
    which begins its first chunk with tokens instead."""
    chunks: list[str] = []
    echo_pending: dict[int, str] = {}
    for index, choice in sorted(choices.items()):
        if fmt is ResponseFormat.CHAT:
            chunks.append(_chunk(served, response_id, fmt, index, "", None, has_role=True))
        elif echo and choice.logprobs is not None:
            echo_pending[index] = choice.source.prompt_text
        elif echo:
            chunks.append(_chunk(served, response_id, fmt, index, choice.source.prompt_text, None))
    return chunks, echo_pending


def _token_chunk(
    served: ServedModel, response_id: str, fmt: ResponseFormat, choice: Choice, item: TokenEvent, echo_pending: dict[int, str]
) -> str | None:
    """The chunk of one token event of ``choice`` (``None`` when it has nothing to send), with
    its tokens' logprobs when the choice asked; its finish reason noted on the choice."""
    choice.finish_reason = item.finish_reason
    if choice.logprobs is None:
        if item.text or item.finish_reason:
            return _chunk(served, response_id, fmt, choice.index, item.text, item.finish_reason)
        return None
    if not (item.text or item.finish_reason or item.token_ids):
        return None
    text = echo_pending.pop(choice.index, "") + item.text
    return _chunk(served, response_id, fmt, choice.index, text, item.finish_reason, logprobs=choice.logprobs.chunk(item))


def _delta_chunk(
    served: ServedModel, response_id: str, index: int, delta: dict[str, Any], finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> str:
    """A chat chunk of one choice with ``delta`` as it is."""
    body = _envelope(served, response_id, ResponseFormat.CHAT, is_chunk=True)
    body["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    return _sse(body)


def tool_token_chunks(served: ServedModel, response_id: str, choice: Choice, item: TokenEvent) -> list[str]:
    """The chunks of one token event of a choice whose text may hold tool calls: the text its
    reader passes on as content; at its end, the held text's content, a pair of
    ``delta.tool_calls`` chunks per call, and the finish reason (``tool_calls`` with calls)."""
    assert choice.tool_reader is not None
    choice.finish_reason = item.finish_reason
    text = choice.tool_reader.feed(item.text)
    logprobs = choice.logprobs.chunk(item) if choice.logprobs is not None and item.token_ids else None
    if item.finish_reason is None:
        has_news = bool(text) or logprobs is not None
        return [_delta_chunk(served, response_id, choice.index, {"content": text}, None, logprobs)] if has_news else []
    parsed = choice.tool_reader.finish()
    chunks = []
    if text or parsed.content or logprobs is not None:
        chunks.append(_delta_chunk(served, response_id, choice.index, {"content": text + parsed.content}, None, logprobs))
    chunks += [_delta_chunk(served, response_id, choice.index, delta, None) for delta in call_deltas(parsed)]
    choice.finish_reason = finish_reason_of(parsed, item.finish_reason)
    chunks.append(_delta_chunk(served, response_id, choice.index, {}, choice.finish_reason))
    return chunks


def _timeout_chunks(
    served: ServedModel, response_id: str, fmt: ResponseFormat, choices: dict[int, Choice], echo_pending: dict[int, str]
) -> list[str]:
    """The last chunk of every unfinished choice when the deadline passed mid-generation, with
    ``finish_reason: timeout`` and the text it still held back (an echo's prompt, a possible
    tool call)."""
    null_text = None if fmt is ResponseFormat.CHAT else ""
    chunks = []
    for index, choice in sorted(choices.items()):
        if choice.finish_reason is None:
            choice.finish_reason = "timeout"
            held = choice.tool_reader.held_text if choice.tool_reader is not None else null_text
            chunks.append(_chunk(served, response_id, fmt, index, echo_pending.pop(index, held), "timeout"))
    return chunks


async def stream_response(
    served: ServedModel,
    response_id: str,
    sources: list[PromptSource],
    firsts: list[ChannelItem],
    n: int,
    fmt: ResponseFormat,
    include_usage: bool,
    watch: RequestWatch,
    echo: bool = False,
    tools: ToolPlan | None = None,
) -> AsyncIterator[str]:
    """SSE events from the ``firsts`` events on: a chat stream opens each choice with its role
    (an ``echo`` completion stream with its prompt's text), in ``index`` order; then a chunk per
    text delta of any choice, as they come, each choice's last one with its ``finish_reason``
    (``timeout`` for every unfinished choice when the deadline passed mid-generation);
    optionally one usage chunk over every choice; then ``data: [DONE]``. A client that
    disconnects cancels every request of the call.

    With ``logprobs``, every event with tokens gets a chunk carrying those tokens' logprobs;
    an ``echo`` choice's prompt text then begins its first such chunk, whose logprobs begin
    with the prompt's. With ``tools``, a choice's text that may be a tool call is held back
    and sent at its end as content or ``delta.tool_calls`` (:func:`tool_token_chunks`)."""
    choices = _choices(served, sources, n, fmt, tools)
    include_usage_now = include_usage
    try:
        opening, echo_pending = _opening_chunks(served, response_id, choices, fmt, echo)
        for chunk in opening:
            yield chunk
        async for source, item in merged_events(sources, firsts):
            record(source, item)
            if isinstance(item, Interrupt) and item.reason is InterruptReason.DISCONNECTED:
                include_usage_now = False
                break  # the client hung up before the stream began
            if isinstance(item, Interrupt):
                for chunk in _timeout_chunks(served, response_id, fmt, choices, echo_pending):
                    yield chunk
                break
            if isinstance(item, ErrorEvent):
                yield _sse(to_api_error(item.error).body())
                include_usage_now = False
                break
            assert isinstance(item, TokenEvent)
            choice = choices[source.first_index + item.index]
            if choice.tool_reader is not None:
                for chunk in tool_token_chunks(served, response_id, choice, item):
                    yield chunk
                continue
            token_chunk = _token_chunk(served, response_id, fmt, choice, item, echo_pending)
            if token_chunk is not None:
                yield token_chunk
                source.channel.chunk_sent()  # resumed: the chunk went to the connection
        if include_usage_now:
            usage = _envelope(served, response_id, fmt, is_chunk=True)
            usage.update(choices=[], usage=_usage_of(sources))
            yield _sse(usage)
        yield _sse("[DONE]")
    finally:
        _finish_all(served, sources, watch)
