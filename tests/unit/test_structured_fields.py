"""gateway.structured_fields: which Constraint each structured-output field asks for, and the
400s for bad values (no model needed: the compile itself is tests/unit/test_structured.py's)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.errors import APIError
from gateway.schemas import ChatCompletionBody, CompletionBody
from gateway.structured_fields import constraint_error
from models.step_io import Constraint, ConstraintKind
from models.structured import ConstraintError

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["a"]}


def chat_body(**fields: Any) -> ChatCompletionBody:
    return ChatCompletionBody.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize(
    "fields, param, constraint",
    [
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, "response_format", Constraint(ConstraintKind.JSON_OBJECT, "")),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            "response_format.json_schema.schema", Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)),
        ),
        ({"guided_json": json.dumps(SCHEMA)}, "guided_json", Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))),
        ({"guided_regex": "[a-z]+"}, "guided_regex", Constraint(ConstraintKind.REGEX, "[a-z]+")),
        ({"guided_choice": ["a", "b"]}, "guided_choice", Constraint(ConstraintKind.CHOICE, '["a", "b"]')),
        ({"guided_grammar": 'start: "x"'}, "guided_grammar", Constraint(ConstraintKind.LARK, 'start: "x"')),
        ({"structured_outputs": {"json_object": True}}, "structured_outputs.json_object", Constraint(ConstraintKind.JSON_OBJECT, "")),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs.regex", Constraint(ConstraintKind.REGEX, "a+")),
    ],
)
def test_each_field_asks_for_its_constraint(fields: dict[str, Any], param: str | None, constraint: Constraint | None) -> None:
    found = chat_body(**fields).constraint()
    assert found == (None if constraint is None else (param, constraint))


def test_a_schema_keeps_its_key_order_and_completions_take_the_fields_too() -> None:
    body = CompletionBody.model_validate({"model": "m", "prompt": "x", "guided_json": SCHEMA})
    found = body.constraint()
    assert found is not None and json.loads(found[1].value) == SCHEMA and found[1].value.index('"b"') < found[1].value.index('"a"')


def test_a_gbnf_grammar_is_converted_to_lark() -> None:
    found = chat_body(guided_grammar='root ::= "yes" | "no"').constraint()
    assert found is not None and found[1].kind is ConstraintKind.LARK and "::=" not in found[1].value


@pytest.mark.parametrize(
    "fields, param, code",
    [
        ({"guided_json": "[1, 2"}, "guided_json", "invalid_schema"),
        ({"guided_json": "[1, 2]"}, "guided_json", "invalid_schema"),
        ({"structured_outputs": {"json": {"type": 5}}}, "structured_outputs.json", "invalid_schema"),
        ({"guided_regex": "a", "structured_outputs": {"choice": ["a"]}}, "structured_outputs.choice", "conflicting_constraints"),
    ],
)
def test_bad_values_are_400s_naming_the_field(fields: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(APIError) as caught:
        chat_body(**fields).constraint()
    assert (caught.value.status_code, caught.value.param, caught.value.code) == (400, param, code)


@pytest.mark.parametrize(
    "message, code",
    [('Unimplemented keys: ["uniqueItems"]', "unsupported_schema_keyword"), ("the json_schema took longer than 1 s to compile", "grammar_compile_timeout"),
     ("1(10): Expected token", "invalid_grammar")],
)
def test_engine_errors_map_to_codes(message: str, code: str) -> None:
    error = constraint_error(ConstraintError("guided_json", message))
    assert (error.status_code, error.param, error.code) == (400, "guided_json", code) and message in error.message
