"""Loading a model and its tokenizer from local files for one task."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from models.kv_cache import KVShape
from models.source import model_folder

Task = Literal["generate", "embed"]

DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


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


def load_model(
    name: str, source: str, task: Task, dtype: str, device: str, cache_dir: Path, weights: bool = True
) -> LoadedModel:
    """Load ``source`` for ``task`` on ``device`` with ``dtype`` weights; with ``weights=False``,
    only its tokenizer, config and generation config (no model instantiated: milliseconds and
    no weight memory).

    Generation models load as ``AutoModelForCausalLM`` with Sluice's packed attention registered
    (see :mod:`models.attention`); embedding models as ``AutoModel``.

    Raises:
        ModelSourceError: the source does not resolve to a model folder.
        OSError, ValueError: transformers cannot load the folder.
    """
    from transformers import AutoConfig, AutoTokenizer

    started = time.perf_counter()
    folder = model_folder(source, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = _load_weights(folder, task, dtype, device) if weights else None
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
    """Bytes the weights of the model in ``folder`` take once loaded as ``dtype`` on ``device``:
    its parameters and buffers counted on a model built on torch's ``meta`` device from the
    folder's ``config.json`` (no weight is read), each parameter at ``dtype``'s size (buffers at
    their own); a CPU decoder's linear tied to another weight (the LM head to the embedding)
    counted twice, as :func:`~models.cpu_linear.prepack_linears` packs a copy of it. What
    :func:`gateway.memory.weight_bytes` measures after the load (SmolLM2: 651,306,496 both).

    Raises:
        OSError, ValueError: the folder has no usable ``config.json``.
    """
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    factory = AutoModelForCausalLM if task == "generate" else AutoModel
    with torch.device("meta"):
        model = factory.from_config(config, dtype=getattr(torch, DTYPES[dtype]))
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    if task == "generate" and device == "cpu" and dtype in ("float32", "bfloat16"):
        linear_weights = {id(m.weight) for m in model.modules() if type(m) is torch.nn.Linear}
        tied = {id(p): p for m in model.modules() if type(m) is not torch.nn.Linear for p in m.parameters(recurse=False)}
        total += sum(p.numel() * p.element_size() for key, p in tied.items() if key in linear_weights)
    return total


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
