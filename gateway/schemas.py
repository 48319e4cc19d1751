"""Request bodies of the OpenAI-compatible API (pydantic), validated before anything is queued."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator,
)

MAX_STOP_STRINGS = 4
MAX_TIMEOUT_S = 7 * 24 * 3600


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
    n: StrictInt = 1
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

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return stop

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


class CompletionBody(_SamplingBody):
    """``POST /v1/completions``. ``max_tokens`` defaults to 16, as OpenAI's does."""

    prompt: Text = Field(min_length=1)


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: Text


class ChatCompletionBody(_SamplingBody):
    """``POST /v1/chat/completions``. Without ``max_tokens`` (or ``max_completion_tokens``)
    generation may run to the model's ``max_model_len``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)


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
