"""Backend gates: enable a faster backend for a bucket only on a recorded, confident win.

The seed's rule: compilation and quantisation are measured before they are trusted. For each
candidate backend a gate run measures, at the bucket's shapes, the latency per batch of the
candidate and of ``eager`` (interleaved repeats: in repeat ``r`` both ran side by side) and the
candidate's accuracy against ``eager``. This module turns those plain numbers into a verdict:

- **speed**: the speed-up at a shape is ``eager_ms / candidate_ms`` of the medians; the
  candidate's speed-up is the geometric mean over shapes, and it must be at least
  ``min_speedup`` with no shape slower than eager (a backend that wins on average but loses at
  one of the bucket's shapes would make that shape's requests slower);
- **confidence**: on a shared machine one lucky run is not a win. Repeat ``r`` gives one paired
  sample of the speed-up, the geometric mean over shapes of ``eager[s][r] / candidate[s][r]``.
  A percentile bootstrap of the geometric mean of those samples (:data:`BOOTSTRAP_RESAMPLES`
  resamples with replacement, drawn by a generator seeded with :data:`BOOTSTRAP_SEED`, so the
  same figures always give the same verdict) gives a two-sided ``confidence`` interval; its
  lower end, the ``(1 - confidence) / 2`` quantile of the resampled means, must be at least
  ``min_speedup`` too. A candidate whose median wins but whose repeats scatter is refused;
  figures without repeats are refused;
- **accuracy**: embeddings need a minimum cosine to eager of at least ``min_cosine`` (FP32) or
  ``min_cosine_quantized`` (INT8); generation needs identical greedy tokens (an exact kind,
  near-ties allowed: :mod:`models.backends.decoder_gate`) or, for a lossy kind, teacher-forced
  along eager's tokens, a top-1 agreement of at least ``min_top1_agreement`` and, where
  measured, a mean KL to eager of at most ``max_mean_kl_nats``;
- a candidate that could not be built or run (``error``) is refused.

:func:`choose_backend` picks among the enabled candidates by a fixed preference
(:data:`BACKEND_PREFERENCE`), and leaves a preferred candidate for a less preferred one only on
a confident win over it: the same paired-bootstrap rule, on the per-repeat ratio of the two
candidates' own latencies (both ran in the same interleaved rounds, so eager cancels out), must
show a lower bound of at least ``min_gain_over_preferred``. Two candidates that tie within the
noise therefore give the same choice on every run, instead of whichever median was lower this
time; ``eager`` when none is enabled.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

BOOTSTRAP_RESAMPLES = 2000
# Among enabled candidates, the order of preference when none is confidently faster than a
# preferred one: exact kinds before lossy ones, and among those, fewer extra weight bytes first.
# ``compiled`` keeps eager's weights (no second copy in memory) and its exact tokens,
# ``onnx-fp32`` is exact but holds its own copy of the weights, ``lean`` is exact with fused
# copies of the QKV and gate/up weights, ``lean-int4`` is exact from a GGUF Q4_1 source (its
# blocks beside eager's float32 weights); then the approximations: ``onnx-int8``, ``lean-int8``
# (float32 activations, exact on its int8 weights), ``lean-int4-q8a`` (lean-int4 with int8
# activations in prefill-sized products), the bfloat16-activation kinds, ``lean-int8-q8a``.
# Labels not listed come after, in name order.
BACKEND_PREFERENCE = (
    "compiled", "onnx-fp32", "lean", "lean-int4", "onnx-int8", "lean-int8", "lean-int4-q8a", "lean-int4-bf16",
    "lean-int8-bf16", "lean-int8-q8a",
)  # fmt: skip
BOOTSTRAP_SEED = 0
# A geometric mean of equal ratios may land an ulp below their value.
_ROUND_OFF = 1e-12


@dataclass(frozen=True)
class GateThresholds:
    """What a candidate must show. Ratios are plain numbers (1.2 = 20% faster); ``confidence``
    is the two-sided level of the bootstrap interval whose lower end must reach ``min_speedup``
    (against eager) and ``min_gain_over_preferred`` (against a more preferred enabled
    candidate, see :func:`choose_backend`)."""

    min_speedup: float = 1.2
    min_cosine: float = 0.999
    min_cosine_quantized: float = 0.99
    min_top1_agreement: float = 0.99
    confidence: float = 0.95
    min_gain_over_preferred: float = 1.1
    max_mean_kl_nats: float = 0.02


@dataclass(frozen=True)
class Measurement:
    """One candidate's gate measurements at a bucket's shapes.

    Fields:
        backend: the candidate's label (``compiled``, ``onnx-fp32``, ``onnx-int8``).
        quantized: whether its weights are quantised (looser accuracy bound).
        eager_ms, candidate_ms: median latency per batch in ms, one entry per shape, same order.
        eager_repeats_ms, candidate_repeats_ms: every repeat's latency in ms, per shape (same
            order), then per repeat; repeat ``r`` of both ran side by side.
        min_cosine: embeddings: the smallest cosine similarity to eager's embeddings.
        tokens_identical: generation, unquantised: greedy tokens equal eager's everywhere.
        top1_agreement: generation, quantised: share of positions whose argmax equals eager's.
        mean_kl_nats: generation, quantised: mean KL(eager || candidate) per position, nats.
        error: why the candidate could not be built or run (then nothing else counts).
    """

    backend: str
    quantized: bool = False
    eager_ms: tuple[float, ...] = ()
    candidate_ms: tuple[float, ...] = ()
    eager_repeats_ms: tuple[tuple[float, ...], ...] = ()
    candidate_repeats_ms: tuple[tuple[float, ...], ...] = ()
    min_cosine: float | None = None
    tokens_identical: bool | None = None
    top1_agreement: float | None = None
    mean_kl_nats: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class Verdict:
    """A gate's decision for one candidate: ``enabled``, its speed-up (geometric mean over
    shapes, ``None`` when not measured), the reasons, one line each, the lower end of the
    speed-up's bootstrap interval (``None`` when not computed), and the candidate's own latency
    in ms per shape, then per repeat (``Measurement.candidate_repeats_ms``), which
    :func:`choose_backend` compares between candidates."""

    backend: str
    enabled: bool
    speedup: float | None
    reasons: tuple[str, ...] = field(default_factory=tuple)
    speedup_low: float | None = None
    repeats_ms: tuple[tuple[float, ...], ...] = ()


def speedups(measurement: Measurement) -> list[float]:
    """Per shape ``eager_ms / candidate_ms``.

    Raises:
        ValueError: the two latency lists differ in length, or a latency is not positive.
    """
    return _ratios(measurement.backend, measurement.eager_ms, measurement.candidate_ms)


def repeat_speedups(measurement: Measurement) -> list[float]:
    """Per repeat, the geometric mean over shapes of ``eager / candidate`` in that repeat
    (empty when the measurement has no per-repeat figures).

    Raises:
        ValueError: the shapes or repeats of the two differ in number, or a latency is not positive.
    """
    eager, candidate = measurement.eager_repeats_ms, measurement.candidate_repeats_ms
    if len(eager) != len(candidate) or (eager and len(eager) != len(measurement.eager_ms)):
        raise ValueError(f"{measurement.backend}: {len(eager)} shapes of eager repeats, {len(candidate)} of candidate, "
                         f"{len(measurement.eager_ms)} of medians")
    per_shape = [_ratios(measurement.backend, e, c) for e, c in zip(eager, candidate)]
    if len({len(r) for r in per_shape}) > 1:
        raise ValueError(f"{measurement.backend}: shapes differ in their number of repeats")
    return [_geometric_mean(list(repeat)) for repeat in zip(*per_shape)]


def bootstrap_lower_bound(samples: list[float], confidence: float) -> float:
    """The lower end of the two-sided ``confidence`` percentile-bootstrap interval of the
    geometric mean of ``samples`` (positive ratios); seeded, so it is reproducible.

    Raises:
        ValueError: ``samples`` is empty or ``confidence`` is not in (0, 1).
    """
    if not samples or not 0 < confidence < 1:
        raise ValueError(f"need samples and a confidence in (0, 1), got {len(samples)} samples, {confidence}")
    logs = [math.log(x) for x in samples]
    rng = random.Random(BOOTSTRAP_SEED)
    means = sorted(math.fsum(rng.choices(logs, k=len(logs))) / len(logs) for _ in range(BOOTSTRAP_RESAMPLES))
    index = min(len(means) - 1, int((1 - confidence) / 2 * len(means)))
    return math.exp(means[index])


def judge(measurement: Measurement, thresholds: GateThresholds) -> Verdict:
    """The verdict on one candidate (see the module docstring for the rules)."""
    name = measurement.backend
    if measurement.error is not None:
        return Verdict(name, False, None, (f"failed: {measurement.error}",))
    ratios = speedups(measurement)
    if not ratios:
        return Verdict(name, False, None, ("no shape was measured",))
    speedup = _geometric_mean(ratios)
    repeats = repeat_speedups(measurement)
    low = bootstrap_lower_bound(repeats, thresholds.confidence) if repeats else None
    speed_ok, speed_reason = _speed(speedup, min(ratios), low, thresholds)
    accurate, accuracy_reason = _accuracy(measurement, thresholds)
    return Verdict(
        name, speed_ok and accurate, speedup, (speed_reason, accuracy_reason), low, measurement.candidate_repeats_ms,
    )


def _speed(speedup: float, slowest: float, low: float | None, t: GateThresholds) -> tuple[bool, str]:
    bound = t.min_speedup - _ROUND_OFF
    level = f"{t.confidence:.0%}"
    if speedup < bound:
        return False, f"speed-up {speedup:.2f}x below {t.min_speedup:.2f}x"
    if slowest < 1.0:
        return False, f"slower than eager at a shape ({slowest:.2f}x)"
    if low is None:
        return False, f"speed-up {speedup:.2f}x, but no per-repeat figures to bound it: run the gate again"
    if low < bound:
        return False, f"speed-up {speedup:.2f}x, but its {level} lower bound {low:.2f}x is below {t.min_speedup:.2f}x (too noisy)"
    return True, f"speed-up {speedup:.2f}x, {level} lower bound {low:.2f}x (at least {t.min_speedup:.2f}x, every shape >= 1.0x)"


def _ratios(backend: str, eager_ms: tuple[float, ...], candidate_ms: tuple[float, ...]) -> list[float]:
    if len(eager_ms) != len(candidate_ms):
        raise ValueError(f"{backend}: {len(eager_ms)} eager latencies, {len(candidate_ms)} candidate")
    if any(not ms > 0 for ms in (*eager_ms, *candidate_ms)):
        raise ValueError(f"{backend}: latencies must be positive")
    return [e / c for e, c in zip(eager_ms, candidate_ms)]


def _geometric_mean(values: list[float]) -> float:
    return math.exp(math.fsum(math.log(v) for v in values) / len(values))


def _accuracy(m: Measurement, t: GateThresholds) -> tuple[bool, str]:
    if m.min_cosine is not None:
        bound = t.min_cosine_quantized if m.quantized else t.min_cosine
        ok = m.min_cosine >= bound
        return ok, f"min cosine {m.min_cosine:.5f} {'>=' if ok else '<'} {bound}"
    if m.quantized and m.top1_agreement is not None:
        ok = m.top1_agreement >= t.min_top1_agreement
        reason = f"top-1 agreement {m.top1_agreement:.2%} {'>=' if ok else '<'} {t.min_top1_agreement:.0%}"
        if m.mean_kl_nats is None:
            return ok, reason
        close = m.mean_kl_nats <= t.max_mean_kl_nats
        return ok and close, f"{reason}, mean KL {m.mean_kl_nats:.5f} nats {'<=' if close else '>'} {t.max_mean_kl_nats}"
    if not m.quantized and m.tokens_identical is not None:
        return m.tokens_identical, "greedy tokens identical" if m.tokens_identical else "greedy tokens differ from eager"
    return False, "no accuracy measurement"


def choose_backend(verdicts: list[Verdict], thresholds: GateThresholds = GateThresholds()) -> str:
    """The backend a bucket should run: the most preferred enabled candidate
    (:data:`BACKEND_PREFERENCE`), unless a less preferred one is confidently faster than it
    (:func:`gain_lower_bound` at least ``thresholds.min_gain_over_preferred``); ``"eager"``
    when none is enabled. The candidates are taken in order of preference, each challenging the
    choice so far, so the result depends on the figures and the order, never on which median
    happened to be lower in a tie."""
    enabled = sorted((v for v in verdicts if v.enabled and v.speedup is not None), key=_preference)
    if not enabled:
        return "eager"
    chosen = enabled[0]
    for challenger in enabled[1:]:
        low = gain_lower_bound(challenger, chosen, thresholds.confidence)
        if low is not None and low >= thresholds.min_gain_over_preferred - _ROUND_OFF:
            chosen = challenger
    return chosen.backend


def gain_lower_bound(challenger: Verdict, incumbent: Verdict, confidence: float) -> float | None:
    """The lower end of the two-sided ``confidence`` bootstrap interval of how much faster
    ``challenger`` ran than ``incumbent``: per repeat, the geometric mean over shapes of
    ``incumbent_ms / challenger_ms`` (the two ran in the same interleaved round); ``None`` when
    either has no per-repeat figures or their shapes or repeats differ in number."""
    a, b = challenger.repeats_ms, incumbent.repeats_ms
    if not a or len(a) != len(b) or any(len(x) != len(y) or not x for x, y in zip(a, b)):
        return None
    per_shape = [_ratios(challenger.backend, y, x) for x, y in zip(a, b)]
    if len({len(r) for r in per_shape}) > 1:
        return None
    return bootstrap_lower_bound([_geometric_mean(list(r)) for r in zip(*per_shape)], confidence)


def _preference(verdict: Verdict) -> tuple[int, str]:
    name = verdict.backend
    rank = BACKEND_PREFERENCE.index(name) if name in BACKEND_PREFERENCE else len(BACKEND_PREFERENCE)
    return rank, name
