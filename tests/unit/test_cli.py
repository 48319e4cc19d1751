"""``sluice prepare`` (what ``make install`` runs): every model of the config resolved to a model
folder (a GGUF converted) under the config's cache dir, then the C++ kernel built; 2 for a bad
config or source."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import gateway.logging
import models.paged_attention
import models.quant_kernels
import models.source
from gateway.cli import main
from tests.unit.test_config import make_config_data, write_config


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """What ``prepare`` asked of the model sources and the kernels, in order."""
    # Import every module first: one imported while the fakes are in place would keep them
    # (``from models.source import model_folder``) after the test.
    importlib.import_module("gateway.app")
    seen: list[tuple[str, ...]] = []

    def model_folder(source: str, cache_dir: Path) -> Path:
        seen.append(("model_folder", source, str(cache_dir)))
        return cache_dir / "converted"

    def compiled_kernel_available() -> bool:
        seen.append(("kernel",))
        return True

    monkeypatch.setattr(models.source, "model_folder", model_folder)
    # structlog's global config would keep pytest's captured stdout after the test.
    monkeypatch.setattr(gateway.logging, "configure_logging", lambda level: seen.append(("logging", level)))
    monkeypatch.setattr(models.paged_attention, "compiled_kernel_available", compiled_kernel_available)
    monkeypatch.setattr(models.quant_kernels, "kernel", lambda: seen.append(("quant_kernel",)))
    return seen


def test_prepare_converts_every_model_then_builds_the_kernel(tmp_path: Path, calls: list[tuple[str, ...]]) -> None:
    data = {**make_config_data(), "cache_dir": str(tmp_path / "cache")}
    assert main(["prepare", "--config", str(write_config(tmp_path, data)), "--log-level", "warning"]) == 0
    cache_dir = str(tmp_path / "cache")
    assert calls == [
        ("logging", "WARNING"), ("model_folder", "/models/gen", cache_dir), ("model_folder", "/models/emb", cache_dir), ("kernel",),
        ("quant_kernel",),
    ]


def test_prepare_refuses_a_bad_config(tmp_path: Path, calls: list[tuple[str, ...]], capsys: pytest.CaptureFixture[str]) -> None:
    data = make_config_data()
    data["models"][0]["max_model_len"] = 1
    assert main(["prepare", "--config", str(write_config(tmp_path, data))]) == 2
    assert "max_model_len" in capsys.readouterr().err and calls == [("logging", "INFO")]


def test_serve_keeps_idle_connections_open_longer_than_clients_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn's default keep-alive (5 s) equals httpx's idle expiry, so a client reusing a
    connection at 5 s raced the server's close (a connection reset): the server keeps it 75 s."""
    import uvicorn

    import gateway.app
    from gateway.cli import KEEP_ALIVE_TIMEOUT_S

    runs: list[dict[str, object]] = []
    monkeypatch.setattr(gateway.app, "create_app", lambda config: "app")
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: runs.append({"app": app, **kwargs}))
    monkeypatch.setattr(gateway.logging, "configure_logging", lambda level: None)
    monkeypatch.setattr("models.cpu_memory.keep_freed_memory_in_heap", lambda: None)
    data = make_config_data()
    for model in data["models"]:
        model["source"] = str(tmp_path)  # a path that exists (create_app, which would read it, is faked)
    config = str(write_config(tmp_path, data))
    assert main(["serve", "--config", config]) == 0
    assert main(["serve", "--config", config, "--keep-alive-timeout-s", "2.5"]) == 0
    assert [run["timeout_keep_alive"] for run in runs] == [KEEP_ALIVE_TIMEOUT_S, 2.5] and KEEP_ALIVE_TIMEOUT_S > 5
    assert runs[0]["app"] == "app" and runs[0]["host"] == "127.0.0.1"


def test_serve_refuses_a_model_source_that_does_not_exist_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import uvicorn

    runs: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: runs.append(app))
    monkeypatch.setattr(gateway.logging, "configure_logging", lambda level: None)
    data = make_config_data()
    data["models"][0]["source"] = str(tmp_path)
    data["models"][1]["source"] = str(tmp_path / "no-such-model")
    assert main(["serve", "--config", str(write_config(tmp_path, data))]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"sluice: models.1.source: source '{tmp_path / 'no-such-model'}': {tmp_path / 'no-such-model'} does not exist"
    assert runs == []
