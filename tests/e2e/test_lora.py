"""LoRA adapters served as model ids, batched together: each adapter's greedy output equals PEFT's
merged model, a burst mixing adapters and the base equals each request alone with no step over
``max_loras`` adapters, and the prefix cache keeps adapters apart. (Adding, removing, draining,
the LRU and bad adapters: ``test_lora_admin.py``.)

One gateway of its own: SmolLM2 with two buckets, the short one on ``lean-int4`` and the long
one on ``eager``, so both backends apply adapters; ``max_loras`` 2 against four adapters.
Adapters are made here (``tests/lora_adapters.py``): random non-zero ``A`` and ``B`` of ranks 4,
8 and 16 on all seven projections, and one on ``q_proj``/``v_proj`` only, found in
``adapters_dir`` and loaded on first use.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from models.source import default_cache_dir, model_folder
from tests.e2e.conftest import GENERATE_MODEL, Server, run_server_process
from tests.e2e.reference import assert_greedy_close, greedy_reference
from tests.lora_adapters import merged_model, write_peft_adapter
from tests.tiny_models import SMOLLM2_SOURCE

BASE = GENERATE_MODEL
MAX_LORAS = 2
MAX_TOKENS = 10
# name -> (rank, seed, target modules or None for all seven); the last lives in adapters_dir.
ADAPTERS = {"lora-r4": (4, 1, None), "lora-r8": (8, 2, None), "lora-r16": (16, 3, None)}
DIR_ADAPTERS = {"lora-qv": (8, 4, ("q_proj", "v_proj"))}
PROMPTS = ("The three primary colors are", "Write one sentence about rivers:")
# Longer than the short bucket (48 tokens): runs on the eager bucket.
LONG_PROMPT = " ".join(["The old mill by the river ground flour for the whole valley every autumn."] * 5)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = model_folder(SMOLLM2_SOURCE, default_cache_dir())
    root = tmp_path_factory.mktemp("lora")
    folders = {}
    for name, (rank, seed, targets) in ADAPTERS.items():
        folders[name] = write_peft_adapter(base, root / "configured" / name, rank, seed, **({"target_modules": targets} if targets else {}))
    for name, (rank, seed, targets) in DIR_ADAPTERS.items():
        folders[name] = write_peft_adapter(base, root / "dir" / name, rank, seed, **({"target_modules": targets} if targets else {}))
    return folders


@pytest.fixture(scope="module")
def server(adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("lora-server")
    batcher = {"kind": "continuous", "max_num_seqs": 16, "max_num_batched_tokens": 256}
    config = {
        "slices": [{"name": "cpu0", "device": "cpu", "num_threads": 1, "kv_cache_memory_bytes": "128MiB"}],
        "admin_allow_loopback_without_token": True,
        "models": [{
            "name": BASE, "source": SMOLLM2_SOURCE, "task": "generate", "max_model_len": 320,
            "buckets": [
                {"max_input_tokens": 48, "batcher": batcher, "slice": "cpu0", "backend": "lean", "quantization": "int4"},
                {"max_input_tokens": 320, "batcher": batcher, "slice": "cpu0"},
            ],
            "lora": {
                "adapters": [{"name": name, "path": str(adapters[name])} for name in ADAPTERS],
                "adapters_dir": str(adapters["lora-qv"].parent),
                "max_loras": MAX_LORAS, "max_lora_rank": 16, "max_cpu_loras": 4,
            },
        }],
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    log_path = folder / "server.log"
    with run_server_process(path, log_path) as (url, proc):
        yield Server(url, proc, log_path)


@pytest.fixture(scope="module")
def references(adapters: dict[str, Path]) -> dict[str, Any]:
    """The base model and each adapter merged into it (PEFT's ``merge_and_unload``)."""
    from transformers import AutoModelForCausalLM

    base = model_folder(SMOLLM2_SOURCE, default_cache_dir())
    models: dict[str, Any] = {BASE: AutoModelForCausalLM.from_pretrained(base).eval()}
    for name in (*ADAPTERS, "lora-qv"):
        models[name] = merged_model(base, adapters[name])
    return models


def _complete(server: Server, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return {"prompt_token_ids": choice["prompt_token_ids"], "token_ids": choice["token_ids"]}


def _stats(server: Server) -> dict[str, dict[str, Any]]:
    stats: dict[str, dict[str, Any]] = httpx.get(f"{server.url}/stats", timeout=30).json()[BASE]
    return stats


def test_each_adapter_equals_the_peft_merged_model_on_both_backends(server: Server, references: dict[str, Any]) -> None:
    outputs: dict[str, list[list[int]]] = {}
    for name, model in references.items():  # base, three configured adapters, one from adapters_dir
        for prompt in (*PROMPTS, LONG_PROMPT):
            got = _complete(server, name, prompt)
            want = greedy_reference(model, got["prompt_token_ids"], MAX_TOKENS)
            assert_greedy_close(model, got["prompt_token_ids"], got["token_ids"], want)
            outputs.setdefault(name, []).append(got["token_ids"])
    for name in (*ADAPTERS, "lora-qv"):  # each adapter really changes the output
        assert outputs[name] != outputs[BASE], name


def test_a_burst_mixing_four_adapters_and_the_base_equals_each_request_alone(server: Server) -> None:
    models = [BASE, *ADAPTERS, "lora-qv"]
    words = "river mill bread bells clouds boats town noon".split()
    jobs = [(models[i % len(models)], f"A story about the {words[i % len(words)]} and the {words[(3 * i) % len(words)]}:") for i in range(32)]
    alone = {job: _complete(server, *job)["token_ids"] for job in set(jobs)}
    before = _stats(server)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(
                client.post(f"{server.url}/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
                })
                for model, prompt in jobs
            ))

    responses = asyncio.run(burst())
    for job, response in zip(jobs, responses):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == alone[job], job
    after = _stats(server)
    assert max(s["max_step_loras"] for s in after.values()) == MAX_LORAS  # adapters shared steps, never more
    assert sum(after[b]["num_multi_seq_steps"] - before[b]["num_multi_seq_steps"] for b in after) > 0


def test_the_same_prompt_under_two_adapters_never_shares_cached_kv(server: Server, references: dict[str, Any]) -> None:
    prompt = " ".join(["Bakers open early in the quiet town, and the bells ring twice before noon."] * 4)
    hits = lambda: sum(s["prefix_cache_hits"] for s in _stats(server).values())  # noqa: E731
    first = _complete(server, "lora-r8", prompt)
    before = hits()
    for name in ("lora-r16", BASE):
        got = _complete(server, name, prompt)
        assert_greedy_close(references[name], got["prompt_token_ids"], got["token_ids"],
                            greedy_reference(references[name], got["prompt_token_ids"], MAX_TOKENS))
    assert hits() == before  # neither found lora-r8's blocks
    again = _complete(server, "lora-r8", prompt)
    assert hits() > before  # its own blocks are found
    assert again["token_ids"] == first["token_ids"]

