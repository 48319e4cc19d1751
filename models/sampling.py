"""Batched next-token selection: greedy argmax or temperature / min-p / top-k / top-p sampling.

Each sampled row uses the request's own ``torch.Generator``, so a seeded request draws the same
tokens whatever else shares its batch. Top-p follows Holtzman et al. 2019 ("nucleus sampling"):
keep the smallest set of most likely tokens whose probabilities sum to at least ``top_p``.

The logits processors of :mod:`models.logits_processors` run first, in vLLM's order (its module
docstring), and only when some row of the step uses one: a batch without them takes the same
path as before they existed. A constrained row's :class:`~models.structured_sampling.TokenMask`
is applied after them and before the greedy pick (vLLM's order); a step without one pays nothing.
"""

from __future__ import annotations

import torch

from models.logits_processors import SequenceHistory, apply_logits_processors, apply_min_p
from models.step_io import SamplingParams
from models.structured_sampling import TokenMask, apply_token_mask


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded with ``params.seed``, or from fresh entropy when no seed is given."""
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    histories: list[SequenceHistory | None] | None = None,
    stop_token_ids: frozenset[int] = frozenset(),
    mask: TokenMask | None = None,
) -> list[int]:
    """Pick one token per row.

    Args:
        logits: ``[num_rows, vocab_size]`` float logits of the last position of each sequence
            (not changed: the processors work on a copy).
        params: sampling parameters, one per row.
        generators: per-row generators (used only by non-greedy rows).
        histories: per-row token histories for the penalties and ``min_tokens`` (``None``: none kept).
        stop_token_ids: the model's end-of-sequence ids, masked under ``min_tokens``.
        mask: the tokens the constrained rows may take (``None``: no row is constrained).
    Returns:
        ``num_rows`` token ids.
    """
    if any(p.uses_logits_processors for p in params):
        rows_history = histories if histories is not None else [None] * len(params)
        logits = apply_logits_processors(logits.float(), params, rows_history, stop_token_ids)
    if mask is not None:
        logits = apply_token_mask(logits.float(), mask)
    chosen = torch.argmax(logits, dim=-1).tolist()
    sampled_rows = [row for row, p in enumerate(params) if not p.is_greedy]
    filtered = _min_p_rows(logits, params, sampled_rows)
    for row in sampled_rows:
        chosen[row] = _sample_row(filtered.get(row, logits[row]).float(), params[row], generators[row])
    return chosen


def _min_p_rows(logits: torch.Tensor, params: list[SamplingParams], sampled_rows: list[int]) -> dict[int, torch.Tensor]:
    """The ``[vocab_size]`` logits of the sampled rows with ``min_p``, filtered by it in one batched
    call (:func:`~models.logits_processors.apply_min_p` on those rows only), by row."""
    rows = [row for row in sampled_rows if params[row].min_p > 0]
    if not rows:
        return {}
    device = logits.device
    min_p = torch.tensor([params[row].min_p for row in rows], device=device)
    temperature = torch.tensor([params[row].temperature for row in rows], device=device)
    filtered = apply_min_p(logits[torch.tensor(rows, device=device)].float(), min_p, temperature)
    return dict(zip(rows, filtered))


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
