"""A process slice's worker: its main, run in a process the gateway's
:class:`~buckets.slices.process.ProcessSlice` spawns (the gateway's app passes
:func:`run_slice_worker` to the engine as the process slices' target).

The worker runs an :class:`~gateway.engine.Engine` over its cut of the config (its slice, as a
thread slice, and the buckets placed on it): it loads those models with their weights and
builds their buckets with the same :mod:`gateway.build` code as the gateway, so both sides
agree on every bucket's KV capacity; then a :class:`~buckets.slices.host.SliceHost` serves
them over the pipe. The gateway loads only a tokenizer and the config of a model whose
buckets all run in worker processes. An ``auto`` bucket without a current gate record is built on
eager, its gate ``pending``: the gateway's background gates run it (in a child process) and
then have the worker rebuild the bucket (:func:`rebuild_bucket`).
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import structlog

from buckets.slices.host import SliceHost
from buckets.slices.slice import BucketKey
from gateway.config import GatewayConfig
from gateway.engine import Engine
from gateway.gate_process import lower_thread_priority, short_gil_switch_interval
from gateway.logging import configure_logging
from models.openmp import release_thread_pool

log = structlog.get_logger(__name__)


def visible_devices(device: str, isolation: str) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for the worker of a slice on ``device``: a process slice's worker
    sees its GPU alone (``cuda:N``: ``"N"``; a MIG instance: its UUID), as ``cuda:0``; ``None``
    (leave it as it is) on a CPU, or for a Ray actor, whose GPUs Ray assigns."""
    if isolation != "process" or device == "cpu":
        return None
    return device.removeprefix("cuda:")


def worker_config(config: GatewayConfig, slice_name: str) -> GatewayConfig:
    """``config`` cut down to what slice ``slice_name``'s worker runs: that slice (as a thread
    slice of the worker) and the models with buckets on it, with those buckets alone. Each
    bucket's share of the slice's KV memory stays what it is in the whole config. A process
    slice's GPU is the worker's ``cuda:0`` (:func:`visible_devices`)."""
    the_slice = next(s for s in config.slices if s.name == slice_name)
    if visible_devices(the_slice.device, the_slice.isolation) is not None:
        the_slice = the_slice.model_copy(update={"device": "cuda:0"})
    models = []
    for model in config.models:
        buckets = [b for b in model.buckets if b.slice == slice_name]
        if buckets:
            models.append(model.model_copy(update={"buckets": buckets}))
    data = config.model_dump(mode="json")
    local = {"isolation": "thread", "resources": None, "replicas": 1, "placement_strategy": "PACK"}
    data["slices"] = [the_slice.model_copy(update=local).model_dump(mode="json")]
    data["models"] = [m.model_dump(mode="json") for m in models]
    return GatewayConfig.model_validate(data)


def rebuild_bucket(engine: Engine, key: BucketKey) -> tuple[BucketKey, dict[str, Any], Callable[[], None]]:
    """The worker's :data:`~buckets.slices.host.Rebuild`: rebuild bucket ``key`` through the
    engine's live-reconfiguration path (:meth:`Engine.rebuild_bucket`: its backend chosen again
    from the gate record now current); the old bucket is retired (drained) when the host calls
    back. Blocking (a backend is built and warmed)."""
    model, bucket_name, _ = key
    lower_thread_priority()  # the host's rebuild thread, one per rebuild: the build yields to serving
    with short_gil_switch_interval():
        old, new = engine.rebuild_bucket(model, bucket_name)
    return new.key, new.backend_info, functools.partial(engine.retire, [old], engine.config.drain_timeout_s)


def run_slice_worker(conn: Connection, config_data: dict[str, Any], slice_name: str, log_level: str) -> None:
    """A slice worker process's main: load the slice's models, build their buckets, serve them
    over ``conn`` until the gateway says stop or goes away, then fail what is left."""
    if threading.current_thread() is threading.main_thread():  # a Ray actor runs it on a thread of its own
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group; the gateway stops us
    the_slice = next(s for s in config_data["slices"] if s["name"] == slice_name)
    visible = visible_devices(the_slice["device"], the_slice.get("isolation", "thread"))
    if visible is not None:  # before CUDA starts in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    configure_logging(log_level)
    structlog.contextvars.bind_contextvars(slice_worker=slice_name)
    engine = Engine(worker_config(GatewayConfig.model_validate(config_data), slice_name), defer_gates=True)
    engine.start()
    release_thread_pool()  # the loads ran here; only the slice thread keeps an OpenMP pool
    keys = [bucket.key for served in engine.models.values() for bucket in served.table.buckets]
    host = SliceHost(conn, engine.slices[slice_name], keys, rebuild=functools.partial(rebuild_bucket, engine))
    log.info("slice_worker_ready", slice=slice_name, buckets=[f"{model}/{bucket}" for model, bucket, _ in keys])
    try:
        host.serve()
    finally:
        engine.stop()
        host.close()
