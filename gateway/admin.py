"""The admin API (``/admin/*``): inspect, load, reconfigure, drain and unload models at run time.

A change is validated first, as a whole new effective config (the same pydantic models as the
config file): an invalid one gets a 422 naming the field and reason, and nothing changes. A
bucket layout change builds new buckets, swaps the model's ``BucketTable`` in one step for new
requests, and drains the old buckets in the background: every request already admitted finishes
where it is. A knob change applies from the bucket's next step or batch.

Auth is a bearer token from the environment variable ``SLUICE_ADMIN_TOKEN``, compared in
constant time (``hmac.compare_digest``); a missing or wrong token gets a 401. With no token set
the admin API is disabled (403 ``admin_api_disabled``, saying how to enable it), unless the
config's ``admin_allow_loopback_without_token`` opens it to clients on the loopback interface alone.
The same refusal answers an ``/admin`` path no route matches (404) or a method a route does not
take (405) before those errors do (:func:`unmatched_admin_error`), so every ``/admin`` request
gets it while the API is off. Every change is logged as an ``admin_audit`` event: who (client
address), what, before, after.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import os
from dataclasses import asdict
from typing import Any, Literal

import structlog
import yaml
from litestar import Controller, delete, get, patch, post, put
from litestar.response import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.config import BucketConfig, GatewayConfig, ModelConfig
from gateway.engine import Engine, ServedModel
from gateway.residency import Residency, describe_state
from gateway.errors import APIError, ConfigError, config_validation_error, model_not_found, to_api_error
from models.errors import ModelError
from models.openmp import release_thread_pool

ADMIN_TOKEN_ENV = "SLUICE_ADMIN_TOKEN"

audit_log = structlog.get_logger("sluice.admin")


def _disabled() -> APIError:
    """403 ``admin_api_disabled``: no token is configured (and loopback is not allowed in)."""
    return APIError(
        403,
        f"The admin API is disabled: set the environment variable {ADMIN_TOKEN_ENV} to a token and send it as "
        "'Authorization: Bearer <token>', or set admin_allow_loopback_without_token: true in the config to "
        "open it to clients on the loopback interface",
        "permission_error",
        code="admin_api_disabled",
    )


def check_admin_token(authorization: str | None, token: str | None, client_host: str | None, allow_loopback: bool) -> None:
    """Let an admin call through, or raise.

    Args:
        authorization: the request's ``Authorization`` header.
        token: the configured token (``SLUICE_ADMIN_TOKEN``); ``None`` or empty: none.
        client_host: the client's address.
        allow_loopback: with no token, let loopback clients in.
    Raises:
        APIError: 403 ``admin_api_disabled`` when the admin API is off (no token, and not a
            permitted loopback client); 401 ``invalid_api_key`` for a missing or wrong bearer token.
    """
    if not token:
        if allow_loopback and _is_loopback(client_host):
            return
        raise _disabled()
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


def admin_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler | None) -> None:
    """litestar guard running :func:`check_admin_token` on every admin route."""
    engine: Engine = connection.app.state.engine
    client = connection.client.host if connection.client else None
    check_admin_token(
        connection.headers.get("authorization"),
        os.environ.get(ADMIN_TOKEN_ENV),
        client,
        engine.config.admin_allow_loopback_without_token,
    )


def is_admin_path(path: str) -> bool:
    """Whether ``path`` lies under ``/admin``."""
    return path == AdminController.path or path.startswith(AdminController.path + "/")


def unmatched_admin_error(connection: ASGIConnection[Any, Any, Any, Any], error: APIError) -> APIError:
    """The answer to an ``/admin`` request no route took (``error``: its 404 or 405): the
    admin API's refusal (403 ``admin_api_disabled``, 401) when :func:`admin_guard` would refuse
    the caller, else ``error``."""
    try:
        admin_guard(connection, None)
    except APIError as refusal:
        return refusal
    return error


def describe_model(served: ServedModel) -> dict[str, Any]:
    """A served model's config, state, buckets (with their slices, backends with their gate
    records in brief, and live stats)."""
    buckets = []
    for bucket in served.table.buckets:
        stats = bucket.stats()
        buckets.append({
            "name": bucket.name,
            "max_input_tokens": bucket.max_input_tokens,
            "slice": bucket.device_slice.name,
            "device": bucket.device_slice.device,
            "isolation": bucket.device_slice.isolation,
            "kind": stats.kind,
            "backend": bucket.backend_info,
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
        """Every loaded model (:func:`describe_model`), then those loading through the admin API,
        then the servable models not loaded (``state`` unloaded, loading, or failed with its
        ``reason``; their ``config``). A LoRA-enabled model has ``lora``: its adapters' stats
        (:meth:`gateway.adapters.AdapterRegistry.stats`)."""
        engine: Engine = request.app.state.engine
        residency: Residency = request.app.state.residency
        loading = [{"name": name, "state": "loading"} for name in sorted(_loading(request))]
        resting = [
            {"name": m.name, **_state_and_reason(residency, m.name), "config": m.model_dump(mode="json")}
            for m in engine.config.models if m.name not in engine.models and m.name not in _loading(request)
        ]
        models = [describe_model(m) for m in list(engine.models.values())] + loading + resting
        for model in models:  # a LoRA-enabled model's adapters: how many, which are read in memory, their bytes
            registry = request.app.state.adapters.registry(model["name"])
            if registry is not None:
                model["lora"] = registry.stats()
        return {"models": models}

    @post("/models/{model:str}/load", status_code=200)
    async def load_servable(self, request: Any, model: str) -> dict[str, Any]:
        """Load servable model ``model`` now, evicting others as a request would (a no-op when
        it is loaded). 503 as a request's load fails; 404 for an unknown model."""
        residency: Residency = request.app.state.residency
        before = describe_state(residency, model)["value"] if residency.model_exists(model) else None
        served = await residency.load(model)
        _audit(request, "load", model, before, "loaded")
        return describe_model(served)

    @post("/models/{model:str}/unload", status_code=200)
    async def unload_servable(self, request: Any, model: str) -> dict[str, Any]:
        """Drain ``model`` (its admitted requests finish; new ones wait to load it again) and
        free it, keeping it servable; pinned models too. 404 for an unknown model."""
        residency: Residency = request.app.state.residency
        before = describe_state(residency, model)["value"] if residency.model_exists(model) else None
        await residency.unload(model, "admin")
        _audit(request, "unload", model, before, "unloaded")
        return {"model": model, "state": describe_state(residency, model)["value"]}

    @patch("/models/{model:str}/pin")
    async def pin(self, request: Any, model: str) -> dict[str, Any]:
        """``{"pinned": true | false}``: a pinned model is never evicted nor unloaded when idle."""
        async with _changes(request):
            residency: Residency = request.app.state.residency
            try:
                body = PinBody.model_validate(await _json_object(request))
            except ValidationError as exc:
                raise config_validation_error(exc) from None
            before = residency.model_config_or_404(model).is_pinned
            changed = residency.set_pinned(model, body.pinned)
            _audit(request, "pin", model, before, changed.is_pinned)
            return {"model": model, "pinned": changed.is_pinned}

    @get("/slices")
    async def list_slices(self, request: Any) -> dict[str, Any]:
        """Every slice: device, threads, isolation, state; a process slice's ``worker_pid`` and
        ``num_restarts``."""
        engine: Engine = request.app.state.engine
        return {"slices": [s.describe() for s in engine.slices.values()]}

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
        async with _changes(request):
            engine: Engine = request.app.state.engine
            served = engine.models.get(model)
            if served is None or served.draining:
                raise model_not_found(model) if served is None else APIError(
                    409, f"The model '{model}' is already draining", "invalid_request_error", code="model_draining"
                )
            _check_thread_slices(engine, served.config, "unloading")
            before = served.state
            client = request.client.host if request.client else None
            audit_log.info("admin_audit", who=client, action="unload_model", model=model, before=before, after="draining")
            result = await asyncio.to_thread(engine.unload, model, engine.config.drain_timeout_s)
            audit_log.info("admin_audit", who=client, action="unload_model", model=model, before="draining", after="unloaded", **result)
            return {"model": model, "state": "unloaded", **result}

    @post("/models", status_code=201)
    async def load_model(self, request: Any) -> dict[str, Any]:
        """Load a model from a ``models[]`` config entry and serve it; one of ``load: on_demand``
        is made servable only (its first request loads it)."""
        async with _changes(request):
            engine: Engine = request.app.state.engine
            data = await _json_object(request)
            name = data.get("name")
            if isinstance(name, str) and (name in engine.models or name in _loading(request)):
                raise APIError(409, f"The model '{name}' is already served or loading", "invalid_request_error", "name", "model_exists")
            if isinstance(name, str) and request.app.state.adapters.find(name) is not None:  # it would hide the adapter
                raise APIError(409, f"The name '{name}' is a LoRA adapter's", "invalid_request_error", "name", "model_exists")
            config = _validated({**_config_data(engine.config), "models": [*_models_data(engine.config), data]})
            model = config.models[-1]
            if model.load == "on_demand":
                engine.config = config
                _audit(request, "add_model", model.name, None, model.model_dump(mode="json"))
                return {"name": model.name, "state": "unloaded", "config": model.model_dump(mode="json")}
            _check_thread_slices(engine, model, "loading")
            _loading(request).add(model.name)
            try:
                served = await asyncio.to_thread(_configured, engine.load, model, config)
            finally:
                _loading(request).discard(model.name)
            _audit(request, "load_model", model.name, None, model.model_dump(mode="json"))
            return describe_model(served)

    @put("/models/{model:str}/buckets")
    async def replace_buckets(self, request: Any, model: str) -> dict[str, Any]:
        """Replace the whole bucket layout; the old buckets drain in the background."""
        async with _changes(request):
            engine: Engine = request.app.state.engine
            served = _ready_model(engine, model)
            data = await _json_object(request)
            index = _model_index(engine.config, model)
            models = _models_data(engine.config)
            models[index] = {**models[index], "buckets": data.get("buckets")}
            config = _validated({**_config_data(engine.config), "models": models})
            _check_thread_slices(engine, served.config, "a new bucket layout of")
            _check_thread_slices(engine, config.models[index], "a new bucket layout of")
            before = [b.model_dump(mode="json") for b in served.config.buckets]
            old = await asyncio.to_thread(_configured, engine.replace_layout, model, config.models[index], config)
            engine.retire(old, engine.config.drain_timeout_s)
            _audit(request, "replace_buckets", model, before, [b.model_dump(mode="json") for b in config.models[index].buckets])
            return {**describe_model(served), "draining_buckets": [b.name for b in old]}

    @patch("/models/{model:str}/buckets/{bucket:str}")
    async def patch_bucket(self, request: Any, model: str, bucket: str) -> dict[str, Any]:
        """Change knobs of one bucket, from its next step or batch."""
        async with _changes(request):
            engine: Engine = request.app.state.engine
            served = _ready_model(engine, model)
            try:
                knobs = BucketPatch.model_validate(await _json_object(request))
            except ValidationError as exc:
                raise config_validation_error(exc, lambda knob: knob_path(engine, model, bucket, knob)) from None
            if not any(b.bucket_name == bucket for b in served.config.buckets):
                raise APIError(404, f"The model '{model}' has no bucket '{bucket}'", "not_found_error", "bucket", "bucket_not_found")
            old, new = change_knobs(engine, model, bucket, knobs.model_dump(exclude_unset=True))
            _audit(request, "patch_bucket", f"{model}/{bucket}", old, new)
            return {"model": model, "bucket": bucket, "config": new}

    @get("/config")
    async def effective_config(self, request: Any, format: str = "json") -> Response[Any]:
        """The effective config (``?format=yaml`` or ``json``), loadable by ``sluice serve --config``."""
        engine: Engine = request.app.state.engine
        data = engine.config.model_dump(mode="json", exclude_defaults=True)
        if format == "yaml":
            return Response(yaml.safe_dump(data, sort_keys=False), media_type="application/yaml")
        if format != "json":
            raise APIError(400, "format must be 'json' or 'yaml'", "invalid_request_error", "format")
        return Response(data)


class PinBody(BaseModel):
    """``PATCH /admin/models/{model}/pin``."""

    model_config = ConfigDict(extra="forbid")

    pinned: StrictBool


def _state_and_reason(residency: Residency, name: str) -> dict[str, Any]:
    """``{"state": ...}``, with ``reason`` for a failed load, of a model not loaded."""
    status = describe_state(residency, name)
    return {"state": status.pop("value"), **status}


class LayoutBody(BaseModel):
    """``PUT /admin/models/{model}/buckets``: the new layout, as the config file's ``buckets``."""

    buckets: list[BucketConfig]


def change_knobs(engine: Engine, model: str, bucket: str, changes: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Apply knob ``changes`` to bucket ``bucket`` of ``model``: validated as a whole new config,
    then live from the bucket's next step (the admin PATCH and the SLO tuner both come here).
    Returns the bucket's config before and after (JSON).

    Raises:
        APIError: 422 naming the field when the changed config is invalid; nothing changes then.
    """
    served = engine.models[model]
    position = next(i for i, b in enumerate(served.config.buckets) if b.bucket_name == bucket)
    index = _model_index(engine.config, model)
    models = _models_data(engine.config)
    old = models[index]["buckets"][position]
    queue = {k: v for k, v in changes.items() if k in BUCKET_LEVEL_KNOBS}
    batcher = {k: v for k, v in changes.items() if k not in BUCKET_LEVEL_KNOBS}
    models[index]["buckets"][position] = {**old, **queue, "batcher": {**old["batcher"], **batcher}}
    config = _validated({**_config_data(engine.config), "models": models})
    try:
        engine.update_bucket(model, bucket, config.models[index], config)
    except ValueError as exc:
        raise APIError(422, str(exc), "invalid_request_error", code="invalid_config") from None
    return old, config.models[index].buckets[position].model_dump(mode="json")


# Knobs of the bucket (admission); the rest belong to its batcher.
BUCKET_LEVEL_KNOBS = frozenset({"max_queue_len", "max_queued_tokens"})


def knob_path(engine: Engine, model: str, bucket: str, knob: str) -> str:
    """A PATCH knob's path in the config: ``models.0.buckets.1.batcher.max_num_seqs``, or
    ``models.0.buckets.1.max_queue_len`` for the bucket's own; the knob alone for a bucket the
    model does not have."""
    names = [b.bucket_name for b in engine.models[model].config.buckets]
    if bucket not in names:
        return knob
    position = names.index(bucket)
    owner = "" if knob in BUCKET_LEVEL_KNOBS else "batcher."
    return f"models.{_model_index(engine.config, model)}.buckets.{position}.{owner}{knob}"


class BucketPatch(BaseModel):
    """``PATCH /admin/models/{model}/buckets/{bucket}``: the knobs that may change on a running
    bucket (a dynamic bucket's or a continuous bucket's own; the other kind's are a 422)."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int | None = Field(default=None, ge=1)
    max_queue_delay_ms: float | None = Field(default=None, ge=0)
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    chunked_prefill: Literal["stall_free", "fixed"] | None = None
    tpot_target_ms: float | None = Field(default=None, gt=0, le=60_000)  # null: back to the default target
    priority_aging_s: float | None = Field(default=None, gt=0)
    fair_share: bool | None = None
    max_starvation_s: float | None = Field(default=None, gt=0)
    max_queue_len: int | None = Field(default=None, ge=1)
    max_queued_tokens: int | None = Field(default=None, ge=1)


async def _json_object(request: Any) -> dict[str, Any]:
    """The request's JSON object body. Raises APIError 400 when it is not one."""
    try:
        data = await request.json()
    except Exception:  # litestar raises its own decode errors
        data = None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object", "invalid_request_error", code="invalid_json")
    return data


def _config_data(config: GatewayConfig) -> dict[str, Any]:
    return config.model_dump(mode="json")


def _models_data(config: GatewayConfig) -> list[dict[str, Any]]:
    return [m.model_dump(mode="json") for m in config.models]


def _model_index(config: GatewayConfig, name: str) -> int:
    return next(i for i, m in enumerate(config.models) if m.name == name)


def _validated(data: dict[str, Any]) -> GatewayConfig:
    """``data`` as a whole effective config.

    Raises:
        APIError: 422 naming the field (a dotted path in the config) and the reason.
    """
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise config_validation_error(exc) from None


def _configured(action: Any, *args: Any) -> Any:
    """Run an engine change; its ``ConfigError`` (KV pools over a slice's KV memory, or weights
    plus KV over its ``memory_budget_bytes``) or ``ModelError`` (a source that loads nothing)
    is a 422. Called on an executor thread, which then frees the OpenMP pool the build left it
    (:mod:`models.openmp`)."""
    try:
        return action(*args)
    except (ConfigError, ModelError) as exc:
        raise to_api_error(exc) from None
    finally:
        release_thread_pool()


def _ready_model(engine: Engine, name: str) -> ServedModel:
    served = engine.models.get(name)
    if served is None:
        raise model_not_found(name)
    if served.draining:
        raise APIError(409, f"The model '{name}' is draining", "invalid_request_error", code="model_draining")
    return served


def _check_thread_slices(engine: Engine, model: ModelConfig, action: str) -> None:
    """Raises APIError 409 (``process_slice``) when a bucket of ``model`` is on a slice with
    ``isolation: process`` or ``ray``: its worker process or actor builds its buckets at start, and does not yet
    load, unload or rebuild them at run time (knob changes do reach it)."""
    for bucket in model.buckets:
        device_slice = engine.slices.get(bucket.slice)
        if device_slice is not None and device_slice.isolation in ("process", "ray"):
            raise APIError(
                409,
                f"{action.capitalize()} the model '{model.name}' is not supported: its bucket '{bucket.bucket_name}' is "
                f"on slice '{bucket.slice}', which has isolation: {device_slice.isolation} (restart the gateway with a new config)",
                "invalid_request_error",
                code="process_slice",
            )


def _loading(request: Any) -> set[str]:
    """Names of the models being loaded (listed with state ``loading``)."""
    state = request.app.state
    if not hasattr(state, "loading_models"):
        state.loading_models = set()
    return state.loading_models  # type: ignore[no-any-return]


def _changes(request: Any) -> asyncio.Lock:
    """One change at a time (admin calls and the SLO tuner): each reads the effective config and
    writes a new one."""
    return request.app.state.config_lock  # type: ignore[no-any-return]


def _audit(request: Any, action: str, target: str, before: Any, after: Any) -> None:
    client = request.client.host if request.client else None
    audit_log.info("admin_audit", who=client, action=action, model=target, before=before, after=after)
