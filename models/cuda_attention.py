"""Which paged-attention kernels serve a call: ours in Triton for CUDA tensors over a float pool.

:func:`models.paged_attention.paged_decode_attention` and :func:`models.attention.attend_packed`
ask :func:`triton_for` before each call. Triton is imported here, lazily, on the first CUDA
call: CPU serving never imports it and needs it not installed (it is a test extra; CUDA builds of
torch bring it). Where it cannot be imported on a CUDA machine, one warning
(``triton_unavailable``) is logged and the torch paths serve CUDA calls: correct, but decode then
reads context lengths on the host, so it cannot be captured in a CUDA graph. int8 pools stay on
the torch paths always (the Triton kernels read float pools only).
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType

import structlog
import torch

log = structlog.get_logger(__name__)

TRITON_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MODULE = "models.triton_attention"

_lock = threading.Lock()
_loaded: list[ModuleType | None] = []  # empty until the first import attempt, then its result


def triton_for(query: torch.Tensor, key_cache: torch.Tensor) -> ModuleType | None:
    """:mod:`models.triton_attention` when a paged-attention call on ``query`` over a pool of
    ``key_cache``'s dtype runs the Triton kernels (CUDA tensors, a float pool, Triton importable:
    imported on the first such call), else ``None``. Host metadata only."""
    if query.device.type != "cuda" or key_cache.dtype not in TRITON_CACHE_DTYPES:
        return None
    return triton_kernels()


def triton_kernels() -> ModuleType | None:
    """:mod:`models.triton_attention`, imported on the first call; ``None`` (with one warning,
    logged once per process) when Triton cannot be imported."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            _loaded.append(_import_kernels())
    return _loaded[0]


def _import_kernels() -> ModuleType | None:
    try:
        return importlib.import_module(TRITON_MODULE)
    except ImportError as exc:
        log.warning("triton_unavailable", reason=f"{type(exc).__name__}: {exc}", fallback="torch")
        return None
