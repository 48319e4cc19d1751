"""Routing a request: its model, its tokens, its bucket, its admission.

Refusals stay cheap under a burst: a prompt is bounded by its length in bytes before it is
tokenized, and when every bucket that could hold it is full it is refused (429) without being
tokenized; a short prompt is tokenized on the event loop (tens of microseconds, less than a hop
to a thread), a long one on a worker thread, with no lock shared between models or threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from buckets.bucket import Bucket
from buckets.errors import BucketClosedError, BucketError
from buckets.request import Request
from gateway.engine import Engine, ServedModel
from gateway.errors import invalid_request, model_not_found, model_unavailable, queue_full, to_api_error
from gateway.prompts import Message, PromptEncoder
from models.loader import kept_tokenizers

# A layout can be replaced between routing and submitting; a request routes again this often.
MAX_ROUTE_ATTEMPTS = 3
# Prompts bounded by at most this many tokens are tokenized on the event loop (about 0.1 ms).
MAX_INLINE_PROMPT_TOKENS = 2048


@dataclass(frozen=True)
class Prompt:
    """A generation request's prompt before tokenizing: a completion's ``text`` or ``token_ids``
    (used as they are), or chat ``messages`` (rendered through the model's chat template).
    ``param`` is the body field its errors name (``prompt``, ``prompt.1`` in a list, ``messages``)."""

    text: str | None = None
    messages: Sequence[Message] = ()
    token_ids: Sequence[int] | None = None
    param: str = "prompt"
    tools: list[dict[str, Any]] | None = None  # for a chat template that renders tools (gateway/tools.py)


# (prompt token ids, max_tokens) -> the core request to queue.
RequestFactory = Callable[[list[int], int], Request]
# prompt tokens -> max_tokens (raises APIError 400 over the model's cap).
TokenBudget = Callable[[int], int]


class Router:
    """Looks models up, tokenizes prompts, picks the smallest bucket that holds them and admits
    them there, routing again when a layout change replaced the bucket in between."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._encoders: dict[int, PromptEncoder] = {}
        self._building: dict[int, asyncio.Future[PromptEncoder]] = {}

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

    async def encoder(self, served: ServedModel) -> PromptEncoder:
        """The lock-free encoder of ``served``'s tokenizer, built once per tokenizer on a worker
        thread (copying a tokenizer takes a while; the first requests wait for the same copy)."""
        tokenizer = served.loaded.tokenizer
        key = id(tokenizer)
        encoder = self._encoders.get(key)
        if encoder is not None and encoder.tokenizer is tokenizer:
            return encoder
        building = self._building.get(key)
        if building is None:
            building = self._building[key] = asyncio.ensure_future(asyncio.to_thread(PromptEncoder, tokenizer))
        try:
            encoder = await asyncio.shield(building)
        finally:
            if building.done():
                self._building.pop(key, None)
        tokenizers = [m.loaded.tokenizer for m in list(self.engine.models.values())] + kept_tokenizers()
        served_tokenizers = {id(t) for t in tokenizers}  # loaded, or kept for a model's next load
        self._encoders = {k: e for k, e in self._encoders.items() if k in served_tokenizers}  # unloaded models'
        self._encoders[key] = encoder
        return encoder

    async def warm(self) -> None:
        """Build the encoders of every served model (called once the models are loaded)."""
        await asyncio.gather(*(self.encoder(served) for served in list(self.engine.models.values())))

    async def submit(
        self,
        served: ServedModel,
        prompt: Prompt,
        budget: TokenBudget,
        deadline_s: float | None,
        build: RequestFactory,
        num_seqs: int = 1,
        tenant: tuple[str, float] | None = None,
    ) -> Request:
        """Tokenize ``prompt``, build its request with ``build(ids, budget(len(ids)))``, and
        queue it on its bucket (admission counts it as ``num_seqs`` sequences: its choices;
        ``tenant``: its tenant's name and weight, for a fair bucket's early refusal; ``None``:
        one with nothing queued). Returns the queued request.

        Raises:
            APIError: 429 ``queue_full`` (``Retry-After``) when the bucket is full, before
                tokenizing when every bucket the prompt could go to is full; 400 for an empty
                prompt, a missing chat template, or the limits of :meth:`route`; 503 when the
                bucket's slice is restarting or every attempt met a replaced bucket.
        """
        if prompt.token_ids is not None:
            ids = list(prompt.token_ids)
            self._refuse_when_full(served, len(ids), len(ids) + budget(1), deadline_s, num_seqs, tenant)
        else:
            ids = await self.tokenize(
                served, prompt, lambda n: self._refuse_when_full(served, n, n + budget(1), deadline_s, num_seqs, tenant)
            )
        max_tokens = budget(len(ids))
        if not ids:
            raise invalid_request("The prompt tokenizes to no tokens", param=prompt.param)
        request = build(ids, max_tokens)
        self.enqueue(served, request, max_tokens, prompt.param)
        return request

    async def tokenize(self, served: ServedModel, prompt: Prompt, before: Callable[[int], None] | None = None) -> list[int]:
        """The token ids of a text or chat ``prompt`` (its ``token_ids`` when it has them).
        ``before(max_prompt_tokens)`` runs first, with a bound on the count (the early 429).

        Raises:
            APIError: 400 when the model has no chat template for ``messages``.
        """
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        encoder = await self.encoder(served)
        if prompt.text is not None:
            pieces = encoder.text_pieces(prompt.text)
        else:
            pieces = encoder.chat_pieces(prompt.messages, served.config.name, tools=prompt.tools)
        max_prompt_tokens = encoder.max_num_tokens(pieces)
        if before is not None:
            before(max_prompt_tokens)
        if max_prompt_tokens <= MAX_INLINE_PROMPT_TOKENS:
            return encoder.encode(pieces)
        return await asyncio.to_thread(encoder.encode, pieces)

    async def tokenize_all(self, served: ServedModel, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each of ``texts`` (embedding inputs), with the usual special tokens."""
        encoder = await self.encoder(served)
        pieces = [encoder.text_pieces(text) for text in texts]
        if sum(encoder.max_num_tokens(p) for p in pieces) <= MAX_INLINE_PROMPT_TOKENS:
            return [encoder.encode(p) for p in pieces]
        return await asyncio.to_thread(lambda: [encoder.encode(p) for p in pieces])

    def enqueue(self, served: ServedModel, request: Request, max_tokens: int, param: str) -> Bucket:
        """Queue ``request`` on the bucket :meth:`route` picks, routing again when a layout change
        closed that bucket in between. Returns the bucket.

        Raises:
            APIError: 429 when the bucket's queue is full; 503 when its slice is restarting or
                every attempt met a closed bucket; the 400s of :meth:`route`.
        """
        for _ in range(MAX_ROUTE_ATTEMPTS):
            bucket = self.route(served, request.num_prompt_tokens, max_tokens, param)
            try:
                bucket.submit(request)
                return bucket
            except BucketClosedError:
                continue
            except BucketError as exc:
                raise to_api_error(exc, served.config.name, bucket.name) from None
        raise model_unavailable(served.config.name, 1)

    @staticmethod
    def _refuse_when_full(
        served: ServedModel, max_prompt_tokens: int, max_total_tokens: int, deadline_s: float | None, num_seqs: int = 1,
        tenant: tuple[str, float] | None = None,
    ) -> None:
        """Raise the 429 every bucket a prompt of at most ``max_prompt_tokens`` (and at most
        ``max_total_tokens`` with its generation, ``num_seqs`` sequences) could go to would give
        it; nothing when one may take it, or when the prompt might fail a limit of :meth:`route`
        (that 400 comes first)."""
        table = served.table
        last = table.pick(max_prompt_tokens)
        if last is None or max_total_tokens > served.config.max_model_len:
            return
        candidates = table.buckets[: table.buckets.index(last) + 1]
        if any(b.kv_capacity_tokens is not None and max_total_tokens > b.kv_capacity_tokens for b in candidates):
            return
        name, weight = tenant if tenant is not None else (None, 1.0)
        refusals = [
            b.admission.refusal(1, None if deadline_s is None else deadline_s - b.admission.clock(), num_seqs, name, weight)
            for b in candidates
        ]
        refusal = refusals[-1]
        if refusal is None or any(r is None for r in refusals) or last.closed:
            return
        last.admission.count_refusal()
        raise queue_full(served.config.name, last.name, refusal)

    @staticmethod
    def route(served: ServedModel, num_prompt_tokens: int, max_tokens: int, param: str) -> Bucket:
        """The bucket for a prompt of ``num_prompt_tokens`` that may grow by ``max_tokens``.

        Raises:
            APIError: 400 when the prompt exceeds the largest bucket, the total exceeds
            ``max_model_len``, or the total needs more KV than the bucket's whole pool; each
            message names the limit. A request that generates nothing (``max_tokens`` 0: an
            embedding input) meets only the largest bucket's limit, named in its ``param``.
        """
        max_model_len = served.config.max_model_len
        if max_tokens and num_prompt_tokens + max_tokens > max_model_len:  # buckets never exceed max_model_len
            raise invalid_request(
                f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{num_prompt_tokens} tokens and max_tokens is {max_tokens}",
                param="max_tokens" if num_prompt_tokens < max_model_len else param,
                code="context_length_exceeded",
            )
        bucket = served.table.pick(num_prompt_tokens)
        if bucket is None:
            raise invalid_request(
                f"The {'input' if param == 'input' else 'prompt'} has {num_prompt_tokens} tokens; "
                f"the largest bucket of '{served.config.name}' "
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
        """A chat request's budget without ``max_tokens``: up to the model's ``max_model_len``."""
        return max(1, served.config.max_model_len - num_prompt_tokens)
