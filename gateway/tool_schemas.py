"""The tool fields of a chat completion body (pydantic): ``tools`` and ``tool_choice``, as
OpenAI's API defines them, checked before anything is queued.

Every tool needs ``parameters`` (OpenAI lets a function omit them, meaning no arguments; here a
tool without them is a 400, so that every call's arguments have a schema to be constrained to).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import jsonschema
from llguidance import LLMatcher
from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, Tag, field_validator

from gateway.body_text import Text

# OpenAI's rule for a function's name.
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class _ToolBody(BaseModel):
    model_config = ConfigDict(extra="ignore")


def check_parameters_schema(schema: dict[str, Any]) -> None:
    """Raises ValueError when ``schema`` is not a valid JSON Schema (``jsonschema``'s
    ``check_schema`` for the draft it names, 2020-12 by default) or uses a keyword the constraint
    engine (llguidance) does not support, so a call's arguments are never relaxed silently."""
    if not isinstance(schema.get("$schema", ""), str):
        raise ValueError("not a valid JSON Schema: $schema must be a string (the URI of a draft)")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema)
    except ValueError as exc:
        raise ValueError(f"the constraint engine refuses the schema: {exc}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"the constraint engine refuses the schema: {error}")


class FunctionDefinition(_ToolBody):
    """A function the model may call: ``parameters`` is the JSON Schema of its arguments (an
    object). ``strict`` is accepted: arguments are always generated under the schema when the
    output is constrained (``required``, a named function, generic mode)."""

    name: Text = Field(pattern=FUNCTION_NAME_PATTERN)
    description: Text | None = None
    parameters: dict[str, Any]
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _valid_schema(cls, parameters: dict[str, Any]) -> dict[str, Any]:
        check_parameters_schema(parameters)
        return parameters


class ToolDefinition(_ToolBody):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition

    def openai_dict(self) -> dict[str, Any]:
        """The tool as OpenAI's JSON (what a chat template's ``tools`` reads), unset fields left out."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(_ToolBody):
    name: Text


class NamedToolChoice(_ToolBody):
    """``tool_choice`` naming the one function to call: ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


def _choice_form(value: Any) -> str | None:
    """Which form a ``tool_choice`` takes; the tags are type names, which ``param`` leaves out."""
    if isinstance(value, str):
        return "str"
    return "dict[str, Any]" if isinstance(value, (dict, NamedToolChoice)) else None


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")] | Annotated[NamedToolChoice, Tag("dict[str, Any]")],
    Discriminator(_choice_form),
]


def check_tool_choice(tools: list[ToolDefinition], tool_choice: ToolChoice | None) -> None:
    """Raises ValueError (worded ``field: reason``, so the 400's ``param`` names the field) for
    two tools with one name, a ``tool_choice`` other than ``none`` without tools, or a named
    function that is not among ``tools``."""
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(f"tools.{i}.function.name: the name '{name}' is taken by an earlier tool")
    if tool_choice is None or tool_choice == "none":
        return
    if not tools:
        raise ValueError("tool_choice: a tool_choice other than 'none' needs tools")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise ValueError(f"tool_choice: the function '{tool_choice.function.name}' is not among the tools ({', '.join(names)})")
