"""What a process slice's gateway side and its worker process say to each other.

Every message is a tuple of plain values (str, int, float, list, dict, None, and the frozen
settings dataclasses), so it pickles the same way whatever the two processes import. Requests
cross as the fields the worker needs to rebuild them; events cross as tuples; errors cross as a
class name and a message and come back as the :mod:`buckets.errors` class of that name.

Gateway -> worker:
    ``("submit", key, wire_request)``, ``("cancel", request_no, reason)``,
    ``("settings", key, settings)``, ``("rebuild", key)`` (build the bucket's batcher again, its
    backend chosen again, under the same key), ``("stop",)``.
Worker -> gateway:
    ``("ready", pid, {key: backend_info})``, ``("dequeued", request_no, timeline)``,
    ``("event", request_no, wire_event, timeline, batches)`` (``batches`` only on a final event),
    ``("batch", key, num_seqs, num_tokens, num_padding_tokens)``,
    ``("stats", {key: stats fields}, busy_s, busy_ratio)``,
    ``("rebuilt", key, backend_info, None)`` or ``("rebuilt", key, None, error)``.

A ``key`` is ``(model name, bucket name, layout number)``; ``request_no`` is the gateway's number for one
request in flight (unique for the gateway process's life; a Ray actor shared by several gateways
makes it ``(channel_id, request_no)`` for its host, :mod:`buckets.slices.ray_channels`). Times are ``time.monotonic()``
seconds, which on Linux is one clock for every process on the machine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from buckets import errors
from buckets.request import (
    EmbeddingEvent,
    EmbeddingRequest,
    ErrorEvent,
    GenerationRequest,
    Request,
    RequestEvent,
    Sink,
    TokenEvent,
)
from buckets.stats import BucketStats
from models.step_io import SamplingParams, TokenLogprobs

Message = tuple[Any, ...]


def encode_request(request_no: int, request: Request) -> dict[str, Any]:
    """The fields of ``request`` the worker rebuilds it from (no sink, no cancel state)."""
    wire: dict[str, Any] = {
        "request_no": request_no,
        "request_id": request.request_id,
        "prompt_token_ids": list(request.prompt_token_ids),
        "priority": request.priority,
        "deadline_s": request.deadline_s,
        "tenant": request.tenant,
        "tenant_weight": request.tenant_weight,
        "timeline": dict(request.timeline),
        "info": {k: v for k, v in request.info.items() if isinstance(v, (str, int, float))},
    }
    if isinstance(request, GenerationRequest):
        wire.update(
            kind="generate",
            max_tokens=request.max_tokens,
            params=dataclasses.asdict(request.params),
            stop=list(request.stop),
            ignore_eos=request.ignore_eos,
            n=request.n,
            num_top_logprobs=request.num_top_logprobs,
            needs_prompt_logprobs=request.needs_prompt_logprobs,
        )
    else:
        wire["kind"] = "embed"
    return wire


def decode_request(wire: dict[str, Any], sink: Sink) -> Request:
    """The worker's copy of a request encoded by :func:`encode_request`, emitting to ``sink``."""
    common: dict[str, Any] = {
        "request_id": wire["request_id"],
        "prompt_token_ids": list(wire["prompt_token_ids"]),
        "sink": sink,
        "priority": wire["priority"],
        "deadline_s": wire["deadline_s"],
        "tenant": wire["tenant"],
        "tenant_weight": wire["tenant_weight"],
        "timeline": dict(wire["timeline"]),
        "info": dict(wire["info"]),
    }
    if wire["kind"] == "generate":
        return GenerationRequest(
            **common,
            max_tokens=wire["max_tokens"],
            params=SamplingParams(**wire["params"]),
            stop=tuple(wire["stop"]),
            ignore_eos=wire["ignore_eos"],
            n=wire["n"],
            num_top_logprobs=wire["num_top_logprobs"],
            needs_prompt_logprobs=wire["needs_prompt_logprobs"],
        )
    return EmbeddingRequest(**common)


def _encode_logprobs(entry: TokenLogprobs | None) -> tuple[Any, ...] | None:
    return None if entry is None else (entry.token_id, entry.logprob, [list(t) for t in entry.top])


def _decode_logprobs(wire: tuple[Any, ...] | None) -> TokenLogprobs | None:
    return None if wire is None else TokenLogprobs(wire[0], wire[1], tuple((int(i), float(v)) for i, v in wire[2]))


def encode_event(event: RequestEvent) -> Message:
    if isinstance(event, TokenEvent):
        prompt = None if event.prompt_logprobs is None else [_encode_logprobs(e) for e in event.prompt_logprobs]
        return (
            "token", event.text, list(event.token_ids), event.finish_reason, event.num_prompt_tokens,
            event.num_completion_tokens, event.index, event.num_open_choices,
            [_encode_logprobs(e) for e in event.logprobs], prompt,
        )
    if isinstance(event, EmbeddingEvent):
        return ("embedding", list(event.embedding), event.num_prompt_tokens)
    return ("error", type(event.error).__name__, str(event.error))


def decode_event(wire: Message) -> RequestEvent:
    kind = wire[0]
    if kind == "token":
        logprobs = tuple(lp for lp in map(_decode_logprobs, wire[8]) if lp is not None)
        prompt = None if wire[9] is None else tuple(_decode_logprobs(e) for e in wire[9])
        return TokenEvent(
            text=wire[1], token_ids=list(wire[2]), finish_reason=wire[3], num_prompt_tokens=wire[4],
            num_completion_tokens=wire[5], index=wire[6], num_open_choices=wire[7],
            logprobs=logprobs, prompt_logprobs=prompt,
        )
    if kind == "embedding":
        return EmbeddingEvent(embedding=list(wire[1]), num_prompt_tokens=wire[2])
    return ErrorEvent(decode_error(wire[1], wire[2]))


def decode_error(name: str, message: str) -> Exception:
    """The :mod:`buckets.errors` class called ``name`` built from ``message``; any other error
    (a bug in the worker) comes back as a :class:`~buckets.errors.BatchFailedError` naming it."""
    cls = getattr(errors, name, None)
    needs_more = (errors.QueueFullError, errors.SliceUnavailableError)  # built from more than a message
    if isinstance(cls, type) and issubclass(cls, errors.BucketError) and not issubclass(cls, needs_more):
        return cls(message)
    return errors.BatchFailedError(f"{name}: {message}")


def is_final(event: RequestEvent) -> bool:
    """Whether nothing follows ``event`` for its request (every choice of it finished)."""
    return not isinstance(event, TokenEvent) or event.ends_request


def encode_stats(stats: BucketStats) -> dict[str, Any]:
    return dataclasses.asdict(stats)


def decode_stats(fields: dict[str, Any]) -> BucketStats:
    return BucketStats(**fields)
