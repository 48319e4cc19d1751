"""Many models on one machine (issue 32) against a real server: models load on their first
request, one load however many wait; a failed load answers every waiter and leaves the others
serving; eviction is least recently used within the gateway's byte budget, never a pinned model,
never a stream mid-way; random traffic over all of them gets the answers each model gives when
resident; and the process's memory stays flat over loads and evictions.

Models: SmolLM2 from its package under three names (one file), MiniLM (loaded at start, so
pinned), a tiny and a small Llama and a tiny BERT written with random weights, and a model whose
weights file is corrupt. The budget holds two SmolLM2s beside the small models, not three."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from models.loader import estimate_weight_bytes
from models.source import default_cache_dir, model_folder, resolve_source
from tests.e2e.conftest import Server, resident_memory_bytes, run_server_process, wait_for
from tests.tiny_models import MINILM_SOURCE, SMOLLM2_SOURCE, write_tiny_bert, write_tiny_llama

SMOLS = ("smol-a", "smol-b", "smol-c")
GENERATORS = (*SMOLS, "tiny-llama")
EMBEDDERS = ("minilm", "tiny-bert")
KV_BYTES = 16 * 1024**2  # each generation model's one bucket
SLACK_BYTES = 64 * 1024**2
TIMEOUT_S = 180.0
MAX_TOKENS = 8
# The reference's best two log-probabilities closer than this at a diverging token: a near-tie
# that float order in another batch may flip (as the engine tests' rule).
NEAR_TIE_NATS = 1e-3
PROMPTS = (
    "The three primary colors are",
    "Write a haiku about rivers.",
    "A short list of fruits:",
    "Explain what a hash table is in one sentence.",
)


def _generation_model(name: str, source: str, max_model_len: int = 256, **extra: Any) -> dict[str, Any]:
    batcher = {"kind": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 256, "kv_cache_memory_bytes": KV_BYTES}
    return {
        "name": name, "source": source, "task": "generate", "max_model_len": max_model_len, "load": "on_demand",
        "buckets": [{"max_input_tokens": max_model_len, "batcher": batcher, "slice": "cpu0"}], **extra,
    }


def _embedding_model(name: str, source: str, max_model_len: int, **extra: Any) -> dict[str, Any]:
    batcher = {"kind": "dynamic", "max_batch_size": 8, "max_queue_delay_ms": 5}
    return {
        "name": name, "source": source, "task": "embed", "max_model_len": max_model_len,
        "buckets": [{"max_input_tokens": max_model_len, "batcher": batcher, "slice": "cpu0"}], **extra,
    }


def _write_models(folder: Path) -> dict[str, Path]:
    """The tiny models and the corrupt one (the tiny Llama's files, its weights cut short)."""
    tiny_llama = write_tiny_llama(folder / "tiny-llama")
    small_llama = write_tiny_llama(folder / "small-llama", hidden_size=256, num_layers=4)
    tiny_bert = write_tiny_bert(folder / "tiny-bert")
    broken = folder / "broken"
    shutil.copytree(tiny_llama, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return {"tiny-llama": tiny_llama, "small-llama": small_llama, "tiny-bert": tiny_bert, "broken": broken}


def _budget_bytes(folders: dict[str, Path]) -> int:
    """Two SmolLM2s, MiniLM, the small models and some slack: a third SmolLM2 does not fit."""
    smol = estimate_weight_bytes(model_folder(SMOLLM2_SOURCE, default_cache_dir()), "generate", "float32", "cpu") + KV_BYTES
    minilm = estimate_weight_bytes(resolve_source(MINILM_SOURCE), "embed", "float32", "cpu")
    tiny = estimate_weight_bytes(folders["tiny-llama"], "generate", "float32", "cpu") + KV_BYTES
    tiny += estimate_weight_bytes(folders["tiny-bert"], "embed", "float32", "cpu")
    tiny += estimate_weight_bytes(folders["small-llama"], "generate", "float32", "cpu") + KV_BYTES
    budget = 2 * smol + minilm + tiny + SLACK_BYTES
    assert budget < 3 * smol, "the budget must not hold a third SmolLM2"
    return budget


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("residency")
    folders = _write_models(folder)
    config = {
        "slices": [{"name": "cpu0", "device": "cpu", "num_threads": 1, "kv_cache_memory_bytes": "256MiB"}],
        "memory_budget_bytes": _budget_bytes(folders),
        "model_load_retry_s": 1.0,
        "admin_allow_loopback_without_token": True,
        "models": [
            *(_generation_model(name, SMOLLM2_SOURCE) for name in SMOLS),
            _embedding_model("minilm", MINILM_SOURCE, 256),
            _generation_model("tiny-llama", str(folders["tiny-llama"])),
            _generation_model("small-llama", str(folders["small-llama"])),
            _embedding_model("tiny-bert", str(folders["tiny-bert"]), 128, load="on_demand"),
            _generation_model("broken", str(folders["broken"])),
        ],
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    log_path = folder / "server.log"
    with run_server_process(path, log_path) as (url, proc):
        yield Server(url, proc, log_path)


def _statuses(server: Server) -> dict[str, dict[str, Any]]:
    data = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    return {card["id"]: card["status"] for card in data}


def _metric(server: Server, name: str, **labels: str) -> float:
    """The value of sample ``name`` with ``labels`` in ``/metrics`` (0 when absent)."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def _log_events(server: Server, event: str) -> list[dict[str, Any]]:
    """The server's structlog events called ``event``, in order."""
    events = []
    for line in server.log_path.read_text().splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            parsed = json.loads(line)
            if parsed.get("event") == event:
                events.append(parsed)
    return events


def _body(model: str, kind: str, prompt: str, **extra: Any) -> tuple[str, dict[str, Any]]:
    """``(path, body)`` of a greedy request of ``kind`` (completion, chat, embedding)."""
    if kind == "embedding":
        return "/v1/embeddings", {"model": model, "input": prompt}
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": prompt}], "logprobs": True, "top_logprobs": 2}
        return "/v1/chat/completions", {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, **body, **extra}
    return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2, **extra}


def _answer(kind: str, response: httpx.Response) -> Any:
    """What is compared: the embedding, or each token with its reference's best two log-probabilities."""
    assert response.status_code == 200, response.text
    data = response.json()
    if kind == "embedding":
        return data["data"][0]["embedding"]
    choice = data["choices"][0]
    if kind == "chat":
        return [(t["token"], sorted((c["logprob"] for c in t["top_logprobs"]), reverse=True)) for t in choice["logprobs"]["content"]]
    logprobs = choice["logprobs"]
    return [(token, sorted(top.values(), reverse=True)) for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"])]


def _assert_same(kind: str, got: Any, want: Any, what: str) -> None:
    """Embeddings equal within float tolerance; tokens equal up to the first near-tie of the reference."""
    if kind == "embedding":
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, what
        return
    for position, ((token, _), (want_token, want_top)) in enumerate(zip(got, want)):
        if token != want_token:
            assert len(want_top) > 1 and want_top[0] - want_top[1] < NEAR_TIE_NATS, f"{what}: token {position} {token!r} != {want_token!r}"
            return
    assert len(got) == len(want), what


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    return await client.post(path, json=body, timeout=TIMEOUT_S)


def test_every_servable_model_is_listed_with_its_status(server: Server) -> None:
    statuses = _statuses(server)
    assert statuses["minilm"] == {"value": "loaded"}
    assert all(statuses[name] == {"value": "unloaded"} for name in (*GENERATORS, "small-llama", "tiny-bert", "broken"))
    health = httpx.get(f"{server.url}/health?verbose", timeout=30).json()
    assert health["models"] == ["minilm"] and health["loading"] == []
    overview = httpx.get(f"{server.url}/dashboard/api", timeout=30).json()
    rows = {row["model"]: row for row in overview["models"]}
    assert sorted(rows) == sorted(statuses)
    assert rows["minilm"]["buckets"] and overview["resident_bytes"] == rows["minilm"]["resident_bytes"] > 0
    assert all(rows[name]["buckets"] == [] and rows[name]["resident_bytes"] is None for name in rows if name != "minilm")
    assert {b["model"] for b in overview["buckets"]} == {"minilm"}
    assert httpx.get(f"{server.url}/dashboard", timeout=30).status_code == 200


def test_sixteen_concurrent_first_requests_load_the_model_once(server: Server) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url) as client:
            return await asyncio.gather(*(_post(client, *_body("tiny-llama", "completion", PROMPTS[i % 4])) for i in range(16)))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 16, [r.text for r in responses if r.status_code != 200]
    assert _metric(server, "sluice_model_loads_total", model="tiny-llama", outcome="ok") == 1
    assert _statuses(server)["tiny-llama"] == {"value": "loaded"}


def test_a_failed_load_answers_every_waiter_and_the_others_keep_serving(server: Server) -> None:
    async def run() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url) as client:
            broken = [_post(client, *_body("broken", "completion", PROMPTS[0])) for _ in range(8)]
            others = [_post(client, *_body("minilm", "embedding", p)) for p in PROMPTS]
            results = await asyncio.gather(*broken, *others)
            return list(results[:8]), list(results[8:])

    broken, others = asyncio.run(run())
    for response in broken:
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "model_load_failed" and error["param"] == "model" and "safetensor" in error["message"].lower()
        assert int(response.headers["retry-after"]) >= 1
    assert [r.status_code for r in others] == [200] * len(others)
    assert _metric(server, "sluice_model_loads_total", model="broken", outcome="failed") == 1
    status = _statuses(server)["broken"]
    assert status["value"] == "failed" and status["reason"]
    overview = httpx.get(f"{server.url}/dashboard/api", timeout=30).json()
    assert next(row for row in overview["models"] if row["model"] == "broken")["status"] == status
    # Within the backoff a request is refused without a load; after it, a request tries again.
    path, body = _body("broken", "completion", PROMPTS[0])

    def tried_again() -> bool:
        assert httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT_S).status_code == 503
        return _metric(server, "sluice_model_loads_total", model="broken", outcome="failed") == 2

    wait_for(tried_again, 30, "a second load after model_load_retry_s", poll_s=0.2)


def _complete(server: Server, model: str) -> None:
    path, body = _body(model, "completion", PROMPTS[0])
    response = httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text


def test_eviction_is_least_recently_used_and_never_takes_a_pinned_model(server: Server) -> None:
    for model in ("smol-a", "smol-b", "smol-a", "tiny-llama"):  # LRU order now: minilm (pinned), smol-b, smol-a, tiny-llama
        _complete(server, model)
    assert {n: s["value"] for n, s in _statuses(server).items() if s["value"] == "loaded"} == dict.fromkeys(
        ("smol-a", "smol-b", "minilm", "tiny-llama"), "loaded"
    )
    _complete(server, "smol-c")
    statuses = _statuses(server)
    assert statuses["smol-b"]["value"] == "unloaded"
    assert all(statuses[name]["value"] == "loaded" for name in ("smol-a", "smol-c", "minilm", "tiny-llama"))
    assert _metric(server, "sluice_model_evictions_total", model="smol-b", reason="lru") == 1
    assert _metric(server, "sluice_model_evictions_total", model="minilm", reason="lru") == 0
    resident = _metric(server, "sluice_model_resident_bytes", model="smol-a")
    assert resident > 0 and _metric(server, "sluice_memory_budget_bytes", slice="") >= 2 * resident


def test_a_stream_in_flight_is_drained_not_cut_when_its_model_is_evicted(server: Server) -> None:
    """smol-a and smol-c stream; smol-b's request must evict one of them (both busy): the least
    recently used, smol-a, finishes its stream first, every token of it, then smol-b loads."""

    async def stream(client: httpx.AsyncClient, model: str, started: asyncio.Event) -> tuple[int, str | None]:
        body = {
            "model": model, "prompt": PROMPTS[1], "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }
        num_tokens, finish_reason = 0, None
        async with client.stream("POST", "/v1/completions", json=body, timeout=TIMEOUT_S) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        num_tokens = chunk["usage"]["completion_tokens"]
                    if chunk["choices"]:
                        finish_reason = chunk["choices"][0]["finish_reason"] or finish_reason
                    started.set()
        return num_tokens, finish_reason

    async def run() -> tuple[tuple[int, str | None], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url) as client:
            a_started, c_started = asyncio.Event(), asyncio.Event()
            stream_a = asyncio.ensure_future(stream(client, "smol-a", a_started))
            await a_started.wait()
            stream_c = asyncio.ensure_future(stream(client, "smol-c", c_started))
            await c_started.wait()
            loading_b = asyncio.ensure_future(_post(client, *_body("smol-b", "completion", PROMPTS[0])))
            a = await stream_a
            b = await loading_b
            await stream_c
            return a, b

    (num_tokens, finish_reason), b = asyncio.run(run())
    assert (num_tokens, finish_reason) == (64, "length")  # every token came, none cut off
    assert b.status_code == 200, b.text
    assert _metric(server, "sluice_model_evictions_total", model="smol-a", reason="lru") == 1
    assert _statuses(server)["smol-a"]["value"] == "unloaded"
    evicted = [e for e in _log_events(server, "model_evicted") if e["model"] == "smol-a"]
    assert len(evicted) == 1 and evicted[0]["drain_s"] > 0.05, evicted  # it waited for the stream


def test_pinning_through_the_admin_api_takes_a_boolean_only(server: Server) -> None:
    url = f"{server.url}/admin/models/smol-c/pin"
    for bad in ({"pinned": "yes"}, {"pinned": 1}, {}, {"pinned": True, "extra": 1}):
        response = httpx.patch(url, json=bad, timeout=30)
        assert response.status_code == 422 and response.json()["error"]["param"] in ("pinned", "extra"), (bad, response.text)
    assert httpx.patch(url, json={"pinned": True}, timeout=30).json() == {"model": "smol-c", "pinned": True}
    assert httpx.patch(url, json={"pinned": False}, timeout=30).json() == {"model": "smol-c", "pinned": False}
    assert httpx.patch(f"{server.url}/admin/models/nope/pin", json={"pinned": True}, timeout=30).status_code == 404


def test_random_traffic_gets_the_answers_of_resident_models(server: Server) -> None:
    """200 requests, 8 at a time, in runs of one model (a client's burst), over every model;
    each answer equals the model's own answer to the same request taken alone (the three
    SmolLM2 names answer alike: one file)."""
    kinds = {model: ("completion", "chat") for model in GENERATORS} | {model: ("embedding",) for model in EMBEDDERS}
    reference: dict[tuple[str, str, str], Any] = {}
    for model in ("smol-a", "tiny-llama", *EMBEDDERS):
        for kind in kinds[model]:
            for prompt in PROMPTS:
                path, body = _body(model, kind, prompt)
                reference[(model, kind, prompt)] = _answer(kind, httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT_S))
    rng = random.Random(32)
    plan: list[tuple[str, str, str]] = []
    while len(plan) < 200:
        model = rng.choice((*GENERATORS, *EMBEDDERS))
        plan += [(model, rng.choice(kinds[model]), rng.choice(PROMPTS)) for _ in range(rng.randint(1, 12))]
    plan = plan[:200]

    async def run() -> list[tuple[str, httpx.Response]]:
        gate = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=server.url, limits=httpx.Limits(max_connections=8)) as client:

            async def one(model: str, kind: str, prompt: str) -> tuple[str, httpx.Response]:
                async with gate:
                    return kind, await _post(client, *_body(model, kind, prompt))

            # The semaphore wakes its waiters in order: the requests go out in plan order.
            return list(await asyncio.gather(*(one(*item) for item in plan)))

    results = asyncio.run(run())
    assert [r.status_code for _, r in results] == [200] * len(plan), [r.text for _, r in results if r.status_code != 200][:3]
    for (model, kind, prompt), (_, response) in zip(plan, results):
        want = reference[("smol-a" if model in SMOLS else model, kind, prompt)]
        _assert_same(kind, _answer(kind, response), want, f"{model} {kind} {prompt!r}")
    assert _metric(server, "sluice_model_evictions_total", model="minilm", reason="lru") == 0


def test_resident_memory_stays_flat_over_twenty_load_and_evict_cycles(server: Server) -> None:
    """Four models, two of about 100 MB (MiniLM; a Llama with SmolLM2's vocabulary, its packed
    LM head apart), loaded and unloaded through the admin API, 20 times: a model's memory kept
    by anything after its unload would add 10 % of the level every cycle or two."""
    models = ("small-llama", "tiny-llama", "tiny-bert", "minilm")
    level_bytes = 0
    for cycle in range(20):
        for model in models:
            response = httpx.post(f"{server.url}/admin/models/{model}/load", timeout=TIMEOUT_S)
            assert response.status_code == 200 and response.json()["state"] == "ready", response.text
            response = httpx.post(f"{server.url}/admin/models/{model}/unload", timeout=TIMEOUT_S)
            assert response.status_code == 200 and response.json()["state"] == "unloaded", response.text
        if cycle == 0:
            level_bytes = resident_memory_bytes(server.proc)
    final_bytes = resident_memory_bytes(server.proc)
    print(f"RSS after the first cycle {level_bytes / 2**20:.0f} MiB, after 20 {final_bytes / 2**20:.0f} MiB")
    assert final_bytes <= level_bytes * 1.10
    assert all(_metric(server, "sluice_model_evictions_total", model=model, reason="admin") == 20 for model in models)
