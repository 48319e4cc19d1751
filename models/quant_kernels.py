"""Sluice's weight-only int4 / int8 CPU products (``csrc/quant_linear.cpp``): float32 activations.

The kernel multiplies float32 ``x`` ``[M, K]`` by weights kept quantized in memory and
dequantized exactly in registers (see the C++ file's header): int4 group-wise asymmetric, group
32, ``w = d * q + m`` (llama.cpp's Q4_1), and int8 symmetric ``w = s * q`` with a group of 32
(Q8_0) or one scale per output channel, by a GEMV that reads each weight once for all rows (the
lean backend sends more than a few rows to float32 weights instead: :mod:`models.backends.lean`).
It also has the lean step's RMSNorm in one call (:func:`rms_norm`, :func:`add_rms_norm_`).

Built and cached like the paged-attention kernel (:class:`models.paged_attention.KernelLoader`:
on first use, or at install by ``sluice prepare``), its own build folder. The ISA (AVX-512
F/BW/VL or AVX2+FMA) is picked once at load, the best the CPU supports;
``SLUICE_KERNEL_ISA=avx512|avx2`` forces one (an unsupported or unknown value is an
error naming the variable). When the kernel cannot be built or the CPU lacks AVX2, :func:`kernel` returns ``None`` and
:mod:`models.lean_linear` falls back to torch's ops.
"""

from __future__ import annotations

import enum
import os
from functools import partial
from pathlib import Path
from types import ModuleType

import torch

from models.paged_attention import CFLAGS, LDFLAGS, KernelLoader, build_extension

ISA_ENV = "SLUICE_KERNEL_ISA"
EXTENSION_NAME = "sluice_quant_linear"
SOURCE_PATH = Path(__file__).parent / "csrc" / "quant_linear.cpp"
GEMM_Q8_PATH = Path(__file__).parent / "csrc" / "quant_gemm_q8.h"  # included by SOURCE_PATH
GROUP_SIZE = 32


class Isa(enum.IntEnum):
    """The kernel's code paths (the C++ ``Isa`` values)."""

    AVX2 = 1
    AVX512 = 2


_LOADER = KernelLoader(
    partial(build_extension, EXTENSION_NAME, SOURCE_PATH, CFLAGS, LDFLAGS, header_paths=(GEMM_Q8_PATH,), choose_isa=False), name=EXTENSION_NAME
)


def kernel() -> ModuleType | None:
    """The compiled module (built on the first call), or ``None`` where it cannot be built."""
    return _LOADER.module()


def kernel_unavailable_reason() -> str | None:
    """Why :func:`kernel` is ``None`` (``None`` when it is not)."""
    _LOADER.module()
    return _LOADER.unavailable_reason


def supported_isas() -> list[Isa]:
    """Every code path this CPU runs (empty without the kernel or AVX2), slowest first."""
    module = kernel()
    return [] if module is None else [Isa(value) for value in module.supported_isas()]


def chosen_isa(environ: dict[str, str] | None = None) -> Isa:
    """The code path to run: ``SLUICE_KERNEL_ISA`` when set, else the best supported.

    Raises:
        ValueError: the variable names an unknown path or one this CPU lacks; no kernel.
    """
    supported = supported_isas()
    if not supported:
        raise ValueError(f"the quantized-product kernel is unavailable: {kernel_unavailable_reason()}")
    wanted = (os.environ if environ is None else environ).get(ISA_ENV, "")
    if not wanted:
        return supported[-1]
    if wanted.upper() not in Isa.__members__:
        raise ValueError(f"{ISA_ENV}={wanted!r}: expected one of {', '.join(i.name.lower() for i in Isa)}")
    isa = Isa[wanted.upper()]
    if isa not in supported:
        raise ValueError(f"{ISA_ENV}={wanted!r}: this CPU supports only {', '.join(i.name.lower() for i in supported)}")
    return isa


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q`` ``[N, K]`` in ``[0, 15]`` -> ``[N, K // 2]`` uint8 in the kernel's layout (per group of
    32: byte ``i`` holds weight ``i`` in its low nibble, weight ``i + 16`` in its high one, as a
    Q4_1 block's ``qs``).

    Raises:
        ValueError: ``K`` not a multiple of 32.
    """
    n, k = q.shape
    if k % GROUP_SIZE:
        raise ValueError(f"int4 weights need in_features divisible by {GROUP_SIZE}, got {k}")
    groups = q.to(torch.uint8).reshape(n, k // GROUP_SIZE, 2, GROUP_SIZE // 2)
    return (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def int4_linear(x: torch.Tensor, q4: torch.Tensor, d: torch.Tensor, m: torch.Tensor, isa: Isa) -> torch.Tensor:
    """``x`` ``[M, K]`` float32 times ``(d * q + m).T`` -> ``[M, N]`` float32; ``q4`` from
    :func:`pack_int4`, ``d`` and ``m`` ``[N, K // 32]`` float32.

    Raises:
        RuntimeError: no kernel. ValueError / TypeError: shapes or dtypes (from the kernel).
    """
    out: torch.Tensor = _module().int4_linear(x, q4, d, m, int(isa))
    return out


def int8_linear(x: torch.Tensor, q8: torch.Tensor, scales: torch.Tensor, isa: Isa) -> torch.Tensor:
    """``x`` ``[M, K]`` float32 times ``(s * q).T`` -> ``[M, N]`` float32; ``q8`` ``[N, K]`` int8,
    ``scales`` ``[N, K // group]`` float32 (group 32 times a power of two, or ``K``).

    Raises:
        RuntimeError: no kernel. ValueError / TypeError: shapes or dtypes (from the kernel).
    """
    out: torch.Tensor = _module().int8_linear(x, q8, scales, int(isa))
    return out


def has_vnni() -> bool:
    """Whether the int8-activation GEMM can run AVX-512 VNNI's ``vpdpbusd`` here (``False``
    without the kernel)."""
    module = kernel()
    return module is not None and bool(module.has_vnni())


def q8_paths() -> list[tuple[Isa, bool]]:
    """Every code path of the int8-activation GEMM this CPU runs, as ``(isa, vnni)``, slowest
    first: AVX2 ``vpmaddubsw``, AVX-512 ``vpmaddubsw``, AVX-512 VNNI ``vpdpbusd``."""
    paths = [(isa, False) for isa in supported_isas()]
    return paths + [(Isa.AVX512, True)] if has_vnni() else paths


def int4_linear_q8(
    x: torch.Tensor, q4: torch.Tensor, d: torch.Tensor, m: torch.Tensor, isa: Isa, vnni: bool = False
) -> torch.Tensor:
    """:func:`int4_linear` with ``x`` quantized to int8 on the fly (symmetric, per row and group
    of 32: llama.cpp's Q8_1; see ``csrc/quant_gemm_q8.h``): ``[M, K]`` float32 -> ``[M, N]``
    float32, integer products exact within each group, lossy by the rounding of ``x``.

    Raises:
        RuntimeError: no kernel. ValueError / TypeError: shapes or dtypes, or ``vnni`` where
            the CPU lacks it or ``isa`` is not AVX512 (from the kernel).
    """
    out: torch.Tensor = _module().int4_linear_q8(x, q4, d, m, int(isa), vnni)
    return out


def int8_linear_q8(x: torch.Tensor, q8: torch.Tensor, scales: torch.Tensor, isa: Isa, vnni: bool = False) -> torch.Tensor:
    """:func:`int8_linear` with ``x`` quantized to int8 on the fly, as :func:`int4_linear_q8`.

    Raises:
        RuntimeError: no kernel. ValueError / TypeError: shapes, dtypes or ``vnni`` (from the kernel).
    """
    out: torch.Tensor = _module().int8_linear_q8(x, q8, scales, int(isa), vnni)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows of ``x`` ``[T, H]`` float32 as ``x / sqrt(mean(x^2) + eps) * weight`` (``[H]``), in
    one call (both contiguous).

    Raises:
        RuntimeError: no kernel. ValueError / TypeError: shapes or dtypes (from the kernel).
    """
    out: torch.Tensor = _module().rms_norm(x, weight, eps)
    return out


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += delta`` in place (the residual, ``[T, H]`` float32, contiguous), then
    :func:`rms_norm` of the new ``x``, in one call.

    Raises:
        RuntimeError: no kernel. ValueError / TypeError: shapes or dtypes (from the kernel).
    """
    out: torch.Tensor = _module().add_rms_norm_(x, delta, weight, eps)
    return out


def _module() -> ModuleType:
    module = kernel()
    if module is None:
        raise RuntimeError(f"the quantized-product kernel is unavailable: {kernel_unavailable_reason()}")
    return module
