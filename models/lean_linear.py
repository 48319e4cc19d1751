"""The matrix products of the lean decoder (:mod:`models.llama_lean`): float32, int8 and int4 weights.

Every kind multiplies ``x`` ``[M, in_features]`` float32 by a weight ``W`` ``[out_features,
in_features]`` and returns ``[M, out_features]`` float32 (``x @ W.T``), through one torch op per
call, so a layer's product is one dispatch whatever the kind:

- :class:`DenseLinear`: float32 ``W`` prepacked for oneDNN (``mkldnn::_linear_pointwise``, as
  :mod:`models.cpu_linear` does for the eager path).
- :class:`Int8Linear`: weight-only int8, one symmetric scale per output channel
  (``w ~= s[n] * q[n, k]``, ``q`` in ``[-127, 127]``), run by ``aten::_weight_int8pack_mm``
  (activations stay float32; the op dequantizes on the fly).
- :class:`Int4Linear`: weight-only int4, asymmetric, one ``(scale, minimum)`` pair per group of
  ``group_size`` input channels of each output channel (``w = d * q + m``, ``q`` in ``[0, 15]``:
  llama.cpp's Q4_1 layout), run by ``aten::_weight_int4pack_mm_for_cpu``. That op dequantizes
  ``(q - 8) * scale + zero``; with ``scale = d`` and ``zero = m + 8 d`` its weights are
  ``d * q + m`` again: on SmolLM2's Q4_1 blocks every dequantized weight equals the float32
  weight the GGUF converter wrote, bit for bit (checked at build, :mod:`models.backends.lean`).

Which is fastest depends on the shape: see ``python -m bench.decode_split`` and the figures in
:mod:`models.backends.lean`.
"""

from __future__ import annotations

import torch

from models.cpu_linear import PACK_FOR_ROWS

INT4_GROUP_SIZE = 32
# int4pack's tiling of the reduction dim (gpt-fast's default; K must be a multiple of 16 * this).
INT4_INNER_K_TILES = 2
INT8_MAX = 127


class DenseLinear:
    """``x @ W.T`` with a float32 ``W`` ``[N, K]`` reordered once for oneDNN."""

    kind = "float32"

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.packed_weight: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_FOR_ROWS)

    @classmethod
    def from_packed(cls, packed_weight: torch.Tensor, out_features: int, in_features: int) -> "DenseLinear":
        """Share a weight already reordered for oneDNN (a :class:`models.cpu_linear.PackedLinear`'s)."""
        linear = cls.__new__(cls)
        linear.out_features, linear.in_features, linear.packed_weight = out_features, in_features, packed_weight
        return linear

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, K]`` float32 -> ``[M, N]`` float32."""
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, None, "none", [], "")
        return out

    @property
    def nbytes(self) -> int:
        return self.packed_weight.numel() * self.packed_weight.element_size()


class Int8Linear:
    """Weight-only int8 ``x @ W.T``: ``W ~= scales[:, None] * q``, per output channel, symmetric.

    Args:
        weight: ``[N, K]`` float32, quantized round-to-nearest with ``scale = max|w[n]| / 127``.
        activation_dtype: the dtype the op computes in (``x`` and the scales are cast to it, the
            result back to float32): float32, or bfloat16, where torch's kernel is 10-25x faster
            on an AVX-512 BF16 machine (``bench.decode_split``) at a bfloat16 rounding of both.
    """

    kind = "int8"

    def __init__(self, weight: torch.Tensor, activation_dtype: torch.dtype = torch.float32):
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        self.scales = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        self.qweight = torch.round(w / self.scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8).contiguous()
        self.activation_dtype = activation_dtype
        self._op_scales = self.scales.to(activation_dtype)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, K]`` float32 -> ``[M, N]`` float32."""
        if self.activation_dtype == torch.float32:
            out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
            return out
        return torch.ops.aten._weight_int8pack_mm(x.to(self.activation_dtype), self.qweight, self._op_scales).float()  # type: ignore[no-any-return]

    def dequantized(self) -> torch.Tensor:
        """``[N, K]`` float32: the weight this layer multiplies by."""
        return self.qweight.float() * self.scales[:, None]

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * 4


class Int4Linear:
    """Weight-only int4 ``x @ W.T`` with ``W[n, g*G + j] = d[n, g] * q[n, g*G + j] + m[n, g]``.

    Args:
        q: ``[N, K]`` integers in ``[0, 15]`` (any int dtype).
        scale, minimum: ``[N, K // group_size]`` float32 (``d`` and ``m``).
        group_size: input channels per group (32 or 64; 32 for Q4_1).
        activation_dtype: as :class:`Int8Linear`'s; bfloat16 also rounds ``d`` and ``m + 8 d``
            to bfloat16, so Q4_1's weights are no longer exact.
    Raises:
        ValueError: ``K`` not a multiple of ``group_size`` and of int4pack's tile (32).
    """

    kind = "int4"

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int = INT4_GROUP_SIZE,
        activation_dtype: torch.dtype = torch.float32,
    ):
        self.out_features, self.in_features = q.shape
        tile = 16 * INT4_INNER_K_TILES
        if self.in_features % group_size or self.in_features % tile:
            raise ValueError(f"int4 weights need in_features divisible by {group_size} and {tile}, got {self.in_features}")
        self.group_size = group_size
        self.packed_weight: torch.Tensor = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), INT4_INNER_K_TILES)
        # [K // G, N, 2]: (scale, zero) with zero = m + 8 d, since the op dequantizes (q - 8) * scale + zero.
        self.scales_and_zeros = torch.stack([scale.t(), (minimum + 8 * scale).t()], dim=-1).float().contiguous()
        self.activation_dtype = activation_dtype
        self._op_scales_and_zeros = self.scales_and_zeros.to(activation_dtype)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, K]`` float32 -> ``[M, N]`` float32."""
        scales_and_zeros = self.scales_and_zeros if self.activation_dtype == torch.float32 else self._op_scales_and_zeros
        x = x.to(self.activation_dtype)
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed_weight, self.group_size, scales_and_zeros)
        return out.float()

    def dequantized(self) -> torch.Tensor:
        """``[N, K]`` float32: the weight this layer multiplies by (the op run on an identity)."""
        return self.mm(torch.eye(self.in_features)).t().contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed_weight.numel() + self.scales_and_zeros.numel() * 4


def int4_round_to_nearest(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE, activation_dtype: torch.dtype = torch.float32
) -> Int4Linear:
    """Group-wise asymmetric int4 of a float ``[N, K]`` weight, round-to-nearest (gpt-fast's
    ``group_quantize_tensor``): ``d = (max - min) / 15`` and ``m = min`` per group."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    minimum, maximum = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((maximum - minimum) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round((groups - minimum[..., None]) / scale[..., None]).clamp_(0, 15).reshape(n, k)
    return Int4Linear(q, scale, minimum, group_size, activation_dtype)
