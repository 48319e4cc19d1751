"""The matrix products of the lean decoder (:mod:`models.llama_lean`): float32, int8 and int4 weights.

Every kind multiplies ``x`` ``[M, in_features]`` float32 by a weight ``W`` ``[out_features,
in_features]`` and returns ``[M, out_features]`` float32 (``x @ W.T``), through one torch op per
call, so a layer's product is one dispatch whatever the kind:

- :class:`DenseLinear`: float32 ``W`` prepacked for oneDNN (``mkldnn::_linear_pointwise``, as
  :mod:`models.cpu_linear` does for the eager path).
- :class:`Int8Linear`: weight-only int8, symmetric (``w = s * q``, ``q`` in ``[-127, 127]``),
  one scale per output channel (round-to-nearest from float32) or per group of 32 (a GGUF Q8_0
  tensor's own blocks).
- :class:`Int4Linear`: weight-only int4, asymmetric, one ``(d, m)`` pair per group of
  ``group_size`` input channels of each output channel (``w = d * q + m``, ``q`` in ``[0, 15]``:
  llama.cpp's Q4_1 layout). On SmolLM2's Q4_1 blocks every dequantized weight equals the float32
  weight the GGUF converter wrote, bit for bit (checked at build, :mod:`models.backends.lean`).

With float32 activations both run Sluice's own kernel (:mod:`models.quant_kernels`: weights
dequantized exactly in registers, AVX-512 or AVX2), else torch's ``aten::_weight_int8pack_mm``
and ``aten::_weight_int4pack_mm_for_cpu``: with bfloat16 activations (the ``-bf16`` kinds), or
where the kernel is unavailable.

Which is fastest depends on the shape: see ``python -m bench.decode_split`` and the figures in
:mod:`models.backends.lean`.
"""

from __future__ import annotations

import torch

from models import quant_kernels
from models.cpu_linear import PACK_FOR_ROWS
from models.quant_kernels import Isa

INT4_GROUP_SIZE = 32
# int4pack's tiling of the reduction dim (gpt-fast's default; K must be a multiple of 16 * this,
# which is also the kernel's group).
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


def kernel_isa() -> Isa | None:
    """The ISA path of Sluice's quantized-product kernel (:mod:`models.quant_kernels`), or
    ``None`` where it is unavailable (no build, no AVX2), where torch's ops run instead.

    Raises:
        ValueError: ``SLUICE_KERNEL_ISA`` names an unknown path or one the CPU lacks.
    """
    return quant_kernels.chosen_isa() if quant_kernels.supported_isas() else None


class Int8Linear:
    """Weight-only int8 ``x @ W.T``: ``W[n, k] = scales[n, k // group] * q[n, k]``, symmetric.

    Args:
        weight: ``[N, K]`` float32, quantized round-to-nearest per output channel (``group =
            K``) with ``scale = max|w[n]| / 127``.
        activation_dtype: the dtype the product computes in: float32 (our kernel, exact on the
            dequantized weights; torch's op where the kernel is unavailable or ``K`` is not a
            multiple of 32), or bfloat16 (torch's op, ``x`` and the scales cast to it, the result
            back to float32: 10-25x faster than torch's float32 op on an AVX-512 BF16 machine, at
            a bfloat16 rounding of both).
    """

    kind = "int8"

    def __init__(self, weight: torch.Tensor, activation_dtype: torch.dtype = torch.float32):
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(w / scales).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        self._setup(q, scales, activation_dtype)

    @classmethod
    def from_blocks(cls, q: torch.Tensor, scales: torch.Tensor) -> "Int8Linear":
        """Group-wise int8 as stored (a GGUF Q8_0 tensor: :func:`models.gguf_blocks.q8_0_fields`),
        float32 activations through our kernel: ``q`` ``[N, K]`` int8, ``scales`` ``[N, K // 32]``.

        Raises:
            ValueError: the kernel is unavailable (torch's op has one scale per channel only).
        """
        linear = cls.__new__(cls)
        linear._setup(q, scales, torch.float32)
        if linear.isa is None:
            raise ValueError("group-wise int8 needs the quantized-product kernel")
        return linear

    def _setup(self, q: torch.Tensor, scales: torch.Tensor, activation_dtype: torch.dtype) -> None:
        self.out_features, self.in_features = q.shape
        self.qweight, self.scales = q.contiguous(), scales.float().contiguous()  # [N, K], [N, K // group]
        self.activation_dtype = activation_dtype
        is_kernel_shape = self.in_features % quant_kernels.GROUP_SIZE == 0
        self.isa = kernel_isa() if activation_dtype == torch.float32 and is_kernel_shape else None
        self._op_scales = self.scales[:, 0].to(activation_dtype) if self.isa is None else self.scales

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, K]`` float32 -> ``[M, N]`` float32."""
        if self.isa is not None:
            return quant_kernels.int8_linear(x, self.qweight, self.scales, self.isa)
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x.to(self.activation_dtype), self.qweight, self._op_scales)
        return out.float()

    def mm_q8(self, x: torch.Tensor, vnni: bool) -> torch.Tensor:
        """``[M, K]`` float32 -> ``[M, N]`` float32 with ``x`` quantized to int8 per row and group
        of 32 (:func:`models.quant_kernels.int8_linear_q8`); needs the kernel (``isa`` set)."""
        assert self.isa is not None
        return quant_kernels.int8_linear_q8(x, self.qweight, self.scales, self.isa, vnni)

    def dequantized(self) -> torch.Tensor:
        """``[N, K]`` float32: the weight this layer multiplies by."""
        return self.qweight.float() * self.scales.repeat_interleave(self.in_features // self.scales.shape[1], dim=1)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * 4


class Int4Linear:
    """Weight-only int4 ``x @ W.T`` with ``W[n, g*G + j] = d[n, g] * q[n, g*G + j] + m[n, g]``.

    Args:
        q: ``[N, K]`` integers in ``[0, 15]`` (any int dtype).
        scale, minimum: ``[N, K // group_size]`` float32 (``d`` and ``m``).
        group_size: input channels per group (32 or 64; 32 for Q4_1).
        activation_dtype: float32 runs our kernel (group 32; exact on the dequantized weights),
            torch's ``_weight_int4pack_mm_for_cpu`` where the kernel is unavailable or the group is
            not 32 (that op dequantizes ``(q - 8) * scale + zero``, so it gets ``zero = m + 8 d``);
            bfloat16 runs torch's op, which then also rounds ``d`` and ``m + 8 d`` to bfloat16, so
            Q4_1's weights are no longer exact.
    Raises:
        ValueError: ``K`` not a multiple of ``group_size`` and of 32.
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
        self.scale, self.minimum = scale.float().contiguous(), minimum.float().contiguous()
        is_kernel_group = group_size == quant_kernels.GROUP_SIZE
        self.isa = kernel_isa() if activation_dtype == torch.float32 and is_kernel_group else None
        self.activation_dtype = activation_dtype
        if self.isa is not None:
            self.packed_weight = quant_kernels.pack_int4(q)
            return
        self.packed_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), INT4_INNER_K_TILES)
        # [K // G, N, 2]: (scale, zero) with zero = m + 8 d.
        scales_and_zeros = torch.stack([self.scale.t(), (self.minimum + 8 * self.scale).t()], dim=-1).contiguous()
        self._op_scales_and_zeros = scales_and_zeros.to(activation_dtype)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, K]`` float32 -> ``[M, N]`` float32."""
        if self.isa is not None:
            return quant_kernels.int4_linear(x, self.packed_weight, self.scale, self.minimum, self.isa)
        x = x.to(self.activation_dtype)
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed_weight, self.group_size, self._op_scales_and_zeros)
        return out.float()

    def mm_q8(self, x: torch.Tensor, vnni: bool) -> torch.Tensor:
        """``[M, K]`` float32 -> ``[M, N]`` float32 with ``x`` quantized to int8 per row and group
        of 32 (:func:`models.quant_kernels.int4_linear_q8`); needs the kernel (``isa`` set)."""
        assert self.isa is not None
        return quant_kernels.int4_linear_q8(x, self.packed_weight, self.scale, self.minimum, self.isa, vnni)

    def dequantized(self) -> torch.Tensor:
        """``[N, K]`` float32: the weight this layer multiplies by (the product run on an identity)."""
        return self.mm(torch.eye(self.in_features)).t().contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed_weight.numel() + (self.scale.numel() + self.minimum.numel()) * 4


class Q8ActivationLinear:
    """The product of an :class:`Int4Linear` or :class:`Int8Linear`'s weights with int8
    activations: ``x`` quantized per row and group of 32 on each call, integer products (AVX-512
    VNNI where the CPU has it and the kernel runs AVX-512, else ``vpmaddubsw``). Lossy (the
    rounding of ``x``); the -q8a kinds run it for prefill-sized products only
    (:class:`models.backends.row_crossover.SwitchedLinear`). Figures: ``csrc/quant_gemm_q8.h``.

    Raises:
        ValueError: ``linear`` does not run the kernel (``isa`` ``None``).
    """

    kind = "q8a"

    def __init__(self, linear: Int4Linear | Int8Linear):
        if linear.isa is None:
            raise ValueError("int8 activations need the quantized-product kernel with float32 activations, group 32")
        self.linear = linear
        self.out_features, self.in_features = linear.out_features, linear.in_features
        self.vnni = linear.isa == Isa.AVX512 and quant_kernels.has_vnni()

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, K]`` float32 -> ``[M, N]`` float32."""
        return self.linear.mm_q8(x, self.vnni)


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
