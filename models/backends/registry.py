"""The backend registry: a kind (``eager``, ``compiled``, ``onnx-fp32``, ``onnx-int8``, ``lean``,
``lean-int8``, ``lean-int4``, ``lean-int8-bf16``, ``lean-int4-bf16``, ``lean-int8-q8a``,
``lean-int4-q8a``) to a factory, for encoders and for decoders.

Each backend module registers its own kinds (its ``ENCODER_FACTORIES`` / ``DECODER_FACTORIES``);
this module only merges them. Importing a backend module is cheap: the heavy libraries
(ONNX Runtime, onnx, TorchInductor) are imported when a factory first builds a backend, so a
gateway that never runs a kind never loads its library. A new kind is one more module and one
more line here; nothing in ``gateway/`` or the runners changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from models.backends import compiled, eager, lean, onnx
from models.backends.base import BackendUnavailableError, DecoderBackend, DecoderParts, EncoderBackend, EncoderParts

ENCODER_FACTORIES: dict[str, Callable[[EncoderParts], EncoderBackend]] = {
    **eager.ENCODER_FACTORIES,
    **compiled.ENCODER_FACTORIES,
    **onnx.ENCODER_FACTORIES,
}
DECODER_FACTORIES: dict[str, Callable[[DecoderParts], DecoderBackend]] = {
    **eager.DECODER_FACTORIES,
    **compiled.DECODER_FACTORIES,
    **lean.DECODER_FACTORIES,
}
# The decoder kinds that run LoRA adapters (:mod:`models.lora_slots`): eager through forward hooks
# on its modules, the lean kinds in their own forward. ``compiled`` traces the modules' forward
# into fixed graphs that hooks and per-step adapter rows cannot reach.
LORA_DECODER_KINDS = frozenset({*eager.DECODER_FACTORIES, *lean.DECODER_FACTORIES})
F = TypeVar("F")
# A bucket's configured ``(backend, quantization)`` to the kind it runs (``auto`` goes to a gate).
CONFIGURED_KINDS: dict[tuple[str, str], str] = {
    ("eager", "none"): "eager",
    ("compiled", "none"): "compiled",
    ("onnx", "none"): "onnx-fp32",
    ("onnx", "int8"): "onnx-int8",
    ("lean", "none"): "lean",
    ("lean", "int8"): "lean-int8",
    ("lean", "int4"): "lean-int4",
}


def build_encoder(kind: str, parts: EncoderParts) -> EncoderBackend:
    """The encoder backend of ``kind``, built (not yet warmed) from ``parts``.

    Raises:
        BackendUnavailableError: an unknown kind, or it cannot be built here.
    """
    return _factory(ENCODER_FACTORIES, kind, "encoder")(parts)


def build_decoder(kind: str, parts: DecoderParts) -> DecoderBackend:
    """The decoder backend of ``kind`` over the runner's ``parts`` (compiled lazily: the runner's
    warm-up compiles it).

    Raises:
        BackendUnavailableError: an unknown kind, or it cannot be built here.
    """
    return _factory(DECODER_FACTORIES, kind, "decoder")(parts)


def supports_lora(kind: str) -> bool:
    """Whether a runner of decoder ``kind`` can run LoRA adapters (``max_loras > 0``): a gate must
    not pick another kind for a LoRA-enabled bucket."""
    return kind in LORA_DECODER_KINDS


def _factory(factories: Mapping[str, F], kind: str, role: str) -> F:
    """The factory of ``kind`` in ``factories``; an unknown kind is :class:`BackendUnavailableError`."""
    factory = factories.get(kind)
    if factory is None:
        raise BackendUnavailableError(f"unknown {role} backend {kind!r} (known: {', '.join(sorted(factories))})")
    return factory
