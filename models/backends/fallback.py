"""One fallback for every backend: the first failure hands the batch, and every later one, to eager."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from models.backends.base import HiddenStatesBackend

B = TypeVar("B", bound=HiddenStatesBackend)

# Called once as ``on_fallback(primary_name, error)`` when the primary fails while serving.
OnFallback = Callable[[str, Exception], None]


class FallbackRunner(Generic[B]):
    """``primary`` until it raises, then ``fallback`` (eager) for good; for encoders and decoders
    alike (both run ``hidden_states``).

    The failing batch is run again on ``fallback``, once, so its requests still get answers;
    ``on_fallback(primary_name, error)`` is called once, when the switch happens (the gateway
    logs ``backend_failed`` and shows the bucket's running backend as ``eager``). The primary is
    never tried again. Called only from the bucket's worker thread.

    Args:
        primary: the gated or configured backend (``compiled``, ``onnx-fp32``, ...).
        fallback: the eager backend of the same model, same inputs.
        on_fallback: see above; ``None`` to switch silently.
    """

    def __init__(self, primary: B, fallback: B, on_fallback: OnFallback | None = None):
        self.primary, self.fallback, self.on_fallback = primary, fallback, on_fallback
        self.has_failed = False

    @property
    def active(self) -> B:
        """The backend batches run on now."""
        return self.fallback if self.has_failed else self.primary

    @property
    def name(self) -> str:
        """The active backend's label (``eager`` once the primary failed)."""
        return self.active.name

    def hidden_states(self, *inputs: Any, **options: Any) -> torch.Tensor:
        """The active backend's ``hidden_states(*inputs, **options)``; a primary that raises
        hands these inputs to the fallback (its error is reported, not raised)."""
        if not self.has_failed:
            try:
                return self.primary.hidden_states(*inputs, **options)
            except Exception as exc:  # any failure of an optional backend: eager takes over
                self.has_failed = True
                if self.on_fallback is not None:
                    self.on_fallback(self.primary.name, exc)
        return self.fallback.hidden_states(*inputs, **options)
