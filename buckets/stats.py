"""Snapshots of a bucket's counters; the gateway turns them into JSON and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from buckets.request import Request
from policies.step_time import StallFreeBudget

# Called by the worker after every forward with (sequences, tokens, padding tokens); must not block.
BatchObserver = Callable[[int, int, int], None]


@dataclass(frozen=True)
class BucketStats:
    """Counters since the bucket key (model, bucket name) first served, plus the current state.

    A rebuilt bucket (a backend switch, a new layout reusing the name) carries the counters of
    the builds it replaced over (:func:`carry_over`); the fields of :data:`PER_BUILD_FIELDS`
    (the queue and the KV pool) are the current build's alone.

    ``num_steps`` counts forwards (continuous steps or dynamic batches);
    ``num_multi_seq_steps`` those that carried more than one request;
    ``max_batch_seqs`` the most requests in one forward;
    ``num_batched_tokens`` tokens computed (continuous) or padded input tokens (dynamic);
    ``num_padding_tokens`` padding inside dynamic batches.

    Continuous batchers also report their KV pool (``kv_blocks_used`` of ``kv_blocks_total``,
    blocks of ``kv_block_size`` tokens, ``kv_blocks_evictable`` of the free ones still holding
    prefix-cached KV), prefix-cache lookups and hits (in blocks), preemptions (``num_preemptions``, by recompute or
    swap; ``num_swap_outs`` of them swapped to the host pool, ``num_swap_ins`` swapped back), the
    host pool of swap preemption (``swap_blocks_used`` of ``swap_blocks_total``: blocks holding
    swapped-out KV; 0 of 0 without swap), and prefill
    chunks that left part of a prompt for a later step, the most distinct LoRA adapters one step
    held (``max_step_loras``, at most ``max_loras``) and adapters copied into a runner slot
    (``num_lora_loads``), and their step-time model
    (:mod:`policies.step_time`): ``step_time_base_ms + step_time_decode_token_ms * decodes +
    step_time_prefill_token_ms * prefill tokens + step_time_attended_pair_ns / 1e6 * attended
    (query, key) pairs`` fit over ``step_time_samples`` steps (0 before a fit), the step-time target of the last step ``step_target_ms`` (0: none yet, or fixed
    chunking) and its prefill room ``max_prefill_tokens`` (as one chunk at position 0). ``num_timed_out`` counts requests
    dropped because their deadline passed (queued or running). ``num_rejected`` counts requests the
    bucket refused because its queue was full (filled in by the bucket, not the batcher).

    Continuous batchers also add up the wall seconds of their steps by phase
    (:data:`STEP_PHASES`): ``step_schedule_s`` (dropping ended requests, taking new ones,
    planning), ``step_forward_s`` (the runner's ``run`` less its sampling), ``step_sampling_s``,
    ``step_postprocess_s`` (the scheduler's books after the forward) and ``step_output_s`` (text
    and events, of which ``step_detokenize_s`` detokenizing): where a token's time goes outside
    the forward (``sluice bench token-path``).

    ``tokens_served_by_tenant``: tokens computed (prefill chunks and decodes; prompt tokens of
    dynamic batches) by tenant, cumulative: each tenant's service in the bucket's fair share
    (:mod:`policies.fair_share`). Its keys are the tenants seen, which the gateway bounds to
    the configured ones and ``anonymous``.
    """

    kind: str
    num_waiting: int
    num_running: int
    num_steps: int
    num_multi_seq_steps: int
    max_batch_seqs: int
    num_batch_seqs_total: int
    num_batched_tokens: int
    num_padding_tokens: int
    num_finished: int
    num_cancelled: int
    num_failed: int
    num_timed_out: int
    kv_block_size: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_evictable: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    swap_blocks_total: int = 0
    swap_blocks_used: int = 0
    num_chunked_prefills: int = 0
    max_step_loras: int = 0
    num_lora_loads: int = 0
    num_rejected: int = 0
    step_schedule_s: float = 0.0
    step_forward_s: float = 0.0
    step_sampling_s: float = 0.0
    step_postprocess_s: float = 0.0
    step_output_s: float = 0.0
    step_detokenize_s: float = 0.0
    step_time_base_ms: float = 0.0
    step_time_decode_token_ms: float = 0.0
    step_time_prefill_token_ms: float = 0.0
    step_time_attended_pair_ns: float = 0.0
    step_time_samples: int = 0
    step_target_ms: float = 0.0
    max_prefill_tokens: int = 0
    tokens_served_by_tenant: dict[str, int] = field(default_factory=dict)

    @property
    def mean_batch_seqs(self) -> float:
        return self.num_batch_seqs_total / self.num_steps if self.num_steps else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        return self.num_batched_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit blocks over looked-up blocks (0.0 before any lookup)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def kv_usage(self) -> float:
        """Fraction of the pool's blocks held by sequences (0.0 without a pool)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


# The phases of a continuous step, each a BucketStats field ``step_<phase>_s`` (detokenize is part of output).
STEP_PHASES = ("schedule", "forward", "sampling", "postprocess", "output", "detokenize")

# Its step-time model's figures (a gauge each, not a count).
STEP_TIME_FIELDS = frozenset({
    "step_time_base_ms", "step_time_decode_token_ms", "step_time_prefill_token_ms", "step_time_attended_pair_ns",
    "step_time_samples",
    "step_target_ms", "max_prefill_tokens",
})
# The BucketStats fields that describe the current build only: its queue, its KV pool and its
# step-time model. Every other field counts since the bucket key first served.
PER_BUILD_FIELDS = frozenset({
    "kind", "num_waiting", "num_running", "kv_block_size", "kv_blocks_total", "kv_blocks_used", "kv_blocks_evictable",
    "swap_blocks_total", "swap_blocks_used",
}) | STEP_TIME_FIELDS
# Cumulative fields that keep the largest value of the builds rather than their sum.
MAX_FIELDS = frozenset({"max_batch_seqs", "max_step_loras"})
# Cumulative fields counted by key (summed key by key).
BY_KEY_FIELDS = frozenset({"tokens_served_by_tenant"})


def add_by_key(counts: list[dict[str, int]]) -> dict[str, int]:
    """The key-by-key sum of ``counts`` (a :data:`BY_KEY_FIELDS` field over builds or replicas)."""
    total: dict[str, int] = {}
    for count in counts:
        for key, value in count.items():
            total[key] = total.get(key, 0) + value
    return total


def carry_over(previous: BucketStats, current: BucketStats) -> BucketStats:
    """``current`` (a rebuilt bucket's own snapshot) with the cumulative counters of ``previous``
    (those of the builds it replaced) added in: summed, ``max_batch_seqs`` the larger of the two;
    :data:`PER_BUILD_FIELDS` are ``current``'s; :data:`BY_KEY_FIELDS` summed key by key."""
    changes: dict[str, Any] = {}
    for stat in fields(BucketStats):
        if stat.name in PER_BUILD_FIELDS:
            continue
        before, now = getattr(previous, stat.name), getattr(current, stat.name)
        if stat.name in BY_KEY_FIELDS:
            changes[stat.name] = add_by_key([before, now])
        else:
            changes[stat.name] = max(before, now) if stat.name in MAX_FIELDS else before + now
    return replace(current, **changes)


@dataclass
class Counters:
    """The mutable counters behind :class:`BucketStats`; owned by the bucket's worker."""

    num_steps: int = 0
    num_multi_seq_steps: int = 0
    max_batch_seqs: int = 0
    num_batch_seqs_total: int = 0
    num_batched_tokens: int = 0
    num_padding_tokens: int = 0
    num_finished: int = 0
    num_cancelled: int = 0
    num_failed: int = 0
    num_timed_out: int = 0
    step_schedule_s: float = 0.0
    step_forward_s: float = 0.0
    step_sampling_s: float = 0.0
    step_postprocess_s: float = 0.0
    step_output_s: float = 0.0
    observers: list[BatchObserver] = field(default_factory=list, repr=False)

    def count_cancelled(self, request: Request) -> None:
        """Count a request dropped after :meth:`Request.cancel`, as timed out or cancelled by its reason."""
        if request.cancel_reason == "timeout":
            self.num_timed_out += 1
        else:
            self.num_cancelled += 1

    def record_batch(self, num_seqs: int, num_tokens: int, num_padding_tokens: int = 0) -> None:
        self.num_steps += 1
        self.num_multi_seq_steps += num_seqs > 1
        self.max_batch_seqs = max(self.max_batch_seqs, num_seqs)
        self.num_batch_seqs_total += num_seqs
        self.num_batched_tokens += num_tokens
        self.num_padding_tokens += num_padding_tokens
        for observer in self.observers:
            observer(num_seqs, num_tokens, num_padding_tokens)

    def record_phases(self, schedule_s: float, forward_s: float, sampling_s: float, postprocess_s: float, output_s: float) -> None:
        """Add one step's phases, in seconds (:data:`STEP_PHASES`)."""
        self.step_schedule_s += schedule_s
        self.step_forward_s += forward_s
        self.step_sampling_s += sampling_s
        self.step_postprocess_s += postprocess_s
        self.step_output_s += output_s

    def snapshot(self, kind: str, num_waiting: int, num_running: int, **extra: Any) -> BucketStats:
        """A frozen copy of the counters plus the queue state (and ``extra`` :class:`BucketStats` fields)."""
        counts = {k: v for k, v in self.__dict__.items() if k != "observers"}
        return BucketStats(kind=kind, num_waiting=num_waiting, num_running=num_running, **counts, **extra)


def step_time_stats(budget: StallFreeBudget, max_prefill_tokens: int) -> dict[str, Any]:
    """The :data:`STEP_TIME_FIELDS` of a continuous batcher's :class:`BucketStats`."""
    fit = budget.model.fit
    target_s = budget.last_target_s
    return {
        "step_time_base_ms": fit.base_s * 1000 if fit else 0.0,
        "step_time_decode_token_ms": fit.per_decode_token_s * 1000 if fit else 0.0,
        "step_time_prefill_token_ms": fit.per_prefill_token_s * 1000 if fit else 0.0,
        "step_time_attended_pair_ns": fit.per_attended_pair_s * 1e9 if fit else 0.0,
        "step_time_samples": fit.num_samples if fit else 0,
        "step_target_ms": target_s * 1000 if target_s is not None else 0.0,
        "max_prefill_tokens": max_prefill_tokens,
    }
