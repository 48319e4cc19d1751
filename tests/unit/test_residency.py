"""gateway/residency.py over a fake engine whose loads and unloads the test releases: single
flight, waits bounded by queue length and deadline, failures with backoff, LRU eviction within
the budget, pins, and the 503s when nothing can be evicted. No model; a fake clock."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway import memory
from gateway.config import GatewayConfig, ModelConfig, parse_config
from gateway.errors import APIError, ConfigError
from gateway.residency import ModelState, Residency

MB = 1_000_000
WEIGHT_BYTES = 100 * MB  # every fake model's weights (no KV: embedding models)


def _config(*models: dict[str, Any], budget_bytes: int = 250 * MB, **top: Any) -> GatewayConfig:
    batcher = {"kind": "dynamic", "max_batch_size": 4}
    return parse_config({
        "slices": [{"name": "cpu0"}],
        "memory_budget_bytes": budget_bytes,
        "model_load_retry_s": 5,
        **top,
        "models": [
            {"task": "embed", "source": "unused", "max_model_len": 16, "load": "on_demand",
             "buckets": [{"max_input_tokens": 16, "batcher": batcher, "slice": "cpu0", "max_queue_len": 4}], **m}
            for m in models
        ],
    })


@dataclass
class FakeServed:
    config: ModelConfig
    draining: bool = False
    num_leases: int = 0
    num_running: int = 0

    def is_idle(self) -> bool:
        return self.num_leases == 0 and self.num_running == 0


@dataclass
class FakeEngine:
    """What Residency uses of an Engine; ``load`` blocks until the test releases it."""

    config: GatewayConfig
    models: dict[str, FakeServed] = field(default_factory=dict)
    weight_bytes: dict[str, int] = field(default_factory=dict)
    kv_memory_bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    cache_dir: Any = None
    loads: list[str] = field(default_factory=list)
    unloads: list[str] = field(default_factory=list)
    fail: set[str] = field(default_factory=set)
    gate: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.gate.set()

    def weights_device(self, _: ModelConfig) -> str:
        return "cpu"

    def draining_kv_bytes(self) -> dict[str, int]:
        return {}

    def load(self, model: ModelConfig, config: GatewayConfig, freeze: bool = True) -> FakeServed:
        self.loads.append(model.name)
        assert self.gate.wait(10)
        if model.name in self.fail:
            raise OSError(f"{model.name}: corrupt weights")
        served = self.models[model.name] = FakeServed(model)
        self.weight_bytes[model.name] = WEIGHT_BYTES
        return served

    def unload(
        self, name: str, drain_timeout_s: float, poll_s: float = 0.02, forget: bool = True, unfrozen_only: bool = False
    ) -> dict[str, Any]:
        self.unloads.append(name)
        del self.models[name]
        self.weight_bytes.pop(name, None)
        return {"drain_s": 0.0, "num_unfinished": 0}


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _residency(engine: FakeEngine, clock: Clock | None = None) -> Residency:
    residency = Residency(engine, clock=clock or Clock(), physical_memory_bytes=10**12)  # type: ignore[arg-type]
    residency._estimate_weight_bytes = lambda model: WEIGHT_BYTES  # type: ignore[method-assign]
    return residency


async def _until(condition: Any, timeout_s: float = 10.0) -> None:
    """Wait until ``condition()`` holds (the load's thread runs beside the loop)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.001)


async def _use(residency: Residency, name: str, deadline_s: float | None = None) -> None:
    async with residency.serving(name, deadline_s):
        pass


def test_concurrent_first_requests_share_one_load() -> None:
    engine = FakeEngine(_config({"name": "a"}))
    residency = _residency(engine)

    async def run() -> None:
        engine.gate.clear()
        waits = [asyncio.ensure_future(_use(residency, "a")) for _ in range(4)]
        await _until(lambda: engine.loads)
        assert residency.state("a")[0] is ModelState.LOADING and residency.loading() == ["a"]
        engine.gate.set()
        await asyncio.gather(*waits)

    asyncio.run(run())
    assert engine.loads == ["a"] and residency.state("a") == (ModelState.LOADED, None)
    assert engine.models["a"].num_leases == 0  # every lease given back


def test_waiters_past_the_queue_length_get_a_429() -> None:
    engine = FakeEngine(_config({"name": "a"}))
    residency = _residency(engine)

    async def run() -> APIError:
        engine.gate.clear()
        waits = [asyncio.ensure_future(_use(residency, "a")) for _ in range(4)]  # max_queue_len 4
        await _until(lambda: engine.loads)
        with pytest.raises(APIError) as refused:
            await _use(residency, "a")
        engine.gate.set()
        await asyncio.gather(*waits)
        return refused.value

    error = asyncio.run(run())
    assert error.status_code == 429 and error.code == "queue_full" and error.headers and "Retry-After" in error.headers


def test_a_deadline_passing_during_the_load_is_a_504_and_the_load_goes_on() -> None:
    engine = FakeEngine(_config({"name": "a"}))
    clock = Clock()
    residency = _residency(engine, clock)

    async def run() -> APIError:
        engine.gate.clear()
        with pytest.raises(APIError) as timed_out:
            await _use(residency, "a", deadline_s=clock.now_s + 0.05)
        engine.gate.set()
        await _until(lambda: residency.state("a")[0] is ModelState.LOADED)
        return timed_out.value

    error = asyncio.run(run())
    assert error.status_code == 504 and error.code == "timeout"
    assert residency.state("a")[0] is ModelState.LOADED


def test_a_failed_load_fails_every_waiter_then_backs_off_then_tries_again() -> None:
    engine = FakeEngine(_config({"name": "a"}), fail={"a"})
    clock = Clock()
    residency = _residency(engine, clock)

    async def run() -> list[BaseException | None]:
        results = await asyncio.gather(*(_use(residency, "a") for _ in range(3)), return_exceptions=True)
        return list(results)

    errors = asyncio.run(run())
    assert all(isinstance(e, APIError) and e.status_code == 503 and e.code == "model_load_failed" for e in errors)
    assert "corrupt weights" in errors[0].message  # type: ignore[union-attr]
    assert engine.loads == ["a"]
    assert residency.state("a") == (ModelState.FAILED, "OSError: a: corrupt weights")
    with pytest.raises(APIError) as backing_off:
        asyncio.run(_use(residency, "a"))
    assert backing_off.value.code == "model_load_failed" and engine.loads == ["a"]  # no new load
    clock.now_s += 5
    engine.fail.clear()
    asyncio.run(_use(residency, "a"))
    assert engine.loads == ["a", "a"] and residency.state("a")[0] is ModelState.LOADED


def test_the_least_recently_used_model_makes_room_and_pins_stay() -> None:
    engine = FakeEngine(_config({"name": "a"}, {"name": "b"}, {"name": "c"}, {"name": "p", "pinned": True}, budget_bytes=350 * MB))
    clock = Clock()
    residency = _residency(engine, clock)
    for name in ("p", "a", "b", "a"):  # LRU: p (pinned), b, a
        clock.now_s += 1
        asyncio.run(_use(residency, name))
    clock.now_s += 1
    asyncio.run(_use(residency, "c"))
    assert engine.unloads == ["b"] and sorted(engine.models) == ["a", "c", "p"]
    assert residency.resident_bytes() == dict.fromkeys(("a", "c", "p"), WEIGHT_BYTES)


def test_a_busy_model_is_evicted_after_idle_ones_and_only_once_idle() -> None:
    engine = FakeEngine(_config({"name": "a"}, {"name": "b"}, {"name": "c"}, budget_bytes=250 * MB))
    clock = Clock()
    residency = _residency(engine, clock)
    for name in ("a", "b"):
        clock.now_s += 1
        asyncio.run(_use(residency, name))
    engine.models["a"].num_running = 1  # a is older but busy: b goes
    asyncio.run(_use(residency, "c"))
    assert engine.unloads == ["b"]


def test_a_model_over_the_budget_alone_is_refused_at_once() -> None:
    engine = FakeEngine(_config({"name": "a"}, budget_bytes=50 * MB))
    with pytest.raises(APIError) as refused:
        asyncio.run(_use(_residency(engine), "a"))
    assert refused.value.code == "model_too_large" and str(WEIGHT_BYTES) in refused.value.message
    assert engine.loads == []


def test_memory_held_by_pinned_models_is_insufficient_memory() -> None:
    engine = FakeEngine(_config({"name": "p", "pinned": True}, {"name": "a"}, budget_bytes=150 * MB))
    residency = _residency(engine)
    asyncio.run(_use(residency, "p"))
    with pytest.raises(APIError) as refused:
        asyncio.run(_use(residency, "a"))
    error = refused.value
    assert error.status_code == 503 and error.code == "insufficient_memory" and error.headers and "Retry-After" in error.headers
    assert engine.unloads == []


def test_unknown_models_and_wrong_tasks_are_refused_before_any_load() -> None:
    engine = FakeEngine(_config({"name": "a"}))
    residency = _residency(engine)
    with pytest.raises(APIError) as unknown:
        residency.model_config("nope", "embed")
    assert unknown.value.status_code == 404
    with pytest.raises(APIError) as wrong:
        residency.model_config("a", "generate")
    assert wrong.value.status_code == 400 and wrong.value.code == "wrong_task"
    assert engine.loads == []


def test_budgets_by_scope_default_to_80_percent_of_ram() -> None:
    config = _config({"name": "a"}).model_copy(update={"memory_budget_bytes": None})
    assert memory.budgets_by_scope(config, 10_000) == {memory.GATEWAY_SCOPE: 8_000}


def test_a_model_idle_past_its_idle_unload_s_is_unloaded_and_a_pinned_one_stays() -> None:
    engine = FakeEngine(_config({"name": "a", "idle_unload_s": 0.1}, {"name": "p", "pinned": True, "idle_unload_s": 0.1}))
    clock = Clock()
    residency = _residency(engine, clock)

    async def run() -> None:
        await _use(residency, "a")
        await _use(residency, "p")
        residency.start()
        clock.now_s += 0.05
        await asyncio.sleep(0)
        assert engine.unloads == []  # not idle long enough yet
        clock.now_s += 1
        await _until(lambda: engine.unloads == ["a"])
        await residency.stop()

    asyncio.run(run())
    assert residency.state("a")[0] is ModelState.UNLOADED and residency.state("p")[0] is ModelState.LOADED


def test_pinned_models_loaded_at_start_over_the_budget_fail_the_start() -> None:
    engine = FakeEngine(_config({"name": "a", "load": "at_start"}, {"name": "b", "load": "at_start"}, budget_bytes=150 * MB))
    for name in ("a", "b"):
        engine.models[name] = FakeServed(next(m for m in engine.config.models if m.name == name))
        engine.weight_bytes[name] = WEIGHT_BYTES
    residency = _residency(engine)

    async def run() -> None:
        residency.start()

    with pytest.raises(ConfigError) as refused:
        asyncio.run(run())
    assert refused.value.code == "model_too_large" and "200000000" in str(refused.value)


class CountingObserver:
    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []

    def observe_model_load(self, model: str, outcome: str, duration_s: float) -> None:
        self.events.append(("load", model, outcome))

    def observe_model_eviction(self, model: str, reason: str) -> None:
        self.events.append(("eviction", model, reason))

    def observe_load_refusal(self, model: str) -> None:
        self.events.append(("refusal", model))


def test_loads_evictions_and_refusals_reach_the_observer() -> None:
    engine = FakeEngine(_config({"name": "a"}, {"name": "b"}, budget_bytes=150 * MB))
    observer = CountingObserver()
    residency = Residency(engine, observer, clock=Clock(), physical_memory_bytes=10**12)  # type: ignore[arg-type]
    residency._estimate_weight_bytes = lambda model: WEIGHT_BYTES  # type: ignore[method-assign]

    async def run() -> None:
        await _use(residency, "a")
        await _use(residency, "b")  # evicts a
        engine.gate.clear()
        waits = [asyncio.ensure_future(_use(residency, "a")) for _ in range(4)]
        await _until(lambda: engine.loads.count("a") == 2)
        with pytest.raises(APIError):
            await _use(residency, "a")  # a fifth waiter: 429
        engine.gate.set()
        await asyncio.gather(*waits)

    asyncio.run(run())
    assert observer.events == [
        ("load", "a", "ok"), ("eviction", "a", "lru"), ("load", "b", "ok"), ("eviction", "b", "lru"), ("refusal", "a"),
        ("load", "a", "ok"),
    ]


def test_a_model_refused_for_memory_is_unloaded_without_a_reason() -> None:
    engine = FakeEngine(_config({"name": "p", "pinned": True}, {"name": "a"}, budget_bytes=150 * MB))
    residency = _residency(engine)
    asyncio.run(_use(residency, "p"))
    with pytest.raises(APIError):
        asyncio.run(_use(residency, "a"))
    assert residency.state("a") == (ModelState.UNLOADED, None)
