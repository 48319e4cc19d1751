"""Tokenizing prompts from any thread at once, and bounding their length before tokenizing.

A Hugging Face fast tokenizer keeps ``split_special_tokens`` as state of its Rust backend and sets
it on every call, so two threads tokenizing with different settings race. :class:`PromptEncoder`
holds two copies of the backend, one splitting control-token strings (user text) and one keeping
them (a chat template's own text), each configured once and never changed: calls need no lock.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from jinja2 import TemplateError

from gateway.errors import invalid_request


class ToolFunction(Protocol):
    """The function of a tool call: its name and its arguments (JSON text)."""

    @property
    def name(self) -> str: ...

    @property
    def arguments(self) -> str: ...


class ToolCall(Protocol):
    """A tool call an assistant message made."""

    @property
    def id(self) -> str: ...

    @property
    def function(self) -> ToolFunction: ...


class Message(Protocol):
    """A chat message as the body schema holds it; ``text()`` is its content as one string."""

    @property
    def role(self) -> str: ...

    @property
    def name(self) -> str | None: ...

    @property
    def tool_call_id(self) -> str | None: ...

    @property
    def tool_calls(self) -> Sequence[ToolCall] | None: ...

    def text(self) -> str: ...


# Roles a chat template is given for OpenAI's: ``developer`` is OpenAI's newer ``system``.
TEMPLATE_ROLES = {"developer": "system"}


@dataclass(frozen=True)
class Piece:
    """A stretch of prompt text tokenized one way.

    ``is_user_text``: control-token strings in it (``<|im_end|>``, ``[SEP]``) are split as plain
    text; otherwise (a chat template's own text) they are the control tokens.
    ``add_special_tokens``: the tokenizer's usual BOS/CLS/SEP are added around it.
    """

    text: str
    is_user_text: bool
    add_special_tokens: bool


class PromptEncoder:
    """Token ids of one model's prompts; thread-safe without a lock for fast tokenizers.

    Args:
        tokenizer: the model's Hugging Face tokenizer. A fast one (with a Rust backend) is copied
            twice; another one is called behind a lock of its own.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.num_special_tokens = int(tokenizer.num_special_tokens_to_add())
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backends = None if backend is None else {split: _backend_copy(backend, split) for split in (True, False)}
        self._slow_lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary, added tokens included: a prompt's ids lie in ``[0, vocab_size)``."""
        return len(self.tokenizer)

    def text_pieces(self, text: str) -> list[Piece]:
        """A completion's prompt: user text, with the usual special tokens."""
        return [Piece(text, is_user_text=True, add_special_tokens=True)]

    def chat_pieces(
        self, messages: Sequence[Message], model_name: str, add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[Piece]:
        """The chat template applied to ``messages`` (with the generation prompt unless told not
        to) and ``tools`` (OpenAI's tool JSON, for a template that renders them; ``None``: none),
        as pieces: the template's text keeps its control tokens, each string a client wrote
        (content, name, tool call ids, names, and the keys and string values of arguments) is user
        text. The template is rendered with a placeholder per string, so its cost does not grow
        with them. A call's arguments reach the template as an object (transformers' format), its
        strings JSON-escaped (templates write arguments with ``tojson``); the tools' JSON is
        the template's own text.

        A conversation without control-token strings tokenizes as the whole rendered template
        does, except where a content's leading or trailing whitespace would merge with the
        template's across the seam.

        Raises:
            APIError: 400 (``messages``) when the model has no chat template, or its template
                refuses the conversation (a role it does not know, roles out of order).
        """
        if not self.tokenizer.chat_template:
            raise invalid_request(f"The model '{model_name}' has no chat template", param="messages")
        nonce = uuid.uuid4().hex
        texts: list[str] = []

        def hole(text: str) -> str:
            texts.append(text)
            return f"@@{nonce}:{len(texts) - 1}@@"

        rendered = [_template_message(m, hole) for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                rendered, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except TemplateError as exc:
            raise invalid_request(f"The chat template of '{model_name}' refuses the messages: {exc}", param="messages") from None
        pieces = []
        for index, part in enumerate(re.split(f"@@{nonce}:(\\d+)@@", text)):
            is_client_text = index % 2 == 1  # re.split puts the captured index at odd positions
            pieces.append(Piece(texts[int(part)] if is_client_text else part, is_client_text, False))
        return pieces

    def max_num_tokens(self, pieces: Sequence[Piece]) -> int:
        """An upper bound on the tokens of ``pieces``, without tokenizing: a token covers at least
        one byte of its text (byte-level BPE, WordPiece), plus one per piece for a normalizer's
        prepended space, plus the special tokens added."""
        num_bytes = sum(len(p.text.encode("utf-8")) for p in pieces)
        num_special = sum(self.num_special_tokens for p in pieces if p.add_special_tokens)
        return num_bytes + len(pieces) + num_special

    def encode(self, pieces: Sequence[Piece]) -> list[int]:
        """Token ids of ``pieces``, joined (callable from any thread)."""
        ids: list[int] = []
        for piece in pieces:
            ids += self._encode(piece)
        return ids

    def _encode(self, piece: Piece) -> list[int]:
        if self._backends is not None:
            return list(self._backends[piece.is_user_text].encode(piece.text, add_special_tokens=piece.add_special_tokens).ids)
        with self._slow_lock:
            encoded = self.tokenizer(
                piece.text, add_special_tokens=piece.add_special_tokens, split_special_tokens=piece.is_user_text
            )
            return list(encoded.input_ids)


def _template_message(message: Message, hole: Callable[[str], str]) -> dict[str, Any]:
    """``message`` as a chat template reads it, each client string replaced by ``hole(string)``."""
    out: dict[str, Any] = {"role": TEMPLATE_ROLES.get(message.role, message.role), "content": hole(message.text())}
    if message.name is not None:
        out["name"] = hole(message.name)
    if message.tool_call_id is not None:
        out["tool_call_id"] = hole(message.tool_call_id)
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": hole(c.id), "type": "function",
                "function": {"name": hole(c.function.name), "arguments": _holed_json(json.loads(c.function.arguments), hole)},
            }
            for c in message.tool_calls
        ]
    return out


def _holed_json(value: Any, hole: Callable[[str], str]) -> Any:
    """Decoded JSON with each string (keys included) replaced by ``hole`` of its JSON-escaped
    text, so the template's ``tojson`` of the placeholder, once filled, is the string's JSON."""
    if isinstance(value, str):
        return hole(json.dumps(value, ensure_ascii=False)[1:-1])
    if isinstance(value, list):
        return [_holed_json(v, hole) for v in value]
    if isinstance(value, dict):
        return {_holed_json(k, hole): _holed_json(v, hole) for k, v in value.items()}
    return value


def _backend_copy(backend: Any, split_special_tokens: bool) -> Any:
    """A private copy of a Rust tokenizer backend with ``encode_special_tokens`` fixed, and the
    padding and truncation a saved tokenizer may carry turned off (as the Python wrapper does)."""
    copy = type(backend).from_str(backend.to_str())
    copy.encode_special_tokens = split_special_tokens
    copy.no_padding()
    copy.no_truncation()
    return copy
