"""OpenAI's two logprobs shapes, from the core's :class:`~models.step_io.TokenLogprobs`.

- Completions (``logprobs: k``, openai-python's ``completion_choice.Logprobs``): parallel lists
  ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict token text -> logprob of the ``k``
  most likely tokens plus the chosen one, so up to ``k + 1`` entries, as OpenAI documents) and
  ``text_offset`` (each token's character offset into the choice's text, echoed prompt
  included). With ``echo``, the prompt's first token has ``null`` logprob and alternatives.
- Chat (``logprobs: true``, ``top_logprobs: k``, ``chat_completion_token_logprob.py``):
  ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}] * k}]}``, one
  entry per token of the message's content: a special token the content leaves out (the
  end-of-turn token that ended it) has none, as OpenAI's chat answers show none, so the entries'
  tokens join to the content.

A token's text is its own decoding (special tokens spelled out), as vLLM's ``decoded_token``;
``bytes`` are the UTF-8 bytes of that text. Text offsets add up these texts' lengths, as vLLM's
``_create_completion_logprobs`` does, so they follow the choice's text as long as each token
decodes on its own to its share of it (a character split across tokens decodes to U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from buckets.request import GenerationRequest, TokenEvent
from models.step_io import TokenLogprobs


class LogprobsFormatter:
    """Formats one choice's logprobs, chunk after chunk (streamed) or at once.

    Args:
        tokenizer: the model's Hugging Face tokenizer (``decode``).
        num_top: alternatives per token (completions ``logprobs``, chat ``top_logprobs``).
    """

    def __init__(self, tokenizer: Any, num_top: int) -> None:
        self._tokenizer = tokenizer
        self._num_top = num_top
        self._texts: dict[int, str] = {}
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self._offset_chars = 0  # characters of the choice's text before the next token

    def token_text(self, token_id: int) -> str:
        """The text of one token, decoded alone."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def completion(self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None]) -> dict[str, Any]:
        """The completion form for the next ``token_ids`` of the choice's text (an entry
        ``None``: a token without logprobs, the echoed prompt's first); ``text_offset`` goes on
        from the tokens formatted before."""
        tokens = [self.token_text(t) for t in token_ids]
        offsets: list[int] = []
        for text in tokens:
            offsets.append(self._offset_chars)
            self._offset_chars += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else self._top_dict(e) for e in entries],
            "text_offset": offsets,
        }

    def chat(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """The chat form of the next tokens: ``{"content": [...]}``."""
        content = []
        for entry in entries:
            if entry.token_id in self._special_ids:
                continue
            item = self._chat_item(entry.token_id, entry.logprob)
            item["top_logprobs"] = [self._chat_item(token_id, value) for token_id, value in entry.top[: self._num_top]]
            content.append(item)
        return {"content": content}

    def _top_dict(self, entry: TokenLogprobs) -> dict[str, float]:
        top = {self.token_text(token_id): value for token_id, value in entry.top[: self._num_top]}
        top.setdefault(self.token_text(entry.token_id), entry.logprob)
        return top

    def _chat_item(self, token_id: int, value: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}


class ChoiceLogprobs:
    """The logprobs of one choice of a request that asked for them, event after event.

    Args:
        formatter: the choice's :class:`LogprobsFormatter`.
        is_chat: the chat form, else the completion form.
        prompt_token_ids: the prompt's tokens, when their logprobs are returned (``echo``).
    """

    def __init__(self, formatter: LogprobsFormatter, is_chat: bool, prompt_token_ids: Sequence[int] | None = None) -> None:
        self._formatter = formatter
        self._is_chat = is_chat
        self._prompt_token_ids = prompt_token_ids
        self._token_ids: list[int] = []
        self._entries: list[TokenLogprobs | None] = []

    def chunk(self, event: TokenEvent) -> dict[str, Any]:
        """The logprobs of one streamed chunk: the event's tokens (after the prompt's, on the
        first event of an ``echo`` request)."""
        token_ids, entries = self._tokens_of(event)
        if self._is_chat:
            return self._formatter.chat([e for e in entries if e is not None])
        return self._formatter.completion(token_ids, entries)

    def add(self, event: TokenEvent) -> None:
        """Keep an event's logprobs for :meth:`whole`."""
        token_ids, entries = self._tokens_of(event)
        self._token_ids.extend(token_ids)
        self._entries.extend(entries)

    def whole(self) -> dict[str, Any]:
        """The logprobs of every event :meth:`add` saw, as one choice's."""
        if self._is_chat:
            return self._formatter.chat([e for e in self._entries if e is not None])
        return self._formatter.completion(self._token_ids, self._entries)

    def _tokens_of(self, event: TokenEvent) -> tuple[list[int], list[TokenLogprobs | None]]:
        token_ids: list[int] = []
        entries: list[TokenLogprobs | None] = []
        if self._prompt_token_ids is not None and event.prompt_logprobs is not None:
            token_ids.extend(self._prompt_token_ids)
            entries.extend(event.prompt_logprobs)
        token_ids.extend(event.token_ids[: len(event.logprobs)])
        entries.extend(event.logprobs)
        return token_ids, entries


def choice_logprobs(request: GenerationRequest, tokenizer: Any, is_chat: bool) -> ChoiceLogprobs | None:
    """The logprobs view of ``request``'s choice, or ``None`` when it asked for none."""
    if request.num_top_logprobs is None:
        return None
    prompt = request.prompt_token_ids if request.needs_prompt_logprobs else None
    return ChoiceLogprobs(LogprobsFormatter(tokenizer, request.num_top_logprobs), is_chat, prompt)
