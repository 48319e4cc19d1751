"""Timing a decoder step by parts: the hooks behind ``python -m bench.decode_split``.

:class:`SplitTimer` wraps, while its :meth:`SplitTimer.hooked` context is open, every matrix
product (the eager path's :class:`models.cpu_linear.PackedLinear` forwards, the LM head
included; the lean path's :mod:`models.lean_linear` ``mm`` calls, the leaves under any switch
or concatenation) and every layer's attention (:func:`models.attention.attend_packed`, as the
Hugging Face path and :mod:`models.llama_lean` call it) in a pair of clock reads, adding the
wall seconds to its counters. Timed hooks rather than the profiler: the profiler's per-op cost
would land in "everything else", the share being measured; a hook costs two clock reads.
:func:`time_products` times each product kind alone at SmolLM2's shapes; :func:`forced_isa`
builds products on a chosen path of :mod:`models.quant_kernels`.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import models.attention as attention
import models.llama_lean as llama_lean
from models.cpu_linear import PackedLinear
from models.lean_linear import DenseLinear, Int4Linear, Int8Linear, Q8ActivationLinear, int4_round_to_nearest
from models.llama_lean import Linear
from models.quant_kernels import ISA_ENV

# One SmolLM2 layer's products (out, in) and the LM head's.
PRODUCT_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
PRODUCT_ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 512)
# The int8-activation kinds (``*q8@isa``) only at prefill sizes.
Q8_MIN_ROWS = 16


class SplitTimer:
    """Counters of matmul and attention seconds, fed by the hooks of :meth:`hooked`."""

    def __init__(self) -> None:
        self.matmul_s = 0.0
        self.attention_s = 0.0

    def take(self) -> tuple[float, float]:
        taken = (self.matmul_s, self.attention_s)
        self.matmul_s = self.attention_s = 0.0
        return taken

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        """Wrap every product and every layer's attention in a clock read pair (restored after)."""
        owners: list[tuple[Any, str]] = [(PackedLinear, "forward"), (DenseLinear, "mm"), (Int8Linear, "mm"), (Int4Linear, "mm"),
                                           (Q8ActivationLinear, "mm")]  # fmt: skip
        patches = [(owner, name, "matmul_s") for owner, name in owners]
        patches += [(attention, "attend_packed", "attention_s"), (llama_lean, "attend_packed", "attention_s")]
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
        for (owner, name, counter), (_, _, original) in zip(patches, saved):
            setattr(owner, name, self._timed(original, counter))
        try:
            yield
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)

    def _timed(self, fn: Callable[..., Any], counter: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, counter, getattr(self, counter) + time.perf_counter() - started)

        return timed


@contextlib.contextmanager
def forced_isa(isa: str | None) -> Iterator[None]:
    """``SLUICE_KERNEL_ISA`` set to ``isa`` (``None``: left as it is) while the block builds
    products, which read it at construction (:func:`models.lean_linear.kernel_isa`)."""
    saved = os.environ.get(ISA_ENV)
    if isa is not None:
        os.environ[ISA_ENV] = isa
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ISA_ENV, None)
        else:
            os.environ[ISA_ENV] = saved


def product_kinds(weight: torch.Tensor, isas: list[str]) -> dict[str, Linear]:
    """Every product kind of ``weight`` ``[N, K]``: float32, our kernel's int8 and int4 on each
    ISA path of ``isas`` with float32 activations and with int8 ones (``int8q8``, ``int4q8``;
    on AVX-512 with VNNI also without it, ``@avx512-novnni``), torch's int8 and int4 ops with
    bfloat16 activations."""
    linears: dict[str, Linear] = {"float32": DenseLinear(weight)}
    for isa in isas:
        with forced_isa(isa):
            linears[f"int8@{isa}"], linears[f"int4@{isa}"] = Int8Linear(weight), int4_round_to_nearest(weight)
        for bits in ("int8", "int4"):
            q8 = linears[f"{bits}q8@{isa}"] = Q8ActivationLinear(linears[f"{bits}@{isa}"])  # type: ignore[arg-type]
            if q8.vnni:
                linears[f"{bits}q8@{isa}-novnni"] = without_vnni = Q8ActivationLinear(q8.linear)
                without_vnni.vnni = False
    linears["int8-bf16"] = Int8Linear(weight, torch.bfloat16)
    linears["int4-bf16"] = int4_round_to_nearest(weight, activation_dtype=torch.bfloat16)
    return linears


def time_products(repeats: int, isas: list[str]) -> dict[str, dict[str, dict[int, float]]]:
    """``{product: {kind: {rows: ms}}}``: each product kind (:func:`product_kinds`) alone on
    random weights of SmolLM2's shapes, kinds interleaved per round, medians (the LM head at 512
    rows left out)."""
    generator = torch.Generator().manual_seed(0)
    result: dict[str, dict[str, dict[int, float]]] = {}
    for product, (out_features, in_features) in PRODUCT_SHAPES.items():
        weight = torch.randn(out_features, in_features, generator=generator) * 0.05
        linears = product_kinds(weight, isas)
        result[product] = {kind: {} for kind in linears}
        for rows in PRODUCT_ROWS:
            if product == "lm_head" and rows > 32:
                continue
            x = torch.randn(rows, in_features, generator=generator)
            timed = {kind: linear for kind, linear in linears.items() if rows >= Q8_MIN_ROWS or "q8@" not in kind}
            times: dict[str, list[float]] = {kind: [] for kind in timed}
            for kind, linear in timed.items():
                linear.mm(x)
            for _ in range(repeats):
                for kind, linear in timed.items():
                    started = time.perf_counter()
                    linear.mm(x)
                    times[kind].append((time.perf_counter() - started) * 1e3)
            for kind, values in times.items():
                result[product][kind][rows] = round(statistics.median(values), 3)
    return result
