"""Which OpenAI response shape a generation answers in: a chat completion or a text completion."""

from __future__ import annotations

from enum import Enum
from typing import Any


class ResponseFormat(Enum):
    """``CHAT``: ``chat.completion`` objects (``message``/``delta`` with a role); ``COMPLETION``:
    ``text_completion`` objects (``text``)."""

    CHAT = "chat"
    COMPLETION = "completion"

    @property
    def id_prefix(self) -> str:
        """The prefix of a response id: ``chatcmpl`` or ``cmpl``."""
        return "chatcmpl" if self is ResponseFormat.CHAT else "cmpl"

    def object_name(self, is_chunk: bool) -> str:
        """The ``object`` of a whole response or of one SSE chunk."""
        if self is ResponseFormat.COMPLETION:
            return "text_completion"
        return "chat.completion.chunk" if is_chunk else "chat.completion"

    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        """One choice of a whole response."""
        if self is ResponseFormat.CHAT:
            message = {"role": "assistant", "content": text}
            return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, text: str | None, finish_reason: str | None, has_role: bool = False) -> dict[str, Any]:
        """One choice of an SSE chunk: ``text`` ``None`` leaves a chat delta without content (a
        completion chunk's text is then empty); ``has_role`` opens a chat stream's first delta."""
        if self is ResponseFormat.CHAT:
            delta: dict[str, Any] = {"role": "assistant"} if has_role else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
