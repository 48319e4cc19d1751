"""Which models are resident: load on the first request, evict the least recently used within
the memory budgets, unload the idle.

Every model of the effective config is servable; those of ``load: at_start`` are loaded by
:meth:`Engine.start`, the others (``load: on_demand``) by their first request. A request for a
model that is not loaded waits for one load per model however many arrive meanwhile (single
flight), in a wait bounded like its buckets' queues (429 past it), its wait counted in its TTFT
and against its ``timeout`` (504 when it passes). A failed load answers every waiter with a 503
``model_load_failed`` naming the reason; the next request tries again after
``model_load_retry_s``.

Before a load, the bytes the model will hold (its weights, estimated on torch's meta device, and
its KV pools) must be free in every budget scope it lives in: the gateway's
``memory_budget_bytes`` (default 80 % of RAM) and its slices'. :func:`policies.eviction.choose_victims`
picks the models to evict, least recently used first, idle before busy, never a pinned one; a
busy victim is drained (its requests finish; new ones for it wait to load it again). A model
that alone needs more than a budget gets a 503 ``model_too_large`` at once; when the memory is
held by pinned or loading models, a 503 ``insufficient_memory`` with ``Retry-After``.

Everything here runs on the event loop (no locks: each decision is made without an ``await`` in
between); the loads and unloads themselves run on worker threads, so other models keep serving.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import structlog

from gateway import memory
from gateway.config import ModelConfig
from gateway.engine import Engine, ServedModel
from gateway.gate_process import in_low_priority_thread
from gateway.errors import (
    APIError,
    ConfigError,
    deadline_exceeded,
    insufficient_memory,
    invalid_request,
    load_queue_full,
    model_load_failed,
    model_not_found,
    model_too_large,
    model_unavailable,
)
from models.cpu_memory import freeze_epoch
from models.loader import estimate_weight_bytes
from models.source import model_folder
from policies.eviction import ResidentModel, choose_victims, idled_out

log = structlog.get_logger(__name__)

# The most seconds between two looks for models past their idle_unload_s.
MAX_IDLE_CHECK_S = 1.0
# The CPU priority (nice) of a load's thread and the threads it starts (prepacking): the models
# serving meanwhile keep the cores first (Linux weighs nice 10 at a tenth of nice 0), while a
# load on an idle machine runs at full speed.
LOAD_NICE = 10


class ModelState(str, Enum):
    """A servable model's state, as ``GET /v1/models`` shows it (llama.cpp's router's words)."""

    LOADED = "loaded"
    LOADING = "loading"
    UNLOADING = "unloading"
    UNLOADED = "unloaded"
    FAILED = "failed"


class ResidencyObserver(Protocol):
    """Who counts loads and evictions (:class:`gateway.metrics.Metrics`)."""

    def observe_model_load(self, model: str, outcome: str, duration_s: float) -> None: ...

    def observe_model_eviction(self, model: str, reason: str) -> None: ...

    def observe_load_refusal(self, model: str) -> None: ...


@dataclass
class ModelEntry:
    """What residency knows of one servable model. Changed on the event loop only."""

    name: str
    state: ModelState = ModelState.UNLOADED
    last_used_s: float = 0.0  # the clock's time of the last request for it
    failure: str | None = None  # why the last load failed
    retry_at_s: float = 0.0  # no load before this (clock seconds) after a failure
    weight_bytes_estimate: int | None = None
    loaded_freeze_epoch: int | None = None  # models.cpu_memory.freeze_epoch() when it last loaded here
    loading: asyncio.Future[ServedModel] | None = None
    unloading: asyncio.Future[None] | None = None
    num_waiters: int = 0


def machine_memory_bytes() -> int:
    """The machine's RAM in bytes (``sysconf``)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Residency:
    """Loads models on demand and evicts them within the budgets (see the module's docstring).

    Args:
        engine: the served models; its :meth:`Engine.start` has loaded the ``at_start`` ones.
        observer: counts loads and evictions (metrics); None: nobody.
        clock: seconds, monotonic (LRU order, retry backoff, deadlines).
        physical_memory_bytes: RAM for the default gateway budget; None: this machine's.
    """

    def __init__(
        self,
        engine: Engine,
        observer: ResidencyObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        physical_memory_bytes: int | None = None,
    ):
        self.engine = engine
        self.observer = observer
        self.clock = clock
        ram = physical_memory_bytes if physical_memory_bytes is not None else machine_memory_bytes()
        self.budgets = memory.budgets_by_scope(engine.config, ram)
        self._entries: dict[str, ModelEntry] = {}
        self._reserved: dict[str, dict[str, int]] = {}  # bytes by scope of each load making room
        self._idle_task: asyncio.Task[None] | None = None
        self.started_unix_s = time.time()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Mark the models the engine loaded at start as loaded, and start the idle unloads (on
        the event loop).

        Raises:
            ConfigError: ``model_too_large``: the pinned models loaded at start hold more than a
                budget.
        """
        now = self.clock()
        for name in self.engine.models:
            entry = self._entry(name)
            entry.state, entry.last_used_s = ModelState.LOADED, now
        used = self._used_by_scope()
        for scope, budget in self.budgets.items():
            if used.get(scope, 0) > budget:
                raise ConfigError(
                    f"memory_budget_bytes: the models loaded at start hold {used[scope]} bytes in {_scope_words(scope)}, "
                    f"over its budget of {budget} bytes (load some on_demand, or raise the budget)",
                    param="memory_budget_bytes", code="model_too_large",
                )
        self._idle_task = asyncio.get_running_loop().create_task(self._idle_loop())

    async def stop(self) -> None:
        """Stop the idle unloads."""
        if self._idle_task is not None:
            self._idle_task.cancel()
            with suppress(asyncio.CancelledError):
                await self._idle_task

    # -- requests ------------------------------------------------------------------------------

    def model_config(self, name: str, task: str) -> ModelConfig:
        """The config of servable model ``name``, loaded or not.

        Raises:
            APIError: 404 for an unknown model; 400 ``wrong_task`` when it does not serve ``task``.
        """
        config = self._config(name)
        if config is None:
            raise model_not_found(name)
        if config.task != task:
            raise invalid_request(f"The model '{name}' does not support {task}", param="model", code="wrong_task")
        return config

    def model_exists(self, name: str) -> bool:
        """Whether ``name`` is servable (in the effective config)."""
        return self._config(name) is not None

    def model_config_or_404(self, name: str) -> ModelConfig:
        """The config of servable model ``name``. Raises APIError 404 for an unknown one."""
        config = self._config(name)
        if config is None:
            raise model_not_found(name)
        return config

    @asynccontextmanager
    async def serving(self, name: str, deadline_s: float | None) -> AsyncIterator[ServedModel]:
        """The served model ``name``, loaded first when it is not (see :meth:`acquire`), held
        against an eviction's drain until the block ends (queue the requests inside it)."""
        served = await self.acquire(name, deadline_s)
        try:
            yield served
        finally:
            served.num_leases -= 1

    async def acquire(self, name: str, deadline_s: float | None) -> ServedModel:
        """The served model ``name`` with a lease taken (``num_leases``; give it back when its
        requests are queued), waiting for it to load when it is not loaded.

        Raises:
            APIError: 404 unknown model; 503 ``model_unavailable`` while an admin unload or the
                gateway's stop drains it; 504 when ``deadline_s`` passes during the load; 429
                when too many requests wait for the load; 503 ``model_load_failed``,
                ``insufficient_memory`` or ``model_too_large`` from the load.
        """
        while True:
            if self._config(name) is None:
                raise model_not_found(name)
            entry = self._entry(name)
            served = self.engine.models.get(name)
            if served is not None and not served.draining:
                entry.last_used_s = self.clock()
                served.num_leases += 1  # no await since the check: an eviction sees the lease
                return served
            if served is not None and entry.unloading is None:  # an admin DELETE or the gateway stopping
                raise model_unavailable(name, self.engine.config.drain_retry_after_s)
            await self._wait_for_load(entry, deadline_s)

    async def load(self, name: str) -> ServedModel:
        """Load ``name`` now unless it is loaded (the admin's ``POST .../load``); returns it.

        Raises:
            APIError: 404, or the load's 503s.
        """
        if self._config(name) is None:
            raise model_not_found(name)
        served = self.engine.models.get(name)
        if served is not None and not served.draining:
            return served
        return await self._loading(self._entry(name))

    async def unload(self, name: str, reason: str = "admin") -> None:
        """Drain ``name`` and free it, keeping it servable (the admin's ``POST .../unload``); a
        pinned model too. Nothing when it is not loaded.

        Raises:
            APIError: 404 for an unknown model.
        """
        if self._config(name) is None:
            raise model_not_found(name)
        if name in self.engine.models:
            await self._evict(name, reason)

    def set_pinned(self, name: str, pinned: bool) -> ModelConfig:
        """Pin or unpin ``name`` in the effective config. Returns its new config.

        Raises:
            APIError: 404 for an unknown model.
        """
        config = self._config(name)
        if config is None:
            raise model_not_found(name)
        changed = config.model_copy(update={"pinned": pinned})
        models = [changed if m.name == name else m for m in self.engine.config.models]
        self.engine.config = self.engine.config.model_copy(update={"models": models})
        served = self.engine.models.get(name)
        if served is not None:
            served.config = changed
        return changed

    # -- what it shows -------------------------------------------------------------------------

    def state(self, name: str) -> tuple[ModelState, str | None]:
        """``(state, failure reason)`` of servable model ``name``."""
        entry = self._entry(name)
        served = self.engine.models.get(name)
        if entry.loading is not None:
            return ModelState.LOADING, None
        if entry.unloading is not None:
            return ModelState.UNLOADING, None
        if served is not None:
            return (ModelState.UNLOADING if served.draining else ModelState.LOADED), None
        if entry.state is ModelState.FAILED:
            return ModelState.FAILED, entry.failure
        return ModelState.UNLOADED, None

    def resident_bytes(self) -> dict[str, int]:
        """Bytes each loaded model holds (weights measured at load, and its KV pools)."""
        return {name: self._model_bytes(name)[memory.GATEWAY_SCOPE] for name in list(self.engine.models)}

    def loading(self) -> list[str]:
        """The models loading now."""
        return sorted(name for name, entry in self._entries.items() if entry.loading is not None)

    # -- loading -------------------------------------------------------------------------------

    async def _wait_for_load(self, entry: ModelEntry, deadline_s: float | None) -> None:
        """Wait, within ``deadline_s``, for ``entry``'s load (started here unless running). While
        requests wait for a model, it is not evicted: they take their leases as they wake."""
        max_waiters = self._max_waiters(entry.name)
        if entry.num_waiters >= max_waiters:
            if self.observer is not None:
                self.observer.observe_load_refusal(entry.name)
            raise load_queue_full(entry.name, max_waiters, self.engine.config.drain_retry_after_s)
        started = self.clock()
        entry.num_waiters += 1
        try:
            loading = self._loading(entry)
            timeout_s = None if deadline_s is None else max(0.0, deadline_s - self.clock())
            await asyncio.wait_for(asyncio.shield(loading), timeout_s)
        except TimeoutError:
            raise deadline_exceeded(self.clock() - started) from None
        finally:
            entry.num_waiters -= 1

    def _loading(self, entry: ModelEntry) -> asyncio.Future[ServedModel]:
        """``entry``'s load in progress, started now when none is.

        Raises:
            APIError: 503 ``model_load_failed`` while the backoff after a failed load runs.
        """
        if entry.loading is not None:
            return entry.loading
        wait_s = entry.retry_at_s - self.clock()
        if entry.state is ModelState.FAILED and wait_s > 0:
            raise model_load_failed(entry.name, entry.failure or "unknown", max(1, round(wait_s)))
        loading = asyncio.ensure_future(self._load(entry))
        loading.add_done_callback(lambda done: done.cancelled() or done.exception())  # no 'never retrieved' warning
        entry.loading = loading
        return loading

    async def _load(self, entry: ModelEntry) -> ServedModel:
        name = entry.name
        started = self.clock()
        entry.state, entry.failure = ModelState.LOADING, None
        try:
            if entry.unloading is not None:
                await entry.unloading  # its own eviction's drain ends first
            model = self._config(name)
            if model is None:
                raise model_not_found(name)
            if entry.weight_bytes_estimate is None:
                entry.weight_bytes_estimate = await asyncio.to_thread(self._estimate_weight_bytes, model)
            needed = memory.model_bytes_by_scope(self.engine.config, name, self.engine.kv_memory_bytes, entry.weight_bytes_estimate)
            await self._make_room(name, needed)
            try:
                model = self._config(name) or model  # as the config is now (a pin may have changed it)
                served = await in_low_priority_thread(f"load-{name}", LOAD_NICE, self.engine.load, model, self.engine.config, False)
            finally:
                self._reserved.pop(name, None)
        except APIError as exc:
            self._failed(entry, exc.message, exc.code == "model_too_large", started)
            raise
        except Exception as exc:  # noqa: BLE001  (any failure of a load is the load's answer)
            reason = f"{type(exc).__name__}: {exc}"
            self._failed(entry, reason, True, started)
            log.warning("model_load_failed", model=name, reason=reason, duration_s=round(self.clock() - started, 3))
            raise model_load_failed(name, reason, max(1, round(self.engine.config.model_load_retry_s))) from None
        finally:
            entry.loading = None
        entry.state, entry.last_used_s = ModelState.LOADED, self.clock()
        entry.loaded_freeze_epoch = freeze_epoch()
        duration_s = self.clock() - started
        bytes_held = self._model_bytes(name)
        log.info(
            "model_resident", model=name, duration_s=round(duration_s, 3), resident_bytes=bytes_held[memory.GATEWAY_SCOPE],
            weight_bytes=self.engine.weight_bytes.get(name), weight_bytes_estimate=entry.weight_bytes_estimate,
        )
        if self.observer is not None:
            self.observer.observe_model_load(name, "ok", duration_s)
        return served

    def _failed(self, entry: ModelEntry, reason: str, backoff: bool, started_s: float) -> None:
        """Record a failed load: with ``backoff``, state ``failed`` until ``model_load_retry_s``."""
        entry.failure = reason
        entry.state = ModelState.FAILED if backoff else ModelState.UNLOADED
        if backoff:
            entry.retry_at_s = self.clock() + self.engine.config.model_load_retry_s
        if self.observer is not None:
            self.observer.observe_model_load(entry.name, "failed", self.clock() - started_s)

    def _estimate_weight_bytes(self, model: ModelConfig) -> int:
        """Bytes ``model``'s weights will take (on a worker thread: a GGUF source converts once)."""
        folder = model_folder(model.source, self.engine.cache_dir)
        return estimate_weight_bytes(folder, model.task, model.dtype, self.engine.weights_device(model))

    async def _make_room(self, name: str, needed: dict[str, int]) -> None:
        """Evict until ``needed`` (bytes by scope) is free, and reserve it for ``name``'s load.

        Raises:
            APIError: 503 ``model_too_large`` when a budget alone is too small; 503
                ``insufficient_memory`` when pinned and loading models hold what is missing.
        """
        for scope, need in needed.items():
            if scope in self.budgets and need > self.budgets[scope]:
                raise model_too_large(name, need, self.budgets[scope], _scope_words(scope))
        while True:
            used = self._used_by_scope()
            free = {scope: budget - used.get(scope, 0) for scope, budget in self.budgets.items()}
            victims = choose_victims(self._resident_models(exclude=name), needed, free)
            if victims is not None:
                break
            unloading = [e.unloading for e in self._entries.values() if e.unloading is not None]
            if not unloading:
                short = ", ".join(
                    f"{_scope_words(s)} has {free[s]} of the {n} bytes free" for s, n in needed.items() if s in free and free[s] < n
                )
                raise insufficient_memory(name, short + " (the rest is pinned or loading)", self.engine.config.drain_retry_after_s)
            await asyncio.wait(unloading)  # what they free may be enough
        self._reserved[name] = needed
        if victims:
            log.info("model_eviction_planned", model=name, needed_bytes=needed, victims=victims)
            await asyncio.gather(*(self._evict(victim, "lru") for victim in victims))

    # -- unloading -----------------------------------------------------------------------------

    def _evict(self, name: str, reason: str) -> asyncio.Future[None]:
        """Start draining and freeing loaded model ``name`` (once; later calls get the same
        future). New requests for it wait to load it again."""
        entry = self._entry(name)
        if entry.unloading is not None:
            return entry.unloading
        self.engine.models[name].draining = True  # on the loop: no request is routed to it from now
        unloading = asyncio.ensure_future(self._unload(entry, reason))
        unloading.add_done_callback(lambda done: done.cancelled() or done.exception())
        entry.unloading = unloading
        return unloading

    async def _unload(self, entry: ModelEntry, reason: str) -> None:
        name = entry.name
        started = self.clock()
        bytes_held = self._model_bytes(name)[memory.GATEWAY_SCOPE]
        try:
            # A model loaded since the heap was last frozen is not frozen: collecting the unfrozen
            # objects frees it, without holding the GIL over the whole heap.
            unfrozen_only = entry.loaded_freeze_epoch == freeze_epoch()
            result = await asyncio.to_thread(self.engine.unload, name, self.engine.config.drain_timeout_s, 0.02, False, unfrozen_only)
        finally:
            entry.unloading = None
        if entry.loading is None:
            entry.state = ModelState.UNLOADED
        log.info(
            "model_evicted", model=name, reason=reason, freed_bytes=bytes_held,
            duration_s=round(self.clock() - started, 3), **result,
        )
        if self.observer is not None:
            self.observer.observe_model_eviction(name, reason)

    async def _idle_loop(self) -> None:
        """Unload models idle past their ``idle_unload_s``, looking every second at most."""
        while True:
            idle_s = {m.name: m.idle_unload_s for m in self.engine.config.models if m.idle_unload_s is not None}
            await asyncio.sleep(min([MAX_IDLE_CHECK_S, *(s / 4 for s in idle_s.values())]))
            for name in idled_out(self._resident_models(), idle_s, self.clock()):
                self._evict(name, "idle")

    # -- bookkeeping ---------------------------------------------------------------------------

    def _config(self, name: str) -> ModelConfig | None:
        return next((m for m in self.engine.config.models if m.name == name), None)

    def _entry(self, name: str) -> ModelEntry:
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = ModelEntry(name)
        return entry

    def _max_waiters(self, name: str) -> int:
        """Requests that may wait for ``name`` to load: what its buckets' queues hold."""
        config = self._config(name)
        return sum(b.max_queue_len for b in config.buckets) if config is not None else 0

    def _model_bytes(self, name: str) -> dict[str, int]:
        """Bytes by scope loaded model ``name`` holds (its measured weights, else the estimate)."""
        weights = self.engine.weight_bytes.get(name)
        if weights is None:
            weights = self._entry(name).weight_bytes_estimate or 0
        return memory.model_bytes_by_scope(self.engine.config, name, self.engine.kv_memory_bytes, weights)

    def _used_by_scope(self) -> dict[str, int]:
        """Bytes held by scope: loaded models (draining ones included), the loads that made room,
        and the KV pools of replaced buckets still draining."""
        used: dict[str, int] = {}
        holdings = [self._model_bytes(name) for name in list(self.engine.models) if self._config(name) is not None]
        for held in [*holdings, *self._reserved.values()]:
            for scope, num_bytes in held.items():
                used[scope] = used.get(scope, 0) + num_bytes
        for slice_name, num_bytes in self.engine.draining_kv_bytes().items():
            for scope in (memory.GATEWAY_SCOPE, memory.slice_scope(slice_name)):
                used[scope] = used.get(scope, 0) + num_bytes
        return used

    def _resident_models(self, exclude: str | None = None) -> list[ResidentModel]:
        """The loaded models not draining, as :mod:`policies.eviction` sees them."""
        resident = []
        for name, served in list(self.engine.models.items()):
            config = self._config(name)
            if name == exclude or served.draining or config is None or name in self._reserved:
                continue
            entry = self._entry(name)
            resident.append(ResidentModel(
                name=name, bytes_by_scope=self._model_bytes(name), last_used_s=entry.last_used_s,
                is_pinned=config.is_pinned or entry.num_waiters > 0, is_busy=not served.is_idle(),
            ))
        return resident


def _scope_words(scope: str) -> str:
    """A budget scope as an error message names it."""
    if scope == memory.GATEWAY_SCOPE:
        return "the gateway's memory_budget_bytes"
    return f"slice '{scope.removeprefix('slice:')}''s memory_budget_bytes"


def describe_state(residency: Residency, name: str) -> dict[str, Any]:
    """``{"value": state}`` (and ``"reason"`` for a failed load), as ``/v1/models`` shows it."""
    state, reason = residency.state(name)
    return {"value": state.value, **({"reason": reason} if reason is not None else {})}
