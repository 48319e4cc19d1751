"""Packed attention for Hugging Face decoders: many sequences' tokens in one forward, no padding.

The runner calls the model's decoder with ``input_ids`` of shape ``[1, T]`` holding the new
tokens of every scheduled sequence back to back, their absolute ``position_ids`` (so RoPE is
right), and a :class:`PackedStep` as the keyword ``sluice_step``. Hugging Face passes that keyword
down to the registered attention function, which writes each segment's new K/V into the
sequence's own cache and attends over that sequence's cached prefix only.

Without ``sluice_step`` (for example ``model.generate`` on the same model) the function is plain
SDPA attention, so the model stays usable as a reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from models.kv_cache import SequenceKVCache

ATTENTION_NAME = "sluice_packed"


@dataclass(frozen=True)
class Segment:
    """One sequence's slice of a packed step.

    ``start`` and ``num_tokens`` locate its new tokens in the packed ``[1, T]`` input;
    ``position`` is the absolute position of the first of them (tokens already in ``kv``).
    """

    start: int
    num_tokens: int
    position: int
    kv: SequenceKVCache


@dataclass(frozen=True)
class PackedStep:
    """Everything the attention function needs for one packed forward."""

    segments: list[Segment]


def packed_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over per-sequence caches.

    Args:
        query: ``[1, num_heads, T, head_dim]``; key, value: ``[1, num_kv_heads, T, head_dim]``,
            RoPE already applied.
    Returns:
        ``([1, T, num_heads, head_dim], None)``, the layout Hugging Face attention functions return.
    """
    step: PackedStep | None = kwargs.get("sluice_step")
    if step is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    layer = module.layer_idx
    key_value = torch.stack((key[0], value[0]))  # [2, num_kv_heads, T, head_dim]
    outputs = []
    for seg in step.segments:
        end = seg.start + seg.num_tokens
        seg.kv.write(layer, seg.position, key_value[:, :, seg.start : end])
        k, v = seg.kv.view(layer, seg.position + seg.num_tokens)
        q = query[:, :, seg.start : end]
        outputs.append(_attend(q, k, v, seg.position, scaling))
    out = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    return out.transpose(1, 2).contiguous(), None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: int, scaling: float | None) -> torch.Tensor:
    """Causal attention of ``q`` (``[1, H, n, D]``, first query at ``position``) over ``k``/``v``."""
    n = q.shape[2]
    if n == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=True)
    if position == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    # A chunk after a cached prefix: query i sees keys 0 .. position + i (bottom-right causal).
    q_pos = torch.arange(position, position + n, device=q.device).unsqueeze(1)
    k_pos = torch.arange(k.shape[2], device=q.device).unsqueeze(0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=k_pos <= q_pos, scale=scaling, enable_gqa=True)


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


_registered = False


def register_attention() -> None:
    """Register :func:`packed_attention` (and SDPA masks) with transformers under ``ATTENTION_NAME``."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _mask)
    _registered = True
