"""Per-sequence KV storage for the packed attention path.

Each running sequence owns one preallocated tensor of shape
``[num_layers, 2, num_kv_heads, capacity_tokens, head_dim]`` (index 0 of dim 1 is K, 1 is V),
sized for its prompt plus its ``max_tokens``, so a step only writes the new positions in place.
Bytes per token follow the usual formula ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes``.
The paged block cache replaces this storage behind the same attention function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


class SequenceKVCache:
    """The KV tensor of one sequence, written in place as tokens are computed.

    Args:
        shape: the model's KV geometry.
        capacity_tokens: the most positions this sequence can hold (prompt + max new tokens).
        dtype, device: of the tensor.
    """

    def __init__(self, shape: KVShape, capacity_tokens: int, dtype: torch.dtype, device: torch.device | str):
        self.capacity_tokens = capacity_tokens
        self.data = torch.empty(
            (shape.num_layers, 2, shape.num_kv_heads, capacity_tokens, shape.head_dim), dtype=dtype, device=device
        )

    def write(self, layer: int, start: int, key_value: torch.Tensor) -> None:
        """Store K and V stacked as ``[2, num_kv_heads, n, head_dim]`` at positions ``start .. start+n``
        (one copy for both, which matters when a step writes thousands of small segments)."""
        end = start + key_value.shape[2]
        assert end <= self.capacity_tokens, "KV write past the sequence's capacity"
        self.data[layer, :, :, start:end] = key_value

    def view(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first ``length`` positions, each ``[1, num_kv_heads, length, head_dim]``."""
        return self.data[layer, 0, :, :length].unsqueeze(0), self.data[layer, 1, :, :length].unsqueeze(0)
