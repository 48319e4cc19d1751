"""The systems the engine benchmark times, each as ``run_*(engines, prompts, max_new_tokens)``.

- ``sequential``: stock Hugging Face ``generate``, one request at a time.
- ``static_<n>``: stock ``generate`` on left-padded batches of ``n`` requests, in arrival order.
- ``hf_continuous``: Hugging Face's own continuous batching, ``model.generate_batch``, with every
  request submitted at once (only where the installed transformers has it: :func:`has_generate_batch`).
- ``sluice``: Sluice's continuous batcher with all requests submitted at once, stepped in the
  calling thread until every request has finished, with a :class:`bench.step_trace.StepTrace`.

Every request is greedy and produces exactly ``max_new_tokens`` tokens (end-of-sequence ignored),
so the systems do the same work. Each run starts with an untimed warm-up; the timed wall clock
includes prefill.

torch, transformers and the batching core are imported when a system runs, so the CLI can list
this module's names without loading them.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from bench.step_trace import FORWARD_SHARE_NUM_SEQS, StepTrace
from models.loader import LoadedModel

SLUICE_MAX_NUM_SEQS = 64
SLUICE_MAX_NUM_BATCHED_TOKENS = 2048
SLUICE_BLOCK_SIZE = 16
WARM_UP_PROMPT_TOKENS = 16
WARM_UP_NEW_TOKENS = 2
PROGRESS_EVERY_REQUESTS = 16


@dataclass(frozen=True)
class SystemResult:
    """One system's timed run.

    ``outputs`` holds the generated token ids of each request, in arrival order;
    ``wall_s`` the wall time from the first submission to the last token, in seconds;
    ``cpu_s`` the CPU time this process spent meanwhile, all threads, in seconds;
    ``num_threads`` the torch intra-op threads it ran with;
    ``trace`` the per-step samples of a Sluice run (``None`` for the other systems);
    ``share_trace`` those of Sluice's untimed probe with exactly ``FORWARD_SHARE_NUM_SEQS``
    requests, whose decode steps all run that many sequences (``None`` for the other systems).
    """

    outputs: list[list[int]]
    wall_s: float
    cpu_s: float
    num_threads: int
    trace: StepTrace | None = None
    share_trace: StepTrace | None = None

    @property
    def cpu_busy_fraction(self) -> float:
        """Process CPU seconds per wall second per torch thread (near 1: the cores were ours)."""
        return self.cpu_s / (self.wall_s * self.num_threads)

    @property
    def num_requests(self) -> int:
        return len(self.outputs)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per wall second."""
        return self.num_generated_tokens / self.wall_s


@dataclass
class Engines:
    """What the systems run on: the model as Sluice loads it, and a stock Hugging Face copy.

    The stock copy (SDPA attention, ``dtype`` weights on the loaded model's device, left-padding
    tokenizer) is loaded from ``loaded.folder`` on first use, so a run without baselines never
    loads it. ``progress`` receives a line now and then during long runs. ``max_num_seqs`` bounds
    the sequences of one step of ``sluice`` and ``hf_continuous``; ``sequential_prompts`` (``None``:
    all) is how many of the prompts ``sequential`` times; ``runner_options`` are extra keyword
    arguments of Sluice's :class:`~models.causal_lm.CausalLMRunner` (:func:`runner_options`).
    """

    loaded: LoadedModel
    progress: Callable[[str], None] = lambda message: None
    dtype: str = "float32"
    max_num_seqs: int = SLUICE_MAX_NUM_SEQS
    sequential_prompts: int | None = None
    runner_options: dict[str, Any] = field(default_factory=dict)
    _baseline: tuple[Any, Any] | None = field(default=None, repr=False)

    def baseline(self) -> tuple[Any, Any]:
        """``(model, tokenizer)`` of stock Hugging Face, loaded once."""
        if self._baseline is None:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            folder = self.loaded.folder
            dtype = getattr(torch, self.dtype)
            model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
            model.to(self.loaded.device)
            tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            self._baseline = (model.eval(), tokenizer)
        return self._baseline


def runner_options(device: str, max_num_seqs: int) -> dict[str, Any]:
    """Sluice's runner options for ``device``: on a GPU, decode CUDA graphs at the batch sizes a
    bucket of ``max_num_seqs`` captures (:func:`models.cuda_graphs.capture_sizes`), as a served
    bucket on a ``cuda`` slice does by default; none on a CPU."""
    from models.cuda_graphs import capture_sizes

    return {"cuda_graph_sizes": capture_sizes(max_num_seqs)} if device.startswith("cuda") else {}


def run_sequential(engines: Engines, prompts: list[list[int]], max_new_tokens: int) -> SystemResult:
    """Stock ``generate`` on one request at a time, on the first ``engines.sequential_prompts``."""
    return run_static(engines, prompts[: engines.sequential_prompts], max_new_tokens, batch_size=1)


def run_static(engines: Engines, prompts: list[list[int]], max_new_tokens: int, *, batch_size: int) -> SystemResult:
    """Stock ``generate`` on left-padded batches of ``batch_size`` requests, in arrival order."""
    model, tokenizer = engines.baseline()
    _hf_generate(model, tokenizer, [p[:WARM_UP_PROMPT_TOKENS] for p in prompts[:2]], WARM_UP_NEW_TOKENS)
    outputs: list[list[int]] = []
    clock = _Stopwatch()
    for first in range(0, len(prompts), batch_size):
        outputs.extend(_hf_generate(model, tokenizer, prompts[first : first + batch_size], max_new_tokens))
        if len(outputs) % PROGRESS_EVERY_REQUESTS == 0 or len(outputs) == len(prompts):
            engines.progress(f"  {len(outputs)}/{len(prompts)} requests done, {clock.wall_s():.1f} s")
    return clock.result(outputs)


def _hf_generate(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy ``generate`` of exactly ``max_new_tokens`` per prompt; returns the new token ids.

    ``min_new_tokens`` is how Hugging Face ignores end-of-sequence: it bans EOS until the limit.
    """
    import torch

    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(model.device)
    with torch.inference_mode():
        sequences = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return sequences[:, batch["input_ids"].shape[1] :].tolist()


def has_generate_batch() -> bool:
    """Whether the installed transformers has continuous batching (``generate_batch`` on its models).

    Imports transformers' generation module, so the engine asks only when it is about to run.
    """
    from transformers import GenerationMixin

    return hasattr(GenerationMixin, "generate_batch")


def run_hf_continuous(engines: Engines, prompts: list[list[int]], max_new_tokens: int) -> SystemResult:
    """Hugging Face's continuous batching: ``generate_batch`` on every request at once.

    It runs on the stock copy, whose SDPA attention transformers' continuous batching reads from
    its paged cache (flash attention, its other choice, needs CUDA). The manager is kept from the
    warm-up to the timed call (``persistent_manager``), so its KV cache is allocated before the clock
    starts, as Sluice's pool is, and destroyed after the run.
    """
    model, _ = engines.baseline()
    config = _hf_continuous_config(prompts, max_new_tokens, engines.max_num_seqs)
    try:
        _hf_generate_batch(model, config, [p[:WARM_UP_PROMPT_TOKENS] for p in prompts[:2]], WARM_UP_NEW_TOKENS)
        clock = _Stopwatch()
        outputs = _hf_generate_batch(model, config, prompts, max_new_tokens)
        return clock.result(outputs)
    finally:
        model.destroy_cached_continuous_batching_manager()


def _hf_continuous_config(prompts: list[list[int]], max_new_tokens: int, max_num_seqs: int) -> Any:
    """Sluice's budgets in transformers' terms: a pool roomy enough that nothing is evicted, at
    most ``max_num_seqs`` requests and ``SLUICE_MAX_NUM_BATCHED_TOKENS`` tokens a step.

    Everything the manager would otherwise infer is set here: from free memory (the pool; on CPU
    60% of RAM), or from the first call's requests (the persistent manager's request limit).
    Transformers before 5.2x names the page ``block_size`` and has no ``auto_switch_to_flash``
    (5.17, on the lent GPU machine): the fields are named as the installed version has them.
    """
    from transformers import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page_field = "page_size" if "page_size" in fields else "block_size"
    page_size = getattr(ContinuousBatchingConfig, page_field)
    options: dict[str, Any] = {
        page_field: page_size,
        "num_blocks": roomy_num_blocks(prompts, max_new_tokens, page_size),
        "max_batch_tokens": SLUICE_MAX_NUM_BATCHED_TOKENS,
        "max_requests_per_batch": max_num_seqs,
        "max_blocks_per_request": 0,  # the decode fast path needs flash attention on CUDA
        "safety_margin": 0.0,  # admit while blocks last, as Sluice does
    }
    if "auto_switch_to_flash" in fields:
        options["auto_switch_to_flash"] = False
    return ContinuousBatchingConfig(**options)


def _hf_generate_batch(model: Any, config: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy ``generate_batch`` of exactly ``max_new_tokens`` per prompt; returns the new token ids.

    ``eos_token_id=-1`` is how transformers' continuous batching ignores end-of-sequence: EOS may be
    chosen and generation goes on, as Sluice's ``ignore_eos`` (``generate``'s ``min_new_tokens``
    instead bans EOS).

    Raises:
        RuntimeError: a request failed, went missing, or returned another number of tokens.
    """
    from transformers import GenerationConfig

    generation = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1)
    results = model.generate_batch(
        prompts, generation_config=generation, continuous_batching_config=config, persistent_manager=True
    )
    outputs = [list(r.generated_tokens) for r in results.values()]
    bad = [(i, len(r.generated_tokens), r.error) for i, r in enumerate(results.values())
           if r.error is not None or len(r.generated_tokens) != max_new_tokens]
    if len(outputs) != len(prompts) or bad:
        raise RuntimeError(
            f"generate_batch returned {len(outputs)}/{len(prompts)} results; bad (index, tokens, error): {bad[:3]}"
        )
    return outputs


def run_sluice(engines: Engines, prompts: list[list[int]], max_new_tokens: int) -> SystemResult:
    """Sluice's continuous batcher: submit every request at once, step until all have finished."""
    from models.causal_lm import CausalLMRunner

    num_blocks = roomy_num_blocks(prompts, max_new_tokens)
    runner = CausalLMRunner(engines.loaded.model, num_blocks, SLUICE_BLOCK_SIZE, **engines.runner_options)
    if engines.runner_options.get("cuda_graph_sizes"):
        runner.warm_up([(1, 1)])  # captures the decode graphs, untimed, as a served bucket's warm-up does
    generate = functools.partial(sluice_generate, runner, engines.loaded, max_num_seqs=engines.max_num_seqs)
    generate([p[:WARM_UP_PROMPT_TOKENS] for p in prompts[:2]], WARM_UP_NEW_TOKENS)
    trace = StepTrace.around(runner)
    clock = _Stopwatch()
    outputs = generate(prompts, max_new_tokens, trace)
    result = clock.result(outputs, trace)
    # Untimed probe for the forward share at exactly FORWARD_SHARE_NUM_SEQS running sequences:
    # the timed run's running count jumps past it as prompts join and leave together.
    share_trace = StepTrace.around(runner)
    generate(prompts[:FORWARD_SHARE_NUM_SEQS], max_new_tokens, share_trace)
    return dataclasses.replace(result, share_trace=share_trace)


def roomy_num_blocks(prompts: list[list[int]], max_new_tokens: int, block_size: int = 16) -> int:
    """Blocks for every request at full length at once: a pool in which nothing is preempted."""
    return sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts)


class _Stopwatch:
    """Wall and process CPU time since it was made."""

    def __init__(self) -> None:
        self._wall_started = time.perf_counter()
        self._cpu_started = time.process_time()

    def wall_s(self) -> float:
        return time.perf_counter() - self._wall_started

    def result(self, outputs: list[list[int]], trace: StepTrace | None = None) -> SystemResult:
        """The timed result of a run that produced ``outputs`` (traced by ``trace``), stopped now."""
        import torch

        cpu_s = time.process_time() - self._cpu_started
        num_threads = torch.get_num_threads()
        return SystemResult(outputs=outputs, wall_s=self.wall_s(), cpu_s=cpu_s, num_threads=num_threads, trace=trace)


class _Collector:
    """Gathers each request's tokens from its events; notes errors and finished requests."""

    def __init__(self, num_requests: int):
        self.outputs: list[list[int]] = [[] for _ in range(num_requests)]
        self.num_finished = 0
        self.errors: list[Exception] = []

    def sink(self, index: int) -> Callable[[Any], None]:
        """The event sink of request ``index``."""
        return functools.partial(self._on_event, index)

    def _on_event(self, index: int, event: Any) -> None:
        error = getattr(event, "error", None)  # an ErrorEvent: the request failed and is finished
        if error is not None:
            self.errors.append(error)
            self.num_finished += 1
            return
        self.outputs[index].extend(event.token_ids)
        self.num_finished += event.finish_reason is not None


def sluice_generate(
    runner: Any, loaded: LoadedModel, prompts: list[list[int]], max_new_tokens: int, trace: StepTrace | None = None,
    *, max_num_seqs: int = SLUICE_MAX_NUM_SEQS, params: Any = None,
) -> list[list[int]]:
    """Run ``prompts`` through a fresh continuous batcher on ``runner`` (at most ``max_num_seqs``
    sequences a step) with sampling ``params`` (a :class:`models.step_io.SamplingParams`;
    ``None``: greedy); return the new token ids.

    With a ``trace`` (made around ``runner``), the batcher runs on ``trace.runner`` and every step
    is recorded in it.

    Raises:
        RuntimeError: a request failed, or the batcher went idle before every request finished.
    """
    from buckets.continuous import ContinuousBatcher
    from buckets.request import GenerationRequest
    from buckets.settings import ContinuousBatcherSettings
    from models.step_io import SamplingParams

    settings = ContinuousBatcherSettings(max_num_seqs, SLUICE_MAX_NUM_BATCHED_TOKENS, SLUICE_BLOCK_SIZE)
    stepped_runner = runner if trace is None else trace.runner
    batcher = ContinuousBatcher(stepped_runner, settings, loaded.tokenizer, loaded.eos_token_ids)
    step = batcher.step if trace is None else functools.partial(trace.step, batcher)
    collector = _Collector(len(prompts))
    for index, prompt in enumerate(prompts):
        batcher.submit(
            GenerationRequest(
                request_id=f"bench-{index}",
                prompt_token_ids=prompt,
                sink=collector.sink(index),
                max_tokens=max_new_tokens,
                params=SamplingParams(temperature=0.0) if params is None else params,
                ignore_eos=True,
            )
        )
    while collector.num_finished < len(prompts):
        if batcher.seconds_until_ready(0.0) is None:
            raise RuntimeError(f"batcher idle with {len(prompts) - collector.num_finished} requests unfinished")
        step()
        if collector.errors:
            raise RuntimeError(f"sluice request failed: {collector.errors[0]!r}") from collector.errors[0]
    # One more step hands the finished sequences' ids to the runner, which drops their sampler
    # state (a few dict removals, no forward).
    step()
    return collector.outputs


SYSTEMS: dict[str, Callable[[Engines, list[list[int]], int], SystemResult]] = {
    "sequential": run_sequential,
    "static_8": functools.partial(run_static, batch_size=8),
    "static_32": functools.partial(run_static, batch_size=32),
    "hf_continuous": run_hf_continuous,
    "sluice": run_sluice,
}
