"""Adding and removing LoRA adapters at run time, behind the admin token (:func:`gateway.admin.admin_guard`).

``POST /admin/models/{base}/adapters`` ``{"name", "path"}`` reads the PEFT folder now and serves
it as model id ``name`` (201; 400 naming ``path`` for a folder Sluice cannot serve, and nothing
is registered; 409 when ``name`` is taken; 404 for an unknown base or one without ``lora``).
``DELETE /admin/models/{base}/adapters/{name}`` drains the adapter (refused at once, its running
requests finish) and forgets it. vLLM's ``POST /v1/load_lora_adapter`` ``{"lora_name",
"lora_path"}`` and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` do the same on the only
LoRA-enabled model, or on ``base_model_name``; they answer in vLLM's plain text.
"""

from __future__ import annotations

from typing import Any

import structlog
from litestar import Controller, Request, delete, get, post
from pydantic import BaseModel, ConfigDict, Field

from gateway.adapters import AdapterRegistry, Adapters, adapter_error
from gateway.admin import admin_guard
from gateway.errors import APIError, invalid_request
from gateway.routes.bodies import parse_body
from models.errors import LoraAdapterError, ModelError

audit_log = structlog.get_logger("sluice.admin")
NAME_PATTERN = r"^[A-Za-z0-9_.:/-]+$"


class AddAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, pattern=NAME_PATTERN)
    path: str = Field(min_length=1)


class LoadLoraAdapterBody(BaseModel):
    """vLLM's ``LoadLoRAAdapterRequest`` (``load_inplace`` only false), and which base."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, pattern=NAME_PATTERN)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False
    base_model_name: str | None = None


class UnloadLoraAdapterBody(BaseModel):
    """vLLM's ``UnloadLoRAAdapterRequest``; ``lora_int_id`` only null (ids are Sluice's own),
    as vLLM's client sends it when unset."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
    base_model_name: str | None = None


def _adapters(request: Request[Any, Any, Any]) -> Adapters:
    return request.app.state.adapters  # type: ignore[no-any-return]


def _registry(adapters: Adapters, base: str) -> AdapterRegistry:
    registry = adapters.registry(base)
    if registry is None:
        raise APIError(404, f"The model '{base}' does not exist or serves no LoRA adapters (no lora block)",
                       "not_found_error", "model", "model_not_found")
    return registry


def _only_registry(adapters: Adapters, base: str | None) -> AdapterRegistry:
    """The registry a vLLM call means: ``base``'s, or the only LoRA-enabled model's."""
    if base is not None:
        return _registry(adapters, base)
    registries = adapters.registries()
    if len(registries) != 1:
        names = [r.base_name for r in registries]
        raise invalid_request(
            f"Name the base model in base_model_name: {len(names)} models serve LoRA adapters ({names})",
            param="base_model_name",
        )
    return registries[0]


async def _add(request: Request[Any, Any, Any], registry: AdapterRegistry, name: str, path: str, path_param: str) -> dict[str, Any]:
    """Read ``path`` and serve it as ``name`` over ``registry``'s base (see the module's docstring)."""
    adapters = _adapters(request)
    if adapters.is_taken(name) or adapters.find(name) is not None:
        raise APIError(409, f"The name '{name}' is already a model or an adapter", "invalid_request_error",
                       "name" if path_param == "path" else "lora_name", "model_exists")
    try:
        entry = await registry.add(name, path, adapters.is_taken)
    except (LoraAdapterError, ModelError) as exc:
        raise adapter_error(exc, path_param) from None
    if entry is None:  # another add of the name won the race while this one read its folder
        raise APIError(409, f"The name '{name}' is already a model or an adapter", "invalid_request_error",
                       "name" if path_param == "path" else "lora_name", "model_exists")
    _audit(request, "add_adapter", registry.base_name, name, path)
    return {"id": name, "root": path, "parent": registry.base_name, "origin": entry.origin}


async def _remove(request: Request[Any, Any, Any], registry: AdapterRegistry, name: str) -> dict[str, Any]:
    entry = await registry.remove(name, request.app.state.engine.config.drain_timeout_s)
    _audit(request, "remove_adapter", registry.base_name, name, entry.path)
    return {"id": name, "parent": registry.base_name, "state": "removed", "num_unfinished": entry.num_in_flight}


def _audit(request: Request[Any, Any, Any], action: str, base: str, name: str, path: str) -> None:
    client = request.client.host if request.client else None
    audit_log.info("admin_audit", who=client, action=action, model=base, adapter=name, path=path)


class AdapterController(Controller):
    path = "/admin/models/{base:str}/adapters"
    guards = [admin_guard]

    @get("/")
    async def list_adapters(self, request: Request[Any, Any, Any], base: str) -> dict[str, Any]:
        """The base's adapters (name, path, origin, requests in flight) and its in-memory cache."""
        registry = _registry(_adapters(request), base)
        adapters = [{"id": e.name, "root": e.path, "origin": e.origin, "in_flight": e.num_in_flight} for e in registry.entries()]
        return {"parent": base, "adapters": adapters, "stats": registry.stats()}

    @post("/", status_code=201)
    async def add_adapter(self, request: Request[Any, Any, Any], base: str) -> dict[str, Any]:
        registry = _registry(_adapters(request), base)
        body = await parse_body(request, AddAdapterBody)
        return await _add(request, registry, body.name, body.path, "path")

    @delete("/{name:path}", status_code=200)
    async def remove_adapter(self, request: Request[Any, Any, Any], base: str, name: str) -> dict[str, Any]:
        return await _remove(request, _registry(_adapters(request), base), name.lstrip("/"))


class VllmAdapterController(Controller):
    path = "/v1"
    guards = [admin_guard]

    @post("/load_lora_adapter", status_code=200)
    async def load_lora_adapter(self, request: Request[Any, Any, Any]) -> str:
        body = await parse_body(request, LoadLoraAdapterBody)
        if body.load_inplace:
            raise invalid_request("load_inplace is not supported: unload the adapter, then load it", param="load_inplace")
        registry = _only_registry(_adapters(request), body.base_model_name)
        await _add(request, registry, body.lora_name, body.lora_path, "lora_path")
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @post("/unload_lora_adapter", status_code=200)
    async def unload_lora_adapter(self, request: Request[Any, Any, Any]) -> str:
        body = await parse_body(request, UnloadLoraAdapterBody)
        if body.lora_int_id is not None:
            raise invalid_request("lora_int_id is not supported: name the adapter by lora_name", param="lora_int_id")
        registry = _only_registry(_adapters(request), body.base_model_name)
        if registry.find(body.lora_name) is None:
            raise APIError(404, f"The LoRA adapter '{body.lora_name}' cannot be found", "not_found_error",
                           "lora_name", "model_not_found")
        await _remove(request, registry, body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
