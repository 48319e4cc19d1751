"""Models named by a folder or a path rather than a ``models:`` entry (issue 32).

Every ``*.gguf`` file and every folder holding a ``config.json`` in ``models_dir`` is a servable
model named after the file's stem or the folder's name; ``sluice serve --model PATH`` names one
the same way. Each gets the ``ModelConfig`` :func:`default_model_config` builds from the
top-level ``model_defaults`` and what the model's own files say: its task (from the
architectures in ``config.json``; a GGUF file always generates) and its context (its
``max_position_embeddings``, or the GGUF's ``<arch>.context_length``). Only metadata is read:
no weights are loaded or converted here.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import ByteSize

from gateway.config import (
    BucketConfig, ContinuousBatcherConfig, DynamicBatcherConfig, GatewayConfig, ModelConfig, ModelDefaultsConfig,
    SliceConfig, parse_config,
)
from gateway.errors import ConfigError
from models.errors import ModelSourceError
from models.source import resolve_source

log = structlog.get_logger(__name__)

Task = Literal["generate", "embed"]

# ModelConfig.name's pattern: a file or folder whose name does not match it is skipped.
MODEL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.:/-]+$")
# Decoder-only model types whose config.json may name no architectures.
DECODER_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "phi", "phi3", "gpt2", "gpt_neox", "gptj", "falcon", "starcoder2", "stablelm", "olmo", "olmo2", "granite",
    "smollm3", "cohere", "nemotron", "bloom", "opt",
})
# Encoder architectures served as embedding models (AutoModel loads their base model).
ENCODER_ARCHITECTURES = frozenset({
    "BertModel", "XLMRobertaModel", "RobertaModel", "MPNetModel", "DistilBertModel", "NomicBertModel",
    "ModernBertModel", "DebertaV2Model", "ElectraModel", "CamembertModel",
})
# The files that mark a sentence-transformers folder (an embedding model whatever its encoder).
SENTENCE_TRANSFORMERS_FILES = ("config_sentence_transformers.json", "modules.json")
# RoBERTa-style encoders number positions from padding_idx + 1: max_position_embeddings
# counts those pad_token_id + 1 positions that no token can use (XLM-R: 514 for 512 tokens).
OFFSET_POSITION_MODEL_TYPES = frozenset({"roberta", "xlm-roberta", "camembert", "mpnet", "longformer"})
# Where config.json states the context, in the order looked at (GPT-2 calls it n_positions).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
# The thread count of the one slice `sluice serve --model` makes: beyond a few threads per
# forward, the small models it is meant for gain little and the synchronisation costs more.
MAX_DEFAULT_NUM_THREADS = 8
DEFAULT_SLICE = "cpu0"
DEFAULT_KV_CACHE_MEMORY_BYTES = 2 * 1024**3


def model_name(path: Path) -> str:
    """The name a model file or folder is served under: a file's stem, a folder's name."""
    return path.stem if path.is_file() else path.name


def discover_models(models_dir: Path) -> dict[str, Path]:
    """The models in ``models_dir`` by name, in name order: every ``*.gguf`` file and every
    folder with a ``config.json``; other entries are ignored and a name that
    ``ModelConfig.name`` refuses is skipped with a warning (``models_dir_entry_skipped``).

    Raises:
        ConfigError: ``models_dir`` is not a folder (``param="models_dir"``).
    """
    if not models_dir.is_dir():
        raise ConfigError(f"models_dir: {str(models_dir)!r} is not a folder", param="models_dir")
    found: dict[str, Path] = {}
    for path in sorted(models_dir.iterdir()):
        is_model = (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (path / "config.json").is_file())
        if not is_model or path.name.startswith("."):
            continue
        name = model_name(path)
        if not MODEL_NAME_PATTERN.match(name):
            log.warning("models_dir_entry_skipped", path=str(path), reason=f"name {name!r} has characters outside A-Za-z0-9_.:/-")
            continue
        found[name] = path
    return found


def expand_models_dir(config: GatewayConfig) -> GatewayConfig:
    """``config`` with one ``models`` entry added per model of its ``models_dir`` that has no
    entry of the same name (see :func:`discover_models` and :func:`default_model_config`); the
    config itself when it has no ``models_dir``.

    Raises:
        ConfigError: ``models_dir`` is not a folder, a model's files are unusable or of an
            unknown architecture, or the expanded config is invalid.
    """
    if config.models_dir is None:
        return config
    explicit = {m.name for m in config.models}
    first_slice = config.model_defaults.slice or config.slices[0].name
    discovered = [
        default_model_config(name, str(path), config.model_defaults, first_slice)
        for name, path in discover_models(Path(config.models_dir).expanduser()).items()
        if name not in explicit
    ]
    log.info("models_dir_scanned", models_dir=config.models_dir, models=[m.name for m in discovered])
    if not discovered and not config.models:
        log.warning("models_dir_empty", models_dir=config.models_dir, hint="no *.gguf file nor folder with a config.json: nothing to serve")
    return _with_models(config, [*config.models, *discovered], "models_dir")


def _with_models(config: GatewayConfig, models: list[ModelConfig], origin: str, **fields: Any) -> GatewayConfig:
    """``config`` with ``models`` (and ``fields``) in place, validated again."""
    data = config.model_dump()
    data.update(fields, models=[m.model_dump() for m in models])
    return parse_config(data, origin)


def default_model_config(name: str, source: str, defaults: ModelDefaultsConfig, first_slice: str) -> ModelConfig:
    """The config of model ``name`` at ``source`` (a ``.gguf`` file or a Hugging Face folder, as a
    path or ``pkg:`` source) from ``defaults``: its task and context read from its metadata,
    ``max_model_len`` = that context capped at ``defaults.max_model_len``, one bucket per
    ``defaults.bucket_max_input_tokens`` value below it and one at it, each on
    ``defaults.slice`` (else ``first_slice``) with a continuous batcher (generate) or a dynamic
    one (embed).

    Raises:
        ConfigError: the source does not exist or is a file but no ``.gguf``, its metadata is
            unreadable, names no context, or an architecture that is neither a decoder nor a known encoder.
    """
    try:
        path = resolve_source(source)
    except ModelSourceError as exc:
        raise ConfigError(str(exc), param="source") from None
    if path.is_file() and path.suffix != ".gguf":
        raise ConfigError(f"source {source!r}: a file source must be a .gguf file", param="source")
    task, context_tokens = _read_gguf(path) if path.is_file() else _read_folder(path)
    max_model_len = min(context_tokens, defaults.max_model_len or context_tokens)
    limits = sorted({t for t in defaults.bucket_max_input_tokens if t < max_model_len}) + [max_model_len]
    slice_name = defaults.slice or first_slice
    buckets = [BucketConfig(max_input_tokens=t, batcher=_batcher(task, defaults), slice=slice_name) for t in limits]
    return ModelConfig(
        name=name, source=source, task=task, dtype=defaults.dtype, max_model_len=max_model_len, buckets=buckets,
        load=defaults.load, pinned=defaults.pinned, idle_unload_s=defaults.idle_unload_s,
    )


def _batcher(task: Task, defaults: ModelDefaultsConfig) -> ContinuousBatcherConfig | DynamicBatcherConfig:
    """The batcher of a default bucket of a ``task`` model."""
    if task == "generate":
        # Every running sequence decodes a token per step, so the budget holds max_num_seqs.
        max_num_batched_tokens = max(defaults.max_num_batched_tokens, defaults.max_num_seqs)
        return ContinuousBatcherConfig(
            kind="continuous", max_num_seqs=defaults.max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        )
    return DynamicBatcherConfig(kind="dynamic", max_batch_size=defaults.max_batch_size, max_queue_delay_ms=defaults.max_queue_delay_ms)


def _read_folder(folder: Path) -> tuple[Task, int]:
    """The task and context (tokens) of a Hugging Face folder, from its ``config.json``.

    Raises:
        ConfigError: no readable ``config.json``, no context in it, or an unknown architecture.
    """
    config_path = folder / "config.json"
    try:
        hf_config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{config_path}: cannot read the model's config: {exc}", param="source") from None
    task = _folder_task(folder, hf_config)
    context = next((hf_config[key] for key in CONTEXT_KEYS if isinstance(hf_config.get(key), int)), None)
    if context is None:
        raise ConfigError(f"{config_path}: none of {', '.join(CONTEXT_KEYS)} is set; give the model a models: entry", param="source")
    if hf_config.get("model_type") in OFFSET_POSITION_MODEL_TYPES:
        context -= int(hf_config.get("pad_token_id") or 0) + 1
    return task, int(context)


def _folder_task(folder: Path, hf_config: dict[str, Any]) -> Task:
    """``generate`` for a decoder, ``embed`` for an encoder or a sentence-transformers folder.

    Raises:
        ConfigError: neither, naming the folder and its architectures.
    """
    architectures = [str(a) for a in hf_config.get("architectures") or []]
    model_type = hf_config.get("model_type")
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        return "generate"
    if any(a in ENCODER_ARCHITECTURES or a.endswith("ForMaskedLM") for a in architectures):
        return "embed"
    if any((folder / name).is_file() for name in SENTENCE_TRANSFORMERS_FILES):
        return "embed"
    if not architectures and model_type in DECODER_MODEL_TYPES:
        return "generate"
    raise ConfigError(
        f"{folder}: architecture {architectures or model_type!r} is neither a causal LM (generate) nor a known "
        f"encoder (embed); give it a models: entry named {folder.name!r} with its task, or remove it",
        param="models_dir",
    )


def _read_gguf(gguf_path: Path) -> tuple[Task, int]:
    """The task (always ``generate``) and context (tokens) of a GGUF file, from its metadata
    (``general.architecture`` and ``<architecture>.context_length``, the key transformers maps
    to ``max_position_embeddings``).

    Raises:
        ConfigError: the file is no GGUF, or names no architecture or context length.
    """
    stat = gguf_path.stat()
    architecture, context_tokens = _gguf_context(str(gguf_path.resolve()), stat.st_size, stat.st_mtime_ns)
    if architecture is None or context_tokens is None:
        raise ConfigError(
            f"{gguf_path}: GGUF metadata has no general.architecture or <architecture>.context_length "
            f"(architecture {architecture!r})",
            param="source",
        )
    return "generate", context_tokens


# Keyed by the file's identity: GGUFReader parses every metadata array (SmolLM2's 49,152 token
# strings: 2.3 s here) although the tensors stay memory-mapped and unread.
@functools.lru_cache(maxsize=256)
def _gguf_context(path: str, size_bytes: int, mtime_ns: int) -> tuple[str | None, int | None]:
    """``(architecture, context length in tokens)`` of the GGUF file at ``path`` (of that size
    and modification time), each None when its metadata lacks it.

    Raises:
        ConfigError: the file is no readable GGUF.
    """
    from gguf import GGUFReader

    try:
        fields = GGUFReader(path).fields
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read GGUF metadata: {exc}", param="source") from None
    architecture_field = fields.get("general.architecture")
    architecture = architecture_field.contents() if architecture_field is not None else None
    if not isinstance(architecture, str):
        return None, None
    context_field = fields.get(f"{architecture}.context_length")
    return architecture, int(context_field.contents()) if context_field is not None else None


def config_for_sources(sources: list[str], models_dir: str | None) -> GatewayConfig:
    """The config of ``sluice serve --model SOURCE ... [--models-dir DIR]`` with no config file:
    one CPU slice ``cpu0`` (threads: the CPUs, at most ``MAX_DEFAULT_NUM_THREADS``; 2 GiB of KV
    memory), each source (a ``.gguf`` file, a Hugging Face folder or a ``pkg:`` source) as a
    model loaded at start, named after its file stem or folder name, and ``models_dir`` (whose
    models load on demand, see :func:`expand_models_dir`).

    Raises:
        ConfigError: a source is unusable or two share a name (``param="--model"``), or neither
            a source nor ``models_dir`` is given.
    """
    num_threads = max(1, min(os.cpu_count() or 1, MAX_DEFAULT_NUM_THREADS))
    slice_config = SliceConfig(
        name=DEFAULT_SLICE, device="cpu", num_threads=num_threads, kv_cache_memory_bytes=ByteSize(DEFAULT_KV_CACHE_MEMORY_BYTES)
    )
    # Not valid by itself (no models yet): add_sources adds them and validates the whole.
    base = GatewayConfig.model_construct(
        slices=[slice_config], models=[], models_dir=models_dir, model_defaults=ModelDefaultsConfig()
    )
    if not sources and models_dir is None:
        raise ConfigError("--model: name a model (--model PATH) or a folder of models (--models-dir DIR)", param="--model")
    return add_sources(base, sources, models_dir)


def add_sources(config: GatewayConfig, sources: list[str], models_dir: str | None) -> GatewayConfig:
    """``config`` with a model loaded at start per source (as :func:`config_for_sources` names
    and builds them, from ``config.model_defaults``) and ``models_dir`` in place of its own when
    given; validated again.

    Raises:
        ConfigError: a source is unusable, or its name is already a model's (``param="--model"``).
    """
    defaults = config.model_defaults.model_copy(update={"load": "at_start"})
    first_slice = defaults.slice or config.slices[0].name
    models = list(config.models)
    for source in sources:
        name = _source_name(source)
        clash = next((m for m in models if m.name == name), None)
        if clash is not None:
            raise ConfigError(
                f"--model: {source!r} would be served as {name!r}, the name of model {clash.source!r}; "
                "rename the file or folder, or give it a models: entry",
                param="--model",
            )
        models.append(default_model_config(name, source, defaults, first_slice))
    dir_field = {"models_dir": models_dir} if models_dir is not None else {}
    return _with_models(config, models, "--model", **dir_field)


def _source_name(source: str) -> str:
    """The model name of a ``--model`` source: its file stem or folder name.

    Raises:
        ConfigError: the source does not exist, or its name does not fit ``ModelConfig.name``.
    """
    try:
        path = resolve_source(source)
    except ModelSourceError as exc:
        raise ConfigError(f"--model: {exc}", param="--model") from None
    name = model_name(path)
    if not MODEL_NAME_PATTERN.match(name):
        raise ConfigError(f"--model: {source!r}: its name {name!r} has characters outside A-Za-z0-9_.:/-", param="--model")
    return name
