"""The structured-output fields of the generation bodies and the :class:`~models.step_io.Constraint`
they ask for.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) and vLLM's extensions
for the same machinery: ``guided_json`` (a schema, as an object or JSON text), ``guided_regex``,
``guided_choice`` (strings), ``guided_grammar`` (a Lark grammar in llguidance's dialect, or a
GBNF one, converted by llguidance) and the newer ``structured_outputs`` object (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``). A request sets at most one. A schema is checked as JSON
Schema (the ``jsonschema`` package, its declared draft) and then compiled by llguidance
(:func:`models.structured.check_constraint`), so a keyword llguidance does not implement is a
400 naming the field and the keyword, never a silent relaxation.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Literal

import jsonschema
import llguidance.gbnf_to_lark
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from gateway.errors import APIError, invalid_request
from models.step_io import Constraint, ConstraintKind
from models.structured import ConstraintError, check_constraint

# OpenAI's rule for a response format's name.
_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
# A GBNF grammar defines its rules with ``::=``; Lark with ``:``.
_GBNF_RULE = re.compile(r"^\s*[A-Za-z][\w-]*\s*::=", re.MULTILINE)


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class JsonSchemaSpec(_Part):
    """``response_format.json_schema``: the schema and OpenAI's label fields (``strict`` is read
    as true: the output always follows the schema)."""

    name: StrictStr = Field(pattern=_NAME_PATTERN)
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormatSpec(_Part):
    """``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
    (one JSON object) or ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormatSpec":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: a json_schema response format needs its json_schema")
        return self


class StructuredOutputsSpec(_Part):
    """vLLM's ``structured_outputs``: one of ``json`` (a schema), ``regex``, ``choice``,
    ``grammar``, ``json_object`` (``true``: any JSON object). vLLM's other keys (backend and
    whitespace options, structural tags) are refused by name, not ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = Field(default=None, min_length=1)
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class StructuredFields(BaseModel):
    """The structured-output fields, mixed into the generation bodies (:mod:`gateway.schemas`)."""

    response_format: ResponseFormatSpec | None = None
    guided_json: dict[str, Any] | StrictStr | None = None  # vLLM's
    guided_regex: StrictStr | None = None  # vLLM's
    guided_choice: list[StrictStr] | None = Field(default=None, min_length=1)  # vLLM's
    guided_grammar: StrictStr | None = None  # vLLM's: Lark (llguidance's dialect) or GBNF
    structured_outputs: StructuredOutputsSpec | None = None  # vLLM's

    def requested_constraints(self) -> list[tuple[str, Constraint]]:
        """Each constraint the body asks for, ``(param, constraint)``.

        Raises:
            APIError: 400 naming the field for a schema that is not valid JSON (text) or not
                valid JSON Schema, or a GBNF grammar that does not convert.
        """
        found: list[tuple[str, Constraint]] = []
        spec = self.response_format
        if spec is not None and spec.type == "json_object":
            found.append(("response_format", Constraint(ConstraintKind.JSON_OBJECT, "")))
        if spec is not None and spec.json_schema is not None and spec.type == "json_schema":
            param = "response_format.json_schema.schema"
            found.append((param, _schema_constraint(spec.json_schema.schema_, param)))
        outputs = self.structured_outputs or StructuredOutputsSpec()
        if outputs.json_object:
            found.append(("structured_outputs.json_object", Constraint(ConstraintKind.JSON_OBJECT, "")))
        for param, schema in (("guided_json", self.guided_json), ("structured_outputs.json", outputs.json_)):
            if schema is not None:
                found.append((param, _schema_constraint(schema, param)))
        for param, regex in (("guided_regex", self.guided_regex), ("structured_outputs.regex", outputs.regex)):
            if regex is not None:
                found.append((param, Constraint(ConstraintKind.REGEX, regex)))
        for param, choice in (("guided_choice", self.guided_choice), ("structured_outputs.choice", outputs.choice)):
            if choice is not None:
                found.append((param, Constraint(ConstraintKind.CHOICE, json.dumps(choice))))
        for param, grammar in (("guided_grammar", self.guided_grammar), ("structured_outputs.grammar", outputs.grammar)):
            if grammar is not None:
                found.append((param, Constraint(ConstraintKind.LARK, _lark(grammar, param))))
        return found

    def constraint(self) -> tuple[str, Constraint] | None:
        """The body's one constraint with the field it came from, or ``None``.

        Raises:
            APIError: 400 naming the second field when two ask for a constraint, and the errors
                of :meth:`requested_constraints`.
        """
        found = self.requested_constraints()
        if len(found) > 1:
            raise invalid_request(
                f"{found[0][0]} and {found[1][0]} both constrain the output; set one of them", param=found[1][0],
                code="conflicting_constraints",
            )
        return found[0] if found else None


def _schema_constraint(schema: dict[str, Any] | str, param: str) -> Constraint:
    """A JSON Schema constraint, checked as JSON Schema: the schema as JSON text with its key order
    kept (llguidance emits an object's properties in the order its schema lists them)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise invalid_request(f"{param}: the schema is not valid JSON: {exc}", param=param, code="invalid_schema") from None
    if not isinstance(schema, dict):
        raise invalid_request(f"{param}: a JSON Schema is an object", param=param, code="invalid_schema")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        at = f" at '{where}'" if where else ""
        raise invalid_request(f"{param}: not a valid JSON Schema{at}: {exc.message}", param=param, code="invalid_schema") from None
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


def _lark(grammar: str, param: str) -> str:
    """``grammar`` in llguidance's Lark dialect: a GBNF grammar (rules defined with ``::=``) is
    converted by llguidance's ``gbnf_to_lark``; anything else is taken as Lark."""
    if not _GBNF_RULE.search(grammar):
        return grammar
    try:
        return str(llguidance.gbnf_to_lark.gbnf_to_lark(grammar))
    except Exception as exc:  # noqa: BLE001 - the converter raises plain exceptions of several kinds
        raise invalid_request(f"{param}: the GBNF grammar does not convert: {exc}", param=param, code="invalid_grammar") from None


def constraint_error(exc: ConstraintError) -> APIError:
    """The 400 for a constraint the engine refused: ``unsupported_schema_keyword`` for a JSON
    Schema keyword llguidance does not implement, ``grammar_compile_timeout`` past the configured
    time, else ``invalid_grammar``."""
    if "Unimplemented keys" in exc.message:
        code = "unsupported_schema_keyword"
        message = f"{exc.param}: the schema uses a keyword structured output does not support ({exc.message})"
    elif "took longer than" in exc.message:
        code, message = "grammar_compile_timeout", f"{exc.param}: {exc.message}"
    else:
        code, message = "invalid_grammar", f"{exc.param}: does not compile: {exc.message}"
    return invalid_request(message, param=exc.param, code=code)


async def checked_constraint(fields: StructuredFields, tokenizer: Any) -> Constraint | None:
    """The body's constraint, compiled once for ``tokenizer`` (on a worker thread, within the
    configured ``compile_timeout_s``) so a bad one is this request's 400 and never reaches a batch.

    Raises:
        APIError: 400 naming the field (:meth:`StructuredFields.constraint`, :func:`constraint_error`).
    """
    found = fields.constraint()
    if found is None:
        return None
    param, constraint = found
    try:
        await asyncio.to_thread(check_constraint, constraint, tokenizer, param)
    except ConstraintError as exc:
        raise constraint_error(exc) from None
    return constraint
