"""Batched logits processors: penalties, ``logit_bias``, ``min_tokens`` and ``min_p``.

Each processor works on a ``[rows, vocab_size]`` float32 logits tensor with per-row settings
held in tensors, so a step costs a few tensor ops whatever the batch mix, and never a Python
loop over the vocabulary. Rows whose settings turn a processor off are left bit-for-bit
unchanged (their index is not among the rows it touches, or its factor is the identity).

Order, as vLLM's V1 sampler (``vllm/v1/sample/sampler.py``) applies them:

1. ``min_tokens`` (mask the stop tokens while too few tokens are out) and ``logit_bias``
   (vLLM's non-argmax-invariant logits processors);
2. the penalties (:func:`apply_penalties`: repetition, then frequency and presence);
3. the greedy pick (argmax) for greedy rows;
4. temperature, then ``min_p`` (:func:`apply_min_p`), then top-k and top-p, then the draw
   (:mod:`models.sampling`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from models.step_io import SamplingParams


@dataclass
class SequenceHistory:
    """The tokens one sequence's processors look at, kept by the runner for its life.

    ``prompt_token_ids`` is filled only for ``repetition_penalty`` (empty otherwise);
    ``output_token_ids`` grows by each token the runner samples for it.
    """

    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


def token_coordinates(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct ``(row, token id)`` pairs of ``token_ids`` (one id list per row) and how
    often each occurs: three ``[n]`` tensors (int64 rows, int64 ids, float32 counts).

    vLLM's ``get_token_bin_counts_and_mask`` scatters the ids into a dense ``[rows, vocab_size]``
    count tensor; these are its non-zero entries, found in one ``torch.unique`` over
    ``row * (vocab_size + 1) + id`` keys (rows padded with the id ``vocab_size``, then dropped),
    so a step costs in the tokens seen, not in the vocabulary.
    """
    width = max((len(ids) for ids in token_ids), default=0)
    padded = torch.tensor([list(ids) + [vocab_size] * (width - len(ids)) for ids in token_ids], dtype=torch.int64, device=device)
    padded = padded.reshape(len(token_ids), width)
    keys = (torch.arange(len(token_ids), device=device).unsqueeze(1) * (vocab_size + 1) + padded)[padded < vocab_size]
    unique, counts = torch.unique(keys, return_counts=True)
    return unique // (vocab_size + 1), unique % (vocab_size + 1), counts.to(torch.float32)


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Penalise tokens already seen in ``rows`` of ``logits``, in place; returns ``logits``.

    Args:
        logits: ``[num_rows, vocab_size]`` float32.
        rows: ``[n]`` int64, the rows penalised; the other rows are not read or written.
        prompt_token_ids, output_token_ids: the prompt and generated token ids of each of ``rows``.
        repetition, frequency, presence: ``[n]`` penalties (1, 0 and 0 leave a row as it is).

    The repetition penalty is CTRL's (Keskar et al. 2019) as vLLM applies it: a token seen in the
    prompt or the output has a positive logit divided by the penalty and a negative one
    multiplied by it. Then OpenAI's formula over the generated tokens (``c[j]`` the count of
    token ``j``): ``logits[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty``.
    Only the seen entries are read and written (:func:`token_coordinates`).
    """
    device, vocab_size = logits.device, logits.shape[-1]
    seen = [list(prompt) + list(output) for prompt, output in zip(prompt_token_ids, output_token_ids)]
    at, ids, _ = token_coordinates(seen, vocab_size, device)
    # Any penalty > 0 is valid: keep it and the results finite in float32 (no inf, no 0 * inf).
    finite = torch.finfo(logits.dtype)
    values, penalty = logits[rows[at], ids], repetition[at].clamp(finite.tiny, finite.max)
    penalised = torch.where(values > 0, values / penalty, values * penalty).clamp(-finite.max, finite.max)
    logits.index_put_((rows[at], ids), penalised)
    at, ids, counts = token_coordinates(output_token_ids, vocab_size, device)
    logits.index_put_((rows[at], ids), -(counts * frequency[at] + presence[at]), accumulate=True)
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    """Add ``biases[i]`` to ``logits[rows[i], token_ids[i]]`` (OpenAI's ``logit_bias``), in place; returns ``logits``.

    Args:
        logits: ``[rows, vocab_size]`` float32.
        rows, token_ids: ``[n]`` int64 coordinates; biases: ``[n]`` float32.
    """
    return logits.index_put_((rows, token_ids), biases, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Set ``logits[rows[i], token_ids[i]]`` to ``-inf`` (vLLM's ``min_tokens``: a row's stop
    tokens cannot be drawn before it has its minimum), in place; returns ``logits``.
    ``rows``, ``token_ids``: ``[n]`` int64."""
    return logits.index_put_((rows, token_ids), torch.tensor(float("-inf"), device=logits.device))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Drop (set to ``-inf``) each token whose probability at the row's temperature is below
    ``min_p`` times the most likely token's (vLLM's ``MinPLogitsProcessor``), in place; returns ``logits``.

    Args:
        logits: ``[rows, vocab_size]`` float32, before temperature.
        min_p: ``[rows]`` in ``[0, 1]`` (0 keeps every token).
        temperature: ``[rows]``, positive.

    With ``p = softmax(logits / T)``, ``p[j] < min_p * max(p)`` is
    ``logits[j] < max(logits) + T * ln(min_p)``; the test runs in that log form, which needs no
    softmax and keeps every token of a row with ``min_p == 0`` (``ln 0 = -inf``).
    """
    threshold = logits.amax(dim=-1) + temperature * torch.log(min_p)
    return logits.masked_fill_(logits < threshold.unsqueeze(1), float("-inf"))


def apply_logits_processors(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[SequenceHistory | None],
    stop_token_ids: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """Steps 1 and 2 of the module's order on the rows whose ``params`` use them; returns new
    logits (one copy of the input, which is not changed, so raw logits stay available for logprobs).

    Args:
        logits: ``[rows, vocab_size]`` float32.
        params: one per row.
        histories: one per row (``None``: no tokens generated yet and no prompt kept).
        stop_token_ids: the model's end-of-sequence ids, masked with each row's own
            ``stop_token_ids`` under ``min_tokens`` (vLLM masks them even with ``ignore_eos``).
    """
    device = logits.device
    logits = logits.clone()
    known = [h if h is not None else SequenceHistory() for h in histories]
    masked = [
        (row, token_id)
        for row, (p, h) in enumerate(zip(params, known))
        if len(h.output_token_ids) < p.min_tokens
        for token_id in stop_token_ids | frozenset(p.stop_token_ids)
        if token_id < logits.shape[-1]
    ]
    if masked:
        rows, ids = zip(*masked)
        logits = apply_min_tokens(logits, torch.tensor(rows, device=device), torch.tensor(ids, device=device))
    biased = [(row, token_id, bias) for row, p in enumerate(params) for token_id, bias in p.logit_bias]
    if biased:
        rows, ids, biases = zip(*biased)
        logits = apply_logit_bias(
            logits, torch.tensor(rows, device=device), torch.tensor(ids, device=device),
            torch.tensor(biases, dtype=logits.dtype, device=device),
        )
    penalised = [row for row, p in enumerate(params) if p.uses_penalties]
    if penalised:
        logits = _penalise_rows(logits, penalised, [params[r] for r in penalised], [known[r] for r in penalised])
    return logits


def _penalise_rows(
    logits: torch.Tensor, rows: list[int], params: list[SamplingParams], histories: list[SequenceHistory]
) -> torch.Tensor:
    """:func:`apply_penalties` on ``rows`` of ``logits``, in place, with their settings in tensors."""
    device = logits.device

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device)

    return apply_penalties(
        logits,
        torch.tensor(rows, device=device),
        [h.prompt_token_ids for h in histories],
        [h.output_token_ids for h in histories],
        column([p.repetition_penalty for p in params]),
        column([p.frequency_penalty for p in params]),
        column([p.presence_penalty for p in params]),
    )
