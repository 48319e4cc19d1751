"""Tool calls as OpenAI's chat completions carry them: ``message.tool_calls`` in a whole
response, ``delta.tool_calls`` chunks in a stream (openai-python's ``ChatCompletionMessageToolCall``
and ``ChoiceDeltaToolCall``; vLLM's serving_chat sends them the same way)."""

from __future__ import annotations

import uuid
from typing import Any

from gateway.tool_parsers import ParsedCall, ParsedOutput

# The finish reason of a choice that ends with tool calls.
TOOL_CALLS_FINISH_REASON = "tool_calls"


def call_id() -> str:
    """A fresh tool call id: ``call_`` and 24 random hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(call: ParsedCall) -> dict[str, Any]:
    """One call of ``message.tool_calls``, with a fresh id; ``arguments`` is JSON text."""
    return {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def message_with_calls(parsed: ParsedOutput) -> dict[str, Any]:
    """A whole response's ``message``: its content (``null`` when there is none beside calls)
    and its ``tool_calls`` when it made any."""
    if not parsed.calls:
        return {"role": "assistant", "content": parsed.content}
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": [tool_call(c) for c in parsed.calls]}


def call_deltas(parsed: ParsedOutput) -> list[dict[str, Any]]:
    """The stream's ``delta`` objects for ``parsed.calls``: per call, one opening it (``index``,
    ``id``, ``type``, ``function.name`` and ``arguments: ""``) and one with its arguments."""
    deltas: list[dict[str, Any]] = []
    for index, call in enumerate(parsed.calls):
        opening = tool_call(ParsedCall(call.name, ""))
        deltas.append({"tool_calls": [{"index": index, **opening}]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
    return deltas


def finish_reason_of(parsed: ParsedOutput, finish_reason: str | None) -> str | None:
    """``tool_calls`` for a choice that made calls, else its own finish reason."""
    return TOOL_CALLS_FINISH_REASON if parsed.calls else finish_reason
