"""Measurements a backend gate needs: interleaved latencies and accuracy against eager.

Interleaving: each repeat runs every backend once at a shape, in a rotated order, so a drift in
the machine's speed (another process, thermal state) is shared by all backends instead of
landing on whichever ran last. Every repeat's time is kept: repeat ``r`` of two backends ran
side by side, so their ratio is one paired sample of the speed-up (:mod:`policies.gating`
bounds it with a confidence interval); the median of the repeats is what tables show.

Quiet: a gate that runs beside serving measures only while the slice has no requests. Before
each timed round it waits on its :class:`IdleGuard` (which pauses it while requests run), and a
round during which work arrived is discarded and run again, so neither the requests nor the
figures pay for the other.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F


class IdleGuard(Protocol):
    """What a measurement waits on so that it runs only while the machine serves nothing."""

    def wait_until_idle(self) -> None:
        """Block until no request is queued or running where the measurement runs.

        Raises:
            GateCancelledError: the measurement must stop (the gateway is stopping).
        """

    def disturbed(self) -> bool:
        """Whether work arrived since the last :meth:`wait_until_idle` returned (the sample is void)."""


class GateCancelledError(Exception):
    """A measurement was stopped while it waited for the machine to be idle."""


class AlwaysIdle:
    """The guard of a gate that runs alone (``sluice gate``, tests): never waits, never disturbed."""

    def wait_until_idle(self) -> None:
        return None

    def disturbed(self) -> bool:
        return False


ALWAYS_IDLE = AlwaysIdle()


def interleaved_times_ms(
    calls: Mapping[str, Callable[..., object]], num_shapes: int, repeats: int, guard: IdleGuard = ALWAYS_IDLE
) -> dict[str, list[list[float]]]:
    """Wall time in ms of every timed ``calls[name](shape_index)``, per backend, shape and repeat.

    Every call runs once untimed per shape first (warm caches, lazy set-up), then ``repeats``
    timed rounds, the order of backends rotating each round. Each round (warm-up too) starts
    when ``guard`` says idle; a round disturbed by work is discarded and run again.

    Returns:
        ``{name: [[ms of repeat 0, 1, ...] for shape 0, [...] for shape 1, ...]}``.
    Raises:
        GateCancelledError: from ``guard``.
    """
    names = list(calls)
    times: dict[str, list[list[float]]] = {n: [[] for _ in range(num_shapes)] for n in names}
    for shape in range(num_shapes):
        guard.wait_until_idle()
        for name in names:
            calls[name](shape)
        round_index = 0
        while round_index < repeats:
            offset = round_index % len(names)
            sample = quiet_round(lambda name: calls[name](shape), names[offset:] + names[:offset], guard)
            if sample is None:
                continue
            for name, ms in sample.items():
                times[name][shape].append(ms)
            round_index += 1
    return times


def quiet_round(call: Callable[[str], object], order: Sequence[str], guard: IdleGuard) -> dict[str, float] | None:
    """``call(name)`` for each name of ``order`` once the guard says idle, timed in ms; ``None``
    (the round discarded) when work arrived meanwhile: the round stops after the call during
    which it arrived, so a request waits for one call at most.

    Raises:
        GateCancelledError: from ``guard``.
    """
    guard.wait_until_idle()
    sample: dict[str, float] = {}
    for name in order:
        started = time.perf_counter()
        call(name)
        sample[name] = (time.perf_counter() - started) * 1000
        if guard.disturbed():
            return None
    return sample


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
