"""The engine benchmark end to end on a tiny workload: every system runs, the report adds up."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import engine
from bench.systems import SYSTEMS, SystemResult

TINY = ["--num-prompts", "4", "--max-new-tokens", "4", "--min-prompt-tokens", "16", "--max-prompt-tokens", "40"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    output = tmp_path_factory.mktemp("bench") / "engine.json"
    assert engine.main([*TINY, "--output", str(output)]) == 0
    return json.loads(output.read_text())


def test_every_system_reports_positive_throughput(report: dict) -> None:
    assert set(report["tokens_per_s"]) == set(SYSTEMS)
    assert set(report["wall_s"]) == set(SYSTEMS)
    assert all(v > 0 for v in report["tokens_per_s"].values())
    assert all(v > 0 for v in report["wall_s"].values())
    assert all(v == 4 * 4 for v in report["generated_tokens"].values())


def test_ratios_are_quotients_of_throughputs(report: dict) -> None:
    tps = report["tokens_per_s"]
    assert set(report["ratios"]) == {"sluice_vs_sequential", "sluice_vs_static_8", "sluice_vs_static_32"}
    for name, ratio in report["ratios"].items():
        other = name.removeprefix("sluice_vs_")
        assert math.isclose(ratio, tps["sluice"] / tps[other])


def test_workload_agreement_and_machine_are_reported(report: dict) -> None:
    workload = report["workload"]
    assert workload["num_prompts"] == 4 and workload["max_new_tokens"] == 4 and workload["seed"] == 0
    assert 16 <= workload["prompt_tokens_min"] <= workload["prompt_tokens_mean"] <= workload["prompt_tokens_max"] <= 40
    assert report["compared"] == 4
    assert 0 <= report["sluice_matches_sequential"] <= 4
    machine = report["machine"]
    assert machine["threads"] >= 1 and machine["cpu_count"] >= 1 and machine["torch"]


def test_subset_of_systems_reports_only_their_ratios(tmp_path: Path) -> None:
    output = tmp_path / "engine.json"
    args = [*TINY, "--num-prompts", "2", "--systems", "static_8,sluice", "--output", str(output)]
    assert engine.main(args) == 0
    report = json.loads(output.read_text())
    assert set(report["tokens_per_s"]) == {"static_8", "sluice"}
    assert set(report["ratios"]) == {"sluice_vs_static_8"}
    assert report["compared"] == 0 and report["sluice_matches_sequential"] is None


def test_unknown_system_is_rejected() -> None:
    with pytest.raises(SystemExit):
        engine.main(["--output", "x.json", "--systems", "sequential,nope"])


def test_inverted_prompt_bounds_are_rejected(tmp_path: Path) -> None:
    args = ["--output", str(tmp_path / "x.json"), "--min-prompt-tokens", "50", "--max-prompt-tokens", "20"]
    assert engine.main(args) == 2
    assert not (tmp_path / "x.json").exists()


def test_agreement_counts_matches_and_eos_mismatches() -> None:
    def result(outputs: list[list[int]]) -> SystemResult:
        return SystemResult(outputs=outputs, wall_s=1.0, cpu_s=1.0, num_threads=1)

    sequential = result([[5, 6, 7], [5, 6, 7], [5, 6, 7]])
    sluice = result([[5, 6, 7], [5, 2, 9], [5, 6, 8]])
    report = engine.agreement({"sequential": sequential, "sluice": sluice}, eos_token_ids=frozenset({2}))
    assert report["sluice_matches_sequential"] == 1 and report["compared"] == 3
    assert report["first_mismatch_tokens"] == {"1": 1, "2": 2}
    assert report["mismatches_at_eos"] == 1
