"""The LoRA adapters the gateway serves over their base models (issue 34).

An adapter is a model id of its own (``"model": "sql-lora"``) that runs in its base model's
buckets with :class:`models.step_io.LoraRequest` on each request. Per LoRA-enabled base model an
:class:`AdapterRegistry` knows its adapters (those of its ``lora.adapters``, every PEFT folder in
its ``lora.adapters_dir`` by folder name, and those the admin API added) and keeps at most
``lora.max_cpu_loras`` of them read in memory, least recently used dropped first
(:func:`policies.eviction.eviction_order`: idle before busy). A read runs on a worker thread,
once per adapter however many requests wait for it, and gives the adapter a new ``adapter_id``
(unique in the process), so the runner's slots and the prefix cache never mix two reads of one
name. A request holds an :class:`AdapterLease` while it runs; removing an adapter drains it: its
name is refused (404) at once, the leases held finish, then it is forgotten.

Everything here runs on the event loop (no locks: no ``await`` between a check and its change).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.config import GatewayConfig, LoraConfig, ModelConfig
from gateway.errors import APIError, ConfigError, invalid_request, model_not_found
from models.errors import LoraAdapterError, ModelError
from models.lora import LoraAdapter
from models.lora_loader import CONFIG_FILE, read_peft_adapter
from models.step_io import LoraRequest
from policies.eviction import ResidentModel, eviction_order

# adapter_id of each read, process-wide.
_adapter_ids = itertools.count(1)


@dataclass
class AdapterEntry:
    """A known adapter. ``origin``: ``config``, ``adapters_dir`` or ``admin``. Changed on the event loop only."""

    name: str
    path: str
    origin: str
    num_in_flight: int = 0  # leases held by requests running with it
    is_draining: bool = False
    drained: asyncio.Event = field(default_factory=asyncio.Event)


class AdapterLease:
    """One request's hold on its adapter (``lora`` goes on its ``GenerationRequest``); the
    adapter is not forgotten by a removal before every lease is released. ``release`` is
    idempotent."""

    def __init__(self, entry: AdapterEntry, lora: LoraRequest):
        self.entry, self.lora = entry, lora
        self._is_released = False
        entry.num_in_flight += 1

    def release(self) -> None:
        if self._is_released:
            return
        self._is_released = True
        self.entry.num_in_flight -= 1
        assert self.entry.num_in_flight >= 0
        if self.entry.num_in_flight == 0:
            self.entry.drained.set()


class AdapterRegistry:
    """The adapters of one LoRA-enabled base model (see the module's docstring).

    Args:
        base: the base model's config (its ``lora`` block set).
        read_base_config: returns the base's Hugging Face config (called on a worker thread,
            once): what adapters' shapes are checked against.
        clock: seconds, monotonic (LRU order).
    """

    def __init__(self, base: ModelConfig, read_base_config: Callable[[], Any], clock: Callable[[], float] = time.monotonic):
        assert base.lora is not None
        self.base_name, self.lora = base.name, base.lora
        self._read_base_config = read_base_config
        self._base_config: Any = None
        self.clock = clock
        self.known: dict[str, AdapterEntry] = {a.name: AdapterEntry(a.name, a.path, "config") for a in base.lora.adapters}
        self._loaded: dict[str, LoraRequest] = {}
        self._last_used_s: dict[str, float] = {}
        self._reading: dict[str, tuple[AdapterEntry, asyncio.Future[LoraRequest]]] = {}

    def update(self, lora: LoraConfig) -> None:
        """Follow a changed ``lora`` block (limits, adapters_dir, configured adapters). Only the
        configured adapters new to the block are added: one the admin removed stays removed."""
        before = {a.name for a in self.lora.adapters}
        self.lora = lora
        for adapter in lora.adapters:
            if adapter.name not in before:
                self.known.setdefault(adapter.name, AdapterEntry(adapter.name, adapter.path, "config"))

    # -- names ---------------------------------------------------------------------------------

    def find(self, name: str) -> AdapterEntry | None:
        """The adapter served as ``name``, not draining: known, or a folder of ``adapters_dir``."""
        entry = self.known.get(name)
        if entry is not None:
            return None if entry.is_draining else entry
        folder = self._dir_folder(name)
        if folder is None:
            return None
        entry = self.known[name] = AdapterEntry(name, str(folder), "adapters_dir")
        return entry

    def entries(self) -> list[AdapterEntry]:
        """Every adapter servable now (``adapters_dir`` scanned), by name."""
        if self.lora.adapters_dir is not None:
            root = Path(self.lora.adapters_dir)
            for folder in sorted(root.iterdir()) if root.is_dir() else []:
                if folder.name not in self.known:
                    self.find(folder.name)
        return sorted((e for e in self.known.values() if not e.is_draining), key=lambda e: e.name)

    def _dir_folder(self, name: str) -> Path | None:
        if self.lora.adapters_dir is None or "/" in name or name.startswith("."):
            return None
        folder = Path(self.lora.adapters_dir) / name
        return folder if (folder / CONFIG_FILE).is_file() else None

    # -- reading -------------------------------------------------------------------------------

    async def read(self, name: str, path: str) -> LoraAdapter:
        """Read the PEFT folder ``path`` as adapter ``name`` on a worker thread.

        Raises:
            LoraAdapterError: the folder is not an adapter Sluice serves over this base.
            ModelError: the base model's own config cannot be read.
        """
        if self._base_config is None:
            self._base_config = await asyncio.to_thread(self._read_base_config)
        return await asyncio.to_thread(read_peft_adapter, name, path, self._base_config, self.lora.max_lora_rank)

    async def lease(self, entry: AdapterEntry) -> AdapterLease:
        """A lease on ``entry`` with its weights read (once however many requests wait).

        Raises:
            APIError: 400 naming ``model`` when the adapter cannot be read; 404 when it was
                removed meanwhile.
        """
        lora = self._loaded.get(entry.name)
        if lora is None:
            pending = self._reading.get(entry.name)
            if pending is None or pending[0] is not entry:  # a removed entry's read is not this one's
                reading: asyncio.Future[LoraRequest] = asyncio.ensure_future(self._read_request(entry))
                self._reading[entry.name] = (entry, reading)
                reading.add_done_callback(lambda done: self._forget_read(entry.name, done))
            else:
                reading = pending[1]
            lora = await asyncio.shield(reading)
        if self.known.get(entry.name) is not entry or entry.is_draining:
            raise model_not_found(entry.name)
        self._last_used_s[entry.name] = self.clock()
        return AdapterLease(entry, lora)

    def _forget_read(self, name: str, done: asyncio.Future[LoraRequest]) -> None:
        pending = self._reading.get(name)
        if pending is not None and pending[1] is done:
            del self._reading[name]

    async def _read_request(self, entry: AdapterEntry) -> LoraRequest:
        try:
            adapter = await self.read(entry.name, entry.path)
        except (LoraAdapterError, ModelError, OSError) as exc:
            raise invalid_request(
                f"The LoRA adapter '{entry.name}' at {entry.path} cannot be served over '{self.base_name}': {exc}",
                param="model", code="invalid_lora_adapter",
            ) from None
        lora = LoraRequest(name=entry.name, adapter_id=next(_adapter_ids), weights=adapter)
        if self.known.get(entry.name) is entry and not entry.is_draining:
            self._keep(lora)  # not a removed entry's: its weights must not stay, nor serve a new one of its name
        return lora

    def _keep(self, lora: LoraRequest) -> None:
        """Hold ``lora`` read, dropping the least recently used beyond ``max_cpu_loras``."""
        self._loaded[lora.name] = lora
        self._last_used_s[lora.name] = self.clock()
        while len(self._loaded) > self.lora.max_cpu_loras:
            resident = [
                ResidentModel(name=n, last_used_s=self._last_used_s.get(n, 0.0),
                              is_busy=n in self.known and self.known[n].num_in_flight > 0)
                for n in self._loaded if n != lora.name
            ]
            victim = eviction_order(resident)[0].name
            del self._loaded[victim]  # a request running with it keeps its own reference

    # -- admin ---------------------------------------------------------------------------------

    async def add(self, name: str, path: str, is_taken: Callable[[str], bool] | None = None) -> AdapterEntry | None:
        """Read ``path`` now and serve it as ``name`` (the admin's add). None, registering
        nothing, when ``name`` was taken while the folder was read (``is_taken``, else this
        registry's names): two concurrent adds of one name, the second must not replace the first.

        Raises:
            LoraAdapterError: the folder cannot be served (nothing is registered).
            ModelError: the base model's config cannot be read.
        """
        adapter = await self.read(name, path)
        if name in self.known or (is_taken is not None and is_taken(name)):
            return None
        entry = self.known[name] = AdapterEntry(name, path, "admin")
        self._keep(LoraRequest(name=name, adapter_id=next(_adapter_ids), weights=adapter))
        return entry

    async def remove(self, name: str, timeout_s: float | None = None) -> AdapterEntry:
        """Drain ``name`` (refused at once; its running requests finish, for at most
        ``timeout_s``), then forget it. Requests still running then go on: each holds its
        adapter's weights. A folder of ``adapters_dir`` stays there: a later request reads it again.

        Raises:
            APIError: 404 when ``name`` is not a servable adapter of this base.
        """
        entry = self.find(name)
        if entry is None:
            raise model_not_found(name)
        entry.is_draining = True
        if entry.num_in_flight > 0:
            entry.drained.clear()
            try:
                await asyncio.wait_for(entry.drained.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass  # forgotten with requests running: they keep their weights to the end
        self.known.pop(name, None)
        self._loaded.pop(name, None)
        self._last_used_s.pop(name, None)
        return entry

    def stats(self) -> dict[str, Any]:
        """What the admin listing shows: adapters known, those read in memory and their bytes."""
        loaded = sorted(self._loaded, key=lambda n: self._last_used_s.get(n, 0.0))
        return {
            "num_adapters": len(self.entries()), "max_cpu_loras": self.lora.max_cpu_loras,
            "loaded": loaded,
            "loaded_bytes": sum(self._loaded[n].weights.nbytes for n in loaded),
            "in_flight": {e.name: e.num_in_flight for e in self.known.values() if e.num_in_flight},
        }


class Adapters:
    """Every LoRA-enabled base model's :class:`AdapterRegistry`, made on first need from the
    effective config (``models()``); resolves a request's model id to its adapter.

    Args:
        models: the effective config's models now (the admin API may change them).
        read_base_config: ``model config -> its Hugging Face config`` (called on a worker thread).
    """

    def __init__(self, models: Callable[[], list[ModelConfig]], read_base_config: Callable[[ModelConfig], Any]):
        self._models = models
        self._read_base_config = read_base_config
        self._registries: dict[str, AdapterRegistry] = {}

    def registry(self, base: str) -> AdapterRegistry | None:
        """The registry of ``base``; None when it is not a model or has no ``lora`` block."""
        model = next((m for m in self._models() if m.name == base), None)
        if model is None or model.lora is None:
            self._registries.pop(base, None)
            return None
        registry = self._registries.get(base)
        if registry is None:
            registry = self._registries[base] = AdapterRegistry(model, lambda: self._read_base_config(model))
        elif registry.lora is not model.lora:
            registry.update(model.lora)
        return registry

    def registries(self) -> list[AdapterRegistry]:
        """The registries of every LoRA-enabled model, in config order."""
        found = (self.registry(m.name) for m in self._models() if m.lora is not None)
        return [r for r in found if r is not None]

    def find(self, name: str) -> tuple[AdapterRegistry, AdapterEntry] | None:
        """The registry and entry of adapter ``name``; None when ``name`` is not a servable
        adapter (a model id is never one: models win over folders of an ``adapters_dir``)."""
        if any(m.name == name for m in self._models()):
            return None
        for registry in self.registries():
            entry = registry.find(name)
            if entry is not None:
                return registry, entry
        return None

    def is_taken(self, name: str) -> bool:
        """Whether ``name`` is a model id or an adapter of any base (draining ones included)."""
        return any(m.name == name for m in self._models()) or any(name in r.known for r in self.registries())

    async def lease(self, name: str, task: str) -> tuple[str, AdapterLease] | None:
        """``(base model name, lease)`` when ``name`` is an adapter; None when it is not.

        Raises:
            APIError: 400 ``wrong_task`` for a task other than generation; 400 naming ``model``
                when the adapter cannot be read; 404 when it was removed meanwhile.
        """
        found = self.find(name)
        if found is None:
            return None
        registry, entry = found
        if task != "generate":
            raise invalid_request(f"The model '{name}' is a LoRA adapter; it does not support {task}", param="model", code="wrong_task")
        return registry.base_name, await registry.lease(entry)


def adapter_error(exc: LoraAdapterError | ModelError, param: str) -> APIError:
    """A bad adapter folder named in an admin call: 400 naming the body field ``param``."""
    key = getattr(exc, "param", None)
    where = f" ({key})" if key not in (None, "path") else ""
    return invalid_request(f"Cannot serve the LoRA adapter{where}: {exc}", param=param, code="invalid_lora_adapter")


def base_hf_config(model: ModelConfig, cache_dir: Path) -> Any:
    """The Hugging Face config of ``model``'s source (a GGUF file is converted once).

    Raises:
        ModelError: the source is not a loadable model folder.
    """
    from transformers import AutoConfig

    from models.source import model_folder

    folder = model_folder(model.source, cache_dir)
    try:
        return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read the config of {model.name!r} at {folder}: {exc}") from None


def check_adapter_folders(config: GatewayConfig) -> None:
    """Every configured adapter's ``path`` holds a PEFT ``adapter_config.json`` and every
    ``adapters_dir`` is a folder (checked at start; the weights are read on first use).

    Raises:
        ConfigError: naming the field (``models.0.lora.adapters.1.path``) and the path.
    """
    for i, model in enumerate(config.models):
        if model.lora is None:
            continue
        for k, adapter in enumerate(model.lora.adapters):
            if not (Path(adapter.path) / CONFIG_FILE).is_file():
                field_path = f"models.{i}.lora.adapters.{k}.path"
                raise ConfigError(f"{field_path}: {adapter.path} has no {CONFIG_FILE}: not a PEFT adapter folder", param=field_path)
        if model.lora.adapters_dir is not None and not Path(model.lora.adapters_dir).is_dir():
            field_path = f"models.{i}.lora.adapters_dir"
            raise ConfigError(f"{field_path}: {model.lora.adapters_dir} is not a folder", param=field_path)
