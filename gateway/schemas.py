"""Request bodies of the OpenAI-compatible API (pydantic), validated before anything is queued."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import (
    BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictFloat, StrictInt, StrictStr, Tag,
    field_validator, model_validator,
)

from gateway.body_text import Text
from gateway.fields import FieldStatus, check_refused, field_statuses
from gateway.structured_fields import StructuredFields
from gateway.tool_schemas import ToolChoice, ToolDefinition, check_tool_choice

MAX_STOP_STRINGS = 4
MAX_TIMEOUT_S = 7 * 24 * 3600
# OpenAI's bounds: completions' ``logprobs`` and chat's ``top_logprobs``.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do (clients send extras).
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """``null`` for an optional field means its default, as OpenAI reads it."""
        if not isinstance(data, dict):
            return data
        optional = {name for name, info in cls.model_fields.items() if not info.is_required()}
        return {k: v for k, v in data.items() if not (v is None and k in optional)}


class EndpointBody(_Body):
    """The body of one endpoint, and the status of each field OpenAI documents for it.

    ``openai_fields``: the endpoint's fields in OpenAI's API reference (openai-python's
    ``*_create_params.py``). ``refused_fields``: fields a body may not set (400
    ``unsupported_parameter``, see :mod:`gateway.fields`); ``ignored_fields``: fields read and
    dropped because they cannot change the result. Every other OpenAI field is a field of the model.
    """

    openai_fields: ClassVar[tuple[str, ...]] = ()
    refused_fields: ClassVar[frozenset[str]] = frozenset()
    ignored_fields: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def check_refused(cls, data: dict[str, Any]) -> None:
        """Raises APIError 400 ``unsupported_parameter`` for a refused field ``data`` sets."""
        check_refused(data, cls.refused_fields)

    @classmethod
    def field_statuses(cls) -> dict[str, FieldStatus]:
        """Each field of the endpoint (OpenAI's, then the extensions) with its status."""
        return field_statuses(cls.openai_fields, list(cls.model_fields), cls.refused_fields, cls.ignored_fields)


# Fields refused on both generation endpoints. The engineers implementing one move it out of
# here (to a field of the body), one line per field.
_REFUSED_GENERATION: frozenset[str] = frozenset()
# Accepted and dropped: a caller's label (user, safety_identifier), storage and billing
# options of OpenAI's platform (metadata, store, service_tier), a cache hint (prompt_cache_key).
_IGNORED_GENERATION = frozenset({"user"})
_IGNORED_CHAT = frozenset({"metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _SamplingBody(EndpointBody, StructuredFields):
    """The fields both generation endpoints share; the structured-output fields
    (``response_format``, vLLM's ``guided_*`` and ``structured_outputs``) come from
    :class:`~gateway.structured_fields.StructuredFields`."""

    model: Text
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | StrictInt = Field(default=1.0, ge=0.0, le=2.0)
    top_p: StrictFloat | StrictInt = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=0, ge=0)
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # torch.Generator range
    stop: Text | list[Text] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Choices from one prompt (1 to the model's ``max_n``, checked by the route).
    n: StrictInt = Field(default=1, ge=1)
    # Lower is more urgent (vLLM's convention); the config bounds it.
    priority: StrictInt = 0
    # Seconds until the request times out (Sluice's extension); the model's config sets a default and a cap.
    timeout: StrictFloat | StrictInt | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    ignore_eos: StrictBool = False
    # vLLM's extension: also return prompt and completion token ids in each choice.
    return_token_ids: StrictBool = False
    # Logits processors (models/logits_processors.py); null means the default, which turns each off.
    frequency_penalty: StrictFloat | StrictInt | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: StrictFloat | StrictInt | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat | StrictInt | None = Field(default=None, gt=0.0, allow_inf_nan=False)  # vLLM's
    min_p: StrictFloat | StrictInt | None = Field(default=None, ge=0.0, le=1.0)  # vLLM's
    logit_bias: dict[StrictStr, Annotated[StrictFloat | StrictInt, Field(ge=-100.0, le=100.0)]] | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None  # vLLM's
    min_tokens: StrictInt | None = Field(default=None, ge=0)  # vLLM's

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return stop

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_SamplingBody":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: set stream_options only with stream: true")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"keys must be token ids (decimal integers as strings), got {key!r}")
        return bias

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token id, bias)`` pairs (its keys are strings in JSON)."""
        return tuple((int(key), float(bias)) for key, bias in (self.logit_bias or {}).items())

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


# A completion prompt: a string, a list of strings, a list of token ids, or a list of lists of them.
PromptField = Text | list[Text] | list[StrictInt] | list[list[StrictInt]]


class CompletionBody(_SamplingBody):
    """``POST /v1/completions``. ``max_tokens`` defaults to 16, as OpenAI's does; 0 only with
    ``echo`` (checked by the route: the prompt alone comes back, with its logprobs when
    ``logprobs`` is set). Each prompt of a list becomes its own ``n`` choices. ``logprobs``
    (0 to 5): each token's logprob and that many alternatives."""

    openai_fields = (
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
        "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
    )
    refused_fields = _REFUSED_GENERATION | {"suffix"}
    ignored_fields = _IGNORED_GENERATION

    prompt: PromptField
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: StrictBool = False
    # Accepted only when it equals ``n`` (or is absent); the route refuses anything else.
    best_of: StrictInt | None = None

    @field_validator("prompt")
    @classmethod
    def _no_empty_prompt(cls, prompt: str | list[str] | list[int] | list[list[int]]) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt must not be empty")
            return prompt
        if not prompt:
            raise ValueError("the prompt list must not be empty")
        for i, item in enumerate(prompt):
            if isinstance(item, (str, list)) and not item:
                raise ValueError(f"{i}: a prompt of the list must not be empty")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the body: a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(item, int) for item in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)


class ToolCallFunction(_Body):
    """The function an assistant message called: its name and its arguments (JSON text of an
    object, as the model produced them)."""

    name: Text
    arguments: Text

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError as exc:
            raise ValueError(f"the arguments must be JSON text of an object: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"the arguments must be a JSON object, got {type(value).__name__}")
        return arguments


class ToolCall(_Body):
    """A tool call of an earlier assistant message, as the conversation passes it back."""

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction


# Part types that carry no text: refused, as every model Sluice serves reads text only.
MEDIA_PART_TYPES = ("image_url", "input_audio", "file")


def _text_part_schema(schema: dict[str, Any]) -> None:
    """The documented schema of a content part: a text part (the only kind that validates)."""
    schema["properties"]["type"] = {"enum": ["text"], "type": "string"}
    schema["properties"]["text"] = {"type": "string"}
    schema["required"] = ["type", "text"]


class ContentPart(_Body):
    """One part of a message's content: ``{"type": "text", "text": ...}``; a media part (image,
    audio, file) fails validation naming its ``type`` (the OpenAPI document shows text parts)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_text_part_schema)

    type: Literal["text", "image_url", "input_audio", "file"]
    text: Text | None = None

    @model_validator(mode="after")
    def _text_only(self) -> "ContentPart":
        if self.type != "text":
            raise ValueError(f"type: '{self.type}' parts need a model that reads them; this model reads text only")
        if self.text is None:
            raise ValueError("text: a text part needs its text")
        return self


# The fields each role needs beside ``role``; only an assistant message carries ``tool_calls``.
_ROLE_REQUIRED = {
    "system": ["content"], "developer": ["content"], "user": ["content"], "assistant": [], "tool": ["content", "tool_call_id"],
}


def _per_role_schema(schema: dict[str, Any]) -> None:
    """The documented schema of a message: one variant per role with the fields it needs (as
    OpenAI's spec has it), while validation stays one model so errors name ``messages.i.field``."""
    properties = schema.pop("properties")
    schema.pop("required", None)
    schema.pop("type", None)
    variants = []
    for role, required in _ROLE_REQUIRED.items():
        fields = {k: v for k, v in properties.items() if k != "tool_calls" or role == "assistant"}
        for name in required:  # a needed field is not nullable either
            fields[name] = {**fields[name], "anyOf": [o for o in fields[name]["anyOf"] if o.get("type") != "null"]}
        fields["role"] = {"enum": [role], "type": "string"}
        variants.append({"type": "object", "properties": fields, "required": ["role", *required]})
    schema["oneOf"] = variants


class ChatMessage(_Body):
    """A chat message. ``content`` is a string or a list of text parts (:meth:`text` joins
    them); it may be ``null`` on an assistant message (one that called tools). ``developer``
    is OpenAI's newer name for ``system``; a ``tool`` message answers ``tool_call_id``."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_per_role_schema)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    refusal: Text | None = None

    @model_validator(mode="after")
    def _check_role_fields(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: a {self.role} message needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message names the call it answers")
        return self

    def text(self) -> str:
        """The content as one string: text parts concatenated with nothing between them (as
        OpenAI reads them; vLLM joins them with newlines); ``""`` for no content."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ChatCompletionBody(_SamplingBody):
    """``POST /v1/chat/completions``. Without ``max_tokens`` (or ``max_completion_tokens``)
    generation may run to the model's ``max_model_len``."""

    openai_fields = (
        "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
        "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
        "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
        "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
        "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
    )
    refused_fields = _REFUSED_GENERATION | {
        "audio", "modalities", "prediction",
        "functions", "function_call", "reasoning_effort", "verbosity", "web_search_options",
    }
    ignored_fields = _IGNORED_GENERATION | _IGNORED_CHAT

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    # ``logprobs: true``: each generated token's logprob, with ``top_logprobs`` (0 to 20) alternatives.
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    # Tool calling (gateway/tool_schemas.py, gateway/tools.py); ``tool_choice`` defaults to
    # ``auto`` when ``tools`` are given, as OpenAI's does.
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionBody:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: logprobs must be true when top_logprobs is given")
        check_tool_choice(self.tools or [], self.tool_choice)
        return self

    def num_top_logprobs(self) -> int | None:
        """Alternatives per token for the core (``None``: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


# A token id in a body (a prompt or an embeddings input given as ids); the vocabulary bounds it later.
TokenId = Annotated[StrictInt, Field(ge=0)]


def _input_form(value: Any) -> str | None:
    """Which form an embeddings ``input`` takes, by its first item, so a bad item is named by its
    position in that form alone. The tags are the forms' type names, which ``param`` leaves out."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None  # no form: pydantic's error names ``input``
    first = value[0] if value else ""
    if isinstance(first, list):
        return "list[list[int]]"
    return "list[int]" if isinstance(first, int) and not isinstance(first, bool) else "list[str]"


EmbeddingInput = Annotated[
    Annotated[Text, Tag("str")]
    | Annotated[list[Text], Tag("list[str]")]
    | Annotated[list[TokenId], Tag("list[int]")]
    | Annotated[list[list[TokenId]], Tag("list[list[int]]")],
    Discriminator(_input_form),
]


class EmbeddingBody(EndpointBody):
    """``POST /v1/embeddings``: a string, a list of strings, a list of token ids, or a list of
    lists of token ids. ``dimensions`` needs a model whose config lists Matryoshka dimensions."""

    openai_fields = ("input", "model", "dimensions", "encoding_format", "user")
    ignored_fields = frozenset({"user"})

    model: Text
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1)
    priority: StrictInt = 0
    timeout: StrictFloat | StrictInt | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: str | list[str] | list[int] | list[list[int]]) -> Any:
        items = [value] if isinstance(value, str) else value
        if not items or any(isinstance(s, (str, list)) and not s for s in items):
            raise ValueError("input must be a non-empty string, token list, or list of them, with no empty item")
        return value

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a list: of strings, or of token-id lists (a flat id list is one input)."""
        if isinstance(self.input, str):
            return [self.input]
        if all(isinstance(i, int) for i in self.input):
            return [cast(list[int], list(self.input))]
        return cast("list[str] | list[list[int]]", list(self.input))

    def is_flat_ids(self) -> bool:
        """Whether ``input`` is one list of token ids (its positions are ``input.<j>``)."""
        return isinstance(self.input, list) and isinstance(self.input[0], int)


class TokenizeBody(EndpointBody):
    """``POST /tokenize`` (vLLM's): the token ids of a ``prompt`` (with the tokenizer's special
    tokens unless ``add_special_tokens`` is false) or of chat ``messages`` (through the chat
    template, with the generation prompt unless ``add_generation_prompt`` is false); one of the two."""

    model: Text
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeBody":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: set either prompt or messages")
        return self


class DetokenizeBody(EndpointBody):
    """``POST /detokenize`` (vLLM's): the text of ``tokens``."""

    model: Text
    tokens: list[TokenId]
