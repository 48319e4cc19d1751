"""Compile the Triton paged-attention kernels ahead of time for sm_90 (an H200), no GPU needed.

Each case builds a decode or prefill call on ``meta`` tensors and asks
:mod:`models.triton_attention` for its launches (:func:`decode_kernel_calls`,
:func:`prefill_kernel_call`: the very arguments the entry points launch with); Triton's own
binder then derives the signature from them (pointer dtypes, ``i32``/``i64`` by value, ints of
1 as constants, 16-divisibility) and :func:`triton.compile` lowers each kernel to PTX and cubin
for ``GPUTarget("cuda", 90, 32)``. Run it with ``TRITON_INTERPRET`` unset (under the interpreter
``@triton.jit`` gives interpreter functions): ``python -m tests.triton_aot [--all]``. It prints
one line per kernel and exits 1 if any failed to compile. Uses Triton internals of 3.x
(``create_function_from_signature``, ``JITFunction._pack_args``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from models import triton_attention as ta

TARGET = GPUTarget("cuda", 90, 32)
META = torch.device("meta")
SM90_SHARED_BYTES = 232_448  # 227 KiB: the most a block may ask for; a launch asking more fails


@dataclass(frozen=True)
class Shape:
    """A model's attention shape: query and kv heads, head size, tokens per pool block."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


SMOLLM2 = Shape("smollm2", 9, 3, 64, 16)
GQA8 = Shape("d128-gqa8", 16, 2, 128, 16)
GQA1 = Shape("d128-gqa1", 4, 4, 128, 16)
DTYPES = {  # name: (query dtype, pool dtype)
    "f16": (torch.float16, torch.float16),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "f32": (torch.float32, torch.float32),
    "f32q-bf16kv": (torch.float32, torch.bfloat16),
}
KINDS = ("decode-1split", "decode-splits", "prefill")
NUM_BLOCKS = 100_000  # a large pool: block_id * block stride passes 2**31 elements
NUM_SEQS = 8
TABLE_BLOCKS = 256  # 4096 tokens of capacity per sequence: several splits at NUM_SEQS
SUBSET = [  # (shape, dtype, kind) compiled by default (~4 s), each kernel and code path once; --all compiles every combination
    (SMOLLM2, "bf16", "decode-1split"),
    (SMOLLM2, "f32q-bf16kv", "decode-splits"),
    (SMOLLM2, "bf16", "prefill"),
    (GQA1, "f16", "decode-1split"),  # a group of 1: [1, ...] tiles
]  # fmt: skip


def kernel_calls(shape: Shape, dtype_name: str, kind: str) -> list[ta.KernelCall]:
    """The launches of one case, on ``meta`` tensors (shapes and dtypes only, no memory)."""
    query_dtype, pool_dtype = DTYPES[dtype_name]
    pool = torch.empty(2, NUM_BLOCKS, shape.block_size, shape.num_kv_heads, shape.head_dim, dtype=pool_dtype, device=META)
    tables = torch.empty(NUM_SEQS, TABLE_BLOCKS, dtype=torch.int32, device=META)
    scale = shape.head_dim**-0.5
    if kind == "prefill":
        query = torch.empty(512, shape.num_heads, shape.head_dim, dtype=query_dtype, device=META)
        segments = torch.empty(3, NUM_SEQS, dtype=torch.int32, device=META)
        out = torch.empty_like(query)
        return [ta.prefill_kernel_call(query, pool[0], pool[1], tables, segments, 256, out, scale)]
    query = torch.empty(NUM_SEQS, shape.num_heads, shape.head_dim, dtype=query_dtype, device=META)
    lens = torch.empty(NUM_SEQS, dtype=torch.int32, device=META)
    out = torch.empty_like(query)
    splits = 1 if kind == "decode-1split" else None
    calls = ta.decode_kernel_calls(query, pool[0], pool[1], tables, lens, out, scale, splits)
    if kind == "decode-splits" and len(calls) != 2:
        raise AssertionError(f"{shape.name} {dtype_name}: expected a split decode, got {len(calls)} launch(es)")
    return calls


def compile_call(call: ta.KernelCall) -> triton.compiler.CompiledKernel:
    """Compile ``call``'s kernel for :data:`TARGET` as its launch would specialize it.

    Raises:
        triton.compiler.CompilationError (or another exception): the kernel does not compile.
    """
    backend = make_backend(TARGET)
    binder = create_function_from_signature(call.kernel.signature, call.kernel.params, backend)
    bound_args, specialization, options = binder(*call.args, **call.constexprs)
    options, signature, constexprs, attrs = call.kernel._pack_args(
        backend, dict(call.constexprs), bound_args, specialization, options
    )
    source = ASTSource(fn=call.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET, options=options.__dict__)


def main(argv: list[str] | None = None) -> int:
    """Compile the cases (``--all``: every shape x dtype x kind); 0 when all compile."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every combination, not the default subset")
    all_cases = [(s, d, k) for s in (SMOLLM2, GQA8, GQA1) for d in DTYPES for k in KINDS]
    cases = all_cases if parser.parse_args(argv).all else SUBSET
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: under the interpreter nothing compiles", file=sys.stderr)
        return 2
    failures = 0
    for shape, dtype_name, kind in cases:
        for call in kernel_calls(shape, dtype_name, kind):
            name = f"{call.kernel.__name__} {shape.name} {dtype_name} {kind} {call.constexprs}"
            started_s = time.perf_counter()
            try:
                compiled = compile_call(call)
            except Exception as exc:  # every kernel is tried; the report lists each failure
                failures += 1
                print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
                continue
            shared_bytes = compiled.metadata.shared
            if not compiled.asm["cubin"] or shared_bytes > SM90_SHARED_BYTES:
                failures += 1
                print(f"FAIL {name}: {shared_bytes} bytes of shared memory (sm_90: {SM90_SHARED_BYTES})", flush=True)
                continue
            print(f"ok {time.perf_counter() - started_s:.2f}s {shared_bytes}B shared {name}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
