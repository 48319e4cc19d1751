"""gateway.adapters: one read per adapter however many requests wait, a new adapter_id per read,
at most max_cpu_loras read (least recently used dropped, idle before busy), and a removal that
refuses the name at once and waits for the requests holding it."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig

from gateway.adapters import AdapterRegistry, Adapters
from gateway.config import ModelConfig
from gateway.errors import APIError
from models.source import default_cache_dir, model_folder
from tests.lora_adapters import write_peft_adapter
from tests.tiny_models import write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama and an adapters folder holding three copies of one of its adapters."""
    root = tmp_path_factory.mktemp("adapters")
    base = write_tiny_llama(root / "base")
    adapter = write_peft_adapter(base, root / "one", rank=2, target_modules=("q_proj",))
    for name in ("a", "b", "c"):
        shutil.copytree(adapter, root / "dir" / name)
    return base, root / "dir"


def _model(base: Path, adapters_dir: Path, **lora: object) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "base", "source": str(base), "task": "generate", "max_model_len": 64,
        "buckets": [{"max_input_tokens": 64, "batcher": {"kind": "continuous"}, "slice": "cpu0"}],
        "lora": {"adapters_dir": str(adapters_dir), "max_loras": 1, **lora},
    })


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        self.now_s += 1.0
        return self.now_s


def _registry(tiny: tuple[Path, Path], reads: list[str], **lora: object) -> AdapterRegistry:
    base, adapters_dir = tiny

    def read_base_config() -> object:
        reads.append("base")
        return AutoConfig.from_pretrained(base)

    return AdapterRegistry(_model(base, adapters_dir, **lora), read_base_config, Clock())


def test_waiters_share_one_read_and_each_read_gets_a_new_adapter_id(tiny: tuple[Path, Path]) -> None:
    async def main() -> None:
        reads: list[str] = []
        registry = _registry(tiny, reads)
        entry = registry.find("a")
        assert entry is not None and entry.origin == "adapters_dir"
        leases = await asyncio.gather(*(registry.lease(entry) for _ in range(4)))
        assert len({id(lease.lora) for lease in leases}) == 1 and reads == ["base"]
        assert entry.num_in_flight == 4
        other = await registry.lease(registry.find("b"))  # type: ignore[arg-type]
        assert other.lora.adapter_id != leases[0].lora.adapter_id
        for lease in [*leases, *leases]:  # idempotent
            lease.release()
        assert entry.num_in_flight == 0

    asyncio.run(main())


def test_at_most_max_cpu_loras_stay_read_idle_before_busy(tiny: tuple[Path, Path]) -> None:
    async def main() -> None:
        registry = _registry(tiny, [], max_cpu_loras=2)
        a = await registry.lease(registry.find("a"))  # type: ignore[arg-type]
        (await registry.lease(registry.find("b"))).release()  # type: ignore[arg-type]
        await registry.lease(registry.find("c"))  # type: ignore[arg-type]
        assert registry.stats()["loaded"] == ["a", "c"]  # b idle, a busy (older)
        a.release()
        again = await registry.lease(registry.find("b"))  # type: ignore[arg-type]
        assert registry.stats()["loaded"] == ["c", "b"] and again.lora.name == "b"

    asyncio.run(main())


def test_removal_refuses_the_name_at_once_and_waits_for_its_requests(tiny: tuple[Path, Path]) -> None:
    async def main() -> None:
        registry = _registry(tiny, [])
        lease = await registry.lease(registry.find("a"))  # type: ignore[arg-type]
        removal = asyncio.ensure_future(registry.remove("a"))
        await asyncio.sleep(0)
        assert registry.find("a") is None and not removal.done()
        lease.release()
        await asyncio.wait_for(removal, 5)
        assert "a" not in registry.stats()["loaded"]
        assert registry.find("a") is not None  # its folder is still there: read again on use
        with pytest.raises(APIError) as caught:
            await registry.remove("zzz")
        assert caught.value.status_code == 404

    asyncio.run(main())


def test_an_unreadable_adapter_is_a_400_naming_model(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    async def main() -> None:
        base, _ = tiny
        registry = AdapterRegistry(
            _model(base, tmp_path, max_lora_rank=1), lambda: AutoConfig.from_pretrained(base)
        )
        shutil.copytree(tiny[1] / "a", tmp_path / "big")
        with pytest.raises(APIError) as caught:
            await registry.lease(registry.find("big"))  # type: ignore[arg-type]
        assert (caught.value.status_code, caught.value.param) == (400, "model") and "max_lora_rank" in caught.value.message

    asyncio.run(main())


def test_models_win_over_adapter_folders_and_embedding_is_refused(tiny: tuple[Path, Path]) -> None:
    async def main() -> None:
        base, adapters_dir = tiny
        models = [_model(base, adapters_dir), _model(base, adapters_dir).model_copy(update={"name": "a", "lora": None})]
        adapters = Adapters(lambda: models, lambda m: AutoConfig.from_pretrained(model_folder(m.source, default_cache_dir())))
        assert adapters.find("a") is None and adapters.find("b") is not None
        assert await adapters.lease("base", "generate") is None
        with pytest.raises(APIError) as caught:
            await adapters.lease("b", "embed")
        assert caught.value.code == "wrong_task"
        found = await adapters.lease("c", "generate")
        assert found is not None and found[0] == "base" and found[1].lora.name == "c"

    asyncio.run(main())


def test_a_removal_past_its_timeout_forgets_the_adapter_its_requests_keep_their_weights(tiny: tuple[Path, Path]) -> None:
    async def main() -> None:
        registry = _registry(tiny, [])
        lease = await registry.lease(registry.find("a"))  # type: ignore[arg-type]
        entry = await registry.remove("a", timeout_s=0.01)
        assert entry.num_in_flight == 1 and "a" not in registry.known and "a" not in registry.stats()["loaded"]
        assert lease.lora.weights.nbytes > 0
        lease.release()

    asyncio.run(main())


def test_configured_adapter_folders_are_checked_at_start(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    from gateway.adapters import check_adapter_folders
    from gateway.config import GatewayConfig
    from gateway.errors import ConfigError

    base, adapters_dir = tiny
    model = _model(base, adapters_dir).model_dump()
    model["lora"]["adapters"] = [{"name": "a", "path": str(adapters_dir / "a")}]
    data = {"slices": [{"name": "cpu0"}], "models": [model]}
    check_adapter_folders(GatewayConfig.model_validate(data))
    model["lora"]["adapters"].append({"name": "gone", "path": str(tmp_path / "gone")})
    with pytest.raises(ConfigError, match=r"models\.0\.lora\.adapters\.1\.path: .*gone has no adapter_config.json"):
        check_adapter_folders(GatewayConfig.model_validate(data))
    model["lora"].update(adapters=[], adapters_dir=str(tmp_path / "none"))
    with pytest.raises(ConfigError, match=r"models\.0\.lora\.adapters_dir: .* is not a folder"):
        check_adapter_folders(GatewayConfig.model_validate(data))


def test_vllm_calls_need_base_model_name_when_two_models_serve_adapters(tiny: tuple[Path, Path]) -> None:
    from gateway.adapter_routes import _only_registry

    base, adapters_dir = tiny
    models = [_model(base, adapters_dir), _model(base, adapters_dir).model_copy(update={"name": "base2"})]
    adapters = Adapters(lambda: models, lambda m: None)
    with pytest.raises(APIError) as caught:
        _only_registry(adapters, None)
    assert (caught.value.status_code, caught.value.param) == (400, "base_model_name")
    assert _only_registry(adapters, "base2").base_name == "base2"
    assert _only_registry(Adapters(lambda: models[:1], lambda m: None), None).base_name == "base"


def test_concurrent_adds_of_one_name_register_one_and_refuse_the_others(tiny: tuple[Path, Path]) -> None:
    async def main() -> None:
        registry = _registry(tiny, [])
        folder = str(Path(tiny[1]) / "a")
        entries = await asyncio.gather(*(registry.add("dup", folder) for _ in range(4)))
        added = [e for e in entries if e is not None]
        assert len(added) == 1 and registry.known["dup"] is added[0]

    asyncio.run(main())


def test_a_read_finishing_after_its_adapter_was_removed_is_not_kept_nor_served_to_a_new_one(tiny: tuple[Path, Path]) -> None:
    async def main() -> None:
        registry = _registry(tiny, [])
        read, paths = registry.read, []

        async def counted_read(name: str, path: str) -> object:
            paths.append(path)
            return await read(name, path)

        registry.read = counted_read  # type: ignore[method-assign,assignment]
        old = registry.find("a")
        assert old is not None
        reading = asyncio.ensure_future(registry.lease(old))
        await asyncio.sleep(0)  # its read has started
        await registry.remove("a")
        new = registry.find("a")  # the folder again: a new entry
        assert new is not None and new is not old
        lease = await registry.lease(new)
        with pytest.raises(APIError):
            await reading  # the removed entry's request: 404
        assert registry._loaded["a"] is lease.lora and registry.stats()["loaded"] == ["a"]
        assert lease.entry is new and len(paths) == 2  # the new entry read its own weights

    asyncio.run(main())


def test_a_config_change_does_not_bring_back_a_removed_configured_adapter(tiny: tuple[Path, Path]) -> None:
    async def main() -> None:
        base, adapters_dir = tiny
        model = _model(base, adapters_dir)
        model = model.model_copy(update={"lora": model.lora.model_copy(update={"adapters": []})})  # type: ignore[union-attr]
        configured = ModelConfig.model_validate({**model.model_dump(), "lora": {
            **model.lora.model_dump(), "adapters": [{"name": "cfg", "path": str(adapters_dir / "a")}]}})  # type: ignore[union-attr]
        registry = AdapterRegistry(configured, lambda: AutoConfig.from_pretrained(base), Clock())
        await registry.remove("cfg")
        registry.update(configured.lora.model_copy(update={"max_cpu_loras": 5}))  # type: ignore[union-attr]
        assert registry.find("cfg") is None
        added = configured.lora.model_copy(update={"adapters": [*configured.lora.adapters,  # type: ignore[union-attr]
                                                                 configured.lora.adapters[0].model_copy(update={"name": "cfg2"})]})  # type: ignore[union-attr]
        registry.update(added)
        assert registry.find("cfg2") is not None and registry.find("cfg") is None

    asyncio.run(main())


def test_vllm_unload_takes_a_null_lora_int_id_and_refuses_a_number() -> None:
    from gateway.adapter_routes import UnloadLoraAdapterBody

    assert UnloadLoraAdapterBody.model_validate({"lora_name": "x", "lora_int_id": None}).lora_int_id is None
    assert UnloadLoraAdapterBody.model_validate({"lora_name": "x", "lora_int_id": 3}).lora_int_id == 3  # the route refuses it: 400
