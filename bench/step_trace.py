"""Per-step timing and KV occupancy of the Sluice run, for the engine benchmark's report.

:class:`StepTrace` steps a :class:`buckets.continuous.ContinuousBatcher` one ``step()`` at a time
and records a :class:`StepSample` for each: the step's wall seconds, the seconds of its model
forward (measured by :class:`TimedRunner`, a thin proxy around the runner), how many sequences the
forward ran, and the KV blocks held against the tokens those blocks store. From the samples it
derives the forward share of step time (:meth:`StepTrace.forward_share`) and the paged pool's
overhead over the bytes the tokens need (:meth:`StepTrace.kv_overhead`).

The instrumentation costs two clock reads around each forward and each step, and a sum over the
running sequences after each step (outside the step's own timing), so it does not distort the run.
No torch here: the proxy only forwards calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

FORWARD_SHARE_NUM_SEQS = 32


class TimedRunner:
    """Wraps a model runner; times each ``run(batch)`` and notes how many sequences it ran.

    Every other attribute (``kv_cache``, ...) is the wrapped runner's, so the batcher sees no difference.
    """

    def __init__(self, runner: Any):
        self.runner = runner
        self.forward_s = 0.0
        self.num_seqs = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def run(self, batch: Any) -> Any:
        """Run ``batch`` (a ``ForwardInput``) on the wrapped runner, adding its wall seconds to ``forward_s``."""
        started = time.perf_counter()
        try:
            return self.runner.run(batch)
        finally:
            self.forward_s += time.perf_counter() - started
            self.num_seqs = max(self.num_seqs, len(batch.sequences))

    def take(self) -> tuple[float, int]:
        """Forward seconds and sequences since the last call (``(0.0, 0)`` when no forward ran); resets both."""
        taken = (self.forward_s, self.num_seqs)
        self.forward_s, self.num_seqs = 0.0, 0
        return taken


@dataclass(frozen=True)
class StepSample:
    """One ``batcher.step()``.

    Fields:
        step_s: wall seconds of the whole step (schedule, forward, postprocess).
        forward_s: of which in the runner's ``run`` (0 when the step ran no forward).
        num_seqs: sequences in the step's forward (0 when none ran).
        kv_bytes_held: bytes of the KV blocks in use after the step (used blocks * bytes per block).
        num_tokens_in_kv: tokens those blocks store after the step: the running sequences'
            ``num_computed_tokens``, summed.
    """

    step_s: float
    forward_s: float
    num_seqs: int
    kv_bytes_held: int
    num_tokens_in_kv: int


@dataclass(frozen=True)
class ForwardShare:
    """Forward seconds over step seconds, at ``num_seqs`` sequences and over all steps.

    ``at_num_seqs`` covers the steps that ran exactly ``requested_num_seqs`` sequences, or if none did,
    those with the smallest count above it (``num_seqs`` says which; ``None`` with ``at_num_seqs``
    ``None`` when no step reached it).
    """

    requested_num_seqs: int
    num_seqs: int | None
    at_num_seqs: float | None
    num_steps_at: int
    all_steps: float | None
    num_steps: int


@dataclass(frozen=True)
class KVOverhead:
    """KV bytes held over the bytes of the tokens they store (1.0: no waste), across the steps.

    ``ratio_max`` is the largest per-step ratio, ``ratio_mean`` the mean weighted by step seconds;
    both ``None`` when no step held a token. ``bytes_held_peak`` is the most bytes held after a step.
    """

    ratio_max: float | None
    ratio_mean: float | None
    bytes_held_peak: int


@dataclass
class StepTrace:
    """The samples of one batcher run. Make one per run, build the batcher on :attr:`runner`, and
    call :meth:`step` in place of ``batcher.step()``.

    Args:
        runner: the model runner to wrap (its ``kv_cache.bytes_per_block`` prices the blocks).
    """

    runner: TimedRunner
    samples: list[StepSample] = field(default_factory=list)

    @classmethod
    def around(cls, runner: Any) -> "StepTrace":
        """A trace whose :attr:`runner` wraps ``runner``."""
        return cls(TimedRunner(runner))

    def step(self, batcher: Any) -> None:
        """Run ``batcher.step()`` timed, then sample the KV held and the tokens in it."""
        started = time.perf_counter()
        batcher.step()
        step_s = time.perf_counter() - started
        forward_s, num_seqs = self.runner.take()
        held = batcher.block_manager.num_used_blocks * self.runner.kv_cache.bytes_per_block
        num_tokens = sum(seq.num_computed_tokens for seq in batcher.scheduler.running)
        self.samples.append(StepSample(step_s, forward_s, num_seqs, held, num_tokens))

    def forward_share(self, num_seqs: int = FORWARD_SHARE_NUM_SEQS) -> ForwardShare:
        """The share of step time spent in the forward, at ``num_seqs`` sequences and over all steps."""
        counts = {s.num_seqs for s in self.samples if s.num_seqs >= num_seqs}
        chosen = num_seqs if num_seqs in counts else min(counts, default=None)
        at = [s for s in self.samples if s.num_seqs == chosen] if chosen is not None else []
        return ForwardShare(
            requested_num_seqs=num_seqs,
            num_seqs=chosen,
            at_num_seqs=_share(at),
            num_steps_at=len(at),
            all_steps=_share(self.samples),
            num_steps=len(self.samples),
        )

    def kv_overhead(self, bytes_per_token: int) -> KVOverhead:
        """Bytes held over ``num_tokens_in_kv * bytes_per_token``, per step with tokens in the KV."""
        held = [s for s in self.samples if s.num_tokens_in_kv > 0]
        ratios = [s.kv_bytes_held / (s.num_tokens_in_kv * bytes_per_token) for s in held]
        total_s = sum(s.step_s for s in held)
        mean = sum(r * s.step_s for r, s in zip(ratios, held)) / total_s if total_s > 0 else None
        return KVOverhead(
            ratio_max=max(ratios, default=None),
            ratio_mean=mean,
            bytes_held_peak=max((s.kv_bytes_held for s in self.samples), default=0),
        )


def _share(samples: list[StepSample]) -> float | None:
    step_s = sum(s.step_s for s in samples)
    return sum(s.forward_s for s in samples) / step_s if step_s > 0 else None
