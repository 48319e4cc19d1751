"""Backends: one interface, several ways to run the same model's forward.

- ``eager``: the PyTorch module as loaded (always there; the reference every gate compares with).
- ``compiled``: ``torch.compile`` of the same module, warmed at the bucket's shapes at start.
- ``onnx``: an ONNX export run by ONNX Runtime, FP32 or INT8 (``quantization``), encoders only.

A backend is picked per bucket (``backend: eager | compiled | onnx | auto`` in the config);
``auto`` takes what :mod:`policies.gating` enabled from a recorded benchmark at the bucket's
shapes, else ``eager``. Every backend keeps the eager module's numerics within the gate's
tolerance; a backend that fails at run time is replaced by ``eager`` for that bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch

BackendName = Literal["eager", "compiled", "onnx"]
Quantization = Literal["none", "int8"]


class BackendUnavailableError(RuntimeError):
    """A backend cannot be built here (a library missing, an export or a compile failed); the
    message says why. The caller falls back to ``eager``."""


class EncoderBackend(Protocol):
    """Runs an encoder (BERT and kin) over a padded batch.

    ``name`` is the label gate records and logs use: ``eager``, ``compiled``, ``onnx-fp32``,
    ``onnx-int8``.
    """

    name: str

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
        session set-up; returns the seconds it took."""
        ...


class EagerEncoder:
    """The loaded PyTorch encoder, called as is."""

    name = "eager"

    def __init__(self, model: Any):
        self.model = model
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float()

    def warm_up(self, shapes: Sequence[tuple[int, int]]) -> float:
        return warm_up_encoder(self, shapes, self.device)


def warm_up_encoder(backend: EncoderBackend, shapes: Sequence[tuple[int, int]], device: torch.device | str = "cpu") -> float:
    """Call ``backend`` once at each ``(batch, seq)`` shape with all-ones ids and masks (id 1 is
    a real token in every BERT vocabulary); return the seconds it took."""
    import time

    started = time.perf_counter()
    for batch, seq in shapes:
        ids = torch.ones((batch, seq), dtype=torch.long, device=device)
        backend.hidden_states(ids, torch.ones_like(ids))
    return time.perf_counter() - started


class FallbackEncoder:
    """``primary`` until it raises, then ``fallback`` (eager) for good.

    The failing batch is run again on ``fallback``, so its requests still get answers;
    ``on_fallback(primary_name, error)`` is called once, when the switch happens (the gateway
    logs it and shows the bucket's running backend as ``eager``).
    """

    def __init__(self, primary: EncoderBackend, fallback: EncoderBackend, on_fallback: Callable[[str, Exception], None]):
        self.primary, self.fallback, self.on_fallback = primary, fallback, on_fallback
        self.failed = False

    @property
    def name(self) -> str:
        return self.fallback.name if self.failed else self.primary.name

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if not self.failed:
            try:
                return self.primary.hidden_states(input_ids, attention_mask)
            except Exception as exc:  # any failure of an optional backend: eager takes over
                self.failed = True
                self.on_fallback(self.primary.name, exc)
        return self.fallback.hidden_states(input_ids, attention_mask)

    def warm_up(self, shapes: Sequence[tuple[int, int]]) -> float:
        return (self.fallback if self.failed else self.primary).warm_up(shapes)
