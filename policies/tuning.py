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
