"""The ``sluice`` command: ``sluice serve`` and ``sluice bench engine``."""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_CONFIG = "configs/default.yaml"


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.config import load_config
    from gateway.errors import ConfigError
    from gateway.logging import configure_logging

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    configure_logging(args.log_level.upper())
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"sluice: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice inference serving gateway")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the gateway")
    serve.add_argument("--config", default=DEFAULT_CONFIG, help=f"config file (default {DEFAULT_CONFIG})")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=_serve)
    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    engine = bench_commands.add_parser("engine", help="offline engine benchmark against Hugging Face baselines")
    from bench import engine as engine_bench

    engine_bench.add_arguments(engine)
    engine.set_defaults(func=engine_bench.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
