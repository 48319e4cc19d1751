"""The SLO tuner on a real server: a bucket with room under its SLO grows ``max_num_seqs``, a
bucket over its SLO shrinks it, each change through the admin path and logged."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.conftest import CONFIG, GENERATE_MODEL, run_server

TOKEN = "slo-token-77"
LONG_PROMPT = " ".join(["The river rose all night and the lock keepers opened every sluice they had."] * 5)


@pytest.fixture(scope="module")
def tuned_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    config = yaml.safe_load(CONFIG.read_text())
    model = next(m for m in config["models"] if m["name"] == GENERATE_MODEL)
    config["models"] = [model]
    roomy, strict = model["buckets"]
    roomy["batcher"]["max_num_seqs"] = 1
    roomy["slo"] = {"ttft_p95_ms": 60_000, "interval_s": 1.0, "min_samples": 3, "max_batch": 8}
    strict["batcher"]["max_num_seqs"] = 8
    strict["slo"] = {"ttft_p95_ms": 1, "interval_s": 1.0, "min_samples": 3, "min_batch": 2}
    folder: Path = tmp_path_factory.mktemp("slo")
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    log_path = folder / "server.log"
    with run_server(path, log_path, {"SLUICE_ADMIN_TOKEN": TOKEN}) as url:
        yield url, log_path


def _knob(url: str, bucket: str) -> int:
    model = httpx.get(f"{url}/admin/models/{GENERATE_MODEL}", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    return next(b for b in model["config"]["buckets"] if (b["name"] or f"le{b['max_input_tokens']}") == bucket)["batcher"]["max_num_seqs"]


def test_the_tuner_grows_a_roomy_bucket_and_shrinks_one_over_its_slo(tuned_server: tuple[str, Path]) -> None:
    url, log_path = tuned_server

    async def load(seconds: float) -> list[int]:
        async with httpx.AsyncClient(base_url=f"{url}/v1", timeout=120) as client:
            stop = time.monotonic() + seconds

            async def client_loop(prompt: str) -> list[int]:
                statuses = []
                while time.monotonic() < stop:
                    body = {"model": GENERATE_MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
                    statuses.append((await client.post("/completions", json=body)).status_code)
                return statuses

            results = await asyncio.gather(*(client_loop("Hello" if i % 2 else LONG_PROMPT) for i in range(8)))
            return [s for r in results for s in r]

    statuses = asyncio.run(load(10.0))
    assert set(statuses) == {200}
    roomy, strict = _knob(url, "le48"), _knob(url, "le320")
    print(f"after 10 s of load: le48 max_num_seqs 1 -> {roomy}; le320 max_num_seqs 8 -> {strict}")
    assert roomy > 1
    assert strict == 2  # down to its min_batch
    events = [json.loads(line) for line in log_path.read_text().splitlines() if '"slo_tuner"' in line]
    assert events and all(e["action"] == "tune_bucket" for e in events)
    assert {e["model"] for e in events} == {f"{GENERATE_MODEL}/le48", f"{GENERATE_MODEL}/le320"}
