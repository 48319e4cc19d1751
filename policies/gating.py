"""Backend gates: enable a faster backend for a bucket only on a recorded win.

The seed's rule: compilation and quantisation are measured before they are trusted. For each
candidate backend a gate run measures, at the bucket's shapes, the latency per batch of the
candidate and of ``eager`` (medians of interleaved runs) and the candidate's accuracy against
``eager``. This module turns those plain numbers into a verdict:

- **speed**: the speed-up at a shape is ``eager_ms / candidate_ms``; the candidate's speed-up is
  the geometric mean over shapes, and it must be at least ``min_speedup`` with no shape slower
  than eager (a backend that wins on average but loses at one of the bucket's shapes would make
  that shape's requests slower);
- **accuracy**: embeddings need a minimum cosine to eager of at least ``min_cosine`` (FP32) or
  ``min_cosine_quantized`` (INT8); generation needs identical greedy tokens (FP32) or a top-1
  agreement of at least ``min_top1_agreement`` (quantised);
- a candidate that could not be built or run (``error``) is refused.

:func:`choose_backend` takes the enabled candidate with the largest speed-up, else ``eager``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GateThresholds:
    """What a candidate must show. Ratios are plain numbers (1.2 = 20% faster)."""

    min_speedup: float = 1.2
    min_cosine: float = 0.999
    min_cosine_quantized: float = 0.99
    min_top1_agreement: float = 0.99


@dataclass(frozen=True)
class Measurement:
    """One candidate's gate measurements at a bucket's shapes.

    Fields:
        backend: the candidate's label (``compiled``, ``onnx-fp32``, ``onnx-int8``).
        quantized: whether its weights are quantised (looser accuracy bound).
        eager_ms, candidate_ms: median latency per batch in ms, one entry per shape, same order.
        min_cosine: embeddings: the smallest cosine similarity to eager's embeddings.
        tokens_identical: generation, unquantised: greedy tokens equal eager's everywhere.
        top1_agreement: generation, quantised: share of positions whose argmax equals eager's.
        error: why the candidate could not be built or run (then nothing else counts).
    """

    backend: str
    quantized: bool = False
    eager_ms: tuple[float, ...] = ()
    candidate_ms: tuple[float, ...] = ()
    min_cosine: float | None = None
    tokens_identical: bool | None = None
    top1_agreement: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class Verdict:
    """A gate's decision for one candidate: ``enabled``, its speed-up (geometric mean over
    shapes, ``None`` when not measured) and the reasons, one line each."""

    backend: str
    enabled: bool
    speedup: float | None
    reasons: tuple[str, ...] = field(default_factory=tuple)


def speedups(measurement: Measurement) -> list[float]:
    """Per shape ``eager_ms / candidate_ms``.

    Raises:
        ValueError: the two latency lists differ in length, or a latency is not positive.
    """
    if len(measurement.eager_ms) != len(measurement.candidate_ms):
        raise ValueError(f"{measurement.backend}: {len(measurement.eager_ms)} eager latencies, {len(measurement.candidate_ms)} candidate")
    if any(not ms > 0 for ms in (*measurement.eager_ms, *measurement.candidate_ms)):
        raise ValueError(f"{measurement.backend}: latencies must be positive")
    return [e / c for e, c in zip(measurement.eager_ms, measurement.candidate_ms)]


def judge(measurement: Measurement, thresholds: GateThresholds) -> Verdict:
    """The verdict on one candidate (see the module docstring for the rules)."""
    name = measurement.backend
    if measurement.error is not None:
        return Verdict(name, False, None, (f"failed: {measurement.error}",))
    ratios = speedups(measurement)
    if not ratios:
        return Verdict(name, False, None, ("no shape was measured",))
    speedup = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    reasons = []
    fast = speedup >= thresholds.min_speedup and min(ratios) >= 1.0
    if speedup < thresholds.min_speedup:
        reasons.append(f"speed-up {speedup:.2f}x below {thresholds.min_speedup:.2f}x")
    elif min(ratios) < 1.0:
        reasons.append(f"slower than eager at a shape ({min(ratios):.2f}x)")
    else:
        reasons.append(f"speed-up {speedup:.2f}x (at least {thresholds.min_speedup:.2f}x, every shape >= 1.0x)")
    accurate, accuracy_reason = _accuracy(measurement, thresholds)
    reasons.append(accuracy_reason)
    return Verdict(name, fast and accurate, speedup, tuple(reasons))


def _accuracy(m: Measurement, t: GateThresholds) -> tuple[bool, str]:
    if m.min_cosine is not None:
        bound = t.min_cosine_quantized if m.quantized else t.min_cosine
        ok = m.min_cosine >= bound
        return ok, f"min cosine {m.min_cosine:.5f} {'>=' if ok else '<'} {bound}"
    if m.quantized and m.top1_agreement is not None:
        ok = m.top1_agreement >= t.min_top1_agreement
        return ok, f"top-1 agreement {m.top1_agreement:.2%} {'>=' if ok else '<'} {t.min_top1_agreement:.0%}"
    if not m.quantized and m.tokens_identical is not None:
        return m.tokens_identical, "greedy tokens identical" if m.tokens_identical else "greedy tokens differ from eager"
    return False, "no accuracy measurement"


def choose_backend(verdicts: list[Verdict]) -> str:
    """The enabled candidate with the largest speed-up; ``"eager"`` when none is enabled."""
    enabled = [v for v in verdicts if v.enabled and v.speedup is not None]
    return max(enabled, key=lambda v: v.speedup or 0.0).backend if enabled else "eager"
