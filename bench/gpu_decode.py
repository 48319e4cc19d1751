"""Decode step time at one sequence, CUDA graphs off and on: the GPU check's launch-overhead figure.

One request (a ``--prompt-tokens`` prompt, ``--new-tokens`` greedy tokens, end-of-sequence
ignored) runs through Sluice's continuous batcher on a fresh :class:`~models.causal_lm.CausalLMRunner`
without CUDA graphs, then with a graph of batch size 1 (``cuda_graph_sizes=[1]``, captured by the
runner's ``warm_up``, as a served bucket's), after an untimed request on each. Each decode step
(every step after the prefill) is timed whole
(schedule, forward, sampling, postprocess: :class:`bench.step_trace.StepTrace`); the report gives
the median step and forward milliseconds, and on a GPU a profile of a few more decode steps:
kernel launches per step and the share of the step the GPU spends in kernels (the rest is
launching and host work, which graphs take away). On a CPU the graphs-on entry says they are not
available instead of a figure; ``captured_sizes`` shows whether the capture succeeded (a failed
capture leaves the runner eager: ``[]``).

Run it as ``python -m bench.gpu_decode --source FOLDER --device cuda:0 --output decode.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.engine_report import machine_info
from bench.systems import roomy_num_blocks, sluice_generate
from bench.step_trace import StepTrace
from models.loader import LoadedModel

PROFILED_NEW_TOKENS = 8
# First ids of the prompt: past the special tokens of SmolLM2's vocabulary.
PROMPT_FIRST_TOKEN_ID = 100
WARM_UP_NEW_TOKENS = 4
LAUNCH_EVENT_NAMES = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"})


def decode_steps(loaded: LoadedModel, prompt_tokens: int, new_tokens: int, cuda_graphs: bool) -> dict[str, Any]:
    """Time the decode steps of one request on a fresh runner, with a batch-1 CUDA graph or without.

    Returns ``median_step_ms``, ``median_forward_ms``, ``num_decode_steps``, with graphs
    ``captured_sizes``, and on a GPU ``launches_per_step`` and ``kernel_share`` (GPU kernel time
    over the median step time, 0..1; ``None`` where the profiler gave no kernel times).
    """
    from models.causal_lm import CausalLMRunner

    prompt = list(range(PROMPT_FIRST_TOKEN_ID, PROMPT_FIRST_TOKEN_ID + prompt_tokens))
    sizes = [1] if cuda_graphs else []
    runner = CausalLMRunner(loaded.model, roomy_num_blocks([prompt], new_tokens), 16, cuda_graph_sizes=sizes)
    if cuda_graphs:
        runner.warm_up([(1, 1)])
    sluice_generate(runner, loaded, [prompt], WARM_UP_NEW_TOKENS, max_num_seqs=1)
    trace = StepTrace.around(runner)
    sluice_generate(runner, loaded, [prompt], new_tokens, trace, max_num_seqs=1)
    decode = [s for s in trace.samples[1:] if s.num_seqs == 1]  # the first step is the prefill
    report: dict[str, Any] = {
        "median_step_ms": statistics.median(s.step_s for s in decode) * 1e3,
        "median_forward_ms": statistics.median(s.forward_s for s in decode) * 1e3,
        "num_decode_steps": len(decode),
    }
    if cuda_graphs:
        report["captured_sizes"] = list(runner.cuda_graph_sizes)
    if loaded.device.startswith("cuda"):
        report.update(_kernel_profile(runner, loaded, prompt, report["median_step_ms"]))
    return report


def _kernel_profile(runner: Any, loaded: LoadedModel, prompt: list[int], median_step_ms: float) -> dict[str, Any]:
    """Kernel launches per decode step and the GPU's kernel time over ``median_step_ms``, from
    torch's profiler over a request of :data:`PROFILED_NEW_TOKENS` tokens (its prefill included,
    spread over its decode steps: an upper bound)."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sluice_generate(runner, loaded, [prompt], PROFILED_NEW_TOKENS, max_num_seqs=1)
    events = prof.events()
    launches = sum(1 for e in events if e.name in LAUNCH_EVENT_NAMES)
    kernel_us = sum(e.device_time for e in events if e.device_type == DeviceType.CUDA)
    num_steps = PROFILED_NEW_TOKENS - 1
    kernel_ms_per_step = kernel_us / 1e3 / num_steps
    return {
        "launches_per_step": launches / num_steps,
        "kernel_ms_per_step": kernel_ms_per_step,
        "kernel_share": min(1.0, kernel_ms_per_step / median_step_ms) if kernel_us > 0 else None,
    }


def measure(loaded: LoadedModel, prompt_tokens: int, new_tokens: int) -> dict[str, Any]:
    """Graphs off and on (see the module docstring); ``graphs_on`` is ``{"not_available": why}``
    off a CUDA device, and ``speedup`` (off over on, median step) is then ``None``."""
    off = decode_steps(loaded, prompt_tokens, new_tokens, False)
    report: dict[str, Any] = {"graphs_off": off, "graphs_on": None, "speedup": None}
    if not loaded.device.startswith("cuda"):
        report["graphs_on"] = {"not_available": f"CUDA graphs need a CUDA device, not {loaded.device}"}
    else:
        on = decode_steps(loaded, prompt_tokens, new_tokens, True)
        report["graphs_on"] = on
        report["speedup"] = off["median_step_ms"] / on["median_step_ms"]
    return report


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, load the model, measure, print and write the JSON report; return 0."""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_decode", description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, help="model source (a Hugging Face folder)")
    parser.add_argument("--device", default="cuda:0", help="default cuda:0")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="default 16")
    parser.add_argument("--new-tokens", type=int, default=128, help="default 128")
    parser.add_argument("--output", type=Path, required=True, help="write the JSON report here")
    args = parser.parse_args(argv)
    import torch

    from models.loader import load_model
    from models.source import default_cache_dir

    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    loaded = load_model("gpu-decode", args.source, "generate", dtype, args.device, default_cache_dir())
    report = measure(loaded, args.prompt_tokens, args.new_tokens)
    report["machine"] = machine_info(torch.get_num_threads(), args.device, dtype)
    report["workload"] = {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "num_seqs": 1}
    print(json.dumps({k: report[k] for k in ("graphs_off", "graphs_on", "speedup")}, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
