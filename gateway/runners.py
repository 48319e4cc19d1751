"""Which backend a bucket's runner uses, and building it: as configured, or for ``auto`` from
the bucket's gate record (:mod:`gateway.gate`), warmed at the bucket's shapes, with a fallback
to eager when it cannot be built or fails while serving (logged, and shown in the bucket's
``backend_info``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from gateway.config import BucketConfig, GateConfig, ModelConfig
from models.loader import LoadedModel

log = structlog.get_logger(__name__)


def backend_label(
    cache_dir: Path, gate_config: GateConfig, model: ModelConfig, loaded: LoadedModel, config: BucketConfig,
    num_threads: int, info: dict[str, Any],
) -> str:
    """The backend a bucket runs: as configured, or for ``auto`` what its gate record (run
    now when missing or stale and ``gate.run_at_start``) enabled. Fills ``info["gate"]``."""
    from gateway import gate

    if config.backend == "onnx":
        return "onnx-int8" if config.quantization == "int8" else "onnx-fp32"
    if config.backend != "auto":
        return config.backend
    path = gate.record_path(cache_dir, model.name, config.bucket_name)
    record = gate.load_record(path, gate.gate_key(model, config, loaded, num_threads))
    if record is None and gate_config.run_at_start:
        log.info("gate_started", model=model.name, bucket=config.bucket_name, reason="no current gate record")
        record = gate.run_gate(loaded, model, config, gate_config, cache_dir, num_threads)
        gate.save_record(path, record)
        log.info("gate_finished", model=model.name, bucket=config.bucket_name, chosen=record["chosen"], gate_s=record["gate_s"], record=str(path))
    info["gate"] = gate.summary(record, gate_config)
    if record is None:  # gate.run_at_start is off
        log.warning("gate_record_missing", model=model.name, bucket=config.bucket_name, record=str(path), running="eager",
                    hint="run `sluice gate` for this model, or set gate.run_at_start")
        return "eager"
    return gate.chosen_backend(record, gate_config)


def encoder_backend(
    cache_dir: Path, model: ModelConfig, loaded: LoadedModel, config: BucketConfig, label: str, num_threads: int,
    info: dict[str, Any],
) -> Any:
    """The encoder backend ``label``, warmed at the bucket's shapes, behind a fallback to
    eager; eager itself when ``label`` cannot be built (logged)."""
    from gateway import gate
    from models.backends import BackendUnavailableError, EagerEncoder, FallbackEncoder

    eager = EagerEncoder(loaded.model)
    info["running"] = "eager"
    if label == "eager":
        return eager
    fields = {"model": model.name, "bucket": config.bucket_name, "backend": label}
    try:
        backend = gate.build_encoder(label, loaded, cache_dir, num_threads)
        info["warm_up_s"] = round(backend.warm_up(gate.encoder_shapes(config)), 3)
    except BackendUnavailableError as exc:
        log.warning("backend_unavailable", **fields, error=str(exc), running="eager")
        info["error"] = str(exc)
        return eager
    log.info("backend_ready", **fields, warm_up_s=info["warm_up_s"])
    info["running"] = label
    return FallbackEncoder(backend, eager, on_fallback_logger(fields, info))


def causal_lm_runner(
    loaded: LoadedModel, num_blocks: int, block_size: int, label: str, config: BucketConfig, info: dict[str, Any]
) -> Any:
    """A decoder runner with backend ``label``, warmed at the bucket's step shapes; eager
    when ``label`` cannot be built (logged)."""
    from gateway import gate
    from models.backends import BackendUnavailableError
    from models.causal_lm import CausalLMRunner

    info["running"] = "eager"
    if label == "eager":
        return CausalLMRunner(loaded.model, num_blocks, block_size)
    fields = {"model": loaded.name, "bucket": config.bucket_name, "backend": label}
    try:
        runner = CausalLMRunner(loaded.model, num_blocks, block_size, backend=label)
        info["warm_up_s"] = round(runner.warm_up(gate.decoder_shapes(config)), 3)
    except BackendUnavailableError as exc:
        log.warning("backend_unavailable", **fields, error=str(exc), running="eager")
        info["error"] = str(exc)
        return CausalLMRunner(loaded.model, num_blocks, block_size)
    log.info("backend_ready", **fields, warm_up_s=info["warm_up_s"])
    info["running"] = label
    runner.on_fallback = on_fallback_logger(fields, info)
    return runner


def on_fallback_logger(fields: dict[str, str], info: dict[str, Any]) -> Callable[[str, Exception], None]:
    """What a backend calls once when it fails while serving and eager takes over: log it
    and show the bucket running eager."""

    def on_fallback(name: str, exc: Exception) -> None:
        log.error("backend_failed", **fields, error=f"{type(exc).__name__}: {exc}", running="eager")
        info.update(running="eager", error=f"{type(exc).__name__}: {exc}")

    return on_fallback
