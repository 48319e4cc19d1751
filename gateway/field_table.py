"""The README's table of every field of the OpenAI endpoints and its status, generated from the
body schemas (:mod:`gateway.schemas`) by the rule of :mod:`gateway.fields`; a unit test keeps the
README's copy equal to :func:`readme_field_table`."""

from __future__ import annotations

from gateway.fields import field_table
from gateway.schemas import ChatCompletionBody, CompletionBody, EmbeddingBody, EndpointBody

# The bodies of the OpenAI endpoints, in the README's field table's column order.
OPENAI_BODIES: dict[str, type[EndpointBody]] = {
    "/v1/completions": CompletionBody,
    "/v1/chat/completions": ChatCompletionBody,
    "/v1/embeddings": EmbeddingBody,
}

# Why a field has its status, where that is not plain: the README table's last column.
FIELD_NOTES = {
    "user": "a caller's label; no output depends on it",
    "safety_identifier": "a caller's label, like `user`",
    "metadata": "tags for OpenAI's stored completions; Sluice stores none",
    "store": "Sluice stores no completion",
    "service_tier": "OpenAI's billing tier; one tier here (`priority` orders requests)",
    "prompt_cache_key": "a cache-routing hint; prefix caching needs none",
    "parallel_tool_calls": "false: at most one call per choice (constrained modes)",
    "tool_choice": "`none`, `auto`, `required` or a named function; see Tools",
    "suffix": "no fill-in-the-middle",
    "response_format": "`text`, `json_object`, `json_schema` (llguidance's JSON Schema subset; an unsupported keyword is a 400); on completions too, as vLLM's",
    "tools": "functions only, each with `parameters` (a JSON Schema); see Tools",
    "functions": "no function calling",
    "audio": "text models only",
    "modalities": "text models only",
    "prediction": "no predicted outputs",
    "reasoning_effort": "no reasoning models",
    "verbosity": "it would change the output's length",
    "web_search_options": "no web search",
    "dimensions": "for a model whose config lists `matryoshka_dimensions`; for another, a 400 `unsupported_parameter`",
    "messages": "text parts of `content` are concatenated; image, audio and file parts are a 400",
    "repetition_penalty": "vLLM's",
    "min_p": "vLLM's",
    "min_tokens": "vLLM's",
    "stop_token_ids": "vLLM's",
    "top_k": "vLLM's",
    "ignore_eos": "vLLM's",
    "return_token_ids": "vLLM's",
    "priority": "vLLM's; bounded by the config",
    "timeout": "Sluice's: seconds until a 504",
    "guided_json": "vLLM's: a JSON Schema (object or JSON text)",
    "guided_regex": "vLLM's",
    "guided_choice": "vLLM's: one of the strings",
    "guided_grammar": "vLLM's: Lark in llguidance's dialect, or GBNF",
    "structured_outputs": "vLLM's: one of `json`, `regex`, `choice`, `grammar`, `json_object`; its other keys are a 400",
}


def readme_field_table() -> str:
    """The README's table of every field of the OpenAI endpoints and its status."""
    statuses = {path: body.field_statuses() for path, body in OPENAI_BODIES.items()}
    openai_fields = frozenset(name for body in OPENAI_BODIES.values() for name in body.openai_fields)
    return field_table(statuses, openai_fields, FIELD_NOTES)
