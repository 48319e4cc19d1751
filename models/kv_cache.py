"""Paged KV storage: every layer's K and V in fixed-size blocks, addressed through block tables.

One preallocated tensor of shape ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 of dim 1 is K, 1 is V) holds the KV of every sequence of a bucket. A sequence's token at
position ``p`` lives in block ``block_table[p // block_size]`` at offset ``p % block_size``; its flat
*slot* is ``block_id * block_size + p % block_size``. Which blocks belong to whom is integer
bookkeeping in :class:`buckets.block_manager.BlockManager`; this module only holds the tensors.

The pool stores K/V in the model's dtype, in bfloat16, or in int8 (a bucket's ``kv_cache_dtype``,
:class:`KVCacheDtype`). An int8 pool keeps beside the data a float32 scale per token, layer, K/V
and kv head (``scales``, ``[num_layers, 2, num_blocks, block_size, num_kv_heads]``): each row of
``head_dim`` values is quantized symmetric absmax, ``q = round(x * 127 / max|x|)``, ``x ~= scale * q``
with ``scale = max|x| / 127``, when it is written (as llama.cpp's ``q8_0`` cache type, with one
block of ``head_dim`` values per scale). The scale is float32 rather than float16: it costs 2 more
bytes per 64-value row (SmolLM2 holds 3.76x a float32 pool's tokens instead of 3.88x) and spares
the kernel a conversion and float16's range limits. A prefix-cached block is the quantized one.

Bytes per token are ``2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes)``
(K and V, every layer; ``scale_bytes`` is 4 for int8, else 0), so a block costs ``block_size``
times that.
"""

from __future__ import annotations

import enum
import math
import mmap
import time
from dataclasses import dataclass

import structlog
import torch

from models.paged_attention import write_kv_rows

log = structlog.get_logger(__name__)

SCALE_DTYPE = torch.float32
INT8_MAX = 127


class KVCacheDtype(str, enum.Enum):
    """How a bucket's KV pool stores K and V (its ``kv_cache_dtype``)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}[self.value]

    @property
    def element_bytes(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def row_scale_bytes(self) -> int:
        """Bytes of scale per row of ``head_dim`` values (4 for int8, else 0)."""
        return scale_bytes(self.torch_dtype)


def storage_dtype(kv_cache_dtype: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element dtype for a bucket's ``kv_cache_dtype`` (``None``: the model's dtype).

    Raises:
        ValueError: not a :class:`KVCacheDtype` value.
    """
    return model_dtype if kv_cache_dtype is None else KVCacheDtype(kv_cache_dtype).torch_dtype


def scale_bytes(dtype: torch.dtype) -> int:
    """Bytes of scale per row (token, layer, K or V, kv head): 4 for int8, 0 for float dtypes."""
    return SCALE_DTYPE.itemsize if dtype == torch.int8 else 0


@dataclass(frozen=True)
class KVShape:
    """The KV geometry of a decoder: layer count, KV heads and head size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: object) -> "KVShape":
        """Read the geometry from a Hugging Face decoder config (Llama, Qwen2, Mistral, ...)."""
        num_heads = getattr(config, "num_attention_heads")
        head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size") // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        return cls(num_layers=getattr(config, "num_hidden_layers"), num_kv_heads=num_kv_heads, head_dim=head_dim)

    def bytes_per_token(self, dtype_bytes: int, row_scale_bytes: int = 0) -> int:
        """KV bytes one token occupies: ``2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + row_scale_bytes)``."""
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * dtype_bytes + row_scale_bytes)

    def bytes_per_token_in(self, dtype: torch.dtype) -> int:
        """KV bytes one token occupies in a pool of ``dtype`` (scales included for int8)."""
        return self.bytes_per_token(dtype.itemsize, scale_bytes(dtype))

    def bytes_per_token_for(self, kv_cache_dtype: str | None, model_dtype_bytes: int) -> int:
        """KV bytes one token occupies in a bucket's pool of ``kv_cache_dtype`` (None: the
        model's dtype, ``model_dtype_bytes`` wide), an int8 pool's scales included.

        Raises:
            ValueError: ``kv_cache_dtype`` is not a :class:`KVCacheDtype` value.
        """
        if kv_cache_dtype is None:
            return self.bytes_per_token(model_dtype_bytes)
        kind = KVCacheDtype(kv_cache_dtype)
        return self.bytes_per_token(kind.element_bytes, kind.row_scale_bytes)

    def num_blocks_for(self, memory_bytes: int, block_size: int, dtype_bytes: int, row_scale_bytes: int = 0) -> int:
        """How many blocks of ``block_size`` tokens fit in ``memory_bytes`` (rounded down)."""
        return memory_bytes // (block_size * self.bytes_per_token(dtype_bytes, row_scale_bytes))


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 per row: ``rows`` ``[..., head_dim]`` (any float dtype) to int8 of the
    same shape and float32 scales ``[...]``, ``rows ~= scale[..., None] * q`` (error at most
    ``scale / 2`` per value). An all-zero row gets scale 0."""
    rows = rows.to(torch.float32)
    scales = rows.abs().amax(dim=-1) / INT8_MAX
    inverse = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales))
    quantized = torch.round(rows * inverse.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return quantized, scales


def zeroed(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor of ``dims``. On the CPU, over anonymous ``mmap`` memory, which the kernel
    hands out zeroed page by page at first touch: the pool costs no time up front, and each block
    is faulted in when a sequence first writes it. ``torch.zeros`` writes every page at once:
    1.6 GB (the default config's larger SmolLM2 pool) took 1.1-3.1 s on a 2-vCPU VM, one of the
    larger parts of a gateway's start; huge pages (``MADV_HUGEPAGE``) did not make those first
    touches cheaper there (2.9 s). The memory goes back when the tensor is freed (the tensor
    holds the map)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    num_bytes = math.prod(dims) * dtype.itemsize
    if num_bytes == 0:
        return torch.zeros(dims, dtype=dtype)
    memory = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=dtype).view(dims)


class PagedKVCache:
    """The block pool's tensors for one bucket.

    Args:
        shape: the model's KV geometry.
        num_blocks: blocks in the pool (see :meth:`KVShape.num_blocks_for`).
        block_size: tokens per block.
        dtype: of the storage: the model's dtype, bfloat16, or int8 (with scales, see the module
            docstring); device: the slice's.
        num_host_blocks: blocks of the host pool for swap preemption (:meth:`swap_out`,
            :meth:`swap_in`): the same per-block layout in CPU memory, pinned when ``device`` is
            CUDA (so copies to and from it can run asynchronously); 0: none.
        has_pad_block: allocate one block more, ``pad_block_id`` (``num_blocks``, outside the
            block manager's range), where the padding rows of a captured decode step write and
            read (:mod:`models.cuda_graphs`); ``num_blocks`` stays the blocks sequences get.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1, or ``num_host_blocks`` below 0.
    """

    def __init__(
        self, shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str,
        num_host_blocks: int = 0, has_pad_block: bool = False,
    ):
        if num_blocks < 1 or block_size < 1 or num_host_blocks < 0:
            raise ValueError(
                f"a KV pool needs num_blocks >= 1, block_size >= 1 and num_host_blocks >= 0, "
                f"got {num_blocks}, {block_size} and {num_host_blocks}"
            )
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.pad_block_id: int | None = num_blocks if has_pad_block else None
        self._num_allocated_blocks = num_blocks + int(has_pad_block)
        dims = (shape.num_layers, 2, self._num_allocated_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        num_bytes = self._num_allocated_blocks * block_size * shape.bytes_per_token_in(dtype)
        log.info(
            "kv_pool_allocation_started", num_blocks=num_blocks, has_pad_block=has_pad_block, block_size=block_size, kv_cache_bytes=num_bytes,
            kv_cache_dtype=str(dtype).removeprefix("torch."), device=str(device),
        )
        started = time.perf_counter()
        self.data = zeroed(dims, dtype, device)
        # [num_layers, 2, num_blocks, block_size, num_kv_heads] float32 for int8, else None.
        self.scales = zeroed(dims[:-1], SCALE_DTYPE, device) if dtype == torch.int8 else None
        log.info("kv_pool_allocation_finished", kv_cache_bytes=num_bytes, duration_s=round(time.perf_counter() - started, 3))
        self.host = HostKVPool(self.data, self.scales, num_host_blocks)
        # [num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]: slots in one flat dim.
        self._slots = self.data.view(shape.num_layers, 2, self._num_allocated_blocks * block_size, shape.num_kv_heads, shape.head_dim)
        self._scale_slots = None if self.scales is None else self.scales.view(*self._slots.shape[:-1])
        # Each layer's views, made once: a decode step asks for them in every layer.
        self._layer_caches = [(self.data[layer, 0], self.data[layer, 1]) for layer in range(shape.num_layers)]
        self._layer_slots = [(self._slots[layer, 0], self._slots[layer, 1]) for layer in range(shape.num_layers)]
        self._layer_scales = [
            (None, None) if self.scales is None else (self.scales[layer, 0], self.scales[layer, 1])
            for layer in range(shape.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds, scales and the pad block included (allocated once, at construction)."""
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.data.numel() * self.data.element_size() + scales

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self._num_allocated_blocks

    def key_cache(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, num_kv_heads, head_dim]`` K of ``layer`` (a view)."""
        return self._layer_caches[layer][0]

    def value_cache(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, num_kv_heads, head_dim]`` V of ``layer`` (a view)."""
        return self._layer_caches[layer][1]

    def key_scales(self, layer: int) -> torch.Tensor | None:
        """``[num_blocks, block_size, num_kv_heads]`` float32 scales of ``layer``'s K (a view); None unless int8."""
        return self._layer_scales[layer][0]

    def value_scales(self, layer: int) -> torch.Tensor | None:
        """``[num_blocks, block_size, num_kv_heads]`` float32 scales of ``layer``'s V (a view); None unless int8."""
        return self._layer_scales[layer][1]

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new tokens' K and V: ``key``/``value`` ``[T, num_kv_heads, head_dim]`` at flat
        ``slots`` ``[T]`` (int64), converted to the pool's dtype (quantized with their scales for
        int8). One copy per tensor for the whole step."""
        if self._scale_slots is None:
            key_slots, value_slots = self._layer_slots[layer]
            write_kv_rows(key_slots, value_slots, slots, key.to(self.dtype), value.to(self.dtype))
            return
        for index, rows in enumerate((key, value)):
            quantized, scales = quantize_rows(rows)
            self._slots[layer, index].index_copy_(0, slots, quantized)
            self._scale_slots[layer, index].index_copy_(0, slots, scales)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks, every layer's K and V (and scales): ``(source, destination)`` block
        ids, each destination distinct and no source also a destination (a forked sequence's copy
        of its parent's partly filled last block). One indexed copy for all pairs."""
        if not copies:
            return
        sources = torch.tensor([src for src, _ in copies], device=self.data.device)
        destinations = torch.tensor([dst for _, dst in copies], device=self.data.device)
        self.restore_blocks(destinations, self.save_blocks(sources))

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host pool (0: none)."""
        return self.host.num_blocks

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks, ``(device block, host block)`` pairs, every layer's K
        and V (and scales); see :class:`HostKVPool`."""
        self.host.copy_from_device(pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks, ``(host block, device block)`` pairs."""
        self.host.copy_to_device(pairs)

    def save_blocks(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A copy of blocks ``block_ids`` ``[n]`` (int64), every layer: data and scales (None unless
        int8); indexing with a tensor copies."""
        return self.data[:, :, block_ids], None if self.scales is None else self.scales[:, :, block_ids]

    def restore_blocks(self, block_ids: torch.Tensor, saved: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        """Write ``saved`` (from :meth:`save_blocks`) into blocks ``block_ids`` ``[n]`` (int64)."""
        data, scales = saved
        self.data[:, :, block_ids] = data
        if self.scales is not None and scales is not None:
            self.scales[:, :, block_ids] = scales

    def gather(
        self, layer: int, block_ids: torch.Tensor, num_tokens: int, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a sequence's first ``num_tokens`` positions, each ``[1, num_kv_heads, num_tokens, head_dim]``
        (a copy, in ``dtype``: default the pool's, float32 for int8; int8 rows are dequantized),
        given its block table ``block_ids`` ``[num_blocks_of_seq]`` (int64)."""
        kv = self.data[layer].index_select(1, block_ids).flatten(1, 2)[:, :num_tokens]  # [2, num_tokens, H, D]
        if self.scales is None:
            kv = kv.to(dtype or self.dtype)
        else:
            scales = self.scales[layer].index_select(1, block_ids).flatten(1, 2)[:, :num_tokens]  # [2, num_tokens, H]
            kv = (kv.to(torch.float32) * scales.unsqueeze(-1)).to(dtype or torch.float32)
        return kv[0].transpose(0, 1).unsqueeze(0), kv[1].transpose(0, 1).unsqueeze(0)


class HostKVPool:
    """The host side of swap preemption: ``num_blocks`` blocks laid out as the device pool's
    (``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, int8 scales beside),
    in CPU memory, pinned when the device pool is on CUDA. On a CPU device it is simply a
    second CPU tensor (how the bookkeeping is tested).

    Each direction is one indexed gather and one indexed scatter over all pairs. Out: the
    blocks are gathered on the device, copied to the host (asynchronously into pinned memory on
    CUDA, then the stream is synchronized, since the scatter into the pool runs on the CPU) and
    scattered into their host blocks; nothing of the step has written KV yet, so the device blocks
    may be handed to another sequence in the same step. In: the host blocks are gathered into a
    pinned buffer, copied to the device without blocking the host, and scattered there on the
    device's stream, ahead of the forward that reads them.
    """

    def __init__(self, data: torch.Tensor, scales: torch.Tensor | None, num_blocks: int) -> None:
        self.device = data.device
        self.num_blocks = num_blocks
        self._pin = data.device.type == "cuda"
        self._pools = [(data, self._host_like(data, num_blocks))]
        if scales is not None:
            self._pools.append((scales, self._host_like(scales, num_blocks)))

    def _host_like(self, pool: torch.Tensor, num_blocks: int) -> torch.Tensor:
        dims = (*pool.shape[:2], num_blocks, *pool.shape[3:])
        if self._pin and num_blocks:  # written by swap_out before anything reads it
            return torch.empty(dims, dtype=pool.dtype, pin_memory=True)
        return zeroed(dims, pool.dtype, "cpu")

    @property
    def is_pinned(self) -> bool:
        """Whether the host blocks sit in pinned memory (a CUDA device pool's)."""
        return self._pools[0][1].is_pinned()

    def copy_from_device(self, pairs: list[tuple[int, int]]) -> None:
        """``(device block, host block)`` pairs: device to host."""
        if not pairs:
            return
        sources = torch.tensor([device for device, _ in pairs], device=self.device)
        destinations = torch.tensor([host for _, host in pairs])
        for device_pool, host_pool in self._pools:
            staged = device_pool.index_select(2, sources).to("cpu", non_blocking=self._pin)
            if self._pin:
                torch.cuda.current_stream(self.device).synchronize()
            host_pool.index_copy_(2, destinations, staged)

    def copy_to_device(self, pairs: list[tuple[int, int]]) -> None:
        """``(host block, device block)`` pairs: host to device."""
        if not pairs:
            return
        sources = torch.tensor([host for host, _ in pairs])
        destinations = torch.tensor([device for _, device in pairs], device=self.device)
        for device_pool, host_pool in self._pools:
            dims = (*host_pool.shape[:2], len(pairs), *host_pool.shape[3:])
            staged = torch.empty(dims, dtype=host_pool.dtype, pin_memory=self._pin)
            torch.index_select(host_pool, 2, sources, out=staged)
            device_pool.index_copy_(2, destinations, staged.to(self.device, non_blocking=self._pin))
