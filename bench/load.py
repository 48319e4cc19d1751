"""``sluice bench load``: a load sweep against any OpenAI-compatible server.

Each step of a sweep holds one load level: a fixed number of requests in flight (a concurrency
sweep, ``--concurrency 1,2,4``) or arrivals at a mean rate (a rate sweep, ``--rate 1,2,4``) with
gamma-distributed gaps (vLLM's ``--burstiness``: shape ``burstiness``, mean ``1 / rate``; 1 is
Poisson, lower is burstier). Completions and chat requests stream, with ``max_tokens`` set to
their drawn output length, ``ignore_eos`` (Sluice's extension; other servers ignore it) and
``stream_options.include_usage``, and the client times it: TTFT at the first chunk with content,
ITL between content chunks, TPOT as (E2E - TTFT) / (output tokens - 1) with the usage count.
Embeddings (``--endpoint embeddings``) are timed whole: TTFT is E2E, and there is no TPOT.
Sluice's ``x-sluice-bucket``, ``x-sluice-queue-ms`` and ``x-sluice-prefill-ms`` response headers,
where present, give per-bucket attribution. The server's queue depth is sampled from its
``/metrics`` (``sluice_requests_waiting`` or vLLM's ``vllm:num_requests_waiting``) when it has one.

Prompt lengths are counted in words, which common English words make about one token each; the
usage chunk reports the tokens the server actually saw.

Run it as ``sluice bench load --base-url URL --model NAME`` or ``python -m bench.load ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench import load_report
from bench.load_client import ENDPOINTS, Sender, sample_queue_depth
from bench.load_report import RequestResult
SYNTHETIC_WORDS = (
    "the of and to in is was for on that with as by at from his her this which are be had it not "
    "were but have their one all an they has been more who will would there can its time first two "
    "new after other people year world water house city music river school light long great small "
    "under over through between before state work life game line story place power sound system"
).split()


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (``sys.argv[1:]`` when ``None``) and run the sweep; return the exit code."""
    parser = argparse.ArgumentParser(prog="sluice bench load", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the sweep's options to ``parser`` (the CLI's ``bench load`` subparser, or main's)."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default http://127.0.0.1:8000)")
    parser.add_argument("--model", help="model name sent with every request (required unless --from-results)")
    parser.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions", help="default completions")
    sweep = parser.add_mutually_exclusive_group()
    sweep.add_argument("--concurrency", type=_loads, help="requests in flight per step (default 1,2,4,8,16,32,64)")
    sweep.add_argument("--rate", type=_loads, help="mean arrivals/s per step, 'inf' for all at once")
    parser.add_argument("--burstiness", type=_positive_float, default=1.0, help="gamma shape of gaps (1: Poisson)")
    parser.add_argument("--duration", type=_positive_float, default=30.0, help="seconds per step (default 30)")
    parser.add_argument("--num-requests", type=_positive_int, help="requests per step (instead of --duration)")
    parser.add_argument("--prompts-file", type=Path, help="text file cut into prompts (default: synthetic text)")
    parser.add_argument("--input-len", type=_positive_int, default=128, help="prompt words (default 128)")
    parser.add_argument("--input-len-range", type=_fraction, default=0.0, help="uniform +- fraction (default 0)")
    parser.add_argument("--output-len", type=_positive_int, default=64, help="max_tokens (default 64)")
    parser.add_argument("--output-len-range", type=_fraction, default=0.0, help="uniform +- fraction (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default 0)")
    parser.add_argument("--slo-ttft-ms", type=_positive_float, help="goodput: TTFT at most this")
    parser.add_argument("--slo-tpot-ms", type=_positive_float, help="goodput: TPOT at most this")
    parser.add_argument("--knee-gain", type=_positive_float, default=0.10, help="knee: QPS gain below (default 0.10)")
    parser.add_argument("--knee-latency", type=_positive_float, default=0.50, help="knee: p95 TTFT growth above (0.50)")
    parser.add_argument("--output", type=Path, help="folder for results.json and PNG plots")
    parser.add_argument("--baseline", type=Path, help="an earlier results.json; exit 1 on a regression")
    parser.add_argument("--tolerance", type=_positive_float, default=0.10, help="regression tolerance (default 0.10)")
    parser.add_argument("--from-results", type=Path, help="report an earlier results.json instead of running")
    parser.add_argument("--retry", action="store_true", help="retry 429/503 with backoff (default: count them)")
    parser.add_argument("--timeout", type=_positive_float, default=600.0, help="per-request seconds (default 600)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run the sweep (or load ``--from-results``), report it; 0, 1 on a regression, 2 on bad options."""
    problem = _check_args(args)
    if problem is not None:
        print(f"sluice bench load: error: {problem}", file=sys.stderr)
        return 2
    report = json.loads(args.from_results.read_text()) if args.from_results else asyncio.run(run_sweep(args))
    load_name = "rate (req/s)" if report["mode"] == "rate" else "concurrency"
    print(load_report.format_table(report["steps"], load_name, report["knee"]))
    buckets = load_report.format_buckets(report["steps"], load_name)
    if buckets is not None:
        print("\nper bucket (ms):\n" + buckets)
    _print_knees(report)
    if args.output is not None:
        args.output.mkdir(parents=True, exist_ok=True)
        plots = load_report.write_plots(report["steps"], load_name, report["knee"], args.output, report["bucket_knees"])
        report["plots"] = [p.name for p in plots]
        (args.output / "results.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output / 'results.json'} and {', '.join(report['plots'])}")
    return 0 if args.baseline is None else _check_baseline(report, args.baseline, args.tolerance)


def _check_args(args: argparse.Namespace) -> str | None:
    if args.from_results is not None:
        return None
    if not args.model:
        return "--model is required"
    if args.rate is not None and math.inf in args.rate and args.num_requests is None:
        return "--rate inf sends every request at once: give --num-requests"
    return None


def _print_knees(report: dict[str, Any]) -> None:
    knee = report["knee"]
    at = "none" if knee is None else f"{report['steps'][knee]['load']:g}"
    print(f"\nknee: {at}")
    for name, load in report["bucket_knees"].items():
        print(f"knee of bucket {name}: {'none' if load is None else f'{load:g}'}")


def _check_baseline(report: dict[str, Any], path: Path, tolerance: float) -> int:
    baseline = json.loads(path.read_text())
    if baseline.get("mode") != report["mode"]:
        print(f"baseline {path} is a {baseline.get('mode')} sweep, this run a {report['mode']} sweep", file=sys.stderr)
        return 2
    regressions, matched = load_report.compare_with_baseline(report["steps"], baseline["steps"], tolerance)
    if matched == 0:
        print(f"baseline {path}: no step matches this run's loads", file=sys.stderr)
        return 2
    if regressions:
        print(f"\nregressions against {path} (tolerance {tolerance:.0%}):")
        print("\n".join(f"  {line}" for line in regressions))
        return 1
    print(f"\nno regression against {path} ({matched} steps, tolerance {tolerance:.0%})")
    return 0


async def run_sweep(args: argparse.Namespace, prompts: Iterator[tuple[str, int]] | None = None) -> dict[str, Any]:
    """Run every step of the sweep against the server; return the report (what results.json holds).

    ``prompts`` (endless ``(prompt, output length)`` pairs) replaces :func:`make_prompts`'s
    (``sluice bench peers`` sends prompts cut to token counts)."""
    mode = "rate" if args.rate is not None else "concurrency"
    loads = args.rate if mode == "rate" else (args.concurrency or [1, 2, 4, 8, 16, 32, 64])
    rng = random.Random(args.seed)
    prompts = make_prompts(args, rng) if prompts is None else prompts
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    steps = []
    async with httpx.AsyncClient(base_url=base_url, timeout=args.timeout, limits=limits) as client:
        sender = Sender(client, args, random.Random(args.seed + 1))
        for load in loads:
            steps.append(await _run_step(client, sender, mode, load, prompts, args, rng))
    knee = load_report.step_knee(steps, args.knee_gain, args.knee_latency)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"}
    return {
        "mode": mode,
        "config": config,
        "steps": steps,
        "knee": knee,
        "bucket_knees": load_report.bucket_knees(steps, args.knee_gain, args.knee_latency),
    }


async def _run_step(
    client: httpx.AsyncClient,
    sender: Sender,
    mode: str,
    load: float,
    prompts: Iterator[tuple[str, int]],
    args: argparse.Namespace,
    rng: random.Random,
) -> dict[str, Any]:
    progress = _progress(f"{mode} {load:g}", args)
    sampler = asyncio.create_task(sample_queue_depth(client))
    start = time.perf_counter()
    deadline = None if args.num_requests else start + args.duration
    sender.step_start = start
    sender.on_done = lambda: progress.update(1) if progress is not None else None
    try:
        if mode == "concurrency":
            results = await _closed_loop(sender, int(load), prompts, args.num_requests, deadline)
        else:
            gaps = _arrival_gaps(load, args.burstiness, rng)
            results = await _open_loop(sender, gaps, prompts, args.num_requests, deadline)
    except BaseException:  # cancelled (SIGINT/SIGTERM): stop polling before the client closes
        sampler.cancel()
        raise
    duration_s = time.perf_counter() - start
    only = getattr(args, "only_bucket", None)
    if only is not None:  # ``sluice bench tune``: answers from other buckets do not describe this one
        results = [r for r in results if r.bucket is None or r.bucket == only]
    sampler.cancel()
    depths = await asyncio.gather(sampler, return_exceptions=True)
    if progress is not None:
        progress.close()
    mean_depth = depths[0] if isinstance(depths[0], float) else None
    return load_report.step_stats(load, results, duration_s, args.slo_ttft_ms, args.slo_tpot_ms, mean_depth)


def _progress(label: str, args: argparse.Namespace) -> Any:
    if args.no_progress:
        return None
    from tqdm import tqdm

    return tqdm(total=args.num_requests, desc=label, unit="req", file=sys.stderr, leave=False)


async def _closed_loop(
    sender: Sender, concurrency: int, prompts: Iterator[tuple[str, int]], num_requests: int | None, deadline: float | None
) -> list[RequestResult]:
    """``concurrency`` workers, each sending its next request as soon as its last one ends."""
    results: list[RequestResult] = []
    budget = [num_requests]

    async def worker() -> None:
        while deadline is None or time.perf_counter() < deadline:
            if budget[0] is not None:
                if budget[0] == 0:
                    return
                budget[0] -= 1
            results.append(await sender.send(*next(prompts)))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def _open_loop(
    sender: Sender, gaps: Iterator[float], prompts: Iterator[tuple[str, int]], num_requests: int | None, deadline: float | None
) -> list[RequestResult]:
    """Requests sent at the arrival times, whatever is still in flight; waits for them all."""
    tasks: list[asyncio.Task[RequestResult]] = []
    next_at = time.perf_counter()
    try:
        while num_requests is None or len(tasks) < num_requests:
            next_at += next(gaps)
            if deadline is not None and max(next_at, time.perf_counter()) >= deadline:
                break
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(sender.send(*next(prompts))))
        return list(await asyncio.gather(*tasks))
    except BaseException:  # cancelled: the requests in flight go too
        for task in tasks:
            task.cancel()
        raise


def _arrival_gaps(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Gaps between arrivals: gamma with shape ``burstiness`` and mean ``1 / rate`` (0 for inf)."""
    while True:
        yield 0.0 if math.isinf(rate) else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def make_prompts(args: argparse.Namespace, rng: random.Random) -> Iterator[tuple[str, int]]:
    """Endless ``(prompt, output length)`` pairs: lengths uniform within ``*-len-range`` of
    ``*-len``, words from ``--prompts-file`` (a window at a random offset) or synthetic."""
    words = args.prompts_file.read_text().split() if args.prompts_file else SYNTHETIC_WORDS
    if not words:
        raise ValueError(f"--prompts-file {args.prompts_file} has no words")
    while True:
        num_words = _draw_len(args.input_len, args.input_len_range, rng)
        if args.prompts_file:
            offset = rng.randrange(len(words))
            chosen = [words[(offset + i) % len(words)] for i in range(num_words)]
        else:
            chosen = rng.choices(words, k=num_words)
        yield " ".join(chosen), _draw_len(args.output_len, args.output_len_range, rng)


def _draw_len(mean: int, spread: float, rng: random.Random) -> int:
    return max(1, round(mean * rng.uniform(1 - spread, 1 + spread)))


def _loads(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


if __name__ == "__main__":
    sys.exit(main())
