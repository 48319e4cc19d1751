"""The Triton paged-attention kernels compile for sm_90 (an H200) here, with no GPU.

The interpreter the other Triton tests run under accepts what real compilation rejects (``tl.dot``
shapes, dtype mismatches, constexpr misuse): ``tests/triton_aot.py`` lowers every kernel to a
cubin, from the arguments the entry points launch with, in a subprocess without
``TRITON_INTERPRET`` (under it ``@triton.jit`` yields interpreter functions). A representative
subset by default (``python -m tests.triton_aot --all`` compiles every shape x dtype x kind).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]
SUBSET_KERNELS = 5  # tests/triton_aot.py's SUBSET: 4 cases, one of them a split decode (+ the reduce kernel)


def test_every_triton_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "tests.triton_aot"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    compiled = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert len(compiled) == SUBSET_KERNELS, result.stdout
    for kernel in ("_decode_kernel", "_reduce_kernel", "_prefill_kernel"):
        assert any(kernel in line for line in compiled), f"{kernel} not compiled:\n{result.stdout}"
