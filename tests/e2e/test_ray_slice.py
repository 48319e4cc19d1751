"""Slices with ``isolation: ray`` on a local multi-node Ray cluster, against a real server.

One cluster for the module (``ray.cluster_utils.Cluster``: a head and a second node, every
process bound to 127.0.0.1, dashboard off, one CPU and a small object store per node) and one
server: the chat model on a Ray slice of two replicas spread over the two nodes and, as a
``-thread`` copy, on a thread slice; the embedding model on a Ray slice of one replica. Greedy
completions must match between the Ray and the thread slice; load must spread over the two
replicas and a shared prefix must stay on one; killing a replica's actor (SIGKILL) or removing
its node must fail only its requests (503 ``worker_crashed``), quickly, and the replica must
come back. Two more gateways of one small config (the chat model on one detached replica) share
that replica's actor: both serve the same greedy output, one stopping (SIGTERM) or killed
(SIGKILL) loses nothing on the other and leaves no KV block taken, and a restarted one attaches
to the actor without loading it again. If Ray cannot start here, the module fails (it never skips).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from buckets.settings import DynamicBatcherSettings
from buckets.slices.ray_actor import LOOPBACK_ONLY_ENV
from buckets.slices.ray_slice import RaySlice
from buckets.slices.slice import SliceState
from gateway.config import parse_config
from gateway.slice_worker import run_slice_worker
from tests.e2e.conftest import EMBED_MODEL, GENERATE_MODEL, run_server, run_server_process, wait_for

from tests.e2e.test_process_slices import (
    CLIENT_TIMEOUT_S,
    EMBED_SOURCE,
    GENERATE_SOURCE,
    LONG_BODY,
    PROMPT,
    RESTART_TIMEOUT_S,
    _streamed_text,
)
from tests.unit.test_process_slice import remote_spec

CRASH_REPORTED_S = 5.0  # the bound: requests on a dead actor end within this
# The long requests a replica is lost under: still running when the loss lands (it follows the
# sight of all of them running within a stats push, 50 ms), and short enough that the other
# replica's finish soon after (200 tokens took 70 s beside two actors reloading on 2 cores).
LONG_TOKENS = 64
NODE_ARGS = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 100 * 1024**2}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A two-node local Ray cluster on the loopback (a third node is added by the node-loss test)."""
    patch = pytest.MonkeyPatch()
    patch.setenv(LOOPBACK_ONLY_ENV, "0")  # Ray keeps 127.0.0.1 instead of the host's address (read at import)
    from ray.cluster_utils import Cluster

    started = time.monotonic()
    local = Cluster(initialize_head=True, head_node_args={**NODE_ARGS, "include_dashboard": False})
    local.add_node(**NODE_ARGS)
    local.wait_for_nodes()
    print(f"ray cluster of 2 nodes started in {time.monotonic() - started:.1f} s")
    try:
        yield local
    finally:
        stopping = time.monotonic()
        local.shutdown()
        patch.undo()
        print(f"ray cluster stopped in {time.monotonic() - stopping:.1f} s")


def _models() -> list[dict[str, Any]]:
    continuous = {"kind": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 256}
    dynamic = {"kind": "dynamic", "max_batch_size": 8, "max_queue_delay_ms": 5}
    chat = {"source": GENERATE_SOURCE, "task": "generate", "max_model_len": 256}
    return [
        {**chat, "name": GENERATE_MODEL, "buckets": [{"max_input_tokens": 256, "batcher": continuous, "slice": "ray"}]},
        {**chat, "name": GENERATE_MODEL + "-thread",
         "buckets": [{"max_input_tokens": 256, "batcher": continuous, "slice": "thread"}]},
        {"name": EMBED_MODEL, "source": EMBED_SOURCE, "task": "embed", "max_model_len": 256,
         "buckets": [{"max_input_tokens": 256, "batcher": dynamic, "slice": "ray-one"}]},
    ]


@pytest.fixture(scope="module")
def server(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    small = {"device": "cpu", "num_threads": 1, "kv_cache_memory_bytes": "32MiB"}
    slices = [
        {**small, "name": "ray", "isolation": "ray", "replicas": 2, "placement_strategy": "SPREAD",
         "resources": {"num_cpus": 1}},
        {**small, "name": "ray-one", "isolation": "ray", "resources": {"num_cpus": 0}},
        {**small, "name": "thread"},
    ]
    config = {
        "slices": slices, "models": _models(), "admin_allow_loopback_without_token": True,
        "ray": {"address": cluster.address},
    }
    folder = tmp_path_factory.mktemp("ray_slice")
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with run_server(path, folder / "server.log", env={"SLUICE_ADMIN_TOKEN": ""}) as url:
        yield url, folder / "server.log"


def _slice(url: str, name: str = "ray") -> dict[str, Any]:
    slices = httpx.get(f"{url}/admin/slices", timeout=10).json()["slices"]
    return next(s for s in slices if s["name"] == name)  # type: ignore[no-any-return]


def _all_ready(url: str, name: str = "ray") -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        described = _slice(url, name)
        return described if all(r["state"] == "ready" for r in described["replicas"]) else None

    return wait_for(probe, RESTART_TIMEOUT_S, f"every replica of slice {name} ready")


def _bucket_stats(url: str, model: str = GENERATE_MODEL) -> dict[str, Any]:
    stats = httpx.get(f"{url}/stats", timeout=10).json()
    return next(iter(stats[model].values()))  # type: ignore[no-any-return]


def test_ray_listens_on_the_loopback_only(server: tuple[str, Path]) -> None:
    url, _ = server
    ours = [psutil.Process(), *psutil.Process().children(recursive=True)]
    names = {p.pid: p.name() for p in ours if p.is_running()}
    assert any("raylet" in name for name in names.values()) and any("gcs_server" in name for name in names.values())
    listening = [c for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.pid in names]
    assert listening
    for conn in listening:
        address = ipaddress.ip_address(conn.laddr.ip)
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # "::ffff:127.0.0.1"
        assert address.is_loopback, f"{names[conn.pid]} (pid {conn.pid}) listens on {conn.laddr}"


def _greedy(client: httpx.Client, model: str) -> tuple[tuple[str, str], httpx.Headers]:
    """A greedy completion of ``model``, whole and streamed, and the whole one's headers."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return (response.json()["choices"][0]["text"], _streamed_text(client, body)), response.headers


def test_a_ray_slice_serves_what_a_thread_slice_does(server: tuple[str, Path]) -> None:
    url, _ = server
    described = _all_ready(url)
    assert described["isolation"] == "ray" and described["num_replicas"] == 2
    replicas = described["replicas"]
    assert len({r["node_id"] for r in replicas}) == 2 and all(r["node_ip"] == "127.0.0.1" for r in replicas)
    assert all(r["worker_pid"] not in (None, os.getpid()) for r in replicas)
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
        through_ray, headers = _greedy(client, GENERATE_MODEL)
        on_a_thread, _ = _greedy(client, GENERATE_MODEL + "-thread")
        assert through_ray == on_a_thread and through_ray[0]
        assert headers["x-sluice-bucket"] == "le256" and "x-sluice-prefill-ms" in headers
        embedded = client.post("/v1/embeddings", json={"model": EMBED_MODEL, "input": ["a lock on a canal", PROMPT]})
        assert embedded.status_code == 200 and len(embedded.json()["data"][0]["embedding"]) == 384
    models = httpx.get(f"{url}/admin/models/{GENERATE_MODEL}", timeout=10).json()
    assert models["buckets"][0]["isolation"] == "ray" and models["buckets"][0]["stats"]["num_finished"] >= 2


def _submitted(url: str) -> list[int]:
    return [r["num_submitted"] for r in _slice(url)["replicas"]]


def test_load_spreads_over_the_replicas_and_a_shared_prefix_stays_on_one(server: tuple[str, Path]) -> None:
    url, _ = server
    _all_ready(url)
    before = _submitted(url)

    async def run(bodies: list[dict[str, Any]], concurrency: int) -> list[int]:
        limit = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
            async def one(body: dict[str, Any]) -> int:
                async with limit:
                    return (await client.post("/v1/completions", json=body)).status_code

            return await asyncio.gather(*[one(body) for body in bodies])

    short = [{"model": GENERATE_MODEL, "prompt": f"n{i}", "max_tokens": 1, "temperature": 0} for i in range(200)]
    assert set(asyncio.run(run(short, 8))) == {200}
    served = [after - was for after, was in zip(_submitted(url), before)]
    mean = sum(served) / len(served)
    assert sum(served) == 200 and all(abs(n - mean) <= 0.25 * mean for n in served), served

    hits_before = [r["prefix_cache_hits"] for r in _slice(url)["replicas"]]
    submitted_before = _submitted(url)
    prefix = "You are a careful assistant who answers in one word. " * 12
    shared = [{"model": GENERATE_MODEL, "prompt": f"{prefix}Question {i}:", "max_tokens": 1} for i in range(12)]
    assert set(asyncio.run(run(shared, 1))) == {200}
    took = [after - was for after, was in zip(_submitted(url), submitted_before)]
    assert sorted(took) == [0, 12], took
    holder = took.index(12)
    hits = wait_for(
        lambda: (h := [r["prefix_cache_hits"] for r in _slice(url)["replicas"]])[holder] > hits_before[holder] and h,
        30, "prefix-cache hits on the replica holding the prefix",
    )
    assert hits[1 - holder] == hits_before[1 - holder]


def test_a_client_that_hangs_up_frees_its_blocks_in_the_actor(server: tuple[str, Path]) -> None:
    url, _ = server
    _all_ready(url)
    body = {**LONG_BODY, "stream": True}
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client, client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200 and any(line.startswith("data: ") for line in response.iter_lines())
        wait_for(lambda: _bucket_stats(url)["kv_blocks_used"] > 0, 60, "the stream's KV blocks in use")
        # the stream is closed here: the gateway cancels the request and tells the actor
    stats = wait_for(
        lambda: (s := _bucket_stats(url))["kv_blocks_used"] == 0 and s["num_running"] == 0 and s, 60,
        "the hung-up request's blocks freed",
    )
    assert stats["num_cancelled"] >= 1


async def _long_request(client: httpx.AsyncClient, stream: bool) -> tuple[int, str]:
    """Status and body (the SSE text when streamed) of a generation of ``LONG_TOKENS``."""
    body = {**LONG_BODY, "max_tokens": LONG_TOKENS}
    if not stream:
        response = await client.post("/v1/completions", json=body)
        return response.status_code, response.text
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        return response.status_code, "".join([line + "\n" async for line in response.aiter_lines()])


def _crashed(results: list[tuple[int, str]]) -> int:
    """How many results say their replica died: a 503 ``worker_crashed``, or a 200 stream that
    ends with such an error chunk and then [DONE]; every other result is a plain 200."""
    failed = 0
    for status, text in results:
        if status == 200 and '"code": "worker_crashed"' in text:
            assert "data: [DONE]" in text
            failed += 1
        elif status != 200:
            assert status == 503 and json.loads(text)["error"]["code"] == "worker_crashed", text
            failed += 1
    return failed


def _lose_a_replica_under_load(url: str, victim: str, lose: Any) -> tuple[int, int, float, int]:
    """Run 4 long requests over the replicas and call ``lose()`` once all run. Returns how many
    were on replica ``victim``, how many of those ended (with ``worker_crashed``) within
    ``CRASH_REPORTED_S``, the seconds from the loss to the last of them, and the status of a
    request sent meanwhile; the others must finish with a 200."""

    async def run() -> tuple[int, int, float, int]:
        async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
            tasks = [asyncio.create_task(_long_request(client, stream=i % 2 == 1)) for i in range(4)]
            deadline = time.monotonic() + CLIENT_TIMEOUT_S
            while _bucket_stats(url)["num_running"] < 4:
                assert time.monotonic() < deadline and not any(t.done() for t in tasks)
                await asyncio.sleep(0.05)
            on_victim = next(r for r in _slice(url)["replicas"] if r["name"] == victim)["num_in_flight"]
            lost_at = time.monotonic()
            lose()
            while sum(t.done() for t in tasks) < on_victim and time.monotonic() < lost_at + CRASH_REPORTED_S:
                await asyncio.sleep(0.02)
            took_s = time.monotonic() - lost_at
            crashed = _crashed([t.result() for t in tasks if t.done()])
            during = await client.post("/v1/completions", json={**LONG_BODY, "max_tokens": 2})
            rest = await asyncio.wait_for(asyncio.gather(*tasks), CLIENT_TIMEOUT_S)
            assert _crashed(rest) == crashed  # the other replica's requests finished
            return on_victim, crashed, took_s, during.status_code

    return asyncio.run(run())


def _embed_unavailable(url: str) -> httpx.Response | None:
    """The 503 ``slice_unavailable`` of an embedding request, or ``None`` while it is not one
    (a ``worker_crashed`` 503 was sent before the actor's death was seen)."""
    response = httpx.post(f"{url}/v1/embeddings", json={"model": EMBED_MODEL, "input": "x"}, timeout=30)
    code = response.json()["error"]["code"] if response.status_code != 200 else None
    assert response.status_code in (200, 503) and code in (None, "worker_crashed", "slice_unavailable"), response.text
    return response if code == "slice_unavailable" else None


def test_killing_actors_fails_only_their_requests_and_they_come_back(server: tuple[str, Path]) -> None:
    """SIGKILL the embedding slice's only actor (503 slice_unavailable with Retry-After until it
    is back), then one of the chat slice's two under load (only its requests fail; the other
    replica serves meanwhile); both are re-created side by side."""
    url, log_path = server
    embed_pid = _all_ready(url, "ray-one")["replicas"][0]["worker_pid"]
    victim = _all_ready(url)["replicas"][0]
    os.kill(embed_pid, signal.SIGKILL)
    unavailable = wait_for(lambda: _embed_unavailable(url), CRASH_REPORTED_S, "a 503 slice_unavailable")
    assert unavailable.headers["Retry-After"]

    kill = lambda: os.kill(victim["worker_pid"], signal.SIGKILL)  # noqa: E731
    on_victim, crashed, took_s, during = _lose_a_replica_under_load(url, victim["name"], kill)
    print(f"the {crashed} requests on the killed actor ended {took_s:.2f} s after the kill")
    assert on_victim >= 1 and crashed == on_victim
    assert during == 200  # the other replica serves
    back = _all_ready(url)["replicas"][0]
    assert back["worker_pid"] != victim["worker_pid"] and back["num_restarts"] == victim["num_restarts"] + 1
    response = httpx.post(f"{url}/v1/completions", json={**LONG_BODY, "max_tokens": 4}, timeout=CLIENT_TIMEOUT_S)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert _all_ready(url, "ray-one")["replicas"][0]["worker_pid"] != embed_pid
    back_embed = httpx.post(f"{url}/v1/embeddings", json={"model": EMBED_MODEL, "input": "back"}, timeout=CLIENT_TIMEOUT_S)
    assert back_embed.status_code == 200
    events = [json.loads(line).get("event") for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert events.count("worker_crashed") >= 2 and events.count("worker_restarted") >= 2


def test_removing_a_node_fails_only_its_requests_and_the_replica_moves(server: tuple[str, Path], cluster: Any) -> None:
    url, _ = server
    cluster.add_node(**NODE_ARGS)  # room for the lost replica
    replicas = _all_ready(url)["replicas"]
    worker_nodes = {node.node_id: node for node in cluster.worker_nodes}
    victim = next(r for r in replicas if r["node_id"] in worker_nodes)
    remove = lambda: cluster.remove_node(worker_nodes[victim["node_id"]])  # noqa: E731
    on_victim, crashed, took_s, during = _lose_a_replica_under_load(url, victim["name"], remove)
    print(f"the {crashed} requests on the removed node ended {took_s:.2f} s after the removal")
    assert on_victim >= 1 and crashed == on_victim
    assert during == 200
    moved = next(r for r in _all_ready(url)["replicas"] if r["name"] == victim["name"])
    assert moved["node_id"] != victim["node_id"]
    response = httpx.post(f"{url}/v1/completions", json={**LONG_BODY, "max_tokens": 4}, timeout=CLIENT_TIMEOUT_S)
    assert response.status_code == 200


def test_layout_changes_of_a_model_on_ray_are_refused(server: tuple[str, Path]) -> None:
    url, _ = server
    layout = {"buckets": [{"max_input_tokens": 256, "batcher": {"kind": "continuous"}, "slice": "ray"}]}
    put = httpx.put(f"{url}/admin/models/{GENERATE_MODEL}/buckets", json=layout, timeout=30)
    assert put.status_code == 409 and "isolation: ray" in put.json()["error"]["message"]


def test_a_model_source_missing_on_the_actors_node_is_a_clear_error_at_start(cluster: Any) -> None:
    """A Ray slice started from this process (a driver of the module's cluster) whose model
    source does not exist where its actor runs."""
    import ray

    from buckets.slices.ray_actor import connect
    from gateway.build import ray_placement

    config = parse_config({
        "ray": {"address": cluster.address},
        "slices": [{"name": "lost", "isolation": "ray", "resources": {"num_cpus": 0}, "kv_cache_memory_bytes": "16MiB"}],
        "models": [{"name": "gone", "source": "/nonexistent/model", "task": "embed", "max_model_len": 16,
                    "buckets": [{"max_input_tokens": 16, "batcher": {"kind": "dynamic"}, "slice": "lost"}]}],
    })
    placement = ray_placement(config.slices[0], config.ray)
    assert placement is not None
    lost = RaySlice("lost", "cpu", 1, run_slice_worker, lambda: (config.model_dump(mode="json"), "lost", "WARNING"), placement)
    lost.attach(("gone", "le16", 0), remote_spec("dynamic", DynamicBatcherSettings(8, 5.0)))
    connect(cluster.address, placement.namespace)
    try:
        with pytest.raises(RuntimeError, match="ModelSourceError: source '/nonexistent/model'.*does not exist"):
            lost.start()
        assert lost.state is SliceState.FAILED
    finally:
        ray.shutdown()


SHARED_NAMESPACE = "sluice-shared"  # apart from the module server's actors


@pytest.fixture(scope="module")
def shared_config(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A config of the chat model alone, on one detached replica (no CPU reserved: the module's
    server holds the nodes' CPUs), and the folder for the gateways' logs."""
    continuous = {"kind": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 256}
    config = {
        "slices": [{"name": "shared", "isolation": "ray", "resources": {"num_cpus": 0}, "device": "cpu",
                    "num_threads": 1, "kv_cache_memory_bytes": "32MiB"}],
        "models": [{"name": GENERATE_MODEL, "source": GENERATE_SOURCE, "task": "generate", "max_model_len": 256,
                    "buckets": [{"max_input_tokens": 256, "batcher": continuous, "slice": "shared"}]}],
        "admin_allow_loopback_without_token": True,
        "ray": {"address": cluster.address, "namespace": SHARED_NAMESPACE, "detached": True},
    }
    folder = tmp_path_factory.mktemp("ray_shared")
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder / "config.yaml", folder


@pytest.fixture(scope="module")
def gateway_a(shared_config: tuple[Path, Path]) -> Iterator[tuple[str, float]]:
    """The first gateway of the shared config (it creates the actor, which loads the model), and
    the seconds it took to answer /health."""
    path, folder = shared_config
    started = time.monotonic()
    with run_server(path, folder / "a.log", env={"SLUICE_ADMIN_TOKEN": ""}) as url:
        yield url, time.monotonic() - started


def _actor(url: str) -> dict[str, Any]:
    return _all_ready(url, "shared")["replicas"][0]


def _finish_on_a_while_b_goes(url_a: str, url_b: str, stop_b: Any) -> list[int]:
    """Two long requests on each gateway; once all four run in the shared actor, ``stop_b()``.
    Returns the statuses of gateway A's requests (B's end however B's going ends them)."""
    body = {**LONG_BODY, "model": GENERATE_MODEL, "max_tokens": LONG_TOKENS}

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
            on_a = [asyncio.create_task(client.post(f"{url_a}/v1/completions", json=body)) for _ in range(2)]
            on_b = [asyncio.create_task(client.post(f"{url_b}/v1/completions", json=body)) for _ in range(2)]
            deadline = time.monotonic() + CLIENT_TIMEOUT_S
            while _bucket_stats(url_a)["num_running"] < 4:  # the actor's stats: both gateways' requests
                assert time.monotonic() < deadline and not any(t.done() for t in on_a + on_b)
                await asyncio.sleep(0.05)
            stop_b()
            await asyncio.gather(*on_b, return_exceptions=True)
            return [response.status_code for response in await asyncio.gather(*on_a)]

    return asyncio.run(run())


def _blocks_all_back(url: str) -> dict[str, Any]:
    return wait_for(
        lambda: (s := _bucket_stats(url))["kv_blocks_used"] == 0 and s["num_running"] == 0 and s, 60,
        "every KV block of the shared actor free again",
    )


def test_two_gateways_of_one_config_share_its_detached_actor_and_one_stopping_loses_nothing_on_the_other(
    gateway_a: tuple[str, float], shared_config: tuple[Path, Path],
) -> None:
    url_a, _ = gateway_a
    path, folder = shared_config
    with run_server_process(path, folder / "b.log", env={"SLUICE_ADMIN_TOKEN": ""}) as (url_b, process_b):
        actor_a, actor_b = _actor(url_a), _actor(url_b)
        assert actor_a["worker_pid"] == actor_b["worker_pid"] and actor_b["actor_loads"] == 1
        assert actor_b["attached_to_running"] and actor_b["actor_name"] == "shared-0"
        outputs = []
        for url in (url_a, url_b):
            with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
                outputs.append(_greedy(client, GENERATE_MODEL)[0])
        assert outputs[0] == outputs[1] and outputs[0][0]
        statuses = _finish_on_a_while_b_goes(url_a, url_b, process_b.terminate)
        assert process_b.wait(60) is not None
    assert statuses == [200, 200]
    _blocks_all_back(url_a)  # B's requests finished or were cancelled when its channel closed
    assert _actor(url_a)["worker_pid"] == actor_a["worker_pid"]  # the actor stayed


def test_a_restarted_gateway_attaches_to_the_detached_actor_without_loading_it_again(
    gateway_a: tuple[str, float], shared_config: tuple[Path, Path],
) -> None:
    """Gateway B again (after the test above stopped it): it finds the actor serving and loads
    nothing; then B is killed (SIGKILL) with requests in flight: A's requests all succeed and
    every KV block of the actor comes back."""
    url_a, first_start_s = gateway_a
    path, folder = shared_config
    pid = _actor(url_a)["worker_pid"]
    started = time.monotonic()
    with run_server_process(path, folder / "b2.log", env={"SLUICE_ADMIN_TOKEN": ""}) as (url_b, process_b):
        restart_s = time.monotonic() - started
        print(f"/health: the first gateway in {first_start_s:.1f} s (the actor loaded), the restarted one in {restart_s:.1f} s")
        actor = _actor(url_b)
        assert actor["worker_pid"] == pid and actor["actor_loads"] == 1 and actor["attached_to_running"]
        response = httpx.post(f"{url_b}/v1/completions", json={**LONG_BODY, "max_tokens": 4}, timeout=CLIENT_TIMEOUT_S)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
        statuses = _finish_on_a_while_b_goes(url_a, url_b, process_b.kill)
    assert statuses == [200, 200]
    _blocks_all_back(url_a)
    assert _actor(url_a)["worker_pid"] == pid
