"""Gate measurements for a decoder backend: step latency at a bucket's shapes and greedy-token
equality with eager, both through :class:`models.causal_lm.CausalLMRunner`.

Latency shapes are ``(num_sequences, num_tokens)`` steps: ``(1, N)`` a prefill of N tokens,
``(B, 1)`` B decodes, each at a context of ``context_tokens`` (the K/V read is whatever the
pool holds: only the time counts). Accuracy runs every prompt greedily for ``max_new_tokens``
tokens, all prompts packed in the same steps, as the continuous batcher does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from models.backends.base import BackendUnavailableError
from models.backends.measure import ALWAYS_IDLE, IdleGuard, interleaved_times_ms, latency_fields
from models.causal_lm import CausalLMRunner
from models.step_io import ForwardInput, SamplingParams, SequenceInput

GREEDY = SamplingParams(temperature=0.0)


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def step_sequences(shape: Sequence[int], context_tokens: int, block_size: int) -> list[SequenceInput]:
    """The sequences of one timed step of ``shape``, with block tables that never overlap."""
    num_seqs, num_tokens = shape
    position = context_tokens if num_tokens == 1 else 0
    per_seq = _blocks(position + num_tokens, block_size)
    return [
        SequenceInput(i, [1] * num_tokens, position, list(range(i * per_seq, (i + 1) * per_seq)), False, GREEDY)
        for i in range(num_seqs)
    ]


def greedy_tokens(runner: Any, prompts: Sequence[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (packed: all prefills in one step, then decodes)."""
    block_size = runner.kv_cache.block_size
    tables, start = [], 0
    for prompt in prompts:
        count = _blocks(len(prompt) + max_new_tokens, block_size)
        tables.append(list(range(start, start + count)))
        start += count
    outputs: list[list[int]] = [[] for _ in prompts]
    steps = [SequenceInput(i, list(p), 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)]
    for _ in range(max_new_tokens):
        sampled = runner.run(ForwardInput(steps)).sampled_token_ids
        for i in range(len(prompts)):
            outputs[i].append(sampled[i])
        steps = [SequenceInput(i, [outputs[i][-1]], len(p) + len(outputs[i]) - 1, tables[i], True, GREEDY) for i, p in enumerate(prompts)]
    runner.run(ForwardInput([], released_seq_ids=list(range(len(prompts)))))
    return outputs


def measure_decoder(
    model: Any,
    shapes: Sequence[Sequence[int]],
    context_tokens: int,
    block_size: int,
    candidates: Sequence[str],
    repeats: int,
    prompts: Sequence[list[int]],
    max_new_tokens: int = 16,
    guard: IdleGuard = ALWAYS_IDLE,
) -> list[dict[str, Any]]:
    """Gate figures for each decoder candidate (``compiled``) against eager; each build, timed
    round and accuracy run starts when ``guard`` says idle (:mod:`models.backends.measure`).

    Returns:
        One dict per candidate: ``backend``, ``quantized`` (False), the latency figures of
        :func:`models.backends.measure.latency_fields`, ``tokens_identical``, ``build_s``,
        ``warm_up_s``; or ``error`` when it could not be built or run.
    Raises:
        GateCancelledError: from ``guard``.
    """
    timed = max(sum(_blocks((context_tokens if n == 1 else 0) + n, block_size) * s for s, n in shapes), 1)
    accuracy = sum(_blocks(len(p) + max_new_tokens, block_size) for p in prompts)
    num_blocks = max(timed, accuracy)
    tuples = [(int(s), int(n)) for s, n in shapes]
    runners = {"eager": CausalLMRunner(model, num_blocks, block_size)}
    results: dict[str, dict[str, Any]] = {}
    for label in candidates:
        results[label] = {"backend": label, "quantized": False}
        guard.wait_until_idle()
        try:
            started = time.perf_counter()
            runner = CausalLMRunner(model, num_blocks, block_size, backend=label)
            results[label]["build_s"] = round(time.perf_counter() - started, 3)
            results[label]["warm_up_s"] = round(runner.warm_up(tuples), 3)
            runners[label] = runner
        except (BackendUnavailableError, ValueError) as exc:
            results[label]["error"] = str(exc)
    steps = [step_sequences(shape, context_tokens, block_size) for shape in tuples]
    calls = {name: (lambda i, r=r: r.run(ForwardInput(steps[i]))) for name, r in runners.items()}
    with torch.inference_mode():
        times = interleaved_times_ms(calls, len(tuples), repeats, guard)
    guard.wait_until_idle()
    reference = greedy_tokens(runners["eager"], prompts, max_new_tokens)
    for name, runner in runners.items():
        if name == "eager":
            continue
        guard.wait_until_idle()
        try:
            results[name]["tokens_identical"] = greedy_tokens(runner, prompts, max_new_tokens) == reference
        except Exception as exc:  # a backend failing at run time is refused, with the reason
            results[name]["error"] = f"{type(exc).__name__}: {exc}"
            continue
        results[name].update(latency_fields(times["eager"], times[name]))
    return list(results.values())
