"""On CUDA, the continuous batcher's greedy tokens are Hugging Face ``generate``'s (``pytest -m gpu``;
skipped without a CUDA device, run by ``bench/gpu_check.sh`` on a lent GPU machine).

Four prompts of different lengths (one block to five) run together through Sluice's continuous
batcher on a :class:`~models.causal_lm.CausalLMRunner` on ``cuda:0``, and each alone through stock
``generate`` (SDPA attention) on the same device, both greedy with end-of-sequence banned until
the last token (``min_tokens`` / ``min_new_tokens``). The model is a tiny random Llama.

In float32 the tokens must be equal. In bfloat16 two correct implementations may differ: the
logits of a random model lie close together, and a different order of bfloat16 sums can flip a
near-tie, after which the two continuations diverge. So in bfloat16 each prompt's tokens must be
equal up to the first difference, and there Sluice's token must be a near-tie in Hugging Face's
own logits: within ``BF16_TIE_FRACTION`` of their range below the best.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.tiny_models import write_tiny_llama

pytestmark = pytest.mark.gpu

DEVICE = "cuda:0"
PROMPT_LENGTHS_TOKENS = (5, 17, 33, 70)
NEW_TOKENS = 24
BF16_TIE_FRACTION = 0.05


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("gpu") / "llama", hidden_size=64, num_layers=2)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    draw = random.Random(0)
    return [[draw.randrange(100, 4000) for _ in range(n)] for n in PROMPT_LENGTHS_TOKENS]


def _hf_greedy(folder: Path, dtype: str, prompts: list[list[int]]) -> list[tuple[list[int], list[Any]]]:
    """Each prompt alone through ``generate``: its new tokens and the logits of every step."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    model.to(DEVICE).eval()
    results = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt], device=DEVICE)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True, return_dict_in_generate=True,
                pad_token_id=model.generation_config.eos_token_id,
            )
        results.append((out.sequences[0, len(prompt) :].tolist(), [s[0].float().cpu() for s in out.scores]))
    return results


def _sluice_greedy(folder: Path, dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    """Every prompt at once through the continuous batcher on a runner on :data:`DEVICE`."""
    from bench.systems import roomy_num_blocks, sluice_generate
    from models.causal_lm import CausalLMRunner
    from models.loader import load_model
    from models.source import default_cache_dir
    from models.step_io import SamplingParams

    loaded = load_model("tiny", str(folder), "generate", dtype, DEVICE, default_cache_dir())
    runner = CausalLMRunner(loaded.model, roomy_num_blocks(prompts, NEW_TOKENS), 16, eos_token_ids=loaded.eos_token_ids)
    params = SamplingParams(temperature=0.0, min_tokens=NEW_TOKENS)
    return sluice_generate(runner, loaded, prompts, NEW_TOKENS, max_num_seqs=len(prompts), params=params)


def test_float32_greedy_tokens_equal_hf_generate_on_cuda(tiny_llama: Path, prompts: list[list[int]]) -> None:
    expected = [tokens for tokens, _ in _hf_greedy(tiny_llama, "float32", prompts)]
    assert _sluice_greedy(tiny_llama, "float32", prompts) == expected


def test_bfloat16_greedy_tokens_equal_hf_generate_up_to_a_near_tie(tiny_llama: Path, prompts: list[list[int]]) -> None:
    expected = _hf_greedy(tiny_llama, "bfloat16", prompts)
    outputs = _sluice_greedy(tiny_llama, "bfloat16", prompts)
    for (hf_tokens, scores), tokens in zip(expected, outputs):
        assert len(tokens) == len(hf_tokens) == NEW_TOKENS
        at = next((i for i, (a, b) in enumerate(zip(tokens, hf_tokens)) if a != b), None)
        if at is None:
            continue
        logits = scores[at]
        finite = logits[logits.isfinite()]
        gap = float(logits.max() - logits[tokens[at]])
        assert gap <= BF16_TIE_FRACTION * float(finite.max() - finite.min()), (at, tokens[at], hf_tokens[at], gap)
