"""Tools in a chat body: validation (each bad input named by ``param``), the tool plan of each
``tool_choice`` in both modes, the prompts they render (generic mode's system message and
history; a tool template's ``tools=`` and call arguments), and the constraints, compiled by
llguidance against the SmolLM2 tokenizer and fed sample outputs."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import pytest
from pydantic import ValidationError

from bench.output_stage import load_tokenizer
from gateway.errors import validation_error
from gateway.prompts import PromptEncoder
from gateway.schemas import ChatCompletionBody
from gateway.tool_parsers import CallFormat
from gateway.tools import TextMessage, ToolPlan, generic_messages, template_reads_tools, tool_plan
from models.step_io import ConstraintKind

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMETERS}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Pa\\"ris"}'}}
HISTORY = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]

# A hermes-style template (after Qwen2.5's) that renders tools and calls.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [USER], **fields}


def body_of(**fields: Any) -> ChatCompletionBody:
    return ChatCompletionBody.model_validate(chat(**fields))


def param_of(body: dict[str, Any]) -> str | None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionBody.model_validate(body)
    return validation_error(info.value).param


def with_function(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", **function}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [with_function()]}, "tools.0.function.parameters"),
        ({"tools": [WEATHER, with_function(parameters={"type": "objekt"})]}, "tools.1.function.parameters"),
        ({"tools": [with_function(parameters={"type": "object", "properties": {"x": {"type": "string", "format": "no-such"}}})]}, "tools.0.function.parameters"),
        ({"tools": [with_function(parameters={"$ref": "#/missing"})]}, "tools.0.function.parameters"),
        ({"tools": [with_function(name="bad name", parameters={})]}, "tools.0.function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "city=Paris"}}]}]},
         "messages.1.tool_calls.0.function.arguments"),
        ({"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]}]},
         "messages.1.tool_calls.0.function.arguments"),
    ],
    ids=["no_parameters", "not_a_schema", "unknown_format", "bad_ref", "bad_name", "duplicate", "not_function",
         "choice_without_tools", "named_not_in_tools", "unknown_choice", "parallel_not_bool", "arguments_not_json",
         "arguments_not_object"],
)
def test_bad_tool_input_is_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    assert param_of(chat(**fields)) == param


def test_good_tool_bodies_validate() -> None:
    assert body_of(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}}).tools is not None
    assert body_of(tools=[], tool_choice="none").tool_choice == "none"
    assert body_of(messages=HISTORY, tools=[WEATHER]).parallel_tool_calls is True


def test_template_support_is_detected_by_its_use_of_tools() -> None:
    tokenizer = load_tokenizer()
    assert not template_reads_tools(tokenizer.chat_template)
    assert template_reads_tools(TOOL_TEMPLATE)
    assert not template_reads_tools(None)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer()


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer: Any) -> Any:
    return llguidance.hf.from_tokenizer(tokenizer)


def accepts(ll_tokenizer: Any, tokenizer: Any, grammar: str, text: str) -> bool:
    """Whether the grammar takes ``text``'s tokens and is complete after them."""
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    taken = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
    return taken and not matcher.is_error() and matcher.is_accepting()


def generic_plan(**fields: Any) -> ToolPlan:
    return tool_plan(body_of(**fields), load_tokenizer().chat_template, None)


def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


@pytest.mark.parametrize(
    ("fields", "good", "bad"),
    [
        ({"tool_choice": "required"}, [{"tool_calls": [call("get_weather", {"city": "Paris"}), call("add", {"a": 1, "b": 2})]}],
         [{"response": "hi"}, {"tool_calls": []}, {"tool_calls": [call("add", {"a": "1", "b": 2})]}, {"tool_calls": [call("launch", {})]}]),
        ({"tool_choice": "auto"}, [{"response": "It is sunny."}, {"tool_calls": [call("get_weather", {"city": "Paris", "days": 2})]}],
         [{"tool_calls": [call("get_weather", {"days": 2})]}, {"answer": "x"}]),
        ({"tool_choice": "required", "parallel_tool_calls": False}, [{"tool_call": call("add", {"a": 1, "b": 2})}],
         [{"tool_calls": [call("add", {"a": 1, "b": 2})]}]),
        ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, [{"tool_call": call("add", {"a": 1, "b": 2})}],
         [{"tool_call": call("get_weather", {"city": "Paris"})}, {"response": "x"}]),
    ],
    ids=["required", "auto", "required_not_parallel", "named"],
)
def test_generic_constraints_take_calls_of_the_allowed_functions_only(
    tokenizer: Any, ll_tokenizer: Any, fields: dict[str, Any], good: list[Any], bad: list[Any]
) -> None:
    plan = generic_plan(tools=[WEATHER, ADD], **fields)
    assert plan.constraint is not None and plan.constraint.kind is ConstraintKind.LARK
    assert llguidance.LLMatcher.validate_grammar(plan.constraint.value, ll_tokenizer) == ""
    assert plan.call_format is CallFormat.GENERIC
    for value in good:
        assert accepts(ll_tokenizer, tokenizer, plan.constraint.value, json.dumps(value)), value
    for value in bad:
        assert not accepts(ll_tokenizer, tokenizer, plan.constraint.value, json.dumps(value)), value


def test_generic_constraint_writes_name_before_arguments(tokenizer: Any, ll_tokenizer: Any) -> None:
    plan = generic_plan(tools=[WEATHER], tool_choice="required")
    assert plan.constraint is not None
    text = '{"tool_calls": [{"arguments": {"city": "Paris"}, "name": "get_weather"}]}'
    assert not accepts(ll_tokenizer, tokenizer, plan.constraint.value, text)


def test_template_mode_constraints_follow_vllm(tokenizer: Any, ll_tokenizer: Any) -> None:
    body = body_of(tools=[WEATHER, ADD], tool_choice="required")
    required = tool_plan(body, TOOL_TEMPLATE, "hermes")
    assert required.call_format is CallFormat.CALL_LIST and required.constraint is not None
    assert accepts(ll_tokenizer, tokenizer, required.constraint.value, json.dumps([{"name": "add", "parameters": {"a": 1, "b": 2}}]))
    assert not accepts(ll_tokenizer, tokenizer, required.constraint.value, json.dumps({"name": "add", "parameters": {"a": 1, "b": 2}}))
    named = tool_plan(body_of(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "get_weather"}}), TOOL_TEMPLATE, None)
    assert (named.call_format, named.function_name) == (CallFormat.ARGUMENTS, "get_weather") and named.constraint is not None
    assert accepts(ll_tokenizer, tokenizer, named.constraint.value, json.dumps({"city": "Paris"}))
    assert not accepts(ll_tokenizer, tokenizer, named.constraint.value, json.dumps({"days": 3}))
    auto = tool_plan(body_of(tools=[WEATHER]), TOOL_TEMPLATE, "hermes")
    assert (auto.call_format, auto.constraint) == (CallFormat.HERMES, None)
    assert auto.template_tools == [WEATHER]
    assert tool_plan(body_of(tools=[WEATHER]), TOOL_TEMPLATE, None).call_format is CallFormat.TEXT


def test_none_offers_no_tool_in_either_mode() -> None:
    for template in (TOOL_TEMPLATE, load_tokenizer().chat_template):
        plan = tool_plan(body_of(tools=[WEATHER], tool_choice="none"), template, "hermes")
        assert (plan.template_tools, plan.constraint, plan.reader()) == (None, None, None)
        assert "get_weather" not in "".join(m.text() for m in plan.messages)


def test_a_body_without_tools_keeps_its_messages() -> None:
    body = body_of(messages=HISTORY)
    assert tool_plan(body, load_tokenizer().chat_template, None).messages is body.messages


def test_generic_prompt_describes_the_tools_and_renders_the_history_as_text() -> None:
    plan = generic_plan(messages=[{"role": "system", "content": "Be brief."}, *HISTORY], tools=[WEATHER])
    roles = [m.role for m in plan.messages]
    assert roles == ["system", "user", "assistant", "user"]
    system = plan.messages[0].text()
    assert system.startswith("Be brief.\n\n") and json.dumps(WEATHER_PARAMETERS) in system
    assert "`tool_calls`" in system and '{"response": "..."}' in system
    assert json.loads(plan.messages[2].text()) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": 'Pa"ris'}, "id": "call_1"}]}
    assert json.loads(plan.messages[3].text()) == {"tool_response": {"tool": "get_weather", "tool_call_id": "call_1", "content": "sunny"}}


def test_generic_required_prompt_asks_for_a_call_only() -> None:
    plan = generic_plan(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    system = plan.messages[0]
    assert isinstance(system, TextMessage) and system.role == "system"
    assert "`tool_call`" in system.text() and "response" not in system.text()


def test_generic_messages_without_instructions_only_rewrite_tool_turns() -> None:
    body = body_of(messages=HISTORY)
    out = generic_messages(body.messages, None)
    assert out[0] is body.messages[0] and [m.role for m in out] == ["user", "assistant", "user"]


def test_a_tool_template_gets_the_tools_and_the_arguments_as_an_object(tokenizer: Any) -> None:
    tokenizer.chat_template = TOOL_TEMPLATE
    body = body_of(messages=HISTORY, tools=[WEATHER])
    plan = tool_plan(body, TOOL_TEMPLATE, "hermes")
    pieces = PromptEncoder(tokenizer).chat_pieces(plan.messages, "m", tools=plan.template_tools)
    rendered = [USER, {"role": "assistant", "content": "", "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": {"city": 'Pa"ris'}}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    expected = tokenizer.apply_chat_template(rendered, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert "".join(p.text for p in pieces) == expected
    assert '"arguments": {"city": "Pa\\"ris"}' in expected
    assert any(p.is_user_text and p.text == 'Pa\\"ris' for p in pieces)  # a client's string stays user text
