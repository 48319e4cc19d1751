"""LoRA on the eager path: forward hooks on a Hugging Face decoder's target linears.

The eager backend calls the Hugging Face modules, whose linears (``nn.Linear`` or
:class:`models.cpu_linear.PackedLinear`) know nothing of the step. A forward hook on each target
module adds the step's LoRA term to its output in place (:meth:`models.lora_slots.LoraBatch.apply`).
The step's :class:`~models.lora_slots.LoraBatch` reaches the hooks through a thread-local that
:class:`models.backends.eager.EagerDecoder` sets around its forward (:func:`active_lora`):
several runners (a model's buckets) may share one decoder module and run it on their own
threads, each with its own slots. Hooks are installed once per decoder, by the first runner
built on it with ``max_loras > 0``; outside :func:`active_lora` (a runner without LoRA, a step
without adapters, ``model.generate``) they return at once. Only eager runs them: the lean
backend shares the modules' weights but never calls the modules, and applies LoRA itself.

The hooks stay on the modules for the process's life: a ``compiled`` runner built later on the
same decoder object would trace them (they read a thread-local), so a LoRA bucket and a
``compiled`` bucket should not share one loaded model.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from models.lora import LORA_TARGET_MODULES, TARGET_MODULE_OWNERS
from models.lora_slots import LoraBatch

_HOOKED = "_sluice_lora_hooked"


class _Active(threading.local):
    batch: LoraBatch | None = None


_active = _Active()


@contextlib.contextmanager
def active_lora(batch: LoraBatch | None) -> Iterator[None]:
    """While open, this thread's hooked modules add ``batch``'s LoRA terms (``None``: none)."""
    previous, _active.batch = _active.batch, batch
    try:
        yield
    finally:
        _active.batch = previous


def install_lora_hooks(decoder: Any) -> int:
    """Hook every :data:`models.lora.LORA_TARGET_MODULES` module of ``decoder``'s layers (a
    Hugging Face Llama-family ``model.model``), once per decoder; returns the hooks added (0
    when already hooked)."""
    if getattr(decoder, _HOOKED, False):
        return 0
    count = 0
    for index, layer in enumerate(decoder.layers):
        for projection in LORA_TARGET_MODULES:
            module: torch.nn.Module = getattr(getattr(layer, TARGET_MODULE_OWNERS[projection]), projection)
            module.register_forward_hook(_hook(index, projection))
            count += 1
    setattr(decoder, _HOOKED, True)
    return count


def _hook(layer: int, projection: str) -> Callable[[torch.nn.Module, tuple[Any, ...], torch.Tensor], None]:
    def add_lora(module: torch.nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        batch = _active.batch
        if batch is None:
            return
        x = inputs[0]
        # Both are [1, T, features] and contiguous (fresh from the product): views, so y changes in place.
        batch.apply(layer, projection, x.reshape(-1, x.shape[-1]), output.view(-1, output.shape[-1]))

    return add_lora
