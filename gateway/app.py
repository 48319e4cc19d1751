"""The litestar app factory: lifespan starts and stops the engine and the background gates
(:mod:`gateway.background_gates`, after the gateway is ready); one place maps errors
(:func:`gateway.errors.to_api_error`); every request is logged once (:mod:`gateway.access_log`),
with its request id, and compressed bodies are inflated (:mod:`gateway.http_edge`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any

import structlog
from litestar import Litestar, Request, get
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.params import FromQuery
from litestar.response import Response

from buckets.bucket import Bucket
from gateway.access_log import AccessLog
from gateway.adapter_routes import AdapterController, VllmAdapterController
from gateway.adapters import Adapters, base_hf_config, check_adapter_folders
from gateway.auth import ApiKeys, KeyRing
from gateway.admin import AdminController, is_admin_path, unmatched_admin_error
from gateway.background_gates import BackgroundGates, gate_states
from gateway.config import GatewayConfig
from gateway.dashboard import DashboardController
from gateway.engine import Engine
from gateway.errors import APIError, ConfigError, is_domain_error, to_api_error
from gateway.http_edge import BodyDecoding, RequestIds
from gateway.key_routes import KeysController, reloading_on_sighup
from gateway.metrics import CONTENT_TYPE, Metrics
from gateway.openapi import RequestBodySchemas
from gateway.quotas import QuotaBook
from gateway.residency import Residency
from gateway.router import Router
from gateway.slice_worker import run_slice_worker
from gateway.tuning import TuningLoop
from gateway.routes.openai import OpenAIController
from models.cpu_memory import freeze_long_lived_objects
from models.openmp import releasing_thread_pool
from gateway.routes.tokenize import TokenizeController

log = structlog.get_logger(__name__)


def _error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """Every error a handler raises, in OpenAI's body shape; an unexpected one is logged (a bug).
    An ``/admin`` path or method no route takes gets the admin API's refusal first."""
    if not is_domain_error(exc):
        log.exception("unhandled_error", error=repr(exc))
        return Response(APIError(500, "internal server error", "server_error").body(), status_code=500)
    error = to_api_error(exc)
    if isinstance(exc, HTTPException) and exc.status_code in (404, 405) and is_admin_path(request.scope["path"]):
        error = unmatched_admin_error(request, error)
    return Response(error.body(), status_code=error.status_code, headers=error.headers or None)


@get("/health")
async def health(request: Request[Any, Any, Any], verbose: FromQuery[str | None] = None) -> dict[str, Any]:
    """200 while the gateway serves (backend gates running in the background included); with
    ``?verbose`` (bare, or any value but ``false``, ``0``, ``no``) also ``gates``: each ``auto``
    bucket's gate state (model, bucket, state), and ``loading``: the models loading now."""
    engine: Engine = request.app.state.engine
    body: dict[str, Any] = {"status": "ok", "models": sorted(engine.models)}
    if verbose is not None and verbose.lower() not in ("false", "0", "no"):
        body["gates"] = gate_states(engine)
        body["loading"] = request.app.state.residency.loading()
    return body


@get("/stats")
async def stats(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """Per-model, per-bucket snapshots of the batchers' counters and queues (JSON)."""
    engine: Engine = request.app.state.engine
    return {
        name: {b.name: _bucket_stats(b) for b in served.table.buckets} for name, served in engine.models.items()
    }


@get("/metrics", media_type=CONTENT_TYPE)
async def metrics_endpoint(request: Request[Any, Any, Any]) -> bytes:
    """Prometheus text: histograms, counters and gauges labelled by model and bucket."""
    metrics: Metrics = request.app.state.metrics
    return await asyncio.to_thread(metrics.render)


def _bucket_stats(bucket: Bucket) -> dict[str, Any]:
    snapshot = bucket.stats()
    return {
        **asdict(snapshot),
        "max_input_tokens": bucket.max_input_tokens,
        "mean_batch_seqs": snapshot.mean_batch_seqs,
        "mean_tokens_per_step": snapshot.mean_tokens_per_step,
        "kv_usage": snapshot.kv_usage,
        "prefix_cache_hit_rate": snapshot.prefix_cache_hit_rate,
    }


def create_app(config: GatewayConfig) -> Litestar:
    """Build the gateway app for ``config``. Models load in the lifespan, before serving starts.

    Raises:
        ConfigError: a configured LoRA adapter folder or ``adapters_dir`` missing; a bad API keys
            file (:class:`gateway.auth.KeyRing`); the engine's.
    """
    check_adapter_folders(config)
    keys = KeyRing.from_config(config)
    engine = Engine(config, worker_main=run_slice_worker, defer_gates=True)
    gates = BackgroundGates(engine)
    engine.bucket_hooks.append(gates.on_bucket)
    metrics = Metrics(engine, frozenset if keys is None else keys.tenant_names)
    residency = Residency(engine, metrics)
    adapters = Adapters(lambda: engine.config.models, lambda model: base_hf_config(model, engine.cache_dir))
    metrics.watch_residency(residency)
    engine.request_observers.append(metrics.observe_request)
    engine.bucket_hooks.append(
        lambda model, bucket: bucket.add_batch_observer(metrics.batch_observer(model, bucket.name, bucket.kind))
    )

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        try:
            await asyncio.to_thread(releasing_thread_pool(engine.start))  # only slice threads keep OpenMP pools
        except ConfigError as exc:  # a layout over a slice's memory budget: say so, do not serve
            log.error("startup_failed", error=str(exc))
            raise
        try:
            residency.start()
        except ConfigError as exc:  # pinned models over a memory budget
            log.error("startup_failed", error=str(exc))
            await asyncio.to_thread(engine.stop)
            raise
        await app.state.router.warm()
        log.info("heap_frozen", num_objects=freeze_long_lived_objects())  # full collections skip the models
        app.state.config_lock = asyncio.Lock()  # admin changes and the SLO tuner, one at a time
        tuning = asyncio.create_task(TuningLoop(engine, metrics, app.state.config_lock).run())
        log.info("gateway_ready", models=sorted(engine.models))
        gates.start(asyncio.get_running_loop(), app.state.config_lock)  # pending gates, one at a time
        try:
            with reloading_on_sighup(keys):
                yield
        finally:
            tuning.cancel()
            await residency.stop()
            await asyncio.to_thread(gates.stop)
            await asyncio.to_thread(engine.stop)

    app = Litestar(
        route_handlers=[
            OpenAIController, TokenizeController, AdminController, AdapterController, VllmAdapterController,
            KeysController, DashboardController, health, stats, metrics_endpoint,
        ],
        lifespan=[lifespan],
        state=State({"engine": engine, "router": Router(engine), "metrics": metrics, "residency": residency,
                     "adapters": adapters, "api_keys": keys,
                     "quotas": QuotaBook(metrics.observe_rate_limited)}),
        exception_handlers={Exception: _error_response},
        request_max_body_size=int(config.max_request_body_bytes),
        plugins=[RequestBodySchemas()],
        # litestar's default logging config would replace the root handler (and its filter of
        # third-party INFO lines) that gateway.logging.configure_logging installed.
        logging_config=None,
    )
    # Around the whole handler, not as route middlewares: unknown paths (404) are logged, and
    # carry a request id, too. API keys are checked before a compressed body is inflated.
    decoding = BodyDecoding(app.asgi_handler, int(config.max_request_body_bytes))
    inner = decoding if keys is None else ApiKeys(decoding, keys)
    app.asgi_handler = AccessLog(RequestIds(inner), metrics.observe_http)
    return app
