"""bench.isolation's arithmetic: the nearest-rank p99 and the loaded/unloaded ratio."""

from __future__ import annotations

import pytest

from bench.isolation import IsolationResult, long_body, p99, short_body


def test_p99_is_the_nearest_rank() -> None:
    assert p99([0.3]) == 0.3
    assert p99([0.2, 0.1]) == 0.2
    assert p99([float(v) for v in range(100, 0, -1)]) == 99.0
    assert p99([float(v) for v in range(1, 201)]) == 198.0


def test_the_ratio_is_loaded_over_unloaded() -> None:
    result = IsolationResult(unloaded_p99_s=0.05, loaded_p99_s=0.12, num_long_running=8, num_long_done=20)
    assert result.ratio == pytest.approx(2.4)


def test_the_bodies_are_greedy_and_the_long_prompt_is_long() -> None:
    short, long = short_body("m"), long_body("m")
    assert short["model"] == long["model"] == "m" and short["temperature"] == long["temperature"] == 0
    assert len(long["prompt"].split()) > 48 > len(short["prompt"].split())
