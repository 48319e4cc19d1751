"""The engine benchmark's report text and provenance: the table, the summary lines under it, and
where the figures came from (:func:`machine_info`), apart from :mod:`bench.engine`'s arithmetic."""

from __future__ import annotations

import os
import platform
from typing import Any

from bench.systems import SystemResult

# Systems whose outputs are compared with ``sequential``'s; Sluice's keys carry no prefix (as before).
COMPARED_SYSTEMS = ("sluice", "hf_continuous")


def machine_info(threads: int, device: str = "cpu", dtype: str = "float32") -> dict[str, Any]:
    """Where the numbers came from: platform, CPUs, library versions, torch threads, the device and
    dtype the systems ran in, and on a GPU its name, CUDA version and Triton version."""
    import torch
    import transformers

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": threads,
        # Other work on the machine skews the figures; the 1-minute load average at report time says how much.
        "load_average_1m": os.getloadavg()[0],
        "device": device,
        "dtype": dtype,
    }
    if device.startswith("cuda"):
        info["gpu_name"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda"] = torch.version.cuda
        info["triton"] = version_of("triton")
    return info


def version_of(package: str) -> str | None:
    """The installed version of ``package``, or ``None`` when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def format_table(results: dict[str, SystemResult]) -> str:
    """A plain-text table: system, requests, generated tokens, wall seconds, tokens/s."""
    lines = [f"{'system':<14} {'requests':>8} {'gen tokens':>10} {'wall s':>9} {'tokens/s':>9}"]
    for name, r in results.items():
        lines.append(
            f"{name:<14} {r.num_requests:>8} {r.num_generated_tokens:>10} {r.wall_s:>9.2f} {r.tokens_per_s:>9.1f}"
        )
    return "\n".join(lines)


def format_summary(report: dict[str, Any]) -> list[str]:
    """The report's lines under the table: ratios, best baseline, agreement, forward share, KV memory."""
    lines = [f"{name}: {value:.2f}x" for name, value in report["ratios"].items()]
    if report["best_hf"] is not None and "sluice_vs_best_hf" in report["ratios"]:
        best = report["best_hf"]
        lines.append(f"best hf: {best['system']} (of {', '.join(best['candidates'])})")
    lines.extend(_agreement_lines(report))
    lines.extend(_forward_share_lines(report["forward_share"]))
    lines.extend(_kv_memory_lines(report["kv_memory"]))
    return lines


def _agreement_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for name in COMPARED_SYSTEMS if report["compared"] else ():
        prefix = "" if name == "sluice" else f"{name}_"
        if report[f"{name}_matches_sequential"] is None:
            continue
        line = f"{name} matches sequential: {report[f'{name}_matches_sequential']}/{report['compared']}"
        if report[f"{prefix}mismatches_at_eos"]:
            line += f" ({report[f'{prefix}mismatches_at_eos']} mismatches where it chose EOS, which HF generate bans)"
        lines.append(line)
    return lines


def _forward_share_lines(share: dict[str, Any] | None) -> list[str]:
    if share is None:
        return []
    all_steps = f"all {share['num_steps']} steps {_fraction(share['all_steps'])}"
    if share["num_seqs"] is None:
        return [f"sluice forward share: no step ran {share['requested_num_seqs']}+ sequences; {all_steps}"]
    at = f"at {share['num_seqs']} sequences {_fraction(share['at_num_seqs'])} ({share['num_steps_at']} steps"
    if share["num_seqs"] != share["requested_num_seqs"]:
        at += f"; none ran exactly {share['requested_num_seqs']}, this is the closest count above"
    return [f"sluice forward share: {at}); {all_steps}"]


def _kv_memory_lines(kv: dict[str, Any]) -> list[str]:
    static = f"static_32 padding {kv['static_32_kv_overhead_ratio']:.2f}x, peak {_mib(kv['static_32_kv_bytes_peak'])}"
    if kv["kv_overhead_ratio_max"] is None:
        return [f"kv bytes held / bytes of tokens: {static}"]
    sluice = (
        f"sluice mean {_times(kv['kv_overhead_ratio_mean'])}, max {_times(kv['kv_overhead_ratio_max'])},"
        f" peak {_mib(kv['kv_bytes_held_peak'])} of a {_mib(kv['kv_pool_bytes'])} pool"
    )
    return [f"kv bytes held / bytes of tokens: {sluice}; {static}"]


def _fraction(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}x"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def print_summary(report: dict[str, Any]) -> None:
    for line in format_summary(report):
        print(line)

