"""The ``sluice`` command: ``sluice serve``, ``sluice prepare``, ``sluice bench engine``,
``sluice bench load|tune|batching|output|logprobs|peers|token-path|loading|lora``, ``sluice gate``,
``sluice kv-plan`` and ``sluice keys add|hash``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from models.kv_plan import KVSource

DEFAULT_CONFIG = "configs/default.yaml"
# Seconds an idle keep-alive connection stays open. Longer than the clients' own expiry (httpx,
# and so the official ``openai`` client, drop an idle connection after 5 s; uvicorn's default is
# also 5 s, so a request sent on a connection at 5 s races the server's close and gets a
# connection reset) and than a load balancer's idle timeout (60 s on AWS ALB): nginx's 75 s.
KEEP_ALIVE_TIMEOUT_S = 75.0

# ``sluice bench NAME``: (name, module with add_arguments and run, help); imported when parsing.
BENCH_COMMANDS = (
    ("engine", "bench.engine", "offline engine benchmark against Hugging Face baselines"),
    ("load", "bench.load", "load sweep (concurrency or request rate) against an OpenAI-compatible server"),
    ("tune", "bench.tune", "sweep one bucket of a running gateway, propose (--apply: set) its knobs"),
    ("batching", "bench.batching_gain", "the same sweep batched and one request at a time, goodput ratio"),
    ("output", "bench.output_stage", "time per token outside the forward at output lengths 64, 512 and 2,048"),
    ("logprobs", "bench.logprobs_cost", "step time at 32 running sequences with and without logprobs"),
    ("peers", "bench.peers", "Sluice, llama-server, vLLM CPU and transformers serve on one workload, side by side"),
    ("token-path", "bench.token_path", "where a served token's time goes (step phases, event loop) against the bare decode step"),
    ("loading", "bench.model_loading", "models loaded on demand: cold load, eviction, what loads cost a model serving, RSS"),
    ("auth", "bench.auth_cost", "microseconds per request of the API-key check (1 to 1,000 keys) and of quota book-keeping"),
    ("fairness", "bench.fairness", "tenants sharing a bucket with and without fair share; low-priority streams under urgent load"),
    ("lora", "bench.lora", "decode throughput with 0, 1, 4 and 8 LoRA adapters in the batch; a cold adapter's first TTFT"),
)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.auth import warn_if_open
    from gateway.errors import ConfigError
    from gateway.logging import configure_logging

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    configure_logging(args.log_level.upper())
    try:
        config = _serve_config(args)
    except ConfigError as exc:
        print(f"sluice: {exc}", file=sys.stderr)
        return 2
    warn_if_open(config, args.host)
    missing = _missing_source(config)
    if missing is not None:  # before uvicorn: a startup failure there is a page of tracebacks
        print(f"sluice: {missing}", file=sys.stderr)
        return 2
    from models.cpu_memory import keep_freed_memory_in_heap

    keep_freed_memory_in_heap()
    try:
        app = create_app(config)
    except ConfigError as exc:  # the KV split over a slice's budget
        print(f"sluice: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
        timeout_keep_alive=args.keep_alive_timeout_s,
    )
    return 0


def _missing_source(config: GatewayConfig) -> str | None:
    """The first model this process loads at start whose ``source`` names no local path or
    installed package (``models.N.source: ...``), or ``None``. Models on Ray slices only are
    left to their actors (their nodes hold the files)."""
    from models.errors import ModelSourceError
    from models.source import resolve_source

    isolation = {s.name: s.isolation for s in config.slices}
    for index, model in enumerate(config.models):
        if model.load != "at_start" or all(isolation[b.slice] == "ray" for b in model.buckets):
            continue
        try:
            resolve_source(model.source)
        except ModelSourceError as exc:
            return f"models.{index}.source: {exc}"
    return None


def _serve_config(args: argparse.Namespace) -> GatewayConfig:
    """The config ``serve`` and ``prepare`` run: ``--config`` (default ``DEFAULT_CONFIG``); or,
    with ``--model`` or ``--models-dir`` and no ``--config``, the config those flags make
    (:func:`gateway.catalog.config_for_sources`); with both, the file's models plus the
    ``--model`` ones (loaded at start) and ``--models-dir`` in place of its ``models_dir``.
    Then every model of the ``models_dir`` is added (:func:`gateway.catalog.expand_models_dir`).

    Raises:
        ConfigError: an invalid file or flag, an unusable model, or a ``--model`` whose name
            another model has.
    """
    from gateway.catalog import add_sources, config_for_sources, expand_models_dir
    from gateway.config import load_config

    has_model_flags = bool(args.model) or args.models_dir is not None
    if args.config is None and has_model_flags:
        config = config_for_sources(args.model, args.models_dir)
    else:
        config = load_config(args.config or DEFAULT_CONFIG)
        if has_model_flags:
            config = add_sources(config, args.model, args.models_dir)
    return expand_models_dir(config)


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    """``--config``, ``--model`` and ``--models-dir``, as ``serve`` and ``prepare`` take them."""
    parser.add_argument(
        "--config", default=None,
        help=f"config file (default {DEFAULT_CONFIG}, unless --model or --models-dir is given)",
    )
    parser.add_argument(
        "--model", action="append", default=[], metavar="PATH",
        help="serve this .gguf file, Hugging Face folder or pkg: source, loaded at start, named after its "
        "file stem or folder name (repeatable; with --config: added to its models)",
    )
    parser.add_argument(
        "--models-dir", metavar="DIR",
        help="serve every .gguf file and model folder in DIR, loaded on demand (with --config: in place of its models_dir)",
    )


def _prepare(args: argparse.Namespace) -> int:
    """Do what a first start (or a model's first request) would otherwise do before serving
    (``make install`` runs it): convert the GGUF sources of the config's models, those loaded on
    demand too, to safetensors folders and build the C++ kernels (decode attention, the lean
    kinds' quantized products), all cached, each step logging its start, end and
    ``duration_s``. A kernel that cannot be built is logged (serving then uses torch's attention
    and torch's quantized ops) and is no failure. Returns 2 for an unusable config or
    model source."""
    from gateway.errors import ConfigError
    from gateway.logging import configure_logging
    from models.errors import ModelError
    from models.paged_attention import compiled_kernel_available
    from models.quant_kernels import kernel as quant_kernel
    from models.source import default_cache_dir, model_folder

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    configure_logging(args.log_level.upper())
    try:
        config = _serve_config(args)
        cache_dir = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()
        for model in config.models:
            model_folder(model.source, cache_dir)
    except (ConfigError, ModelError) as exc:
        print(f"sluice: {exc}", file=sys.stderr)
        return 2
    compiled_kernel_available()
    quant_kernel()
    return 0


def _memory_size(text: str) -> int:
    from models.kv_plan import parse_memory_size

    try:
        return parse_memory_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def _kv_model(args: argparse.Namespace) -> tuple[str, str | None, KVSource]:
    """The name, configured dtype and KV geometry ``--model`` names: a local path if one exists,
    else a generate model of ``--config``.

    Raises:
        ConfigError, ModelSourceError, ValueError: the config, the model or its files are unusable.
    """
    from gateway.config import load_config
    from models.kv_plan import read_kv_source
    from models.source import default_cache_dir

    if Path(args.model).expanduser().exists():
        return args.model, None, read_kv_source(args.model, default_cache_dir())
    config = load_config(args.config)
    models = {m.name: m for m in config.models}
    model = models.get(args.model)
    if model is None:
        known = ", ".join(models)
        raise ValueError(f"--model: {args.model!r} is neither a path nor a model of {args.config} ({known})")
    if model.task != "generate":
        raise ValueError(f"--model: {args.model!r} has task {model.task!r}; only generate models keep a KV cache")
    cache_dir = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()
    return model.name, model.dtype, read_kv_source(model.source, cache_dir)


def _kv_plan(args: argparse.Namespace) -> int:
    from gateway.errors import ConfigError
    from models.errors import ModelSourceError
    from models.kv_plan import DTYPE_BYTES, KV_DTYPE_BYTES, ROW_SCALE_BYTES, dtype_description, plan_kv_cache, plan_rows

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        name, dtype, kv = _kv_model(args)
    except (ConfigError, ModelSourceError, ValueError) as exc:
        print(f"sluice: {exc}", file=sys.stderr)
        return 2
    dtype = args.dtype or dtype or kv.dtype or "float32"
    if dtype not in KV_DTYPE_BYTES:
        known = ", ".join(DTYPE_BYTES)
        print(f"sluice: the model's dtype {dtype!r} is not one of {known}; pass --dtype", file=sys.stderr)
        return 2
    shape = kv.shape
    plan = plan_kv_cache(shape, KV_DTYPE_BYTES[dtype], args.memory, args.block_size, args.seq_len, ROW_SCALE_BYTES.get(dtype, 0))
    rows = [
        ("model", name),
        ("read from", kv.origin),
        ("kv shape", f"{shape.num_layers} layers x {shape.num_kv_heads} kv heads x {shape.head_dim} head dim"),
        ("dtype", dtype_description(dtype)),
        *plan_rows(plan, args.num_seqs),
    ]
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice inference serving gateway")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the gateway")
    _add_model_flags(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--keep-alive-timeout-s", type=float, default=KEEP_ALIVE_TIMEOUT_S,
        help=f"seconds an idle HTTP connection stays open (default {KEEP_ALIVE_TIMEOUT_S:g})",
    )
    serve.set_defaults(func=_serve)
    prepare = commands.add_parser("prepare", help="convert the config's GGUF models and build the C++ kernel ahead of serving")
    _add_model_flags(prepare)
    prepare.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    prepare.set_defaults(func=_prepare)
    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    for name, module, help_text in BENCH_COMMANDS:
        sub = bench_commands.add_parser(name, help=help_text)
        bench_module = importlib.import_module(module)
        bench_module.add_arguments(sub)
        sub.set_defaults(func=bench_module.run)
    gate = commands.add_parser("gate", help="benchmark backends at each bucket's shapes against eager; record verdicts")
    from gateway import gate_command

    gate_command.add_arguments(gate, DEFAULT_CONFIG)
    gate.set_defaults(func=gate_command.run)
    kv_plan = commands.add_parser("kv-plan", help="how many KV blocks, tokens and sequences fit in a memory budget")
    kv_plan.add_argument("--model", required=True, help="a model of the config file, or a model folder or .gguf file")
    kv_plan.add_argument("--memory", type=_memory_size, default="8GiB", help="bytes or 8GiB, 512MiB, 1.5GB (default 8GiB)")
    kv_plan.add_argument("--seq-len", type=_positive_int, default=1024, help="tokens per sequence (default 1024)")
    kv_plan.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block (default 16)")
    kv_plan.add_argument("--num-seqs", type=_positive_int, help="also show the memory this many sequences need")
    kv_plan.add_argument(
        "--dtype", choices=["float32", "float16", "bfloat16", "int8"], help="KV dtype, a bucket's kv_cache_dtype (default: the model's)"
    )
    kv_plan.add_argument("--config", default=DEFAULT_CONFIG, help=f"config file (default {DEFAULT_CONFIG})")
    kv_plan.set_defaults(func=_kv_plan)
    from gateway import key_command

    key_command.add_arguments(commands.add_parser("keys", help="make API keys (printed once) and their config entries"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
