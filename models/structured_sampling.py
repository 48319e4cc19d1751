"""Constrained sampling: each constrained sequence's matcher, its allowed-token mask per step,
and the mask applied to the batched logits.

Per step (the order of vLLM's guidance backend, ``vllm/v1/structured_output``): the matchers of
the step's constrained rows fill one int32 bitmask together (llguidance's ``LLExecutor``, its
threads outside the GIL), the bits are unpacked (numpy), moved to the logits' device and applied to those rows
after the logits processors and before the greedy pick and the temperature / top-k / top-p draw
(:func:`models.sampling.sample`); then each matcher consumes its sampled token. A step with no
constrained row does none of this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np
import torch

from models.step_io import Constraint
from models.structured import ConstraintError, GrammarCache, cache_for

@dataclass(frozen=True)
class TokenMask:
    """The tokens each constrained row of a step may take.

    Fields:
        rows: ``[r]`` int64, the rows of the step's logits that are constrained.
        allowed: ``[r, vocab_size]`` bool, on the logits' device (``vocab_size``: llguidance's).
    """

    rows: torch.Tensor
    allowed: torch.Tensor


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """llguidance's ``[r, ceil(vocab_size / 32)]`` int32 bitmask (bit ``j % 32`` of word ``j // 32``
    is token ``j``; little-endian words, so bit ``j % 8`` of byte ``j // 8``) as a
    ``[r, vocab_size]`` bool CPU tensor, by numpy's ``unpackbits`` (one C pass, no int32 temporaries)."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """``logits`` (``[rows, width]`` float, not changed) with the disallowed tokens of
    ``mask.rows`` at ``-inf``: one ``torch.where`` over those rows. Columns past the mask's
    vocabulary (a padded LM head) are disallowed. A row whose every allowed token another
    processor already set to ``-inf`` (``min_tokens`` masking the end-of-sequence token a grammar
    needs) gets its allowed tokens at 0, so it can still be drawn from."""
    width = logits.shape[-1]
    allowed = mask.allowed[:, :width]
    if allowed.shape[-1] < width:
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[-1]), value=False)
    positions = torch.arange(len(mask.rows), device=mask.rows.device)
    every_row = len(mask.rows) == logits.shape[0] and bool((mask.rows == positions).all())
    rows = torch.where(allowed, logits if every_row else logits[mask.rows], float("-inf"))
    dead = torch.isneginf(rows.amax(dim=-1))
    if bool(dead.any()):
        rows[dead] = torch.where(allowed[dead], 0.0, float("-inf"))
    if every_row:
        return rows
    masked = logits.clone()
    masked[mask.rows] = rows
    return masked


class SequenceMatchers:
    """The llguidance matchers of a runner's constrained sequences, by sequence id.

    Args:
        tokenizer: the model's Hugging Face tokenizer (its :class:`GrammarCache` is built at the
            first constrained sequence, not before).

    A sequence's matcher is made at its first sampled token (a fork gets its own, in the start
    state) and dropped by :meth:`release`. Preemption by recompute keeps it: the tokens it
    consumed stay the sequence's outputs, and the next token sampled after the recompute is the
    next one it sees.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: GrammarCache | None = None
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self._executor: llguidance.LLExecutor | None = None

    def __len__(self) -> int:
        return len(self._matchers)

    def release(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def _matcher(self, seq_id: int, constraint: Constraint) -> llguidance.LLMatcher:
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            if self._cache is None:
                self._cache = cache_for(self._tokenizer)
            try:
                matcher = self._cache.matcher(constraint)
            except ConstraintError:
                # The gateway checks each constraint before submitting it; one that fails here
                # anyway (a caller of the core that skipped the check) gets a matcher in the error
                # state (an empty grammar), which allows only end-of-sequence: the sequence stops.
                matcher = llguidance.LLMatcher(self._cache.ll_tokenizer, "", log_level=0)
            self._matchers[seq_id] = matcher
        return matcher

    def mask(self, constrained: list[tuple[int, int, Constraint]], device: torch.device | str) -> TokenMask:
        """The step's :class:`TokenMask` for ``constrained``: ``(row, seq_id, constraint)`` per
        constrained row of the logits."""
        matchers = [self._matcher(seq_id, constraint) for _, seq_id, constraint in constrained]
        assert self._cache is not None
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        vocab_size = self._cache.vocab_size
        # llguidance's numpy helpers, not its torch ones: ``llguidance.torch`` imports Dynamo and
        # Inductor (about 0.5 s of every gateway's and worker's start) for a kernel we do not use.
        bitmask = llguidance.numpy.allocate_token_bitmask(len(matchers), vocab_size)
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        rows = torch.tensor([row for row, _, _ in constrained], dtype=torch.int64, device=device)
        return TokenMask(rows, unpack_bitmask(bitmask, vocab_size).to(device, non_blocking=True))

    def advance(self, seq_ids: list[int], token_ids: list[int]) -> frozenset[int]:
        """Feed each sequence's matcher its sampled token; return the sequences whose grammar is
        now complete (stopped: nothing but end-of-sequence may follow) or broken (a token it
        refused, which the mask rules out)."""
        done: set[int] = set()
        for seq_id, token_id in zip(seq_ids, token_ids):
            matcher = self._matchers[seq_id]
            if not matcher.consume_token(token_id) or matcher.is_stopped():
                done.add(seq_id)
        return frozenset(done)
