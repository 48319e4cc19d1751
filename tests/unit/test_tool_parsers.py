"""Reading tool calls out of generated text: each format whole and streamed, and a call that
does not parse (bad JSON, unknown function, arguments that are no object) coming back as text."""

from __future__ import annotations

import json

import pytest

from gateway.tool_format import call_deltas, message_with_calls
from gateway.tool_parsers import CallFormat, ParsedCall, ParsedOutput, ToolCallReader, parse_calls

NAMES = frozenset({"get_weather", "add"})
WEATHER = ParsedCall("get_weather", '{"city": "Paris"}')
ADD = ParsedCall("add", '{"a": 1, "b": 2}')


def hermes_block(name: str, arguments: object) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@pytest.mark.parametrize(
    ("fmt", "text", "expected"),
    [
        (CallFormat.GENERIC, '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}', ParsedOutput("", (WEATHER,))),
        (
            CallFormat.GENERIC,
            '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]}',
            ParsedOutput("", (WEATHER, ADD)),
        ),
        (CallFormat.GENERIC, '{"response": "Hello!"}', ParsedOutput("Hello!")),
        (CallFormat.CALL_LIST, '[{"name": "add", "parameters": {"a": 1, "b": 2}}]', ParsedOutput("", (ADD,))),
        (CallFormat.HERMES, "Let me look." + hermes_block("get_weather", {"city": "Paris"}), ParsedOutput("Let me look.", (WEATHER,))),
        (CallFormat.HERMES, hermes_block("get_weather", {"city": "Paris"}) + "\n" + hermes_block("add", {"a": 1, "b": 2}), ParsedOutput("", (WEATHER, ADD))),
        (CallFormat.HERMES, "No tools needed.", ParsedOutput("No tools needed.")),
        (CallFormat.LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris"}}', ParsedOutput("", (WEATHER,))),
        (
            CallFormat.LLAMA3_JSON,
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "arguments": {"a": 1, "b": 2}}',
            ParsedOutput("", (WEATHER, ADD)),
        ),
        (CallFormat.LLAMA3_JSON, "Paris is sunny.", ParsedOutput("Paris is sunny.")),
    ],
    ids=["generic_one", "generic_many", "generic_response", "call_list", "hermes_after_text", "hermes_two", "hermes_none",
         "llama3_one", "llama3_two", "llama3_text"],
)
def test_each_format_reads_its_calls(fmt: CallFormat, text: str, expected: ParsedOutput) -> None:
    assert ToolCallReader(fmt, NAMES).read_whole(text) == expected


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (CallFormat.GENERIC, '{"tool_call": {"name": "get_weather", "arguments": {"city": "Par'),
        (CallFormat.GENERIC, '{"tool_call": {"name": "launch", "arguments": {}}}'),
        (CallFormat.GENERIC, '{"tool_call": {"name": "add", "arguments": "a=1"}}'),
        (CallFormat.CALL_LIST, "[]"),
        (CallFormat.HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'),
        (CallFormat.HERMES, "<tool_call>\n{\"name\": \"add\"}\n</tool_call>"),
        (CallFormat.LLAMA3_JSON, '{"name": "add", "parameters": {"a": 1}}; {"name": '),
    ],
    ids=["generic_cut", "generic_unknown_name", "generic_string_arguments", "empty_list", "hermes_bad_json",
         "hermes_no_arguments", "llama3_second_cut"],
)
def test_a_call_that_does_not_parse_is_text(fmt: CallFormat, text: str) -> None:
    assert ToolCallReader(fmt, NAMES).read_whole(text) == ParsedOutput(text)


def test_named_function_output_is_its_arguments() -> None:
    assert parse_calls('{"city": "Paris"}', CallFormat.ARGUMENTS, NAMES, "get_weather") == ParsedOutput("", (WEATHER,))
    assert parse_calls('{"city": ', CallFormat.ARGUMENTS, NAMES, "get_weather") == ParsedOutput('{"city": ')


def streamed(fmt: CallFormat, text: str, step: int) -> tuple[str, ParsedOutput]:
    """Feed ``text`` ``step`` characters at a time: the content passed on, and what the end read."""
    reader = ToolCallReader(fmt, NAMES)
    passed = "".join(reader.feed(text[i : i + step]) for i in range(0, len(text), step))
    return passed, reader.finish()


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_hermes_streams_text_until_a_call_begins_and_holds_the_call(step: int) -> None:
    text = "I will check <tool> tags." + hermes_block("get_weather", {"city": "Paris"})
    passed, rest = streamed(CallFormat.HERMES, text, step)
    assert passed == "I will check <tool> tags."
    assert rest == ParsedOutput("", (WEATHER,))


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_reading_equals_whole_reading(step: int) -> None:
    cases = [
        (CallFormat.HERMES, "Answer: 4 <tool_ca"),
        (CallFormat.HERMES, "<tool_call>{broken"),
        (CallFormat.LLAMA3_JSON, "  Paris is sunny."),
        (CallFormat.LLAMA3_JSON, '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}'),
        (CallFormat.GENERIC, '{"response": "Hi"}'),
    ]
    for fmt, text in cases:
        passed, rest = streamed(fmt, text, step)
        whole = ToolCallReader(fmt, NAMES).read_whole(text)
        assert (passed + rest.content, rest.calls) == (whole.content, whole.calls), (fmt, text)


def test_json_formats_hold_everything_until_the_end() -> None:
    reader = ToolCallReader(CallFormat.GENERIC, NAMES)
    assert reader.feed('{"response": "Hi') == "" and reader.held_text == '{"response": "Hi'


def test_message_and_deltas_carry_ids_names_and_json_arguments() -> None:
    parsed = ParsedOutput("", (WEATHER, ADD))
    message = message_with_calls(parsed)
    assert message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "add", "arguments": '{"a": 1, "b": 2}'}]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    deltas = [d["tool_calls"][0] for d in call_deltas(parsed)]
    assert [d["index"] for d in deltas] == [0, 0, 1, 1]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["id"].startswith("call_")
    assert deltas[1] == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    assert message_with_calls(ParsedOutput("plain")) == {"role": "assistant", "content": "plain"}
