"""Paged KV storage: every layer's K and V in fixed-size blocks, addressed through block tables.

One preallocated tensor of shape ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 of dim 1 is K, 1 is V) holds the KV of every sequence of a bucket. A sequence's token at
position ``p`` lives in block ``block_table[p // block_size]`` at offset ``p % block_size``; its flat
*slot* is ``block_id * block_size + p % block_size``. Which blocks belong to whom is integer
bookkeeping in :class:`buckets.block_manager.BlockManager`; this module only holds the tensors.

Bytes per token follow the usual formula ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes``
(K and V, every layer), so a block costs ``block_size`` times that.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import structlog
import torch

log = structlog.get_logger(__name__)


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

    def bytes_per_token(self, dtype_bytes: int) -> int:
        """KV bytes one token occupies: ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_blocks_for(self, memory_bytes: int, block_size: int, dtype_bytes: int) -> int:
        """How many blocks of ``block_size`` tokens fit in ``memory_bytes`` (rounded down)."""
        return memory_bytes // (block_size * self.bytes_per_token(dtype_bytes))


class PagedKVCache:
    """The block pool's tensors for one bucket.

    Args:
        shape: the model's KV geometry.
        num_blocks: blocks in the pool (see :meth:`KVShape.num_blocks_for`).
        block_size: tokens per block.
        dtype, device: of the storage (the model's dtype and the slice's device).

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1.
    """

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        dims = (shape.num_layers, 2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        num_bytes = math.prod(dims) * dtype.itemsize
        log.info("kv_pool_allocation_started", num_blocks=num_blocks, block_size=block_size, kv_cache_bytes=num_bytes, device=str(device))
        started = time.perf_counter()
        self.data = torch.zeros(dims, dtype=dtype, device=device)
        log.info("kv_pool_allocation_finished", kv_cache_bytes=num_bytes, duration_s=round(time.perf_counter() - started, 3))
        # [num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]: slots in one flat dim.
        self._slots = self.data.view(shape.num_layers, 2, num_blocks * block_size, shape.num_kv_heads, shape.head_dim)

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (allocated once, at construction)."""
        return self.data.numel() * self.data.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks

    def key_cache(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, num_kv_heads, head_dim]`` K of ``layer`` (a view)."""
        return self.data[layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, num_kv_heads, head_dim]`` V of ``layer`` (a view)."""
        return self.data[layer, 1]

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new tokens' K and V: ``key``/``value`` ``[T, num_kv_heads, head_dim]`` at flat
        ``slots`` ``[T]`` (int64). One copy per tensor for the whole step."""
        self._slots[layer, 0].index_copy_(0, slots, key)
        self._slots[layer, 1].index_copy_(0, slots, value)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks, every layer's K and V: ``(source, destination)`` block ids, each
        destination distinct and no source also a destination (a forked sequence's copy of its
        parent's partly filled last block). One indexed copy for all pairs."""
        if not copies:
            return
        sources = torch.tensor([src for src, _ in copies], device=self.data.device)
        destinations = torch.tensor([dst for _, dst in copies], device=self.data.device)
        self.data[:, :, destinations] = self.data[:, :, sources]

    def gather(self, layer: int, block_ids: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a sequence's first ``num_tokens`` positions, each ``[1, num_kv_heads, num_tokens, head_dim]``
        (a copy), given its block table ``block_ids`` ``[num_blocks_of_seq]`` (int64)."""
        kv = self.data[layer].index_select(1, block_ids)  # [2, n, block_size, H, D]
        kv = kv.flatten(1, 2)[:, :num_tokens]  # [2, num_tokens, H, D]
        return kv[0].transpose(0, 1).unsqueeze(0), kv[1].transpose(0, 1).unsqueeze(0)
