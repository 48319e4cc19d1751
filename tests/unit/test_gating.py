"""The gate's decision logic with plain numbers: speed (geometric mean, no slower shape),
accuracy bounds for FP32 and quantised candidates, failures, and the choice between winners."""

from __future__ import annotations

import pytest

from policies.gating import GateThresholds, Measurement, Verdict, choose_backend, judge, speedups

T = GateThresholds()


def test_a_fast_accurate_fp32_candidate_is_enabled_with_its_geometric_mean_speedup() -> None:
    verdict = judge(Measurement("onnx-fp32", eager_ms=(10.0, 40.0), candidate_ms=(5.0, 20.0), min_cosine=0.99999), T)
    assert verdict.enabled and verdict.speedup == pytest.approx(2.0)
    verdict = judge(Measurement("onnx-fp32", eager_ms=(10.0, 10.0), candidate_ms=(10.0, 2.5), min_cosine=1.0), T)
    assert verdict.speedup == pytest.approx(2.0)  # sqrt(1 * 4)


def test_too_little_speedup_or_one_slower_shape_is_refused() -> None:
    assert not judge(Measurement("compiled", eager_ms=(10.0,), candidate_ms=(9.0,), min_cosine=1.0), T).enabled
    slower_once = judge(Measurement("compiled", eager_ms=(10.0, 100.0), candidate_ms=(11.0, 20.0), min_cosine=1.0), T)
    assert slower_once.speedup is not None and slower_once.speedup > T.min_speedup
    assert not slower_once.enabled and "slower than eager" in slower_once.reasons[0]
    exactly = judge(Measurement("compiled", eager_ms=(12.0,), candidate_ms=(10.0,), min_cosine=1.0), T)
    assert exactly.enabled  # 1.2x is enough


def test_accuracy_bounds_differ_for_fp32_and_quantized() -> None:
    fast = {"eager_ms": (30.0,), "candidate_ms": (10.0,)}
    assert not judge(Measurement("onnx-fp32", min_cosine=0.998, **fast), T).enabled  # fp32 needs 0.999
    assert judge(Measurement("onnx-int8", quantized=True, min_cosine=0.995, **fast), T).enabled
    refused = judge(Measurement("onnx-int8", quantized=True, min_cosine=0.935, **fast), T)
    assert not refused.enabled and "min cosine 0.93500 < 0.99" in refused.reasons[1]
    strict = GateThresholds(min_cosine_quantized=0.999)
    assert not judge(Measurement("onnx-int8", quantized=True, min_cosine=0.995, **fast), strict).enabled


def test_generation_needs_identical_tokens_or_top1_agreement_when_quantized() -> None:
    fast = {"eager_ms": (30.0,), "candidate_ms": (10.0,)}
    assert judge(Measurement("compiled", tokens_identical=True, **fast), T).enabled
    assert not judge(Measurement("compiled", tokens_identical=False, **fast), T).enabled
    assert judge(Measurement("int8", quantized=True, top1_agreement=0.995, **fast), T).enabled
    assert not judge(Measurement("int8", quantized=True, top1_agreement=0.98, **fast), T).enabled
    assert not judge(Measurement("compiled", **fast), T).enabled  # no accuracy shown, no entry


def test_failures_and_bad_measurements() -> None:
    failed = judge(Measurement("compiled", error="inductor crashed"), T)
    assert not failed.enabled and failed.speedup is None and "inductor crashed" in failed.reasons[0]
    assert not judge(Measurement("compiled", min_cosine=1.0), T).enabled  # no shape measured
    with pytest.raises(ValueError):
        speedups(Measurement("x", eager_ms=(1.0, 2.0), candidate_ms=(1.0,)))
    with pytest.raises(ValueError):
        speedups(Measurement("x", eager_ms=(0.0,), candidate_ms=(1.0,)))


def test_the_fastest_enabled_candidate_wins_else_eager() -> None:
    verdicts = [Verdict("compiled", True, 1.4), Verdict("onnx-fp32", True, 1.6), Verdict("onnx-int8", False, 3.0)]
    assert choose_backend(verdicts) == "onnx-fp32"
    assert choose_backend([Verdict("onnx-int8", False, 3.0)]) == "eager"
    assert choose_backend([]) == "eager"
