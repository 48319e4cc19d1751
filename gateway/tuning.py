"""The SLO tuning loop: for every bucket with an ``slo``, feed its observed p95 TTFT and TPOT to
:class:`policies.tuning.SLOTuner` each ``interval_s`` and apply what it proposes through the same
path as the admin API's PATCH (validated, logged as an ``admin_audit`` event with ``who="slo_tuner"``).

Continuous buckets tune ``max_num_seqs``; dynamic buckets tune ``max_batch_size`` and
``max_queue_delay_ms`` (each by its own tuner, both judged by the same latencies). Only requests
that finished under the current knob values count.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.admin import change_knobs
from gateway.config import SLOConfig
from gateway.engine import Engine
from gateway.errors import APIError
from gateway.metrics import Metrics, RequestTiming
from policies.tuning import SLO, SLOTuner

audit_log = structlog.get_logger("sluice.admin")
log = structlog.get_logger(__name__)

TICK_S = 0.5


def p95(values: list[float]) -> float | None:
    """Nearest-rank 95th percentile; ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


@dataclass
class BucketTuning:
    """The tuners of one bucket (one per knob), and since when its knobs have held."""

    bucket_id: int
    slo: SLOConfig
    tuners: dict[str, SLOTuner]
    since_s: float
    next_s: float
    history: list[dict[str, Any]] = field(default_factory=list)


def tuners_for(slo: SLOConfig, kind: str, knobs: dict[str, Any]) -> dict[str, SLOTuner]:
    """The knob name -> tuner of a bucket of ``kind`` whose batcher config is ``knobs``."""
    targets = SLO(slo.ttft_p95_ms, slo.tpot_p95_ms)

    def tuner(initial: int, low: int, high: int) -> SLOTuner:
        initial = max(low, min(high, initial))
        return SLOTuner(targets, initial, low, high, slo.headroom, slo.min_samples)

    if kind == "continuous":
        return {"max_num_seqs": tuner(knobs["max_num_seqs"], slo.min_batch, slo.max_batch)}
    return {
        "max_batch_size": tuner(knobs["max_batch_size"], slo.min_batch, slo.max_batch),
        "max_queue_delay_ms": tuner(
            max(1, round(knobs["max_queue_delay_ms"])), slo.min_queue_delay_ms, slo.max_queue_delay_ms
        ),
    }


class TuningLoop:
    """Runs on the event loop; :meth:`tick` once per ``TICK_S`` (see :meth:`run`)."""

    def __init__(self, engine: Engine, metrics: Metrics, lock: asyncio.Lock, clock: Any = time.monotonic):
        self.engine = engine
        self.metrics = metrics
        self.lock = lock
        self.clock = clock
        self.buckets: dict[tuple[str, str], BucketTuning] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.tick()
            except Exception:  # the loop never dies; the next tick tries again
                log.exception("slo_tuning_failed")

    async def tick(self) -> None:
        """Judge every bucket whose interval has passed; apply the changes its tuners propose."""
        now = self.clock()
        for name, served in list(self.engine.models.items()):
            if served.draining:
                continue
            for bucket_config in served.config.buckets:
                bucket = served.table.by_name(bucket_config.bucket_name)
                if bucket_config.slo is None or bucket is None:
                    continue
                key = (name, bucket.name)
                state = self.buckets.get(key)
                if state is None or state.bucket_id != id(bucket) or state.slo != bucket_config.slo:
                    knobs = bucket_config.batcher.model_dump()
                    state = BucketTuning(id(bucket), bucket_config.slo, tuners_for(bucket_config.slo, bucket.kind, knobs), now, now)
                    self.buckets[key] = state
                if now < state.next_s:
                    continue
                state.next_s = now + state.slo.interval_s
                timings = [t for t in self.metrics.recent(name, bucket.name) if t.outcome == "ok" and t.finished_s >= state.since_s]
                changes = self._proposals(state, timings)
                if not changes:
                    continue
                async with self.lock:
                    try:
                        old, new = change_knobs(self.engine, name, bucket.name, changes)
                    except (APIError, KeyError, StopIteration) as exc:
                        log.warning("slo_tuning_refused", model=name, bucket=bucket.name, changes=changes, error=str(exc))
                        continue
                state.since_s = self.clock()
                state.history.append({"time_s": state.since_s, **changes})
                audit_log.info(
                    "admin_audit", who="slo_tuner", action="tune_bucket", model=f"{name}/{bucket.name}", before=old, after=new
                )

    @staticmethod
    def _proposals(state: BucketTuning, timings: list[RequestTiming]) -> dict[str, int]:
        ttft = p95([t.ttft_s * 1000 for t in timings if t.ttft_s is not None])
        tpot = p95([t.tpot_s * 1000 for t in timings if t.tpot_s is not None])
        changes = {}
        for knob, tuner in state.tuners.items():
            value = tuner.propose(ttft, tpot, len(timings))
            if value is not None:
                changes[knob] = value
        return changes
