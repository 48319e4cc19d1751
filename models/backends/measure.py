"""Measurements a backend gate needs: interleaved latencies and accuracy against eager.

Interleaving: each repeat runs every backend once at a shape, in a rotated order, so a drift in
the machine's speed (another process, thermal state) is shared by all backends instead of
landing on whichever ran last. Every repeat's time is kept: repeat ``r`` of two backends ran
side by side, so their ratio is one paired sample of the speed-up (:mod:`policies.gating`
bounds it with a confidence interval); the median of the repeats is what tables show.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F


def interleaved_times_ms(
    calls: Mapping[str, Callable[..., object]], num_shapes: int, repeats: int
) -> dict[str, list[list[float]]]:
    """Wall time in ms of every timed ``calls[name](shape_index)``, per backend, shape and repeat.

    Every call runs once untimed per shape first (warm caches, lazy set-up), then ``repeats``
    timed rounds, the order of backends rotating each round.

    Returns:
        ``{name: [[ms of repeat 0, 1, ...] for shape 0, [...] for shape 1, ...]}``.
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
    return times


def latency_fields(eager: list[list[float]], candidate: list[list[float]]) -> dict[str, list[float] | list[list[float]]]:
    """A candidate's latency figures for its gate record, in ms rounded to µs: per shape the
    medians (``eager_ms``, ``candidate_ms``) and every repeat (``eager_repeats_ms``,
    ``candidate_repeats_ms``), as :class:`policies.gating.Measurement` takes them."""
    return {
        "eager_ms": [round(statistics.median(shape), 3) for shape in eager],
        "candidate_ms": [round(statistics.median(shape), 3) for shape in candidate],
        "eager_repeats_ms": [[round(ms, 3) for ms in shape] for shape in eager],
        "candidate_repeats_ms": [[round(ms, 3) for ms in shape] for shape in candidate],
    }


def min_cosine(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """The smallest row-wise cosine similarity of two ``[n, hidden]`` embedding matrices."""
    return float(F.cosine_similarity(reference.float(), candidate.float(), dim=-1).min())


def batched(items: Sequence[list[int]], size: int) -> list[list[list[int]]]:
    """``items`` in consecutive batches of at most ``size``."""
    return [list(items[i : i + size]) for i in range(0, len(items), size)]
