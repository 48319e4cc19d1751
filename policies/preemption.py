"""Which running sequence to preempt when the KV pool runs out of blocks."""

from __future__ import annotations


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
