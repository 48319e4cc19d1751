"""How a chat request's ``tools`` and ``tool_choice`` shape its prompt, its constraint and the
reading of its output (:class:`ToolPlan`).

Two modes, by the model's chat template:

- *template*: the template renders tools (it reads ``tools``, as vLLM and transformers detect
  it): the tools go to ``apply_chat_template(..., tools=...)`` and the conversation as it is.
  ``required`` is constrained to a JSON array of calls, a named function to its arguments (vLLM's
  shapes); ``auto`` is free text read by the model's ``tool_call_parser`` (none configured: the
  text is the answer).
- *generic* (a template without tool support, the default SmolLM2's): llama.cpp server's generic
  format. A system message describes the tools and the JSON to answer with; earlier calls and
  tool results are rendered as JSON text messages (a result as a ``user`` message, as minja's
  polyfill does for a template without a ``tool`` role); the output is constrained to a call or,
  with ``auto``, a ``{"response": ...}`` answer.

``tool_choice: none`` offers no tool: the prompt leaves them out and the answer is plain text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.errors import invalid_request
from gateway.prompts import Message, ToolCall
from gateway.schemas import ChatCompletionBody
from gateway.tool_grammar import arguments_constraint, call_list_constraint, generic_constraint
from gateway.tool_parsers import CallFormat, ToolCallReader
from gateway.tool_schemas import NamedToolChoice, ToolDefinition
from models.step_io import Constraint, SamplingParams
from models.structured import ConstraintError, check_constraint

# A template that reads ``tools`` renders them (transformers' and vLLM's test for tool support).
_READS_TOOLS = re.compile(r"\btools\b")

# The configured ``tool_call_parser`` of a model -> how its ``auto`` output is read.
PARSER_FORMATS = {"hermes": CallFormat.HERMES, "llama3_json": CallFormat.LLAMA3_JSON}


def template_reads_tools(chat_template: Any) -> bool:
    """Whether a chat template (its Jinja source; ``None``: the model has none) renders tools."""
    return isinstance(chat_template, str) and _READS_TOOLS.search(chat_template) is not None


@dataclass(frozen=True)
class TextMessage:
    """A message of the generic mode's prompt: a role and its text (a :class:`Message`)."""

    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: Sequence[ToolCall] | None = None

    def text(self) -> str:
        return self.content


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools change.

    Fields:
        messages: the conversation to render.
        template_tools: the tools for the chat template's ``tools`` (OpenAI's JSON); ``None``:
            the template gets none.
        constraint: the output's constraint (``None``: free text).
        call_format: how the output holds its calls.
        function_names: the request's functions (a call of another is text).
        function_name: the named function of ``tool_choice`` (its arguments are the output in
            the ``ARGUMENTS`` format).
    """

    messages: Sequence[Message]
    template_tools: list[dict[str, Any]] | None = None
    constraint: Constraint | None = None
    call_format: CallFormat = CallFormat.TEXT
    function_names: frozenset[str] = frozenset()
    function_name: str | None = None

    def reader(self) -> ToolCallReader | None:
        """A fresh reader of one choice's calls; ``None`` when the output holds none."""
        if self.call_format is CallFormat.TEXT:
            return None
        return ToolCallReader(self.call_format, self.function_names, self.function_name)


def tool_plan(body: ChatCompletionBody, chat_template: Any, tool_call_parser: str | None) -> ToolPlan:
    """The :class:`ToolPlan` of ``body`` for a model with ``chat_template`` (its Jinja source)
    and ``tool_call_parser`` (``hermes``, ``llama3_json`` or ``None``). A body without tools
    keeps its messages as they are. ``tool_choice`` defaults to ``auto`` with tools."""
    tools = body.tools or []
    if not tools:
        return ToolPlan(body.messages)
    choice: str | NamedToolChoice = body.tool_choice or "auto"
    names = frozenset(t.function.name for t in tools)
    named = next((t for t in tools if t.function.name == choice.function.name), None) if isinstance(choice, NamedToolChoice) else None
    if template_reads_tools(chat_template):
        return _template_plan(body, tools, choice, named, names, tool_call_parser)
    if choice == "none":
        return ToolPlan(generic_messages(body.messages, None))
    offered = [named] if named is not None else tools
    prompt = generic_messages(body.messages, generic_instructions(offered, body.parallel_tool_calls and named is None, choice == "auto"))
    constraint = generic_constraint(offered, body.parallel_tool_calls and named is None, may_answer=choice == "auto")
    return ToolPlan(prompt, None, constraint, CallFormat.GENERIC, names)


def _template_plan(
    body: ChatCompletionBody, tools: list[ToolDefinition], choice: str | NamedToolChoice, named: ToolDefinition | None,
    names: frozenset[str], tool_call_parser: str | None,
) -> ToolPlan:
    """The plan for a template that renders tools (see the module's docstring)."""
    if choice == "none":
        return ToolPlan(body.messages)
    offered = [t.openai_dict() for t in tools]
    if named is not None:
        return ToolPlan(body.messages, offered, arguments_constraint(named), CallFormat.ARGUMENTS, names, named.function.name)
    if choice == "required":
        return ToolPlan(body.messages, offered, call_list_constraint(tools, body.parallel_tool_calls), CallFormat.CALL_LIST, names)
    fmt = PARSER_FORMATS[tool_call_parser] if tool_call_parser is not None else CallFormat.TEXT
    return ToolPlan(body.messages, offered, None, fmt, names)


def generic_instructions(tools: Sequence[ToolDefinition], is_parallel: bool, may_answer: bool) -> str:
    """The generic mode's description of ``tools`` (each function's JSON: name, description,
    parameters) and of the JSON to answer with, after llama.cpp's: an example of a call and,
    when ``may_answer``, the ``response`` alternative. Kept short: it shares the context."""
    described = json.dumps([t.function.model_dump(exclude_none=True) for t in tools], ensure_ascii=False)
    example_call = {"name": tools[0].function.name, "arguments": {"...": "..."}}
    example = {"tool_calls": [example_call]} if is_parallel else {"tool_call": example_call}
    lines = [
        f"You can call these tools:\n{described}",
        f"To call tools, answer in JSON with `{next(iter(example))}`, as in {json.dumps(example)}",
    ]
    if may_answer:
        lines.append('To reply to the user instead, answer in JSON with `response`: {"response": "..."}')
    return "\n".join(lines)


def generic_messages(messages: Sequence[Message], instructions: str | None) -> list[Message]:
    """``messages`` for a template without tool support: ``instructions`` (``None``: none)
    appended to the system message (one is put first when there is none), an assistant's calls
    as their generic JSON (``{"tool_calls": [...]}``, with their ids), a tool result as a
    ``user`` message holding ``{"tool_response": {"tool", "tool_call_id", "content"}}``."""
    names_by_id = {c.id: c.function.name for m in messages for c in (m.tool_calls or ())}
    out: list[Message] = []
    for message in messages:
        if message.tool_calls:
            calls = [{"name": c.function.name, "arguments": json.loads(c.function.arguments), "id": c.id} for c in message.tool_calls]
            out.append(TextMessage("assistant", json.dumps({"tool_calls": calls}, ensure_ascii=False)))
        elif message.role == "tool":
            call_id = message.tool_call_id or ""
            response = {"tool": names_by_id.get(call_id, ""), "tool_call_id": call_id, "content": message.text()}
            out.append(TextMessage("user", json.dumps({"tool_response": response}, ensure_ascii=False)))
        else:
            out.append(message)
    if instructions is None:
        return out
    if out and out[0].role in ("system", "developer"):
        return [TextMessage("system", f"{out[0].text()}\n\n{instructions}"), *out[1:]]
    return [TextMessage("system", instructions), *out]


def with_tool_constraint(params: SamplingParams, tools: ToolPlan | None) -> SamplingParams:
    """``params`` with the tool plan's constraint (as they are without one).

    Raises:
        APIError: 400 (``tool_choice``) when ``params`` already carry a constraint
            (``response_format`` or a guided field): an output cannot follow two.
    """
    if tools is None or tools.constraint is None:
        return params
    if params.constraint is not None:
        raise invalid_request(
            "A tool call constrains the output; tool_choice cannot be combined with response_format or a guided field",
            param="tool_choice",
        )
    return dataclasses.replace(params, constraint=tools.constraint)


async def check_tool_constraint(tools: ToolPlan, tokenizer: Any) -> None:
    """Compile the plan's constraint for ``tokenizer`` before the request is queued (on a
    worker thread, within the engine's compile time limit), so a call grammar that cannot be
    used fails this request alone.

    Raises:
        APIError: 400 naming ``tools`` when the grammar does not compile or not in time.
    """
    if tools.constraint is None:
        return
    try:
        await asyncio.to_thread(check_constraint, tools.constraint, tokenizer, "tools")
    except ConstraintError as exc:
        raise invalid_request(f"The tool-call grammar cannot be used: {exc.message}", param=exc.param) from None
