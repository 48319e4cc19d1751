"""The SSE chunks of a choice whose text may hold tool calls (template mode with the hermes
parser): text before a ``<tool_call>`` streams as content, the call comes at the end as
OpenAI's pair of ``delta.tool_calls`` chunks, then ``finish_reason: "tool_calls"``; a call that
does not parse ends as content with the choice's own finish reason."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from buckets.request import TokenEvent
from gateway.routes.choices import Choice
from gateway.routes.generation import tool_token_chunks
from gateway.tool_parsers import CallFormat, ToolCallReader

SERVED: Any = SimpleNamespace(config=SimpleNamespace(name="m"))


def stream(pieces: list[str], finish_reason: str = "stop") -> list[dict[str, Any]]:
    """The chunks' choices of a hermes choice fed ``pieces``, the last ending it."""
    choice = Choice(0, source=None)  # type: ignore[arg-type]
    choice.tool_reader = ToolCallReader(CallFormat.HERMES, frozenset({"get_weather"}))
    chunks: list[str] = []
    for k, piece in enumerate(pieces):
        is_last = k == len(pieces) - 1
        event = TokenEvent(piece, [k], finish_reason if is_last else None, 5, k + 1)
        chunks += tool_token_chunks(SERVED, "chatcmpl-1", choice, event)
    return [json.loads(c.removeprefix("data: "))["choices"][0] for c in chunks]


def test_text_then_a_call_streams_content_then_tool_call_deltas() -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    choices = stream(["Let me", " check. <tool", call[len("<tool"):40], call[40:]])
    contents = "".join(c["delta"].get("content", "") for c in choices)
    assert contents == "Let me check. "
    deltas = [c["delta"]["tool_calls"][0] for c in choices if "tool_calls" in c["delta"]]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["id"].startswith("call_")
    assert deltas[1] == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    assert [c["finish_reason"] for c in choices][-1] == "tool_calls"
    assert all(c["finish_reason"] is None for c in choices[:-1])


def test_a_broken_call_ends_as_content_with_its_own_finish_reason() -> None:
    choices = stream(["Sure. ", "<tool_call>\n{\"name\": \"get_weather\", \"argu"], finish_reason="length")
    assert "".join(c["delta"].get("content", "") for c in choices) == 'Sure. <tool_call>\n{"name": "get_weather", "argu'
    assert not any("tool_calls" in c["delta"] for c in choices)
    assert choices[-1]["finish_reason"] == "length"
