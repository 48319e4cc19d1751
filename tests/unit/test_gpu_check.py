"""The GPU check's parts that run on a CPU: the carried model folder, the dry run's config, the
decode measurement, the wait for the gateway, and summary.json from the stages' reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bench import gpu_check, gpu_model
from bench.gpu_summary import build_summary, load_figures
from gateway.config import parse_config

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


def test_prepare_carries_no_weights_and_materialise_writes_seeded_ones(tmp_path: Path) -> None:
    prepared = tmp_path / "prepared"
    written = gpu_model.prepare(prepared)
    names = {p.name for p in prepared.iterdir()}
    assert {"config.json", "tokenizer.json"} <= names and not any(n.endswith(".safetensors") for n in names)
    assert (prepared / "minilm" / "vocab.txt").exists()
    assert sum(p.stat().st_size for p in written) < 8 * 2**20
    folder = gpu_model.materialise(prepared, tmp_path / "model", seed=0, num_hidden_layers=1)
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == 576
    weights = folder / "model.safetensors"
    modified_ns = weights.stat().st_mtime_ns
    gpu_model.materialise(prepared, folder, seed=0, num_hidden_layers=1)  # same note: kept as it is
    assert weights.stat().st_mtime_ns == modified_ns
    with pytest.raises(FileNotFoundError):
        gpu_model.materialise(tmp_path / "empty", tmp_path / "other")


def test_the_dry_run_config_is_the_gpu_config_on_a_cpu() -> None:
    original = yaml.safe_load((CONFIGS_DIR / "gpu.yaml").read_text())
    config = parse_config(gpu_check.cpu_config(original, "/tmp/model"))
    assert [s.device for s in config.slices] == ["cpu"] and config.slices[0].memory_budget_bytes is None
    (model,) = config.models
    assert model.source == "/tmp/model" and model.dtype == "float32"
    assert model.buckets[0].kv_cache_dtype is None and model.buckets[0].batcher.max_num_seqs == 16  # type: ignore[union-attr]
    assert original["slices"][0]["device"] == "cuda:0"  # the original is left alone


def test_decode_steps_are_timed_and_graphs_are_not_available_on_a_cpu(tmp_path: Path) -> None:
    from bench.gpu_decode import measure
    from models.loader import load_model
    from models.source import default_cache_dir
    from tests.tiny_models import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "llama")
    loaded = load_model("tiny", str(folder), "generate", "float32", "cpu", default_cache_dir())
    report = measure(loaded, prompt_tokens=5, new_tokens=4)
    assert report["graphs_off"]["num_decode_steps"] == 3 and report["graphs_off"]["median_step_ms"] > 0
    assert "not_available" in report["graphs_on"] and report["speedup"] is None


def test_the_wait_ends_when_the_server_process_is_gone() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    # Nothing listens on port 9 (discard) of the loopback; the process is gone: no 30 s wait.
    assert gpu_check.wait_until_served("http://127.0.0.1:9/health", process.pid, timeout_s=30) is False


def _step(load: int, ttft_p50: float) -> dict:
    stats = {"mean": ttft_p50, "p50": ttft_p50, "p95": ttft_p50, "p99": ttft_p50 * 2}
    return {
        "load": load, "num_requests": 8, "num_completed": 8, "num_errors": 0, "requests_per_s": 4.0,
        "output_tokens_per_s": 256.0, "ttft_ms": stats, "tpot_ms": None, "error_samples": [],
    }


def test_summary_gathers_the_figures_and_checks_the_targets(tmp_path: Path) -> None:
    stages = [
        {"stage": "engine-1", "status": "ok"}, {"stage": "engine-16", "status": "timed_out"},
        {"stage": "decode", "status": "ok"}, {"stage": "load-16", "status": "ok"},
    ]
    (tmp_path / "stages.jsonl").write_text("".join(json.dumps(s) + "\n" for s in stages))
    (tmp_path / "versions.json").write_text(json.dumps({"gpu_name": "NVIDIA H200", "torch": "2.11.0"}))
    engine = {
        "tokens_per_s": {"sequential": 10.0, "static_32": 50.0, "sluice": 120.0},
        "ratios": {"sluice_vs_sequential": 12.0, "sluice_vs_static_32": 2.4, "sluice_vs_best_hf": 2.4},
        "best_hf": {"system": "static_32"}, "compared": 1, "sluice_matches_sequential": 1,
    }
    (tmp_path / "engine-1.json").write_text(json.dumps(engine))
    (tmp_path / "decode.json").write_text(json.dumps({"graphs_off": {}, "graphs_on": {}, "speedup": 2.5}))
    (tmp_path / "load-16").mkdir()
    (tmp_path / "load-16" / "results.json").write_text(json.dumps({"steps": [_step(16, 40.0)]}))
    (tmp_path / "pytest.xml").write_text('<testsuites><testsuite tests="5" failures="1" errors="0" skipped="1"/></testsuites>')
    summary = build_summary(tmp_path, dry_run=False)
    assert summary["gpu_name"] == "NVIDIA H200" and summary["engine"]["provenance"]["torch"] == "2.11.0"
    assert summary["engine"]["by_num_seqs"]["1"]["best_hf_system"] == "static_32"
    assert summary["engine"]["by_num_seqs"]["16"] is None  # timed out: no report
    assert summary["load"]["by_concurrency"]["16"]["ttft_ms_p99"] == 80.0
    assert summary["load"]["by_concurrency"]["16"]["tpot_ms_p50"] is None
    assert summary["pytest_gpu"] == {"tests": 5, "failures": 1, "errors": 0, "skipped": 1, "passed": 3}
    targets = summary["targets"]
    assert targets["sluice_vs_sequential"]["met"] is True and targets["sluice_vs_best_hf"]["met"] is True
    assert targets["cuda_graphs_decode_speedup"]["met"] is False
    json.dumps(summary)


def test_a_sweep_of_several_steps_keeps_each() -> None:
    figures = load_figures({"steps": [_step(1, 10.0), _step(4, 20.0)]})
    assert [s["concurrency"] for s in figures["steps"]] == [1, 4]
    assert load_figures(None) is None
