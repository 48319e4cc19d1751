"""Many requests at once: each result equals running it alone, and batching really happened."""

from __future__ import annotations

import asyncio

import httpx
import torch

from tests.e2e.conftest import EMBED_MODEL, GENERATE_MODEL
from tests.e2e.reference import assert_greedy_close, greedy_reference

WORDS = (
    "the river carried small boats past the old mill while children counted clouds above "
    "a quiet town where bakers opened early and the bells rang twice before noon every day"
).split()


def _prompt(num_words: int, offset: int) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(num_words))


def _stats(server_url: str, model: str) -> dict:
    return httpx.get(f"{server_url}/stats").json()[model]


def test_16_concurrent_generations_equal_their_single_references(server_url, async_openai_client, hf_causal_lm) -> None:
    model, tokenizer = hf_causal_lm
    before = _stats(server_url, GENERATE_MODEL)
    prompts = [_prompt(3 + 9 * i, i) for i in range(16)]  # 4 to ~190 tokens: both buckets
    max_tokens = [4 + (i % 5) * 3 for i in range(16)]  # 4 to 16: sequences leave the batch at five steps

    async def one(client, prompt: str, n: int):
        return await client.completions.create(
            model=GENERATE_MODEL, prompt=prompt, max_tokens=n, temperature=0, extra_body={"return_token_ids": True}
        )

    async def all_at_once():
        client = async_openai_client()
        return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, max_tokens)))

    outs = asyncio.run(all_at_once())
    for prompt, n, out in zip(prompts, max_tokens, outs):
        choice = out.model_dump()["choices"][0]
        assert choice["prompt_token_ids"] == tokenizer(prompt).input_ids
        want = greedy_reference(model, choice["prompt_token_ids"], n)
        assert_greedy_close(model, choice["prompt_token_ids"], choice["token_ids"], want)
    after = _stats(server_url, GENERATE_MODEL)
    multi = sum(after[b]["num_multi_seq_steps"] - before[b]["num_multi_seq_steps"] for b in after)
    assert multi > 0, f"no step ran more than one sequence: {after}"
    assert max(after[b]["max_batch_seqs"] for b in after) > 1
    assert all(after[b]["num_running"] == 0 and after[b]["num_waiting"] == 0 for b in after)


def test_32_concurrent_embeddings_equal_single_forwards(server_url, async_openai_client, hf_encoder) -> None:
    model, tokenizer = hf_encoder
    before = _stats(server_url, EMBED_MODEL)
    texts = [_prompt(1 + (i * 7) % 40, i) for i in range(32)]

    async def all_at_once():
        client = async_openai_client()
        return await asyncio.gather(*(client.embeddings.create(model=EMBED_MODEL, input=t) for t in texts))

    outs = asyncio.run(all_at_once())
    with torch.inference_mode():
        for text, out in zip(texts, outs):
            enc = tokenizer(text, return_tensors="pt")
            hidden = model(**enc).last_hidden_state[0]
            want = torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1)
            got = torch.tensor(out.data[0].embedding)
            assert float((got - want).abs().max()) <= 1e-5
    after = _stats(server_url, EMBED_MODEL)
    multi = sum(after[b]["num_multi_seq_steps"] - before[b]["num_multi_seq_steps"] for b in after)
    assert multi > 0, f"no embedding batch held more than one request: {after}"


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(async_openai_client) -> None:
    request = dict(
        model=GENERATE_MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.9, top_p=0.95, seed=1234,
        extra_body={"top_k": 50},
    )

    async def alone(seed: int):
        return await async_openai_client().completions.create(**{**request, "seed": seed})

    async def crowded():
        client = async_openai_client()
        others = [
            client.completions.create(model=GENERATE_MODEL, prompt=_prompt(5 + i, i), max_tokens=16, temperature=1.0)
            for i in range(6)
        ]
        results = await asyncio.gather(client.completions.create(**request), *others)
        return results[0]

    first = asyncio.run(alone(1234)).choices[0].text
    assert asyncio.run(crowded()).choices[0].text == first
    other_seed = asyncio.run(alone(99)).choices[0].text
    assert other_seed != first
