"""The config file's schema (pydantic), validated once at start.

A bad file fails with the field path and the bad value, for example
``models.0.buckets.1.batcher.max_batch_size: Input should be greater than or equal to 1 (got 0)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, model_validator

from gateway.errors import BATCHER_KIND_TAGS, ConfigError

# cpu, cuda:N, or a MIG instance's UUID (as nvidia-smi -L prints it; process slices only).
DEVICE_PATTERN = r"^(cpu|cuda:\d+|MIG-[0-9A-Fa-f-]+)$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RayResourcesConfig(_Strict):
    """What each Ray actor of a slice reserves, and where it may run."""

    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=0.0, ge=0)
    # Custom Ray resources each actor reserves ({"node1": 0.1} pins it to nodes that have "node1").
    custom: dict[str, Annotated[float, Field(gt=0)]] = {}
    # The Ray node (hex id, as `ray status -v` or ray.nodes() shows it) every replica runs on.
    node_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{56}$")


class SliceConfig(_Strict):
    """A device slice: a device and the worker (thread or process) that runs its buckets."""

    name: str = Field(min_length=1)
    device: str = Field(default="cpu", pattern=DEVICE_PATTERN)
    num_threads: int = Field(default=1, ge=1, le=512)
    # Memory for the KV pools of the continuous buckets placed here ("2GiB", "512MiB" or bytes);
    # unset: 2 GiB on a CPU, half the device's memory on a GPU.
    kv_cache_memory_bytes: ByteSize | None = Field(default=None, gt=0)
    # The most steps one bucket runs in a row while another bucket on this slice has work.
    max_consecutive_steps: int = Field(default=4, ge=1, le=10_000)
    # The most memory the weights of the models with buckets here plus their KV pools may take
    # ("6GiB" or bytes); a layout over it is refused at start and by the admin API (422).
    # Unset: only kv_cache_memory_bytes bounds the KV pools.
    memory_budget_bytes: ByteSize | None = Field(default=None, gt=0)
    # thread: the buckets run on a worker thread of the gateway process. process: on a worker
    # process of their own, started and supervised by the gateway (restarted when it dies; its
    # requests in flight get a 503).
    # ray: on Ray actors of the cluster at the top-level ray.address, one per replica (a dead
    # actor is re-created; its requests in flight get a 503).
    isolation: Literal["thread", "process", "ray"] = "thread"
    # isolation: ray only. What each actor reserves; how many actors serve the slice's buckets
    # (each request goes to one, by load and prefix); PACK: Ray's default placement of the
    # actors, SPREAD: over the nodes.
    resources: RayResourcesConfig | None = None
    replicas: int = Field(default=1, ge=1, le=64)
    placement_strategy: Literal["PACK", "SPREAD"] = "PACK"

    @model_validator(mode="after")
    def _check_budget(self) -> "SliceConfig":
        if self.isolation != "ray":
            for key, default in (("resources", None), ("replicas", 1), ("placement_strategy", "PACK")):
                if getattr(self, key) != default:
                    raise ValueError(f"{key}: only a slice with isolation: ray has it (this one has isolation: {self.isolation})")
        if self.device.startswith("MIG-"):
            if self.isolation != "process":
                raise ValueError("isolation: a MIG instance is reached through CUDA_VISIBLE_DEVICES of a worker process; set isolation: process")
            if self.kv_cache_memory_bytes is None:
                raise ValueError("kv_cache_memory_bytes: set it for a MIG slice (its memory is not probed from the gateway)")
        if self.memory_budget_bytes is not None and self.kv_cache_memory_bytes is not None:
            if self.kv_cache_memory_bytes > self.memory_budget_bytes:
                raise ValueError(
                    f"kv_cache_memory_bytes: {int(self.kv_cache_memory_bytes)} is above memory_budget_bytes "
                    f"{int(self.memory_budget_bytes)}"
                )
        return self


class DynamicBatcherConfig(_Strict):
    """Encoder work: a batch leaves at ``max_batch_size`` or after ``max_queue_delay_ms``."""

    kind: Literal["dynamic"]
    max_batch_size: int = Field(default=32, ge=1, le=4096)
    max_queue_delay_ms: float = Field(default=5.0, ge=0, le=60_000)
    # Waiting this many seconds is worth one priority level (effective = priority - waited / aging).
    priority_aging_s: float = Field(default=10.0, gt=0, le=86_400)
    # Batches by priority band, then the tenant with the fewest prompt tokens served per weight,
    # then aging (policies/fair_share.py); off: priority and aging alone, tenants as one.
    fair_share: bool = True
    # A request waiting this long goes into the next batch before priority order.
    max_starvation_s: float = Field(default=10.0, gt=0, le=86_400)


class ContinuousBatcherConfig(_Strict):
    """Generation: iteration-level scheduling with per-step budgets."""

    kind: Literal["continuous"]
    max_num_seqs: int = Field(default=64, ge=1, le=4096)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    block_size: int = Field(default=16, ge=1, le=1024)
    priority_aging_s: float = Field(default=10.0, gt=0, le=86_400)
    # Competing tenants of a priority share the bucket by tokens served, in proportion to their
    # weights (Virtual Token Counter); one under its share of max_num_seqs takes a seat from one
    # over it; a full queue refuses the tenant over its share first (policies/fair_share.py).
    fair_share: bool = True
    # Every admitted sequence computes a token at least this often, whatever arrives after it.
    max_starvation_s: float = Field(default=10.0, gt=0, le=86_400)
    enable_prefix_caching: bool = True
    # Stall-free chunked prefill (Sarathi-Serve): with decodes running, a step takes only the
    # prefill tokens that keep it within tpot_target_ms (None: three times the measured
    # decode-only step, at least four blocks; a set target, at least one block), from a step-time model fit online; fixed: prefill fills max_num_batched_tokens.
    # The per-step target, apart from slo.tpot_p95_ms (which drives the max_num_seqs tuner).
    chunked_prefill: Literal["stall_free", "fixed"] = "stall_free"
    tpot_target_ms: float | None = Field(default=None, gt=0, le=60_000)
    # This bucket's KV pool: explicit bytes, or a fraction of its slice's kv_cache_memory_bytes;
    # neither: an equal share of what the slice's other buckets leave.
    kv_cache_memory_bytes: ByteSize | None = Field(default=None, gt=0)
    kv_cache_memory_fraction: float | None = Field(default=None, gt=0, le=1)
    # A sequence preempted for want of KV blocks: recompute (its KV dropped, recomputed when it
    # resumes), swap (its KV copied to a host pool of swap_space_bytes and back, when it fits),
    # auto (swapped when recomputing costs more than the copy both ways, as measured at start).
    preemption: Literal["recompute", "swap", "auto"] = "recompute"
    swap_space_bytes: ByteSize = Field(default=ByteSize(0), ge=0)
    # Decode steps replayed as CUDA graphs captured at warm-up for batch sizes 1, 2, 4, 8 and
    # every 16th up to max_num_seqs (or the SLO tuner's max_batch when larger); prefill, mixed and
    # LoRA steps run eagerly (models/cuda_graphs.py). None: on for a bucket on a cuda slice, off
    # on a CPU one; true on a CPU slice is an error.
    cuda_graphs: bool | None = None

    @model_validator(mode="after")
    def _one_budget(self) -> "ContinuousBatcherConfig":
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_fraction is not None:
            raise ValueError(
                "kv_cache_memory_fraction: set kv_cache_memory_bytes or kv_cache_memory_fraction, not both "
                f"({self.kv_cache_memory_bytes}, {self.kv_cache_memory_fraction})"
            )
        if self.preemption != "recompute" and self.swap_space_bytes == 0:
            raise ValueError(f"swap_space_bytes: preemption {self.preemption} needs host memory to swap to (got 0)")
        return self

    @property
    def host_swap_bytes(self) -> int:
        """Bytes of the host pool swap preemption allocates: ``swap_space_bytes`` when
        ``preemption`` swaps (``swap`` or ``auto``), else 0 (a ``recompute`` bucket reads no host
        pool, so none is allocated, pinned or zeroed)."""
        return int(self.swap_space_bytes) if self.preemption != "recompute" else 0


BatcherConfig = Annotated[DynamicBatcherConfig | ContinuousBatcherConfig, Field(discriminator="kind")]


class SLOConfig(_Strict):
    """A bucket's latency targets, which the SLO tuner (:mod:`policies.tuning`) keeps by adjusting
    ``max_num_seqs`` (continuous) or ``max_batch_size`` and ``max_queue_delay_ms`` (dynamic)
    within the bounds here."""

    ttft_p95_ms: float | None = Field(default=None, gt=0)
    tpot_p95_ms: float | None = Field(default=None, gt=0)
    min_batch: int = Field(default=1, ge=1, le=4096)
    max_batch: int = Field(default=256, ge=1, le=4096)
    min_queue_delay_ms: int = Field(default=1, ge=1, le=60_000)
    max_queue_delay_ms: int = Field(default=100, ge=1, le=60_000)
    # How often the tuner looks, how many requests must finish under a value before it is judged,
    # and the share of each target kept free before it grows.
    interval_s: float = Field(default=5.0, gt=0, le=3600)
    min_samples: int = Field(default=20, ge=1)
    headroom: float = Field(default=0.2, ge=0, lt=1)

    @model_validator(mode="after")
    def _check(self) -> "SLOConfig":
        if self.ttft_p95_ms is None and self.tpot_p95_ms is None:
            raise ValueError("ttft_p95_ms: set ttft_p95_ms, tpot_p95_ms or both")
        if self.min_batch > self.max_batch:
            raise ValueError(f"min_batch: {self.min_batch} is above max_batch {self.max_batch}")
        if self.min_queue_delay_ms > self.max_queue_delay_ms:
            raise ValueError(f"min_queue_delay_ms: {self.min_queue_delay_ms} is above max_queue_delay_ms {self.max_queue_delay_ms}")
        return self


GateCandidate = Literal[
    "compiled", "onnx-fp32", "onnx-int8", "lean", "lean-int8", "lean-int4", "lean-int8-bf16", "lean-int4-bf16",
    "lean-int8-q8a", "lean-int4-q8a",
]


class BucketConfig(_Strict):
    """Prompts of at most ``max_input_tokens`` tokens (above the previous bucket's limit)."""

    max_input_tokens: int = Field(ge=1)
    batcher: BatcherConfig
    slice: str = Field(min_length=1)
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$")
    # Requests submitted and not yet started beyond these get a 429 with Retry-After at once;
    # max_queued_tokens counts their prompt tokens (None: unlimited).
    max_queue_len: int = Field(default=1024, ge=1)
    max_queued_tokens: int | None = Field(default=None, ge=1)
    # Latency targets kept by adjusting the batch knobs at run time (None: knobs stay as set).
    slo: SLOConfig | None = None
    # How the bucket's forward runs (models/backends): eager; compiled (torch.compile); onnx
    # (ONNX Runtime, embedding models only) with quantization none (FP32) or int8; lean (Sluice's
    # own Llama forward, generation models only) with quantization none, int8 or int4; auto: what
    # the bucket's gate record enabled (`sluice gate`), else eager.
    backend: Literal["eager", "compiled", "onnx", "lean", "auto"] = "eager"
    quantization: Literal["none", "int8", "int4"] = "none"
    # The candidates this bucket's gate measures (`auto` at start, `sluice gate`); None:
    # gate.candidates. A decoder bucket may leave out compiled (minutes of compiling per gate).
    gate_candidates: list[GateCandidate] | None = Field(default=None, min_length=1)
    # How a continuous bucket's KV pool stores K/V (models/kv_cache.py): float32, bfloat16, or
    # int8 with a float32 scale per token and KV head; auto: int8 when the bucket's gate record
    # shows it passes gate.min_kv_greedy_agreement and gate.max_kv_mean_kl_nats, else float32;
    # None: the model's dtype (float32 by default).
    kv_cache_dtype: Literal["float32", "bfloat16", "int8", "auto"] | None = None

    @model_validator(mode="after")
    def _check_kv_cache_dtype(self) -> "BucketConfig":
        if self.kv_cache_dtype is not None and not isinstance(self.batcher, ContinuousBatcherConfig):
            raise ValueError("kv_cache_dtype: only a continuous batcher has a KV cache")
        return self

    @property
    def bucket_name(self) -> str:
        return self.name or f"le{self.max_input_tokens}"


class LoraAdapterConfig(_Strict):
    """One LoRA adapter served over its base model under its own model id."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:/-]+$")
    # A PEFT folder: adapter_config.json + adapter_model.safetensors.
    path: str = Field(min_length=1)


class LoraConfig(_Strict):
    """Many LoRA adapters over one generation model (issue 34): each is a model id of its own,
    run in the base model's buckets, where one step may mix up to ``max_loras`` of them."""

    adapters: list[LoraAdapterConfig] = []
    # Every PEFT folder in this folder is servable under its folder name, read on first use.
    adapters_dir: str | None = None
    # Distinct adapters one step of a bucket may run (the runner's adapter slots).
    max_loras: int = Field(default=8, ge=1, le=1024)
    # The largest adapter rank r served; a larger adapter is refused when it is added or used.
    max_lora_rank: int = Field(default=16, ge=1, le=1024)
    # Adapters kept read in the gateway's memory (least recently used dropped first).
    max_cpu_loras: int = Field(default=32, ge=1, le=100_000)

    @model_validator(mode="after")
    def _check(self) -> "LoraConfig":
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras: {self.max_cpu_loras} is below max_loras {self.max_loras}")
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapters: names must be unique, got {names}")
        return self


# Bucket backends whose runners cannot take LoRA adapters (compiled graphs, ONNX sessions).
NO_LORA_BACKENDS = ("compiled", "onnx")


class ModelConfig(_Strict):
    """One served model."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:/-]+$")
    source: str = Field(min_length=1)
    task: Literal["generate", "embed"]
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    max_model_len: int = Field(ge=2)
    buckets: list[BucketConfig] = Field(min_length=1)
    # The most tokens one request may ask to generate; None: only max_model_len limits it.
    max_tokens_cap: int | None = Field(default=None, ge=1)
    # The most strings in one embeddings request's ``input`` list (OpenAI's limit).
    max_embedding_inputs: int = Field(default=2048, ge=1)
    # The most choices (``n``) one completion or chat request may ask for.
    max_n: int = Field(default=8, ge=1)
    # A request's ``timeout`` when its body sets none, and the most it may set (seconds; None: no
    # default deadline / no cap). Without a body timeout the default is clipped to the cap.
    default_timeout_s: float | None = Field(default=None, gt=0)
    max_timeout_s: float | None = Field(default=None, gt=0)
    # An embedding model trained with Matryoshka representation learning: the sizes its leading
    # components may be cut to (a request's ``dimensions``); None: the model has none.
    matryoshka_dimensions: list[Annotated[int, Field(ge=1)]] | None = Field(default=None, min_length=1)
    # How ``tool_choice: auto`` reads tool calls in the output of a model whose chat template
    # renders tools (gateway/tool_parsers.py): ``hermes`` (``<tool_call>`` JSON blocks) or
    # ``llama3_json`` (JSON objects with name and parameters); None: such output is plain text.
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    # at_start: loaded before the gateway serves (and pinned unless ``pinned: false``);
    # on_demand: loaded by its first request, and evictable (least recently used first) to make
    # room for another within the memory budgets (gateway/residency.py).
    load: Literal["at_start", "on_demand"] = "at_start"
    # Never evicted for another model nor unloaded when idle; None: pinned when load is at_start.
    pinned: bool | None = None
    # Unload the model after this many seconds with no request (Ollama's keep_alive); None: never.
    idle_unload_s: float | None = Field(default=None, gt=0)
    # LoRA adapters served over this model (generation only); None: none.
    lora: LoraConfig | None = None

    @property
    def is_pinned(self) -> bool:
        """Whether eviction and the idle unload leave this model alone."""
        return self.pinned if self.pinned is not None else self.load == "at_start"

    @model_validator(mode="after")
    def _check_buckets(self) -> "ModelConfig":
        limits = [b.max_input_tokens for b in self.buckets]
        if limits != sorted(set(limits)):
            raise ValueError(f"buckets: max_input_tokens must be strictly increasing, got {limits}")
        if limits[-1] != self.max_model_len:
            # Clients read max_model_len as the promise: a prompt up to it must have a bucket.
            raise ValueError(
                f"buckets.{len(limits) - 1}.max_input_tokens: the largest bucket must reach max_model_len "
                f"{self.max_model_len}, got {limits[-1]}"
            )
        if self.matryoshka_dimensions is not None and self.task != "embed":
            raise ValueError(f"matryoshka_dimensions: only an embedding model has them; {self.name} generates")
        names = [b.bucket_name for b in self.buckets]
        if len(set(names)) != len(names):
            raise ValueError(f"buckets: names must be unique, got {names}")
        self._check_lora()
        want = "continuous" if self.task == "generate" else "dynamic"
        for i, b in enumerate(self.buckets):
            if b.batcher.kind != want:
                raise ValueError(f"buckets.{i}.batcher.kind: a {self.task} model needs '{want}', got '{b.batcher.kind}'")
            if b.backend == "onnx" and self.task != "embed":
                raise ValueError(f"buckets.{i}.backend: onnx runs embedding models only; {self.name} generates")
            if b.backend == "lean" and self.task != "generate":
                raise ValueError(f"buckets.{i}.backend: lean runs generation models only; {self.name} embeds")
            quantizing = {"int8": ("onnx", "lean"), "int4": ("lean",)}.get(b.quantization, (b.backend,))
            if b.backend not in quantizing:
                raise ValueError(f"buckets.{i}.quantization: {b.quantization} needs backend {' or '.join(quantizing)}, got {b.backend}")
            if isinstance(b.batcher, ContinuousBatcherConfig) and b.batcher.max_num_batched_tokens < b.batcher.max_num_seqs:
                raise ValueError(
                    f"buckets.{i}.batcher.max_num_batched_tokens: {b.batcher.max_num_batched_tokens} is below "
                    f"max_num_seqs {b.batcher.max_num_seqs}; every running sequence decodes one token per step"
                )
        return self


    def _check_lora(self) -> None:
        if self.lora is None:
            return
        if self.task != "generate":
            raise ValueError(f"lora: only a generation model serves LoRA adapters; {self.name} embeds")
        for i, b in enumerate(self.buckets):
            if b.backend in NO_LORA_BACKENDS:
                raise ValueError(f"buckets.{i}.backend: {b.backend} cannot run LoRA adapters (lora is set); use eager, lean or auto")
        if self.name in {a.name for a in self.lora.adapters}:
            raise ValueError(f"lora.adapters: an adapter is named like its base model {self.name!r}")


class GateConfig(_Strict):
    """What a backend must show at a bucket's shapes before ``auto`` enables it
    (:mod:`policies.gating`), and how the gate measures."""

    min_speedup: float = Field(default=1.2, ge=1.0)
    min_cosine: float = Field(default=0.999, gt=0, le=1)
    min_cosine_quantized: float = Field(default=0.99, gt=0, le=1)
    min_top1_agreement: float = Field(default=0.99, gt=0, le=1)
    # What a lossy decoder kind (lean-int8, the -bf16 kinds, lean-int4 from a float folder) must
    # show against eager, teacher-forced along eager's greedy tokens, besides min_top1_agreement.
    max_mean_kl_nats: float = Field(default=0.02, gt=0)
    # What an int8 KV pool must show against float32 KV for kv_cache_dtype auto
    # (models/kv_accuracy.py): greedy agreement up to the first divergence, and mean KL.
    min_kv_greedy_agreement: float = Field(default=0.99, gt=0, le=1)
    max_kv_mean_kl_nats: float = Field(default=0.02, gt=0)
    # Two-sided level of the bootstrap interval of the per-repeat speed-ups whose lower end
    # must reach min_speedup (policies/gating.py).
    confidence: float = Field(default=0.95, ge=0.5, lt=1)
    # Timed runs per backend and shape, interleaved across backends: each repeat is one paired
    # sample of the speed-up (their medians are what the tables show).
    repeats: int = Field(default=7, ge=1, le=1000)
    # Candidates an auto bucket is gated over (those a model's task cannot run are skipped: the
    # onnx kinds are encoders only, compiled both, the lean kinds decoders only). The -bf16
    # kinds are opt-in: no faster than lean-int4 here, and lossy; so are the -q8a kinds (int8
    # activations in prefill: lean-int4-q8a's top-1 agreement on the gate texts was 0.984 here).
    candidates: list[GateCandidate] = ["compiled", "onnx-fp32", "onnx-int8", "lean", "lean-int8", "lean-int4"]
    # With no valid gate record for an auto bucket at start: run the gate then (else: eager).
    run_at_start: bool = True


class StructuredOutputConfig(_Strict):
    """The constraint engine's limits (:mod:`models.structured`)."""

    # Compiled grammars kept per model tokenizer (least recently used dropped first).
    grammar_cache_size: int = Field(default=256, ge=1, le=100_000)
    # Seconds a request's grammar may take to compile before the request is a 400.
    compile_timeout_s: float = Field(default=10.0, gt=0, le=600)


class RayConfig(_Strict):
    """The Ray cluster that the slices with ``isolation: ray`` run on."""

    # auto (the cluster this machine's `ray start` joined), ray://host:port, or the GCS host:port.
    address: str = Field(min_length=1)
    # The Ray namespace of the slices' actors (two gateways on one cluster share it).
    namespace: str = Field(default="sluice", min_length=1)
    # true: the slices' actors are detached and named after the slice and replica: every gateway
    # of the same config on this cluster and namespace shares them, they outlive the gateways,
    # and a restarted gateway attaches to them again instead of loading the models. A detached
    # actor running another config is refused (kill it or use another namespace). false: each
    # gateway owns its actors; they die with it.
    detached: bool = False


class ModelDefaultsConfig(_Strict):
    """The config of a model found in ``models_dir`` (or named by ``sluice serve --model``) with
    no ``models:`` entry of its own (gateway/catalog.py builds its entry from these)."""

    # The slice its buckets run on; None: the first slice.
    slice: str | None = None
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    # None: the model's own context (max_position_embeddings); else at most this many tokens.
    max_model_len: int | None = Field(default=None, ge=2)
    # The buckets' max_input_tokens below max_model_len (which closes the last bucket).
    bucket_max_input_tokens: list[Annotated[int, Field(ge=1)]] = [256]
    load: Literal["at_start", "on_demand"] = "on_demand"
    pinned: bool | None = None
    idle_unload_s: float | None = Field(default=None, gt=0)
    # The batchers of every default bucket (generation: continuous; embedding: dynamic).
    max_num_seqs: int = Field(default=16, ge=1, le=4096)
    max_num_batched_tokens: int = Field(default=512, ge=1)
    max_batch_size: int = Field(default=32, ge=1, le=4096)
    max_queue_delay_ms: float = Field(default=5.0, ge=0, le=60_000)


class ApiKeyConfig(_Strict):
    """One API key of ``auth.api_keys``: its tenant, what it may use, and its quotas.

    The key itself is never written down: ``key_sha256`` is the SHA-256 of the key's UTF-8 text
    in lower-case hex (``sluice keys add NAME`` prints a new key once, with this line).
    """

    # The tenant: access log, request timeline, the ``tenant`` metric label, fair share.
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    key_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    # Model ids and adapter ids this key may use; None: all. Others answer 404 as if unknown.
    models: list[str] | None = None
    # The priority of this tenant's requests that name none (None: 0, as without auth, or max_priority
    # when 0 is more urgent than that); never more urgent than max_priority.
    priority: int | None = None
    # The most urgent priority (the lowest number) a request of this tenant may ask; None: any.
    max_priority: int | None = None
    # Share of a bucket, by tokens served, when tenants compete there (policies/fair_share.py).
    weight: float = Field(default=1.0, gt=0, le=1_000_000)
    # Quotas per gateway (divided by auth.num_gateways); None: no limit. Over one: 429.
    requests_per_minute: int | None = Field(default=None, ge=1)
    # Prompt + generated tokens a minute, generated tokens charged as they are produced.
    tokens_per_minute: int | None = Field(default=None, ge=1)
    max_concurrent_requests: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _priority_within_max(self) -> "ApiKeyConfig":
        if self.priority is not None and self.max_priority is not None and self.priority < self.max_priority:
            raise ValueError(f"priority: {self.priority} is more urgent than the key's max_priority {self.max_priority} "
                             "(lower is more urgent)")
        return self


class AuthConfig(_Strict):
    """API keys on ``/v1/*`` and the tokenizer routes (``Authorization: Bearer <key>``).

    With ``auth`` in the config every such route needs a listed key (401 ``invalid_api_key``
    otherwise); without it nothing changes. ``SLUICE_API_KEYS_FILE`` may name a YAML file holding
    a list of ``api_keys`` entries instead (or besides): it is read at start, on SIGHUP and on
    ``POST /admin/keys/reload``.
    """

    api_keys: list[ApiKeyConfig] = []
    # /metrics, /stats and the dashboard need a key too (any listed key); else they stay open.
    protect_metrics: bool = False
    # Gateways sharing the keys behind one balancer: each enforces limit / num_gateways.
    num_gateways: int = Field(default=1, ge=1, le=10_000)

    @model_validator(mode="after")
    def _unique(self) -> "AuthConfig":
        names = [k.name for k in self.api_keys]
        hashes = [k.key_sha256 for k in self.api_keys]
        if len(set(hashes)) != len(hashes):
            raise ValueError("api_keys: two entries have the same key_sha256")
        if len(set(names)) != len(names):
            raise ValueError(f"api_keys: tenant names must be unique, got {names}")
        return self


class GatewayConfig(_Strict):
    """The whole file: slices, then models whose buckets name those slices."""

    slices: list[SliceConfig] = Field(min_length=1)
    # May be empty when models_dir names the models.
    models: list[ModelConfig] = []
    # Every model file (.gguf) or Hugging Face folder (with config.json) in this folder is
    # servable under its file or folder name, with the config of model_defaults; a models entry
    # of the same name wins.
    models_dir: str | None = None
    model_defaults: ModelDefaultsConfig = ModelDefaultsConfig()
    # The most bytes the resident models' weights and KV pools (draining ones included) may take
    # in this process, over all slices ("12GiB" or bytes); None: 80 % of the machine's RAM.
    # Loading a model past it evicts idle, unpinned models, least recently used first.
    memory_budget_bytes: ByteSize | None = Field(default=None, gt=0)
    # After a failed load, the seconds before a request may try to load the model again (503
    # model_load_failed meanwhile).
    model_load_retry_s: float = Field(default=5.0, ge=0, le=3600)
    cache_dir: str | None = None
    # A larger request body gets a 413 before it is parsed ("2MiB" or bytes).
    max_request_body_bytes: ByteSize = Field(default=ByteSize(2 * 1024 * 1024), gt=0)
    # The ``priority`` values a request may carry (lower is more urgent); outside: 400.
    min_priority: int = -1000
    max_priority: int = 1000
    # Seconds a draining model asks clients to wait (Retry-After on its 503s).
    drain_retry_after_s: int = Field(default=5, ge=1, le=3600)
    # How long an unload waits for admitted requests to finish before failing the rest.
    drain_timeout_s: float = Field(default=120.0, gt=0, le=86_400)
    # With no SLUICE_ADMIN_TOKEN set, open the admin API to loopback clients (else it is off: 404).
    admin_allow_loopback_without_token: bool = False
    gate: GateConfig = GateConfig()
    structured_output: StructuredOutputConfig = StructuredOutputConfig()
    # Absent: no Ray (a slice with isolation: ray is then an error).
    ray: RayConfig | None = None
    # Absent: /v1 is open to every caller (as before); see AuthConfig.
    auth: AuthConfig | None = None

    @model_validator(mode="after")
    def _check_references(self) -> "GatewayConfig":
        self._check_ray()
        if self.min_priority > self.max_priority:
            raise ValueError(f"min_priority: {self.min_priority} is above max_priority {self.max_priority}")
        for k, key in enumerate(self.auth.api_keys if self.auth else []):
            for field_name in ("priority", "max_priority"):
                value = getattr(key, field_name)
                if value is not None and not self.min_priority <= value <= self.max_priority:
                    raise ValueError(
                        f"auth.api_keys.{k}.{field_name}: {value} lies outside [min_priority, max_priority] = "
                        f"[{self.min_priority}, {self.max_priority}]"
                    )
        slice_names = [s.name for s in self.slices]
        if len(set(slice_names)) != len(slice_names):
            raise ValueError(f"slices: names must be unique, got {slice_names}")
        if not self.models and self.models_dir is None:
            raise ValueError("models: name at least one model, or a models_dir to serve models from")
        if self.model_defaults.slice is not None and self.model_defaults.slice not in slice_names:
            raise ValueError(f"model_defaults.slice: unknown slice {self.model_defaults.slice!r}; known: {slice_names}")
        model_names = [m.name for m in self.models]
        if len(set(model_names)) != len(model_names):
            raise ValueError(f"models: names must be unique, got {model_names}")
        self._check_lora(model_names)
        for i, model in enumerate(self.models):
            for j, bucket in enumerate(model.buckets):
                if bucket.slice not in slice_names:
                    raise ValueError(f"models.{i}.buckets.{j}.slice: unknown slice {bucket.slice!r}; known: {slice_names}")
                the_slice = self.slices[slice_names.index(bucket.slice)]
                isolation = the_slice.isolation
                if isinstance(bucket.batcher, ContinuousBatcherConfig) and bucket.batcher.cuda_graphs and the_slice.device == "cpu":
                    raise ValueError(
                        f"models.{i}.buckets.{j}.batcher.cuda_graphs: true needs a GPU slice; bucket {j} is on "
                        f"{bucket.slice!r}, whose device is cpu (got true)"
                    )
                if model.load == "on_demand" and isolation != "thread":
                    raise ValueError(
                        f"models.{i}.load: on_demand needs its buckets on thread slices; bucket {j} is on "
                        f"{bucket.slice!r}, which has isolation: {isolation} (its worker builds its buckets at start)"
                    )
        for index, slice_config in enumerate(self.slices):
            fractions = [b.batcher.kv_cache_memory_fraction or 0.0 for b in self.continuous_buckets(slice_config.name)]
            if sum(fractions) > 1.0 + 1e-9:
                raise ValueError(
                    f"slices.{index}.kv_cache_memory_bytes: the kv_cache_memory_fraction of its buckets add up to "
                    f"more than 1 ({sum(fractions):g})"
                )
        return self

    def _check_lora(self, model_names: list[str]) -> None:
        """Adapter names are model ids: unique among adapters and models; a LoRA model's buckets
        run in this process (its adapters live here)."""
        isolation = {s.name: s.isolation for s in self.slices}
        seen: dict[str, str] = {}
        for i, model in enumerate(self.models):
            if model.lora is None:
                continue
            for j, bucket in enumerate(model.buckets):
                if isolation.get(bucket.slice, "thread") != "thread":
                    raise ValueError(
                        f"models.{i}.lora: LoRA adapters on a slice with isolation: {isolation[bucket.slice]} are not "
                        f"supported yet (bucket {j} is on {bucket.slice!r}; the adapters live in the gateway process)"
                    )
            for k, adapter in enumerate(model.lora.adapters):
                if adapter.name in model_names:
                    raise ValueError(f"models.{i}.lora.adapters.{k}.name: {adapter.name!r} is already a model's name")
                if adapter.name in seen:
                    raise ValueError(
                        f"models.{i}.lora.adapters.{k}.name: {adapter.name!r} is already an adapter of {seen[adapter.name]!r}"
                    )
                seen[adapter.name] = model.name

    def _check_ray(self) -> None:
        """A Ray slice needs ``ray.address``; its buckets' backend is chosen in the actors, so
        not by a gate (``auto``) run from the gateway."""
        ray_slices = {s.name: i for i, s in enumerate(self.slices) if s.isolation == "ray"}
        if ray_slices and self.ray is None:
            first = next(iter(ray_slices.values()))
            raise ValueError(f"slices.{first}.isolation: ray needs the top-level ray.address of the cluster")
        for i, model in enumerate(self.models):
            for j, bucket in enumerate(model.buckets):
                if bucket.slice in ray_slices and bucket.backend == "auto":
                    raise ValueError(f"models.{i}.buckets.{j}.backend: auto is not supported on a slice with isolation: ray")

    def continuous_buckets(self, slice_name: str) -> list[BucketConfig]:
        """The continuous buckets (of every model) placed on slice ``slice_name``, in file order."""
        return [
            b
            for m in self.models
            for b in m.buckets
            if b.slice == slice_name and isinstance(b.batcher, ContinuousBatcherConfig)
        ]


def parse_config(data: object, origin: str = "<config>") -> GatewayConfig:
    """Validate a parsed YAML/JSON document.

    Raises:
        ConfigError: with one line per problem: ``field.path: reason (got value)``.
    """
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            path = ".".join(str(p) for p in err["loc"] if str(p) not in BATCHER_KIND_TAGS)
            if err["type"] == "value_error":
                # Our validators word their own message as "relative.path: reason (value)".
                message = err["msg"].removeprefix("Value error, ")
                lines.append(f"{path}.{message}" if path else message)
                continue
            got = "" if err["type"] == "missing" else f" (got {err.get('input')!r})"
            lines.append(f"{path or '<root>'}: {err['msg']}{got}")
        raise ConfigError(f"{origin}: invalid config\n  " + "\n  ".join(lines)) from None


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a YAML config file.

    Raises:
        ConfigError: unreadable file, bad YAML, or an invalid field (path and value named).
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(data, str(path))
