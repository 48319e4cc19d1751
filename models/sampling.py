"""Batched next-token selection: greedy argmax or temperature / top-k / top-p sampling.

Each sampled row uses the request's own ``torch.Generator``, so a seeded request draws the same
tokens whatever else shares its batch. Top-p follows Holtzman et al. 2019 ("nucleus sampling"):
keep the smallest set of most likely tokens whose probabilities sum to at least ``top_p``.
"""

from __future__ import annotations

import torch

from models.step_io import SamplingParams


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded with ``params.seed``, or from fresh entropy when no seed is given."""
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """Pick one token per row.

    Args:
        logits: ``[num_rows, vocab_size]`` float logits of the last position of each sequence.
        params: sampling parameters, one per row.
        generators: per-row generators (used only by non-greedy rows).
    Returns:
        ``num_rows`` token ids.
    """
    chosen = torch.argmax(logits, dim=-1).tolist()
    for row, p in enumerate(params):
        if not p.is_greedy:
            chosen[row] = _sample_row(logits[row].float(), p, generators[row])
    return chosen


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """Sample from one ``[vocab_size]`` row after temperature, top-k and top-p filtering."""
    # Shift first so a tiny temperature cannot overflow to inf (the top token stays at 0).
    logits = (logits - logits.max()) / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the top token always stays.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= p.top_p
        drop_sorted[0] = False  # a top_p below float32's smallest value would otherwise drop it
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
