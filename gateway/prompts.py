"""Tokenizing prompts from any thread at once, and bounding their length before tokenizing.

A Hugging Face fast tokenizer keeps ``split_special_tokens`` as state of its Rust backend and sets
it on every call, so two threads tokenizing with different settings race. :class:`PromptEncoder`
holds two copies of the backend, one splitting control-token strings (user text) and one keeping
them (a chat template's own text), each configured once and never changed: calls need no lock.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.errors import invalid_request


class Message(Protocol):
    """A chat message as the body schema holds it."""

    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...


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

    def text_pieces(self, text: str) -> list[Piece]:
        """A completion's prompt: user text, with the usual special tokens."""
        return [Piece(text, is_user_text=True, add_special_tokens=True)]

    def chat_pieces(self, messages: Sequence[Message], model_name: str) -> list[Piece]:
        """The chat template applied to ``messages`` with the generation prompt, as pieces: the
        template's text keeps its control tokens, each content is user text. The template is
        rendered with a placeholder per content, so its cost does not grow with the contents.

        A conversation without control-token strings tokenizes as the whole rendered template
        does, except where a content's leading or trailing whitespace would merge with the
        template's across the seam.

        Raises:
            APIError: 400 (``messages``) when the model has no chat template.
        """
        if not self.tokenizer.chat_template:
            raise invalid_request(f"The model '{model_name}' has no chat template", param="messages")
        nonce = uuid.uuid4().hex
        placeholders = [{"role": m.role, "content": f"@@{nonce}:{i}@@"} for i, m in enumerate(messages)]
        text = self.tokenizer.apply_chat_template(placeholders, add_generation_prompt=True, tokenize=False)
        pieces = []
        for index, part in enumerate(re.split(f"@@{nonce}:(\\d+)@@", text)):
            is_content = index % 2 == 1  # re.split puts the captured message index at odd positions
            pieces.append(Piece(messages[int(part)].content if is_content else part, is_content, False))
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


def _backend_copy(backend: Any, split_special_tokens: bool) -> Any:
    """A private copy of a Rust tokenizer backend with ``encode_special_tokens`` fixed, and the
    padding and truncation a saved tokenizer may carry turned off (as the Python wrapper does)."""
    copy = type(backend).from_str(backend.to_str())
    copy.encode_special_tokens = split_special_tokens
    copy.no_padding()
    copy.no_truncation()
    return copy
