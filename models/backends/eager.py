"""The ``eager`` backends: the PyTorch modules as loaded, the reference every gate compares with
and what every other backend falls back to."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from models.backends.base import DecoderBackend, DecoderParts, EncoderBackend, EncoderParts, warm_up_encoder
from models.lora_hooks import active_lora
from models.module_call_guard import module_calls


class EagerEncoder:
    """The loaded PyTorch encoder, called as is (see :class:`models.backends.base.EncoderBackend`)."""

    name = "eager"

    def __init__(self, model: Any):
        self.model = model
        self.device = next(model.parameters()).device

    @module_calls
    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[batch, seq]`` ids and mask in, ``[batch, seq, hidden]`` float32 out."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float()

    def warm_up(self, shapes: Sequence[tuple[int, int]]) -> float:
        """Run once at each ``(batch, seq)`` shape; returns the seconds it took."""
        return warm_up_encoder(self, shapes, self.device)


class EagerDecoder:
    """The decoder module as loaded, called with the packed step (see
    :class:`models.backends.base.DecoderBackend`)."""

    name = "eager"

    def __init__(self, decoder: Any, attention_mask: torch.Tensor):
        self.decoder = decoder
        self.attention_mask = attention_mask

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, step: Any) -> torch.Tensor:
        """Last hidden states ``[1, T, hidden_size]`` of the packed tokens; the step's LoRA rows
        (``step.lora``) through the decoder's hooks (:mod:`models.lora_hooks`)."""
        lora = getattr(step, "lora", None)
        with active_lora(lora) if lora is not None else contextlib.nullcontext():
            out = self.decoder(
                input_ids=input_ids, position_ids=position_ids, attention_mask=self.attention_mask, use_cache=False, sluice_step=step
            )
        hidden: torch.Tensor = out.last_hidden_state
        return hidden


def _eager_encoder(parts: EncoderParts) -> EncoderBackend:
    return EagerEncoder(parts.model)


def _eager_decoder(parts: DecoderParts) -> DecoderBackend:
    return EagerDecoder(parts.decoder, parts.attention_mask)


ENCODER_FACTORIES: dict[str, Callable[[EncoderParts], EncoderBackend]] = {"eager": _eager_encoder}
DECODER_FACTORIES: dict[str, Callable[[DecoderParts], DecoderBackend]] = {"eager": _eager_decoder}
