"""Ray slices without Ray: their config and its errors, the example config, the replicas a slice
builds and where they are placed, routing over ready replicas (a fake worker per replica), the
merged stats admission sees, and the actor's inbox that puts the gateway's messages back in
order. The cluster itself is tested end to end (tests/e2e/test_ray_slice.py)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from pathlib import Path
from typing import Any

import pytest

from buckets.errors import SliceUnavailableError
from buckets.settings import ContinuousBatcherSettings
from buckets.slices.ray_actor import RayPlacement, actor_options
from buckets.slices.ray_channels import ActorInbox, actor_name, config_fingerprint
from buckets.slices.ray_slice import RaySlice, merge_stats
from buckets.slices.slice import SliceState
from buckets.stats import Counters
from gateway.config import GatewayConfig, load_config, parse_config
from gateway.engine import Engine
from gateway.errors import ConfigError
from gateway.slice_worker import run_slice_worker, worker_config
from tests.factories import make_request
from tests.unit.test_process_slice import remote_spec

ROOT = Path(__file__).resolve().parents[2]
KEY = ("gen", "le64", 0)
NODE_ID = "ab" * 28  # a Ray node id: 28 bytes in hex


def ray_config(**slice_fields: Any) -> dict[str, Any]:
    return {
        "ray": {"address": "127.0.0.1:6379"},
        "slices": [{"name": "r", "kv_cache_memory_bytes": "32MiB", "isolation": "ray", **slice_fields}],
        "models": [{"name": "gen", "source": "/models/gen", "task": "generate", "max_model_len": 64, "buckets": [
            {"max_input_tokens": 64, "batcher": {"kind": "continuous", "block_size": 4}, "slice": "r"},
        ]}],
    }


def test_a_ray_slice_needs_the_cluster_address_and_its_knobs_belong_to_ray_slices_alone() -> None:
    data = ray_config()
    del data["ray"]
    with pytest.raises(ConfigError, match=r"slices\.0\.isolation: ray needs the top-level ray\.address"):
        parse_config(data)
    for knob in ({"replicas": 2}, {"placement_strategy": "SPREAD"}, {"resources": {"num_cpus": 1}}):
        name = next(iter(knob))
        with pytest.raises(ConfigError, match=f"{name}: only a slice with isolation: ray has it"):
            parse_config(ray_config(isolation="process", **knob))
    with pytest.raises(ConfigError, match="replicas"):
        parse_config(ray_config(replicas=0))
    with pytest.raises(ConfigError, match="node_id"):
        parse_config(ray_config(resources={"node_id": "node-1"}))
    auto = ray_config()
    auto["models"][0]["buckets"][0]["backend"] = "auto"
    with pytest.raises(ConfigError, match=r"models\.0\.buckets\.0\.backend: auto is not supported"):
        parse_config(auto)


def test_the_example_config_runs_the_chat_model_on_two_spread_replicas_and_embeddings_on_one_node() -> None:
    config = load_config(ROOT / "configs" / "ray-example.yaml")
    engine = Engine(config, worker_main=run_slice_worker)
    chat, embed = engine.slices["chat"], engine.slices["embed"]
    assert isinstance(chat, RaySlice) and isinstance(embed, RaySlice)
    assert [r.name for r in chat.replicas] == ["chat-0", "chat-1"] and chat.placement.strategy == "SPREAD"
    assert embed.placement.custom_resources == {"embed_node": 1.0} and not chat.needs_weights
    assert chat.placement.detached and actor_options(chat.placement, 0, "chat-0")["lifetime"] == "detached"
    assert actor_options(chat.placement, 1, "chat-1")["scheduling_strategy"] == "SPREAD"
    assert "scheduling_strategy" not in actor_options(embed.placement, 0, "embed-0")


def test_a_ray_replica_pinned_to_a_node_and_its_worker_config() -> None:
    config = parse_config(ray_config(replicas=2, resources={"num_cpus": 0.5, "num_gpus": 1, "node_id": NODE_ID}))
    placement = Engine(config, worker_main=run_slice_worker).slices["r"].placement  # type: ignore[attr-defined]
    assert placement == RayPlacement("127.0.0.1:6379", 0.5, 1.0, {}, NODE_ID, 2, "PACK", "sluice")
    options = actor_options(placement, 0, "r-0")
    assert options["scheduling_strategy"].node_id == NODE_ID and options["num_gpus"] == 1.0
    cut = worker_config(config, "r")  # the actor's own engine runs the slice as a thread slice
    assert [(s.isolation, s.replicas, s.resources) for s in cut.slices] == [("thread", 1, None)]
    assert isinstance(GatewayConfig.model_validate(cut.model_dump(mode="json")), GatewayConfig)


class FakeActorWorker:
    """Stands in for a replica's worker: keeps what the gateway sends it."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []
        self.pid = 4242
        self.process = SimpleNamespace(where={"node_id": NODE_ID, "node_ip": "127.0.0.1"})

    def send(self, message: tuple[Any, ...]) -> None:
        self.sent.append(message)


def ready_slice(num_replicas: int) -> RaySlice:
    placement = RayPlacement("127.0.0.1:6379", replicas=num_replicas)
    ray_slice = RaySlice("r", "cpu", 1, run_slice_worker, lambda: (), placement)
    ray_slice.attach(KEY, remote_spec("continuous", ContinuousBatcherSettings(8, 64, block_size=4)))
    for replica in ray_slice.replicas:
        replica._worker = FakeActorWorker()  # type: ignore[assignment]
        replica.state = SliceState.READY
    return ray_slice


def submitted(ray_slice: RaySlice) -> list[int]:
    return [sum(m[0] == "submit" for m in r._worker.sent) for r in ray_slice.replicas]  # type: ignore[union-attr]


def test_requests_spread_over_the_ready_replicas_and_a_shared_prefix_stays_on_one() -> None:
    ray_slice = ready_slice(2)
    for i in range(40):
        ray_slice.submit(KEY, make_request(prompt_len=3, name=f"short{i}", first_token=100 + i))
    assert submitted(ray_slice) == [20, 20]  # two choices of two: the less loaded one, each time
    ray_slice.replicas[1].state = SliceState.RESTARTING
    ray_slice.submit(KEY, make_request(prompt_len=3, name="while-restarting"))
    assert submitted(ray_slice) == [21, 20]
    ray_slice.replicas[1].state = SliceState.READY
    before = submitted(ray_slice)
    for i in range(6):  # 5 full blocks of 4 tokens shared, then each its own tail
        request = make_request(prompt_len=20, name=f"shared{i}")
        request.prompt_token_ids.append(1000 + i)
        ray_slice.submit(KEY, request)
    took = [after - was for after, was in zip(submitted(ray_slice), before)]
    assert sorted(took) == [0, 6]


def test_no_ready_replica_is_a_slice_unavailable_error_with_retry_after() -> None:
    ray_slice = ready_slice(2)
    for replica in ray_slice.replicas:
        replica.state = SliceState.RESTARTING
    with pytest.raises(SliceUnavailableError) as raised:
        ray_slice.submit(KEY, make_request())
    assert raised.value.retry_after_s > 0 and ray_slice.state is SliceState.RESTARTING
    described = ray_slice.describe()
    assert described["isolation"] == "ray" and [r["state"] for r in described["replicas"]] == ["restarting"] * 2
    assert [(r["name"], r["node_id"], r["worker_pid"]) for r in described["replicas"]] == [("r-0", NODE_ID, None), ("r-1", NODE_ID, None)]


def test_the_bucket_stats_admission_sees_are_the_sum_over_the_replicas() -> None:
    one = Counters().snapshot("continuous", num_waiting=2, num_running=3)
    other = Counters().snapshot("continuous", num_waiting=1, num_running=4)
    merged = merge_stats([one, other])
    assert (merged.num_waiting, merged.num_running, merged.kind) == (3, 7, "continuous")


def test_the_actor_inbox_hands_the_gateways_messages_over_in_the_order_they_were_sent() -> None:
    inbox = ActorInbox()
    inbox.open("gw")
    inbox.put("gw", 1, ("cancel", 7, "gone"))
    inbox.put("gw", 0, ("submit", KEY, {"request_no": 7}))
    assert inbox.recv() == ("submit", KEY, {"request_no": ("gw", 7)}) and inbox.recv() == ("cancel", ("gw", 7), "gone")
    received: list[Any] = []
    reader = threading.Thread(target=lambda: received.append(inbox.recv()))
    reader.start()
    inbox.put("gw", 2, ("stop",))
    reader.join(5)
    assert received == [("stop",)]
    inbox.send(None)
    with pytest.raises(EOFError):
        inbox.recv()
    assert inbox.num_channels == 0


def drained(outbox: Any) -> list[Any]:
    items = []
    while not outbox.empty():
        items.append(outbox.get_nowait())
    return items


def test_two_gateways_request_numbers_never_collide_and_each_gets_its_own_events() -> None:
    inbox = ActorInbox(shared=True)
    inbox.send(("ready", 99, {KEY: {"backend": "eager"}}))
    for gateway in ("a", "b"):
        inbox.open(gateway)
        inbox.put(gateway, 0, ("submit", KEY, {"request_no": 0}))
    assert [inbox.recv()[2]["request_no"] for _ in range(2)] == [("a", 0), ("b", 0)]
    a_out, b_out = inbox.outbox("a"), inbox.outbox("b")
    inbox.send(("event", ("b", 0), ("token",), {}, [(1, 2)]))  # b's request finished
    inbox.send(("stats", {}, 1.0, 0.5))
    inbox.send(("rebuilt", KEY, {"backend": "lean"}, None))
    assert drained(a_out) == [("ready", 99, {KEY: {"backend": "eager"}}), ("stats", {}, 1.0, 0.5), ("rebuilt", KEY, {"backend": "lean"}, None)]
    assert drained(b_out)[1] == ("event", 0, ("token",), {}, [(1, 2)])
    inbox.open("late")  # told at once that the worker is ready, with the rebuilt backend
    assert drained(inbox.outbox("late")) == [("ready", 99, {KEY: {"backend": "lean"}})]
    inbox.put("a", 1, ("stop",))  # on a shared actor: a's channel closes, its request is cancelled
    assert inbox.recv() == ("cancel", ("a", 0), "cancelled") and drained(a_out) == [None]
    inbox.close_channel("b")  # nothing in flight: nothing to cancel
    assert drained(b_out) == [None] and inbox.num_channels == 1
    inbox.send(("event", ("a", 0), ("error", "CancelledError", "x"), {}, []))  # a's is gone: dropped
    assert drained(inbox.outbox("late")) == []


def test_a_channel_whose_gateway_stops_renewing_its_lease_is_closed() -> None:
    now = [0.0]
    inbox = ActorInbox(shared=True, clock=lambda: now[0])
    inbox.open("alive")
    inbox.open("dead")
    inbox.put("dead", 0, ("submit", KEY, {"request_no": 3}))
    assert inbox.recv()[0] == "submit"
    now[0] = 8.0
    inbox.renew("alive")
    assert inbox.expire(5.0) == ["dead"] and inbox.recv() == ("cancel", ("dead", 3), "cancelled")
    now[0] = 12.0
    assert inbox.expire(5.0) == [] and inbox.num_channels == 1


def test_detached_actors_are_named_per_replica_and_fingerprinted_by_the_models_they_run() -> None:
    placement = RayPlacement("127.0.0.1:6379", namespace="prod", detached=True)
    options = actor_options(placement, 1, actor_name("r", 1))
    assert (options["name"], options["namespace"], options["lifetime"], options["get_if_exists"]) == ("r-1", "prod", "detached", True)
    assert "lifetime" not in actor_options(RayPlacement("127.0.0.1:6379"), 0, "r-0")
    data = ray_config()
    data["slices"].append({"name": "t"})
    data["models"].append({"name": "other", "source": "/models/o", "task": "embed", "max_model_len": 16,
                           "buckets": [{"max_input_tokens": 16, "batcher": {"kind": "dynamic"}, "slice": "t"}]})
    base = config_fingerprint(parse_config(data).model_dump(mode="json"), "r")
    data["models"][1]["dtype"] = "float16"  # a model on another slice
    data["slices"][0]["replicas"] = 3  # a scaled slice keeps its actors
    assert config_fingerprint(parse_config(data).model_dump(mode="json"), "r") == base
    data["models"][0]["buckets"][0]["batcher"]["block_size"] = 8
    assert config_fingerprint(parse_config(data).model_dump(mode="json"), "r") != base
    assert parse_config({**ray_config(), "ray": {"address": "auto", "detached": True}}).ray.detached  # type: ignore[union-attr]
