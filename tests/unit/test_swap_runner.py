"""Swap preemption with tensors: the host pool's copies (a second CPU tensor here, pinned memory
beside a CUDA pool on a GPU), and a tiny Llama whose swapped-out sequences come back to the
greedy tokens they give when never preempted."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from buckets.continuous import ContinuousBatcher
from buckets.request import GenerationRequest, TokenEvent
from buckets.settings import ContinuousBatcherSettings
from models.kv_cache import KVShape, PagedKVCache
from models.step_io import SamplingParams
from tests.factories import FakeTokenizer, Recorder
from tests.unit.test_forks import drain

BLOCK_SIZE = 4
SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8)


def round_trip(device: str, dtype: torch.dtype) -> None:
    """Blocks 1 and 3 out to host blocks 2 and 0, the device pool scrambled, then back into 0 and 2."""
    cache = PagedKVCache(SHAPE, num_blocks=4, block_size=BLOCK_SIZE, dtype=dtype, device=device, num_host_blocks=3)
    cache.data.copy_(torch.randint(-127, 128, cache.data.shape) if dtype == torch.int8 else torch.randn(cache.data.shape))
    if cache.scales is not None:
        cache.scales.copy_(torch.rand(cache.scales.shape))
    before = cache.data.clone()
    scales = None if cache.scales is None else cache.scales.clone()
    cache.swap_out([(1, 2), (3, 0)])
    cache.data.zero_()
    cache.swap_in([(2, 0), (0, 2)])
    assert torch.equal(cache.data[:, :, 0], before[:, :, 1]) and torch.equal(cache.data[:, :, 2], before[:, :, 3])
    assert not cache.data[:, :, 1].any() and not cache.data[:, :, 3].any()
    if scales is not None and cache.scales is not None:
        assert torch.equal(cache.scales[:, :, 0], scales[:, :, 1]) and torch.equal(cache.scales[:, :, 2], scales[:, :, 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_blocks_swapped_out_and_back_in_hold_the_same_kv(dtype: torch.dtype) -> None:
    round_trip("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_a_cuda_pool_swaps_through_pinned_host_memory_and_back(dtype: torch.dtype) -> None:
    cache = PagedKVCache(SHAPE, num_blocks=2, block_size=BLOCK_SIZE, dtype=dtype, device="cuda", num_host_blocks=2)
    assert cache.host.is_pinned
    round_trip("cuda", dtype)


@pytest.fixture(scope="module")
def tiny_llama() -> Any:
    """A 2-layer Llama of hidden size 32 and 96 tokens, random weights (seed 0), in memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.attention import ATTENTION_NAME, register_attention

    register_attention()
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(config, attn_implementation=ATTENTION_NAME).eval()


def greedy_outputs(model: Any, num_blocks: int, preemption: str, swap_space_bytes: int = 0) -> tuple[list[list[int]], Any, Any]:
    """Greedy tokens of three requests run together over a pool of ``num_blocks`` blocks."""
    from models.causal_lm import CausalLMRunner

    runner = CausalLMRunner(model, num_blocks, BLOCK_SIZE, swap_space_bytes=swap_space_bytes)
    settings = ContinuousBatcherSettings(3, 64, BLOCK_SIZE, preemption=preemption, swap_space_bytes=swap_space_bytes)  # type: ignore[arg-type]
    batcher = ContinuousBatcher(runner, settings, FakeTokenizer(), frozenset())
    requests = [
        GenerationRequest(
            request_id=f"r{i}", prompt_token_ids=[(7 * i + j) % 90 + 3 for j in range(9 + i)], sink=Recorder(), max_tokens=12,
            params=SamplingParams(temperature=0.0), ignore_eos=True,
        )
        for i in range(3)
    ]
    for request in requests:
        batcher.submit(request)
    drain(batcher, max_steps=300)
    outputs = [[t for e in r.sink.events if isinstance(e, TokenEvent) for t in e.token_ids] for r in requests]  # type: ignore[attr-defined]
    return outputs, batcher, runner


def test_swapped_out_sequences_give_the_greedy_tokens_of_a_pool_that_never_preempts(tiny_llama: Any) -> None:
    roomy, roomy_batcher, _ = greedy_outputs(tiny_llama, 24, "recompute")
    assert roomy_batcher.stats().num_preemptions == 0
    bytes_per_block = BLOCK_SIZE * SHAPE.bytes_per_token_in(torch.float32)
    tight, batcher, runner = greedy_outputs(tiny_llama, 9, "swap", swap_space_bytes=16 * bytes_per_block)
    stats = batcher.stats()
    assert runner.kv_cache.num_host_blocks == 16
    assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
    assert tight == roomy and all(len(tokens) == 12 for tokens in tight)
    assert batcher.block_manager.num_used_blocks == 0 and batcher.swapper.space.num_free_blocks == 16


def test_the_runner_measures_copies_and_prefills_for_auto(tiny_llama: Any) -> None:
    from models.causal_lm import CausalLMRunner
    from models.swap_costs import measure_swap_costs

    runner = CausalLMRunner(tiny_llama, 8, BLOCK_SIZE, swap_space_bytes=4 * BLOCK_SIZE * SHAPE.bytes_per_token_in(torch.float32))
    runner.kv_cache.data.normal_()
    before = runner.kv_cache.data.clone()
    timings = measure_swap_costs(runner, (4, 8, 64))
    assert timings is not None and timings.swap_out_s_per_block > 0 and timings.swap_in_s_per_block > 0
    assert [n for n, _ in timings.prefill_s_by_length] == [4, 8, 32]  # capped by the pool's 32 tokens
    assert torch.equal(runner.kv_cache.data, before)  # the blocks it used are put back
    assert measure_swap_costs(CausalLMRunner(tiny_llama, 8, BLOCK_SIZE)) is None


def test_auto_measures_a_pool_smaller_than_the_shortest_timed_prefill(tiny_llama: Any) -> None:
    # 8 blocks of 4: every default length (64, 256, 1024) caps to 32 tokens, one timing alone.
    from gateway.runners import swap_costs
    from models.causal_lm import CausalLMRunner

    runner = CausalLMRunner(tiny_llama, 8, BLOCK_SIZE, swap_space_bytes=4 * BLOCK_SIZE * SHAPE.bytes_per_token_in(torch.float32))
    info: dict[str, Any] = {}
    assert swap_costs(runner, info) is not None
    assert len(info["swap_costs"]["recompute_ms"]) >= 2


def test_a_greedy_fork_swapped_out_right_after_its_fork_gives_its_parents_tokens(tiny_llama: Any) -> None:
    # 5 blocks of 4: "a" (8 tokens, 2 blocks) and "b" (5 tokens, 2 blocks; n=2, its fork shares the
    # first and copies the second) fill the pool; a's first decode preempts the fork (lowest priority,
    # latest) in the step its block copy runs.
    from models.causal_lm import CausalLMRunner

    bytes_per_block = BLOCK_SIZE * SHAPE.bytes_per_token_in(torch.float32)
    runner = CausalLMRunner(tiny_llama, 5, BLOCK_SIZE, swap_space_bytes=8 * bytes_per_block)
    runner.kv_cache.data.normal_(std=100.0)  # a block read before it was written tells
    settings = ContinuousBatcherSettings(8, 64, BLOCK_SIZE, preemption="swap", swap_space_bytes=8 * bytes_per_block)
    batcher = ContinuousBatcher(runner, settings, FakeTokenizer(), frozenset())
    greedy = SamplingParams(temperature=0.0)
    batcher.submit(GenerationRequest(request_id="a", prompt_token_ids=list(range(10, 18)), sink=Recorder(), max_tokens=12, params=greedy, ignore_eos=True))
    forked = GenerationRequest(
        request_id="b", priority=1, prompt_token_ids=[3, 5, 7, 9, 11], sink=Recorder(), max_tokens=8, params=greedy, n=2, ignore_eos=True,
    )
    batcher.submit(forked)
    drain(batcher, max_steps=100)
    choices: dict[int, list[int]] = {0: [], 1: []}
    for event in forked.sink.events:  # type: ignore[attr-defined]
        if isinstance(event, TokenEvent):
            choices[event.index].extend(event.token_ids)
    assert batcher.stats().num_swap_outs > 0
    assert choices[0] == choices[1] and len(choices[0]) == 8
