"""Which running sequence to preempt when the KV pool runs out of blocks, and how: its KV
dropped and recomputed when it resumes, or copied to a host pool and back (swap)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from policies.step_time import StepTimeFit, StepTimeSample, attended_pairs, fit_step_time


def pick_victim(candidates: list[tuple[float, int]]) -> int:
    """Index of the candidate to preempt, from ``(priority, arrival_order)`` pairs.

    ``priority`` may be a plain priority or an aged one (:func:`policies.priority.priority_key`).
    The victim is the lowest-priority sequence (largest value: lower is more urgent, as in
    vLLM), and among equals the latest arrived (largest ``arrival_order``): the one that has
    waited least loses least by being recomputed later (vLLM's priority policy).

    Raises:
        ValueError: no candidates.
    """
    if not candidates:
        raise ValueError("pick_victim needs at least one candidate")
    return max(range(len(candidates)), key=lambda i: candidates[i])


PreemptionMode = Literal["recompute", "swap", "auto"]


@dataclass(frozen=True)
class SwapCostModel:
    """What preempting a victim costs each way, measured by the runner when it starts
    (:func:`models.swap_costs.measure_swap_costs`).

    Fields:
        swap_out_s_per_block: seconds to copy one KV block (every layer's K and V) from the
            device pool to the host pool, timed over a few blocks copied at warm-up.
        swap_in_s_per_block: the same, host to device.
        recompute: the prefill time of a context of ``n`` tokens, fitted by
            :func:`policies.step_time.fit_step_time` to prefills timed at a few lengths at
            warm-up: ``base_s + per_prefill_token_s * n + per_attended_pair_s * n (n + 1) / 2``,
            the ``a + b n + c n^2`` of a prefill whose attention grows with the square of its length.
    """

    swap_out_s_per_block: float
    swap_in_s_per_block: float
    recompute: StepTimeFit

    def recompute_s(self, num_context_tokens: int) -> float:
        """Predicted seconds to recompute ``num_context_tokens`` tokens of KV (one prefill from 0)."""
        return self.recompute.predict_s(0, num_context_tokens, attended_pairs(0, num_context_tokens))

    def swap_s(self, num_blocks: int) -> float:
        """Predicted seconds to copy ``num_blocks`` blocks out to the host and back in."""
        return (self.swap_out_s_per_block + self.swap_in_s_per_block) * num_blocks


def fit_swap_costs(
    swap_out_s_per_block: float, swap_in_s_per_block: float, prefill_s_by_length: list[tuple[int, float]]
) -> SwapCostModel:
    """A :class:`SwapCostModel` from the per-block copy seconds and ``(num_tokens, seconds)`` of
    prefills timed at a few lengths (at least two distinct lengths; three fit the square term).

    Raises:
        ValueError: a negative copy time, or fewer than two prefill timings.
    """
    if swap_out_s_per_block < 0 or swap_in_s_per_block < 0:
        raise ValueError(f"copy seconds per block must be >= 0, got {swap_out_s_per_block} and {swap_in_s_per_block}")
    samples = [StepTimeSample(0, n, attended_pairs(0, n), seconds) for n, seconds in prefill_s_by_length]
    fit = fit_step_time(samples, [1.0] * len(samples))
    if fit is None:
        raise ValueError(f"prefill_s_by_length: need at least two prefill timings, got {len(samples)}")
    return SwapCostModel(swap_out_s_per_block, swap_in_s_per_block, fit)


def should_swap(
    mode: PreemptionMode, num_context_tokens: int, num_blocks: int, num_free_host_blocks: int, costs: SwapCostModel | None
) -> bool:
    """Whether a victim's KV goes to the host pool (swap) rather than being dropped (recompute).

    ``num_context_tokens``: the victim's computed tokens; ``num_blocks``: the blocks holding them.
    ``recompute`` never swaps. ``swap`` swaps whenever the host pool has ``num_blocks`` free.
    ``auto`` swaps when they fit and recomputing costs more than the copy both ways:
    ``costs.recompute_s(num_context_tokens) > costs.swap_s(num_blocks)`` (no ``costs``: never).
    A victim with nothing computed has nothing to save and is recomputed.
    """
    if mode == "recompute" or num_blocks == 0 or num_blocks > num_free_host_blocks:
        return False
    if mode == "swap":
        return True
    return costs is not None and costs.recompute_s(num_context_tokens) > costs.swap_s(num_blocks)
