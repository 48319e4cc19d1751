"""SLO-driven tuning of one batching knob: the largest value whose latencies keep the SLO.

The seed method: fix TTFT and TPOT SLOs first, then grow the batch as far as they allow. A
larger ``max_num_seqs`` / ``max_batch_size`` (or a longer ``max_queue_delay_ms``) raises
throughput and latency together, so latency is taken to grow with the knob. The tuner:

- holds while it has too few samples since its last change (the new value has not shown yet);
- on a breach (a p95 above its SLO) goes back to the last value that kept the SLO and remembers
  the breaching value as a ceiling; with no such value (the load changed under it) it cuts to
  half, or further to the share ``(1 - headroom) * target / observed`` of the value;
- with headroom (every p95 below ``(1 - headroom)`` times its SLO) grows: doubling while no
  ceiling is known, else halfway to the ceiling, never reaching it;
- forgets the ceiling after ``ceiling_ttl_intervals`` intervals, so it probes again when the
  load has changed.

Under a steady load each breach is followed at once by a step back to a value that kept the
SLO, so the SLO is never exceeded for more than one adjustment interval, and re-probes happen at
most once per ``ceiling_ttl_intervals``. When the load itself slows, the cuts compound until the
SLO holds again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SLO:
    """p95 latency targets in milliseconds; ``None``: not constrained."""

    ttft_p95_ms: float | None = None
    tpot_p95_ms: float | None = None

    def breached(self, ttft_p95_ms: float | None, tpot_p95_ms: float | None) -> bool:
        return _over(ttft_p95_ms, self.ttft_p95_ms, 1.0) or _over(tpot_p95_ms, self.tpot_p95_ms, 1.0)

    def scale_to_fit(self, ttft_p95_ms: float | None, tpot_p95_ms: float | None, headroom: float) -> float:
        """The smallest ``(1 - headroom) * target / observed`` over the constrained p95s (1.0 when
        none is known): the share of the knob that latency proportional to it would allow."""
        shares = [
            (1.0 - headroom) * target / observed
            for observed, target in ((ttft_p95_ms, self.ttft_p95_ms), (tpot_p95_ms, self.tpot_p95_ms))
            if observed and target is not None
        ]
        return min(shares, default=1.0)

    def has_headroom(self, ttft_p95_ms: float | None, tpot_p95_ms: float | None, headroom: float) -> bool:
        """Every constrained p95 is known and below ``(1 - headroom)`` times its target."""
        return not (
            _over(ttft_p95_ms, self.ttft_p95_ms, 1.0 - headroom, unknown_is_over=True)
            or _over(tpot_p95_ms, self.tpot_p95_ms, 1.0 - headroom, unknown_is_over=True)
        )


def _over(observed: float | None, target: float | None, share: float, unknown_is_over: bool = False) -> bool:
    if target is None:
        return False
    if observed is None:
        return unknown_is_over
    return observed > target * share


class SLOTuner:
    """Proposes the next value of one integer knob from observed p95 latencies.

    Args:
        slo: the targets.
        initial: the knob's value now.
        min_value, max_value: bounds the tuner stays within.
        headroom: grow only while every p95 is below ``(1 - headroom) * target``.
        min_samples: requests finished under the current value before it is judged.
        ceiling_ttl_intervals: intervals after which a remembered breaching value is forgotten.
    Raises:
        ValueError: bounds out of order, ``initial`` outside them, or ``headroom`` not in [0, 1).
    """

    def __init__(
        self,
        slo: SLO,
        initial: int,
        min_value: int,
        max_value: int,
        headroom: float = 0.2,
        min_samples: int = 20,
        ceiling_ttl_intervals: int = 30,
    ):
        if not min_value <= initial <= max_value or min_value < 1:
            raise ValueError(f"need 1 <= min_value <= initial <= max_value, got {min_value}, {initial}, {max_value}")
        if not 0 <= headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {headroom}")
        self.slo = slo
        self.value = initial
        self.min_value = min_value
        self.max_value = max_value
        self.headroom = headroom
        self.min_samples = min_samples
        self.ceiling_ttl_intervals = ceiling_ttl_intervals
        self.last_good: int | None = None
        self.ceiling: int | None = None
        self._ceiling_age = 0

    def propose(self, ttft_p95_ms: float | None, tpot_p95_ms: float | None, num_samples: int) -> int | None:
        """The knob's next value from one interval's p95s over ``num_samples`` requests finished
        under the current value; ``None``: keep it. A returned value becomes :attr:`value`."""
        if self.ceiling is not None:
            self._ceiling_age += 1
            if self._ceiling_age > self.ceiling_ttl_intervals:
                self.ceiling, self._ceiling_age = None, 0
        if num_samples < self.min_samples:
            return None
        if self.slo.breached(ttft_p95_ms, tpot_p95_ms):
            self.ceiling, self._ceiling_age = self.value, 0
            if self.last_good is not None and self.last_good < self.value:
                return self._move(self.last_good)
            self.last_good = None
            scale = self.slo.scale_to_fit(ttft_p95_ms, tpot_p95_ms, self.headroom)
            return self._move(max(self.min_value, min(self.value // 2, math.floor(self.value * scale))))
        self.last_good = self.value
        if not self.slo.has_headroom(ttft_p95_ms, tpot_p95_ms, self.headroom):
            return None
        if self.ceiling is None:
            return self._move(min(self.max_value, self.value * 2))
        return self._move(min(self.max_value, self.value + math.floor((self.ceiling - self.value) / 2)))

    def _move(self, value: int) -> int | None:
        value = max(self.min_value, min(self.max_value, value))
        if value == self.value:
            return None
        self.value = value
        return value


@dataclass(frozen=True)
class SweepPoint:
    """One step of a concurrency sweep against one bucket (``sluice bench tune``).

    Fields:
        concurrency: requests kept in flight.
        requests_per_s: completed requests per second.
        ttft_p95_ms, tpot_p95_ms: p95 latencies (``None``: not measured, e.g. TPOT of embeddings).
        goodput_per_s: requests per second within the SLO (``None``: not measured).
    """

    concurrency: int
    requests_per_s: float
    ttft_p95_ms: float | None
    tpot_p95_ms: float | None = None
    goodput_per_s: float | None = None


@dataclass(frozen=True)
class KnobProposal:
    """What a sweep suggests for a bucket: ``knobs`` is an admin PATCH body; ``chosen`` the
    index of the sweep step it is based on; ``notes`` say why, one line each."""

    knobs: dict[str, float | int]
    chosen: int
    notes: tuple[str, ...]


def _chosen_step(points: list[SweepPoint], slo: SLO, knee: int | None) -> tuple[int, str]:
    """The index of the step :func:`propose_knobs` bases its knobs on, and why (one line)."""
    candidates = [i for i in range(len(points) if knee is None else max(1, knee)) if points[i].requests_per_s > 0]
    keeping = [i for i in candidates if not slo.breached(points[i].ttft_p95_ms, points[i].tpot_p95_ms)]
    if keeping:
        chosen = max(keeping, key=lambda i: (_throughput(points[i]), -points[i].concurrency))
        return chosen, (f"concurrency {points[chosen].concurrency}: the most throughput within the SLO"
                        + ("" if knee is None else f", below the knee at {points[knee].concurrency}"))
    chosen = next(i for i, p in enumerate(points) if p.requests_per_s > 0)
    return chosen, f"no step kept the SLO; concurrency {points[chosen].concurrency}, the smallest load that completed requests, is proposed"


def propose_knobs(
    points: list[SweepPoint], slo: SLO, kind: str, knee: int | None, max_input_tokens: int
) -> KnobProposal:
    """Batch knobs and admission caps for a bucket from a concurrency sweep.

    The chosen step is the one with the most goodput (else requests/s) among the steps before
    the knee (past it, more load buys latency, not throughput) whose p95s keep the SLO; the
    smallest load that completed requests when none does (steps that completed none never count).
    Its concurrency becomes the batch cap (``max_num_seqs`` for a
    continuous bucket, ``max_batch_size`` for a dynamic one). Admission: by Little's law a
    request queued behind ``k`` others waits about ``k / throughput`` more, so the queue holds
    ``throughput * (TTFT SLO - chosen p95 TTFT)`` requests (at least 1; one batch's worth when
    TTFT is not constrained), and ``max_queued_tokens`` that many full-length prompts. A dynamic
    bucket waits for a batch no longer than it takes to gather one at the measured rate,
    ``(batch - 1) / throughput``, and at most half the TTFT slack.

    Args:
        points: the sweep's steps, in increasing load.
        slo: the targets.
        kind: ``"continuous"`` or ``"dynamic"``.
        knee: index of the knee step (``None``: none found).
        max_input_tokens: the bucket's prompt limit.
    Raises:
        ValueError: no points, no step that completed a request, or an unknown ``kind``.
    """
    if not points:
        raise ValueError("propose_knobs needs at least one sweep point")
    if kind not in ("continuous", "dynamic"):
        raise ValueError(f"kind must be 'continuous' or 'dynamic', not {kind!r}")
    if all(p.requests_per_s <= 0 for p in points):
        raise ValueError("no step of the sweep completed a request: nothing to base knobs on")
    chosen, choice_note = _chosen_step(points, slo, knee)
    notes = [choice_note]
    point = points[chosen]
    batch = max(1, point.concurrency)
    throughput = max(point.requests_per_s, 1e-9)
    slack_s = None
    if slo.ttft_p95_ms is not None and point.ttft_p95_ms is not None:
        slack_s = max(0.0, (slo.ttft_p95_ms - point.ttft_p95_ms) / 1000)
    max_queue_len, queue_note = _queue_len(throughput, slack_s, batch)
    notes.append(queue_note)
    knobs: dict[str, float | int] = {"max_queue_len": max_queue_len, "max_queued_tokens": max_queue_len * max_input_tokens}
    if kind == "continuous":
        knobs["max_num_seqs"] = batch
    else:
        knobs["max_batch_size"] = batch
        delay_s = (batch - 1) / throughput
        if slack_s is not None:
            delay_s = min(delay_s, slack_s / 2)
        knobs["max_queue_delay_ms"] = round(delay_s * 1000, 1)
    return KnobProposal(knobs=knobs, chosen=chosen, notes=tuple(notes))


def _queue_len(throughput: float, slack_s: float | None, batch: int) -> tuple[int, str]:
    """Little's law: the requests that can queue within ``slack_s`` of TTFT at ``throughput``
    requests/s (at least 1); one batch when TTFT is not constrained. With the reason."""
    if slack_s is None:
        return batch, f"queue: TTFT not constrained, one batch ({batch}) may wait"
    max_queue_len = max(1, math.floor(throughput * slack_s))
    return max_queue_len, f"queue: {throughput:.2f} req/s x {slack_s * 1000:.0f} ms TTFT slack = {max_queue_len} requests"


def _throughput(point: SweepPoint) -> float:
    return point.goodput_per_s if point.goodput_per_s is not None else point.requests_per_s
