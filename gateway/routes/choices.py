"""The choices of one completion or chat call: its prompts' core requests, each with ``n``
choices, and their events merged in arrival order.

A call with ``P`` prompts and ``n`` choices queues ``P`` core requests (one per prompt, each
routed to its own bucket by its length); choice ``j`` of prompt ``p`` answers as ``index``
``p * n + j``, as OpenAI's API numbers them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from buckets.request import ErrorEvent, GenerationRequest, TokenEvent
from gateway.engine import ServedModel
from gateway.errors import invalid_request
from gateway.logprobs_format import ChoiceLogprobs
from gateway.router import Prompt
from gateway.schemas import CompletionBody
from gateway.streams import ChannelItem, EventChannel, Interrupt
from gateway.tool_parsers import ToolCallReader


def check_choices(served: ServedModel, n: int, best_of: int | None) -> None:
    """Raises APIError 400: ``n`` over the model's ``max_n``; ``best_of`` other than ``n``
    (``unsupported_parameter``: every choice is returned, none is picked)."""
    if n > served.config.max_n:
        raise invalid_request(
            f"n is {n}; the model '{served.config.name}' returns at most {served.config.max_n} choices",
            param="n",
            code="too_many_choices",
        )
    if best_of is not None and best_of != n:
        raise invalid_request(
            f"best_of {best_of} differs from n {n}; only best_of equal to n is supported",
            param="best_of",
            code="unsupported_parameter",
        )


def completion_prompts(served: ServedModel, body: CompletionBody) -> list[tuple[Prompt, str]]:
    """Each prompt of a completion body with the text ``echo`` returns for it (a token-id
    prompt decoded).

    Raises:
        APIError: 400 naming the position (``prompt.j`` in a list of token ids, ``prompt.i.j``
            in a list of lists) of a token id outside the model's vocabulary.
    """
    items = body.prompts()
    is_one = isinstance(body.prompt, str) or all(isinstance(x, int) for x in body.prompt)
    tokenizer = served.loaded.tokenizer
    vocab_size = min(len(tokenizer), getattr(served.loaded.model_config, "vocab_size", None) or len(tokenizer))
    out: list[tuple[Prompt, str]] = []
    for i, item in enumerate(items):
        param = "prompt" if is_one else f"prompt.{i}"
        if isinstance(item, str):
            out.append((Prompt(text=item, param=param), item))
            continue
        bad = next((j for j, token_id in enumerate(item) if not 0 <= token_id < vocab_size), None)
        if bad is not None:
            form = "the list of token ids" if is_one else f"token-id list {i} of the prompt"
            raise invalid_request(
                f"token id {item[bad]} at position {bad} of {form} is outside the vocabulary [0, {vocab_size})",
                param=f"{param}.{bad}",
                code="invalid_token_id",
            )
        out.append((Prompt(token_ids=item, param=param), tokenizer.decode(item)))
    return out


@dataclass
class PromptSource:
    """One prompt of a call and the core request that generates its choices.

    ``prompt_text`` is the prompt as the client sent it (a token-id prompt decoded), what
    ``echo`` returns; the prompt's token ids are ``request.prompt_token_ids``. ``first_index``
    is the ``index`` of its choice 0 (``p * n``).
    """

    request: GenerationRequest
    channel: EventChannel
    prompt_text: str
    first_index: int
    last: ChannelItem | None = None  # the last item its wait saw (for the request's log line)
    completion_tokens: dict[int, int] = field(default_factory=dict)  # by choice of the request

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.completion_tokens.values())


@dataclass
class Choice:
    """What one choice has generated so far (and its logprobs, formatted as they come)."""

    index: int
    source: PromptSource
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None  # when the request asked for them
    tool_reader: ToolCallReader | None = None  # when its text may hold tool calls (gateway/tools.py)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def make_choices(sources: list[PromptSource], n: int) -> dict[int, Choice]:
    """Every choice of the call by ``index``."""
    return {s.first_index + j: Choice(s.first_index + j, s) for s in sources for j in range(n)}


def is_last_of_source(item: ChannelItem) -> bool:
    """Whether nothing follows ``item`` on its prompt's channel that the call waits for."""
    return isinstance(item, (Interrupt, ErrorEvent)) or (isinstance(item, TokenEvent) and item.ends_request)


def record(source: PromptSource, item: ChannelItem) -> None:
    """Note ``item`` as the last seen for ``source``, and its choice's token count."""
    source.last = item
    if isinstance(item, TokenEvent):
        source.completion_tokens[item.index] = item.num_completion_tokens


async def merged_events(
    sources: list[PromptSource], firsts: list[ChannelItem]
) -> AsyncIterator[tuple[PromptSource, ChannelItem]]:
    """Each prompt's events from its ``firsts`` item on, as they arrive, until every prompt's
    request has ended (or its wait was interrupted). One prompt waits on its channel alone; several
    wait together, and the waits left are cancelled when the consumer stops early."""
    open_sources = []
    for source, first in zip(sources, firsts):
        yield source, first
        if not is_last_of_source(first):
            open_sources.append(source)
    if len(open_sources) == 1:
        (source,) = open_sources
        while True:
            item = await source.channel.next()
            yield source, item
            if is_last_of_source(item):
                return
    waits = {asyncio.ensure_future(s.channel.next()): s for s in open_sources}
    try:
        while waits:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for wait in done:
                source = waits.pop(wait)
                item = wait.result()
                yield source, item
                if not is_last_of_source(item):
                    waits[asyncio.ensure_future(source.channel.next())] = source
    finally:
        for wait in waits:
            wait.cancel()
