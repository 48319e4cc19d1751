"""The engine benchmark's workload: prompts of real English prose, as token ids.

The text is the standard library's ``pydoc_data.topics`` (the help pages of Python's language
reference), so the workload needs no download and is the same on every machine with the same
Python. The pages are joined, tokenised once with the model's tokenizer, and each prompt is a
window of that token stream at a seeded random offset, with a seeded random length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Workload:
    """The prompts of one benchmark run, in arrival order.

    ``prompts`` are token-id lists; ``seed`` drew their lengths and offsets.
    """

    prompts: list[list[int]]
    seed: int

    @property
    def prompt_lengths(self) -> list[int]:
        """Tokens per prompt."""
        return [len(p) for p in self.prompts]

    def summary(self) -> dict[str, float | int]:
        """Prompt-length statistics in tokens, for the report."""
        lengths = self.prompt_lengths
        return {
            "num_prompts": len(lengths),
            "prompt_tokens_min": min(lengths),
            "prompt_tokens_mean": sum(lengths) / len(lengths),
            "prompt_tokens_max": max(lengths),
            "prompt_tokens_total": sum(lengths),
            "seed": self.seed,
        }

    def static_kv_tokens(self, batch_size: int, max_new_tokens: int) -> list[tuple[int, int]]:
        """KV tokens of static batching: for each batch of ``batch_size`` prompts in arrival order,
        ``(held, needed)``.

        A left-padded batch holds every row at the longest prompt's length plus ``max_new_tokens``:
        ``held = rows * (longest prompt + max_new_tokens)``; its requests need
        ``needed = sum(prompt + max_new_tokens)``.
        """
        batches = [self.prompt_lengths[i : i + batch_size] for i in range(0, len(self.prompts), batch_size)]
        return [(len(b) * (max(b) + max_new_tokens), sum(b) + len(b) * max_new_tokens) for b in batches]


def corpus_text() -> str:
    """The prose the prompts are cut from: every ``pydoc_data.topics`` page, in sorted key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def corpus_token_ids(tokenizer: Any) -> list[int]:
    """The corpus tokenised once with ``tokenizer`` (no special tokens added)."""
    return list(tokenizer(corpus_text(), add_special_tokens=False)["input_ids"])


def make_workload(tokenizer: Any, num_prompts: int, min_tokens: int, max_tokens: int, seed: int) -> Workload:
    """Draw ``num_prompts`` prompts of ``min_tokens`` to ``max_tokens`` tokens (uniform, inclusive).

    Lengths and window offsets come from ``random.Random(seed)``, so a seed fixes the workload.

    Raises:
        ValueError: the bounds are not ``1 <= min_tokens <= max_tokens <= corpus length``.
    """
    corpus = corpus_token_ids(tokenizer)
    if not 1 <= min_tokens <= max_tokens <= len(corpus):
        raise ValueError(
            f"prompt lengths: need 1 <= min ({min_tokens}) <= max ({max_tokens}) <= corpus tokens ({len(corpus)})"
        )
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        length = rng.randint(min_tokens, max_tokens)
        start = rng.randint(0, len(corpus) - length)
        prompts.append(corpus[start : start + length])
    return Workload(prompts=prompts, seed=seed)
