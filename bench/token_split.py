"""Where a generated token's time goes at concurrency 1 in the real batcher path, per decoder kind.

``python -m bench.token_split [--kinds eager,lean-int4] [--tokens N] [--repeats N] [--temperature T]``

A :class:`buckets.continuous.ContinuousBatcher` steps one request at a time (``ignore_eos``,
``--tokens`` tokens, a 32-token prompt) on a real :class:`models.causal_lm.CausalLMRunner` with
the SmolLM2 tokenizer, as a bucket's worker does. Each decode step (the prefill step left out) is
cut by clock reads (``time.perf_counter_ns``) around the runner's calls into five shares, in
milliseconds per token:

- ``forward_ms``: the decoder and the LM head (the runner's ``_forward`` and ``_logits``);
- ``sampling_ms``: :func:`models.sampling.sample` (greedy: one argmax; else the sampler);
- ``runner_other_ms``: the rest of ``run()``: ordering, the row index, generators, histories;
- ``batcher_ms``: the step outside ``run()``: schedule, ``ForwardInput``, postprocess, the output
  stage (detokenizing, the token event);
- ``step_ms``: the whole step (the sum of the four).

Medians over the decode steps of ``--repeats`` requests per kind; kinds alternate request by
request so every ratio compares runs side by side. What this leaves out is the server's share
(the slice thread's turn-taking, the hop to the event loop, the HTTP stream, the GIL shared with
the event loop): ``sluice bench load --concurrency 1`` against a server gives the whole TPOT.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.decode_split import BLOCK_SIZE, SOURCE
from buckets.continuous import ContinuousBatcher
from buckets.request import GenerationRequest, RequestEvent
from buckets.settings import ContinuousBatcherSettings
import models.causal_lm as causal_lm
from models.step_io import SamplingParams

PROMPT = "Tell me a long story about a cat who learns to sail across the sea."
SHARES = ("forward_ms", "sampling_ms", "runner_other_ms", "batcher_ms", "step_ms")


class _Clock:
    """Nanoseconds spent inside the wrapped callables since the last :meth:`take`."""

    def __init__(self) -> None:
        self.spent_ns: dict[str, int] = {"forward": 0, "sampling": 0, "run": 0}

    def wrap(self, share: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent_ns[share] += time.perf_counter_ns() - started
        return timed

    def take(self) -> dict[str, int]:
        spent, self.spent_ns = self.spent_ns, dict.fromkeys(self.spent_ns, 0)
        return spent


class _Finished:
    """A request sink that notes when the request's last event came."""

    def __init__(self) -> None:
        self.done = False

    def __call__(self, event: RequestEvent) -> None:
        if getattr(event, "finish_reason", None) is not None:
            self.done = True


def build(kind: str, loaded: Any, clock: _Clock, num_blocks: int) -> ContinuousBatcher:
    """A batcher on a ``kind`` runner whose forward, LM head, sampler and ``run`` add to ``clock``."""
    tokenizer = loaded.tokenizer
    runner = causal_lm.CausalLMRunner(
        loaded.model, num_blocks, BLOCK_SIZE, backend=kind, tokenizer=tokenizer, eos_token_ids=loaded.eos_token_ids
    )
    runner._forward = clock.wrap("forward", runner._forward)  # type: ignore[method-assign]
    runner._logits = clock.wrap("forward", runner._logits)  # type: ignore[method-assign]
    runner.run = clock.wrap("run", runner.run)  # type: ignore[method-assign]
    settings = ContinuousBatcherSettings(max_num_seqs=1, max_num_batched_tokens=512, block_size=BLOCK_SIZE)
    return ContinuousBatcher(runner, settings, tokenizer, loaded.eos_token_ids)


def run_request(batcher: ContinuousBatcher, clock: _Clock, prompt_ids: list[int], tokens: int, temperature: float) -> list[dict[str, float]]:
    """Generate ``tokens`` tokens for one request; the shares of each decode step, in ms."""
    sink = _Finished()
    batcher.submit(GenerationRequest(
        request_id="split", prompt_token_ids=prompt_ids, sink=sink, max_tokens=tokens, ignore_eos=True,
        params=SamplingParams(temperature=temperature, seed=0),
    ))
    steps: list[dict[str, float]] = []
    while not sink.done:
        clock.take()
        started = time.perf_counter_ns()
        batcher.step()
        step_ns = time.perf_counter_ns() - started
        spent = clock.take()
        steps.append({
            "forward_ms": spent["forward"] / 1e6,
            "sampling_ms": spent["sampling"] / 1e6,
            "runner_other_ms": (spent["run"] - spent["forward"] - spent["sampling"]) / 1e6,
            "batcher_ms": (step_ns - spent["run"]) / 1e6,
            "step_ms": step_ns / 1e6,
        })
    return steps[1:]  # the first step is the prefill


def measure(kinds: list[str], tokens: int, repeats: int, temperature: float) -> dict[str, dict[str, float]]:
    """``{kind: {share: median ms per token}}`` over the decode steps of ``repeats`` requests per kind."""
    from models.loader import load_model
    from models.source import default_cache_dir

    loaded = load_model("smollm2", SOURCE, "generate", "float32", "cpu", default_cache_dir())
    prompt_ids = loaded.tokenizer.encode(PROMPT)
    num_blocks = -(-(len(prompt_ids) + tokens) // BLOCK_SIZE) + 1
    clock = _Clock()
    causal_lm.sample = clock.wrap("sampling", causal_lm.sample)  # type: ignore[assignment]
    batchers = {kind: build(kind, loaded, clock, num_blocks) for kind in kinds}
    samples: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    for kind in kinds:  # untimed warm-up
        run_request(batchers[kind], clock, prompt_ids, 8, temperature)
    for _ in range(repeats):
        for kind in kinds:
            samples[kind] += run_request(batchers[kind], clock, prompt_ids, tokens, temperature)
    return {kind: {s: statistics.median(step[s] for step in steps) for s in SHARES} for kind, steps in samples.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.token_split", description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="eager,lean-int4", help="decoder kinds, comma-separated (default eager,lean-int4)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request (default 128)")
    parser.add_argument("--repeats", type=int, default=3, help="requests per kind (default 3)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    result = measure(args.kinds.split(","), args.tokens, args.repeats, args.temperature)
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    print(f"load before={load_before} after={load_after} threads={args.threads} temperature={args.temperature}")
    print(f"{'kind':<16}" + "".join(f"{s:>17}" for s in SHARES))
    for kind, shares in result.items():
        print(f"{kind:<16}" + "".join(f"{shares[s]:>17.3f}" for s in SHARES))


if __name__ == "__main__":
    main()
