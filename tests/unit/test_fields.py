"""The rule for fields (gateway.fields, gateway.schemas): refused fields are a 400 naming them,
ignored ones are dropped, ``null`` means the default, and the README's table is the schemas'."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from gateway.errors import APIError, validation_error
from gateway.field_table import OPENAI_BODIES, readme_field_table
from gateway.fields import NEUTRAL_VALUES, FieldStatus, is_neutral
from gateway.schemas import (
    ChatCompletionBody, ChatMessage, CompletionBody, ContentPart, DetokenizeBody, EmbeddingBody,
    EndpointBody, StreamOptions, TokenizeBody, ToolCall,
)

README = Path(__file__).resolve().parents[2] / "README.md"
MINIMAL: dict[type[BaseModel], dict[str, Any]] = {
    CompletionBody: {"model": "m", "prompt": "Hi"},
    ChatCompletionBody: {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
    EmbeddingBody: {"model": "m", "input": "Hi"},
    TokenizeBody: {"model": "m", "prompt": "Hi"},
    DetokenizeBody: {"model": "m", "tokens": [1]},
    ChatMessage: {"role": "assistant"},
    StreamOptions: {},
    ContentPart: {"type": "text", "text": "x"},
    ToolCall: {"id": "c", "function": {"name": "f", "arguments": "{}"}},
}


def test_the_readme_table_is_the_schemas() -> None:
    text = README.read_text()
    found = re.search(r"<!-- field-table:start -->\n(.*?)\n<!-- field-table:end -->", text, re.S)
    assert found, "README.md has no field table between the field-table markers"
    assert found.group(1) == readme_field_table(), "regenerate it with gateway.field_table.readme_field_table()"


@pytest.mark.parametrize("body", OPENAI_BODIES.values(), ids=OPENAI_BODIES.keys())
def test_every_openai_field_has_one_status(body: type[EndpointBody]) -> None:
    statuses = body.field_statuses()  # raises for an OpenAI field with none
    assert set(body.openai_fields) <= set(statuses)
    refused = {n for n, s in statuses.items() if s is FieldStatus.REFUSED}
    assert not refused & set(body.model_fields), "a refused field is not a field of the body"
    assert {n for n, s in statuses.items() if s is FieldStatus.IMPLEMENTED} <= set(body.model_fields)


REFUSED_CASES = [
    (path, body, name) for path, body in OPENAI_BODIES.items() for name in sorted(body.refused_fields)
]


@pytest.mark.parametrize(("path", "body", "name"), REFUSED_CASES, ids=[f"{p}:{n}" for p, _, n in REFUSED_CASES])
def test_a_refused_field_is_a_400_naming_it(path: str, body: type[EndpointBody], name: str) -> None:
    with pytest.raises(APIError) as info:
        body.check_refused({**MINIMAL[body], name: {"set": True}})
    error = info.value
    assert (error.status_code, error.param, error.code) == (400, name, "unsupported_parameter")
    assert "does not implement" in error.message
    body.check_refused({**MINIMAL[body], name: None})  # null: its default
    for value in NEUTRAL_VALUES.get(name, ()):
        body.check_refused({**MINIMAL[body], name: value})


@pytest.mark.parametrize(
    ("name", "value", "neutral"),
    [
        ("n", 1, True), ("n", 2, False), ("n", True, False), ("n", 1.0, True), ("frequency_penalty", 0.0, True),
        ("frequency_penalty", False, False), ("logprobs", False, True), ("logprobs", 0, False), ("logit_bias", {}, True),
        ("tools", [], True), ("tools", [{}], False), ("response_format", {"type": "text"}, True),
        ("response_format", {"type": "json_object"}, False), ("suffix", None, True), ("suffix", "", False),
    ],
)
def test_neutral_values_match_strictly(name: str, value: Any, neutral: bool) -> None:
    assert is_neutral(name, value) is neutral


@pytest.mark.parametrize("body", OPENAI_BODIES.values(), ids=OPENAI_BODIES.keys())
def test_ignored_fields_are_accepted_and_dropped(body: type[EndpointBody]) -> None:
    data = {**MINIMAL[body], **{name: {"any": ["thing"]} for name in body.ignored_fields}}
    body.check_refused(data)
    assert body.model_validate(data) == body.model_validate(MINIMAL[body])


OPTIONAL_FIELDS = [
    (model, name)
    for model in MINIMAL
    for name, info in model.model_fields.items()
    if not info.is_required() and name not in MINIMAL[model]  # those the minimal body needs (tokenize's prompt)
]


@pytest.mark.parametrize(("model", "name"), OPTIONAL_FIELDS, ids=[f"{m.__name__}.{n}" for m, n in OPTIONAL_FIELDS])
def test_null_for_an_optional_field_means_its_default(model: type[BaseModel], name: str) -> None:
    body = model.model_validate({**MINIMAL[model], name: None})
    assert getattr(body, name) == model.model_fields[name].get_default(call_default_factory=True)


@pytest.mark.parametrize("body", [CompletionBody, ChatCompletionBody])
def test_null_for_a_required_field_is_refused(body: type[EndpointBody]) -> None:
    with pytest.raises(ValidationError):
        body.model_validate({**MINIMAL[body], "model": None})


def api_param(model: type[BaseModel], data: dict[str, Any]) -> str | None:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    return validation_error(info.value).param


@pytest.mark.parametrize("body", [CompletionBody, ChatCompletionBody])
def test_stream_options_need_stream(body: type[EndpointBody]) -> None:
    options = {"stream_options": {"include_usage": True}}
    assert api_param(body, {**MINIMAL[body], **options}) == "stream_options"
    assert api_param(body, {**MINIMAL[body], **options, "stream": False}) == "stream_options"
    body.model_validate({**MINIMAL[body], **options, "stream": True})
    body.model_validate({**MINIMAL[body], "stream_options": None})


def chat(*messages: dict[str, Any]) -> ChatCompletionBody:
    return ChatCompletionBody.model_validate({"model": "m", "messages": list(messages)})


def test_text_parts_are_concatenated() -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    assert chat({"role": "user", "content": parts}).messages[0].text() == "Hello, world"
    assert chat({"role": "user", "content": []}).messages[0].text() == ""


@pytest.mark.parametrize("part_type", ["image_url", "input_audio", "file"])
def test_a_media_part_is_refused_naming_its_type(part_type: str) -> None:
    content = [{"type": "text", "text": "Look:"}, {"type": part_type, part_type: {"url": "x"}}]
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": content}]
    param = api_param(ChatCompletionBody, {"model": "m", "messages": messages})
    assert param == "messages.1.content.1.type"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": [{"type": "video"}]}, "messages.0.content.0.type"),
        ({"role": "user", "content": [{"type": "text"}]}, "messages.0.content.0.text"),
        ({"role": "user", "content": None}, "messages.0.content"),
        ({"role": "tool", "content": "42"}, "messages.0.tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": []}, "messages.0.tool_calls"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}, "messages.0.tool_calls.0.function.arguments"),
        ({"role": "user", "content": "x", "name": 3}, "messages.0.name"),
    ],
)
def test_bad_messages_name_the_field(message: dict[str, Any], param: str) -> None:
    assert api_param(ChatCompletionBody, {"model": "m", "messages": [message]}) == param


def test_every_role_is_accepted_with_its_fields() -> None:
    body = chat(
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is 42.", "refusal": None},
    )
    assert [m.role for m in body.messages] == ["developer", "system", "user", "assistant", "tool", "assistant"]
    assert body.messages[3].text() == "" and body.messages[3].tool_calls is not None


@pytest.mark.parametrize(
    ("value", "inputs"),
    [
        ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_embedding_inputs_take_every_form(value: Any, inputs: list[Any]) -> None:
    assert EmbeddingBody.model_validate({"model": "m", "input": value}).inputs() == inputs


@pytest.mark.parametrize(
    ("value", "param"), [([1, -1], "input.1"), ([[1], [2, -3]], "input.1.1"), ([1, "a"], "input.1"), ({"a": 1}, "input"), ([[1], []], "input"), (["a", 1], "input.1")]
)
def test_bad_token_inputs_name_the_position(value: Any, param: str) -> None:
    assert api_param(EmbeddingBody, {"model": "m", "input": value}) == param


def test_dimensions_must_be_positive() -> None:
    assert api_param(EmbeddingBody, {"model": "m", "input": "a", "dimensions": 0}) == "dimensions"


@pytest.mark.parametrize(
    ("data", "param"),
    [
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ],
)
def test_tokenize_takes_a_prompt_or_messages(data: dict[str, Any], param: str) -> None:
    assert api_param(TokenizeBody, data) == param


def test_detokenize_ids_are_non_negative_integers() -> None:
    assert api_param(DetokenizeBody, {"model": "m", "tokens": [1, -2]}) == "tokens.1"
    assert api_param(DetokenizeBody, {"model": "m", "tokens": "1"}) == "tokens"
