"""``sluice gate --model NAME [--bucket B]``: run the backend gates of a model's buckets.

For each bucket (or the one named) it measures every candidate backend against eager at the
bucket's shapes, prints the figures and verdicts, and saves the gate record where the gateway
reads it (``<cache_dir>/gates/<model>/<bucket>.json``); buckets with ``backend: auto`` then
run what their record enabled. ``--output DIR`` also copies the records there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, get_args

import torch
from pydantic import ValidationError

from gateway import gate
from gateway.config import GateCandidate, GatewayConfig, load_config
from gateway.errors import ConfigError
from models.loader import load_model
from models.source import default_cache_dir

CANDIDATES: tuple[str, ...] = get_args(GateCandidate)


def add_arguments(parser: argparse.ArgumentParser, default_config: str) -> None:
    """Add the command's options to ``parser``."""
    parser.add_argument("--config", default=default_config, help=f"config file (default {default_config})")
    parser.add_argument("--model", required=True, help="a model of the config")
    parser.add_argument("--bucket", help="one of its buckets (default: all)")
    parser.add_argument("--repeats", type=int, help="timed runs per backend and shape (default: the config's gate.repeats)")
    parser.add_argument("--candidates", help=f"comma-separated subset of {','.join(CANDIDATES)} (default: the config's)")
    parser.add_argument("--output", type=Path, help="also copy the records to this folder")


def run(args: argparse.Namespace) -> int:
    """Gate the buckets; 0 when every record was written, 2 on a bad option or config."""
    try:
        config = _with_overrides(load_config(args.config), args)
    except (ConfigError, ValueError) as exc:
        print(f"sluice gate: {exc}", file=sys.stderr)
        return 2
    model = next((m for m in config.models if m.name == args.model), None)
    if model is None:
        print(f"sluice gate: no model {args.model!r} in {args.config} (it has {', '.join(m.name for m in config.models)})", file=sys.stderr)
        return 2
    buckets = [b for b in model.buckets if args.bucket in (None, b.bucket_name)]
    if not buckets:
        names = ", ".join(b.bucket_name for b in model.buckets)
        print(f"sluice gate: model {model.name!r} has no bucket {args.bucket!r} (it has {names})", file=sys.stderr)
        return 2
    cache_dir = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()
    slices = {s.name: s for s in config.slices}
    first_slice = slices[buckets[0].slice]
    loaded = load_model(model.name, model.source, model.task, model.dtype, first_slice.device, cache_dir)
    for bucket in buckets:
        num_threads = slices[bucket.slice].num_threads
        torch.set_num_threads(num_threads)
        record = gate.run_and_save(loaded, model, bucket, config.gate, cache_dir, num_threads, reason="sluice gate")
        path = gate.record_path(cache_dir, model.name, bucket.bucket_name)
        print(format_record(record))
        print(f"saved {path}")
        if args.output is not None:
            args.output.mkdir(parents=True, exist_ok=True)
            copy = args.output / f"{model.name.replace('/', '_')}__{bucket.bucket_name}.json"
            copy.write_text(json.dumps(record, indent=2) + "\n")
    return 0


def _with_overrides(config: GatewayConfig, args: argparse.Namespace) -> GatewayConfig:
    changes: dict[str, Any] = {}
    if args.repeats is not None:
        changes["repeats"] = args.repeats
    if args.candidates is not None:
        changes["candidates"] = [c.strip() for c in args.candidates.split(",") if c.strip()]
    if not changes:
        return config
    data = config.model_dump(mode="json")
    data["gate"] = {**data["gate"], **changes}
    if "candidates" in changes:  # the command line's candidates win over each bucket's own
        for model in data["models"]:
            for bucket in model["buckets"]:
                bucket["gate_candidates"] = None
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"--{'.'.join(str(p) for p in e['loc'][1:2])}: {e['msg']} (got {e.get('input')!r})" for e in exc.errors())
        raise ValueError(problems) from None


def format_record(record: dict[str, Any]) -> str:
    """A gate record as a table: per candidate, per shape latencies and ratio, accuracy, verdict."""
    shapes = [_shape_label(s, record["key"]["kind"]) for s in record["key"]["shapes"]]
    verdicts = {v["backend"]: v for v in record["verdicts"]}
    lines = [f"\ngate {record['model']} / {record['bucket']} ({record['key']['machine'].get('cpu', '?')}, "
             f"{record['key']['machine']['num_threads']} threads; medians of {record['repeats']} interleaved runs)"]
    for candidate in record["candidates"]:
        verdict = verdicts[candidate["backend"]]
        mark = "ENABLED" if verdict["enabled"] else "refused"
        lines.append(f"  {candidate['backend']:10s} {mark}: " + "; ".join(verdict["reasons"]))
        for label, eager_ms, ms in zip(shapes, candidate.get("eager_ms", []), candidate.get("candidate_ms", [])):
            lines.append(f"    {label:28s} eager {eager_ms:9.2f} ms  {candidate['backend']} {ms:9.2f} ms  {eager_ms / ms:5.2f}x")
        if "warm_up_s" in candidate:
            lines.append(f"    build {candidate.get('build_s', 0):.1f} s, warm-up {candidate['warm_up_s']:.1f} s")
    lines.append(f"  chosen: {record['chosen']} (gate took {record['gate_s']:.1f} s)")
    return "\n".join(lines)


def _shape_label(shape: list[int], kind: str) -> str:
    if kind == "dynamic":
        return f"batch {shape[0]} x {shape[1]} tokens"
    if shape[1] > 1:
        return f"prefill {shape[1]} tokens"
    return f"decode {shape[0]} seqs"
