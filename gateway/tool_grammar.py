"""The constraints that make a model's output a tool call: JSON Schemas over the allowed
functions' call objects, handed to the structured-output engine as a :class:`Constraint`.

Two shapes, after the servers whose prompts they follow:

- *generic* (llama.cpp server's ``generic`` chat format, common/chat.cpp, for a chat template
  without tool support): ``{"tool_calls": [{"name", "arguments"}, ...]}`` with parallel calls,
  ``{"tool_call": {"name", "arguments"}}`` without, and for ``auto`` also ``{"response": "..."}``;
- *template* (vLLM's, for a template that renders tools): ``required`` is a JSON array of
  ``{"name", "parameters"}`` objects (vLLM's ``_get_json_schema_from_tool``), a named function is
  its arguments object alone (vLLM's named-function guided decoding).

Each call object is ``{"name": {"const": name}, <arguments key>: the function's parameters}``;
several functions are an ``anyOf``. The layout is fixed (llguidance's ``x-guidance``: ``", "``
and ``": "`` separators, no other whitespace), so a small model cannot pad the JSON until
``max_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.tool_schemas import ToolDefinition
from models.step_io import Constraint, ConstraintKind

# llguidance's JSON compile options, read from the schema's top level: the separators of
# Python's json.dumps and no other whitespace.
JSON_LAYOUT = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


def _call_schema(tool: ToolDefinition, arguments_key: str) -> dict[str, Any]:
    """The JSON Schema of one call of ``tool``: its name (a constant) and its arguments."""
    function = tool.function
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, arguments_key: function.parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _any_call(tools: Sequence[ToolDefinition], arguments_key: str) -> dict[str, Any]:
    """A call of any of ``tools`` (one schema, or an ``anyOf`` of them)."""
    calls = [_call_schema(t, arguments_key) for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _constraint(schema: dict[str, Any]) -> Constraint:
    """``schema`` as a Lark grammar embedding it (``start: %json {...}``): a JSON-Schema
    constraint's value has its keys sorted, which would make the model write ``arguments``
    before ``name``; the embedded schema keeps the order of its properties."""
    return Constraint(ConstraintKind.LARK, "start: %json " + json.dumps({**schema, **JSON_LAYOUT}))


def generic_call_schema(tools: Sequence[ToolDefinition], is_parallel: bool) -> dict[str, Any]:
    """llama.cpp's generic tool-call object: ``{"tool_calls": [call, ...]}`` (at least one) when
    ``is_parallel``, else ``{"tool_call": call}``."""
    if is_parallel:
        calls = {"type": "array", "items": _any_call(tools, "arguments"), "minItems": 1}
        return {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"], "additionalProperties": False}
    call = _any_call(tools, "arguments")
    return {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"], "additionalProperties": False}


# llama.cpp's generic plain answer.
GENERIC_RESPONSE_SCHEMA = {
    "type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"], "additionalProperties": False,
}


def generic_constraint(tools: Sequence[ToolDefinition], is_parallel: bool, may_answer: bool) -> Constraint:
    """The generic mode's constraint: a call of ``tools`` or, when ``may_answer`` (``auto``), a
    plain answer object too."""
    call = generic_call_schema(tools, is_parallel)
    return _constraint({"anyOf": [call, GENERIC_RESPONSE_SCHEMA]} if may_answer else call)


def call_list_constraint(tools: Sequence[ToolDefinition], is_parallel: bool) -> Constraint:
    """vLLM's ``required``: a JSON array of ``{"name", "parameters"}`` calls of ``tools`` (exactly
    one unless ``is_parallel``)."""
    schema: dict[str, Any] = {"type": "array", "items": _any_call(tools, "parameters"), "minItems": 1}
    if not is_parallel:
        schema["maxItems"] = 1
    return _constraint(schema)


def arguments_constraint(tool: ToolDefinition) -> Constraint:
    """vLLM's named function: the output is the arguments object of ``tool``."""
    return _constraint(tool.function.parameters)
