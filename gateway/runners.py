"""Which backend a bucket's runner uses, and building it: as configured, or for ``auto`` from
the bucket's gate record (:mod:`gateway.gate`), warmed at the bucket's shapes, with a fallback
to eager when it cannot be built or fails while serving (logged, and shown in the bucket's
``backend_info``). Every function takes plain values (no engine), so the gateway and a slice
worker build runners alike."""

from __future__ import annotations

import enum
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog

from gateway import gate
from gateway.config import BucketConfig, ContinuousBatcherConfig, GateConfig, LoraConfig, ModelConfig
from models.backends.base import BackendUnavailableError, EncoderBackend, EncoderParts
from models.backends.eager import EagerEncoder
from models.backends.fallback import FallbackRunner, OnFallback
from models.backends.registry import CONFIGURED_KINDS, build_encoder
from models.causal_lm import CausalLMRunner
from models.cuda_graphs import capture_sizes
from models.loader import LoadedModel
from models.swap_costs import measure_swap_costs
from policies.preemption import SwapCostModel, fit_swap_costs

log = structlog.get_logger(__name__)

R = TypeVar("R")


class GateState(enum.Enum):
    """Where an ``auto`` bucket's gate stands (``backend_info["gate_state"]``): ``pending`` (to
    run in the background, eager meanwhile), ``running``, ``building`` (a current record enables
    a backend that is built in the background, eager meanwhile), ``done`` (a current record, its
    backend running), ``off`` (no record and ``gate.run_at_start`` off), ``dropped`` (its bucket
    changed or went while it ran), ``failed``."""

    PENDING = "pending"
    RUNNING = "running"
    BUILDING = "building"
    DONE = "done"
    OFF = "off"
    DROPPED = "dropped"
    FAILED = "failed"


def backend_label(
    cache_dir: Path, gate_config: GateConfig, model: ModelConfig, loaded: LoadedModel, config: BucketConfig,
    num_threads: int, info: dict[str, Any], defer_gate: bool = False, defer_build: bool = False,
) -> str:
    """The backend kind a bucket runs: as configured, or for ``auto`` what its gate record
    enabled. With no current record and ``gate.run_at_start``, the gate runs now, or with
    ``defer_gate`` later in the background (:mod:`gateway.background_gates`): eager meanwhile.
    With ``defer_build``, a current record that enables a backend other than eager leaves the
    bucket on eager too, ``building``: the gate thread builds that backend after the gateway is
    ready (a ``compiled`` winner takes seconds per bucket to compile and warm, even with
    Inductor's cache; a start must not wait for it). Fills ``info["gate"]`` (the record in
    brief) and ``info["gate_state"]`` (:class:`GateState`)."""
    if config.backend != "auto":
        return CONFIGURED_KINDS[(config.backend, config.quantization)]
    path = gate.record_path(cache_dir, model.name, config.bucket_name)
    record = gate.load_record(path, gate.gate_key(model, config, loaded, num_threads))
    if record is None and gate_config.run_at_start and defer_gate:
        info.update(gate=None, gate_state=GateState.PENDING.value)
        return "eager"
    if record is None and gate_config.run_at_start:
        record = gate.run_and_save(loaded, model, config, gate_config, cache_dir, num_threads, reason="no current gate record")
    info["gate"] = gate.summary(record, gate_config)
    if record is None:  # gate.run_at_start is off
        info["gate_state"] = GateState.OFF.value
        log.warning("gate_record_missing", model=model.name, bucket=config.bucket_name, record=str(path), running="eager",
                    hint="run `sluice gate` for this model, or set gate.run_at_start")
        return "eager"
    chosen = gate.chosen_backend(record, gate_config)
    if defer_build and chosen != "eager":
        info["gate_state"] = GateState.BUILDING.value
        return "eager"
    info["gate_state"] = GateState.DONE.value
    return chosen


def encoder_backend(
    cache_dir: Path, model: ModelConfig, loaded: LoadedModel, config: BucketConfig, label: str, num_threads: int,
    info: dict[str, Any],
) -> Any:
    """The encoder backend ``label``, warmed at the bucket's shapes, behind a fallback to
    eager; eager itself when ``label`` cannot be built (logged)."""
    eager = EagerEncoder(loaded.model)
    parts = EncoderParts(loaded.model, loaded.folder, cache_dir, num_threads, loaded.device)

    def build(on_fallback: OnFallback) -> FallbackRunner[EncoderBackend]:
        backend = build_encoder(label, parts)
        info["warm_up_s"] = round(backend.warm_up(gate.encoder_shapes(config)), 3)
        return FallbackRunner(backend, eager, on_fallback)

    return _with_eager_fallback(model.name, config, label, info, build, lambda: eager)


def kv_cache_dtype(
    cache_dir: Path, gate_config: GateConfig, model: ModelConfig, loaded: LoadedModel, config: BucketConfig,
    num_threads: int, info: dict[str, Any],
) -> str | None:
    """The dtype a continuous bucket's KV pool stores: as configured (None: the model's), or for
    ``auto`` what its current gate record chose (:func:`gateway.gate.chosen_kv_cache_dtype`;
    float32 without one: ``sluice gate``, or a background gate of an ``auto`` backend, writes
    it). Sets ``info["kv_cache_dtype"]`` unless it is None."""
    chosen = config.kv_cache_dtype
    if chosen == "auto":
        record = gate.load_record(gate.record_path(cache_dir, model.name, config.bucket_name), gate.gate_key(model, config, loaded, num_threads))
        if record is None or "kv_cache" not in record:
            chosen = "float32"
            log.warning("kv_gate_record_missing", model=model.name, bucket=config.bucket_name, running=chosen,
                        hint="run `sluice gate` for this model")
        else:
            chosen = gate.chosen_kv_cache_dtype(record, gate_config)
    if chosen is not None:
        info["kv_cache_dtype"] = chosen
    return chosen


def lora_runner_kwargs(lora: LoraConfig | None) -> dict[str, Any]:
    """The adapter slots and largest rank a LoRA-enabled model's runners take (none without ``lora``)."""
    return {} if lora is None else {"max_loras": lora.max_loras, "max_lora_rank": lora.max_lora_rank}


def swap_costs(runner: CausalLMRunner, info: dict[str, Any]) -> SwapCostModel | None:
    """What preempting costs ``runner`` each way (:func:`models.swap_costs.measure_swap_costs`,
    fitted by :func:`policies.preemption.fit_swap_costs`) for ``preemption: auto``; sets
    ``info["swap_costs"]`` (milliseconds). ``None`` when its host pool holds no block (the
    build warns of that)."""
    timings = measure_swap_costs(runner)
    if timings is None:
        return None
    costs = fit_swap_costs(timings.swap_out_s_per_block, timings.swap_in_s_per_block, timings.prefill_s_by_length)
    info["swap_costs"] = {
        "swap_out_ms_per_block": round(costs.swap_out_s_per_block * 1e3, 4),
        "swap_in_ms_per_block": round(costs.swap_in_s_per_block * 1e3, 4),
        "recompute_ms": {str(n): round(costs.recompute_s(n) * 1e3, 3) for n, _ in timings.prefill_s_by_length},
    }
    return costs


def cuda_graph_sizes(config: BucketConfig, device: str) -> list[int]:
    """The decode batch sizes a continuous bucket on ``device`` captures as CUDA graphs
    (:func:`models.cuda_graphs.capture_sizes` up to ``max_num_seqs``, or its SLO's
    ``max_batch`` when larger: the tuner may grow the batch that far); empty when its
    ``cuda_graphs`` is false, or unset off a CUDA device."""
    batcher = config.batcher
    assert isinstance(batcher, ContinuousBatcherConfig)
    is_on = batcher.cuda_graphs if batcher.cuda_graphs is not None else device.startswith("cuda")
    if not is_on:
        return []
    return capture_sizes(max(batcher.max_num_seqs, config.slo.max_batch if config.slo is not None else 0))


def causal_lm_runner(
    loaded: LoadedModel, num_blocks: int, block_size: int, label: str, config: BucketConfig, info: dict[str, Any],
    kv_dtype: str | None = None, lora: LoraConfig | None = None,
) -> Any:
    """A decoder runner with backend ``label`` over a KV pool of ``kv_dtype`` (None: the
    model's dtype), with the adapter slots of ``lora`` (its model's block), warmed at the
    bucket's step shapes (its decode CUDA graphs captured then: :func:`cuda_graph_sizes`;
    ``info["cuda_graphs"]`` lists the sizes captured, empty when the capture failed); eager
    when ``label`` cannot be built (logged). An eager runner without graphs is not warmed."""
    kwargs: dict[str, Any] = {
        **lora_runner_kwargs(lora), "eos_token_ids": loaded.eos_token_ids, "tokenizer": loaded.tokenizer,
        "kv_cache_dtype": kv_dtype, "cuda_graph_sizes": cuda_graph_sizes(config, loaded.device),
        "swap_space_bytes": config.batcher.host_swap_bytes if isinstance(config.batcher, ContinuousBatcherConfig) else 0,
    }

    def warmed(runner: CausalLMRunner) -> CausalLMRunner:
        info["warm_up_s"] = round(runner.warm_up(gate.decoder_shapes(config)), 3)
        if kwargs["cuda_graph_sizes"]:
            info["cuda_graphs"] = runner.cuda_graph_sizes
        return runner

    def build(on_fallback: OnFallback) -> CausalLMRunner:
        return warmed(CausalLMRunner(loaded.model, num_blocks, block_size, backend=label, on_fallback=on_fallback, **kwargs))

    def build_eager() -> CausalLMRunner:
        runner = CausalLMRunner(loaded.model, num_blocks, block_size, **kwargs)
        return warmed(runner) if kwargs["cuda_graph_sizes"] else runner

    return _with_eager_fallback(loaded.name, config, label, info, build, build_eager)


def _with_eager_fallback(
    model_name: str, config: BucketConfig, label: str, info: dict[str, Any],
    build: Callable[[OnFallback], R], build_eager: Callable[[], R],
) -> R:
    """``build(on_fallback)`` for a non-eager ``label`` (logged ready), else ``build_eager()``:
    when ``label`` is eager, or when building or warming it raised
    :class:`BackendUnavailableError` (logged, the error shown in ``info``)."""
    info["running"] = "eager"
    if label == "eager":
        return build_eager()
    fields = {"model": model_name, "bucket": config.bucket_name, "backend": label}
    try:
        built = build(on_fallback_logger(fields, info))
    except BackendUnavailableError as exc:
        log.warning("backend_unavailable", **fields, error=str(exc), running="eager")
        info["error"] = str(exc)
        return build_eager()
    log.info("backend_ready", **fields, warm_up_s=info["warm_up_s"])
    info["running"] = label
    return built


def on_fallback_logger(fields: dict[str, str], info: dict[str, Any]) -> OnFallback:
    """What a backend calls once when it fails while serving and eager takes over: log it
    and show the bucket running eager."""

    def on_fallback(name: str, exc: Exception) -> None:
        log.error("backend_failed", **fields, error=f"{type(exc).__name__}: {exc}", running="eager")
        info.update(running="eager", error=f"{type(exc).__name__}: {exc}")

    return on_fallback
