"""How far a lossy KV pool (``kv_cache_dtype`` bfloat16 or int8) moves a decoder from float32 KV.

Two measures on a fixed prompt set, both through :class:`models.causal_lm.CausalLMRunner` with
every prompt packed in the same steps, as the continuous batcher runs them:

- ``greedy_agreement``: each prompt's greedy continuation is compared with float32 KV's; its
  score is the share of positions before the first differing token (1.0 when none differs), and
  the scores are averaged over prompts (issue 16 §2: "positions up to the first divergence").
- ``top1_agreement`` and ``mean_kl_nats`` / ``max_kl_nats``: teacher-forced along float32's
  tokens, so both pools see the same inputs at every step, the share of decode steps whose top
  token is float32's, and KL(float32 || candidate) of the next-token distributions, in nats.

Measured on SmolLM2-135M (all 30 layers, float32 weights, eager), the 8 gate texts of
:mod:`gateway.gate` x 16 tokens (``python -m bench.kv_dtype accuracy``): see the README's KV
section for the figures. :func:`judge_kv_dtype` is the gate's verdict on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from models.backends.decoder_gate import greedy_tokens, logprob_agreement, teacher_forced_logprobs
from models.causal_lm import CausalLMRunner


@dataclass(frozen=True)
class KVAccuracyThresholds:
    """What a lossy KV dtype must show against float32 KV (the gate's config)."""

    min_greedy_agreement: float = 0.99
    max_mean_kl_nats: float = 0.02


def greedy_agreement(reference: Sequence[list[int]], got: Sequence[list[int]]) -> float:
    """Mean over prompts of the share of ``reference``'s positions before the first token
    ``got`` differs at (1.0 for a prompt that matches throughout)."""
    scores = []
    for want, have in zip(reference, got, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
        scores.append(first / len(want) if want else 1.0)
    return sum(scores) / len(scores)


def measure_kv_dtype(
    model: Any, prompts: Sequence[list[int]], max_new_tokens: int, block_size: int, kv_cache_dtype: str, backend: str = "eager"
) -> dict[str, Any]:
    """Accuracy figures of ``kv_cache_dtype`` against float32 KV on ``prompts`` (module docstring).

    Returns:
        ``kv_cache_dtype``, ``greedy_agreement``, ``top1_agreement``, ``mean_kl_nats``, ``max_kl_nats``.
    """
    num_blocks = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts)
    reference_runner = CausalLMRunner(model, num_blocks, block_size, backend=backend, kv_cache_dtype="float32")
    runner = CausalLMRunner(model, num_blocks, block_size, backend=backend, kv_cache_dtype=kv_cache_dtype)
    want = greedy_tokens(reference_runner, prompts, max_new_tokens)
    got = greedy_tokens(runner, prompts, max_new_tokens)
    reference = teacher_forced_logprobs(reference_runner, prompts, want)
    candidate = teacher_forced_logprobs(runner, prompts, want)
    return {
        "kv_cache_dtype": kv_cache_dtype,
        "greedy_agreement": round(greedy_agreement(want, got), 4),
        **logprob_agreement(reference, candidate),
    }


def judge_kv_dtype(figures: dict[str, Any], thresholds: KVAccuracyThresholds) -> list[str]:
    """Why ``figures`` (from :func:`measure_kv_dtype`) fail ``thresholds``; empty when they pass."""
    reasons = []
    if figures["greedy_agreement"] < thresholds.min_greedy_agreement:
        reasons.append(f"greedy agreement {figures['greedy_agreement']:.4f} < {thresholds.min_greedy_agreement}")
    if figures["mean_kl_nats"] > thresholds.max_mean_kl_nats:
        reasons.append(f"mean KL {figures['mean_kl_nats']:.5f} nats > {thresholds.max_mean_kl_nats}")
    return reasons
