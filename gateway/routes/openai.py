"""OpenAI-compatible routes: models, completions, chat completions (SSE streaming), embeddings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from litestar import Controller, Request, get, post
from litestar.response import Response, Stream

from buckets.request import EmbeddingRequest, GenerationRequest, Request as CoreRequest
from gateway.adapters import AdapterRegistry
from gateway.config import ModelConfig
from gateway.engine import ServedModel
from gateway.errors import APIError, invalid_request, model_not_found
from gateway.response_format import ResponseFormat
from gateway.http_edge import request_id_of
from gateway.quotas import meter
from gateway.residency import Residency, describe_state
from gateway.router import Prompt, Router, TokenBudget
from gateway.routes.bodies import parse_body, resolve_max_tokens, sampling_params
from gateway.routes.choices import PromptSource, check_choices, completion_prompts
from gateway.routes.embeddings import base64_floats, check_dimensions, embed_one, input_token_lists, matryoshka, submit_embedding
from gateway.routes.generation import EchoOnlyResponse, collect_response, first_events, stream_response
from gateway.routes.served import adapters_of, lora_of, quota_of, residency_of, served_call
from gateway.schemas import ChatCompletionBody, CompletionBody, EmbeddingBody
from gateway.streams import EventChannel, RequestWatch
from gateway.structured_fields import checked_constraint
from gateway.tenants import Tenant, tenant_of
from gateway.tools import ToolPlan, check_tool_constraint, tool_plan, with_tool_constraint
from models.step_io import LoraRequest, SamplingParams


class OpenAIController(Controller):
    path = "/v1"

    @get("/models")
    async def list_models(self, request: Request[Any, Any, Any]) -> dict[str, Any]:
        """Every servable model, loaded or not, as :func:`model_card` describes it, and every
        adapter; only those the caller's API key may use."""
        residency = residency_of(request)
        cards = [model_card(residency, m) for m in list(residency.engine.config.models)]
        model_ids = {card["id"] for card in cards}  # a model wins over an adapter of its name: listed once
        cards += [adapter_card(residency, r, e.name, e.path) for r in adapters_of(request).registries() for e in r.entries()
                  if e.name not in model_ids]
        tenant = tenant_of(request.scope)
        return {"object": "list", "data": [card for card in cards if tenant.may_use(card["id"])]}

    @get("/models/{model_id:path}")
    async def retrieve_model(self, request: Request[Any, Any, Any], model_id: str) -> dict[str, Any]:
        """One servable model (a name may hold ``/``). Raises APIError 404 for an unknown one, and
        for one the caller's API key may not use."""
        name = model_id.lstrip("/")
        residency = residency_of(request)
        if not tenant_of(request.scope).may_use(name):
            raise model_not_found(name)
        model = next((m for m in residency.engine.config.models if m.name == name), None)
        if model is None:
            found = adapters_of(request).find(name)
            if found is None:
                raise model_not_found(name)
            return adapter_card(residency, found[0], name, found[1].path)
        return model_card(residency, model)

    @post("/completions", status_code=200)
    async def completions(self, request: Request[Any, Any, Any]) -> Response[Any] | Stream:
        arrival_s = time.monotonic()
        body = await parse_body(request, CompletionBody)
        return await served_call(request, body, "generate", arrival_s, self._completions)  # type: ignore[no-any-return]

    async def _completions(
        self, request: Request[Any, Any, Any], router: Router, served: ServedModel, body: CompletionBody,
        arrival_s: float, deadline_s: float | None,
    ) -> Response[Any] | Stream:
        check_choices(served, body.n, body.best_of)
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
        return await served_call(request, body, "generate", arrival_s, self._chat_completions)  # type: ignore[no-any-return]

    async def _chat_completions(
        self, request: Request[Any, Any, Any], router: Router, served: ServedModel, body: ChatCompletionBody,
        arrival_s: float, deadline_s: float | None,
    ) -> Response[Any] | Stream:
        check_choices(served, body.n, None)
        param, requested = _chat_max_tokens(body)

        def budget(num_prompt_tokens: int) -> int:
            return resolve_max_tokens(served, requested, router.default_max_tokens(served, num_prompt_tokens), param)

        tools = tool_plan(body, served.loaded.tokenizer.chat_template, served.config.tool_call_parser)
        await check_tool_constraint(tools, served.loaded.tokenizer)
        prompts = [(Prompt(messages=tools.messages, param="messages", tools=tools.template_tools), "")]
        return await _generate(
            request, router, served, body, prompts, budget, ResponseFormat.CHAT, arrival_s, deadline_s, tools
        )

    @post("/embeddings", status_code=200)
    async def embeddings(self, request: Request[Any, Any, Any]) -> Response[Any]:
        arrival_s = time.monotonic()
        body = await parse_body(request, EmbeddingBody)
        return await served_call(request, body, "embed", arrival_s, self._embeddings)  # type: ignore[no-any-return]

    async def _embeddings(
        self, request: Request[Any, Any, Any], router: Router, served: ServedModel, body: EmbeddingBody,
        arrival_s: float, deadline_s: float | None,
    ) -> Response[Any]:
        check_dimensions(served, body.dimensions)
        token_lists = await input_token_lists(router, served, body)
        for ids in token_lists:  # all inputs fit, or none is queued
            router.route(served, len(ids), 0, "input")
        submitted: list[tuple[EmbeddingRequest, EventChannel]] = []
        try:
            for ids in token_lists:
                submitted.append(
                    submit_embedding(router, served, ids, body.priority, arrival_s, deadline_s, tenant_of(request.scope))
                )
        except APIError:
            for queued, _ in submitted:
                queued.cancel()  # all inputs or none: the batcher drops them unrun
            raise
        requests = [r for r, _ in submitted]
        watch = RequestWatch(requests, [c for _, c in submitted], deadline_s, request.receive)
        waits = [asyncio.ensure_future(embed_one(served, r, c, watch)) for r, c in submitted]
        try:
            results = await asyncio.gather(*waits)
        finally:
            watch.close()
            for wait, queued in zip(waits, requests):
                wait.cancel()  # one input failed: stop waiting for the others ...
                queued.cancel()  # ... which the batcher drops unrun
        if body.dimensions is not None:
            results = [matryoshka(emb, body.dimensions) for emb in results]
        encode = base64_floats if body.encoding_format == "base64" else list
        data = [{"object": "embedding", "index": i, "embedding": encode(emb)} for i, emb in enumerate(results)]
        num_tokens = sum(len(ids) for ids in token_lists)
        usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
        slowest = max(requests, key=lambda r: r.timeline.get("first_token", 0.0))
        body_out = {"object": "list", "data": data, "model": served.config.name, "usage": usage}
        return Response(body_out, headers=timing_headers(slowest))


def model_card(residency: Residency, model: ModelConfig) -> dict[str, Any]:
    """A model as OpenAI's ``/v1/models`` lists it, with vLLM's ``max_model_len``, the task, and
    llama.cpp's router's ``status`` (``{"value": loaded | loading | unloading | unloaded |
    failed}``, with ``reason`` for a failed load): ``created`` is the Unix time (seconds) it
    finished loading, or the gateway's start for a model not loaded."""
    served = residency.engine.models.get(model.name)
    created_s = served.created_s if served is not None else residency.started_unix_s
    return {
        "id": model.name, "object": "model", "created": int(created_s), "owned_by": "sluice",
        "max_model_len": model.max_model_len, "task": model.task, "status": describe_state(residency, model.name),
    }


def adapter_card(residency: Residency, registry: AdapterRegistry, name: str, path: str) -> dict[str, Any]:
    """A LoRA adapter as vLLM lists it: ``root`` its folder, ``parent`` its base model's id."""
    base = next(m for m in residency.engine.config.models if m.name == registry.base_name)
    return {**model_card(residency, base), "id": name, "root": path, "parent": registry.base_name}


def _chat_max_tokens(body: ChatCompletionBody) -> tuple[str, int | None]:
    """Which field sets chat's budget: ``max_completion_tokens`` takes precedence over ``max_tokens``."""
    if body.max_completion_tokens is not None:
        return "max_completion_tokens", body.max_completion_tokens
    return "max_tokens", body.max_tokens


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
    tools: ToolPlan | None = None,
) -> Response[Any] | Stream:
    """Submit one generation request per prompt (``(prompt, its text for echo)``), each with
    ``n`` choices, and answer once each has its first token (or one failed). ``tools``: a chat
    request's tool plan (its constraint joins the sampling parameters, its calls are read out
    of the choices).

    Waiting for the first tokens before the response starts lets a queued request that times
    out, or fails, get its status code (504, 500) even when it streams. All prompts are queued
    or none: a refusal cancels those queued before it.
    """
    constraint = await checked_constraint(body, served.loaded.tokenizer)
    params = with_tool_constraint(replace(sampling_params(served, body), constraint=constraint), tools)
    response_id = f"{fmt.id_prefix}-{request_id_of(http_request.scope)}"
    sources: list[PromptSource] = []
    try:
        for p, (prompt, text) in enumerate(prompts):
            request_id = response_id if len(prompts) == 1 else f"{response_id}-{p}"
            channel = EventChannel(http_request.app.state.metrics.event_timings)
            tenant = tenant_of(http_request.scope)
            build = _request_factory(body, params, request_id, channel, arrival_s, deadline_s, tenant, lora_of(http_request))
            request = await router.submit(served, prompt, budget, deadline_s, build, body.n, (tenant.name, tenant.weight))
            assert isinstance(request, GenerationRequest)
            sources.append(PromptSource(request, channel, text, p * body.n))
    except BaseException:
        for queued in sources:
            queued.request.cancel()  # the batcher drops them unrun
        raise
    meter(quota_of(http_request), lambda: sum(s.request.num_prompt_tokens + s.num_completion_tokens for s in sources))
    watch = RequestWatch([s.request for s in sources], [s.channel for s in sources], deadline_s, http_request.receive)
    firsts = await first_events(served, sources, watch)
    headers = timing_headers(sources[0].request)
    echo = isinstance(body, CompletionBody) and body.echo
    if body.stream:
        watch.stop_disconnect_watch()  # the streaming response listens for the hang-up itself
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Stream(
            stream_response(served, response_id, sources, firsts, body.n, fmt, include_usage, watch, echo, tools),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **headers},
        )
    body_out = await collect_response(
        served, response_id, sources, firsts, body.n, fmt, watch, echo, body.return_token_ids, tools
    )
    return Response(body_out, headers=headers)


def _request_factory(
    body: CompletionBody | ChatCompletionBody,
    params: SamplingParams,
    request_id: str,
    channel: EventChannel,
    arrival_s: float,
    deadline_s: float | None,
    tenant: Tenant,
    lora: LoraRequest | None = None,
) -> Callable[[list[int], int], GenerationRequest]:
    """How the router builds one prompt's core request from its token ids and budget (with
    ``echo`` and ``logprobs`` it asks for the prompt's logprobs too; ``tenant``: who sent it, for
    fair share; ``lora``: the adapter it runs with)."""
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
            tenant=tenant.name,
            tenant_weight=tenant.weight,
            max_tokens=max_tokens,
            params=params,
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
            n=body.n,
            num_top_logprobs=num_top_logprobs,
            needs_prompt_logprobs=echo and num_top_logprobs is not None,
            lora=lora,
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
    meter(quota_of(http_request), lambda: num_prompt_tokens)
    response_id = f"{fmt.id_prefix}-{request_id_of(http_request.scope)}"
    texts = [text for _, text in prompts]
    out = EchoOnlyResponse(served, response_id, texts, num_prompt_tokens, body.n, fmt)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Stream(out.chunks(include_usage), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return Response(out.body())


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
