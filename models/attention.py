"""Packed paged attention for Hugging Face decoders: many sequences' tokens in one forward, no padding.

The runner calls the model's decoder with ``input_ids`` of shape ``[1, T]`` holding the new
tokens of every scheduled sequence back to back, their absolute ``position_ids`` (so RoPE is
right), and a :class:`PackedStep` as the keyword ``sluice_step``. Hugging Face passes that keyword
down to the registered attention function, which, per layer:

1. writes all T new K/V rows into the paged pool with one indexed copy (``slot_mapping``),
   converted to the pool's dtype (quantized to int8 with a scale per row for an int8 pool);
2. attends the *decode* rows (segments of one token) in one call of
   :func:`models.paged_attention.paged_decode_attention`, which reads K/V through block tables;
3. attends each *prefill* segment (a prompt or a prompt chunk) with SDPA: over its own fresh
   K/V when it starts at position 0, else over its prefix gathered from its blocks
   (a chunk after earlier chunks, or after blocks reused from the prefix cache), widened or
   dequantized to the query's dtype. With a bfloat16 or int8 pool, a segment at position 0 thus
   attends over exact K/V (as vLLM's prefill does) and a later chunk over the stored ones, its
   own tokens included. On CUDA over a float pool (:mod:`models.cuda_attention`), the segments
   at ``position > 0`` run instead in one launch of
   :func:`models.triton_attention.triton_paged_prefill_attention`, which reads the pool through
   their block tables (no gather); segments at position 0 stay on SDPA (flash attention on CUDA).

Decode segments come first in the packed input (the scheduler orders them so), which lets step 2
use a slice instead of an index. Without ``sluice_step`` (for example ``model.generate`` on the
same model) the function is plain SDPA attention, so the model stays usable as a reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from models import cuda_attention
from models.kv_cache import PagedKVCache
from models.paged_attention import paged_decode_attention

if TYPE_CHECKING:
    from models.lora_stacks import LoraBatch

ATTENTION_NAME = "sluice_packed"


@dataclass(frozen=True)
class PrefillSegment:
    """One sequence's prefill chunk in a packed step.

    ``start`` and ``num_tokens`` locate its tokens in the packed ``[1, T]`` input; ``position`` is
    the absolute position of the first of them (tokens before it are already in the pool);
    ``block_ids`` ``[num_blocks_of_seq]`` (int64) is the sequence's block table, used only when
    ``position > 0``.
    """

    start: int
    num_tokens: int
    position: int
    block_ids: torch.Tensor | None


@dataclass(frozen=True)
class PackedStep:
    """Everything the attention function needs for one packed forward.

    Fields:
        kv_cache: the bucket's block pool.
        slot_mapping: ``[T]`` int64, the flat pool slot of every packed token.
        num_decode_tokens: the first ``num_decode_tokens`` packed tokens are single-token segments
            (one per sequence).
        block_tables: ``[num_decode_tokens, max_blocks]`` int32 block tables of those sequences.
        context_lens: ``[num_decode_tokens]`` int32, each one's tokens in the pool after this write.
        prefills: the remaining segments, in packed order.
        lora: the step's LoRA rows (:class:`models.lora_stacks.LoraBatch`), applied by the
            backends after each target product; ``None``: no row runs an adapter.
    """

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    prefills: list[PrefillSegment]
    lora: LoraBatch | None = None

    @cached_property
    def chunks(self) -> ChunkBatch | None:
        """The prefill segments at ``position > 0`` as one Triton launch's tensors (built on the
        first layer that asks, on the pool's device; ``None`` when there are none)."""
        return ChunkBatch.of(self.prefills, self.kv_cache.data.device)


@dataclass(frozen=True)
class ChunkBatch:
    """A step's prefill chunks after a prefix, for one :func:`triton_paged_prefill_attention` call.

    Fields:
        segments: ``[3, num_chunks]`` int32 rows: packed start, token count, absolute position.
        block_tables: ``[num_chunks, max_blocks]`` int32, each chunk's block table, zero-padded.
        max_segment_tokens: the largest token count (a host integer: the launch grid).
    """

    segments: torch.Tensor
    block_tables: torch.Tensor
    max_segment_tokens: int

    @classmethod
    def of(cls, prefills: list[PrefillSegment], device: torch.device) -> ChunkBatch | None:
        """The batch of ``prefills``' segments at ``position > 0``; ``None`` when there are none."""
        chunks = [seg for seg in prefills if seg.position > 0]
        if not chunks:
            return None
        rows = [[seg.start for seg in chunks], [seg.num_tokens for seg in chunks], [seg.position for seg in chunks]]
        tables = [seg.block_ids.to(device, torch.int32) for seg in chunks if seg.block_ids is not None]
        assert len(tables) == len(chunks), "a chunk after a prefix needs its block table"
        return cls(
            segments=torch.tensor(rows, dtype=torch.int32, device=device),
            block_tables=torch.nn.utils.rnn.pad_sequence(tables, batch_first=True),
            max_segment_tokens=max(seg.num_tokens for seg in chunks),
        )


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
    """Attention over the paged pool.

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
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = attend_packed(step, module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), scale)
    return out.unsqueeze(0), None


def attend_packed(step: PackedStep, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """One layer's attention of a packed step in the packed layout (steps 1-3 of the module
    docstring); what :func:`packed_attention` runs for Hugging Face modules and
    :mod:`models.llama_lean` runs directly.

    Args:
        step: the step's slots, decode block tables and prefill segments.
        layer: the layer index (which pool tensors to write and read).
        query: ``[T, num_heads, head_dim]``; key, value: ``[T, num_kv_heads, head_dim]``, RoPE
            already applied (any strides).
        scale: multiplies ``q . k`` before the softmax.
    Returns:
        ``[T, num_heads, head_dim]``, the dtype of ``query``.
    """
    step.kv_cache.write(layer, step.slot_mapping, key, value)
    num_decode = step.num_decode_tokens
    decoded = None
    if num_decode:
        cache = step.kv_cache
        decoded = paged_decode_attention(
            query[:num_decode].contiguous(), cache.key_cache(layer), cache.value_cache(layer), step.block_tables,
            step.context_lens, scale, cache.key_scales(layer), cache.value_scales(layer),
        )
        if not step.prefills:  # decodes only: the kernel's output is the whole answer
            return decoded
    out = query.new_empty(query.shape)
    if decoded is not None:
        out[:num_decode] = decoded
    _attend_prefills(step, layer, query, key, value, scale, out)
    return out


def _attend_prefills(
    step: PackedStep, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, out: torch.Tensor
) -> None:
    """Step 3 of the module docstring: each prefill segment's rows of ``out`` (``[T, num_heads,
    head_dim]``, contiguous); the chunks after a prefix in one Triton launch on CUDA."""
    kernels = cuda_attention.triton_for(query, step.kv_cache.key_cache(layer))
    for seg in step.prefills:
        if kernels is not None and seg.position > 0:
            continue  # in the one Triton launch below
        end = seg.start + seg.num_tokens
        if seg.position == 0:
            k, v = key[seg.start : end].transpose(0, 1).unsqueeze(0), value[seg.start : end].transpose(0, 1).unsqueeze(0)
        else:
            assert seg.block_ids is not None, "a chunk after a prefix needs its block table"
            k, v = step.kv_cache.gather(layer, seg.block_ids, seg.position + seg.num_tokens, query.dtype)
        q = query[seg.start : end].transpose(0, 1).unsqueeze(0)
        out[seg.start : end] = _attend(q, k, v, seg.position, scale)[0].transpose(0, 1)
    chunks = step.chunks if kernels is not None else None
    if kernels is not None and chunks is not None:
        kernels.triton_paged_prefill_attention(
            query, step.kv_cache.key_cache(layer), step.kv_cache.value_cache(layer), chunks.block_tables,
            chunks.segments, chunks.max_segment_tokens, scale, out=out,
        )


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: int, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` (``[1, H, n, D]``, first query at ``position``) over ``k``/``v``
    (``[1, H_kv, position + n, D]``): query i sees keys ``0 .. position + i``."""
    n = q.shape[2]
    if position == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=n > 1, scale=scale, enable_gqa=True)
    q_pos = torch.arange(position, position + n, device=q.device).unsqueeze(1)
    k_pos = torch.arange(k.shape[2], device=q.device).unsqueeze(0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=k_pos <= q_pos, scale=scale, enable_gqa=True)


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
