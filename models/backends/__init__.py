"""Backends: one interface, several ways to run the same model's forward.

- ``eager``: the PyTorch module as loaded (always there; the reference every gate compares with).
- ``compiled``: ``torch.compile`` of the same module, warmed at the bucket's shapes at start.
- ``onnx-fp32``, ``onnx-int8``: an ONNX export run by ONNX Runtime, FP32 or INT8, encoders only.

A kind maps to a factory in :mod:`models.backends.registry`; each backend module registers its
own. A backend is picked per bucket (``backend: eager | compiled | onnx | auto`` in the config);
``auto`` takes what :mod:`policies.gating` enabled from a recorded benchmark at the bucket's
shapes, else ``eager``. Every backend keeps the eager module's numerics within the gate's
tolerance; one :class:`FallbackRunner` reruns a batch that fails at run time on ``eager`` and
stays there.

This package's root holds only the shared names (no backend module), so a backend module can
import them without importing its siblings.
"""

from models.backends.base import (
    BackendUnavailableError,
    DecoderBackend,
    DecoderParts,
    EncoderBackend,
    EncoderParts,
    HiddenStatesBackend,
    Quantization,
    warm_up_encoder,
)
from models.backends.eager import EagerDecoder, EagerEncoder
from models.backends.fallback import FallbackRunner, OnFallback

__all__ = [
    "BackendUnavailableError",
    "DecoderBackend",
    "DecoderParts",
    "EagerDecoder",
    "EagerEncoder",
    "EncoderBackend",
    "EncoderParts",
    "FallbackRunner",
    "HiddenStatesBackend",
    "OnFallback",
    "Quantization",
    "warm_up_encoder",
]
