"""Prometheus metrics (``GET /metrics``), labelled by ``model`` and ``bucket``; the per-request
series (latencies, tokens, ``sluice_tenant_requests`` by outcome) also by ``tenant``: a
configured API key's tenant name, else ``anonymous`` (a key a reload removed while its request
ran included), so clients cannot add series.

Latencies are observed once per finished request from its timeline (:meth:`Metrics.observe_request`,
called where the request is logged); batch shapes once per forward from the worker
(:meth:`Metrics.observe_batch`, a batch observer on each bucket). Counts the core already keeps
(outcomes, preemptions) and current state (queue depth, KV usage, slice busy ratio) are read from
the buckets' stats at scrape time by :class:`EngineCollector`, so the step loop pays nothing for them.

Requests no bucket took (a 400 before routing, a 404, a 503 while the model drains) are counted
by :meth:`Metrics.observe_http` with an empty ``bucket`` label. Embedding (dynamic) buckets export no generation-only series
(time to first token, time per output token, generated tokens, preemptions, KV usage).

Where a streamed token's time goes: continuous buckets add up their steps by phase
(``sluice_step_phase_seconds{phase}``: schedule, forward, sampling, postprocess, output and its
detokenize; over ``sluice_steps``), and the event loop observes each event's hop from the worker
(``sluice_event_hop_seconds``) and its SSE chunk's encoding and write (``sluice_stream_chunk_seconds``);
``sluice bench token-path`` reads them.

Names follow vLLM's where one exists (``time_to_first_token_seconds``, ``e2e_request_latency_seconds``,
``request_queue_time_seconds``, ``kv_cache_usage_ratio``), prefixed ``sluice_``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from buckets.request import GenerationRequest, Request
from buckets.stats import STEP_PHASES
from gateway.outcome import Outcome, outcome_of_status
from gateway.streams import EventTimings
from gateway.tenants import ANONYMOUS_NAME

if TYPE_CHECKING:
    from gateway.engine import Engine
    from gateway.residency import Residency

# The Prometheus text format's media type; litestar adds ``charset=utf-8`` to a text/* type itself.
CONTENT_TYPE = "text/plain; version=0.0.4"
LABELS = ("model", "bucket")
# The series observed once per finished request.
REQUEST_LABELS = (*LABELS, "tenant")
# Seconds: vLLM's TTFT buckets, reaching further for CPU prefills.
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BATCH_TOKENS_BUCKETS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# The gateway's share of a streamed token: microseconds to tens of milliseconds.
EVENT_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0)
# Requests kept per bucket for the dashboards' percentiles.
RECENT_REQUESTS = 1000


@dataclass(frozen=True)
class RequestTiming:
    """One finished request's latencies in seconds (``None`` where it never got that far).

    ``tpot_s`` is time per output token after the first: ``(finished - first_token) / (n - 1)``.
    """

    finished_s: float
    outcome: str
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    queue_s: float | None
    completion_tokens: int


def request_timing(request: Request, completion_tokens: int, outcome: str) -> RequestTiming:
    """Latencies from a request's timeline (``arrival``, ``started``, ``first_token``, ``finished``)."""
    timeline = request.timeline
    arrival = timeline.get("arrival")
    first = timeline.get("first_token")
    finished = timeline.get("finished", first)
    started = timeline.get("started")

    def since(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else max(0.0, end - start)

    tpot = None
    if first is not None and finished is not None and completion_tokens > 1:
        tpot = max(0.0, finished - first) / (completion_tokens - 1)
    return RequestTiming(
        finished_s=finished if finished is not None else (arrival or 0.0),
        outcome=outcome,
        ttft_s=since(arrival, first),
        tpot_s=tpot,
        e2e_s=since(arrival, finished),
        queue_s=since(arrival, started),
        completion_tokens=completion_tokens,
    )


class Metrics:
    """The gateway's metrics, in their own registry (one per app)."""

    def __init__(self, engine: Engine, tenant_names: Callable[[], frozenset[str]] = frozenset):
        """``tenant_names``: the configured tenants' names now (the ``tenant`` label's values
        besides ``anonymous``)."""
        self.registry = CollectorRegistry()
        registry = self.registry
        self.ttft = Histogram(
            "sluice_time_to_first_token_seconds", "Arrival to first token (or embedding).", REQUEST_LABELS,
            buckets=LATENCY_BUCKETS_S, registry=registry,
        )
        self.itl = Histogram(
            "sluice_inter_token_latency_seconds", "Time per output token after the first (TPOT), one per request.",
            REQUEST_LABELS, buckets=ITL_BUCKETS_S, registry=registry,
        )
        self.e2e = Histogram(
            "sluice_e2e_request_latency_seconds", "Arrival to the last token (or embedding).", REQUEST_LABELS,
            buckets=LATENCY_BUCKETS_S, registry=registry,
        )
        self.queue_time = Histogram(
            "sluice_request_queue_time_seconds", "Arrival to leaving the bucket's queue to run.", REQUEST_LABELS,
            buckets=LATENCY_BUCKETS_S, registry=registry,
        )
        self.batch_size = Histogram(
            "sluice_batch_size", "Sequences (or inputs) per forward.", LABELS, buckets=BATCH_SIZE_BUCKETS, registry=registry,
        )
        self.batch_tokens = Histogram(
            "sluice_batch_tokens", "Tokens per forward (padding included).", LABELS,
            buckets=BATCH_TOKENS_BUCKETS, registry=registry,
        )
        self.padding_ratio = Histogram(
            "sluice_padding_ratio", "Padding tokens over all tokens of a dynamic batch.", LABELS,
            buckets=RATIO_BUCKETS, registry=registry,
        )
        self.event_hop = Histogram(
            "sluice_event_hop_seconds", "A request event from the worker's sink call to the event loop running it.",
            buckets=EVENT_BUCKETS_S, registry=registry,
        )
        self.stream_chunk = Histogram(
            "sluice_stream_chunk_seconds", "A streamed event from reaching the event loop to its SSE chunk handed to the connection.",
            buckets=EVENT_BUCKETS_S, registry=registry,
        )
        self.event_timings = EventTimings(self.event_hop.observe, self.stream_chunk.observe)
        self.prompt_tokens = Counter(
            "sluice_prompt_tokens", "Prompt tokens of finished requests.", REQUEST_LABELS, registry=registry
        )
        self.generation_tokens = Counter(
            "sluice_generation_tokens", "Generated tokens of finished requests.", REQUEST_LABELS, registry=registry
        )
        self.tenant_requests = Counter(
            "sluice_tenant_requests", "Finished requests a bucket took, by tenant and outcome.",
            ("model", "tenant", "outcome"), registry=registry,
        )
        self._tenant_names = tenant_names
        self.model_loads = Counter(
            "sluice_model_loads", "Model loads on demand by outcome (ok, failed).", ("model", "outcome"), registry=registry
        )
        self.model_evictions = Counter(
            "sluice_model_evictions", "Models unloaded by reason (lru, idle, admin).", ("model", "reason"), registry=registry
        )
        # Only tenants with quotas are refused: the configured keys' names, a bounded label set.
        self.rate_limited = Counter(
            "sluice_rate_limited", "Requests refused (429) for an API key's quota, by tenant and limit.",
            ("tenant", "limit"), registry=registry,
        )
        self.model_load_seconds = Histogram(
            "sluice_model_load_seconds", "A load on demand, its evictions included, start to serving.", ("model",),
            buckets=LATENCY_BUCKETS_S, registry=registry,
        )
        self._engine = engine
        self._recent: dict[tuple[str, str], deque[RequestTiming]] = {}
        self._unrouted: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        registry.register(EngineCollector(engine, self.unrouted_counts))

    def watch_residency(self, residency: Residency) -> None:
        """Export ``residency``'s resident bytes per model and budgets per scope at scrape time."""
        self.registry.register(ResidencyCollector(residency))

    def observe_model_load(self, model: str, outcome: str, duration_s: float) -> None:
        """Count a load on demand (``outcome`` ok or failed) and its seconds."""
        self.model_loads.labels(model, outcome).inc()
        if outcome == "ok":
            self.model_load_seconds.labels(model).observe(duration_s)

    def observe_model_eviction(self, model: str, reason: str) -> None:
        """Count a model unloaded by ``reason`` (lru, idle, admin)."""
        self.model_evictions.labels(model, reason).inc()

    def observe_rate_limited(self, tenant: str, limit: str) -> None:
        """Count a request of ``tenant`` refused for its ``limit`` (:mod:`gateway.quotas`)."""
        self.rate_limited.labels(tenant, limit).inc()

    def observe_request(self, model: str, request: Request, completion_tokens: int, outcome: str) -> None:
        """Record a finished request (any outcome) once; latencies only where it reached that stage."""
        bucket = request.info.get("bucket")
        if bucket is None:
            return  # refused before routing
        tenant = request.tenant if request.tenant in self._tenant_names() else ANONYMOUS_NAME
        labels = (model, bucket, tenant)
        self.tenant_requests.labels(model, tenant, outcome).inc()
        timing = request_timing(request, completion_tokens, outcome)
        observed = [(self.e2e, timing.e2e_s), (self.queue_time, timing.queue_s)]
        is_generation = isinstance(request, GenerationRequest)
        if is_generation:
            observed += [(self.ttft, timing.ttft_s), (self.itl, timing.tpot_s)]
        for histogram, value in observed:
            if value is not None and (outcome == "ok" or histogram is self.queue_time):
                histogram.labels(*labels).observe(value)
        self.prompt_tokens.labels(*labels).inc(request.num_prompt_tokens)
        if is_generation:
            self.generation_tokens.labels(*labels).inc(completion_tokens)
        with self._lock:
            self._recent.setdefault((model, bucket), deque(maxlen=RECENT_REQUESTS)).append(timing)

    def batch_observer(self, model: str, bucket: str, kind: str) -> Callable[[int, int, int], None]:
        """The observer a bucket's batcher calls after each forward."""
        size = self.batch_size.labels(model, bucket)
        tokens = self.batch_tokens.labels(model, bucket)
        padding = self.padding_ratio.labels(model, bucket) if kind == "dynamic" else None

        def observe(num_seqs: int, num_tokens: int, num_padding_tokens: int) -> None:
            size.observe(num_seqs)
            tokens.observe(num_tokens)
            if padding is not None and num_tokens:
                padding.observe(num_padding_tokens / num_tokens)

        return observe

    def observe_http(self, path: str, status: int, model: str | None, reached_bucket: bool) -> None:
        """Count an API request answered before any bucket took it, with the outcome of its
        ``status`` (404 ``not_found``, 503 ``unavailable``, 499 ``cancelled``, another 4xx
        ``invalid_request``, another 5xx ``error``). Not counted here: requests a bucket took
        (``reached_bucket``) and 429s (their bucket's admission counted them), which the buckets'
        stats count, and answers below 400 (a 429 while the model loads is counted by
        :meth:`observe_load_refusal`). The ``model`` label is the body's model only when it is
        servable, loaded or not (clients cannot add series), else empty."""
        outcome = outcome_of_status(status)
        if reached_bucket or outcome in (Outcome.OK, Outcome.REJECTED) or not path.startswith("/v1/"):
            return
        servable = model is not None and any(m.name == model for m in self._engine.config.models)
        self._count_unrouted(model if servable and model is not None else "", outcome.value)

    def observe_load_refusal(self, model: str) -> None:
        """Count a request refused (429) because too many wait for ``model`` to load."""
        self._count_unrouted(model, Outcome.REJECTED.value)

    def _count_unrouted(self, label: str, outcome: str) -> None:
        with self._lock:
            self._unrouted[(label, outcome)] = self._unrouted.get((label, outcome), 0) + 1

    def unrouted_counts(self) -> dict[tuple[str, str], int]:
        """``(model, outcome) -> count`` of the requests :meth:`observe_http` counted."""
        with self._lock:
            return dict(self._unrouted)

    def recent(self, model: str, bucket: str) -> list[RequestTiming]:
        """The last ``RECENT_REQUESTS`` finished requests of a bucket, oldest first."""
        with self._lock:
            return list(self._recent.get((model, bucket), ()))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class EngineCollector:
    """Reads the buckets' stats at scrape time: request outcomes, preemptions, queue depth, running
    sequences, KV usage, and each slice's busy ratio."""

    def __init__(self, engine: Engine, unrouted_counts: Callable[[], dict[tuple[str, str], int]]):
        self.engine = engine
        self.unrouted_counts = unrouted_counts

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("sluice_requests", "Requests by outcome.", labels=[*LABELS, "outcome"])
        preemptions = CounterMetricFamily("sluice_preemptions", "Sequences preempted (recompute or swap).", labels=list(LABELS))
        swaps = CounterMetricFamily(
            "sluice_kv_swaps", "Preempted sequences whose KV was copied to the host pool (out) or back (in).",
            labels=[*LABELS, "direction"],
        )
        waiting = GaugeMetricFamily("sluice_requests_waiting", "Requests queued, not yet running.", labels=list(LABELS))
        running = GaugeMetricFamily("sluice_requests_running", "Sequences running.", labels=list(LABELS))
        kv_usage = GaugeMetricFamily("sluice_kv_cache_usage_ratio", "KV blocks in use over the pool.", labels=list(LABELS))
        steps = CounterMetricFamily("sluice_steps", "Forwards run (continuous steps, dynamic batches).", labels=list(LABELS))
        phases = CounterMetricFamily(
            "sluice_step_phase_seconds", "Wall seconds of continuous steps by phase (detokenize is part of output).",
            labels=[*LABELS, "phase"],
        )
        for name, served in list(self.engine.models.items()):
            for bucket in served.table.buckets:
                stats = bucket.stats()
                labels = [name, bucket.name]
                for outcome, count in (
                    ("ok", stats.num_finished), ("rejected", stats.num_rejected), ("timeout", stats.num_timed_out),
                    ("cancelled", stats.num_cancelled), ("error", stats.num_failed),
                ):
                    requests.add_metric([*labels, outcome], count)
                waiting.add_metric(labels, stats.num_waiting)
                running.add_metric(labels, stats.num_running)
                steps.add_metric(labels, stats.num_steps)
                if stats.kind == "continuous":
                    preemptions.add_metric(labels, stats.num_preemptions)
                    swaps.add_metric([*labels, "out"], stats.num_swap_outs)
                    swaps.add_metric([*labels, "in"], stats.num_swap_ins)
                    kv_usage.add_metric(labels, stats.kv_usage)
                    for phase in STEP_PHASES:
                        phases.add_metric([*labels, phase], getattr(stats, f"step_{phase}_s"))
        for (model, outcome), count in sorted(self.unrouted_counts().items()):
            requests.add_metric([model, "", outcome], count)
        busy = GaugeMetricFamily("sluice_slice_busy_ratio", "Share of the last 10 s the slice's worker stepped.", labels=["slice"])
        busy_s = CounterMetricFamily("sluice_slice_busy_seconds", "Seconds the slice's worker spent stepping.", labels=["slice"])
        for slice_name, device_slice in self.engine.slices.items():
            busy.add_metric([slice_name], device_slice.busy_ratio())
            busy_s.add_metric([slice_name], device_slice.busy_s)
        yield from (requests, preemptions, swaps, waiting, running, kv_usage, steps, phases, busy, busy_s)


class ResidencyCollector:
    """Reads the residency at scrape time: ``sluice_model_resident_bytes{model}`` (weights and KV
    pools of each loaded model) and ``sluice_memory_budget_bytes{slice}`` (``slice`` empty: the
    gateway's budget)."""

    def __init__(self, residency: Residency):
        self.residency = residency

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        resident = GaugeMetricFamily("sluice_model_resident_bytes", "Bytes a loaded model holds (weights, KV pools).", labels=["model"])
        for model, num_bytes in sorted(self.residency.resident_bytes().items()):
            resident.add_metric([model], num_bytes)
        budget = GaugeMetricFamily("sluice_memory_budget_bytes", "Memory budget in bytes (slice empty: the gateway's).", labels=["slice"])
        for scope, num_bytes in sorted(self.residency.budgets.items()):
            budget.add_metric([scope.removeprefix("slice:") if scope.startswith("slice:") else ""], num_bytes)
        yield from (resident, budget)
