"""Building and running what a config describes: slices, loaded models, bucket tables."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable
from pathlib import Path

import structlog

from buckets.bucket import Bucket, BucketTable
from buckets.continuous import ContinuousBatcher
from buckets.device_slice import DeviceSlice
from buckets.process_slice import ProcessSlice
from buckets.dynamic import DynamicBatcher
from buckets.settings import ContinuousBatcherSettings, DynamicBatcherSettings
from buckets.request import Request
from gateway import runners
from gateway.errors import ConfigError
from gateway.logging import log_request_finished
from gateway.slice_worker import make_slice, remote_bucket
from gateway.config import BucketConfig, ContinuousBatcherConfig, DynamicBatcherConfig, GatewayConfig, ModelConfig
from models.cpu_memory import release_memory
from models.loader import LoadedModel, load_model
from models.source import default_cache_dir

log = structlog.get_logger(__name__)

RequestObserver = Callable[[str, Request, int, str], None]
# Called with (model name, bucket) for every bucket built, before it takes requests.
BucketHook = Callable[[str, Bucket], None]

DEFAULT_CPU_KV_CACHE_MEMORY_BYTES = 2 * 1024**3
DEFAULT_GPU_KV_CACHE_MEMORY_FRACTION = 0.5


def default_kv_cache_memory_bytes(device: str) -> int:
    """A slice's KV budget when its config sets none: 2 GiB on a CPU, half the GPU's memory."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory * DEFAULT_GPU_KV_CACHE_MEMORY_FRACTION)
    return DEFAULT_CPU_KV_CACHE_MEMORY_BYTES


def split_kv_memory(config: GatewayConfig, slice_budgets: dict[str, int]) -> dict[tuple[str, str], int]:
    """Each continuous bucket's KV pool in bytes, keyed by ``(model name, bucket name)``.

    On each slice, explicit ``kv_cache_memory_bytes`` come first, then fractions of the slice's
    budget; buckets with neither share what is left equally.

    Raises:
        ConfigError: a slice's buckets ask for more than its budget.
    """
    shares: dict[tuple[str, str], int] = {}
    for slice_name, budget in slice_budgets.items():
        owners = [(m.name, b) for m in config.models for b in m.buckets if b in config.continuous_buckets(slice_name)]
        fixed = {
            (name, b.bucket_name): int(b.batcher.kv_cache_memory_bytes or budget * (b.batcher.kv_cache_memory_fraction or 0))
            for name, b in owners
            if b.batcher.kv_cache_memory_bytes or b.batcher.kv_cache_memory_fraction  # type: ignore[union-attr]
        }
        left = budget - sum(fixed.values())
        rest = [(name, b.bucket_name) for name, b in owners if (name, b.bucket_name) not in fixed]
        if left < 0 or (rest and left == 0):
            index = [s.name for s in config.slices].index(slice_name)
            param = f"slices.{index}.kv_cache_memory_bytes"
            raise ConfigError(
                f"{param}: the continuous buckets of slice {slice_name!r} ask for "
                f"{sum(fixed.values())} bytes of KV memory, its kv_cache_memory_bytes is {budget}",
                param=param,
                code="kv_cache_memory_exceeded",
            )
        shares.update(fixed)
        shares.update({key: left // len(rest) for key in rest})
    return shares


def kv_num_blocks(
    model: ModelConfig, loaded: LoadedModel, config: BucketConfig, kv_memory_bytes: dict[tuple[str, str], int]
) -> int:
    """The KV blocks of continuous bucket ``config`` of ``model``: its share of its slice's KV memory
    (:func:`split_kv_memory`) in blocks of its ``block_size`` tokens.

    Raises:
        ConfigError: the share holds no block.
    """
    block_size = config.batcher.block_size  # type: ignore[union-attr]
    memory_bytes = kv_memory_bytes[(model.name, config.bucket_name)]
    num_blocks = int(loaded.kv_shape().num_blocks_for(memory_bytes, block_size, loaded.dtype_bytes))
    if num_blocks < 1:
        raise ConfigError(
            f"models.{model.name}.buckets.{config.bucket_name}: {memory_bytes} bytes of KV memory hold no "
            f"block of {block_size} tokens",
            code="kv_cache_memory_exceeded",
        )
    return num_blocks


def check_devices(config: GatewayConfig) -> None:
    """Every ``cuda:N`` slice names a device torch can see.

    Raises:
        ConfigError: naming the slice's ``device`` path and what torch sees.
    """
    for index, slice_config in enumerate(config.slices):
        if not slice_config.device.startswith("cuda:"):
            continue
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(slice_config.device.split(":")[1]) >= count:
            raise ConfigError(
                f"slices.{index}.device: {slice_config.device} is not a CUDA device torch can use here "
                f"(torch {torch.__version__} sees {count})"
            )


def weight_bytes(model: Any) -> int:
    """Bytes held by a module's parameters and buffers (its weights, as loaded)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def check_slice_budgets(config: GatewayConfig, kv_bytes: dict[tuple[str, str], int], weights: dict[str, int]) -> None:
    """Every slice with a ``memory_budget_bytes`` holds the weights of the models with a bucket
    on it (those in ``weights``: loaded so far) plus the KV pools of its continuous buckets.

    Raises:
        ConfigError: naming the slice, its weights and KV bytes, and its budget.
    """
    for index, slice_config in enumerate(config.slices):
        budget = slice_config.memory_budget_bytes
        if budget is None:
            continue
        models = [m.name for m in config.models if any(b.slice == slice_config.name for b in m.buckets)]
        weights_total = sum(weights.get(name, 0) for name in models)
        kv_total = sum(
            kv_bytes.get((m.name, b.bucket_name), 0) for m in config.models for b in config.continuous_buckets(slice_config.name)
            if b in m.buckets
        )
        if weights_total + kv_total > budget:
            loaded = ", ".join(f"{name} {weights[name]}" for name in models if name in weights)
            pending = [name for name in models if name not in weights]
            if pending:
                loaded += f"; not yet loaded, so not counted: {', '.join(pending)}"
            param = f"slices.{index}.memory_budget_bytes"
            raise ConfigError(
                f"{param}: slice {slice_config.name!r} needs {weights_total + kv_total} bytes "
                f"(weights {weights_total}: {loaded or 'none loaded'}; KV pools {kv_total}), over its budget of {int(budget)}",
                param=param,
                code="memory_budget_exceeded",
            )


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
    # Called with (model name, request, completion tokens, outcome) once per finished request.
    request_observers: list[RequestObserver] = field(default_factory=list)

    def finish(self, request: Request, completion_tokens: int, outcome: str) -> None:
        """Log a finished request once and hand it to the observers (metrics, dashboards)."""
        log_request_finished(self.config.name, request, completion_tokens, outcome)
        for observer in self.request_observers:
            observer(self.config.name, request, completion_tokens, outcome)

    @property
    def state(self) -> str:
        return "draining" if self.draining else "ready"

    def is_idle(self) -> bool:
        """No request queued or running in any of its buckets (admission tickets included)."""
        return all(bucket.is_idle() for bucket in self.table.buckets)


def continuous_settings(config: ContinuousBatcherConfig) -> ContinuousBatcherSettings:
    return ContinuousBatcherSettings(
        config.max_num_seqs, config.max_num_batched_tokens, config.block_size, config.enable_prefix_caching,
        config.priority_aging_s,
    )


def dynamic_settings(config: DynamicBatcherConfig) -> DynamicBatcherSettings:
    return DynamicBatcherSettings(config.max_batch_size, config.max_queue_delay_ms, config.priority_aging_s)


def drain_buckets(buckets: list[Bucket], timeout_s: float, poll_s: float = 0.02) -> tuple[float, int]:
    """Wait until ``buckets`` (closed or draining: taking no new requests) are idle, for at most
    ``timeout_s``; then take their batchers off their slices and fail what is left.
    Returns ``(seconds waited, requests failed)``."""
    started = time.monotonic()
    while not all(b.is_idle() for b in buckets) and time.monotonic() - started < timeout_s:
        time.sleep(poll_s)
    drain_s = time.monotonic() - started
    num_unfinished = 0
    for bucket in buckets:
        stats = bucket.batcher.stats()
        num_unfinished += stats.num_waiting + stats.num_running
        bucket.device_slice.detach(bucket.batcher)
        bucket.batcher.shutdown()
    return drain_s, num_unfinished


class Engine:
    """Owns the device slices and served models of one gateway process.

    :meth:`start` loads every model (slow: seconds) and starts the slice workers; call it off the
    event loop. :meth:`stop` stops the workers and fails whatever is still queued.
    """

    def __init__(self, config: GatewayConfig):
        check_devices(config)
        self.config = config
        self.cache_dir = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()
        self.slices: dict[str, DeviceSlice | ProcessSlice] = {s.name: make_slice(s, self) for s in config.slices}
        self.models: dict[str, ServedModel] = {}
        self.request_observers: list[RequestObserver] = []
        self.retiring: list[Bucket] = []  # closed buckets still draining after a layout change
        self.bucket_hooks: list[BucketHook] = []
        self.kv_memory_bytes = split_kv_memory(config, self._slice_budgets())
        self.weight_bytes: dict[str, int] = {}  # per loaded model, for the slices' memory budgets

    def start(self) -> None:
        for model_config in self.config.models:
            self.models[model_config.name] = self._load(model_config)
        for device_slice in self.slices.values():
            device_slice.start()

    def stop(self) -> None:
        for model in self.models.values():
            model.draining = True
        for device_slice in self.slices.values():
            device_slice.stop()

    def unload(self, name: str, drain_timeout_s: float, poll_s: float = 0.02) -> dict[str, float | int]:
        """Drain model ``name`` and free it. Blocking: call it off the event loop.

        New requests get 503 at once; those already admitted run to the end, for at most
        ``drain_timeout_s`` seconds, after which the rest fail (:class:`ShuttingDownError`).
        Then its batchers leave their slices and the model, its KV pools and its tokenizer are
        dropped (``gc.collect``, and glibc's ``malloc_trim`` so the heap shrinks).

        Returns:
            ``drain_s`` (seconds spent draining) and ``num_unfinished`` (requests failed at the timeout).
        Raises:
            KeyError: no model called ``name``.
        """
        served = self.models[name]
        served.draining = True
        drain_s, num_unfinished = drain_buckets(served.table.buckets, drain_timeout_s, poll_s)
        del self.models[name]
        self.weight_bytes.pop(name, None)
        self.config = self.config.model_copy(update={"models": [m for m in self.config.models if m.name != name]})
        del served
        release_memory()
        return {"drain_s": drain_s, "num_unfinished": num_unfinished}

    def load(self, model: ModelConfig, config: GatewayConfig) -> ServedModel:
        """Load ``model`` (already validated as part of ``config``, the effective config with it)
        and start serving it. Blocking (seconds): call it off the event loop.

        Raises:
            ConfigError: its KV pools do not fit the slices' budgets.
        """
        kv_memory_bytes = split_kv_memory(config, self._slice_budgets())
        check_slice_budgets(config, kv_memory_bytes, self.weight_bytes)
        self.kv_memory_bytes = kv_memory_bytes
        served = self._load(model, config)
        self.models[model.name] = served
        self.config = config
        return served

    def replace_layout(self, name: str, model: ModelConfig, config: GatewayConfig) -> list[Bucket]:
        """Serve model ``name`` through new buckets built from ``model.buckets``: the new table is
        swapped in at once for new requests; the old buckets are closed and returned, still
        running what they admitted (drain them with :func:`drain_buckets`). Blocking (KV pools
        are allocated): call it off the event loop.

        Raises:
            ConfigError: the new KV pools do not fit the slices' budgets.
        """
        served = self.models[name]
        kv_memory_bytes = split_kv_memory(config, self._slice_budgets())
        check_slice_budgets(config, kv_memory_bytes, self.weight_bytes)
        self.kv_memory_bytes = kv_memory_bytes
        buckets = self._buckets(model, served.loaded)
        old = served.table.buckets
        served.table = BucketTable(buckets)  # one reference swap: routing sees old or new, whole
        for bucket in old:
            bucket.close()
        served.config = model
        self.config = config
        return old

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
        knobs = new.batcher
        settings = continuous_settings(knobs) if isinstance(knobs, ContinuousBatcherConfig) else dynamic_settings(knobs)
        bucket.batcher.update_settings(settings)
        bucket.set_queue_limits(new.max_queue_len, new.max_queued_tokens)
        bucket.device_slice.notify()
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
            buckets.clear()
            release_memory()
            log.info("buckets_retired", drain_s=round(drain_s, 3), num_unfinished=num_unfinished)

        thread = threading.Thread(target=run, name="retire-buckets", daemon=True)
        thread.start()
        return thread

    def _slice_budgets(self) -> dict[str, int]:
        return {
            s.name: int(s.kv_cache_memory_bytes or default_kv_cache_memory_bytes(s.device)) for s in self.config.slices
        }

    def _load(self, config: ModelConfig, gateway_config: GatewayConfig | None = None) -> ServedModel:
        """Load a model, check the slices' memory budgets with its weights, build its buckets.

        Raises:
            ConfigError: its weights and KV pools do not fit a slice's ``memory_budget_bytes``
                (the model is dropped again).
        """
        first_slice = self.slices[config.buckets[0].slice]
        # A process slice's worker holds the weights it runs; the gateway's copy (for the
        # tokenizer and the KV geometry) stays on the CPU.
        device = "cpu" if isinstance(first_slice, ProcessSlice) else first_slice.device
        loaded = load_model(config.name, config.source, config.task, config.dtype, device, self.cache_dir)
        log.info("model_loaded", model=config.name, folder=str(loaded.folder), load_s=round(loaded.load_s, 3))
        weights = {**self.weight_bytes, config.name: weight_bytes(loaded.model)}
        try:
            check_slice_budgets(gateway_config or self.config, self.kv_memory_bytes, weights)
        except ConfigError:
            loaded = None  # type: ignore[assignment]  # drop the weights: the traceback keeps this frame
            release_memory()
            raise
        self.weight_bytes = weights
        buckets = self._buckets(config, loaded)
        return ServedModel(config=config, loaded=loaded, table=BucketTable(buckets), request_observers=self.request_observers)

    def _buckets(self, config: ModelConfig, loaded: LoadedModel) -> list[Bucket]:
        """Build ``config``'s buckets on ``loaded`` and attach them to their slices."""
        buckets = [self._bucket(config, loaded, b) for b in config.buckets]
        for bucket in buckets:
            for hook in self.bucket_hooks:
                hook(config.name, bucket)
            bucket.device_slice.attach(bucket.batcher)
        return buckets

    def _bucket(self, model: ModelConfig, loaded: LoadedModel, config: BucketConfig) -> Bucket:
        device_slice = self.slices[config.slice]
        if isinstance(device_slice, ProcessSlice):
            return remote_bucket(model, loaded, config, device_slice, self.kv_memory_bytes)
        batcher: ContinuousBatcher | DynamicBatcher
        info: dict[str, Any] = {"configured": config.backend}
        if isinstance(config.batcher, ContinuousBatcherConfig):
            knobs = config.batcher
            settings = continuous_settings(knobs)
            num_blocks = kv_num_blocks(model, loaded, config, self.kv_memory_bytes)
            label = runners.backend_label(self, model, loaded, config, device_slice.num_threads, info)
            runner = runners.causal_lm_runner(loaded, num_blocks, knobs.block_size, label, config, info)
            batcher = ContinuousBatcher(runner, settings, loaded.tokenizer, loaded.eos_token_ids)
            log.info(
                "kv_pool_allocated", model=model.name, bucket=config.bucket_name, num_blocks=num_blocks,
                block_size=knobs.block_size, kv_cache_bytes=runner.kv_cache.nbytes,
            )
        else:
            from models.encoder import EmbeddingRunner

            label = runners.backend_label(self, model, loaded, config, device_slice.num_threads, info)
            backend = runners.encoder_backend(self, model, loaded, config, label, device_slice.num_threads, info)
            pad_id = loaded.tokenizer.pad_token_id or 0
            runner = EmbeddingRunner(backend, pad_id, loaded.device, loaded.folder)
            batcher = DynamicBatcher(runner, dynamic_settings(config.batcher))
        max_seq_tokens = batcher.kv_capacity_tokens if isinstance(batcher, ContinuousBatcher) else None
        return Bucket(
            config.bucket_name, model.name, config.max_input_tokens, batcher, device_slice, max_seq_tokens,
            max_queue_len=config.max_queue_len, max_queued_tokens=config.max_queued_tokens, backend_info=info,
        )
