"""Tool calls end to end on the default model (SmolLM2, whose chat template has no tool support,
so the generic mode): the official ``openai`` client and LangChain's ``bind_tools`` against the
server, the whole flow (a required call, the tool's result, a plain answer), named functions,
streamed ``delta.tool_calls`` against the whole response, and the bad inputs' 400s.

Greedy decoding throughout. ``parallel_tool_calls: false`` where a call is required: with
parallel calls the grammar lets a small model append call after call until ``max_tokens``.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from tests.e2e.conftest import GENERATE_MODEL

WEATHER_PARAMETERS = {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city", "parameters": WEATHER_PARAMETERS}}
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME_PARAMETERS}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 40
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


def create(openai_client: Any, **fields: Any) -> Any:
    options = {"model": GENERATE_MODEL, "messages": QUESTION, "tools": [WEATHER, TIME], "max_tokens": MAX_TOKENS, "temperature": 0}
    return openai_client.chat.completions.create(**{**options, **fields})


def check_call(call: Any) -> None:
    """A well-formed call of one of the tools, its arguments valid against its parameters."""
    assert call.id.startswith("call_") and call.type == "function"
    parameters = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), parameters)


def test_required_call_then_tool_result_then_a_plain_answer(openai_client: Any) -> None:
    out = create(openai_client, tool_choice="required", parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    check_call(call)
    result = {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 22 degrees Celsius."}
    follow_up = [*QUESTION, choice.message.model_dump(exclude_none=True), result]
    answer = create(openai_client, messages=follow_up, tool_choice="none", max_tokens=16).choices[0]
    assert answer.message.tool_calls is None
    assert answer.message.content and answer.finish_reason in ("stop", "length")


def test_a_named_function_is_the_one_called(openai_client: Any) -> None:
    choice = create(openai_client, tool_choice=NAMED_TIME).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    check_call(call)


def test_sampled_calls_validate_too(openai_client: Any) -> None:
    out = create(openai_client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=7, n=3)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        check_call(call)


def test_auto_answers_with_a_call_or_text_never_a_broken_call(openai_client: Any) -> None:
    for question in ("What is the weather in Paris?", "Say hello.", "What time is it in UTC?"):
        choice = create(openai_client, messages=[{"role": "user", "content": question}], tool_choice="auto").choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                check_call(call)
        else:
            assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")


def reassembled(chunks: list[Any]) -> tuple[dict[int, dict[int, tuple[str, str, str]]], dict[int, str | None]]:
    """``delta.tool_calls`` of a stream joined per choice and call index: ``(id, name,
    arguments)``; and each choice's finish reason."""
    calls: dict[int, dict[int, list[str]]] = {}
    reasons: dict[int, str | None] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(choice.index, {}).setdefault(delta.index, ["", "", ""])
                if delta.id:
                    assert not entry[0], "a call's id comes once, in its first chunk"
                    entry[0], entry[1] = delta.id, delta.function.name
                entry[2] += delta.function.arguments or ""
    return {i: {k: (e[0], e[1], e[2]) for k, e in by_call.items()} for i, by_call in calls.items()}, reasons


@pytest.mark.parametrize("tool_choice", ["required", NAMED_TIME], ids=["required", "named"])
def test_streamed_tool_calls_reassemble_to_the_whole_response(openai_client: Any, tool_choice: Any) -> None:
    whole = create(openai_client, tool_choice=tool_choice, parallel_tool_calls=False, n=2)
    calls, reasons = reassembled(list(create(openai_client, tool_choice=tool_choice, parallel_tool_calls=False, n=2, stream=True)))
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    for choice in whole.choices:
        expected = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert [(name, arguments) for _, name, arguments in calls[choice.index].values()] == expected
        assert all(call_id.startswith("call_") for call_id, _, _ in calls[choice.index].values())
    ids = [c.id for choice in whole.choices for c in choice.message.tool_calls]
    assert len(set(ids)) == len(ids), "each choice has calls of its own"


def chat_model(server_url: str) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=GENERATE_MODEL, base_url=f"{server_url}/v1", api_key="unused", temperature=0, max_tokens=MAX_TOKENS,
        max_retries=0, timeout=300,
    )


def test_langchain_bind_tools_invokes_and_streams_the_same_call(server_url: str) -> None:
    from langchain_core.tools import tool

    @tool
    def get_time(zone: str) -> str:
        """The time in a zone (UTC or CET)."""
        return "12:00"

    model = chat_model(server_url).bind_tools([get_time], tool_choice="get_time")
    message = model.invoke("What time is it in UTC?")
    (call,) = message.tool_calls
    assert call["name"] == "get_time" and isinstance(call["args"].get("zone"), str)
    chunks = list(model.stream("What time is it in UTC?"))
    joined = chunks[0]
    for chunk in chunks[1:]:
        joined = joined + chunk
    assert [(c["name"], c["args"]) for c in joined.tool_calls] == [(call["name"], call["args"])]
    assert joined.response_metadata.get("finish_reason") == "tool_calls"


def error_of(server_url: str, body: dict[str, Any]) -> dict[str, Any]:
    base = {"model": GENERATE_MODEL, "messages": QUESTION, "max_tokens": 4}
    response = httpx.post(f"{server_url}/v1/chat/completions", json={**base, **body}, timeout=60)
    assert response.status_code == 400, response.text
    return response.json()["error"]  # type: ignore[no-any-return]


BAD_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "city=Paris"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "get_weather"}}]}, "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]}, "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "pattern": "(?=a)"}}}]},
         "tools.0.function.parameters"),
        ({"tools": [WEATHER], "tool_choice": NAMED_TIME}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [BAD_CALL]}]},
         "messages.1.tool_calls.0.function.arguments"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
    ids=["no_parameters", "not_a_schema", "unsupported_pattern", "named_not_in_tools", "choice_without_tools", "arguments_not_json",
         "with_response_format"],
)
def test_bad_tool_input_is_a_400_naming_the_field(server_url: str, body: dict[str, Any], param: str) -> None:
    error = error_of(server_url, body)
    assert error["param"] == param and error["type"] == "invalid_request_error"
