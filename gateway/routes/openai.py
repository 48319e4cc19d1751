"""OpenAI-compatible routes: models, completions, chat completions (SSE streaming), embeddings."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from litestar import Controller, Request, get, post
from litestar.response import Response, Stream
from pydantic import BaseModel, ValidationError

from buckets.request import EmbeddingEvent, EmbeddingRequest, GenerationRequest, Request as CoreRequest
from gateway.access_log import note
from gateway.engine import ServedModel
from gateway.errors import APIError, invalid_request, model_not_found, validation_error
from gateway.response_format import ResponseFormat
from gateway.router import Prompt, Router, TokenBudget
from gateway.http_edge import request_id_of
from gateway.routes.choices import PromptSource, check_choices, completion_prompts
from gateway.routes.generation import EchoOnlyResponse, collect_response, finish, first_event, first_events, stream_response
from gateway.schemas import ChatCompletionBody, CompletionBody, EmbeddingBody, EndpointBody
from gateway.streams import EventChannel, RequestWatch
from models.step_io import SamplingParams
from policies.deadlines import TimeoutOverCapError, resolve_timeout_s

BodyT = TypeVar("BodyT", bound=BaseModel)


async def parse_body(request: Request[Any, Any, Any], schema: type[BodyT]) -> BodyT:
    """Parse and validate a JSON body (whatever its declared content type).

    Raises:
        APIError: 400 for malformed JSON (too deeply nested or with too many digits included),
            a field the endpoint refuses (``unsupported_parameter``, see :mod:`gateway.fields`)
            or a field that fails validation (``param`` names it, as a dotted path);
            413 (from litestar) for a body over ``max_request_body_bytes``.
    """
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # ValueError covers JSONDecodeError and UnicodeDecodeError
        raise invalid_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object", code="invalid_json")
    if isinstance(data.get("model"), str):
        note(request.scope, model=data["model"])  # for the access log, a body that fails validation included
    if issubclass(schema, EndpointBody):
        schema.check_refused(data)
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def resolve_max_tokens(served: ServedModel, requested: int | None, default: int, param: str) -> int:
    """The generation budget of one request: ``requested``, else ``default`` clipped to the cap.

    Raises:
        APIError: 400 naming ``param`` when ``requested`` exceeds the model's ``max_tokens_cap``.
    """
    cap = served.config.max_tokens_cap
    if requested is None:
        return default if cap is None else min(default, cap)
    if cap is not None and requested > cap:
        raise invalid_request(
            f"{param} is {requested}, over the cap of {cap} tokens for the model '{served.config.name}'",
            param=param,
            code="max_tokens_exceeded",
        )
    return requested


def resolve_deadline_s(served: ServedModel, requested_s: float | None, arrival_s: float) -> float | None:
    """The request's deadline (``time.monotonic()`` seconds; ``None``: none) from its body's
    ``timeout`` and the model's ``default_timeout_s`` and ``max_timeout_s``.

    Raises:
        APIError: 400 (``timeout``, ``timeout_exceeded``) over the model's cap.
    """
    try:
        timeout_s = resolve_timeout_s(requested_s, served.config.default_timeout_s, served.config.max_timeout_s)
    except TimeoutOverCapError as exc:
        raise invalid_request(f"{exc} for the model '{served.config.name}'", param="timeout", code="timeout_exceeded") from None
    return None if timeout_s is None else arrival_s + timeout_s


def check_priority(router: Router, priority: int) -> None:
    """Raises APIError 400 (``priority``) outside the configured ``[min_priority, max_priority]``."""
    low, high = router.engine.config.min_priority, router.engine.config.max_priority
    if not low <= priority <= high:
        raise invalid_request(
            f"priority is {priority}; it must lie in [{low}, {high}] (lower is more urgent)",
            param="priority",
            code="priority_out_of_range",
        )


def check_num_inputs(served: ServedModel, num_inputs: int) -> None:
    """Raises APIError 400 (``input``) when an embeddings request has more inputs than allowed."""
    limit = served.config.max_embedding_inputs
    if num_inputs > limit:
        raise invalid_request(
            f"input has {num_inputs} items; the model '{served.config.name}' takes at most {limit}",
            param="input",
            code="too_many_inputs",
        )


def _router(request: Request[Any, Any, Any]) -> Router:
    return request.app.state.router  # type: ignore[no-any-return]


class OpenAIController(Controller):
    path = "/v1"

    @get("/models")
    async def list_models(self, request: Request[Any, Any, Any]) -> dict[str, Any]:
        """Every served model, as :func:`model_card` describes it."""
        models = list(_router(request).engine.models.values())
        return {"object": "list", "data": [model_card(m) for m in models]}

    @get("/models/{model_id:path}")
    async def retrieve_model(self, request: Request[Any, Any, Any], model_id: str) -> dict[str, Any]:
        """One served model (a name may hold ``/``). Raises APIError 404 for an unknown one."""
        name = model_id.lstrip("/")
        served = _router(request).engine.models.get(name)
        if served is None:
            raise model_not_found(name)
        return model_card(served)

    @post("/completions", status_code=200)
    async def completions(self, request: Request[Any, Any, Any]) -> Response[Any] | Stream:
        arrival_s = time.monotonic()
        body = await parse_body(request, CompletionBody)
        router = _router(request)
        served = router.model(body.model, "generate")
        check_priority(router, body.priority)
        check_choices(served, body.n, body.best_of)
        deadline_s = resolve_deadline_s(served, body.timeout, arrival_s)
        max_tokens = resolve_max_tokens(served, body.max_tokens, 16, "max_tokens")
        if max_tokens == 0 and not body.echo:
            raise invalid_request("max_tokens must be at least 1 unless echo is true", param="max_tokens")
        prompts = completion_prompts(served, body)
        fmt = ResponseFormat.COMPLETION
        if max_tokens == 0 and body.logprobs is None:  # the prompts alone: nothing to run
            return await _echo_only(request, router, served, body, prompts, fmt)
        budget: TokenBudget = lambda _: max_tokens  # noqa: E731
        return await _generate(request, router, served, body, prompts, budget, fmt, arrival_s, deadline_s)

    @post("/chat/completions", status_code=200)
    async def chat_completions(self, request: Request[Any, Any, Any]) -> Response[Any] | Stream:
        arrival_s = time.monotonic()
        body = await parse_body(request, ChatCompletionBody)
        router = _router(request)
        served = router.model(body.model, "generate")
        check_priority(router, body.priority)
        check_choices(served, body.n, None)
        deadline_s = resolve_deadline_s(served, body.timeout, arrival_s)
        param, requested = _chat_max_tokens(body)

        def budget(num_prompt_tokens: int) -> int:
            return resolve_max_tokens(served, requested, router.default_max_tokens(served, num_prompt_tokens), param)

        prompts = [(Prompt(messages=body.messages, param="messages"), "")]
        return await _generate(request, router, served, body, prompts, budget, ResponseFormat.CHAT, arrival_s, deadline_s)

    @post("/embeddings", status_code=200)
    async def embeddings(self, request: Request[Any, Any, Any]) -> Response[Any]:
        arrival_s = time.monotonic()
        body = await parse_body(request, EmbeddingBody)
        router = _router(request)
        served = router.model(body.model, "embed")
        check_priority(router, body.priority)
        deadline_s = resolve_deadline_s(served, body.timeout, arrival_s)
        check_dimensions(served, body.dimensions)
        token_lists = await _input_token_lists(router, served, body)
        for ids in token_lists:  # all inputs fit, or none is queued
            router.route(served, len(ids), 0, "input")
        submitted: list[tuple[EmbeddingRequest, EventChannel]] = []
        try:
            for ids in token_lists:
                submitted.append(_submit_embedding(router, served, ids, body.priority, arrival_s, deadline_s))
        except APIError:
            for queued, _ in submitted:
                queued.cancel()  # all inputs or none: the batcher drops them unrun
            raise
        requests = [r for r, _ in submitted]
        watch = RequestWatch(requests, [c for _, c in submitted], deadline_s, request.receive)
        waits = [asyncio.ensure_future(_embed_one(served, r, c, watch)) for r, c in submitted]
        try:
            results = await asyncio.gather(*waits)
        finally:
            watch.close()
            for wait, queued in zip(waits, requests):
                wait.cancel()  # one input failed: stop waiting for the others ...
                queued.cancel()  # ... which the batcher drops unrun
        if body.dimensions is not None:
            results = [matryoshka(emb, body.dimensions) for emb in results]
        encode = _base64_floats if body.encoding_format == "base64" else list
        data = [{"object": "embedding", "index": i, "embedding": encode(emb)} for i, emb in enumerate(results)]
        num_tokens = sum(len(ids) for ids in token_lists)
        usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
        slowest = max(requests, key=lambda r: r.timeline.get("first_token", 0.0))
        body_out = {"object": "list", "data": data, "model": served.config.name, "usage": usage}
        return Response(body_out, headers=timing_headers(slowest))


async def _input_token_lists(router: Router, served: ServedModel, body: EmbeddingBody) -> list[list[int]]:
    """The token ids of each embeddings input: strings tokenized, token ids checked.

    Raises:
        APIError: 400 ``too_many_inputs`` over the model's ``max_embedding_inputs``; 400 naming
            the position (``input.3``, ``input.1.3``) of a token id outside the vocabulary.
    """
    inputs = body.inputs()
    check_num_inputs(served, len(inputs))
    texts = [item for item in inputs if isinstance(item, str)]
    if texts:
        return await router.tokenize_all(served, texts)
    token_lists = [item for item in inputs if isinstance(item, list)]
    vocab_size = (await router.encoder(served)).vocab_size
    for i, ids in enumerate(token_lists):
        check_token_ids(ids, vocab_size, "input" if body.is_flat_ids() else f"input.{i}")
    return token_lists


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    """Raises APIError 400 (``param.<position>``, ``invalid_token_id``) for an id outside
    ``[0, vocab_size)``."""
    for position, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise invalid_request(
                f"token id {token_id} is outside the vocabulary of {vocab_size} tokens",
                param=f"{param}.{position}",
                code="invalid_token_id",
            )


def check_dimensions(served: ServedModel, dimensions: int | None) -> None:
    """Raises APIError 400 (``dimensions``): ``unsupported_parameter`` for a model whose config
    declares no ``matryoshka_dimensions``, ``invalid_dimensions`` for a size it does not declare."""
    if dimensions is None:
        return
    declared = served.config.matryoshka_dimensions
    if declared is None:
        raise invalid_request(
            f"The model '{served.config.name}' declares no Matryoshka dimensions, so Sluice does not implement "
            "'dimensions' for it; leave it out (or null)",
            param="dimensions",
            code="unsupported_parameter",
        )
    if dimensions not in declared:
        raise invalid_request(
            f"dimensions is {dimensions}; the model '{served.config.name}' takes one of {declared}",
            param="dimensions",
            code="invalid_dimensions",
        )


def matryoshka(embedding: list[float], dimensions: int) -> list[float]:
    """The first ``dimensions`` components of a Matryoshka embedding, L2-renormalised (as
    sentence-transformers' ``truncate_dim`` followed by normalising does)."""
    head = embedding[:dimensions]
    norm = math.sqrt(sum(x * x for x in head))
    return [x / norm for x in head] if norm > 0 else head


def model_card(served: ServedModel) -> dict[str, Any]:
    """A model as OpenAI's ``/v1/models`` lists it, with vLLM's ``max_model_len`` and the task:
    ``created`` is the Unix time (seconds) it finished loading."""
    return {
        "id": served.config.name, "object": "model", "created": int(served.created_s), "owned_by": "sluice",
        "max_model_len": served.config.max_model_len, "task": served.config.task,
    }


def _chat_max_tokens(body: ChatCompletionBody) -> tuple[str, int | None]:
    """Which field sets chat's budget: ``max_completion_tokens`` takes precedence over ``max_tokens``."""
    if body.max_completion_tokens is not None:
        return "max_completion_tokens", body.max_completion_tokens
    return "max_tokens", body.max_tokens


def _base64_floats(values: list[float]) -> str:
    """OpenAI's ``encoding_format: base64``: little-endian float32 bytes, base64-encoded."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def _submit_embedding(
    router: Router, served: ServedModel, token_ids: list[int], priority: int, arrival_s: float, deadline_s: float | None
) -> tuple[EmbeddingRequest, EventChannel]:
    channel = EventChannel()
    request = EmbeddingRequest(
        request_id=f"emb-{uuid.uuid4().hex}",
        prompt_token_ids=token_ids,
        sink=channel.sink,
        priority=priority,
        deadline_s=deadline_s,
    )
    request.timeline["arrival"] = arrival_s
    router.enqueue(served, request, 0, "input")
    return request, channel


async def _embed_one(served: ServedModel, request: EmbeddingRequest, channel: EventChannel, watch: RequestWatch) -> list[float]:
    """One input's embedding.

    Raises:
        APIError: 504 past the deadline, 499 after a hang-up, 500 when the batch failed.
    """
    event = await first_event(served, request, channel, watch)
    assert isinstance(event, EmbeddingEvent)
    finish(served, request, 0, event, watch)
    return event.embedding


async def _generate(
    http_request: Request[Any, Any, Any],
    router: Router,
    served: ServedModel,
    body: CompletionBody | ChatCompletionBody,
    prompts: list[tuple[Prompt, str]],
    budget: TokenBudget,
    fmt: ResponseFormat,
    arrival_s: float,
    deadline_s: float | None,
) -> Response[Any] | Stream:
    """Submit one generation request per prompt (``(prompt, its text for echo)``), each with
    ``n`` choices, and answer once each has its first token (or one failed).

    Waiting for the first tokens before the response starts lets a queued request that times
    out, or fails, get its status code (504, 500) even when it streams. All prompts are queued
    or none: a refusal cancels those queued before it.
    """
    params = sampling_params(served, body)
    response_id = f"{fmt.id_prefix}-{request_id_of(http_request.scope)}"
    sources: list[PromptSource] = []
    try:
        for p, (prompt, text) in enumerate(prompts):
            request_id = response_id if len(prompts) == 1 else f"{response_id}-{p}"
            channel = EventChannel()
            build = _request_factory(body, params, request_id, channel, arrival_s, deadline_s)
            request = await router.submit(served, prompt, budget, deadline_s, build, body.n)
            assert isinstance(request, GenerationRequest)
            sources.append(PromptSource(request, channel, text, p * body.n))
    except BaseException:
        for queued in sources:
            queued.request.cancel()  # the batcher drops them unrun
        raise
    watch = RequestWatch([s.request for s in sources], [s.channel for s in sources], deadline_s, http_request.receive)
    firsts = await first_events(served, sources, watch)
    headers = timing_headers(sources[0].request)
    echo = isinstance(body, CompletionBody) and body.echo
    if body.stream:
        watch.stop_disconnect_watch()  # the streaming response listens for the hang-up itself
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Stream(
            stream_response(served, response_id, sources, firsts, body.n, fmt, include_usage, watch, echo),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **headers},
        )
    body_out = await collect_response(served, response_id, sources, firsts, body.n, fmt, watch, echo, body.return_token_ids)
    return Response(body_out, headers=headers)


def _request_factory(
    body: CompletionBody | ChatCompletionBody,
    params: SamplingParams,
    request_id: str,
    channel: EventChannel,
    arrival_s: float,
    deadline_s: float | None,
) -> Callable[[list[int], int], GenerationRequest]:
    """How the router builds one prompt's core request from its token ids and budget (with
    ``echo`` and ``logprobs`` it asks for the prompt's logprobs too)."""
    num_top_logprobs = body.logprobs if isinstance(body, CompletionBody) else body.num_top_logprobs()
    echo = isinstance(body, CompletionBody) and body.echo

    def build(prompt_ids: list[int], max_tokens: int) -> GenerationRequest:
        if params.min_tokens > max_tokens:
            raise invalid_request(
                f"min_tokens is {params.min_tokens}, over the request's max_tokens of {max_tokens}", param="min_tokens"
            )
        request = GenerationRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sink=channel.sink,
            priority=body.priority,
            deadline_s=deadline_s,
            max_tokens=max_tokens,
            params=params,
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
            n=body.n,
            num_top_logprobs=num_top_logprobs,
            needs_prompt_logprobs=echo and num_top_logprobs is not None,
        )
        request.timeline["arrival"] = arrival_s
        return request

    return build


async def _echo_only(
    http_request: Request[Any, Any, Any], router: Router, served: ServedModel, body: CompletionBody,
    prompts: list[tuple[Prompt, str]], fmt: ResponseFormat,
) -> Response[Any] | Stream:
    """``max_tokens: 0`` with ``echo`` and without ``logprobs``: every choice is its prompt's
    text, nothing generated and nothing run (with ``logprobs`` the prompts go through the model,
    :func:`_generate`, for their logprobs).

    Raises:
        APIError: 400 for a prompt that tokenizes to nothing or fails a limit of :meth:`Router.route`.
    """
    num_prompt_tokens = 0
    for prompt, _ in prompts:
        ids = await router.tokenize(served, prompt)
        if not ids:
            raise invalid_request("The prompt tokenizes to no tokens", param=prompt.param)
        router.route(served, len(ids), 0, prompt.param)
        num_prompt_tokens += len(ids)
    response_id = f"{fmt.id_prefix}-{request_id_of(http_request.scope)}"
    texts = [text for _, text in prompts]
    out = EchoOnlyResponse(served, response_id, texts, num_prompt_tokens, body.n, fmt)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Stream(out.chunks(include_usage), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return Response(out.body())


def sampling_params(served: ServedModel, body: CompletionBody | ChatCompletionBody) -> SamplingParams:
    """The request's :class:`SamplingParams`; a ``null`` processor field is its default (off).

    Raises:
        APIError: 400 naming ``logit_bias.<id>`` when a key is outside the model's vocabulary.
    """
    vocab_size = served.loaded.model_config.vocab_size
    for key in body.logit_bias or {}:
        if int(key) >= vocab_size:
            raise invalid_request(
                f"logit_bias has the token id {key}, outside the vocabulary of the model "
                f"'{served.config.name}' (ids 0 to {vocab_size - 1})",
                param=f"logit_bias.{key}",
            )
    logit_bias = body.logit_bias_pairs()
    return SamplingParams(
        temperature=float(body.temperature), top_p=float(body.top_p), top_k=body.top_k, seed=body.seed,
        frequency_penalty=float(body.frequency_penalty or 0.0),
        presence_penalty=float(body.presence_penalty or 0.0),
        repetition_penalty=float(1.0 if body.repetition_penalty is None else body.repetition_penalty),
        min_p=float(body.min_p or 0.0),
        logit_bias=logit_bias,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        min_tokens=body.min_tokens or 0,
    )


def timing_headers(request: CoreRequest) -> dict[str, str]:
    """Where a request's first token came from, for load tools' per-bucket attribution:
    ``x-sluice-bucket``, ``x-sluice-queue-ms`` (arrival to leaving the queue to run) and
    ``x-sluice-prefill-ms`` (from then to the first token; an embedding's forward). Known once
    the first token (the embedding) is out; a multi-input embeddings call reports its slowest input."""
    timeline = request.timeline
    headers = {"x-sluice-bucket": str(request.info.get("bucket", ""))}
    arrival, started, first = timeline.get("arrival"), timeline.get("started"), timeline.get("first_token")
    if arrival is not None and started is not None:
        headers["x-sluice-queue-ms"] = f"{max(0.0, started - arrival) * 1000:.1f}"
    if started is not None and first is not None:
        headers["x-sluice-prefill-ms"] = f"{max(0.0, first - started) * 1000:.1f}"
    return headers
