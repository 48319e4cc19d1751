"""gateway.schemas: OpenAI-style bodies are validated before anything is queued."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.errors import validation_error
from gateway.schemas import MAX_STOP_STRINGS, ChatCompletionBody, CompletionBody, EmbeddingBody


def completion(**overrides: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "Hello", **overrides}


def chat(**overrides: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **overrides}


def rejected_field(model: type, body: dict[str, Any]) -> set[str]:
    """Validate and return the top-level names of the fields at fault."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return {str(err["loc"][0]) for err in info.value.errors()}


def test_minimal_bodies_are_valid_with_defaults() -> None:
    body = CompletionBody.model_validate(completion())
    assert (body.temperature, body.top_p, body.top_k, body.stream) == (1.0, 1.0, 0, False)
    assert body.max_tokens is None and body.seed is None and body.stop_strings() == ()
    ChatCompletionBody.model_validate(chat())
    EmbeddingBody.model_validate({"model": "m", "input": "x"})


@pytest.mark.parametrize(
    "overrides",
    [
        {"temperature": 0}, {"temperature": 2}, {"temperature": 0.7}, {"top_p": 1}, {"top_p": 0.01},
        {"top_k": 0}, {"top_k": 50}, {"max_tokens": 1}, {"seed": 0}, {"seed": -5},
        {"stop": "END"}, {"stop": ["a", "b", "c", "d"]}, {"n": 1}, {"n": 3}, {"stream": True},
        {"stream": True, "stream_options": {"include_usage": True}}, {"unknown_extra": 1},
    ],
)
def test_valid_sampling_fields_are_accepted(overrides: dict[str, Any]) -> None:
    CompletionBody.model_validate(completion(**overrides))
    ChatCompletionBody.model_validate(chat(**overrides))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2.01), ("temperature", 3), ("temperature", -0.1),
        ("top_p", 0), ("top_p", 0.0), ("top_p", 1.01), ("top_p", -1),
        ("top_k", -1),
        ("max_tokens", -3),
        ("n", 0), ("n", -1), ("n", 1.0), ("n", "2"),
        ("stop", ["a"] * (MAX_STOP_STRINGS + 1)),
        ("temperature", "hot"), ("temperature", "0.5"), ("temperature", True),
        ("top_p", "1"), ("top_k", 1.5), ("top_k", "3"), ("max_tokens", 2.0), ("max_tokens", "16"),
        ("seed", 1.0), ("seed", "7"), ("stream", "yes"), ("stream", 1), ("stop", 5), ("stop", ["a", 1]),
        ("model", 3), ("priority", "high"), ("ignore_eos", "no"),
    ],
)
def test_bad_sampling_fields_are_rejected(field: str, value: Any) -> None:
    assert rejected_field(CompletionBody, completion(**{field: value})) == {field}
    assert rejected_field(ChatCompletionBody, chat(**{field: value})) == {field}


@pytest.mark.parametrize("prompt", ["", None, 5, [], True, {"text": "Hi"}])
def test_bad_prompt_is_rejected(prompt: Any) -> None:
    assert rejected_field(CompletionBody, completion(prompt=prompt)) == {"prompt"}


def test_max_tokens_zero_passes_the_completion_schema_but_not_chat() -> None:
    CompletionBody.model_validate(completion(max_tokens=0, echo=True))  # the route refuses 0 without echo
    assert rejected_field(ChatCompletionBody, chat(max_tokens=0)) == {"max_tokens"}


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("Hi", ["Hi"]), (["Hi", "there"], ["Hi", "there"]), ([1, 2, 3], [[1, 2, 3]]), ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_every_prompt_form_is_accepted(prompt: Any, expected: list[Any]) -> None:
    assert CompletionBody.model_validate(completion(prompt=prompt)).prompts() == expected


@pytest.mark.parametrize(
    ("prompt", "param"),
    [(["Hi", ""], "prompt.1"), ([[1], []], "prompt.1"), (["Hi", 3], "prompt.1"), ([[1, "x"]], "prompt.0.1"), ([1, [2]], "prompt.0")],
)
def test_a_bad_item_of_a_prompt_list_is_named_by_its_position(prompt: Any, param: str) -> None:
    with pytest.raises(ValidationError) as err:
        CompletionBody.model_validate(completion(prompt=prompt))
    assert validation_error(err.value).param == param


def test_missing_prompt_or_model_is_rejected() -> None:
    assert rejected_field(CompletionBody, {"model": "m"}) == {"prompt"}
    assert rejected_field(CompletionBody, {"prompt": "x"}) == {"model"}


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "tool", "content": "x"}],
        [{"role": "robot", "content": "x"}],
        [{"role": "user"}],
        [{"content": "x"}],
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": None}],
        "Hi",
        None,
    ],
    ids=["empty", "tool_role", "unknown_role", "no_content", "no_role", "int_content", "null_content", "string", "null"],
)
def test_bad_messages_are_rejected(messages: Any) -> None:
    assert rejected_field(ChatCompletionBody, chat(messages=messages)) == {"messages"}


@pytest.mark.parametrize("role", ["system", "user", "assistant"])
def test_known_roles_are_accepted(role: str) -> None:
    ChatCompletionBody.model_validate(chat(messages=[{"role": role, "content": "x"}]))


def test_max_completion_tokens_must_be_positive() -> None:
    assert rejected_field(ChatCompletionBody, chat(max_completion_tokens=0)) == {"max_completion_tokens"}


def test_stop_strings_normalise_to_a_tuple() -> None:
    assert CompletionBody.model_validate(completion(stop="x")).stop_strings() == ("x",)
    assert CompletionBody.model_validate(completion(stop=["x", "y"])).stop_strings() == ("x", "y")


@pytest.mark.parametrize("value", ["", [], [""], ["ok", ""], 3, None, [-1], [[]], [[1], []], [[1, "a"]], [1, [2]], [1.5]])
def test_bad_embedding_input_is_rejected(value: Any) -> None:
    assert rejected_field(EmbeddingBody, {"model": "m", "input": value}) == {"input"}


def test_embedding_inputs_normalise_to_a_list() -> None:
    assert EmbeddingBody.model_validate({"model": "m", "input": "a"}).inputs() == ["a"]
    assert EmbeddingBody.model_validate({"model": "m", "input": ["a", "b"]}).inputs() == ["a", "b"]
    assert rejected_field(EmbeddingBody, {"model": "m", "input": "a", "encoding_format": "int8"}) == {"encoding_format"}


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_seed_out_of_generator_range_is_rejected(seed: int) -> None:
    assert rejected_field(CompletionBody, completion(seed=seed)) == {"seed"}


def api_param(model: type, body: dict[str, Any]) -> str | None:
    """Validate and return the ``param`` of the 400 the gateway would answer."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    error = validation_error(info.value)
    assert (error.status_code, error.type) == (400, "invalid_request_error")
    return error.param


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (ChatCompletionBody, chat(messages=[{"role": "robot", "content": "x"}]), "messages.0.role"),
        (ChatCompletionBody, chat(messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "x"}]), "messages.1.tool_call_id"),
        (ChatCompletionBody, chat(messages=[{"role": "user", "content": ["x"]}]), "messages.0.content.0"),
        (ChatCompletionBody, chat(messages=[["x"]]), "messages.0"),
        (ChatCompletionBody, chat(messages=[]), "messages"),
        (ChatCompletionBody, chat(stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
        (ChatCompletionBody, chat(max_completion_tokens="5"), "max_completion_tokens"),
        (EmbeddingBody, {"model": "m", "input": ["ok", 1]}, "input.1"),
        (EmbeddingBody, {"model": "m", "input": 1}, "input"),
        (CompletionBody, completion(stop=["a", None]), "stop.1"),
        (CompletionBody, completion(prompt=""), "prompt"),
        (CompletionBody, completion(temperature=float("inf")), "temperature"),
        (CompletionBody, {"prompt": "x"}, "model"),
    ],
)
def test_validation_errors_name_the_dotted_field_path(model: type, body: dict[str, Any], param: str) -> None:
    assert api_param(model, body) == param


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (CompletionBody, completion(prompt="a\ud800b"), "prompt"),
        (ChatCompletionBody, chat(messages=[{"role": "user", "content": "\udfff"}]), "messages.0.content"),
        (EmbeddingBody, {"model": "m", "input": ["ok", "\ud800"]}, "input.1"),
        (CompletionBody, completion(stop=["\ud800"]), "stop.0"),
        (CompletionBody, completion(model="\ud800"), "model"),
    ],
)
def test_lone_surrogates_are_rejected(model: type, body: dict[str, Any], param: str) -> None:
    assert api_param(model, body) == param
