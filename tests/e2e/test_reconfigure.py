"""Live reconfiguration against a real server: bucket layouts replaced and knobs patched while
100 requests are in flight (all succeed, outputs equal Hugging Face greedy), invalid changes
refused with 422 and nothing changed, unload and load in quick succession, and the effective
config loadable by ``sluice serve``."""

from __future__ import annotations

import asyncio

import time
from typing import Any

import httpx
import pytest
import yaml

from gateway.config import parse_config
from tests.e2e.conftest import ADMIN_TOKEN, EMBED_MODEL, GENERATE_MODEL, Server
from tests.e2e.reference import assert_greedy_close, greedy_reference

TOKEN = ADMIN_TOKEN
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NUM_REQUESTS = 100
NUM_LAYOUTS = 10
NUM_PATCHES = 20
MAX_TOKENS = 12
LAYOUTS = [
    [(48, {"max_num_seqs": 16, "max_num_batched_tokens": 512}), (320, {"max_num_seqs": 8, "max_num_batched_tokens": 512})],
    [(24, {"max_num_seqs": 4, "max_num_batched_tokens": 128}), (96, {"max_num_seqs": 8, "max_num_batched_tokens": 256}),
     (320, {"max_num_seqs": 4, "max_num_batched_tokens": 256})],
]
PROMPTS = [
    "Hi", "The capital of France is", "Write a haiku about rain:", "List three colours:",
    "Once upon a time, in a village by the river, there lived an old miller who",
    " ".join(["The locks on the canal opened at dawn and the barges moved north."] * 6),
    " ".join(["Engineers measured the water level in every reservoir twice a day."] * 10),
    "Question: what is 12 times 12? Answer:", "def fibonacci(n):", "Dear diary, today I learned",
]


@pytest.fixture(scope="module")
def admin_url(admin_server: Server) -> str:
    """The shared admin server; the layout swaps end on the test config's layout."""
    return admin_server.url


def _layout(index: int) -> list[dict[str, Any]]:
    return [
        {"max_input_tokens": limit, "slice": "cpu0", "batcher": {"kind": "continuous", **knobs}}
        for limit, knobs in LAYOUTS[index % len(LAYOUTS)]
    ]


def _model(url: str, name: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/admin/models/{name}", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_layout_swaps_and_knob_patches_under_load_lose_no_request(admin_url: str, hf_causal_lm: Any) -> None:
    model, _ = hf_causal_lm

    async def run() -> tuple[list[httpx.Response], list[httpx.Response], float]:
        async with httpx.AsyncClient(base_url=admin_url, timeout=300, limits=httpx.Limits(max_connections=150)) as client:
            bodies = [
                {"model": GENERATE_MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS,
                 "temperature": 0, "return_token_ids": True}
                for i in range(NUM_REQUESTS)
            ]

            async def staggered(index: int, body: dict[str, Any]) -> httpx.Response:
                await asyncio.sleep(index * 0.05)  # arrivals spread over the changes
                return await client.post("/v1/completions", json=body)

            in_flight = [asyncio.create_task(staggered(i, b)) for i, b in enumerate(bodies)]
            changes: list[httpx.Response] = []
            started = time.monotonic()
            for step in range(NUM_LAYOUTS + NUM_PATCHES):
                if step % 3 == 0 and step // 3 < NUM_LAYOUTS:
                    layout = _layout(step // 3 + 1)
                    changes.append(await client.put(f"/admin/models/{GENERATE_MODEL}/buckets", json={"buckets": layout}, headers=AUTH))
                else:
                    buckets = (await client.get(f"/admin/models/{GENERATE_MODEL}", headers=AUTH)).json()["buckets"]
                    target = buckets[step % len(buckets)]["name"]
                    knobs = {"max_num_seqs": 2 + step % 7, "max_num_batched_tokens": 64 * (1 + step % 4), "max_queue_len": 200 + step}
                    changes.append(await client.patch(f"/admin/models/{GENERATE_MODEL}/buckets/{target}", json=knobs, headers=AUTH))
                await asyncio.sleep(0.15)
            elapsed_s = time.monotonic() - started
            return list(await asyncio.gather(*in_flight)), changes, elapsed_s

    started = time.monotonic()
    responses, changes, changes_s = asyncio.run(run())
    total_s = time.monotonic() - started
    assert [c.status_code for c in changes] == [200] * (NUM_LAYOUTS + NUM_PATCHES), [c.text for c in changes if c.status_code != 200]
    assert [r.status_code for r in responses] == [200] * NUM_REQUESTS, [r.text for r in responses if r.status_code != 200][:3]
    references: dict[str, list[int]] = {}
    for response in responses:
        choice = response.json()["choices"][0]
        ids = choice["prompt_token_ids"]
        key = " ".join(map(str, ids))
        if key not in references:
            references[key] = greedy_reference(model, ids, MAX_TOKENS)
        assert_greedy_close(model, ids, choice["token_ids"], references[key])
    print(
        f"{NUM_REQUESTS} requests through {NUM_LAYOUTS} layout swaps and {NUM_PATCHES} patches in {changes_s:.1f} s "
        f"(all done in {total_s:.1f} s): {sum(r.status_code == 200 for r in responses)} ok"
    )
    final = _model(admin_url, GENERATE_MODEL)
    assert [b["max_input_tokens"] for b in final["buckets"]] == [limit for limit, _ in LAYOUTS[NUM_LAYOUTS % len(LAYOUTS)]]


def test_an_invalid_change_is_422_and_changes_nothing(admin_url: str) -> None:
    before = httpx.get(f"{admin_url}/admin/config", headers=AUTH).json()
    bucket = _model(admin_url, GENERATE_MODEL)["buckets"][0]["name"]
    bad_layout = [{"max_input_tokens": 96, "slice": "cpu0", "batcher": {"kind": "continuous"}},
                  {"max_input_tokens": 48, "slice": "cpu0", "batcher": {"kind": "continuous"}}]
    whole = {**bad_layout[0], "max_input_tokens": 320}  # one bucket reaching the test config's max_model_len
    cases = [
        ("put", f"/admin/models/{GENERATE_MODEL}/buckets", {"buckets": bad_layout}, "strictly increasing"),
        ("put", f"/admin/models/{GENERATE_MODEL}/buckets", {"buckets": [{**whole, "slice": "gpu9"}]}, "unknown slice"),
        ("put", f"/admin/models/{GENERATE_MODEL}/buckets", {"buckets": [{**whole, "batcher": {"kind": "dynamic"}}]}, "needs 'continuous'"),
        ("put", f"/admin/models/{GENERATE_MODEL}/buckets", {"buckets": [bad_layout[1]]}, "must reach max_model_len"),
        ("patch", f"/admin/models/{GENERATE_MODEL}/buckets/{bucket}", {"max_num_seqs": 0}, "greater than or equal to 1"),
        ("patch", f"/admin/models/{GENERATE_MODEL}/buckets/{bucket}", {"max_batch_size": 8}, "Extra inputs"),
        ("patch", f"/admin/models/{GENERATE_MODEL}/buckets/{bucket}", {"block_size": 8}, "Extra inputs"),
        ("patch", f"/admin/models/{GENERATE_MODEL}/buckets/{bucket}", {"max_num_seqs": 64, "max_num_batched_tokens": 32}, "below max_num_seqs"),
        ("post", "/admin/models", {"name": "x", "source": "nowhere", "task": "generate", "max_model_len": 1, "buckets": []}, ""),
    ]
    for method, path, body, reason in cases:
        response = httpx.request(method.upper(), f"{admin_url}{path}", json=body, headers=AUTH, timeout=30)
        assert response.status_code == 422, (method, path, body, response.text)
        error = response.json()["error"]
        assert reason in error["message"], (body, error)
        assert error["param"], error
    assert httpx.get(f"{admin_url}/admin/config", headers=AUTH).json() == before
    assert httpx.patch(f"{admin_url}/admin/models/{GENERATE_MODEL}/buckets/nope", json={}, headers=AUTH).status_code == 404


def test_unload_then_load_in_quick_succession(admin_url: str) -> None:
    config = _model(admin_url, EMBED_MODEL)["config"]
    body = {"model": EMBED_MODEL, "input": "round trip"}
    first = httpx.post(f"{admin_url}/v1/embeddings", json=body, timeout=60).json()["data"][0]["embedding"]
    for _ in range(3):
        assert httpx.delete(f"{admin_url}/admin/models/{EMBED_MODEL}", headers=AUTH, timeout=120).status_code == 200
        loaded = httpx.post(f"{admin_url}/admin/models", json=config, headers=AUTH, timeout=300)
        assert loaded.status_code == 201, loaded.text
        again = httpx.post(f"{admin_url}/v1/embeddings", json=body, timeout=60)
        assert again.status_code == 200
        assert again.json()["data"][0]["embedding"] == pytest.approx(first, abs=1e-5)

    async def both_at_once() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=admin_url, headers=AUTH, timeout=300) as client:
            return tuple(await asyncio.gather(  # type: ignore[return-value]
                client.delete(f"/admin/models/{EMBED_MODEL}"), client.post("/admin/models", json=config)
            ))

    unloaded, reloaded = asyncio.run(both_at_once())
    assert unloaded.status_code == 200
    # Changes are serialized: the load ran after the unload (201) or saw the model still there (409).
    assert reloaded.status_code in (201, 409), reloaded.text
    served = EMBED_MODEL in httpx.get(f"{admin_url}/health").json()["models"]
    assert served == (reloaded.status_code == 201)
    if not served:
        assert httpx.post(f"{admin_url}/admin/models", json=config, headers=AUTH, timeout=300).status_code == 201
    assert httpx.post(f"{admin_url}/v1/embeddings", json=body, timeout=60).status_code == 200


def test_the_effective_config_reflects_changes_and_loads(admin_url: str) -> None:
    bucket = _model(admin_url, GENERATE_MODEL)["buckets"][-1]["name"]
    patched = httpx.patch(
        f"{admin_url}/admin/models/{GENERATE_MODEL}/buckets/{bucket}", json={"max_queue_len": 77}, headers=AUTH
    )
    assert patched.status_code == 200, patched.text
    text = httpx.get(f"{admin_url}/admin/config", params={"format": "yaml"}, headers=AUTH).text
    config = parse_config(yaml.safe_load(text))
    generate = next(m for m in config.models if m.name == GENERATE_MODEL)
    assert generate.buckets[-1].max_queue_len == 77
    assert {m.name for m in config.models} == {GENERATE_MODEL, EMBED_MODEL}

