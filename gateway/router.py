"""Tokenizing once and routing a prompt to its model's bucket."""

from __future__ import annotations

import re
import threading
import uuid

from buckets.bucket import Bucket
from gateway.engine import Engine, ServedModel
from gateway.errors import invalid_request, model_not_found, model_unavailable
from gateway.schemas import ChatMessage


class Router:
    """Looks models up, tokenizes prompts, and picks the smallest bucket that holds them."""

    # A fast tokenizer keeps ``split_special_tokens`` as state of its Rust backend, set by each
    # call; prompts are tokenized on worker threads, so one call at a time sets it and encodes.
    _encode_lock = threading.Lock()

    def __init__(self, engine: Engine):
        self.engine = engine

    def model(self, name: str, task: str) -> ServedModel:
        """The served model called ``name`` for ``task``.

        Raises:
            APIError: 404 for an unknown model; 503 with ``Retry-After`` while it drains; 400
                when it does not serve ``task``.
        """
        served = self.engine.models.get(name)
        if served is None:
            raise model_not_found(name)
        if served.draining:
            raise model_unavailable(name, self.engine.config.drain_retry_after_s)
        if served.config.task != task:
            raise invalid_request(f"The model '{name}' does not support {task}", param="model", code="wrong_task")
        return served

    @staticmethod
    def tokenize(served: ServedModel, text: str) -> list[int]:
        """Token ids of user text, with the tokenizer's usual special tokens (BOS, CLS/SEP) added.

        Control-token strings inside ``text`` (``<|im_end|>``, ``[SEP]``) are tokenized as plain
        text, never as the control tokens themselves.
        """
        with Router._encode_lock:
            return list(served.loaded.tokenizer(text, split_special_tokens=True).input_ids)

    @staticmethod
    def tokenize_chat(served: ServedModel, messages: list[ChatMessage]) -> list[int]:
        """Token ids of the chat template applied to ``messages``, with the generation prompt.

        The template is rendered with a placeholder for each message's content; the template's
        own text is tokenized with its control tokens, each content as plain text (control-token
        strings in it split), and the pieces are joined. A conversation without control-token
        strings tokenizes as the whole rendered template does, except where a content's leading
        or trailing whitespace would merge with the template's across the seam.

        Raises:
            APIError: 400 (``messages``) when the model has no chat template.
        """
        tokenizer = served.loaded.tokenizer
        if not tokenizer.chat_template:
            raise invalid_request(f"The model '{served.config.name}' has no chat template", param="messages")
        nonce = uuid.uuid4().hex
        placeholders = [{"role": m.role, "content": f"@@{nonce}:{i}@@"} for i, m in enumerate(messages)]
        text = tokenizer.apply_chat_template(placeholders, add_generation_prompt=True, tokenize=False)
        ids: list[int] = []
        with Router._encode_lock:
            for index, piece in enumerate(re.split(f"@@{nonce}:(\\d+)@@", text)):
                is_content = index % 2 == 1  # re.split puts the captured message index at odd positions
                content = messages[int(piece)].content if is_content else piece
                ids += tokenizer(content, add_special_tokens=False, split_special_tokens=is_content).input_ids
        return ids

    @staticmethod
    def route(served: ServedModel, num_prompt_tokens: int, max_tokens: int, param: str) -> Bucket:
        """The bucket for a prompt of ``num_prompt_tokens`` that may grow by ``max_tokens``.

        Raises:
            APIError: 400 when the prompt exceeds the largest bucket, the total exceeds
            ``max_model_len``, or the total needs more KV than the bucket's whole pool; each
            message names the limit.
        """
        max_model_len = served.config.max_model_len
        if num_prompt_tokens + max_tokens > max_model_len:
            raise invalid_request(
                f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{num_prompt_tokens} tokens and max_tokens is {max_tokens}",
                param="max_tokens" if num_prompt_tokens < max_model_len else param,
                code="context_length_exceeded",
            )
        bucket = served.table.pick(num_prompt_tokens)
        if bucket is None:
            raise invalid_request(
                f"The prompt has {num_prompt_tokens} tokens; the largest bucket of '{served.config.name}' "
                f"takes at most {served.table.max_input_tokens} input tokens",
                param=param,
                code="prompt_too_long",
            )
        if bucket.kv_capacity_tokens is not None and num_prompt_tokens + max_tokens > bucket.kv_capacity_tokens:
            raise invalid_request(
                f"The prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) needs more KV cache than "
                f"bucket '{bucket.name}' of '{served.config.name}' holds: {bucket.kv_capacity_tokens} tokens",
                param="max_tokens",
                code="kv_cache_capacity_exceeded",
            )
        return bucket

    @staticmethod
    def default_max_tokens(served: ServedModel, num_prompt_tokens: int) -> int:
        return max(1, served.config.max_model_len - num_prompt_tokens)

