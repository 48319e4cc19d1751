"""Where a quantized kind's products stop paying: the row count up to which the lean decoder's
int8 / int4 products run quantized, measured on this machine when the backend is built.

A weight-only quantized product reads a quarter (int8) or an eighth (int4) of float32's weight
bytes but dequantizes every weight it reads, once per pass over a few rows. At one row a decode
step is bound by memory and the quantized product wins; with more rows the float32 product
(oneDNN, weights read once for all rows) catches up and then wins. Where it catches up depends
on the machine's memory bandwidth against its vector units, so it is measured, not assumed.
The constants it replaced (4 rows on AVX-512, 1 on AVX2, the AVX2 figure taken with the AVX2 path
forced on an AVX-512 machine, where oneDNN still ran AVX-512) were both too low on the machines
that run AVX2 natively. ``python -m bench.decode_split --kinds eager,lean-int4,lean-int8
--threads 2 --repeats 3 --no-products --shapes decode1,decode4,decode8,decode32``, SmolLM2-135M,
2 threads, context 128, decode step ms (ratio to eager), quiet:

    machine (measured rows)     kind        1 row        4 rows       8 rows       32 rows
    AMD Zen 3, AVX2 only (12)   eager       49.0         61.8         80.9         168.8
                                lean-int4   17.2 (0.35)  29.6 (0.48)  53.3 (0.66)  156.5 (0.93)
                                lean-int8   19.8 (0.40)  30.6 (0.50)  53.1 (0.66)  154.7 (0.92)
    AMD EPYC, AVX-512 (12)      eager       46.2         50.4         57.8         106.3
                                lean-int4   15.4 (0.33)  21.7 (0.43)  38.2 (0.66)  97.6 (0.92)
                                lean-int8   18.0 (0.39)  25.8 (0.51)  37.1 (0.64)  101.7 (0.96)

(The figure in brackets is the row count measured at build: lean-int8's on the Zen 3, both kinds'
on the AVX-512 machine. 32 rows run on the float32 weights: the lean step without Hugging Face's
modules.)

The measurement runs every product of the model once per row count, quantized and float32 in
turn, the best of ``repeats`` each: 1.4-1.6 s for SmolLM2-135M at 2 threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import structlog
import torch

from models.llama_lean import Linear

log = structlog.get_logger(__name__)
T = TypeVar("T", int, int | None)

# Row counts tried, ascending: the answer is the largest before the first that does not pay.
CROSSOVER_ROWS = (1, 2, 4, 6, 8, 12, 16)
CROSSOVER_REPEATS = 3
# Row counts tried for the int8-activation GEMM of the -q8a kinds: the answer is the smallest from
# which it beats float32 at every larger one tried (a prefill chunk is rarely under 16 tokens; past
# 128 rows the ratio to float32 no longer changes much: models/csrc/quant_gemm_q8.h).
PREFILL_ROWS = (16, 32, 128)


class SwitchedLinear:
    """``quantized`` for at most ``max_rows`` rows; ``prefill`` (the same weights with int8
    activations, :class:`models.lean_linear.Q8ActivationLinear`) for at least
    ``min_prefill_rows`` where both are set; else ``dense`` (same product, float32 weights)."""

    def __init__(self, quantized: Linear, dense: Linear, max_rows: int, prefill: Linear | None = None):
        self.quantized, self.dense, self.max_rows, self.prefill = quantized, dense, max_rows, prefill
        self.min_prefill_rows: int | None = None

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, K]`` float32 -> ``[M, N]`` float32."""
        rows = x.shape[0]
        if rows <= self.max_rows:
            return self.quantized.mm(x)
        if self.prefill is not None and self.min_prefill_rows is not None and rows >= self.min_prefill_rows:
            return self.prefill.mm(x)
        return self.dense.mm(x)


def measure_max_quantized_rows(
    products: Sequence[SwitchedLinear],
    rows: Sequence[int] = CROSSOVER_ROWS,
    repeats: int = CROSSOVER_REPEATS,
    clock: Callable[[], float] = time.perf_counter,
) -> int:
    """The largest of ``rows`` (ascending) such that, at it and at every smaller one, running all
    of ``products`` quantized takes less time than running them on their float32 weights; 0 when
    even ``rows[0]`` does not pay.

    Each product gets its own random input ``[r, in_features]`` float32; a pass runs the products
    in order, as a decode step streams its layers' weights, and the best of ``repeats`` passes
    per kind counts (the kinds alternate, so a burst of other load falls on both).
    """
    fast = [p.quantized for p in products]
    return _last_paying(fast, products, rows, repeats, clock) or 0


def set_max_quantized_rows(
    products: Sequence[SwitchedLinear], kind: str, clock: Callable[[], float] = time.perf_counter
) -> int:
    """Measure (:func:`measure_max_quantized_rows`, on ``clock``) and set every product's
    ``max_rows``, which it returns; logs ``quantized_rows_measured`` with the figure and the time
    it took."""
    return _set_measured(products, kind, "max_rows", lambda: measure_max_quantized_rows(products, clock=clock))


def measure_min_prefill_rows(
    products: Sequence[SwitchedLinear],
    rows: Sequence[int] = PREFILL_ROWS,
    repeats: int = CROSSOVER_REPEATS,
    clock: Callable[[], float] = time.perf_counter,
) -> int | None:
    """The smallest of ``rows`` (ascending) such that, at it and at every larger one, running all
    of ``products`` through their ``prefill`` (int8-activation) product takes less time than on
    their float32 weights; ``None`` when even the largest does not pay (or no product has one).
    Measured as :func:`measure_max_quantized_rows` does, from the largest row count down."""
    with_prefill = [p for p in products if p.prefill is not None]
    fast = [p.prefill for p in with_prefill if p.prefill is not None]
    return _last_paying(fast, with_prefill, sorted(rows, reverse=True), repeats, clock) if fast else None


def _last_paying(
    fast: Sequence[Linear], products: Sequence[SwitchedLinear], rows: Sequence[int], repeats: int, clock: Callable[[], float]
) -> int | None:
    """The last of ``rows``, in their order, up to which one pass over ``fast`` (one product per
    product of ``products``) took less time than over their ``dense`` ones at each; ``None`` when
    the first already does not pay. Best of ``repeats`` passes, the two kinds alternating."""
    best = None
    for r in rows:
        inputs = [torch.randn(r, _in_features(p)) for p in products]
        fast_s = dense_s = float("inf")
        for _ in range(repeats):
            fast_s = min(fast_s, _pass_s(fast, inputs, clock))
            dense_s = min(dense_s, _pass_s([p.dense for p in products], inputs, clock))
        if fast_s >= dense_s:
            break
        best = r
    return best


def set_min_prefill_rows(
    products: Sequence[SwitchedLinear], kind: str, clock: Callable[[], float] = time.perf_counter
) -> int | None:
    """Measure (:func:`measure_min_prefill_rows`) and set every product's ``min_prefill_rows``,
    which it returns; logs ``min_prefill_rows_measured``."""
    return _set_measured(products, kind, "min_prefill_rows", lambda: measure_min_prefill_rows(products, clock=clock))


def _set_measured(products: Sequence[SwitchedLinear], kind: str, field: str, measure: Callable[[], T]) -> T:
    """``measure()`` set as ``field`` of every product; logs ``<field>_measured`` with the figure."""
    started = time.perf_counter()
    value = measure()
    for product in products:
        setattr(product, field, value)
    event = "quantized_rows_measured" if field == "max_rows" else f"{field}_measured"
    log.info(event, backend=kind, **{"max_quantized_rows" if field == "max_rows" else field: value},
             num_threads=torch.get_num_threads(), duration_s=round(time.perf_counter() - started, 3))  # fmt: skip
    return value


def _pass_s(linears: Sequence[Linear], inputs: Sequence[torch.Tensor], clock: Callable[[], float]) -> float:
    started = clock()
    for linear, x in zip(linears, inputs):
        linear.mm(x)
    return clock() - started


def _in_features(product: SwitchedLinear) -> int:
    in_features = getattr(product.quantized, "in_features", None)
    if in_features is None:
        raise TypeError(f"{type(product.quantized).__name__} does not say its in_features")
    return int(in_features)
