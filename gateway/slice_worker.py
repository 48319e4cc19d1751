"""Slices with ``isolation: process``: the gateway's side (a :class:`ProcessSlice` and remote
buckets) and the worker process's entry point, which builds the slice's buckets with the same
:class:`~gateway.engine.Engine` code as the gateway and serves them (:class:`SliceHost`).

The gateway process still loads every model it serves (it tokenizes, and routes by the KV
capacity of each bucket), but allocates no KV pool and builds no runner for a process slice's
buckets; the worker loads its models and builds their runners, KV pools and batchers.
"""

from __future__ import annotations

import logging
import os
import signal
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import structlog

from buckets.bucket import Bucket
from buckets.device_slice import DeviceSlice
from buckets.process_slice import ProcessSlice
from buckets.remote_batcher import RemoteBatcher
from gateway.config import BucketConfig, ContinuousBatcherConfig, GatewayConfig, ModelConfig, SliceConfig

if TYPE_CHECKING:
    from gateway.engine import Engine
    from models.loader import LoadedModel

log = structlog.get_logger(__name__)


def make_slice(config: SliceConfig, engine: Engine) -> DeviceSlice | ProcessSlice:
    """The slice ``config`` describes: a worker thread, or a worker process whose arguments are
    read from ``engine``'s config at each (re)start."""
    if config.isolation == "process":
        return ProcessSlice(config.name, config.device, config.num_threads, run_slice_worker, lambda: worker_args(engine, config.name))
    return DeviceSlice(config.name, config.device, config.num_threads, config.max_consecutive_steps)


def worker_args(engine: Engine, slice_name: str) -> tuple[Any, ...]:
    """What a slice's worker process is started with: the effective config (plain JSON data),
    the slice's name and the gateway's log level."""
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    return engine.config.model_dump(mode="json"), slice_name, level


def remote_bucket(
    model: ModelConfig,
    loaded: LoadedModel,
    config: BucketConfig,
    device_slice: ProcessSlice,
    kv_memory_bytes: dict[tuple[str, str], int],
) -> Bucket:
    """Bucket ``config`` of ``model`` on process slice ``device_slice``: its batcher is a
    :class:`RemoteBatcher`; its KV capacity is computed as the worker's will be."""
    from gateway.engine import continuous_settings, dynamic_settings, kv_num_blocks

    info: dict[str, Any] = {"configured": config.backend, "isolation": "process"}
    key = (model.name, config.bucket_name)
    max_seq_tokens = None
    if isinstance(config.batcher, ContinuousBatcherConfig):
        settings: Any = continuous_settings(config.batcher)
        max_seq_tokens = kv_num_blocks(model, loaded, config, kv_memory_bytes) * config.batcher.block_size
    else:
        settings = dynamic_settings(config.batcher)
    batcher = RemoteBatcher(key, config.batcher.kind, device_slice, settings, info)
    return Bucket(
        config.bucket_name, model.name, config.max_input_tokens, batcher, device_slice, max_seq_tokens,  # type: ignore[arg-type]
        max_queue_len=config.max_queue_len, max_queued_tokens=config.max_queued_tokens, backend_info=info,
    )


def worker_config(config: GatewayConfig, slice_name: str) -> GatewayConfig:
    """``config`` cut down to what slice ``slice_name``'s worker runs: that slice (as a thread
    slice of the worker) and the models with buckets on it, with those buckets alone. Each
    bucket's share of the slice's KV memory stays what it is in the whole config."""
    the_slice = next(s for s in config.slices if s.name == slice_name)
    if the_slice.device.startswith("MIG-"):  # the worker sees only its MIG instance, as cuda:0
        the_slice = the_slice.model_copy(update={"device": "cuda:0"})
    models = []
    for model in config.models:
        buckets = [b for b in model.buckets if b.slice == slice_name]
        if buckets:
            models.append(model.model_copy(update={"buckets": buckets}))
    data = config.model_dump(mode="json")
    data["slices"] = [the_slice.model_copy(update={"isolation": "thread"}).model_dump(mode="json")]
    data["models"] = [m.model_dump(mode="json") for m in models]
    return GatewayConfig.model_validate(data)


def run_slice_worker(conn: Connection, config_data: dict[str, Any], slice_name: str, log_level: str) -> None:
    """A slice worker process's main: load the slice's models, build their buckets, serve them
    over ``conn`` until the gateway says stop or goes away, then fail what is left."""
    from buckets.slice_host import SliceHost
    from gateway.engine import Engine
    from gateway.logging import configure_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group; the gateway stops us
    device = next(s["device"] for s in config_data["slices"] if s["name"] == slice_name)
    if device.startswith("MIG-"):  # before CUDA starts in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = device
    configure_logging(log_level)
    structlog.contextvars.bind_contextvars(slice_worker=slice_name)
    engine = Engine(worker_config(GatewayConfig.model_validate(config_data), slice_name))
    engine.start()
    buckets = [(name, b) for name, served in engine.models.items() for b in served.table.buckets]
    host = SliceHost(
        conn,
        engine.slices[slice_name],  # type: ignore[arg-type]
        {(name, b.name): b.batcher for name, b in buckets},
        {(name, b.name): dict(b.backend_info) for name, b in buckets},
    )
    log.info("slice_worker_ready", slice=slice_name, buckets=[f"{name}/{b.name}" for name, b in buckets])
    try:
        host.serve()
    finally:
        engine.stop()
        host.close()
