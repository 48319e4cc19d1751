"""Slices, buckets and runners from plain config values: the one place a bucket is built.

The gateway's :class:`~gateway.engine.Engine` and a slice worker process (which runs an engine
over its cut of the config, :mod:`gateway.slice_worker`) build every bucket here, so a bucket's
KV pool and its KV capacity in tokens come out the same on both sides of a process slice.
Which parts are built in this process is the slice's decision (:class:`BucketSpec`): a local
slice calls the spec's factory, which loads the backend and allocates the KV pool; a process
slice never does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from buckets.batcher import Batcher
from buckets.bucket import Bucket
from buckets.continuous import ContinuousBatcher
from buckets.dynamic import DynamicBatcher
from buckets.settings import ContinuousBatcherSettings, DynamicBatcherSettings
from buckets.slices import kinds
from buckets.slices.kinds import SliceOptions
from buckets.slices.ray_actor import RayPlacement
from buckets.slices.slice import BatcherSettings, BucketSpec, Slice
from gateway import memory, runners
from gateway.config import (
    BucketConfig,
    ContinuousBatcherConfig,
    DynamicBatcherConfig,
    GateConfig,
    GatewayConfig,
    ModelConfig,
    RayConfig,
    RayResourcesConfig,
    SliceConfig,
)
from gateway.errors import ConfigError
from models.encoder import EmbeddingRunner
from models.loader import LoadedModel
from models.source import default_cache_dir

log = structlog.get_logger(__name__)

# A slice worker process's main, ``worker_main(conn, *worker_args())`` (gateway.slice_worker).
WorkerMain = Callable[..., None]


def cache_dir(config: GatewayConfig) -> Path:
    """The folder for converted models and gate records: the config's ``cache_dir``, else the default."""
    return Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()


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


def device_memory_bytes(config: GatewayConfig) -> dict[str, int]:
    """Total memory in bytes of each ``cuda:N`` device a slice without ``kv_cache_memory_bytes``
    runs on (what :func:`gateway.memory.slice_kv_budgets` takes its default share of)."""
    devices = {s.device for s in config.slices if s.device.startswith("cuda") and not s.kv_cache_memory_bytes}
    if not devices:
        return {}
    import torch

    return {device: int(torch.cuda.get_device_properties(device).total_memory) for device in devices}


def slice_kv_budgets(config: GatewayConfig) -> dict[str, int]:
    """Each slice's KV budget in bytes (:func:`gateway.memory.slice_kv_budgets` on this machine)."""
    return memory.slice_kv_budgets(config, device_memory_bytes(config))


def make_slice(
    config: SliceConfig, worker_main: WorkerMain | None, worker_args: Callable[[], tuple[Any, ...]],
    ray: RayConfig | None = None,
) -> Slice:
    """The slice ``config`` describes, of the kind its ``isolation`` names
    (:data:`buckets.slices.kinds.SLICE_KINDS`); one whose worker runs elsewhere runs
    ``worker_main(conn, *worker_args())`` there (``worker_args`` is called at each (re)start);
    a Ray slice's actors run on the cluster ``ray`` names.

    Raises:
        ValueError: a process or Ray slice and no ``worker_main`` to run in it.
    """
    options = SliceOptions(
        config.name, config.device, config.num_threads, config.max_consecutive_steps, worker_main, worker_args,
        ray_placement(config, ray),
    )
    return kinds.make_slice(config.isolation, options)


def ray_placement(config: SliceConfig, ray: RayConfig | None) -> RayPlacement | None:
    """Where slice ``config``'s Ray actors run (``None`` unless it has ``isolation: ray``)."""
    if config.isolation != "ray" or ray is None:
        return None
    resources = config.resources or RayResourcesConfig()
    return RayPlacement(
        ray.address, resources.num_cpus, resources.num_gpus, dict(resources.custom), resources.node_id,
        config.replicas, config.placement_strategy, ray.namespace, ray.detached,
    )


def lora_slots(model: ModelConfig) -> int:
    """The adapter slots of ``model``'s continuous buckets: its ``lora.max_loras`` (0 without ``lora``)."""
    return model.lora.max_loras if model.lora is not None else 0


def continuous_settings(config: ContinuousBatcherConfig, max_loras: int = 0) -> ContinuousBatcherSettings:
    return ContinuousBatcherSettings(
        config.max_num_seqs, config.max_num_batched_tokens, config.block_size, config.enable_prefix_caching,
        config.priority_aging_s, config.chunked_prefill, config.tpot_target_ms, max_loras, config.preemption,
        int(config.swap_space_bytes), config.fair_share, config.max_starvation_s,
    )


def dynamic_settings(config: DynamicBatcherConfig) -> DynamicBatcherSettings:
    return DynamicBatcherSettings(
        config.max_batch_size, config.max_queue_delay_ms, config.priority_aging_s, config.fair_share, config.max_starvation_s
    )


def batcher_settings(config: BucketConfig, max_loras: int = 0) -> BatcherSettings:
    """The frozen settings of bucket ``config``'s batcher (``max_loras``: its model's :func:`lora_slots`)."""
    knobs = config.batcher
    return continuous_settings(knobs, max_loras) if isinstance(knobs, ContinuousBatcherConfig) else dynamic_settings(knobs)


@dataclass(frozen=True)
class BucketBuilder:
    """Builds buckets from config values: ``cache_dir`` (converted models, gate records),
    ``gate`` (the backend gate's settings), ``kv_memory_bytes`` (each continuous bucket's KV
    pool in bytes, from :func:`gateway.memory.split_kv_memory` over the whole config) and
    ``defer_gates`` (an ``auto`` bucket without a current gate record runs eager, its gate
    ``pending`` for :mod:`gateway.background_gates`; else it is gated while it is built) and
    ``defer_builds`` (an ``auto`` bucket whose current record enables a backend other than eager
    runs eager, ``building``, for the gate thread to build that backend; else it is built now)."""

    cache_dir: Path
    gate: GateConfig
    kv_memory_bytes: dict[memory.BucketName, int]
    defer_gates: bool = False
    defer_builds: bool = False

    def bucket(
        self, model: ModelConfig, loaded: LoadedModel, config: BucketConfig, device_slice: Slice, layout_no: int = 0
    ) -> Bucket:
        """Bucket ``config`` of ``model`` in the model's ``layout_no``-th bucket layout, attached
        to ``device_slice`` (which builds its batcher now when it runs in this process: KV pool,
        backend, gate; slow). ``loaded`` needs its weights only then.

        Raises:
            ConfigError: its KV share holds no block.
        """
        info: dict[str, Any] = {"configured": config.backend, "isolation": device_slice.isolation}
        settings = batcher_settings(config, lora_slots(model))
        kv_capacity_tokens = None
        make_batcher: Callable[[], Batcher]
        if isinstance(config.batcher, ContinuousBatcherConfig):
            kv_dtype = runners.kv_cache_dtype(self.cache_dir, self.gate, model, loaded, config, device_slice.num_threads, info)
            num_blocks = self._kv_num_blocks(model, loaded, config, kv_dtype)
            kv_capacity_tokens = memory.kv_capacity_tokens(num_blocks, config.batcher.block_size)
            make_batcher = lambda: self._continuous(model, loaded, config, num_blocks, device_slice.num_threads, info, kv_dtype)  # noqa: E731
        else:
            make_batcher = lambda: self._dynamic(model, loaded, config, device_slice.num_threads, info)  # noqa: E731
        bucket = Bucket(
            config.bucket_name, model.name, config.max_input_tokens, device_slice, config.batcher.kind, kv_capacity_tokens,
            max_queue_len=config.max_queue_len, max_queued_tokens=config.max_queued_tokens, layout_no=layout_no,
            fair_share=config.batcher.fair_share,
        )
        device_slice.attach(bucket.key, BucketSpec(config.batcher.kind, settings, make_batcher, info))
        return bucket

    def _kv_num_blocks(self, model: ModelConfig, loaded: LoadedModel, config: BucketConfig, kv_dtype: str | None) -> int:
        block_size = config.batcher.block_size  # type: ignore[union-attr]
        bytes_per_token = loaded.kv_shape().bytes_per_token_for(kv_dtype, loaded.dtype_bytes)
        where = f"models.{model.name}.buckets.{config.bucket_name}"
        return memory.kv_num_blocks(self.kv_memory_bytes[(model.name, config.bucket_name)], block_size, bytes_per_token, where)

    def _backend_label(
        self, model: ModelConfig, loaded: LoadedModel, config: BucketConfig, num_threads: int, info: dict[str, Any]
    ) -> str:
        return runners.backend_label(
            self.cache_dir, self.gate, model, loaded, config, num_threads, info, self.defer_gates, self.defer_builds,
        )

    def _continuous(
        self, model: ModelConfig, loaded: LoadedModel, config: BucketConfig, num_blocks: int, num_threads: int, info: dict[str, Any],
        kv_dtype: str | None = None,
    ) -> ContinuousBatcher:
        """The bucket's continuous batcher: its backend (gated when ``auto``) over a KV pool of
        ``num_blocks`` blocks of ``kv_dtype`` (None: the model's dtype)."""
        knobs: ContinuousBatcherConfig = config.batcher  # type: ignore[assignment]
        label = self._backend_label(model, loaded, config, num_threads, info)
        runner = runners.causal_lm_runner(loaded, num_blocks, knobs.block_size, label, config, info, kv_dtype, model.lora)
        log.info(
            "kv_pool_allocated", model=model.name, bucket=config.bucket_name, num_blocks=num_blocks,
            block_size=knobs.block_size, kv_cache_bytes=runner.kv_cache.nbytes, num_host_blocks=runner.kv_cache.num_host_blocks,
        )
        if knobs.preemption != "recompute" and runner.kv_cache.num_host_blocks == 0:
            log.warning(
                "swap_space_holds_no_block", model=model.name, bucket=config.bucket_name, swap_space_bytes=int(knobs.swap_space_bytes),
                bytes_per_block=runner.kv_cache.bytes_per_block, running="recompute",
            )
        swap_costs = runners.swap_costs(runner, info) if knobs.preemption == "auto" else None
        return ContinuousBatcher(
            runner, continuous_settings(knobs, lora_slots(model)), loaded.tokenizer, loaded.eos_token_ids, swap_costs=swap_costs,
        )

    def _dynamic(
        self, model: ModelConfig, loaded: LoadedModel, config: BucketConfig, num_threads: int, info: dict[str, Any]
    ) -> DynamicBatcher:
        """The bucket's dynamic batcher over its encoder backend (gated when ``auto``)."""
        label = self._backend_label(model, loaded, config, num_threads, info)
        backend = runners.encoder_backend(self.cache_dir, model, loaded, config, label, num_threads, info)
        runner = EmbeddingRunner(backend, loaded.tokenizer.pad_token_id or 0, loaded.device, loaded.folder)
        return DynamicBatcher(runner, dynamic_settings(config.batcher))  # type: ignore[arg-type]
