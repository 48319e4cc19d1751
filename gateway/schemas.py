"""Request bodies of the OpenAI-compatible API (pydantic), validated before anything is queued."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator, model_validator,
)

MAX_STOP_STRINGS = 4
MAX_TIMEOUT_S = 7 * 24 * 3600
# OpenAI's bounds: completions' ``logprobs`` and chat's ``top_logprobs``.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20


def _encodable(text: str) -> str:
    """JSON's ``\\ud800`` escapes decode to lone surrogates, which no tokenizer or encoder takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"String contains an invalid Unicode code point at position {exc.start}") from None
    return text


# A string field: strictly a string, and valid Unicode (no lone surrogates).
Text = Annotated[StrictStr, AfterValidator(_encodable)]


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do (clients send extras).
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _SamplingBody(_Body):
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

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return stop

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


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: Text


class ChatCompletionBody(_SamplingBody):
    """``POST /v1/chat/completions``. Without ``max_tokens`` (or ``max_completion_tokens``)
    generation may run to the model's ``max_model_len``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    # ``logprobs: true``: each generated token's logprob, with ``top_logprobs`` (0 to 20) alternatives.
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionBody:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: logprobs must be true when top_logprobs is given")
        return self

    def num_top_logprobs(self) -> int | None:
        """Alternatives per token for the core (``None``: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class EmbeddingBody(_Body):
    """``POST /v1/embeddings``: one string or a list of strings."""

    model: Text
    input: Text | list[Text]
    encoding_format: Literal["float", "base64"] = "float"
    priority: StrictInt = 0
    timeout: StrictFloat | StrictInt | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: str | list[str]) -> str | list[str]:
        items = [value] if isinstance(value, str) else value
        if not items or any(not s for s in items):
            raise ValueError("input must be a non-empty string or a non-empty list of non-empty strings")
        return value

    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)
