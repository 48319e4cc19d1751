"""Measurements a backend gate needs: interleaved latency medians and accuracy against eager.

Interleaving: each repeat runs every backend once at a shape, in a rotated order, so a drift in
the machine's speed (another process, thermal state) is shared by all backends instead of
landing on whichever ran last. The median of the repeats is reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


def interleaved_medians_ms(
    calls: dict[str, Callable[[int], object]], num_shapes: int, repeats: int
) -> dict[str, list[float]]:
    """Median wall time in ms of ``calls[name](shape_index)`` per backend and shape.

    Every call runs once untimed per shape first (warm caches, lazy set-up), then ``repeats``
    timed rounds, the order of backends rotating each round.

    Returns:
        ``{name: [median ms for shape 0, shape 1, ...]}``.
    """
    names = list(calls)
    times: dict[str, list[list[float]]] = {n: [[] for _ in range(num_shapes)] for n in names}
    for shape in range(num_shapes):
        for name in names:
            calls[name](shape)
        for round_index in range(repeats):
            offset = round_index % len(names)
            for name in names[offset:] + names[:offset]:
                started = time.perf_counter()
                calls[name](shape)
                times[name][shape].append((time.perf_counter() - started) * 1000)
    return {name: [statistics.median(samples) for samples in per_shape] for name, per_shape in times.items()}


def min_cosine(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """The smallest row-wise cosine similarity of two ``[n, hidden]`` embedding matrices."""
    return float(F.cosine_similarity(reference.float(), candidate.float(), dim=-1).min())


def batched(items: Sequence[list[int]], size: int) -> list[list[list[int]]]:
    """``items`` in consecutive batches of at most ``size``."""
    return [list(items[i : i + size]) for i in range(0, len(items), size)]
