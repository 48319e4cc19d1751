"""Backend gates at a bucket's shapes: measure, judge (:mod:`policies.gating`), record, reuse.

A gate run builds every candidate backend a bucket could use, measures it against ``eager`` at
the bucket's shapes (latency per batch, every repeat of interleaved runs, and their medians)
and for accuracy, and writes a JSON record to ``<cache_dir>/gates/<model>/<bucket>.json``: the machine, the library
versions, the shapes, every figure, each verdict and the chosen backend. A record counts only
while its ``key`` (machine, versions, model files, dtype, shapes) equals the current one;
otherwise it is stale and the gate runs again. Verdicts are re-judged from the stored figures
with the current thresholds, so changing a threshold needs no new measurement. A record without
per-repeat figures (version 1, before confidence bounds) is stale by its key, so it is gated
again (with ``gate.run_at_start``: in the background at start, :mod:`gateway.background_gates`;
else the bucket runs eager); were such figures judged anyway, :func:`policies.gating.judge`
refuses them.

Shapes:
    dynamic (encoder) bucket: ``(batch, max_input_tokens)`` for batch 1, a quarter and all of
        ``max_batch_size``: the padded shapes its batches take at the length boundary.
    continuous (decoder) bucket: ``(num_sequences, num_tokens)`` steps: one prefill chunk of
        ``min(max_input_tokens, max_num_batched_tokens)`` tokens, and decodes of 1 and
        ``max_num_seqs`` sequences at a context of ``max_input_tokens``; accuracy on 8 gate
        texts, 16 tokens each: exact kinds greedy tokens identical to eager (near-ties allowed),
        lossy kinds teacher-forced top-1 agreement and mean KL (:mod:`models.backends.decoder_gate`).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import structlog
import torch

from gateway.config import BucketConfig, ContinuousBatcherConfig, GateConfig, ModelConfig
from models.backends.base import BackendUnavailableError, EncoderBackend, EncoderParts
from models.backends.decoder_gate import measure_decoder
from models.backends.eager import EagerEncoder
from models.backends.measure import ALWAYS_IDLE, IdleGuard, batched, interleaved_times_ms, latency_fields, min_cosine
from models.backends.registry import DECODER_FACTORIES, ENCODER_FACTORIES, build_encoder, supports_lora
from models.encoder import EmbeddingRunner
from models.kv_accuracy import KVAccuracyThresholds, judge_kv_dtype, measure_kv_dtype
from models.loader import LoadedModel
from policies.gating import GateThresholds, Measurement, Verdict, choose_backend, judge

log = structlog.get_logger(__name__)

# 2: per-repeat latencies (records of version 1 have medians only: stale, so gated again).
RECORD_VERSION = 2
# The fixed accuracy set: varied topics and lengths (the longest are cut to the bucket's limit).
GATE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "How do I reset my password?",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The central bank raised interest rates by a quarter of a percentage point on Tuesday.",
    "def add(a, b): return a + b",
    "Paris is the capital and most populous city of France.",
    "I loved the film, but the ending felt rushed and the soundtrack was far too loud.",
    "Mix the flour, sugar and butter, then bake for twenty minutes at 180 degrees.",
    "Quantum entanglement links the states of particles regardless of the distance between them.",
    "Error 503: the service is temporarily unavailable, please retry after a few seconds.",
    "A batch of independent requests keeps the accelerator busy and raises throughput.",
    "¿Dónde está la estación de tren más cercana?",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "The patient reported mild headaches and occasional dizziness after the new medication.",
    "ok",
    "Transformers use self-attention to weigh every token of the input against every other token.",
) + tuple(
    " ".join(
        f"Paragraph {i}: the river rose through the night, the town watched the levee, and by dawn "
        f"the water had found the low streets near the old mill, where volunteers stacked sandbags "
        f"and counted boats while the radio repeated the warnings every few minutes."
        for i in range(n)
    )
    for n in (2, 4, 8)
)


def encoder_shapes(bucket: BucketConfig) -> list[tuple[int, int]]:
    """The ``(batch, seq)`` shapes a dynamic bucket is gated at."""
    max_batch = bucket.batcher.max_batch_size  # type: ignore[union-attr]
    batches = sorted({1, max(1, max_batch // 4), max_batch})
    return [(b, bucket.max_input_tokens) for b in batches]


def decoder_shapes(bucket: BucketConfig) -> list[tuple[int, int]]:
    """The ``(num_sequences, num_tokens)`` steps a continuous bucket is gated (and warmed) at:
    one prefill chunk of ``min(max_input_tokens, max_num_batched_tokens)`` tokens, and decodes
    of 1 and ``max_num_seqs`` sequences (timed at a context of ``max_input_tokens``)."""
    batcher = bucket.batcher
    assert isinstance(batcher, ContinuousBatcherConfig)
    prefill = min(bucket.max_input_tokens, batcher.max_num_batched_tokens)
    return [(1, prefill)] + [(n, 1) for n in sorted({1, batcher.max_num_seqs})]


def gate_key(model: ModelConfig, bucket: BucketConfig, loaded: LoadedModel, num_threads: int) -> dict[str, Any]:
    """What a record was measured under; a record whose key differs from this one is stale."""
    return {
        "record_version": RECORD_VERSION,
        "machine": machine_info(loaded.device, num_threads),
        "versions": library_versions(),
        "model": {"source": model.source, "dtype": model.dtype, "files": _folder_fingerprint(loaded.folder)},
        "kind": bucket.batcher.kind,
        "shapes": encoder_shapes(bucket) if model.task == "embed" else decoder_shapes(bucket),
        # Only a bucket that gates its KV dtype measures it: other records keep their key.
        **({"kv_cache_dtype": "auto"} if bucket.kv_cache_dtype == "auto" else {}),
        # A LoRA model's gate measures only kinds that run adapters: a record made without is stale.
        **({"lora": True} if model.lora is not None else {}),
    }


def machine_info(device: str, num_threads: int) -> dict[str, Any]:
    """The CPU (or GPU) model, core count, threads and device a measurement ran on: ``cpu`` or
    ``cuda`` (the GPU named by its model, not its ordinal, which a process slice's worker sees
    as ``cuda:0``: :func:`gateway.slice_worker.visible_devices`)."""
    info: dict[str, Any] = {"device": "cuda" if device.startswith("cuda") else device, "num_threads": num_threads, "cpu_count": os.cpu_count(), "arch": platform.machine()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        info["cpu"] = platform.processor()
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def library_versions() -> dict[str, str | None]:
    """Versions of what a backend's speed and numerics depend on (``None``: not installed)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for package in ("torch", "transformers", "onnx", "onnxruntime", "onnxruntime-gpu", "sluice"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return versions


def _folder_fingerprint(folder: Path) -> list[tuple[str, int]]:
    return sorted((p.name, p.stat().st_size) for p in folder.iterdir() if p.is_file())


def record_path(cache_dir: Path, model: str, bucket: str) -> Path:
    """Where the gate record of ``model``'s bucket ``bucket`` lives."""
    return cache_dir / "gates" / model.replace("/", "_") / f"{bucket}.json"


def load_record(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The record at ``path`` when it exists, parses and matches ``key``; else ``None``."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    # JSON has no tuples: compare through a JSON round trip.
    return record if record.get("key") == json.loads(json.dumps(key)) else None


def save_record(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)


def thresholds(config: GateConfig) -> GateThresholds:
    """The thresholds of :mod:`policies.gating` that ``config`` sets."""
    return GateThresholds(
        config.min_speedup, config.min_cosine, config.min_cosine_quantized, config.min_top1_agreement, config.confidence,
        max_mean_kl_nats=config.max_mean_kl_nats,
    )


def verdicts(record: dict[str, Any], config: GateConfig) -> list[Verdict]:
    """Each candidate of ``record`` judged with ``config``'s thresholds."""
    fields = set(Measurement.__dataclass_fields__)
    measured = [Measurement(**{k: _tuples(v) for k, v in c.items() if k in fields}) for c in record["candidates"]]
    return [judge(m, thresholds(config)) for m in measured]


def _tuples(value: Any) -> Any:
    """JSON lists (nested too) as the tuples :class:`Measurement` holds."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def chosen_kv_cache_dtype(record: dict[str, Any], config: GateConfig) -> str:
    """The KV dtype a ``kv_cache_dtype: auto`` bucket runs by ``record``: int8 when its int8
    figures (``record["kv_cache"]``) pass ``config``'s thresholds, else float32."""
    bounds = KVAccuracyThresholds(config.min_kv_greedy_agreement, config.max_kv_mean_kl_nats)
    passing = [f for f in record.get("kv_cache", []) if f["kv_cache_dtype"] == "int8" and not judge_kv_dtype(f, bounds)]
    return "int8" if passing else "float32"


def chosen_backend(record: dict[str, Any], config: GateConfig) -> str:
    """The backend the record enables under ``config`` (``eager`` when none)."""
    return choose_backend(verdicts(record, config), thresholds(config))


def bucket_gate_config(config: GateConfig, bucket: BucketConfig, model: ModelConfig | None = None) -> GateConfig:
    """``config`` with the bucket's own ``gate_candidates``, where it sets them; for a ``model``
    with LoRA adapters, only the candidates that run them (:func:`models.backends.registry.supports_lora`:
    the lean kinds; ``compiled`` traces fixed graphs that per-row adapters cannot reach)."""
    candidates = list(bucket.gate_candidates) if bucket.gate_candidates is not None else list(config.candidates)
    if model is not None and model.lora is not None:
        candidates = [c for c in candidates if supports_lora(c)]
    if candidates == list(config.candidates):
        return config
    return config.model_copy(update={"candidates": candidates})


def run_gate(
    loaded: LoadedModel, model: ModelConfig, bucket: BucketConfig, config: GateConfig, cache_dir: Path, num_threads: int,
    guard: IdleGuard = ALWAYS_IDLE,
) -> dict[str, Any]:
    """Measure every candidate for one bucket (``config.candidates``, or the bucket's
    ``gate_candidates``) and return the record (not yet saved). Every build, timed round and
    accuracy run starts when ``guard`` says the slice is idle; a round disturbed by work is
    measured again (:mod:`models.backends.measure`).

    Raises:
        GateCancelledError: from ``guard``.
    """
    started = time.perf_counter()
    config = bucket_gate_config(config, bucket, model)
    if model.task == "embed":
        candidates = _gate_encoder(loaded, bucket, config, cache_dir, num_threads, guard)
    else:
        candidates = _gate_decoder(loaded, bucket, config, guard, model.lora is not None)
    record = {
        "model": model.name,
        "bucket": bucket.bucket_name,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "key": json.loads(json.dumps(gate_key(model, bucket, loaded, num_threads))),
        "repeats": config.repeats,
        "candidates": candidates,
        "gate_s": round(time.perf_counter() - started, 3),
    }
    judged = verdicts(record, config)
    record["verdicts"] = [
        {"backend": v.backend, "enabled": v.enabled, "speedup": v.speedup, "speedup_low": v.speedup_low, "reasons": list(v.reasons)}
        for v in judged
    ]
    record["chosen"] = choose_backend(judged, thresholds(config))
    record["thresholds"] = thresholds(config).__dict__
    if bucket.kv_cache_dtype == "auto":
        guard.wait_until_idle()
        block_size = bucket.batcher.block_size  # type: ignore[union-attr]
        record["kv_cache"] = [measure_kv_dtype(loaded.model, _decoder_prompts(loaded, bucket), 16, block_size, "int8")]
        record["kv_cache_dtype"] = chosen_kv_cache_dtype(record, config)
    elif model.task == "generate":
        record["kv_cache_dtype"] = bucket.kv_cache_dtype or model.dtype
    return record


def run_and_save(
    loaded: LoadedModel, model: ModelConfig, bucket: BucketConfig, config: GateConfig, cache_dir: Path, num_threads: int,
    reason: str, guard: IdleGuard = ALWAYS_IDLE,
) -> dict[str, Any]:
    """Run one bucket's gate (:func:`run_gate`, waiting on ``guard``) and save its record,
    logging ``gate_started`` (with ``reason``) and ``gate_finished`` (the chosen backend,
    ``duration_s`` and where the record went).

    Raises:
        GateCancelledError: from ``guard`` (nothing saved).
    """
    fields = {"model": model.name, "bucket": bucket.bucket_name}
    candidates = bucket_gate_config(config, bucket, model).candidates
    log.info("gate_started", **fields, reason=reason, candidates=list(candidates), repeats=config.repeats)
    record = run_gate(loaded, model, bucket, config, cache_dir, num_threads, guard)
    path = record_path(cache_dir, model.name, bucket.bucket_name)
    save_record(path, record)
    log.info("gate_finished", **fields, chosen=record["chosen"], duration_s=record["gate_s"], record=str(path))
    return record


def _gate_encoder(
    loaded: LoadedModel, bucket: BucketConfig, config: GateConfig, cache_dir: Path, num_threads: int, guard: IdleGuard
) -> list[dict[str, Any]]:
    shapes = encoder_shapes(bucket)
    parts = EncoderParts(loaded.model, loaded.folder, cache_dir, num_threads, loaded.device)
    backends: dict[str, EncoderBackend] = {"eager": EagerEncoder(loaded.model)}
    results: dict[str, dict[str, Any]] = {}
    for label in (c for c in config.candidates if c in ENCODER_FACTORIES and c != "eager"):
        results[label] = {"backend": label, "quantized": label.endswith("int8")}
        guard.wait_until_idle()
        try:
            built_at = time.perf_counter()
            backend = build_encoder(label, parts)
            results[label]["build_s"] = round(time.perf_counter() - built_at, 3)
            results[label]["warm_up_s"] = round(backend.warm_up(shapes), 3)
            backends[label] = backend
        except BackendUnavailableError as exc:
            results[label]["error"] = str(exc)
    ids = _token_ids(loaded, max(seq for _, seq in shapes))
    inputs = [(ids[:, :seq].expand(batch, seq).contiguous(), torch.ones((batch, seq), dtype=torch.long)) for batch, seq in shapes]
    calls = {name: (lambda i, b=b: b.hidden_states(*inputs[i])) for name, b in backends.items()}
    times = interleaved_times_ms(calls, len(shapes), config.repeats, guard)
    texts = [loaded.tokenizer(t, truncation=True, max_length=bucket.max_input_tokens)["input_ids"] for t in GATE_TEXTS]
    pad_id = loaded.tokenizer.pad_token_id or 0
    max_batch = bucket.batcher.max_batch_size  # type: ignore[union-attr]

    def embed(backend: EncoderBackend) -> torch.Tensor:
        runner = EmbeddingRunner(backend, pad_id, loaded.device, loaded.folder)
        return torch.cat([runner.embed(batch)[0] for batch in batched(texts, max_batch)])

    guard.wait_until_idle()
    reference = embed(backends["eager"])
    for name, backend in backends.items():
        if name == "eager":
            continue
        guard.wait_until_idle()
        try:
            results[name]["min_cosine"] = round(min_cosine(reference, embed(backend)), 6)
        except Exception as exc:  # a backend that fails at run time is refused, with the reason
            results[name]["error"] = f"{type(exc).__name__}: {exc}"
            continue
        results[name].update(latency_fields(times["eager"], times[name]))
    return list(results.values())


def _token_ids(loaded: LoadedModel, length: int) -> torch.Tensor:
    """``[1, length]`` real token ids cut from the gate texts (the tokenizer's special tokens kept)."""
    text = " ".join(GATE_TEXTS)
    while len(text.split()) < length:  # at least one token per word
        text = f"{text} {text}"
    ids = loaded.tokenizer(text, truncation=True, max_length=length)["input_ids"]
    return torch.tensor([ids], dtype=torch.long)


def _gate_decoder(
    loaded: LoadedModel, bucket: BucketConfig, config: GateConfig, guard: IdleGuard, lora_enabled: bool = False
) -> list[dict[str, Any]]:
    batcher = bucket.batcher
    assert isinstance(batcher, ContinuousBatcherConfig)
    prompts = _decoder_prompts(loaded, bucket)
    candidates = [c for c in config.candidates if c in DECODER_FACTORIES and c != "eager"]
    return measure_decoder(
        loaded.model, decoder_shapes(bucket), bucket.max_input_tokens, batcher.block_size, candidates, config.repeats, prompts,
        guard=guard, lora_enabled=lora_enabled,
    )


def _decoder_prompts(loaded: LoadedModel, bucket: BucketConfig) -> list[list[int]]:
    """The first 8 gate texts as token ids, cut to the bucket's limit."""
    return [loaded.tokenizer(t, truncation=True, max_length=bucket.max_input_tokens)["input_ids"] for t in GATE_TEXTS[:8]]


def summary(record: dict[str, Any] | None, config: GateConfig) -> dict[str, Any] | None:
    """A record in brief for the admin API and the dashboard: when, chosen, and per candidate
    the speed-up, accuracy and verdict."""
    if record is None:
        return None
    judged = {v.backend: v for v in verdicts(record, config)}
    rows = []
    for candidate in record["candidates"]:
        verdict = judged[candidate["backend"]]
        rows.append({
            "backend": candidate["backend"],
            "enabled": verdict.enabled,
            "speedup": None if verdict.speedup is None else round(verdict.speedup, 3),
            "speedup_low": None if verdict.speedup_low is None else round(verdict.speedup_low, 3),
            "min_cosine": candidate.get("min_cosine"),
            "tokens_identical": candidate.get("tokens_identical"),
            "top1_agreement": candidate.get("top1_agreement"),
            "mean_kl_nats": candidate.get("mean_kl_nats"),
            "reasons": list(verdict.reasons),
        })
    chosen = choose_backend(list(judged.values()), thresholds(config))
    return {"created": record["created"], "chosen": chosen, "candidates": rows}
