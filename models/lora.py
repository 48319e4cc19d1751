"""LoRA adapters over a served decoder: their weights, and (in the runner) their slots.

A LoRA adapter (Hu et al., 2021) adds a low-rank product to a linear layer:
``y = x W^T + scaling * (x A^T) B^T`` with ``A`` ``[r, in_features]``, ``B``
``[out_features, r]`` and ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
rsLoRA), as PEFT's ``LoraLayer`` computes it. Sluice reads PEFT's folders
(``adapter_config.json`` + ``adapter_model.safetensors``) into :class:`LoraAdapter`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The projections of a Llama-family decoder layer an adapter may target (PEFT's module names).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The submodule of a Hugging Face decoder layer that holds each of them.
TARGET_MODULE_OWNERS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One PEFT LoRA adapter's weights, checked against its base model, on the CPU in float32.

    Fields:
        name: the served model id.
        path: the PEFT folder it was read from.
        rank: the adapter's ``r`` (every target module's: per-module ranks are refused).
        scaling: ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), the factor
            on every ``B``.
        weights: ``(layer index, projection)`` -> ``(A, B)``: ``A`` ``[rank, in_features]``,
            ``B`` ``[out_features, rank]`` float32, unscaled; ``projection`` is one of
            :data:`LORA_TARGET_MODULES`. A projection the adapter does not target is absent.
    """

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> frozenset[str]:
        """The projections the adapter changes in at least one layer."""
        return frozenset(projection for _, projection in self.weights)

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def projection_shapes(config: object) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each of :data:`LORA_TARGET_MODULES` in a Llama-family
    decoder layer of ``config`` (a Hugging Face ``PretrainedConfig``): what an adapter's ``A``
    ``[r, in]`` and ``B`` ``[out, r]`` must match."""
    hidden = int(getattr(config, "hidden_size"))
    num_heads = int(getattr(config, "num_attention_heads"))
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // num_heads)
    intermediate = int(getattr(config, "intermediate_size"))
    return {
        "q_proj": (hidden, num_heads * head_dim), "k_proj": (hidden, num_kv_heads * head_dim),
        "v_proj": (hidden, num_kv_heads * head_dim), "o_proj": (num_heads * head_dim, hidden),
        "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden),
    }  # fmt: skip
