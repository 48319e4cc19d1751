"""LoRA adapters as model ids against a real server: ``/v1/models`` lists them with their
``parent``, the admin API and vLLM's endpoints add and remove them, every folder Sluice cannot
serve is refused naming the field, ``adapters_dir`` folders are served by name, and at most
``max_cpu_loras`` adapters stay read in memory."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from models.source import default_cache_dir, model_folder
from tests.e2e.conftest import ADMIN_TOKEN, EMBED_MODEL, GENERATE_MODEL, Server, async_wait_for
from tests.lora_adapters import write_peft_adapter
from tests.tiny_models import SMOLLM2_SOURCE, write_tiny_llama

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
BASE = GENERATE_MODEL
ADAPTERS = f"/admin/models/{BASE}/adapters"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One real adapter of SmolLM2 (rank 4 on q_proj and v_proj), an adapters_dir holding a copy
    of it and a broken one, and an adapter of another base (a tiny Llama)."""
    root = tmp_path_factory.mktemp("lora")
    adapter = write_peft_adapter(model_folder(SMOLLM2_SOURCE, default_cache_dir()), root / "good", rank=4, seed=3,
                                 target_modules=("q_proj", "v_proj"))
    shutil.copytree(adapter, root / "dir" / "dir-lora")
    broken = shutil.copytree(adapter, root / "dir" / "dir-broken")
    _edit(broken, use_dora=True)
    other = write_peft_adapter(write_tiny_llama(root / "tiny"), root / "other", rank=4, target_modules=("q_proj",))
    return {"good": adapter, "dir": root / "dir", "other": other, "root": root}


@pytest.fixture(scope="module")
def server(server_with: Callable[..., Server], folders: dict[str, Path]) -> Server:
    def edit(config: dict[str, Any]) -> None:
        config["models"][0]["lora"] = {
            "adapters": [{"name": "cfg-lora", "path": str(folders["good"])}],
            "adapters_dir": str(folders["dir"]), "max_loras": 2, "max_cpu_loras": 2,
        }
    return server_with(edit, {"SLUICE_ADMIN_TOKEN": ADMIN_TOKEN})


def _edit(folder: Path, **changes: Any) -> Path:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


def _copy(folders: dict[str, Path], name: str, **changes: Any) -> Path:
    return _edit(shutil.copytree(folders["good"], folders["root"] / name), **changes)


def _ids(server: Server) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]}


def _add(server: Server, name: str, path: Path | str) -> httpx.Response:
    return httpx.post(f"{server.url}{ADAPTERS}", json={"name": name, "path": str(path)}, headers=AUTH, timeout=60)


def _remove(server: Server, name: str) -> httpx.Response:
    return httpx.delete(f"{server.url}{ADAPTERS}/{name}", headers=AUTH, timeout=60)


def _error(response: httpx.Response) -> dict[str, Any]:
    return response.json()["error"]  # type: ignore[no-any-return]


def test_models_lists_configured_and_adapters_dir_adapters_with_their_parent(server: Server, folders: dict[str, Path]) -> None:
    ids = _ids(server)
    assert ids["cfg-lora"]["parent"] == BASE and ids["cfg-lora"]["root"] == str(folders["good"])
    assert ids["dir-lora"]["parent"] == BASE and ids["dir-lora"]["root"] == str(folders["dir"] / "dir-lora")
    assert "parent" not in ids[BASE]
    one = httpx.get(f"{server.url}/v1/models/dir-lora", timeout=30).json()
    assert (one["id"], one["parent"], one["max_model_len"]) == ("dir-lora", BASE, ids[BASE]["max_model_len"])


def test_an_unknown_adapter_is_404_and_an_adapter_does_not_embed(server: Server) -> None:
    unknown = httpx.post(f"{server.url}/v1/completions", json={"model": "no-such-lora", "prompt": "hi"}, timeout=30)
    assert unknown.status_code == 404 and _error(unknown)["param"] == "model"
    embed = httpx.post(f"{server.url}/v1/embeddings", json={"model": "cfg-lora", "input": "hi"}, timeout=30)
    assert embed.status_code == 400 and _error(embed)["code"] == "wrong_task" and _error(embed)["param"] == "model"


def test_a_broken_adapters_dir_folder_is_a_400_naming_model_on_first_use(server: Server) -> None:
    response = httpx.post(f"{server.url}/v1/completions", json={"model": "dir-broken", "prompt": "hi", "max_tokens": 1}, timeout=60)
    assert response.status_code == 400, response.text
    assert _error(response)["param"] == "model" and "use_dora" in _error(response)["message"]


def test_admin_adds_lists_and_removes_an_adapter(server: Server, folders: dict[str, Path]) -> None:
    added = _add(server, "added-lora", folders["good"])
    assert added.status_code == 201, added.text
    assert added.json() == {"id": "added-lora", "root": str(folders["good"]), "parent": BASE, "origin": "admin"}
    assert _ids(server)["added-lora"]["parent"] == BASE
    clash = _add(server, "added-lora", folders["good"])
    assert clash.status_code == 409 and _error(clash)["param"] == "name"
    assert _add(server, EMBED_MODEL, folders["good"]).status_code == 409
    removed = _remove(server, "added-lora")
    assert removed.status_code == 200 and removed.json()["state"] == "removed"
    assert "added-lora" not in _ids(server)
    assert httpx.get(f"{server.url}/v1/models/added-lora", timeout=30).status_code == 404
    assert _remove(server, "added-lora").status_code == 404


def test_admin_adapter_calls_need_the_token_and_a_lora_base(server: Server, folders: dict[str, Path]) -> None:
    body = {"name": "x-lora", "path": str(folders["good"])}
    assert httpx.post(f"{server.url}{ADAPTERS}", json=body, timeout=30).status_code == 401
    for base in ("no-such-model", EMBED_MODEL):
        response = httpx.post(f"{server.url}/admin/models/{base}/adapters", json=body, headers=AUTH, timeout=30)
        assert response.status_code == 404, response.text
    extra = httpx.post(f"{server.url}{ADAPTERS}", json={**body, "scaling": 2}, headers=AUTH, timeout=30)
    assert extra.status_code == 400 and _error(extra)["param"] == "scaling"
    missing = httpx.post(f"{server.url}{ADAPTERS}", json={"name": "x-lora"}, headers=AUTH, timeout=30)
    assert missing.status_code == 400 and _error(missing)["param"] == "path"


@pytest.mark.parametrize("name, changes, words", [
    ("bad-peft", {"peft_type": "IA3"}, "peft_type"),
    ("bad-dora", {"use_dora": True}, "use_dora"),
    ("bad-bias", {"bias": "all"}, "bias"),
    ("bad-fan", {"fan_in_fan_out": True}, "fan_in_fan_out"),
    ("bad-pattern", {"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ("bad-layers", {"layers_to_transform": [0]}, "layers_to_transform"),
    ("bad-save", {"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ("bad-target", {"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
    ("bad-rank", {"r": 32}, "max_lora_rank of 16"),
])
def test_a_folder_sluice_cannot_serve_is_refused_naming_path(
    server: Server, folders: dict[str, Path], name: str, changes: dict[str, Any], words: str
) -> None:
    response = _add(server, name, _copy(folders, name, **changes))
    assert response.status_code == 400, response.text
    assert _error(response)["param"] == "path" and words in _error(response)["message"]
    assert name not in _ids(server)


def test_missing_files_and_another_base_are_refused_naming_path(server: Server, folders: dict[str, Path]) -> None:
    binary = folders["root"] / "bin-only"
    binary.mkdir()
    shutil.copy(folders["good"] / "adapter_config.json", binary)
    (binary / "adapter_model.bin").write_bytes(b"pickle")
    cases = [("gone", folders["root"] / "absent", "no adapter folder"), ("bin-only", binary, "safetensors"),
             ("other-base", folders["other"], "base architecture or shapes do not match")]
    for name, path, words in cases:
        response = _add(server, name, path)
        assert response.status_code == 400 and _error(response)["param"] == "path", response.text
        assert words in _error(response)["message"]
        assert name not in _ids(server)


def test_vllm_load_and_unload_lora_adapter(server: Server, folders: dict[str, Path]) -> None:
    url = server.url
    body = {"lora_name": "vllm-lora", "lora_path": str(folders["good"])}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=30).status_code == 401
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=AUTH, timeout=60)
    assert loaded.status_code == 200 and "vllm-lora" in loaded.text
    assert _ids(server)["vllm-lora"]["parent"] == BASE
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=AUTH, timeout=60)
    assert again.status_code == 409 and _error(again)["param"] == "lora_name"
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={**body, "lora_name": "v2", "lora_path": str(folders["other"])},
                     headers=AUTH, timeout=60)
    assert bad.status_code == 400 and _error(bad)["param"] == "lora_path"
    inplace = httpx.post(f"{url}/v1/load_lora_adapter", json={**body, "load_inplace": True}, headers=AUTH, timeout=30)
    assert inplace.status_code == 400 and _error(inplace)["param"] == "load_inplace"
    by_id = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "vllm-lora", "lora_int_id": 1}, headers=AUTH, timeout=30)
    assert by_id.status_code == 400 and _error(by_id)["param"] == "lora_int_id"
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "vllm-lora"}, headers=AUTH, timeout=60)
    assert unloaded.status_code == 200 and "vllm-lora" not in _ids(server)
    unknown = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "vllm-lora"}, headers=AUTH, timeout=30)
    assert unknown.status_code == 404 and _error(unknown)["param"] == "lora_name"
    wrong_base = httpx.post(f"{url}/v1/load_lora_adapter", json={**body, "base_model_name": EMBED_MODEL}, headers=AUTH, timeout=30)
    assert wrong_base.status_code == 404


def test_at_most_max_cpu_loras_adapters_stay_in_memory_least_recently_used_dropped(server: Server, folders: dict[str, Path]) -> None:
    names = ["lru-a", "lru-b", "lru-c"]
    try:
        for name in names:
            assert _add(server, name, folders["good"]).status_code == 201
        listing = httpx.get(f"{server.url}/admin/models", headers=AUTH, timeout=30).json()["models"]
        stats = next(m for m in listing if m["name"] == BASE)["lora"]
        assert stats["loaded"] == ["lru-b", "lru-c"] and stats["max_cpu_loras"] == 2
        one_adapter_bytes = 30 * 4 * (576 + 576 + 576 + 192) * 4  # layers x r x (q: A, B; v: A, B features) x float32
        assert stats["loaded_bytes"] == 2 * one_adapter_bytes
        assert {"lru-a", "lru-b", "lru-c"} <= set(_ids(server))  # evicted from memory, still served
    finally:
        for name in names:
            _remove(server, name)


def test_a_completion_with_an_adapter_id_runs_on_its_base_with_the_adapter(server: Server) -> None:
    """Smoke only (greedy equality with PEFT is tests of the runner's): the adapter changes the
    base's greedy text, and two ids of one folder (configured, adapters_dir) write the same."""
    texts = {}
    for name in ("cfg-lora", "dir-lora", BASE):
        body = {"model": name, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8 and response.json()["model"] == name
        texts[name] = response.json()["choices"][0]["text"]
    assert texts["cfg-lora"] == texts["dir-lora"] != texts[BASE], texts


def test_tokenize_takes_an_adapter_id_with_its_bases_tokenizer(server: Server) -> None:
    tokens = {name: httpx.post(f"{server.url}/tokenize", json={"model": name, "prompt": "hello"}, timeout=30).json()["tokens"]
              for name in ("cfg-lora", BASE)}
    assert tokens["cfg-lora"] == tokens[BASE]


def test_removing_an_adapter_refuses_it_at_once_and_lets_its_stream_finish(server: Server, folders: dict[str, Path]) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            assert (await client.post(ADAPTERS, json={"name": "drain-lora", "path": str(folders["good"])}, headers=AUTH)).status_code == 201
            body = {"model": "drain-lora", "prompt": "Count to a thousand:", "max_tokens": 96, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as stream:
                assert stream.status_code == 200
                lines = stream.aiter_lines()
                first = await anext(lines)
                assert first.startswith("data: ") and json.loads(first.removeprefix("data: "))["model"] == "drain-lora"
                removal = asyncio.ensure_future(client.delete(f"{ADAPTERS}/drain-lora", headers=AUTH))

                async def refused() -> bool:
                    return (await client.get("/v1/models/drain-lora")).status_code == 404
                await async_wait_for(refused, 30, "drain-lora refused while it drains")
                again = await client.post("/v1/completions", json={**body, "stream": False})
                assert again.status_code == 404 and not removal.done()
                rest = [line async for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            assert (await removal).status_code == 200
            stats = (await client.get(ADAPTERS, headers=AUTH)).json()
            assert "drain-lora" not in stats["stats"]["loaded"] and not stats["stats"]["in_flight"]

    asyncio.run(main())


def test_a_model_added_under_an_adapters_name_is_refused_and_models_are_listed_once(server: Server, folders: dict[str, Path]) -> None:
    assert _add(server, "taken-lora", folders["good"]).status_code == 201
    entry = {"name": "taken-lora", "source": SMOLLM2_SOURCE, "task": "generate", "max_model_len": 64, "load": "on_demand",
             "buckets": [{"max_input_tokens": 64, "slice": "cpu0", "batcher": {"kind": "continuous", "max_num_seqs": 2}}]}
    clash = httpx.post(f"{server.url}/admin/models", json=entry, headers=AUTH, timeout=60)
    assert clash.status_code == 409 and _error(clash)["param"] == "name", clash.text
    listed = [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]]
    assert listed.count("taken-lora") == 1 and len(listed) == len(set(listed))
    assert _remove(server, "taken-lora").status_code == 200


def test_a_404_of_the_adapter_calls_is_a_not_found_error_as_every_other_404(server: Server) -> None:
    unknown_base = httpx.post(f"{server.url}/admin/models/no-such-model/adapters", json={"name": "x", "path": "/x"}, headers=AUTH, timeout=30)
    unknown_adapter = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "no-such-lora"}, headers=AUTH, timeout=30)
    unknown_model = httpx.post(f"{server.url}/v1/completions", json={"model": "no-such-lora", "prompt": "x"}, timeout=30)
    for response in (unknown_base, unknown_adapter, unknown_model):
        assert response.status_code == 404 and _error(response)["type"] == "not_found_error", response.text
