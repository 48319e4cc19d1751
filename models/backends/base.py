"""What every backend shares: the protocols, what a factory builds from, and the one error.

A backend runs one model's forward and returns its last hidden states. Encoder and decoder
backends differ in their inputs only, so one :class:`models.backends.fallback.FallbackRunner`
wraps either kind.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

Quantization = Literal["none", "int8"]


class BackendUnavailableError(RuntimeError):
    """A backend cannot be built here (a library missing, an export or a compile failed, an
    unknown kind); the message says why. The caller falls back to ``eager``."""


class HiddenStatesBackend(Protocol):
    """Anything that runs a forward to the last hidden states: the seam the fallback wraps.

    ``name`` is the kind's label, as gate records and logs use it (``eager``, ``compiled``,
    ``onnx-fp32``, ``onnx-int8``).
    """

    @property
    def name(self) -> str: ...

    def hidden_states(self, *inputs: Any, **options: Any) -> torch.Tensor:
        """The last hidden states of one batch (inputs per kind: see the two protocols below)."""
        ...


class EncoderBackend(Protocol):
    """Runs an encoder (BERT and kin) over a padded batch."""

    @property
    def name(self) -> str: ...

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The last hidden states.

        Args:
            input_ids: ``[batch, seq]`` int64 token ids (padded with the pad id).
            attention_mask: ``[batch, seq]`` int64, 1 for real tokens, 0 for padding.
        Returns:
            ``[batch, seq, hidden]`` float32 on the caller's device.
        """
        ...

    def warm_up(self, shapes: Sequence[tuple[int, int]]) -> float:
        """Run once at each ``(batch, seq)`` shape so no request pays for compilation or
        session set-up; returns the seconds it took.

        Raises:
            BackendUnavailableError: the backend failed to compile or run.
        """
        ...


class DecoderBackend(Protocol):
    """Runs the packed decoder forward of :class:`models.causal_lm.CausalLMRunner` (the runner
    warms it up by running steps through it)."""

    @property
    def name(self) -> str: ...

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, step: Any) -> torch.Tensor:
        """Last hidden states ``[1, T, hidden_size]`` of the packed tokens.

        Args:
            input_ids, position_ids: ``[1, T]`` int64, every scheduled token of the step.
            step: the step's :class:`models.attention.PackedStep` (slots, block tables, prefills).
        """
        ...


@dataclass(frozen=True)
class EncoderParts:
    """What an encoder factory builds a backend from.

    Fields:
        model: the loaded Hugging Face encoder (``AutoModel``), in eval mode.
        folder: the model folder it was loaded from (keys export caches).
        cache_dir: Sluice's cache folder (exports go below it).
        num_threads: intra-op threads the backend may use.
        device: ``"cpu"`` or ``"cuda[:N]"``.
    """

    model: Any
    folder: Path
    cache_dir: Path
    num_threads: int
    device: str


@dataclass(frozen=True)
class DecoderParts:
    """What a decoder factory builds a backend from: the runner's decoder module
    (``model.model``), its KV pool (:class:`models.kv_cache.PagedKVCache`), its prepared
    dummy 4D attention mask, and the model's output embedding module (``[hidden] -> [vocab]``).

    A backend that also has ``logits(hidden: [R, hidden_size]) -> [R, vocab_size]`` float32
    owns the LM head: the runner calls it instead of ``lm_head`` while that backend serves.
    """

    decoder: Any
    kv_cache: Any
    attention_mask: torch.Tensor
    lm_head: Any = None


def warm_up_encoder(backend: EncoderBackend, shapes: Sequence[tuple[int, int]], device: torch.device | str = "cpu") -> float:
    """Call ``backend`` once at each ``(batch, seq)`` shape with all-ones ids and masks (id 1 is
    a real token in every BERT vocabulary); return the seconds it took."""
    started = time.perf_counter()
    for batch, seq in shapes:
        ids = torch.ones((batch, seq), dtype=torch.long, device=device)
        backend.hidden_states(ids, torch.ones_like(ids))
    return time.perf_counter() - started
