"""gateway.memory with plain numbers (KV blocks and capacity, budgets, weight bytes), and
gateway.build computing a bucket's KV capacity the same way whatever slice it runs on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from buckets.slices.process import ProcessSlice
from buckets.slices.thread import ThreadSlice
from gateway import memory
from gateway.build import BucketBuilder
from gateway.config import GateConfig, GatewayConfig, parse_config
from gateway.errors import ConfigError
from models.kv_cache import KVShape

GiB = 1024**3


def config_with(slices: list[dict[str, Any]], buckets: list[dict[str, Any]]) -> GatewayConfig:
    return parse_config({
        "slices": slices,
        "models": [{"name": "gen", "source": "/models/gen", "task": "generate", "max_model_len": buckets[-1]["max_input_tokens"], "buckets": buckets}],
    })


def continuous(max_input_tokens: int, slice_name: str = "s", **batcher: Any) -> dict[str, Any]:
    return {"max_input_tokens": max_input_tokens, "slice": slice_name,
            "batcher": {"kind": "continuous", "max_num_batched_tokens": 256, **batcher}}


def test_blocks_are_the_share_over_a_block_of_tokens() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, float32: 2 * 30 * 3 * 64 * 4 = 46,080 bytes a token.
    bytes_per_token = KVShape(num_layers=30, num_kv_heads=3, head_dim=64).bytes_per_token(4)
    assert bytes_per_token == 46_080
    num_blocks = memory.kv_num_blocks(64 * 1024**2, 16, bytes_per_token, "models.gen.buckets.le128")
    assert num_blocks == 64 * 1024**2 // (16 * 46_080) == 91
    assert memory.kv_capacity_tokens(num_blocks, 16) == 1456


def test_a_share_that_holds_no_block_names_the_bucket() -> None:
    with pytest.raises(ConfigError, match="models.gen.buckets.le64: 1000 bytes of KV memory hold no block of 16 tokens"):
        memory.kv_num_blocks(1000, 16, 100, "models.gen.buckets.le64")
    assert memory.kv_num_blocks(1600, 16, 100, "x") == 1


def test_fixed_shares_come_first_then_fractions_then_equal_parts_of_the_rest() -> None:
    config = config_with(
        [{"name": "s", "kv_cache_memory_bytes": 1000}],
        [continuous(16, kv_cache_memory_bytes=100), continuous(32, kv_cache_memory_fraction=0.5), continuous(64), continuous(128)],
    )
    shares = memory.split_kv_memory(config, {"s": 1000})
    assert shares == {("gen", "le16"): 100, ("gen", "le32"): 500, ("gen", "le64"): 200, ("gen", "le128"): 200}


def test_shares_over_the_budget_are_a_config_error() -> None:
    config = config_with([{"name": "s", "kv_cache_memory_bytes": 1000}], [continuous(16, kv_cache_memory_bytes=600), continuous(32)])
    with pytest.raises(ConfigError, match=r"slices\.0\.kv_cache_memory_bytes") as caught:
        memory.split_kv_memory(config, {"s": 500})
    assert caught.value.code == "kv_cache_memory_exceeded"


def test_default_budgets_two_gib_on_a_cpu_half_a_gpu() -> None:
    assert memory.default_kv_cache_memory_bytes("cpu", None) == 2 * GiB
    assert memory.default_kv_cache_memory_bytes("cuda:0", 80 * GiB) == 40 * GiB
    config = config_with([{"name": "s"}, {"name": "t", "kv_cache_memory_bytes": 1000}], [continuous(16), continuous(32, "t")])
    assert memory.slice_kv_budgets(config, {}) == {"s": 2 * GiB, "t": 1000}


@dataclass
class Tensor:
    num_elements: int
    bytes_per_element: int

    def numel(self) -> int:
        return self.num_elements

    def element_size(self) -> int:
        return self.bytes_per_element


def test_weight_bytes_count_parameters_and_buffers() -> None:
    module = SimpleNamespace(parameters=lambda: [Tensor(10, 4), Tensor(3, 2)], buffers=lambda: [Tensor(5, 1)])
    assert memory.weight_bytes(module) == 40 + 6 + 5


# -- one KV capacity, whatever the slice ---------------------------------------------------------


def light_model() -> Any:
    """What build reads of a model loaded without weights: its KV geometry and dtype."""
    return SimpleNamespace(kv_shape=lambda: KVShape(num_layers=2, num_kv_heads=1, head_dim=8), dtype_bytes=4, model=None)


def test_a_bucket_has_the_same_kv_capacity_on_a_thread_and_a_process_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    config = config_with([{"name": "s", "kv_cache_memory_bytes": 64 * 1024}], [continuous(16)])
    model, bucket_config = config.models[0], config.models[0].buckets[0]
    shares = memory.split_kv_memory(config, {"s": 64 * 1024})
    builder = BucketBuilder(cache_dir=Path("/nonexistent"), gate=GateConfig(), kv_memory_bytes=shares)
    built: list[int] = []
    monkeypatch.setattr(BucketBuilder, "_continuous", lambda self, *args: built.append(args[3]) or SimpleNamespace())
    on_thread = builder.bucket(model, light_model(), bucket_config, ThreadSlice("s", "cpu", 1))
    on_process = builder.bucket(model, light_model(), bucket_config, ProcessSlice("s", "cpu", 1, print, lambda: ()))
    # 64 KiB over 16-token blocks of 2 * 2 * 1 * 8 * 4 = 128 bytes a token: 32 blocks, 512 tokens.
    assert on_thread.kv_capacity_tokens == on_process.kv_capacity_tokens == 512
    assert built == [32]  # the thread slice built its batcher over 32 blocks; the process slice built none
    assert on_process.backend_info == {"configured": bucket_config.backend, "isolation": "process"}


@pytest.mark.parametrize("kv_cache_dtype, num_blocks", [("bfloat16", 64), ("int8", 85)])
def test_a_buckets_kv_cache_dtype_sets_its_blocks_scales_included(
    monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str, num_blocks: int
) -> None:
    config = config_with([{"name": "s", "kv_cache_memory_bytes": 64 * 1024}], [continuous(16) | {"kv_cache_dtype": kv_cache_dtype}])
    builder = BucketBuilder(cache_dir=Path("/nonexistent"), gate=GateConfig(), kv_memory_bytes=memory.split_kv_memory(config, {"s": 64 * 1024}))
    built: list[int] = []
    monkeypatch.setattr(BucketBuilder, "_continuous", lambda self, *args: built.append(args[3]) or SimpleNamespace())
    bucket = builder.bucket(config.models[0], light_model(), config.models[0].buckets[0], ThreadSlice("s", "cpu", 1))
    # A token: 2 * 2 layers * 1 kv head * 8 * 2 = 64 bytes in bfloat16; 2 * 2 * 1 * (8 + 4) = 48 in int8.
    assert built == [num_blocks] and bucket.kv_capacity_tokens == num_blocks * 16


def test_pools_still_draining_count_against_a_slices_memory_budget() -> None:
    config = config_with(
        [{"name": "s", "device": "cpu", "num_threads": 1, "kv_cache_memory_bytes": GiB, "memory_budget_bytes": 3 * GiB}],
        [continuous(128)],
    )
    kv_bytes = memory.split_kv_memory(config, {"s": GiB})
    weights = {"gen": GiB // 2}
    memory.check_slice_budgets(config, kv_bytes, weights, {"s": GiB + GiB // 2})  # 0.5 + 1 + 1.5 GiB: exactly the budget
    with pytest.raises(ConfigError) as over:
        memory.check_slice_budgets(config, kv_bytes, weights, {"s": GiB + GiB // 2 + 1})
    assert over.value.code == "memory_budget_exceeded" and over.value.param == "slices.0.memory_budget_bytes"
    assert f"needs {3 * GiB + 1} bytes" in str(over.value) and f"still draining {GiB + GiB // 2 + 1}" in str(over.value)
    memory.check_slice_budgets(config, kv_bytes, weights, {"other-slice": 10 * GiB})  # another slice's pools


def test_rebuilding_a_bucket_counts_its_old_pool_while_it_drains() -> None:
    from buckets.bucket import Bucket, BucketTable
    from gateway.engine import Engine, ServedModel

    config = config_with(
        [{"name": "s", "device": "cpu", "num_threads": 1, "kv_cache_memory_bytes": GiB, "memory_budget_bytes": 3 * GiB // 2}],
        [continuous(128)],
    )
    engine = Engine(config)
    old = Bucket(name="le128", model_name="gen", max_input_tokens=128, device_slice=engine.slices["s"], kind="continuous")
    engine.models["gen"] = ServedModel(config=config.models[0], loaded=None, table=BucketTable([old]))  # type: ignore[arg-type]
    engine.kv_pool_bytes[old.key] = ("s", GiB)  # as built: the whole slice's KV memory
    with pytest.raises(ConfigError) as refused:  # 1 GiB new + 1 GiB old > 1.5 GiB
        engine.rebuild_bucket("gen", "le128")
    assert refused.value.code == "memory_budget_exceeded"
    assert f"needs {2 * GiB} bytes" in str(refused.value) and f"still draining {GiB}" in str(refused.value)
    assert engine.models["gen"].table.buckets == [old] and not old.closed  # nothing changed
