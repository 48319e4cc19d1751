"""The step-time model and the stall-free prefill budget, with plain numbers (no clock, no model)."""

from __future__ import annotations

import random

import pytest

from policies.step_time import (
    StallFreeBudget,
    StepTimeFit,
    StepTimeModel,
    StepTimeSample,
    fit_step_time,
    max_prefill_tokens,
)

BASE_S, DECODE_S, PREFILL_S = 0.010, 0.002, 0.001


def true_time(num_decode: int, num_prefill: int) -> float:
    return BASE_S + DECODE_S * num_decode + PREFILL_S * num_prefill


def synthetic(num: int, seed: int = 0, noise_s: float = 0.0005) -> list[StepTimeSample]:
    rng = random.Random(seed)
    samples = []
    for _ in range(num):
        decode = rng.randint(0, 16)
        prefill = rng.choice([0, 0, 16, 64, 200, 512])
        samples.append(StepTimeSample(decode, prefill, true_time(decode, prefill) + rng.gauss(0, noise_s)))
    return samples


def test_fit_recovers_the_coefficients_from_noisy_samples() -> None:
    samples = synthetic(200)
    fit = fit_step_time(samples, [1.0] * len(samples))
    assert fit is not None and fit.has_prefill
    assert fit.base_s == pytest.approx(BASE_S, abs=0.0005)
    assert fit.per_decode_token_s == pytest.approx(DECODE_S, rel=0.05)
    assert fit.per_prefill_token_s == pytest.approx(PREFILL_S, rel=0.02)


def test_outliers_do_not_move_the_fit() -> None:
    samples = synthetic(100, noise_s=0.0)
    samples[10] = StepTimeSample(4, 0, 2.0)  # a GC pause
    samples[50] = StepTimeSample(0, 64, 0.9)
    fit = fit_step_time(samples, [1.0] * len(samples))
    assert fit is not None
    assert fit.num_outliers == 2
    assert fit.base_s == pytest.approx(BASE_S, rel=1e-3)
    assert fit.per_decode_token_s == pytest.approx(DECODE_S, rel=1e-3)
    assert fit.per_prefill_token_s == pytest.approx(PREFILL_S, rel=1e-3)


def test_decode_only_samples_leave_the_prefill_slope_unknown() -> None:
    samples = [StepTimeSample(d, 0, true_time(d, 0)) for d in (1, 2, 4, 8)]
    fit = fit_step_time(samples, [1.0] * 4)
    assert fit is not None and not fit.has_prefill
    assert fit.per_prefill_token_s == 0.0
    assert fit.predict_s(3, 0) == pytest.approx(true_time(3, 0))


def test_a_constant_decode_count_still_predicts_that_step() -> None:
    samples = [StepTimeSample(4, p, true_time(4, p)) for p in (0, 0, 16, 64)]
    fit = fit_step_time(samples, [1.0] * 4)
    assert fit is not None
    assert fit.predict_s(4, 100) == pytest.approx(true_time(4, 100), rel=1e-6)


def test_negative_slopes_are_pinned_to_zero() -> None:
    samples = [StepTimeSample(d, 0, 0.02 - 0.0001 * d) for d in (1, 2, 3, 4)] + [StepTimeSample(0, 100, 0.12)]
    fit = fit_step_time(samples, [1.0] * 5)
    assert fit is not None
    assert fit.per_decode_token_s == 0.0
    assert fit.base_s > 0 and fit.per_prefill_token_s > 0


def test_fit_needs_two_samples_and_matching_weights() -> None:
    assert fit_step_time([StepTimeSample(1, 0, 0.01)], [1.0]) is None
    with pytest.raises(ValueError, match="weights"):
        fit_step_time(synthetic(3), [1.0])


def test_model_follows_a_changed_backend() -> None:
    model = StepTimeModel(window=64, half_life_steps=8, refit_every=1)
    for sample in synthetic(64, seed=1, noise_s=0.0):
        model.observe(sample.num_decode_tokens, sample.num_prefill_tokens, sample.seconds)
    assert model.fit is not None and model.fit.per_prefill_token_s == pytest.approx(PREFILL_S, rel=1e-3)
    for sample in synthetic(64, seed=2, noise_s=0.0):  # a backend 4x faster
        model.observe(sample.num_decode_tokens, sample.num_prefill_tokens, sample.seconds / 4)
    assert model.fit.per_prefill_token_s == pytest.approx(PREFILL_S / 4, rel=1e-3)


def test_model_ignores_empty_and_invalid_steps() -> None:
    model = StepTimeModel()
    model.observe(0, 0, 0.5)
    model.observe(1, 0, float("nan"))
    model.observe(1, 0, -1.0)
    assert model.fit is None
    with pytest.raises(ValueError, match="window"):
        StepTimeModel(window=1)


FIT = StepTimeFit(BASE_S, DECODE_S, PREFILL_S, num_samples=10, num_outliers=0, has_prefill=True)


def test_budget_fills_the_target_after_the_decodes() -> None:
    # 4 decodes: 10 + 8 = 18 ms predicted; a 50 ms target leaves 32 ms = 32 prefill tokens.
    assert max_prefill_tokens(FIT, 4, 0.050, max_tokens=1020, min_tokens=16) == 32
    assert FIT.predict_s(4, 32) == pytest.approx(0.050)


def test_budget_floors_and_caps() -> None:
    assert max_prefill_tokens(FIT, 4, 0.015, max_tokens=1020, min_tokens=16) == 16  # decodes alone over target
    assert max_prefill_tokens(FIT, 4, 10.0, max_tokens=500, min_tokens=16) == 500
    assert max_prefill_tokens(FIT, 4, 0.015, max_tokens=8, min_tokens=16) == 8  # the cap beats the floor
    assert max_prefill_tokens(FIT, 4, 0.015, max_tokens=0, min_tokens=16) == 0


def test_budget_is_the_whole_cap_with_nothing_decoding_or_nothing_known() -> None:
    assert max_prefill_tokens(FIT, 0, 0.015, max_tokens=1024, min_tokens=16) == 1024
    assert max_prefill_tokens(None, 4, 0.015, max_tokens=1020, min_tokens=16) == 1020
    no_prefill = StepTimeFit(BASE_S, DECODE_S, 0.0, 10, 0, has_prefill=False)
    assert max_prefill_tokens(no_prefill, 4, 0.015, max_tokens=1020, min_tokens=16) == 1020
    assert max_prefill_tokens(FIT, 4, None, max_tokens=1020, min_tokens=16) == 1020


def fed_budget(target_step_s: float | None) -> StallFreeBudget:
    budget = StallFreeBudget(target_step_s, min_prefill_tokens=16, model=StepTimeModel(refit_every=1))
    for sample in synthetic(50, noise_s=0.0):
        budget.observe(sample.num_decode_tokens, sample.num_prefill_tokens, sample.seconds)
    return budget


def test_default_target_is_twice_the_decode_only_step() -> None:
    budget = fed_budget(None)
    # 4 decodes: 18 ms decode-only, target 36 ms, so 18 ms of prefill = 18 tokens.
    assert budget.target_s(4) == pytest.approx(0.036)
    assert budget.max_prefill_tokens(4, 1020) == 18
    assert budget.max_prefill_tokens(0, 1024) == 1024


def test_a_configured_target_wins() -> None:
    budget = fed_budget(0.100)
    assert budget.target_s(4) == 0.100
    assert budget.max_prefill_tokens(4, 1020) == 82  # (100 - 18) ms / 1 ms


def test_budget_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="target_step_s"):
        StallFreeBudget(0.0, 16)
    with pytest.raises(ValueError, match="min_prefill_tokens"):
        StallFreeBudget(None, 0)
