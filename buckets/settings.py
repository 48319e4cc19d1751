"""Frozen settings the core receives (the gateway validates config files into these)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class DynamicBatcherSettings:
    """A batch leaves when it holds ``max_batch_size`` requests or its oldest request has
    waited ``max_queue_delay_ms`` milliseconds (Triton's dynamic batcher vocabulary). Batches
    are formed by priority band, then (``fair_share``) the tenant with the fewest prompt tokens
    served per weight, then aging (:class:`policies.fair_share.FairQueue`). ``max_starvation_s``
    is kept for the config's symmetry: a dynamic batch never preempts, and aging bounds the wait."""

    max_batch_size: int
    max_queue_delay_ms: float
    priority_aging_s: float = 10.0
    fair_share: bool = True
    max_starvation_s: float = 10.0

    @property
    def max_queue_delay_s(self) -> float:
        return self.max_queue_delay_ms / 1000.0


@dataclass(frozen=True)
class ContinuousBatcherSettings:
    """Per-step budgets of the continuous batcher (vLLM's names): at most ``max_num_seqs``
    running sequences and ``max_num_batched_tokens`` tokens (prefill + decode) in one forward;
    KV in blocks of ``block_size`` tokens, full blocks shared between prompts with a common
    prefix when ``enable_prefix_caching``. Waiting requests are served by effective priority,
    ``priority - waited_s / priority_aging_s`` (see :mod:`policies.priority`); with
    ``fair_share``, competing tenants of a priority share the bucket by tokens served in
    proportion to their weights, and every admitted sequence computes a token at least every
    ``max_starvation_s`` seconds (:mod:`policies.fair_share`).

    ``chunked_prefill``: ``stall_free`` gives a step with decodes running only the prefill tokens
    that keep it within ``tpot_target_ms`` (``None``: three times the measured decode-only step), from
    a step-time model fit online (:mod:`policies.step_time`), never fewer than four blocks
    under the default target (:data:`buckets.continuous.STALL_FREE_MIN_PREFILL_BLOCKS`), one
    under a configured one;
    ``fixed`` lets prefill fill ``max_num_batched_tokens``.

    ``max_loras`` (0: none) is the number of LoRA adapter slots of the runner: the most distinct
    adapters among running sequences, hence in one step (vLLM's ``--max-loras``).

    ``preemption``: how a sequence preempted for want of KV blocks keeps its KV: ``recompute``
    (dropped, recomputed when it resumes), ``swap`` (copied to a host pool of
    ``swap_space_bytes`` and back when the pool has room, else recomputed) or ``auto`` (swapped
    when recomputing would cost more than the copy both ways, by the runner's measured costs:
    :func:`policies.preemption.should_swap`). Both are fixed for a bucket's life."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    priority_aging_s: float = 10.0
    chunked_prefill: Literal["stall_free", "fixed"] = "stall_free"
    tpot_target_ms: float | None = None
    max_loras: int = 0
    preemption: Literal["recompute", "swap", "auto"] = "recompute"
    swap_space_bytes: int = 0
    fair_share: bool = True
    max_starvation_s: float = 10.0

    @property
    def tpot_target_s(self) -> float | None:
        return None if self.tpot_target_ms is None else self.tpot_target_ms / 1000.0
