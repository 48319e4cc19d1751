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


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: weights on ``device``, its tokenizer, and facts the gateway needs.

    ``eos_token_ids`` are the ids that end generation (tokenizer and generation config merged).
    ``load_s`` is the wall time the load took, in seconds.
    """

    name: str
    task: Task
    folder: Path
    model: Any
    tokenizer: Any
    device: str
    eos_token_ids: frozenset[int]
    load_s: float

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the weights (and of the KV cache, which uses the same dtype)."""
        return next(self.model.parameters()).element_size()

    def kv_shape(self) -> KVShape:
        """The decoder's KV geometry (generation models only)."""
        return KVShape.from_config(self.model.config)


def load_model(name: str, source: str, task: Task, dtype: str, device: str, cache_dir: Path) -> LoadedModel:
    """Load ``source`` for ``task`` on ``device`` with ``dtype`` weights.

    Generation models load as ``AutoModelForCausalLM`` with Sluice's packed attention registered
    (see :mod:`models.attention`); embedding models as ``AutoModel``.

    Raises:
        ModelSourceError: the source does not resolve to a model folder.
        OSError, ValueError: transformers cannot load the folder.
    """
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    from models.attention import ATTENTION_NAME, register_attention

    started = time.perf_counter()
    folder = model_folder(source, cache_dir)
    torch_dtype = getattr(torch, DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(folder)
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
    return LoadedModel(
        name=name,
        task=task,
        folder=folder,
        model=model,
        tokenizer=tokenizer,
        device=device,
        eos_token_ids=_eos_token_ids(model, tokenizer),
        load_s=time.perf_counter() - started,
    )


def _eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (generation_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
