"""The step-time model and the stall-free prefill room, with plain numbers (no clock, no model)."""

from __future__ import annotations

import random

import pytest

from policies.step_time import (
    PrefillRoom,
    StallFreeBudget,
    StepTimeFit,
    StepTimeModel,
    StepTimeSample,
    attended_pairs,
    fit_step_time,
)

BASE_S, DECODE_S, PREFILL_S, PAIR_S = 0.010, 0.002, 0.001, 1e-6


def true_time(num_decode: int, num_prefill: int, num_pairs: int = 0) -> float:
    return BASE_S + DECODE_S * num_decode + PREFILL_S * num_prefill + PAIR_S * num_pairs


def synthetic(num: int, seed: int = 0, noise_s: float = 0.0005) -> list[StepTimeSample]:
    """Steps of up to 16 decodes (context up to 1,000 each) beside a chunk at up to position 1,500."""
    rng = random.Random(seed)
    samples = []
    for _ in range(num):
        decode = rng.randint(0, 16)
        prefill = rng.choice([0, 0, 16, 64, 200, 512])
        pairs = sum(rng.randint(1, 1000) for _ in range(decode)) + attended_pairs(rng.randint(0, 1500), prefill)
        samples.append(StepTimeSample(decode, prefill, pairs, true_time(decode, prefill, pairs) + rng.gauss(0, noise_s)))
    return samples


def feed(model: StepTimeModel, samples: list[StepTimeSample], scale: float = 1.0) -> None:
    for s in samples:
        model.observe(s.num_decode_tokens, s.num_prefill_tokens, s.num_attended_pairs, s.seconds * scale)


def test_attended_pairs_are_causal() -> None:
    assert attended_pairs(0, 1) == 1
    assert attended_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attended_pairs(10, 1) == 11  # a decode at position 10
    assert attended_pairs(10, 2) == 11 + 12


def test_fit_recovers_the_coefficients_from_noisy_samples() -> None:
    samples = synthetic(300)
    fit = fit_step_time(samples, [1.0] * len(samples))
    assert fit is not None and fit.has_prefill
    assert fit.base_s == pytest.approx(BASE_S, abs=0.0005)
    assert fit.per_decode_token_s == pytest.approx(DECODE_S, rel=0.05)
    assert fit.per_prefill_token_s == pytest.approx(PREFILL_S, rel=0.03)
    assert fit.per_attended_pair_s == pytest.approx(PAIR_S, rel=0.03)


def test_outliers_do_not_move_the_fit() -> None:
    samples = synthetic(100, noise_s=0.0)
    samples[10] = StepTimeSample(4, 0, 400, 2.0)  # a GC pause
    samples[50] = StepTimeSample(0, 64, attended_pairs(0, 64), 0.9)
    fit = fit_step_time(samples, [1.0] * len(samples))
    assert fit is not None
    assert fit.num_outliers == 2
    assert fit.base_s == pytest.approx(BASE_S, rel=1e-3)
    assert fit.per_decode_token_s == pytest.approx(DECODE_S, rel=1e-3)
    assert fit.per_prefill_token_s == pytest.approx(PREFILL_S, rel=1e-3)
    assert fit.per_attended_pair_s == pytest.approx(PAIR_S, rel=1e-3)


def test_decode_only_samples_leave_the_prefill_slope_unknown() -> None:
    samples = [StepTimeSample(d, 0, 10 * d, true_time(d, 0, 10 * d)) for d in (1, 2, 4, 8)]
    fit = fit_step_time(samples, [1.0] * 4)
    assert fit is not None and not fit.has_prefill
    assert fit.per_prefill_token_s == 0.0
    assert fit.predict_s(3, 0, 30) == pytest.approx(true_time(3, 0, 30))


def test_a_constant_decode_count_still_predicts_that_step() -> None:
    samples = [StepTimeSample(4, p, 0, true_time(4, p)) for p in (0, 0, 16, 64)]
    fit = fit_step_time(samples, [1.0] * 4)
    assert fit is not None
    assert fit.predict_s(4, 100) == pytest.approx(true_time(4, 100), rel=1e-6)


def test_negative_slopes_are_pinned_to_zero() -> None:
    samples = [StepTimeSample(d, 0, 0, 0.02 - 0.0001 * d) for d in (1, 2, 3, 4)] + [StepTimeSample(0, 100, 0, 0.12)]
    fit = fit_step_time(samples, [1.0] * 5)
    assert fit is not None
    assert fit.per_decode_token_s == 0.0
    assert fit.base_s > 0 and fit.per_prefill_token_s > 0


def test_fit_needs_two_samples_and_matching_weights() -> None:
    assert fit_step_time([StepTimeSample(1, 0, 1, 0.01)], [1.0]) is None
    with pytest.raises(ValueError, match="weights"):
        fit_step_time(synthetic(3), [1.0])


def test_model_follows_a_changed_backend() -> None:
    model = StepTimeModel(window=64, half_life_steps=8, refit_every=1)
    feed(model, synthetic(64, seed=1, noise_s=0.0))
    assert model.fit is not None and model.fit.per_prefill_token_s == pytest.approx(PREFILL_S, rel=1e-3)
    feed(model, synthetic(64, seed=2, noise_s=0.0), scale=0.25)  # a backend 4x faster
    assert model.fit.per_prefill_token_s == pytest.approx(PREFILL_S / 4, rel=0.01)


def test_a_long_run_of_decodes_keeps_the_prefill_slope() -> None:
    model = StepTimeModel(window=16, half_life_steps=8, refit_every=1)
    feed(model, [s for s in synthetic(40, noise_s=0.0) if s.num_prefill_tokens][:8])
    feed(model, [StepTimeSample(4, 0, 4 * (100 + i), true_time(4, 0, 4 * (100 + i))) for i in range(500)])
    assert model.fit is not None and model.fit.has_prefill
    assert model.fit.per_prefill_token_s == pytest.approx(PREFILL_S, rel=1e-3)
    assert model.fit.predict_s(4, 0, 400) == pytest.approx(true_time(4, 0, 400), rel=1e-3)


def test_model_ignores_empty_and_invalid_steps() -> None:
    model = StepTimeModel()
    model.observe(0, 0, 0, 0.5)
    model.observe(1, 0, 1, float("nan"))
    model.observe(1, 0, 1, -1.0)
    assert model.fit is None
    with pytest.raises(ValueError, match="window"):
        StepTimeModel(window=1)


FIT = StepTimeFit(BASE_S, DECODE_S, PREFILL_S, 0.0, num_samples=10, num_outliers=0, has_prefill=True)
FIT_WITH_PAIRS = StepTimeFit(BASE_S, DECODE_S, PREFILL_S, PAIR_S, num_samples=10, num_outliers=0, has_prefill=True)


def test_a_chunk_deeper_in_its_prompt_gets_fewer_tokens() -> None:
    assert FIT.chunk_tokens_within(0.032, 0) == 32
    assert FIT.chunk_tokens_within(0.032, 1000) == 32  # no attention term
    shallow = FIT_WITH_PAIRS.chunk_tokens_within(0.032, 0)
    deep = FIT_WITH_PAIRS.chunk_tokens_within(0.032, 1000)
    assert shallow == 31 and deep == 15
    for n, position in ((shallow, 0), (deep, 1000)):
        assert FIT_WITH_PAIRS.chunk_s(position, n) <= 0.032 < FIT_WITH_PAIRS.chunk_s(position, n + 1)
    assert FIT_WITH_PAIRS.chunk_tokens_within(0.0, 0) == 0


def test_the_room_charges_chunks_until_the_time_is_spent() -> None:
    room = PrefillRoom(FIT, 0.032, max_tokens=1000, min_tokens=16)
    assert room.tokens_for(0, 600) == 32
    room.take(0, 20)
    assert room.tokens_for(0, 600) == 12
    room.take(0, 12)
    assert room.tokens_for(0, 600) == 0  # the floor (16) is already granted
    room.take(0, -12)  # a preempted chunk gives its time back
    assert room.tokens_for(0, 600) == 12


def test_room_floors_and_caps() -> None:
    over = PrefillRoom(FIT, -0.005, max_tokens=1000, min_tokens=16)  # the decodes alone pass the target
    assert over.tokens_for(0, 600) == 16
    assert over.tokens_for(0, 10) == 10
    over.take(0, 10)
    assert over.tokens_for(0, 600) == 6
    assert PrefillRoom(FIT, 10.0, max_tokens=500, min_tokens=16).tokens_for(0, 600) == 500
    assert PrefillRoom(FIT, -1.0, max_tokens=8, min_tokens=16).tokens_for(0, 600) == 8  # the cap beats the floor
    assert PrefillRoom(None, None, max_tokens=1024, min_tokens=16).tokens_for(0, 2000) == 1024
    with pytest.raises(ValueError, match="room_s"):
        PrefillRoom(None, 0.1, 100, 16)


def fed_budget(target_step_s: float | None) -> StallFreeBudget:
    budget = StallFreeBudget(target_step_s, min_prefill_tokens=16, model=StepTimeModel(refit_every=1))
    feed(budget.model, [StepTimeSample(s.num_decode_tokens, s.num_prefill_tokens, 0, s.seconds - PAIR_S * s.num_attended_pairs)
                        for s in synthetic(50, noise_s=0.0)])
    return budget


def test_default_target_is_twice_the_decode_only_step() -> None:
    budget = fed_budget(None)
    # 4 decodes: 18 ms decode-only, target 36 ms, so 18 ms of prefill = 18 tokens.
    room = budget.open_step(4, 0, 1020)
    assert budget.last_target_s == pytest.approx(0.036)
    assert room.tokens_for(0, 1020) == 18
    assert budget.open_step(0, 0, 1024).tokens_for(0, 2000) == 1024  # nothing decodes: no time limit


def test_a_configured_target_wins() -> None:
    budget = fed_budget(0.100)
    assert budget.target_s(4) == 0.100
    assert budget.open_step(4, 0, 1020).tokens_for(0, 1020) == 82  # (100 - 18) ms / 1 ms


def test_nothing_known_means_no_time_limit() -> None:
    budget = StallFreeBudget(0.05, 16)
    assert budget.open_step(4, 100, 1020).tokens_for(0, 2000) == 1020
    budget.observe(4, 0, 100, 0.02)
    budget.observe(8, 0, 200, 0.03)
    budget.model.refit()
    assert budget.open_step(4, 100, 1020).tokens_for(0, 2000) == 1020  # no prefill seen yet


def test_budget_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="target_step_s"):
        StallFreeBudget(0.0, 16)
    with pytest.raises(ValueError, match="min_prefill_tokens"):
        StallFreeBudget(None, 0)


def test_a_step_without_decodes_is_held_to_the_target_of_its_neighbours_decodes() -> None:
    """The slice steps one bucket at a time: another bucket's 4 running sequences wait out a step
    of this one even when it decodes nothing itself."""
    budget = fed_budget(None)
    neighbours = {"running": 4}
    budget.neighbour_decodes = lambda: neighbours["running"]
    room = budget.open_step(0, 0, 1024)
    # Target: twice a 4-decode step (36 ms); this step has no decodes: 36 - 10 ms base = 26 tokens.
    assert budget.last_target_s == pytest.approx(0.036)
    assert room.tokens_for(0, 2000) == 26
    neighbours["running"] = 0
    assert budget.open_step(0, 0, 1024).tokens_for(0, 2000) == 1024  # nobody waits: no time limit
    assert budget.last_target_s is None
