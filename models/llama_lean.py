"""A Llama-family decoder forward written for Sluice's packed layout, without Hugging Face modules.

The eager path calls the Hugging Face decoder, which dispatches every layer op by op through
module calls (about 30 layers of ``nn.Module.__call__``, hooks, kwargs plumbing). This forward
runs the same weights as a flat loop over plain tensors, in the manner of nano-vllm's
``qwen3.py`` and gpt-fast's ``model.py``: per layer one fused QKV product and one fused
gate/up product (weights concatenated once at load, as nano-vllm's ``QKVParallelLinear`` and
``MergedColumnParallelLinear``), RMSNorm in one C++ call each (:mod:`models.quant_kernels`,
the second with the residual add before it; torch's ``F.rms_norm``, six ops on CPU, where the
kernel is unavailable), RoPE applied to Q and K together in place in one C++ call
(:func:`models.paged_attention.rope_`; three torch ops where the kernel is unavailable) with the
cos/sin the model's own rotary module computes once per step, SiLU-mul, and the packed paged attention
(:func:`models.attention.attend_packed`: the C++ kernel for decodes, SDPA for prefill
segments). Per layer that is about 15 op dispatches and no module call.

Numerics match the eager path up to float reduction order: same weights, same formulas (RMSNorm
``x / sqrt(mean(x^2) + eps) * w``; RoPE ``q * cos + rotate_half(q) * sin`` as Hugging Face's
``apply_rotary_pos_emb``), the products only grouped differently.

LoRA: when the step carries LoRA rows (``step.lora``, :class:`models.lora_slots.LoraBatch`),
each product's LoRA terms are added to its output right after it, per projection (the fused
QKV and gate/up outputs column by column), here and nowhere else: whichever product ran (the
quantized GEMV, the float32 weights of :class:`models.backends.row_crossover.SwitchedLinear`,
the int8-activation GEMM) they are added once. A step without LoRA rows runs no extra op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from models import quant_kernels
from models.attention import PackedStep, attend_packed
from models.lora_slots import LoraBatch
from models.paged_attention import fused_rope_available, rope_


# The projections of the fused products, in their output column order (LoRA adds per projection).
QKV_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
GATE_UP_PROJECTIONS = ("gate_proj", "up_proj")


class Linear(Protocol):
    """A product ``x @ W.T``: ``[M, in_features]`` float32 -> ``[M, out_features]`` float32
    (:mod:`models.lean_linear`)."""

    def mm(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class LeanLayer:
    """One decoder layer's weights: the two RMSNorm weights ``[hidden]`` and four products,
    ``qkv`` (``[hidden] -> [(num_heads + 2 * num_kv_heads) * head_dim]``, Q rows then K then V),
    ``o`` (``[num_heads * head_dim] -> [hidden]``), ``gate_up`` (``[hidden] ->
    [2 * intermediate]``, gate rows then up) and ``down`` (``[intermediate] -> [hidden]``)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


@dataclass(frozen=True)
class LeanGeometry:
    """The shapes and constants of a Llama-family config."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float

    @classmethod
    def from_config(cls, config: Any) -> "LeanGeometry":
        num_heads = config.num_attention_heads
        return cls(
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=float(config.rms_norm_eps),
        )


class LeanLlama:
    """The packed forward over :class:`LeanLayer` weights.

    Args:
        geometry: the config's shapes.
        embed_tokens: ``[vocab, hidden]`` float32 input embedding.
        layers: every layer's weights, in order.
        final_norm: ``[hidden]`` weight of the last RMSNorm.
        rotary: the model's own rotary module (``decoder.rotary_emb``), called once per step as
            ``rotary(x, position_ids) -> (cos, sin)``, each ``[1, T, head_dim]``.
        lm_head: the output product ``[hidden] -> [vocab]``.
    """

    def __init__(
        self, geometry: LeanGeometry, embed_tokens: torch.Tensor, layers: list[LeanLayer], final_norm: torch.Tensor, rotary: Any,
        lm_head: Linear,
    ):
        self.geometry, self.embed_tokens, self.layers = geometry, embed_tokens, layers
        self.final_norm, self.rotary, self.lm_head = final_norm, rotary, lm_head
        self.hidden_size = embed_tokens.shape[1]
        self.scale = geometry.head_dim**-0.5
        self.has_fused_norm = quant_kernels.kernel() is not None
        self.has_fused_rope = fused_rope_available()

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, step: PackedStep) -> torch.Tensor:
        """Last hidden states ``[1, T, hidden]`` of the packed ``[1, T]`` ``input_ids`` at
        ``position_ids``; writes every layer's new K/V into the step's pool."""
        x = F.embedding(input_ids[0], self.embed_tokens)  # [T, hidden]
        cos, sin = self.rotary(x.unsqueeze(0), position_ids)  # [1, T, head_dim]
        if self.has_fused_rope:  # the kernel's tables: [T, head_dim]
            rope_tables = (cos[0].float().contiguous(), sin[0].float().contiguous())
        else:
            half = self.geometry.head_dim // 2
            # [T, 1, 2, half]: cos by halves, and sin with the sign rotate_half gives its first half.
            cos_halves = cos[0].view(-1, 1, 2, half)
            rope_tables = (cos_halves, torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1).view(-1, 1, 2, half))
        for index, layer in enumerate(self.layers):
            x = self._layer(index, layer, x, rope_tables, step)
        return self._norm(x, self.final_norm).unsqueeze(0)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, hidden]`` final hidden rows -> ``[R, vocab]`` float32 logits."""
        return self.lm_head.mm(hidden.contiguous())

    def _layer(
        self, index: int, layer: LeanLayer, x: torch.Tensor, rope_tables: tuple[torch.Tensor, torch.Tensor], step: PackedStep
    ) -> torch.Tensor:
        """One decoder layer on ``x`` ``[T, hidden]`` (updated in place and returned);
        ``rope_tables``: ``(cos, sin)`` as :func:`models.paged_attention.rope_` takes them with
        the fused RoPE, else as :func:`_rotate` does."""
        g = self.geometry
        num_tokens = x.shape[0]
        lora = step.lora
        normed = self._norm(x, layer.input_norm)
        qkv = layer.qkv.mm(normed)
        if lora is not None:
            lora.apply_fused(index, QKV_PROJECTIONS, normed, qkv)
        num_qk_heads = g.num_heads + g.num_kv_heads
        if self.has_fused_rope:  # in place on the Q and K heads of the fresh product
            heads = qkv.view(num_tokens, num_qk_heads + g.num_kv_heads, g.head_dim)
            rope_(heads, *rope_tables, num_qk_heads)
            qk = heads[:, :num_qk_heads]
        else:
            qk = _rotate(qkv[:, : num_qk_heads * g.head_dim].view(num_tokens, num_qk_heads, g.head_dim), *rope_tables)
        v = qkv[:, num_qk_heads * g.head_dim :].view(num_tokens, g.num_kv_heads, g.head_dim)
        attn = attend_packed(step, index, qk[:, : g.num_heads], qk[:, g.num_heads :], v, self.scale)
        if lora is not None:
            return self._lora_mlp(index, layer, x, attn.view(num_tokens, -1), lora)
        gate_up = layer.gate_up.mm(self._add_norm(x, layer.o.mm(attn.view(num_tokens, -1)), layer.post_attention_norm))
        act = F.silu(gate_up[:, : g.intermediate_size]).mul_(gate_up[:, g.intermediate_size :])
        return x.add_(layer.down.mm(act))

    def _lora_mlp(self, index: int, layer: LeanLayer, x: torch.Tensor, attn: torch.Tensor, lora: LoraBatch) -> torch.Tensor:
        """The rest of :meth:`_layer` after attention (``attn`` ``[T, num_heads * head_dim]``)
        with the step's LoRA terms added to the O, gate/up and down products."""
        g = self.geometry
        o = layer.o.mm(attn)
        lora.apply(index, "o_proj", attn, o)
        normed = self._add_norm(x, o, layer.post_attention_norm)
        gate_up = layer.gate_up.mm(normed)
        lora.apply_fused(index, GATE_UP_PROJECTIONS, normed, gate_up)
        act = F.silu(gate_up[:, : g.intermediate_size]).mul_(gate_up[:, g.intermediate_size :])
        down = layer.down.mm(act)
        lora.apply(index, "down_proj", act, down)
        return x.add_(down)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of the rows of ``x`` ``[T, hidden]``: the kernel's one call, else torch's."""
        if self.has_fused_norm:
            return quant_kernels.rms_norm(x, weight, self.geometry.rms_norm_eps)
        return F.rms_norm(x, (self.hidden_size,), weight, self.geometry.rms_norm_eps)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x += delta`` (in place), then the RMSNorm of ``x``."""
        if self.has_fused_norm:
            return quant_kernels.add_rms_norm_(x, delta, weight, self.geometry.rms_norm_eps)
        return self._norm(x.add_(delta), weight)


def _rotate(x: torch.Tensor, cos_halves: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[T, heads, head_dim]`` (a new contiguous tensor): Hugging Face's ``x * cos
    + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, as ``x * cos + flip(x) *
    signed_sin`` over the halves (``cos_halves``, ``signed_sin`` ``[T, 1, 2, head_dim // 2]``,
    ``signed_sin = cat(-sin1, sin2)``): three ops instead of five."""
    num_tokens, heads, head_dim = x.shape
    halves = x.view(num_tokens, heads, 2, head_dim // 2)
    return torch.addcmul(halves * cos_halves, halves.flip(-2), signed_sin).view(num_tokens, heads, head_dim)
