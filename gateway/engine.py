"""The served models of one gateway process and their life: load, unload, layout swap, knob
patch, retire. Budgets are :mod:`gateway.memory`'s arithmetic; buckets and slices are built by
:mod:`gateway.build`."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import structlog

from buckets.bucket import Bucket, BucketTable
from buckets.request import Request
from buckets.slices.slice import BucketKey, Slice
from gateway import build, memory
from gateway.build import BucketBuilder, WorkerMain
from gateway.config import BucketConfig, GatewayConfig, ModelConfig
from gateway.errors import ConfigError
from gateway.logging import log_request_finished
from models.cpu_memory import freeze_long_lived_objects, release_memory
from models import structured
from models.loader import LoadedModel, keep_tokenizer, load_model

log = structlog.get_logger(__name__)

RequestObserver = Callable[[str, Request, int, str], None]
# Called with (model name, bucket) for every bucket built, before it takes requests.
BucketHook = Callable[[str, Bucket], None]


@dataclass
class ServedModel:
    """A loaded model and the bucket table requests are routed through.

    ``draining`` is set while the model is being unloaded or the gateway stops: it takes no new
    requests (503 with ``Retry-After``) while those in flight finish.
    """

    config: ModelConfig
    loaded: LoadedModel
    table: BucketTable
    draining: bool = False
    # Requests the router has handed this model and not yet queued on a bucket (they keep an
    # eviction's drain waiting: gateway/residency.py). Changed on the event loop only.
    num_leases: int = 0
    layout_no: int = 0  # bumped by each new bucket layout (its buckets' keys on their slices)
    # Called with (model name, request, completion tokens, outcome) once per finished request.
    request_observers: list[RequestObserver] = field(default_factory=list)
    created_s: float = field(default_factory=time.time)  # Unix time the model finished loading

    def finish(self, request: Request, completion_tokens: int, outcome: str) -> None:
        """Log a finished request once and hand it to the observers (metrics, dashboards)."""
        log_request_finished(self.config.name, request, completion_tokens, outcome)
        for observer in self.request_observers:
            observer(self.config.name, request, completion_tokens, outcome)

    @property
    def state(self) -> str:
        return "draining" if self.draining else "ready"

    def is_idle(self) -> bool:
        """No request queued, running or being routed in any of its buckets (admission tickets
        and leases included)."""
        return self.num_leases == 0 and all(bucket.is_idle() for bucket in self.table.buckets)


def drain_buckets(buckets: list[Bucket], timeout_s: float, poll_s: float = 0.02) -> tuple[float, int]:
    """Wait until ``buckets`` (closed or draining: taking no new requests) are idle, for at most
    ``timeout_s``; then take them off their slices, which fail what is left.
    Returns ``(seconds waited, requests failed)``."""
    started = time.monotonic()
    while not all(b.is_idle() for b in buckets) and time.monotonic() - started < timeout_s:
        time.sleep(poll_s)
    drain_s = time.monotonic() - started
    num_unfinished = 0
    for bucket in buckets:
        stats = bucket.stats()
        num_left = stats.num_waiting + stats.num_running
        num_unfinished += num_left
        bucket.freeze_stats(num_failed=num_left)  # a bucket that replaced it carries its counters on
        bucket.device_slice.detach(bucket.key)  # fails what is left
    return drain_s, num_unfinished


class Engine:
    """Owns the slices and served models of one gateway process (or of one slice worker
    process, which runs an engine over its cut of the config).

    :meth:`start` loads every model (slow: seconds) and starts the slice workers; call it off the
    event loop. :meth:`stop` stops the workers and fails whatever is still queued.

    Args:
        config: the validated gateway config.
        worker_main: what a process slice's worker runs (:func:`gateway.slice_worker.run_slice_worker`,
            passed in by the app, so this module does not import the worker's code).
        defer_gates: build an ``auto`` bucket without a current gate record on eager with its
            gate ``pending`` (the app's :class:`~gateway.background_gates.BackgroundGates` runs
            it), and one whose current record enables another backend on eager, ``building``
            (the gate thread builds that backend through :meth:`rebuild_bucket`); else gate and
            build them while they are built (the gateway waits).

    Raises:
        ConfigError: a ``cuda:N`` slice torch cannot see, or KV shares over a slice's budget.
        ValueError: a process slice and no ``worker_main``.
    """

    def __init__(self, config: GatewayConfig, worker_main: WorkerMain | None = None, defer_gates: bool = False):
        build.check_devices(config)
        self.config = config
        structured.configure(config.structured_output.grammar_cache_size, config.structured_output.compile_timeout_s)
        self.defer_gates = defer_gates
        self.cache_dir = build.cache_dir(config)
        self.slices: dict[str, Slice] = {
            s.name: build.make_slice(s, worker_main, functools.partial(self._worker_args, s.name), config.ray)
            for s in config.slices
        }
        self.models: dict[str, ServedModel] = {}
        self.request_observers: list[RequestObserver] = []
        self.retiring: list[Bucket] = []  # closed buckets still draining after a layout change
        self.bucket_hooks: list[BucketHook] = []
        self.kv_memory_bytes = memory.split_kv_memory(config, build.slice_kv_budgets(config))
        self.weight_bytes: dict[str, int] = {}  # per model loaded with weights here, for the slices' memory budgets
        # Each built bucket's slice and KV pool bytes (0: no pool), until it is detached.
        self.kv_pool_bytes: dict[BucketKey, tuple[str, int]] = {}

    def start(self) -> None:
        """Load every model of ``load: at_start``, then start the slices side by side: a process
        or Ray slice's worker loads its models itself, so several such slices load at once rather
        than one after another. Models of ``load: on_demand`` load on their first request
        (:mod:`gateway.residency`).

        Raises:
            RuntimeError: a slice could not start (the first such slice in config order; the
                others have started or failed too).
        """
        for model_config in self.config.models:
            if model_config.load == "at_start":
                self.models[model_config.name] = self._load(model_config)
        slices = list(self.slices.values())
        with ThreadPoolExecutor(max(1, len(slices)), thread_name_prefix="slice-start") as pool:
            errors = [future.exception() for future in [pool.submit(s.start) for s in slices]]
        for error in errors:
            if error is not None:
                raise error

    def stop(self) -> None:
        for model in self.models.values():
            model.draining = True
        for device_slice in self.slices.values():
            device_slice.stop()

    def unload(
        self, name: str, drain_timeout_s: float, poll_s: float = 0.02, forget: bool = True, unfrozen_only: bool = False
    ) -> dict[str, float | int]:
        """Drain model ``name`` and free it. Blocking: call it off the event loop.

        New requests get 503 at once (or, for a model :mod:`gateway.residency` evicts, wait for
        it to load again); those already admitted, or being routed (``num_leases``), run to the
        end, for at most ``drain_timeout_s`` seconds, after which the rest fail
        (:class:`ShuttingDownError`). Then its batchers leave their slices and the model, its KV
        pools and its tokenizer are dropped (``gc.collect``, and glibc's ``malloc_trim`` so the
        heap shrinks; with ``unfrozen_only``, a collection of the objects not frozen, for a model
        loaded since the heap was last frozen: :func:`~models.cpu_memory.release_memory`). With
        ``forget`` the model leaves the effective config too (the admin's DELETE); without it, it
        stays servable (an eviction).

        Returns:
            ``drain_s`` (seconds spent draining) and ``num_unfinished`` (requests failed at the timeout).
        Raises:
            KeyError: no model called ``name``.
        """
        served = self.models[name]
        served.draining = True
        started = time.monotonic()
        while served.num_leases and time.monotonic() - started < drain_timeout_s:
            time.sleep(poll_s)  # a request routed before the drain began is about to be queued
        _, num_unfinished = drain_buckets(served.table.buckets, drain_timeout_s - (time.monotonic() - started), poll_s)
        drain_s = time.monotonic() - started  # the leases' wait included
        del self.models[name]
        if not forget:  # it may be loaded again: its tokenizer (and the router's encoder of it) stays
            keep_tokenizer(served.loaded.folder, served.loaded.tokenizer)
        self.weight_bytes.pop(name, None)
        for bucket in served.table.buckets:
            self.kv_pool_bytes.pop(bucket.key, None)
        if forget:
            self.config = self.config.model_copy(update={"models": [m for m in self.config.models if m.name != name]})
        del served
        release_memory(unfrozen_only)
        return {"drain_s": drain_s, "num_unfinished": num_unfinished}

    def load(self, model: ModelConfig, config: GatewayConfig, freeze: bool = True) -> ServedModel:
        """Load ``model`` (already validated as part of ``config``, the effective config with it)
        and start serving it; with ``freeze``, its objects frozen with the heap
        (:func:`~models.cpu_memory.freeze_long_lived_objects`: full collections skip them; a
        model that may be evicted is not frozen, so its cycles are collected when it goes).
        Blocking (seconds): call it off the event loop.

        Raises:
            ConfigError: its KV pools do not fit the slices' budgets.
        """
        self._check_budgets(config, resident={*self.models, model.name})
        served = self._load(model, config)
        if freeze:
            freeze_long_lived_objects()  # as the app does after start: full collections skip this model
        self.models[model.name] = served
        self.config = config
        return served

    def replace_layout(self, name: str, model: ModelConfig, config: GatewayConfig) -> list[Bucket]:
        """Serve model ``name`` through new buckets built from ``model.buckets``: the new table is
        swapped in at once for new requests; the old buckets are closed and returned, still
        running what they admitted (drain them with :func:`drain_buckets`). A new bucket with an
        old one's name carries its cumulative counters over (:meth:`Bucket.stats`). Blocking (KV pools
        are allocated): call it off the event loop.

        Raises:
            ConfigError: the new KV pools, beside the old ones while they drain, do not fit the
                slices' budgets.
        """
        served = self.models[name]
        self._check_budgets(config, served.table.buckets)
        buckets = self._buckets(model, served.loaded, served.layout_no + 1)
        served.layout_no += 1
        old = served.table.buckets
        replaced = {b.name: b for b in old}
        for bucket in buckets:
            bucket.predecessor = replaced.get(bucket.name)  # a name kept keeps its counters
        served.table = BucketTable(buckets)  # one reference swap: routing sees old or new, whole
        for bucket in old:
            bucket.close()
        served.config = model
        self.config = config
        return old

    def rebuild_bucket(self, name: str, bucket_name: str) -> tuple[Bucket, Bucket]:
        """Serve bucket ``bucket_name`` of model ``name`` through a new bucket built from the same
        config (its backend chosen again, a gate record written since counting, and built now),
        swapped into the table at once (one reference assignment); the old bucket is closed, still
        running what it admitted (retire it with :meth:`retire`), and the new one carries its
        cumulative counters over (:meth:`Bucket.stats`). Blocking (a backend is built and
        warmed): call it off the event loop.

        Returns:
            ``(old bucket, new bucket)``.
        Raises:
            KeyError: no such model or bucket.
            ConfigError: the new KV pool, beside the old one while it drains (and those of
                buckets still retiring), goes over a slice's ``memory_budget_bytes``; nothing
                changes then.
        """
        served = self.models[name]
        old = served.table.by_name(bucket_name)
        if old is None:
            raise KeyError(bucket_name)
        config = next(b for b in served.config.buckets if b.bucket_name == bucket_name)
        self._check_budgets(self.config, [old])
        new = self._bucket(served.config, served.loaded, config, served.layout_no + 1, defer_build=False)
        new.predecessor = old  # its counters carry over
        served.layout_no += 1
        served.table = BucketTable([new if b is old else b for b in served.table.buckets])
        old.close()
        return old, new

    def update_bucket(self, name: str, bucket_name: str, model: ModelConfig, config: GatewayConfig) -> None:
        """Apply the knobs of bucket ``bucket_name`` in ``model`` to the running bucket, from its
        next step or batch (queue limits from the next request).

        Raises:
            ValueError: a knob that cannot change for a running bucket differs (``block_size``).
        """
        served = self.models[name]
        bucket = served.table.by_name(bucket_name)
        if bucket is None:
            raise KeyError(bucket_name)
        new = next(b for b in model.buckets if b.bucket_name == bucket_name)
        bucket.update_settings(build.batcher_settings(new, build.lora_slots(model)))
        bucket.set_queue_limits(new.max_queue_len, new.max_queued_tokens, new.batcher.fair_share)
        served.config = model
        self.config = config

    def retire(self, buckets: list[Bucket], timeout_s: float) -> threading.Thread:
        """Drain closed ``buckets`` on a background thread (:func:`drain_buckets`), then free their
        KV pools. :attr:`retiring` lists them until they are gone."""
        self.retiring.extend(buckets)

        def run() -> None:
            drain_s, num_unfinished = drain_buckets(buckets, timeout_s)
            for retired in buckets:
                self.retiring.remove(retired)
                self.kv_pool_bytes.pop(retired.key, None)
            buckets.clear()
            release_memory()
            log.info("buckets_retired", drain_s=round(drain_s, 3), num_unfinished=num_unfinished)

        thread = threading.Thread(target=run, name="retire-buckets", daemon=True)
        thread.start()
        return thread

    def _worker_args(self, slice_name: str) -> tuple[Any, ...]:
        """What slice ``slice_name``'s worker process is started with: the effective config
        (plain JSON data), the slice's name and the gateway's log level."""
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        return self.config.model_dump(mode="json"), slice_name, level

    def _check_budgets(
        self, config: GatewayConfig, replaced: Sequence[Bucket] = (), resident: set[str] | None = None
    ) -> None:
        """Split the slices' KV memory for ``config`` and check their memory budgets with the
        weights loaded so far and the pools still allocated beside the new ones (``replaced``,
        the buckets a change is about to close, and those still retiring), counting the models
        loaded here (or ``resident``); keep the split.

        Raises:
            ConfigError: the KV pools, with the weights, do not fit a slice's budgets.
        """
        kv_memory_bytes = memory.split_kv_memory(config, build.slice_kv_budgets(config))
        memory.check_slice_budgets(
            config, kv_memory_bytes, self.weight_bytes, self._draining_kv_bytes(replaced),
            resident=set(self.models) if resident is None else resident,
        )
        self.kv_memory_bytes = kv_memory_bytes

    def draining_kv_bytes(self) -> dict[str, int]:
        """KV pool bytes per slice name of the buckets still retiring after a layout change."""
        return self._draining_kv_bytes()

    def _draining_kv_bytes(self, replaced: Sequence[Bucket] = ()) -> dict[str, int]:
        """KV pool bytes per slice name of the buckets still retiring and of ``replaced``."""
        draining: dict[str, int] = {}
        for key in {b.key for b in [*self.retiring, *replaced]}:
            slice_name, pool_bytes = self.kv_pool_bytes.get(key, ("", 0))
            draining[slice_name] = draining.get(slice_name, 0) + pool_bytes
        return draining

    def weights_device(self, config: ModelConfig) -> str:
        """The device ``config``'s weights load on here: the first of its slices that runs in
        this process (``cpu`` when none does)."""
        return next((self.slices[b.slice].device for b in config.buckets if self.slices[b.slice].needs_weights), "cpu")

    def _needs_weights(self, config: ModelConfig) -> bool:
        """Whether a bucket of ``config`` runs in this process (on a slice that needs weights)."""
        return any(self.slices[b.slice].needs_weights for b in config.buckets)

    def _load(self, config: ModelConfig, gateway_config: GatewayConfig | None = None) -> ServedModel:
        """Load a model, check the slices' memory budgets with its weights, build its buckets.
        A model whose buckets all run in worker processes loads without weights (a tokenizer,
        its config and KV geometry): each worker loads its own.

        Raises:
            ConfigError: its weights and KV pools do not fit a slice's ``memory_budget_bytes``
                (the model is dropped again).
        """
        weights = self._needs_weights(config)
        device = self.weights_device(config)
        loaded = load_model(config.name, config.source, config.task, config.dtype, device, self.cache_dir, weights=weights)
        model_weight_bytes = memory.weight_bytes(loaded.model) if weights else None
        log.info(
            "model_loaded", model=config.name, folder=str(loaded.folder), load_s=round(loaded.load_s, 3),
            weight_bytes=model_weight_bytes,  # None: loaded without weights (its buckets run in worker processes)
        )
        all_weights = self.weight_bytes if model_weight_bytes is None else {**self.weight_bytes, config.name: model_weight_bytes}
        try:
            memory.check_slice_budgets(
                gateway_config or self.config, self.kv_memory_bytes, all_weights, self._draining_kv_bytes(),
                resident={*self.models, config.name},
            )
        except ConfigError:
            loaded = None  # type: ignore[assignment]  # drop the weights: the traceback keeps this frame
            release_memory()
            raise
        self.weight_bytes = all_weights
        if config.task == "generate" and config.load == "at_start":  # on demand: the first constrained request builds it
            threading.Thread(target=_build_grammar_tokenizer, args=(config.name, loaded.tokenizer), daemon=True).start()
        buckets = self._buckets(config, loaded)
        return ServedModel(config=config, loaded=loaded, table=BucketTable(buckets), request_observers=self.request_observers)

    def _buckets(self, config: ModelConfig, loaded: LoadedModel, layout_no: int = 0) -> list[Bucket]:
        """Build ``config``'s buckets (its ``layout_no``-th layout) on ``loaded``, attached to their
        slices, and hand each to the bucket hooks (before any request can reach it)."""
        return [self._bucket(config, loaded, b, layout_no) for b in config.buckets]

    def _bucket(
        self, model: ModelConfig, loaded: LoadedModel, config: BucketConfig, layout_no: int, defer_build: bool = True
    ) -> Bucket:
        """Build bucket ``config`` of ``model`` on its slice and hand it to the bucket hooks; with
        ``defer_build`` off, its gate record's backend is built now even when gates are deferred."""
        builder = BucketBuilder(
            self.cache_dir, self.config.gate, self.kv_memory_bytes, self.defer_gates, self.defer_gates and defer_build
        )
        bucket = builder.bucket(model, loaded, config, self.slices[config.slice], layout_no)
        self.kv_pool_bytes[bucket.key] = (config.slice, self.kv_memory_bytes.get((model.name, config.bucket_name), 0))
        for hook in self.bucket_hooks:
            hook(model.name, bucket)
        return bucket


def _build_grammar_tokenizer(model: str, tokenizer: Any) -> None:
    """Build llguidance's view of ``tokenizer`` (0.25-0.95 s for SmolLM2's) beside the start, so
    neither the start nor the first constrained request waits for it (a request that comes
    first builds it itself, under the cache's lock)."""
    started = time.perf_counter()
    structured.cache_for(tokenizer)
    log.info("grammar_tokenizer_built", model=model, duration_s=round(time.perf_counter() - started, 3))
