"""The Python side of ``bench/gpu_check.sh``: provenance, the dry run's config, the wait for the
served gateway, and ``summary.json``.

- ``versions --device D --output F``: Python, torch, CUDA, Triton, transformers, and the GPU's name,
  driver and memory (``nvidia-smi``) as JSON.
- ``cpu-config --config C --source S --output F``: the served config ``C`` moved to a CPU for the
  dry run (``SLUICE_GPU_CHECK_DEVICE=cpu``): float32, the model folder ``S``, small budgets.
- ``wait --url U --pid P --timeout-s T``: poll ``U`` until it answers 200; exit 1 when process ``P``
  ends first or ``T`` seconds pass.
- ``summary --work W --output F``: the figures of every stage's report in ``W`` (see
  :func:`build_summary`), each with the GPU's name and the versions, as one JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu_summary import build_summary

NVIDIA_SMI_QUERY = ("--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")
WAIT_POLL_S = 0.5
# The dry run's serving budgets on a CPU (the H200's would ask for 16 GiB of KV).
CPU_KV_CACHE_BYTES = "256MiB"
CPU_MAX_NUM_SEQS = 16
CPU_MAX_NUM_BATCHED_TOKENS = 512


def versions(device: str) -> dict[str, Any]:
    """What the figures ran on: Python, library versions, and the GPU (``None`` fields on a CPU)."""
    import torch
    import transformers

    from bench.engine_report import version_of

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": version_of("triton"),
        "transformers": transformers.__version__,
        "device": device,
        "gpu_name": None,
        "driver": None,
        "gpu_memory": None,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu_name"] = torch.cuda.get_device_name(torch.device(device))
    command = shutil.which("nvidia-smi")
    if command is not None:
        line = subprocess.run([command, *NVIDIA_SMI_QUERY], capture_output=True, text=True).stdout.strip()
        fields = [f.strip() for f in line.splitlines()[0].split(",")] if line else []
        if len(fields) == 3:
            info["gpu_name"] = info["gpu_name"] or fields[0]
            info["driver"], info["gpu_memory"] = fields[1], fields[2]
    return info


def cpu_config(config: dict[str, Any], source: str) -> dict[str, Any]:
    """``config`` (a parsed gateway config) moved to a CPU: every slice on ``cpu`` with a small KV
    budget and no memory budget, every model float32 from ``source`` with its KV in its own dtype,
    and the continuous buckets at :data:`CPU_MAX_NUM_SEQS` sequences."""
    moved: dict[str, Any] = json.loads(json.dumps(config))
    for slice_config in moved["slices"]:
        slice_config.update(device="cpu", kv_cache_memory_bytes=CPU_KV_CACHE_BYTES)
        slice_config.pop("memory_budget_bytes", None)
    for model in moved["models"]:
        model.update(source=source, dtype="float32")
        for bucket in model["buckets"]:
            bucket.pop("kv_cache_dtype", None)
            if bucket["batcher"]["kind"] == "continuous":
                bucket["batcher"].update(max_num_seqs=CPU_MAX_NUM_SEQS, max_num_batched_tokens=CPU_MAX_NUM_BATCHED_TOKENS)
    return moved


def wait_until_served(url: str, pid: int, timeout_s: float) -> bool:
    """Poll ``url`` every :data:`WAIT_POLL_S` seconds until it answers 200 (``True``), or until
    process ``pid`` has ended or ``timeout_s`` seconds have passed (``False``)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        time.sleep(WAIT_POLL_S)
    return False


def main(argv: list[str] | None = None) -> int:
    """Run one of the subcommands of the module docstring; return its exit code."""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ver = commands.add_parser("versions")
    ver.add_argument("--device", required=True)
    ver.add_argument("--output", type=Path, required=True)
    cpu = commands.add_parser("cpu-config")
    cpu.add_argument("--config", type=Path, required=True)
    cpu.add_argument("--source", required=True)
    cpu.add_argument("--output", type=Path, required=True)
    wait = commands.add_parser("wait")
    wait.add_argument("--url", required=True)
    wait.add_argument("--pid", type=int, required=True)
    wait.add_argument("--timeout-s", type=float, required=True)
    summary = commands.add_parser("summary")
    summary.add_argument("--work", type=Path, required=True)
    summary.add_argument("--output", type=Path, required=True)
    summary.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "versions":
        _write_json(args.output, versions(args.device))
    elif args.command == "cpu-config":
        import yaml

        args.output.write_text(yaml.safe_dump(cpu_config(yaml.safe_load(args.config.read_text()), args.source)))
    elif args.command == "wait":
        return 0 if wait_until_served(args.url, args.pid, args.timeout_s) else 1
    else:
        _write_json(args.output, build_summary(args.work, args.dry_run))
        print(args.output.read_text())
    return 0


def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
