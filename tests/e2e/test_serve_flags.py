"""``sluice serve --model PATH`` and ``--models-dir DIR`` with no config file, against real
gateways serving the tiny models of :mod:`tests.tiny_models` (random weights: the tests check
what is served and that it answers, not what it says)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import run_server_args
from tests.tiny_models import write_tiny_bert, write_tiny_llama

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models folder holding ``tiny-llama`` (generate) and ``tiny-bert`` (embed)."""
    folder = tmp_path_factory.mktemp("models")
    write_tiny_llama(folder / "tiny-llama")
    write_tiny_bert(folder / "tiny-bert")
    return folder


@pytest.fixture(scope="module")
def model_flag_server(tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``serve --model <tiny-llama folder>``: its base URL."""
    log_path = tmp_path_factory.mktemp("model_flag") / "server.log"
    with run_server_args(["--model", str(tiny_models_dir / "tiny-llama")], log_path) as (url, _):
        yield url


def test_a_model_flag_serves_the_folder_under_its_name(model_flag_server: str) -> None:
    listed = httpx.get(f"{model_flag_server}/v1/models", timeout=TIMEOUT_S)
    assert listed.status_code == 200
    assert [m["id"] for m in listed.json()["data"]] == ["tiny-llama"]
    body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    completion = httpx.post(f"{model_flag_server}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] <= 4


def test_a_models_dir_serves_each_model_on_its_first_request(tiny_models_dir: Path, tmp_path: Path) -> None:
    with run_server_args(["--models-dir", str(tiny_models_dir)], tmp_path / "server.log") as (url, _):
        listed = httpx.get(f"{url}/v1/models", timeout=TIMEOUT_S)
        assert listed.status_code == 200
        assert sorted(m["id"] for m in listed.json()["data"]) == ["tiny-bert", "tiny-llama"]
        body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        completion = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)
        assert completion.status_code == 200, completion.text
        embedding = httpx.post(f"{url}/v1/embeddings", json={"model": "tiny-bert", "input": "Hello"}, timeout=TIMEOUT_S)
        assert embedding.status_code == 200, embedding.text
        assert len(embedding.json()["data"][0]["embedding"]) == 32
