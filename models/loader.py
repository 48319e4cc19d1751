"""Loading a model and its tokenizer from local files for one task."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from models.kv_cache import KVShape
from models.source import model_folder

Task = Literal["generate", "embed"]

DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# One weights load at a time in a process: transformers' from_pretrained builds the model under
# process-wide state (its meta-device initialisation), and two loads on two threads at once
# broke each other ("Cannot copy out of meta tensor", seen with two models loading on demand).
_WEIGHTS_LOCK = threading.Lock()

# Tokenizers of unloaded models, by folder, for the model's next load (least recently kept
# first out past MAX_KEPT_TOKENIZERS): loading SmolLM2's took 0.11 s of a 0.75 s reload, and the
# gateway's prompt encoder of the same tokenizer object is kept too (another 0.22 s).
MAX_KEPT_TOKENIZERS = 8
_kept_tokenizers: OrderedDict[Path, Any] = OrderedDict()
_kept_tokenizers_lock = threading.Lock()


def keep_tokenizer(folder: Path, tokenizer: Any) -> None:
    """Keep the tokenizer of a model being unloaded for the next :func:`load_model` of ``folder``
    (one model uses a tokenizer object at a time: a load takes it out)."""
    with _kept_tokenizers_lock:
        _kept_tokenizers[folder] = tokenizer
        _kept_tokenizers.move_to_end(folder)
        while len(_kept_tokenizers) > MAX_KEPT_TOKENIZERS:
            _kept_tokenizers.popitem(last=False)


def kept_tokenizers() -> list[Any]:
    """The tokenizers kept for later loads (:func:`keep_tokenizer`)."""
    with _kept_tokenizers_lock:
        return list(_kept_tokenizers.values())


PreloadKey = tuple[Path, str, str, str]  # (model folder, task, dtype, device)


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, or to tokenize for: its tokenizer, its config, and facts the
    gateway needs; its weights on ``device`` unless it was loaded without them.

    ``model`` is ``None`` when loaded with ``weights=False`` (its buckets run in another
    process: the gateway only tokenizes and reads the KV geometry). ``model_config`` is the
    Hugging Face config. ``eos_token_ids`` are the ids that end generation (tokenizer and
    generation config merged). ``dtype_bytes`` is bytes per element of the weights and of the
    KV cache, which uses the same dtype. ``load_s`` is the wall time the load took, in seconds.
    """

    name: str
    task: Task
    folder: Path
    model: Any
    tokenizer: Any
    device: str
    eos_token_ids: frozenset[int]
    load_s: float
    model_config: Any
    dtype_bytes: int

    @property
    def has_weights(self) -> bool:
        return self.model is not None

    def kv_shape(self) -> KVShape:
        """The decoder's KV geometry (generation models only)."""
        return KVShape.from_config(self.model_config)


# Models loaded with weights before this process forked, by :data:`PreloadKey`: the first
# :func:`load_model` asking for one takes it (see :func:`preload`). Empty unless a process that
# forks others put models here (the end-to-end tests' server zygote).
_preloaded: dict[PreloadKey, LoadedModel] = {}


def preload(source: str, task: Task, dtype: str, device: str, cache_dir: Path) -> LoadedModel:
    """Load a model with its weights and keep it for the first :func:`load_model` of the same
    folder, task, dtype and device, here or in a process forked from here afterwards, which takes
    it instead of loading again (a fork shares its pages copy-on-write: nothing is read, prepacked
    or faulted in again). For a process that forks many servers of the same models, as the
    end-to-end tests do (``tests/e2e/zygote.py``); a taken model is not kept for a second load.

    Raises:
        As :func:`load_model`.
    """
    loaded = load_model("", source, task, dtype, device, cache_dir)
    _preloaded[(loaded.folder, task, dtype, device)] = loaded
    return loaded


def load_model(
    name: str, source: str, task: Task, dtype: str, device: str, cache_dir: Path, weights: bool = True
) -> LoadedModel:
    """Load ``source`` for ``task`` on ``device`` with ``dtype`` weights; with ``weights=False``,
    only its tokenizer, config and generation config (no model instantiated: milliseconds and
    no weight memory).

    Generation models load as ``AutoModelForCausalLM`` with Sluice's packed attention registered
    (see :mod:`models.attention`); embedding models as ``AutoModel``. A model :func:`preload`
    kept for the same folder, task, dtype and device is taken instead (``load_s``: the lookup),
    and a tokenizer :func:`keep_tokenizer` kept for the folder is taken instead of loading one.

    Raises:
        ModelSourceError: the source does not resolve to a model folder.
        OSError, ValueError: transformers cannot load the folder.
    """
    from transformers import AutoConfig, AutoTokenizer

    started = time.perf_counter()
    folder = model_folder(source, cache_dir)
    if weights and (taken := _preloaded.pop((folder, task, dtype, device), None)) is not None:
        return replace(taken, name=name, load_s=time.perf_counter() - started)
    with _kept_tokenizers_lock:
        tokenizer = _kept_tokenizers.pop(folder, None)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    if weights:
        with _WEIGHTS_LOCK:
            model = _load_weights(folder, task, dtype, device)
    else:
        model = None
    model_config = model.config if model is not None else AutoConfig.from_pretrained(folder)
    generation_config = getattr(model, "generation_config", None) if model is not None else _generation_config(folder, model_config)
    return LoadedModel(
        name=name,
        task=task,
        folder=folder,
        model=model,
        tokenizer=tokenizer,
        device=device,
        eos_token_ids=_eos_token_ids(generation_config, tokenizer),
        load_s=time.perf_counter() - started,
        model_config=model_config,
        dtype_bytes=DTYPE_BYTES[dtype],
    )


def estimate_weight_bytes(folder: Path, task: Task, dtype: str, device: str) -> int:
    """Bytes the weights of the model in ``folder`` take once loaded as ``dtype`` on ``device``,
    from its safetensors headers (no weight is read, no torch state is touched, so it is safe
    beside a load on another thread): each floating tensor at ``dtype``'s size, others at their
    own; a CPU decoder's tied LM head counted again, as :func:`~models.cpu_linear.prepack_linears`
    packs a copy of the embedding it shares. A folder without safetensors counts its ``.bin``
    files' sizes. What :func:`gateway.memory.weight_bytes` measures after the load, less
    non-persistent buffers (SmolLM2: 651,306,240 estimated, 651,306,496 measured).

    Raises:
        OSError, ValueError: the folder's config or a safetensors header cannot be read.
    """
    from transformers import AutoConfig

    tensors = _safetensors_tensors(folder)
    if not tensors:
        return sum(f.stat().st_size for f in folder.glob("*.bin"))
    target_bytes = DTYPE_BYTES[dtype]
    sizes = {name: numel * (target_bytes if kind in _FLOAT_KINDS else _KIND_BYTES.get(kind, 4)) for name, (numel, kind) in tensors.items()}
    total = sum(sizes.values())
    config = AutoConfig.from_pretrained(folder)
    if task == "generate" and device == "cpu" and dtype in ("float32", "bfloat16") and getattr(config, "tie_word_embeddings", False):
        total += sum(size for name, size in sizes.items() if name.endswith(_EMBEDDING_SUFFIXES))
    return total


# The format's own limit on a header (the safetensors crate refuses larger ones).
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
_FLOAT_KINDS = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
_KIND_BYTES = {"I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


def _safetensors_tensors(folder: Path) -> dict[str, tuple[int, str]]:
    """``name -> (element count, safetensors dtype)`` of every tensor in the folder's
    ``*.safetensors`` files, read from their headers (an 8-byte little-endian length, then JSON).

    Raises:
        ValueError: a header is longer than the format allows or not valid JSON.
    """
    import json
    import math

    tensors: dict[str, tuple[int, str]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as file:
            header_len = int.from_bytes(file.read(8), "little")
            if header_len > MAX_SAFETENSORS_HEADER_BYTES:  # a broken file: reading it all could take the machine's memory
                raise ValueError(f"{path}: not a readable safetensors file (a header of {header_len} bytes)")
            try:
                header = json.loads(file.read(header_len))
            except ValueError as exc:
                raise ValueError(f"{path}: not a readable safetensors file (its header: {exc})") from None
        for name, info in header.items():
            if name != "__metadata__":
                tensors[name] = (math.prod(info["shape"]), info["dtype"])
    return tensors


def _load_weights(folder: Path, task: Task, dtype: str, device: str) -> Any:
    """The model in ``folder`` with ``dtype`` weights on ``device``, in eval mode; a decoder
    with Sluice's attention, fused norms and prepacked linears."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    from models.attention import ATTENTION_NAME, register_attention

    torch_dtype = getattr(torch, DTYPES[dtype])
    model: Any
    if task == "generate":
        register_attention()
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, attn_implementation=ATTENTION_NAME)
    else:
        model = AutoModel.from_pretrained(folder, dtype=torch_dtype)
    model.to(device).eval()
    if task == "generate":
        from models.cpu_linear import prepack_linears
        from models.fused_norm import fuse_rms_norms

        fuse_rms_norms(model)
        prepack_linears(model)
    return model


def _generation_config(folder: Path, model_config: Any) -> Any:
    """The folder's generation config, as ``from_pretrained`` of the model would set it."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(folder)
    except OSError:
        return GenerationConfig.from_model_config(model_config)


def _eos_token_ids(generation_config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    generation_eos = getattr(generation_config, "eos_token_id", None)
    for value in (generation_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
