"""What preempting a sequence costs each way on a runner, timed once at start for swap
preemption's ``auto`` choice (:func:`policies.preemption.should_swap`): copying KV blocks to the
host pool and back, and prefills at a few lengths (what recomputing a context costs)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Prefills of these lengths (tokens) are timed, copies of this many blocks, each the best of
# this many runs (the first may pay for a new shape).
SWAP_COST_PREFILL_LENGTHS = (64, 256, 1024)
COST_BLOCKS = 8
COST_REPEATS = 3


@dataclass(frozen=True)
class SwapTimings:
    """What :func:`measure_swap_costs` timed: seconds to copy one KV block (every layer's K and V)
    to the host pool and back, and ``(num_tokens, seconds)`` of one-sequence prefills."""

    swap_out_s_per_block: float
    swap_in_s_per_block: float
    prefill_s_by_length: list[tuple[int, float]]


def measure_swap_costs(runner: Any, prefill_lengths: Sequence[int] = SWAP_COST_PREFILL_LENGTHS) -> SwapTimings | None:
    """Time a :class:`models.causal_lm.CausalLMRunner`: :data:`COST_BLOCKS` blocks (fewer in a
    smaller pool) copied out to its host pool and back in (seconds per block each way, the best
    of :data:`COST_REPEATS`), and one-sequence prefills of ``prefill_lengths`` tokens
    (:func:`timed_lengths`: capped by the pool) through :meth:`~models.causal_lm.CausalLMRunner.warm_up` (best of
    :data:`COST_REPEATS`); the gateway fits them as ``a + b n + c n^2``
    (:func:`policies.preemption.fit_swap_costs`). Called once at start, after the runner's
    warm-up, before any request: the device blocks it overwrites are put back. ``None`` without
    a host pool.
    """
    cache = runner.kv_cache
    num_blocks = min(COST_BLOCKS, cache.num_blocks, cache.num_host_blocks)
    if num_blocks == 0:
        return None
    pairs = [(i, i) for i in range(num_blocks)]
    blocks = torch.arange(num_blocks, device=cache.data.device)
    saved = cache.save_blocks(blocks)
    try:
        out_s = _best_s(lambda: cache.swap_out(pairs), cache.data.device) / num_blocks
        in_s = _best_s(lambda: cache.swap_in(pairs), cache.data.device) / num_blocks
    finally:
        cache.restore_blocks(blocks, saved)
    lengths = timed_lengths(prefill_lengths, cache.num_blocks * cache.block_size)
    prefills = [(n, min(runner.warm_up([(1, n)]) for _ in range(COST_REPEATS))) for n in lengths]
    return SwapTimings(out_s, in_s, prefills)


def timed_lengths(prefill_lengths: Sequence[int], max_tokens: int) -> list[int]:
    """The prefill lengths (tokens) to time: ``prefill_lengths`` capped at ``max_tokens`` (the
    pool's), with half and a quarter of ``max_tokens`` added while the capped ones are fewer than
    three, so a pool below the lengths still gives the fit of ``a + b n + c n^2`` three points
    (two for a pool of 2 or 3 tokens; one, which cannot be fitted, for a pool of 1)."""
    lengths = {min(n, max_tokens) for n in prefill_lengths}
    for n in (max_tokens, max_tokens // 2, max_tokens // 4):
        if len(lengths) >= 3:
            break
        if n > 0:
            lengths.add(n)
    return sorted(lengths)


def _best_s(work: Callable[[], object], device: torch.device) -> float:
    """The least wall seconds of :data:`COST_REPEATS` runs of ``work``, the device synchronized."""
    best_s = math.inf
    for _ in range(COST_REPEATS):
        started = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best_s = min(best_s, time.perf_counter() - started)
    return best_s
