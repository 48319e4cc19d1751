"""Gate measurements for a decoder backend: step latency at a bucket's shapes and accuracy
against eager, both through :class:`models.causal_lm.CausalLMRunner`.

Latency shapes are ``(num_sequences, num_tokens)`` steps: ``(1, N)`` a prefill of N tokens,
``(B, 1)`` B decodes, each at a context of ``context_tokens`` (the K/V read is whatever the
pool holds: only the time counts). Accuracy runs every prompt greedily for ``max_new_tokens``
tokens, all prompts packed in the same steps, as the continuous batcher does. An exact kind
(:func:`is_lossy` false: ``compiled``, ``lean``, ``lean-int4`` from a GGUF Q4_1 source) must give
eager's greedy tokens, where a prompt first differs a near-tie in eager's log-probabilities (the
two picks within :data:`NEAR_TIE_LOGPROB`, the engine tests' rule after vLLM's
``check_logprobs_close``). A lossy kind is teacher-forced along eager's tokens: the share of
decode steps whose top token is eager's and the mean KL(eager || candidate) in nats (the -q8a
kinds with int8 activations on every prefill of :data:`Q8A_ACCURACY_ROWS` tokens or more, since
the gate's prompts are shorter than their measured threshold). Candidates
run one prompt at a time (a decode step of more rows than the kernel's limit runs float32
products, so packed prompts would measure that exact path, not the one a lone request takes).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from models.backends.base import BackendUnavailableError
from models.backends.measure import ALWAYS_IDLE, IdleGuard, interleaved_times_ms, latency_fields
from models.backends.registry import supports_lora
from models.causal_lm import CausalLMRunner
from models.gguf_blocks import gguf_source
from models.step_io import ForwardInput, SamplingParams, SequenceInput

GREEDY = SamplingParams(temperature=0.0)
# Log-probability gap (nats) under which two picks are a near-tie (tests/e2e/reference.py's rule).
NEAR_TIE_LOGPROB = 1e-3
# Kinds whose weights or activations differ from eager's (lean-int4 too, from a float folder).
LOSSY_KINDS = frozenset({"onnx-int8", "lean-int8", "lean-int8-bf16", "lean-int4-bf16", "lean-int8-q8a", "lean-int4-q8a"})


# The row count from which the -q8a kinds run int8 activations in the accuracy check.
Q8A_ACCURACY_ROWS = 2


def is_lossy(kind: str, model: Any) -> bool:
    """Whether ``kind`` changes ``model``'s numerics beyond float order: the kinds of
    :data:`LOSSY_KINDS`, and ``lean-int4`` unless its source is a GGUF (Q4_1 blocks, exact)."""
    if kind == "lean-int4":
        return gguf_source(Path(str(model.config._name_or_path))) is None
    return kind in LOSSY_KINDS


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


@torch.inference_mode()
def teacher_forced_logprobs(runner: Any, prompts: Sequence[list[int]], continuations: Sequence[list[int]]) -> torch.Tensor:
    """``[steps * num_prompts, vocab]`` float32 log-probabilities of each decode step along
    ``continuations`` (every prompt prefilled in one step, then one packed decode per token),
    grouped by step. All continuations have the same length ``steps``."""
    block_size = runner.kv_cache.block_size
    steps = len(continuations[0])
    tables, start = [], 0
    for prompt in prompts:
        count = _blocks(len(prompt) + steps, block_size)
        tables.append(list(range(start, start + count)))
        start += count
    batch = [SequenceInput(i, list(p), 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)]
    rows = []
    for step in range(steps):
        hidden = runner._forward(batch)[0]
        ends = torch.tensor([len(s.token_ids) for s in batch]).cumsum(0) - 1
        rows.append(torch.log_softmax(runner._logits(hidden[ends]).float(), dim=-1))
        batch = [
            SequenceInput(i, [continuations[i][step]], len(p) + step, tables[i], True, GREEDY) for i, p in enumerate(prompts)
        ]
    return torch.cat(rows)


def logprob_agreement(reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, float]:
    """Teacher-forced agreement of ``candidate`` with ``reference`` (both ``[rows, vocab]``
    log-probabilities): ``top1_agreement`` (share of rows with the same argmax), ``mean_kl_nats``
    and ``max_kl_nats`` (KL(reference || candidate) per row, nats; a row's float32 sum, which
    rounding can take a few 1e-8 below zero where the two nearly agree, is clamped at 0)."""
    kl = (reference.exp() * (reference - candidate)).sum(-1).clamp_min(0.0)
    return {
        "top1_agreement": round(float((candidate.argmax(-1) == reference.argmax(-1)).float().mean()), 4),
        "mean_kl_nats": float(kl.mean()),
        "max_kl_nats": float(kl.max()),
    }


def greedy_near_ties(reference: torch.Tensor, want: Sequence[list[int]], got: Sequence[list[int]]) -> int | None:
    """How many prompts' greedy tokens ``got`` first differ from ``want`` at a near-tie of the
    teacher-forced ``reference`` (``[num_prompts * steps, vocab]``, grouped by prompt, along
    ``want``); ``None`` when one differs by more than :data:`NEAR_TIE_LOGPROB`."""
    ties = 0
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        step = next((j for j, (a, b) in enumerate(zip(w, g)) if a != b), None)
        if step is None:
            continue
        row = reference[i * len(w) + step]
        if abs(float(row[w[step]] - row[g[step]])) >= NEAR_TIE_LOGPROB:
            return None
        ties += 1
    return ties


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
    lora_enabled: bool = False,
) -> list[dict[str, Any]]:
    """Gate figures for each decoder candidate (``compiled``) against eager; each build, timed
    round and accuracy run starts when ``guard`` says idle (:mod:`models.backends.measure`).
    With ``lora_enabled`` (a bucket with ``max_loras > 0``) a kind that cannot run LoRA adapters
    (:func:`models.backends.registry.supports_lora`) is not built: its row has an ``error``, so
    the gate never picks it.

    Returns:
        One dict per candidate: ``backend``, ``quantized`` (:func:`is_lossy`), the latency
        figures of :func:`models.backends.measure.latency_fields`, ``build_s``, ``warm_up_s``,
        and for an exact kind ``tokens_identical`` and ``near_ties``, for a lossy one the
        figures of :func:`logprob_agreement`; or ``error`` when it could not be built or run.
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
        results[label] = {"backend": label, "quantized": is_lossy(label, model)}
        if lora_enabled and not supports_lora(label):
            results[label]["error"] = f"the {label} decoder backend cannot run LoRA adapters (the bucket has max_loras > 0)"
            continue
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
    want = greedy_tokens(runners["eager"], prompts, max_new_tokens)
    reference = _one_at_a_time(runners["eager"], prompts, want)
    for name, runner in runners.items():
        if name == "eager":
            continue
        guard.wait_until_idle()
        try:
            results[name].update(_accuracy(runner, results[name]["quantized"], prompts, want, reference))
        except Exception as exc:  # a backend failing at run time is refused, with the reason
            results[name]["error"] = f"{type(exc).__name__}: {exc}"
            continue
        results[name].update(latency_fields(times["eager"], times[name]))
    return list(results.values())


def _one_at_a_time(runner: Any, prompts: Sequence[list[int]], want: Sequence[list[int]]) -> torch.Tensor:
    """:func:`teacher_forced_logprobs` of each prompt alone, ``[num_prompts * steps, vocab]``
    grouped by prompt."""
    return torch.cat([teacher_forced_logprobs(runner, [p], [w]) for p, w in zip(prompts, want, strict=True)])


def _accuracy(runner: Any, lossy: bool, prompts: Sequence[list[int]], want: Sequence[list[int]], reference: torch.Tensor) -> dict[str, Any]:
    """A candidate's accuracy figures (see :func:`measure_decoder`), each prompt alone;
    ``reference`` eager's :func:`_one_at_a_time` along ``want``."""
    if lossy:
        # The -q8a kinds' int8 activations on every prefill of 2 tokens or more, not only past
        # the threshold measured at build (the gate texts are shorter than it).
        lowered = getattr(runner.primary_backend, "int8_activations_from", None)
        with lowered(Q8A_ACCURACY_ROWS) if lowered is not None else contextlib.nullcontext():
            return logprob_agreement(reference, _one_at_a_time(runner, prompts, want))
    got = [greedy_tokens(runner, [prompt], len(want[0]))[0] for prompt in prompts]
    ties = greedy_near_ties(reference, want, got)
    return {"tokens_identical": ties is not None, "near_ties": ties}
