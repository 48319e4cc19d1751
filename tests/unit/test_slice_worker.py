"""gateway.slice_worker and the HTTP side of process slices, without processes: the worker's cut
of the config keeps each bucket's KV share, the build code makes the slice each config asks for
(with the worker main it is given), and a dead or restarting worker is a 503 with Retry-After."""

from __future__ import annotations

from typing import get_args

import pytest

from buckets.errors import BatchFailedError, SliceUnavailableError, WorkerCrashedError
from buckets.slices.kinds import SLICE_KINDS
from buckets.slices.process import ProcessSlice
from buckets.slices.thread import ThreadSlice
from gateway.build import make_slice
from gateway.config import GatewayConfig, SliceConfig, parse_config
from gateway.engine import Engine
from gateway.errors import slice_unavailable, to_api_error
from gateway.memory import split_kv_memory
from gateway.slice_worker import run_slice_worker, worker_config


def two_slice_config() -> GatewayConfig:
    continuous = {"kind": "continuous", "max_num_batched_tokens": 64}
    return parse_config({
        "slices": [
            {"name": "proc", "num_threads": 2, "kv_cache_memory_bytes": "64MiB", "isolation": "process"},
            {"name": "thr", "kv_cache_memory_bytes": "32MiB"},
        ],
        "models": [
            {"name": "gen", "source": "/models/gen", "task": "generate", "max_model_len": 96, "buckets": [
                {"max_input_tokens": 32, "batcher": continuous, "slice": "thr"},
                {"max_input_tokens": 64, "batcher": {**continuous, "kv_cache_memory_fraction": 0.25}, "slice": "proc"},
                {"max_input_tokens": 96, "batcher": continuous, "slice": "proc"},
            ]},
            {"name": "emb", "source": "/models/emb", "task": "embed", "max_model_len": 16, "buckets": [
                {"max_input_tokens": 16, "batcher": {"kind": "dynamic"}, "slice": "thr"},
            ]},
        ],
    })


def budgets(config: GatewayConfig) -> dict[str, int]:
    return {s.name: int(s.kv_cache_memory_bytes or 0) for s in config.slices}


def test_the_worker_config_holds_its_slice_and_its_buckets_alone() -> None:
    config = two_slice_config()
    cut = worker_config(config, "proc")
    assert [(s.name, s.isolation, s.num_threads) for s in cut.slices] == [("proc", "thread", 2)]
    assert [m.name for m in cut.models] == ["gen"]
    assert [b.bucket_name for b in cut.models[0].buckets] == ["le64", "le96"]
    whole = split_kv_memory(config, budgets(config))
    assert split_kv_memory(cut, budgets(cut)) == {k: v for k, v in whole.items() if k[1] in ("le64", "le96")}


def test_each_slice_gets_the_worker_its_isolation_names() -> None:
    config = two_slice_config()
    engine = Engine(config, worker_main=run_slice_worker)
    process, thread = engine.slices["proc"], engine.slices["thr"]
    assert isinstance(process, ProcessSlice) and process.isolation == "process" and process.num_threads == 2
    assert isinstance(thread, ThreadSlice) and thread.isolation == "thread"
    assert not process.needs_weights and thread.needs_weights
    assert process._target is run_slice_worker
    config_data, slice_name, level = process._worker_args()
    assert slice_name == "proc" and GatewayConfig.model_validate(config_data) == config and isinstance(level, str)


def test_every_isolation_the_config_accepts_is_a_slice_kind() -> None:
    isolations = get_args(SliceConfig.model_fields["isolation"].annotation)
    assert set(isolations) == set(SLICE_KINDS) == {"thread", "process", "ray"}


def test_a_process_slice_needs_a_worker_main_to_run() -> None:
    config = two_slice_config()
    with pytest.raises(ValueError, match="isolation: process"):
        make_slice(config.slices[0], None, lambda: ())
    assert isinstance(make_slice(config.slices[1], None, lambda: ()), ThreadSlice)


def test_a_crashed_worker_is_a_503_with_retry_after_and_other_failures_a_500() -> None:
    crashed = to_api_error(WorkerCrashedError("the worker process of slice 'proc' exited (code -9)"))
    assert (crashed.status_code, crashed.code) == (503, "worker_crashed") and int(crashed.headers["Retry-After"]) >= 1
    assert "exited (code -9)" in crashed.message
    failed = to_api_error(BatchFailedError("forward failed"))
    assert (failed.status_code, failed.type) == (500, "server_error")
    restarting = slice_unavailable("gen", "le64", SliceUnavailableError("the worker process of slice 'proc' is restarting", 5))
    assert (restarting.status_code, restarting.code, restarting.headers) == (503, "slice_unavailable", {"Retry-After": "5"})


def test_isolation_defaults_to_thread() -> None:
    assert two_slice_config().slices[1].isolation == "thread"


def test_a_mig_slice_needs_process_isolation_and_a_kv_budget_and_its_worker_sees_cuda_0() -> None:
    from gateway.config import parse_config
    from gateway.slice_worker import worker_config
    from tests.unit.test_config import config_error, make_config_data

    uuid = "MIG-4f2c9a1e-0b3d-5e6f-8a9b-0c1d2e3f4a5b"
    data = make_config_data()
    data["slices"][0].update(device=uuid, isolation="thread", kv_cache_memory_bytes="1GiB")
    assert "set isolation: process" in config_error(data)
    data["slices"][0].update(isolation="process", kv_cache_memory_bytes=None)
    assert "kv_cache_memory_bytes: set it for a MIG slice" in config_error(data)
    data["slices"][0]["kv_cache_memory_bytes"] = "1GiB"
    config = parse_config(data)
    assert config.slices[0].device == uuid
    assert worker_config(config, "cpu0").slices[0].device == "cuda:0"
