"""What every served call of the OpenAI routes goes through before and after its handler: the
caller's model access, priority and deadline, quota admission, the model's residency lease and a
LoRA adapter's lease (:func:`served_call`), and the app-state accessors the routes share."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from litestar import Request
from litestar.response import Stream

from gateway.adapters import AdapterLease, Adapters
from gateway.errors import model_not_found
from gateway.quotas import QuotaBook, QuotaLease
from gateway.residency import Residency
from gateway.router import Router
from gateway.routes.bodies import resolve_deadline_s, resolve_priority
from gateway.tenants import tenant_of
from models.step_io import LoraRequest


def router_of(request: Request[Any, Any, Any]) -> Router:
    return request.app.state.router  # type: ignore[no-any-return]


def residency_of(request: Request[Any, Any, Any]) -> Residency:
    return request.app.state.residency  # type: ignore[no-any-return]


def adapters_of(request: Request[Any, Any, Any]) -> Adapters:
    return request.app.state.adapters  # type: ignore[no-any-return]


def quotas_of(request: Request[Any, Any, Any]) -> QuotaBook:
    return request.app.state.quotas  # type: ignore[no-any-return]


def quota_of(request: Request[Any, Any, Any]) -> QuotaLease | None:
    """This HTTP request's hold on its API key's quotas (set by :func:`served_call`; ``None``: none)."""
    return getattr(request.state, "quota", None)


def lora_of(request: Request[Any, Any, Any]) -> LoraRequest | None:
    """The LoRA adapter this HTTP request's generations run with (set by :func:`served_call`)."""
    return getattr(request.state, "lora", None)


async def served_call(
    request: Request[Any, Any, Any], body: Any, task: str, arrival_s: float, handler: Callable[..., Awaitable[Any]]
) -> Any:
    """Check ``body``'s model (404, as unknown, for one the caller's API key may not use; 400
    ``wrong_task``), priority (the tenant's default when it names none) and timeout, then run
    ``handler(request, router, served, body, arrival_s, deadline_s)`` (``body.priority``
    resolved) on the served model, loaded first when it is not (the wait counts against the
    deadline), under a lease that keeps an eviction from draining it before its requests are
    queued. A LoRA adapter's id runs on its base model with the adapter (read first when it is
    not), leased until the response ends. An API key's quotas admit the request (429 over one)
    before the model is loaded, and hold it until the response ends (:mod:`gateway.quotas`)."""
    tenant = tenant_of(request.scope)
    if not tenant.may_use(body.model):
        raise model_not_found(body.model)
    router = router_of(request)
    leased = await adapters_of(request).lease(body.model, task)
    name, adapter = (body.model, None) if leased is None else leased
    quota: QuotaLease | None = None
    try:
        model = residency_of(request).model_config(name, task)
        body = body.model_copy(update={"priority": resolve_priority(router, tenant, body)})
        deadline_s = resolve_deadline_s(model, body.timeout, arrival_s)
        request.state.lora = None if adapter is None else adapter.lora
        quota = request.state.quota = quotas_of(request).admit(tenant)
        async with residency_of(request).serving(name, deadline_s) as served:
            response = await handler(request, router, served, body, arrival_s, deadline_s)
    except BaseException:
        if adapter is not None:
            adapter.release()
        if quota is not None:
            quota.release()
        raise
    response = _with_adapter(response, adapter, name)
    return response if quota is None else quota.settle(response)


def _with_adapter(response: Any, adapter: AdapterLease | None, name: str) -> Any:
    """``response`` of a request run with ``adapter`` on the base model ``name``: the adapter is
    released when the response ends and the response names it as its model."""
    if adapter is None:
        return response
    if isinstance(response, Stream):
        response.iterator = _adapter_chunks(response.iterator, adapter, name)
        return response
    adapter.release()
    if isinstance(response.content, dict) and "model" in response.content:
        response.content["model"] = adapter.lora.name  # as vLLM answers: the id the client asked for
    return response


async def _adapter_chunks(chunks: Any, adapter: AdapterLease, base: str) -> AsyncIterator[Any]:
    """``chunks`` (a streaming body's SSE events) naming the adapter as their ``model``, releasing
    ``adapter`` when they end, fail or are dropped. The envelope's ``"model": "<base>"`` is the
    only place that text can stand unescaped in an event's JSON (a string's quotes are escaped)."""
    field = f'"model": {json.dumps(base, ensure_ascii=False)}'
    named = f'"model": {json.dumps(adapter.lora.name, ensure_ascii=False)}'
    try:
        async for chunk in chunks:
            yield chunk.replace(field, named, 1) if isinstance(chunk, str) else chunk
    finally:
        adapter.release()
