"""Paged attention on CUDA in Triton: decode (split-K) and prefill chunks after a prefix.

Both kernels read K/V straight from the pool of :mod:`models.kv_cache` (``[num_blocks,
block_size, num_kv_heads, head_dim]`` per layer) through int32 block tables: token ``t`` of a
sequence lives at ``cache[table[t // block_size], t % block_size]``. Tiles are runs of
consecutive token positions whose block ids are loaded per token, so a tile may span several
blocks and ``block_size`` need not be a power of two. Scores, the online softmax and the output
accumulate in float32 (the pool's float16 / bfloat16 rows are widened right after each load;
Triton's interpreter also mis-adds bfloat16 values without it); the output is stored in the
query's dtype. int8 pools are not handled here: :mod:`models.cuda_attention` keeps them on torch.

**Decode** (one query per sequence), as FlashDecoding / vLLM's ``paged_attention_v2``: the grid is
``(num_seqs, num_kv_heads, num_splits)``; a program holds the query heads of one kv head (GQA:
head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``) and walks the tiles of its share of
the context with an online softmax. With one split it writes the output; with several, each
writes its running max, sum of exponentials and unnormalized accumulator to float32 scratch and
a second kernel (grid ``(num_seqs, num_heads)``) rescales and combines them. The split count
comes from host integers only (:func:`decode_num_splits`: the table's capacity in tokens and the
grid size), never from ``context_lens``' values, and nothing reads a device value on the host:
a decode step can be captured in a CUDA graph.

**Prefill chunks** (segments starting at ``position > 0``, their own K/V already in the pool):
all of a step's segments in one launch, grid ``(num_segments * num_query_tiles, num_heads)``.
Query ``i`` of a segment, at absolute position ``position + i``, attends to keys
``0 .. position + i``; ``tl.dot`` products of ``PREFILL_TILE_QUERIES x PREFILL_TILE_KEYS`` tiles.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated (at import), so the tests set it
before importing this module to run the kernels on CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from models.paged_attention import _check_inputs, check_query_and_cache

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SPLIT_MIN_TOKENS = 256  # below this many tokens per split, a split costs more than it hides
MAX_SPLITS = 32
TARGET_PROGRAMS = 256  # enough programs to fill a large GPU (an H200 has 132 SMs) about twice
DECODE_TILE_ELEMENTS = 8192  # group_pad * tile_tokens * dim_pad per product: registers, not spills
PREFILL_TILE_QUERIES = 64
PREFILL_TILE_KEYS = 64


@triton.jit
def _decode_kernel(
    query, key_cache, value_cache, tables, context_lens, out, part_max, part_sum, part_acc, scale,
    stride_qs, stride_qh, stride_qd, stride_cb, stride_ct, stride_ch, stride_table, stride_os, stride_oh,
    num_heads, num_splits, tokens_per_split,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr, TILE_N: tl.constexpr, IS_SPLIT: tl.constexpr,
):  # fmt: skip
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g, d = tl.arange(0, GROUP_PAD), tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    head_mask, dim_mask = g < GROUP, d < HEAD_DIM
    q_mask = head_mask[:, None] & dim_mask[None, :]
    q = tl.load(query + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd, mask=q_mask, other=0.0)
    q = q.to(tl.float32) * scale
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    first = split * tokens_per_split
    end = tl.minimum(first + tokens_per_split, tl.load(context_lens + seq))
    for tile_first in range(first, end, TILE_N):
        pos = tile_first + tl.arange(0, TILE_N)
        is_valid = pos < end
        block = tl.load(tables + seq * stride_table + pos // BLOCK_SIZE, mask=is_valid, other=0).to(tl.int64)
        rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        kv_mask = is_valid[:, None] & dim_mask[None, :]
        k = tl.load(key_cache + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        scores = tl.where(is_valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        alpha = tl.exp(running_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(value_cache + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        running_max = new_max
    if IS_SPLIT:
        part = (seq * num_heads + heads) * num_splits + split
        tl.store(part_max + part, running_max, mask=head_mask)
        tl.store(part_sum + part, running_sum, mask=head_mask)
        tl.store(part_acc + part[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
    else:
        result = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]  # an empty context: zeros
        pointers = out + seq * stride_os + heads[:, None] * stride_oh + d[None, :]
        tl.store(pointers, result.to(out.dtype.element_ty), mask=q_mask)


@triton.jit
def _reduce_kernel(
    part_max, part_sum, part_acc, out, stride_os, stride_oh, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):  # fmt: skip
    seq, head = tl.program_id(0), tl.program_id(1)
    s, d = tl.arange(0, SPLITS_PAD), tl.arange(0, DIM_PAD)
    split_mask, dim_mask = s < num_splits, d < HEAD_DIM
    part = (seq * num_heads + head) * num_splits + s
    split_max = tl.load(part_max + part, mask=split_mask, other=float("-inf"))
    top = tl.max(split_max, axis=0)
    weight = tl.exp(split_max - tl.where(top > float("-inf"), top, 0.0))  # an empty split (max -inf) weighs 0
    total = tl.sum(tl.load(part_sum + part, mask=split_mask, other=0.0) * weight, axis=0)
    total = tl.where(total > 0, total, 1.0)  # an empty context: zeros
    acc = tl.load(part_acc + part[:, None] * HEAD_DIM + d[None, :], mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    result = tl.sum(acc * weight[:, None], axis=0) / total
    tl.store(out + seq * stride_os + head * stride_oh + d, result.to(out.dtype.element_ty), mask=dim_mask)


@triton.jit
def _prefill_kernel(
    query, key_cache, value_cache, tables, seg_starts, seg_lens, seg_positions, out, scale,
    stride_qt, stride_qh, stride_qd, stride_cb, stride_ct, stride_ch, stride_table, stride_ot, stride_oh,
    num_query_tiles,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, DIM_PAD: tl.constexpr,
    TILE_M: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    seg, head = tl.program_id(0) // num_query_tiles, tl.program_id(1)
    first_query = (tl.program_id(0) % num_query_tiles) * TILE_M
    seg_len = tl.load(seg_lens + seg)
    if first_query < seg_len:
        start, position = tl.load(seg_starts + seg), tl.load(seg_positions + seg)
        i, d = first_query + tl.arange(0, TILE_M), tl.arange(0, DIM_PAD)
        q_mask = (i < seg_len)[:, None] & (d < HEAD_DIM)[None, :]
        q_rows = (start + i).to(tl.int64)
        q = tl.load(query + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd, mask=q_mask, other=0.0)
        q = q.to(tl.float32) * scale
        q_pos = position + i
        kv_end = position + tl.minimum(first_query + TILE_M, seg_len)  # the tile's last query sees up to here
        running_max = tl.full([TILE_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([TILE_M], tl.float32)
        acc = tl.zeros([TILE_M, DIM_PAD], tl.float32)
        for key_first in range(0, kv_end, TILE_N):
            pos = key_first + tl.arange(0, TILE_N)
            is_valid = pos < kv_end
            block = tl.load(tables + seg * stride_table + pos // BLOCK_SIZE, mask=is_valid, other=0).to(tl.int64)
            rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + (head // GROUP) * stride_ch
            kv_mask = is_valid[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(key_cache + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            scores = tl.where(is_valid[None, :] & (pos[None, :] <= q_pos[:, None]), scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))  # key 0 is always seen: finite
            alpha = tl.exp(running_max - new_max)
            p = tl.exp(scores - new_max[:, None])
            running_sum = running_sum * alpha + tl.sum(p, axis=1)
            v = tl.load(value_cache + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
            running_max = new_max
        result = acc / running_sum[:, None]
        pointers = out + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :]
        tl.store(pointers, result.to(out.dtype.element_ty), mask=q_mask)


@dataclass(frozen=True)
class DecodeLaunch:
    """How a decode call is cut: ``num_splits`` programs per (sequence, kv head), each over
    ``tokens_per_split`` consecutive positions (a multiple of ``tile_tokens``, the positions one
    loop iteration reads)."""

    num_splits: int
    tokens_per_split: int
    tile_tokens: int


def decode_num_splits(max_context_tokens: int, num_programs: int) -> int:
    """How many splits a decode call asks for: enough that the grid fills the GPU
    (``TARGET_PROGRAMS // num_programs``), no more than the context gives ``SPLIT_MIN_TOKENS``
    each, at most ``MAX_SPLITS``, at least 1.

    Args:
        max_context_tokens: the block tables' capacity, ``max_blocks_per_seq * block_size``
            (a host integer, so the count is fixed for a captured shape).
        num_programs: programs per split, ``num_seqs * num_kv_heads``.
    """
    by_length = -(-max_context_tokens // SPLIT_MIN_TOKENS)
    by_occupancy = TARGET_PROGRAMS // max(num_programs, 1)
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def decode_launch(
    max_context_tokens: int, num_programs: int, group: int, head_dim: int, num_splits: int | None = None
) -> DecodeLaunch:
    """The cut of a decode call over tables of ``max_context_tokens`` capacity with ``num_programs``
    (sequence, kv head) pairs of ``group`` query heads each, from host integers only.

    The tile holds at most ``DECODE_TILE_ELEMENTS`` products (``group x tile x head_dim``, padded
    to powers of two) and no more than a split's share; splits then cover whole tiles, so fewer
    than ``num_splits`` (default :func:`decode_num_splits`) may run when the capacity is short.
    """
    wanted = num_splits or decode_num_splits(max_context_tokens, num_programs)
    by_registers = DECODE_TILE_ELEMENTS // (triton.next_power_of_2(group) * _dim_pad(head_dim))
    by_share = triton.next_power_of_2(-(-max_context_tokens // wanted))
    tile_tokens = max(16, min(by_registers, by_share))
    tokens_per_split = -(-max_context_tokens // (wanted * tile_tokens)) * tile_tokens
    return DecodeLaunch(-(-max_context_tokens // tokens_per_split), tokens_per_split, tile_tokens)


def triton_paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """:func:`models.paged_attention.paged_decode_attention` in Triton, for float pools.

    Args:
        query: ``[num_seqs, num_heads, head_dim]`` float32, bfloat16 or float16 (any strides).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous,
            the query's dtype or bfloat16 under a float32 query; on the query's device.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32; entries past a sequence's last
            block are never read.
        context_lens: ``[num_seqs]`` int32 in ``[0, max_blocks_per_seq * block_size]`` (not
            checked: checking would read device values); a 0 (a CUDA graph's padding row) reads
            nothing and gives zeros.
        scale: multiplies ``q . k`` before the softmax.
        num_splits: splits of the context (``None``: :func:`decode_num_splits`); tests force it.
    Returns:
        ``[num_seqs, num_heads, head_dim]`` contiguous, the dtype of ``query``.
    Raises:
        TypeError: a dtype is wrong (int8 pools included). ValueError: a shape is, or ``num_splits < 1``.
    """
    _check_inputs(query, key_cache, value_cache, block_tables, context_lens)
    _check_float_cache(key_cache)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0:
        return out
    for call in decode_kernel_calls(query, key_cache, value_cache, block_tables, context_lens, out, scale, num_splits):
        call.launch()
    return out


def triton_paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    segments: torch.Tensor,
    max_segment_tokens: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of prefill chunks after a prefix, every segment of a step in one launch.

    Args:
        query: ``[T, num_heads, head_dim]`` packed queries (float32, bfloat16 or float16; any strides).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous,
            the query's dtype or bfloat16 under a float32 query, holding every segment's K/V up to
            its last token (the chunk's own rows written already).
        block_tables: ``[num_segments, max_blocks]`` int32, each segment's sequence's blocks.
        segments: ``[3, num_segments]`` int32 rows: ``start`` (first packed row), ``num_tokens``
            and ``position`` (absolute position of its first token): query ``i`` of a segment,
            row ``start + i``, attends to keys ``0 .. position + i``.
        max_segment_tokens: at least the largest ``num_tokens`` (a host integer: the grid).
        scale: multiplies ``q . k`` before the softmax.
        out: ``[T, num_heads, head_dim]`` of the query's dtype to write the segments' rows into
            (``None``: a new zeroed tensor); other rows are left as they are.
    Returns:
        ``out``.
    Raises:
        TypeError: a dtype is wrong (int8 pools included). ValueError: a shape is.
    """
    _check_prefill_inputs(query, key_cache, value_cache, block_tables, segments, max_segment_tokens)
    if out is None:
        out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {list(query.shape)} {query.dtype} with unit stride in head_dim")
    if segments.shape[1] == 0:
        return out
    prefill_kernel_call(query, key_cache, value_cache, block_tables, segments, max_segment_tokens, out, scale).launch()
    return out


@dataclass(frozen=True)
class KernelCall:
    """One launch, ``kernel[grid](*args, **constexprs)``: the entry points run it, tests/triton_aot.py compiles it."""

    kernel: triton.runtime.JITFunction[Any]
    grid: tuple[int, ...]
    args: tuple[object, ...]
    constexprs: dict[str, object]

    def launch(self) -> None:
        """Run the kernel (compiling it on the first call of a specialization)."""
        self.kernel[self.grid](*self.args, **self.constexprs)


def decode_kernel_calls(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> list[KernelCall]:
    """The launches of :func:`triton_paged_decode_attention` (arguments as it documents, ``out``
    its result, ``num_seqs >= 1``): the decode kernel, then the reduce kernel when the context is
    split; allocates the splits' float32 scratch on the query's device (``meta`` tensors work)."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    launch = decode_launch(block_tables.shape[1] * block_size, num_seqs * num_kv_heads, group, head_dim, num_splits)
    splits = launch.num_splits
    part_max, part_sum, part_acc = _split_scratch(num_seqs, num_heads, splits, head_dim, query.device) if splits > 1 else (out, out, out)
    calls = [KernelCall(_decode_kernel, (num_seqs, num_kv_heads, splits), (
        query, key_cache, value_cache, block_tables, context_lens, out, part_max, part_sum, part_acc, scale,
        *query.stride(), *key_cache.stride()[:3], block_tables.stride(0), *out.stride()[:2],
        num_heads, splits, launch.tokens_per_split,
    ), dict(
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        DIM_PAD=_dim_pad(head_dim), TILE_N=launch.tile_tokens, IS_SPLIT=splits > 1,
    ))]  # fmt: skip
    if splits > 1:
        calls.append(KernelCall(_reduce_kernel, (num_seqs, num_heads), (
            part_max, part_sum, part_acc, out, *out.stride()[:2], num_heads, splits,
        ), dict(HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(splits), DIM_PAD=_dim_pad(head_dim))))  # fmt: skip
    return calls


def prefill_kernel_call(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    segments: torch.Tensor,
    max_segment_tokens: int,
    out: torch.Tensor,
    scale: float,
) -> KernelCall:
    """The launch of :func:`triton_paged_prefill_attention` (arguments as it documents, ``out``
    allocated, at least one segment)."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_query_tiles = -(-max_segment_tokens // PREFILL_TILE_QUERIES)
    return KernelCall(_prefill_kernel, (segments.shape[1] * num_query_tiles, query.shape[1]), (
        query, key_cache, value_cache, block_tables, segments[0], segments[1], segments[2], out, scale,
        *query.stride(), *key_cache.stride()[:3], block_tables.stride(0), *out.stride()[:2], num_query_tiles,
    ), dict(
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=query.shape[1] // num_kv_heads,
        DIM_PAD=_dim_pad(head_dim), TILE_M=PREFILL_TILE_QUERIES, TILE_N=PREFILL_TILE_KEYS,
        DOT_PRECISION="ieee" if key_cache.dtype == torch.float32 else "tf32",
    ))  # fmt: skip


def _split_scratch(
    num_seqs: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 scratch of the splits: running max and sum ``[num_seqs, num_heads, num_splits]``,
    accumulator ``[num_seqs, num_heads, num_splits, head_dim]`` (with one split the kernel writes
    the output and gets the output tensor in their place, never touched)."""
    dims = (num_seqs, num_heads, num_splits)
    return (
        torch.empty(dims, dtype=torch.float32, device=device),
        torch.empty(dims, dtype=torch.float32, device=device),
        torch.empty((*dims, head_dim), dtype=torch.float32, device=device),
    )


def _dim_pad(head_dim: int) -> int:
    """``head_dim`` padded to a power of two, at least 16 (``tl.dot``'s smallest side)."""
    return max(triton.next_power_of_2(head_dim), 16)


def _check_float_cache(key_cache: torch.Tensor) -> None:
    if key_cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"the Triton kernels read float16, bfloat16 or float32 pools, got {key_cache.dtype}")


def _check_prefill_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    segments: torch.Tensor,
    max_segment_tokens: int,
) -> None:
    """Shapes and dtypes only (host metadata): nothing here reads a device value."""
    check_query_and_cache(query, key_cache, value_cache)
    _check_float_cache(key_cache)
    num_segments = segments.shape[-1]
    if block_tables.dtype != torch.int32 or segments.dtype != torch.int32:
        raise TypeError(f"block_tables and segments must be int32, got {block_tables.dtype} and {segments.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_segments:
        raise ValueError(f"block_tables must be [num_segments={num_segments}, max_blocks], got {list(block_tables.shape)}")
    if segments.dim() != 2 or segments.shape[0] != 3:
        raise ValueError(f"segments must be [3, num_segments], got {list(segments.shape)}")
    if max_segment_tokens < 1:
        raise ValueError(f"max_segment_tokens must be at least 1, got {max_segment_tokens}")
