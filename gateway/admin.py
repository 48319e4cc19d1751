"""The admin API (``/admin/*``): inspect served models, drain and unload them.

Auth is a bearer token from the environment variable ``SLUICE_ADMIN_TOKEN``, compared in
constant time (``hmac.compare_digest``); a missing or wrong token gets a 401. With no token set
the admin API does not exist (404), unless the config's ``admin_allow_loopback_without_token``
opens it to clients on the loopback interface alone. Every change is logged as an ``admin_audit``
event: who (client address), what, before, after.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import os
from dataclasses import asdict
from typing import Any

import structlog
from litestar import Controller, delete, get
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.engine import Engine, ServedModel
from gateway.errors import APIError, model_not_found

ADMIN_TOKEN_ENV = "SLUICE_ADMIN_TOKEN"

audit_log = structlog.get_logger("sluice.admin")


def _not_found() -> APIError:
    return APIError(404, "Not Found", "not_found_error")


def check_admin_token(authorization: str | None, token: str | None, client_host: str | None, allow_loopback: bool) -> None:
    """Let an admin call through, or raise.

    Args:
        authorization: the request's ``Authorization`` header.
        token: the configured token (``SLUICE_ADMIN_TOKEN``); ``None`` or empty: none.
        client_host: the client's address.
        allow_loopback: with no token, let loopback clients in.
    Raises:
        APIError: 404 when the admin API is off (no token, and not a permitted loopback
            client); 401 ``invalid_api_key`` for a missing or wrong bearer token.
    """
    if not token:
        if allow_loopback and _is_loopback(client_host):
            return
        raise _not_found()
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise APIError(
            401, "Missing or invalid admin token (Authorization: Bearer ...)", "authentication_error", code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def _is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def admin_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """litestar guard running :func:`check_admin_token` on every admin route."""
    engine: Engine = connection.app.state.engine
    client = connection.client.host if connection.client else None
    check_admin_token(
        connection.headers.get("authorization"),
        os.environ.get(ADMIN_TOKEN_ENV),
        client,
        engine.config.admin_allow_loopback_without_token,
    )


def describe_model(served: ServedModel) -> dict[str, Any]:
    """A served model's config, state, buckets (with their slices and live stats)."""
    buckets = []
    for bucket in served.table.buckets:
        stats = bucket.stats()
        buckets.append({
            "name": bucket.name,
            "max_input_tokens": bucket.max_input_tokens,
            "slice": bucket.device_slice.name,
            "device": bucket.device_slice.device,
            "kind": stats.kind,
            "stats": asdict(stats),
        })
    return {
        "name": served.config.name,
        "state": served.state,
        "config": served.config.model_dump(mode="json"),
        "buckets": buckets,
    }


class AdminController(Controller):
    path = "/admin"
    guards = [admin_guard]

    @get("/models")
    async def list_models(self, request: Any) -> dict[str, Any]:
        engine: Engine = request.app.state.engine
        return {"models": [describe_model(m) for m in engine.models.values()]}

    @get("/models/{model:str}")
    async def get_model(self, request: Any, model: str) -> dict[str, Any]:
        engine: Engine = request.app.state.engine
        served = engine.models.get(model)
        if served is None:
            raise model_not_found(model)
        return describe_model(served)

    @delete("/models/{model:str}", status_code=200)
    async def unload_model(self, request: Any, model: str) -> dict[str, Any]:
        """Drain ``model`` (503 for new requests, admitted ones finish) and unload it."""
        engine: Engine = request.app.state.engine
        served = engine.models.get(model)
        if served is None or served.draining:
            raise model_not_found(model) if served is None else APIError(
                409, f"The model '{model}' is already draining", "invalid_request_error", code="model_draining"
            )
        before = served.state
        client = request.client.host if request.client else None
        audit_log.info("admin_audit", who=client, action="unload_model", model=model, before=before, after="draining")
        result = await asyncio.to_thread(engine.unload, model, engine.config.drain_timeout_s)
        audit_log.info("admin_audit", who=client, action="unload_model", model=model, before="draining", after="unloaded", **result)
        return {"model": model, "state": "unloaded", **result}
