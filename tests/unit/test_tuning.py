"""The SLO tuner against a synthetic latency model, interval by interval on a fake clock."""

from __future__ import annotations

import pytest

from policies.tuning import SLO, SLOTuner, SweepPoint, propose_knobs
from tests.factories import FakeClock

INTERVAL_S = 5.0


class SyntheticBucket:
    """p95 TTFT and TPOT that grow linearly with the batch knob (ms); ``slowdown`` scales both."""

    def __init__(self, ttft_base_ms: float = 50.0, ttft_per_seq_ms: float = 20.0, tpot_base_ms: float = 20.0,
                 tpot_per_seq_ms: float = 3.0) -> None:
        self.ttft = (ttft_base_ms, ttft_per_seq_ms)
        self.tpot = (tpot_base_ms, tpot_per_seq_ms)
        self.slowdown = 1.0

    def p95_ms(self, knob: int) -> tuple[float, float]:
        return (
            self.slowdown * (self.ttft[0] + self.ttft[1] * knob),
            self.slowdown * (self.tpot[0] + self.tpot[1] * knob),
        )


def run(tuner: SLOTuner, bucket: SyntheticBucket, num_intervals: int, clock: FakeClock) -> list[tuple[float, int, bool]]:
    """``(time, knob, breached)`` per interval; the knob a proposal sets applies from the next one."""
    history = []
    for _ in range(num_intervals):
        clock.advance(INTERVAL_S)
        ttft, tpot = bucket.p95_ms(tuner.value)
        breached = tuner.slo.breached(ttft, tpot)
        history.append((clock(), tuner.value, breached))
        tuner.propose(ttft, tpot, num_samples=50)
    return history


def assert_no_breach_lasts(history: list[tuple[float, int, bool]]) -> None:
    """Every interval that breached the SLO is followed by one that does not."""
    for (_, _, breached), (_, _, next_breached) in zip(history, history[1:]):
        assert not (breached and next_breached), history


def test_the_tuner_grows_to_the_largest_knob_the_slo_allows_and_stays() -> None:
    slo = SLO(ttft_p95_ms=500.0, tpot_p95_ms=100.0)  # the model allows knob <= 22 (TTFT) and <= 26 (TPOT)
    tuner = SLOTuner(slo, initial=1, min_value=1, max_value=256, headroom=0.1)
    clock = FakeClock()
    history = run(tuner, SyntheticBucket(), 60, clock)
    assert_no_breach_lasts(history)
    assert sum(b for _, _, b in history) <= 2  # the doubling overshoot, then at most one re-probe
    final = [knob for _, knob, _ in history[-10:]]
    assert len(set(final)) == 1, history[-10:]
    # Growth stops inside the headroom: 50 + 20 k > 0.9 * 500 once k > 20; the SLO itself allows 22.
    assert 20 <= final[0] <= 22, history
    print(f"converged to {final[0]} after {next(i for i, (_, k, _) in enumerate(history) if k == final[0])} intervals")


def test_a_slowdown_backs_the_knob_off_then_holds_the_slo() -> None:
    slo = SLO(ttft_p95_ms=500.0)
    tuner = SLOTuner(slo, initial=4, min_value=1, max_value=64, headroom=0.1, ceiling_ttl_intervals=10)
    bucket = SyntheticBucket()
    clock = FakeClock()
    before = run(tuner, bucket, 30, clock)
    steady = tuner.value
    bucket.slowdown = 2.0  # the same knob now costs twice the latency
    after = run(tuner, bucket, 40, clock)
    assert_no_breach_lasts(before)
    recovered = next(i for i, (_, _, breached) in enumerate(after) if not breached)
    assert recovered <= 2, after  # the cuts compound: 22 -> 10 here
    assert_no_breach_lasts(after[recovered:])
    assert tuner.value < steady
    ttft, _ = bucket.p95_ms(tuner.value)
    assert ttft <= 500.0
    # Re-probes after the ceiling expires breach at most once per ceiling lifetime (10 intervals).
    assert sum(b for _, _, b in after) <= 1 + len(after) // 10


def test_the_tuner_holds_until_enough_requests_have_finished() -> None:
    tuner = SLOTuner(SLO(ttft_p95_ms=100.0), initial=8, min_value=1, max_value=64, min_samples=20)
    assert tuner.propose(10.0, None, num_samples=5) is None
    assert tuner.propose(500.0, None, num_samples=19) is None
    assert tuner.propose(500.0, None, num_samples=20) == 1  # no known good value: 8 * 0.8 * 100 / 500
    tuner = SLOTuner(SLO(ttft_p95_ms=100.0), initial=8, min_value=1, max_value=64, min_samples=20)
    assert tuner.propose(110.0, None, num_samples=20) == 4  # a small breach still halves
    assert tuner.propose(10.0, None, num_samples=20) == 6  # halfway to the breaching ceiling 8
    assert tuner.propose(10.0, None, num_samples=20) == 7
    assert tuner.propose(10.0, None, num_samples=20) is None  # never reaches the ceiling while it lasts


def test_bounds_are_kept_and_checked() -> None:
    tuner = SLOTuner(SLO(tpot_p95_ms=50.0), initial=60, min_value=2, max_value=64)
    assert tuner.propose(None, 1.0, num_samples=100) == 64
    assert tuner.propose(None, 1.0, num_samples=100) is None
    low = SLOTuner(SLO(tpot_p95_ms=50.0), initial=3, min_value=2, max_value=64)
    assert low.propose(None, 99.0, num_samples=100) == 2
    assert low.propose(None, 99.0, num_samples=100) is None  # at the floor it holds
    with pytest.raises(ValueError):
        SLOTuner(SLO(), initial=0, min_value=1, max_value=8)
    with pytest.raises(ValueError):
        SLOTuner(SLO(), initial=4, min_value=1, max_value=8, headroom=1.0)


def test_an_unconstrained_or_unknown_latency_does_not_grow_the_knob() -> None:
    tuner = SLOTuner(SLO(ttft_p95_ms=100.0, tpot_p95_ms=50.0), initial=4, min_value=1, max_value=64)
    assert tuner.propose(10.0, None, num_samples=100) is None  # TPOT unknown: no headroom shown
    assert tuner.propose(10.0, 5.0, num_samples=100) == 8


def sweep(*rows: tuple[int, float, float, float]) -> list[SweepPoint]:
    """(concurrency, requests/s, p95 TTFT ms, p95 TPOT ms) rows."""
    return [SweepPoint(c, qps, ttft, tpot) for c, qps, ttft, tpot in rows]


SWEEP = sweep((1, 2.0, 100.0, 20.0), (2, 3.8, 120.0, 22.0), (4, 7.0, 180.0, 30.0), (8, 11.0, 300.0, 45.0),
              (16, 11.5, 700.0, 80.0), (32, 11.6, 1500.0, 81.0))


def test_the_proposal_is_the_most_throughput_within_the_slo_and_below_the_knee() -> None:
    proposal = propose_knobs(SWEEP, SLO(ttft_p95_ms=500.0, tpot_p95_ms=50.0), "continuous", knee=4, max_input_tokens=256)
    assert proposal.chosen == 3 and proposal.knobs["max_num_seqs"] == 8
    # Little's law: 11 req/s x (500 - 300) ms of TTFT slack = 2.2 -> 2 queued requests
    assert proposal.knobs["max_queue_len"] == 2 and proposal.knobs["max_queued_tokens"] == 2 * 256
    # a tighter TPOT SLO moves the choice down; the knee cuts off steps past it even when they keep the SLO
    assert propose_knobs(SWEEP, SLO(tpot_p95_ms=35.0), "continuous", None, 256).knobs["max_num_seqs"] == 4
    loose = SLO(ttft_p95_ms=10_000.0)
    assert propose_knobs(SWEEP, loose, "continuous", knee=None, max_input_tokens=256).knobs["max_num_seqs"] == 32
    assert propose_knobs(SWEEP, loose, "continuous", knee=4, max_input_tokens=256).knobs["max_num_seqs"] == 8


def test_goodput_decides_over_raw_throughput_and_ties_take_the_smaller_batch() -> None:
    points = [SweepPoint(1, 2.0, 10.0, None, 2.0), SweepPoint(2, 4.0, 20.0, None, 1.0), SweepPoint(4, 4.0, 30.0, None, 2.0)]
    proposal = propose_knobs(points, SLO(ttft_p95_ms=1000.0), "continuous", None, 64)
    assert proposal.knobs["max_num_seqs"] == 1  # goodput 2.0 at concurrency 1 and 4: the smaller wins


def test_a_dynamic_bucket_gets_a_batch_size_and_a_delay_bounded_by_gather_time_and_slack() -> None:
    proposal = propose_knobs(SWEEP, SLO(ttft_p95_ms=500.0), "dynamic", knee=4, max_input_tokens=64)
    assert proposal.knobs["max_batch_size"] == 8 and "max_num_seqs" not in proposal.knobs
    # gathering 7 more at 11 req/s takes 636 ms; half the 200 ms slack is 100 ms
    assert proposal.knobs["max_queue_delay_ms"] == 100.0
    roomy = propose_knobs(SWEEP, SLO(ttft_p95_ms=5000.0), "dynamic", knee=4, max_input_tokens=64)
    assert roomy.knobs["max_queue_delay_ms"] == round(7 / 11.0 * 1000, 1)


def test_when_no_step_keeps_the_slo_the_smallest_load_is_proposed() -> None:
    proposal = propose_knobs(SWEEP, SLO(ttft_p95_ms=50.0), "continuous", None, 256)
    assert proposal.chosen == 0 and proposal.knobs["max_num_seqs"] == 1 and proposal.knobs["max_queue_len"] == 1
    assert "no step kept the SLO" in proposal.notes[0]
    with pytest.raises(ValueError):
        propose_knobs([], SLO(ttft_p95_ms=50.0), "continuous", None, 256)
    with pytest.raises(ValueError):
        propose_knobs(SWEEP, SLO(ttft_p95_ms=50.0), "static", None, 256)


def test_steps_that_completed_nothing_never_count() -> None:
    failed = [SweepPoint(1, 0.0, None, None), SweepPoint(2, 0.0, None, None)]
    with pytest.raises(ValueError, match="no step of the sweep completed a request"):
        propose_knobs(failed, SLO(ttft_p95_ms=1000.0), "continuous", None, 64)
    mixed = [SweepPoint(1, 0.0, None, None), SweepPoint(2, 3.0, 5000.0, None)]
    proposal = propose_knobs(mixed, SLO(ttft_p95_ms=1000.0), "continuous", None, 64)
    assert proposal.chosen == 1 and proposal.knobs["max_num_seqs"] == 2
