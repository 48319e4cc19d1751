"""The engine benchmark end to end on a tiny workload: every system runs, the report adds up;
and the report's arithmetic (ratios, agreement, forward share, KV memory) on fake results."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import engine
from bench.step_trace import StepSample, StepTrace, TimedRunner
from bench.systems import SYSTEMS, SystemResult
from bench.workload import Workload

TINY = ["--num-prompts", "4", "--max-new-tokens", "4", "--min-prompt-tokens", "16", "--max-prompt-tokens", "40"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    output = tmp_path_factory.mktemp("bench") / "engine.json"
    assert engine.main([*TINY, "--output", str(output)]) == 0
    return json.loads(output.read_text())


def test_every_system_reports_positive_throughput(report: dict) -> None:
    assert set(report["skipped"]) <= {"hf_continuous"}  # only where transformers lacks generate_batch
    ran = set(SYSTEMS) - set(report["skipped"])
    assert set(report["tokens_per_s"]) == ran
    assert set(report["wall_s"]) == ran
    assert all(v > 0 for v in report["tokens_per_s"].values())
    assert all(v > 0 for v in report["wall_s"].values())
    assert all(v == 4 * 4 for v in report["generated_tokens"].values())


def test_ratios_are_quotients_of_throughputs(report: dict) -> None:
    tps = report["tokens_per_s"]
    others = {f"sluice_vs_{name}" for name in tps if name != "sluice"}
    assert set(report["ratios"]) == others | {"sluice_vs_best_hf"}
    for name, ratio in report["ratios"].items():
        other = name.removeprefix("sluice_vs_")
        if other != "best_hf":
            assert math.isclose(ratio, tps["sluice"] / tps[other])
    best = report["best_hf"]
    assert best["candidates"] == [n for n in ("static_32", "hf_continuous") if n in tps]
    assert best["tokens_per_s"] == max(tps[n] for n in best["candidates"]) == tps[best["system"]]
    assert math.isclose(report["ratios"]["sluice_vs_best_hf"], tps["sluice"] / best["tokens_per_s"])


def test_sluice_trace_is_reported(report: dict) -> None:
    share = report["forward_share"]
    assert share["requested_num_seqs"] == 32 and share["num_seqs"] is None  # 4 requests never reach 32
    assert share["num_steps"] >= 4 and 0 < share["all_steps"] <= 1
    kv = report["kv_memory"]
    assert kv["bytes_per_token"] > 0
    assert 1 <= kv["kv_overhead_ratio_mean"] <= kv["kv_overhead_ratio_max"]
    assert 0 < kv["kv_bytes_held_peak"] <= kv["kv_pool_bytes"]
    assert kv["static_32_kv_overhead_ratio"] >= 1 and kv["static_32_kv_bytes_peak"] > 0


def test_workload_agreement_and_machine_are_reported(report: dict) -> None:
    workload = report["workload"]
    assert workload["num_prompts"] == 4 and workload["max_new_tokens"] == 4 and workload["seed"] == 0
    assert 16 <= workload["prompt_tokens_min"] <= workload["prompt_tokens_mean"] <= workload["prompt_tokens_max"] <= 40
    assert report["compared"] == 4
    assert 0 <= report["sluice_matches_sequential"] <= 4
    if "hf_continuous" in report["tokens_per_s"]:
        assert 0 <= report["hf_continuous_matches_sequential"] <= 4
    machine = report["machine"]
    assert machine["threads"] >= 1 and machine["cpu_count"] >= 1 and machine["torch"]


def test_subset_of_systems_reports_only_their_ratios(tmp_path: Path) -> None:
    output = tmp_path / "engine.json"
    args = [*TINY, "--num-prompts", "2", "--systems", "static_8,sluice", "--output", str(output)]
    assert engine.main(args) == 0
    report = json.loads(output.read_text())
    assert set(report["tokens_per_s"]) == {"static_8", "sluice"}
    assert set(report["ratios"]) == {"sluice_vs_static_8"}
    assert report["best_hf"] is None
    assert report["compared"] == 0 and report["sluice_matches_sequential"] is None
    assert report["hf_continuous_matches_sequential"] is None


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


def _result(outputs: list[list[int]], wall_s: float = 1.0, trace: StepTrace | None = None) -> SystemResult:
    return SystemResult(outputs=outputs, wall_s=wall_s, cpu_s=wall_s, num_threads=1, trace=trace)


def _trace(samples: list[StepSample], bytes_per_block: int = 64, num_blocks: int = 10) -> StepTrace:
    kv_cache = SimpleNamespace(bytes_per_block=bytes_per_block, nbytes=bytes_per_block * num_blocks)
    return StepTrace(TimedRunner(SimpleNamespace(kv_cache=kv_cache)), samples)


def _sample(step_s: float, forward_s: float, num_seqs: int, held: int = 0, tokens: int = 0) -> StepSample:
    return StepSample(step_s, forward_s, num_seqs, kv_bytes_held=held, num_tokens_in_kv=tokens)


def test_hf_continuous_agreement_is_counted_beside_sluice() -> None:
    sequential, sluice, hf_continuous = _result([[5, 6], [5, 6]]), _result([[5, 6], [5, 6]]), _result([[5, 2], [5, 6]])
    results = {"sequential": sequential, "sluice": sluice, "hf_continuous": hf_continuous}
    report = engine.agreement(results, eos_token_ids=frozenset({2}))
    assert report["compared"] == 2
    assert report["sluice_matches_sequential"] == 2 and report["first_mismatch_tokens"] == {}
    assert report["hf_continuous_matches_sequential"] == 1
    assert report["hf_continuous_first_mismatch_tokens"] == {"0": 1}
    assert report["hf_continuous_mismatches_at_eos"] == 1


def test_best_hf_is_the_faster_of_static_32_and_hf_continuous() -> None:
    tps = {"sequential": 1.0, "static_32": 4.0, "hf_continuous": 5.0, "sluice": 10.0}
    best = {"system": "hf_continuous", "tokens_per_s": 5.0, "candidates": ["static_32", "hf_continuous"]}
    assert engine.best_hf(tps) == best
    assert engine.ratios(tps)["sluice_vs_best_hf"] == 2.0
    assert engine.best_hf({"static_32": 4.0, "sluice": 10.0})["system"] == "static_32"
    assert engine.ratios({"sequential": 1.0, "sluice": 10.0}) == {"sluice_vs_sequential": 10.0}


def test_forward_share_at_32_sequences_and_over_all_steps() -> None:
    trace = _trace([_sample(1.0, 0.5, 40), _sample(2.0, 1.5, 32), _sample(2.0, 1.0, 32), _sample(5.0, 4.0, 8)])
    share = trace.forward_share()
    assert share.num_seqs == 32 and share.num_steps_at == 2 and share.at_num_seqs == 2.5 / 4.0
    assert share.all_steps == 7.0 / 10.0 and share.num_steps == 4


def test_forward_share_falls_back_to_closest_count_above_32() -> None:
    trace = _trace([_sample(1.0, 0.5, 40), _sample(1.0, 0.9, 36), _sample(1.0, 0.1, 8)])
    share = trace.forward_share()
    assert share.num_seqs == 36 and share.at_num_seqs == 0.9 and share.num_steps_at == 1
    none = _trace([_sample(1.0, 0.5, 8)]).forward_share()
    assert none.num_seqs is None and none.at_num_seqs is None and none.all_steps == 0.5


def test_kv_overhead_is_max_and_time_weighted_mean() -> None:
    # 4 bytes per token: 64 held for 16 tokens is 1.0x, 128 held for 16 tokens is 2.0x.
    samples = [_sample(1.0, 0.9, 2, held=64, tokens=16), _sample(3.0, 2.0, 2, held=128, tokens=16), _sample(1.0, 0.0, 0)]
    trace = _trace(samples)
    overhead = trace.kv_overhead(bytes_per_token=4)
    assert overhead.ratio_max == 2.0 and overhead.ratio_mean == (1.0 * 1.0 + 2.0 * 3.0) / 4.0
    assert overhead.bytes_held_peak == 128


def test_step_trace_times_forward_and_samples_kv() -> None:
    class FakeBatcher:
        def __init__(self, runner: TimedRunner) -> None:
            self.runner = runner
            self.block_manager = SimpleNamespace(num_used_blocks=3)
            running = [SimpleNamespace(num_computed_tokens=20), SimpleNamespace(num_computed_tokens=9)]
            self.scheduler = SimpleNamespace(running=running)

        def step(self) -> None:
            self.runner.run(SimpleNamespace(sequences=[1, 2]))

    inner = SimpleNamespace(kv_cache=SimpleNamespace(bytes_per_block=100, block_size=16), run=lambda batch: "out")
    trace = StepTrace.around(inner)
    assert trace.runner.kv_cache.block_size == 16  # the proxy shows the runner's attributes
    trace.step(FakeBatcher(trace.runner))
    (sample,) = trace.samples
    assert sample.num_seqs == 2 and sample.kv_bytes_held == 300 and sample.num_tokens_in_kv == 29
    assert 0 <= sample.forward_s <= sample.step_s
    assert trace.runner.take() == (0.0, 0)


def test_static_kv_tokens_pad_each_batch_to_its_longest_prompt() -> None:
    workload = Workload(prompts=[[0] * 10, [0] * 4, [0] * 6], seed=0)
    assert workload.static_kv_tokens(batch_size=2, max_new_tokens=2) == [(2 * 12, 10 + 4 + 4), (8, 8)]


def test_build_report_and_summary_carry_the_new_fields() -> None:
    workload = Workload(prompts=[[0] * 10, [0] * 4], seed=0)
    trace = _trace([_sample(1.0, 0.8, 32, held=64 * 2, tokens=24)], bytes_per_block=64, num_blocks=4)
    results = {
        "sequential": _result([[1], [1]], wall_s=2.0),
        "static_32": _result([[1], [1]], wall_s=1.0),
        "hf_continuous": _result([[1], [2]], wall_s=0.5),
        "sluice": _result([[1], [1]], wall_s=0.25, trace=trace),
    }
    args = argparse.Namespace(max_new_tokens=1, threads=1, device="cpu", dtype="float32")
    report = engine.build_report(results, workload, args, frozenset({2}), kv_bytes_per_token=4)
    assert report["tokens_per_s"]["hf_continuous"] == 4.0
    assert report["best_hf"]["system"] == "hf_continuous" and report["ratios"]["sluice_vs_best_hf"] == 2.0
    assert report["hf_continuous_matches_sequential"] == 1 and report["sluice_matches_sequential"] == 2
    assert report["forward_share"]["num_seqs"] == 32 and report["forward_share"]["at_num_seqs"] == 0.8
    kv = report["kv_memory"]
    assert kv["kv_overhead_ratio_max"] == kv["kv_overhead_ratio_mean"] == 128 / (24 * 4)
    assert kv["kv_bytes_held_peak"] == 128 and kv["kv_pool_bytes"] == 256
    assert kv["static_32_kv_overhead_ratio"] == (2 * 11) / (11 + 5) and kv["static_32_kv_bytes_peak"] == 2 * 11 * 4
    json.dumps(report)  # serialisable as is
    table = engine.format_table(results)
    assert "hf_continuous" in table and len(table.splitlines()) == 5
    summary = "\n".join(engine.format_summary(report))
    assert "sluice_vs_best_hf: 2.00x" in summary and "best hf: hf_continuous" in summary
    assert "hf_continuous matches sequential: 1/2" in summary
    assert "at 32 sequences 80.0%" in summary and "static_32 padding 1.38x" in summary


def test_summary_says_when_no_step_hit_exactly_32() -> None:
    workload = Workload(prompts=[[0] * 4], seed=0)
    trace = _trace([_sample(1.0, 0.5, 40, held=64, tokens=16)])
    args = argparse.Namespace(max_new_tokens=1, threads=1, device="cpu", dtype="float32")
    results = {"sluice": _result([[1]], trace=trace)}
    report = engine.build_report(results, workload, args, frozenset(), kv_bytes_per_token=4)
    summary = "\n".join(engine.format_summary(report))
    assert "at 40 sequences 50.0%" in summary and "none ran exactly 32" in summary


def test_hf_continuous_is_skipped_with_a_note_without_generate_batch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(engine, "has_generate_batch", lambda: False)
    skipped = engine._unavailable_systems(["sequential", "hf_continuous", "sluice"])
    assert list(skipped) == ["hf_continuous"] and "has no generate_batch" in skipped["hf_continuous"]
    assert "hf_continuous: skipped" in capsys.readouterr().err
    assert engine._unavailable_systems(["sequential", "sluice"]) == {}


def test_a_device_torch_does_not_see_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "_has_cuda_device", lambda device: False)
    assert engine.main(["--output", str(tmp_path / "x.json"), "--device", "cuda:0"]) == 2
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(SystemExit):
        engine.main(["--output", "x.json", "--device", "gpu0"])


def test_max_num_seqs_above_the_step_budget_is_refused(tmp_path: Path) -> None:
    assert engine.main(["--output", str(tmp_path / "x.json"), "--max-num-seqs", "4096"]) == 2


def test_sequential_times_only_its_share_of_the_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import systems

    seen: list[list[list[int]]] = []
    monkeypatch.setattr(systems, "run_static", lambda engines, prompts, max_new_tokens, batch_size: seen.append(prompts))
    prompts = [[1], [2], [3]]
    systems.run_sequential(systems.Engines(loaded=None, sequential_prompts=2), prompts, 4)  # type: ignore[arg-type]
    systems.run_sequential(systems.Engines(loaded=None), prompts, 4)  # type: ignore[arg-type]
    assert seen == [[[1], [2]], prompts]


def test_runner_options_capture_decode_graphs_only_on_a_gpu() -> None:
    from bench.systems import runner_options

    assert runner_options("cpu", 64) == {}
    assert runner_options("cuda:0", 4) == {"cuda_graph_sizes": [1, 2, 4]}


def test_keep_going_notes_a_failed_system_and_runs_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(engines: object, prompts: list[list[int]], max_new_tokens: int) -> SystemResult:
        raise RuntimeError("no such kernel")

    monkeypatch.setitem(engine.SYSTEMS, "sequential", boom)
    monkeypatch.setitem(engine.SYSTEMS, "sluice", lambda engines, prompts, max_new_tokens: _result([[1]]))
    workload = Workload(prompts=[[0] * 4], seed=0)
    failed: dict[str, str] = {}
    results = engine._run_systems(None, workload, ["sequential", "sluice"], 1, failed)  # type: ignore[arg-type]
    assert list(results) == ["sluice"] and failed == {"sequential": "RuntimeError: no such kernel"}
    with pytest.raises(RuntimeError):
        engine._run_systems(None, workload, ["sequential"], 1)  # type: ignore[arg-type]


def test_hf_continuous_config_names_the_fields_as_an_older_transformers_has_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    import transformers

    from bench import systems

    @dataclasses.dataclass
    class ConfigOf517:  # transformers 5.17: `block_size`, no `auto_switch_to_flash`
        block_size: int = 256
        num_blocks: int | None = None
        max_batch_tokens: int | None = None
        max_requests_per_batch: int | None = None
        max_blocks_per_request: int | None = None
        safety_margin: float | None = None

    monkeypatch.setattr(transformers, "ContinuousBatchingConfig", ConfigOf517)
    config = systems._hf_continuous_config([[0] * 300], 20, max_num_seqs=8)
    assert config.block_size == 256 and config.num_blocks == 2 and config.max_requests_per_batch == 8
