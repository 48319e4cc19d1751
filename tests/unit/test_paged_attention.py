"""models.paged_attention: the C++ kernel and the torch fallback against a per-sequence reference
(every cache dtype, both ISA paths), input validation, and the lazy build's fallback and warning."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import structlog
import torch
import torch.nn.functional as F

from models import paged_attention as pa
from models.kv_cache import quantize_rows

BLOCK_SIZE = 16
HEAD_DIM = 64
# Past a sequence's last block, tables hold ids that do not exist: they must never be read.
UNUSED_BLOCK_ID = 1 << 30

Attention = Callable[..., torch.Tensor]


@dataclass
class Problem:
    """The arguments of one paged_decode_attention call."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    scale: float = HEAD_DIM**-0.5
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None

    def args(self) -> tuple[object, ...]:
        return (
            self.query, self.key_cache, self.value_cache, self.block_tables, self.context_lens, self.scale,
            self.key_scales, self.value_scales,
        )

    def dequantized(self) -> "Problem":
        """The same problem over float64 K/V: an int8 cache's rows times their scales."""
        def widen(cache: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
            return cache.double() if scales is None else cache.double() * scales.double().unsqueeze(-1)

        key, value = widen(self.key_cache, self.key_scales), widen(self.value_cache, self.value_scales)
        return Problem(self.query, key, value, self.block_tables, self.context_lens, self.scale)


def make_problem(
    context_lens: list[int],
    num_heads: int = 9,
    num_kv_heads: int = 3,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Problem:
    """Random K/V in a shuffled block pool (a view of a bigger, layered tensor), each sequence's
    first block shared with sequence 0 (as with a common prefix)."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 7
    pool = torch.randn(2, 2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.full((len(context_lens), max(blocks_per_seq) + 2), UNUSED_BLOCK_ID, dtype=torch.int32)
    for seq, count in enumerate(blocks_per_seq):
        tables[seq, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
        tables[seq, 0] = tables[0, 0]
    query = torch.randn(len(context_lens), num_heads, HEAD_DIM, generator=generator).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return Problem(query, pool[1, 0], pool[1, 1], tables, lens)


def reference(problem: Problem) -> torch.Tensor:
    """Per sequence: its tokens gathered one by one, then SDPA with GQA, in float64."""
    problem = problem.dequantized()
    outputs = []
    for seq, context_len in enumerate(problem.context_lens.tolist()):
        slots = [(int(problem.block_tables[seq, t // BLOCK_SIZE]), t % BLOCK_SIZE) for t in range(context_len)]
        keys = torch.stack([problem.key_cache[block, offset] for block, offset in slots]).double()
        values = torch.stack([problem.value_cache[block, offset] for block, offset in slots]).double()
        out = F.scaled_dot_product_attention(
            problem.query[seq].double()[None, :, None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            scale=problem.scale,
            enable_gqa=True,
        )
        outputs.append(out[0, :, 0])
    return torch.stack(outputs)


def compiled_attention(*args: object) -> torch.Tensor:
    """The public entry point, which sends float32 and bfloat16 CPU calls to the C++ kernel."""
    if not pa.compiled_kernel_available():
        pytest.skip(f"C++ kernel unavailable: {pa.kernel_unavailable_reason()}")
    return pa.paged_decode_attention(*args)  # type: ignore[arg-type]


IMPLEMENTATIONS = {"compiled": compiled_attention, "torch": pa.torch_paged_decode_attention}
EDGE_LENS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 600]


@pytest.fixture(params=list(IMPLEMENTATIONS))
def attention(request: pytest.FixtureRequest) -> Attention:
    return IMPLEMENTATIONS[request.param]


@pytest.mark.parametrize("num_heads, num_kv_heads", [(3, 3), (9, 3)])
@pytest.mark.parametrize(
    "context_lens",
    [[1], [600], EDGE_LENS, torch.randint(1, 601, (20,), generator=torch.Generator().manual_seed(3)).tolist()],
    ids=["one-token", "one-long", "block-edges", "twenty-random"],
)
def test_matches_reference(attention: Attention, context_lens: list[int], num_heads: int, num_kv_heads: int) -> None:
    problem = make_problem(context_lens, num_heads, num_kv_heads)
    out = attention(*problem.args())
    assert out.shape == problem.query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(problem), atol=1e-5, rtol=0)


def test_one_token_context_returns_its_value(attention: Attention) -> None:
    problem = make_problem([1, 1], num_heads=6, num_kv_heads=2)
    out = attention(*problem.args())
    for seq in range(2):
        value = problem.value_cache[int(problem.block_tables[seq, 0]), 0]  # [num_kv_heads, head_dim]
        torch.testing.assert_close(out[seq], value.repeat_interleave(3, dim=0), atol=1e-6, rtol=0)


def test_accepts_a_strided_query(attention: Attention) -> None:
    problem = make_problem(EDGE_LENS)
    problem.query = problem.query.transpose(0, 1).contiguous().transpose(0, 1)  # [seqs, heads, dim], not contiguous
    torch.testing.assert_close(attention(*problem.args()).double(), reference(problem), atol=1e-5, rtol=0)


def test_large_scores_stay_finite(attention: Attention) -> None:
    problem = make_problem(EDGE_LENS)
    problem.scale = 40.0  # scores in the thousands: softmax must subtract the max
    out = attention(*problem.args())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(problem), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(attention: Attention, dtype: torch.dtype) -> None:
    problem = make_problem(EDGE_LENS, dtype=dtype)
    out = attention(*problem.args())
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(problem), atol=2e-2, rtol=0)


@pytest.mark.parametrize("num_threads", [1, 4, 7])
def test_any_thread_count_splits_the_work_correctly(attention: Attention, num_threads: int) -> None:
    # 7 threads over 3 sequences x 3 kv heads cut sequences between kv heads.
    problem = make_problem([600, 17, 300])
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = attention(*problem.args())
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out.double(), reference(problem), atol=1e-5, rtol=0)


def test_empty_batch(attention: Attention) -> None:
    problem = make_problem([5])
    problem.query, problem.block_tables, problem.context_lens = (
        problem.query[:0],
        problem.block_tables[:0],
        problem.context_lens[:0],
    )
    assert attention(*problem.args()).shape == (0, 9, HEAD_DIM)


def with_cache_dtype(problem: Problem, dtype: torch.dtype) -> Problem:
    """The problem's K/V stored in ``dtype`` (int8: quantized as the KV pool writes them)."""
    if dtype != torch.int8:
        return Problem(problem.query, problem.key_cache.to(dtype), problem.value_cache.to(dtype), problem.block_tables, problem.context_lens)
    (key, key_scales), (value, value_scales) = quantize_rows(problem.key_cache), quantize_rows(problem.value_cache)
    return Problem(problem.query, key, value, problem.block_tables, problem.context_lens, problem.scale, key_scales, value_scales)


@pytest.fixture(params=["best", "avx2"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The kernel's ISA path: the best the CPU has, or AVX2 (what ``SLUICE_KERNEL_ISA=avx2``
    selects at load; a second load in one process would rebuild under a new name)."""
    if not pa.compiled_kernel_available():
        pytest.skip(f"C++ kernel unavailable: {pa.kernel_unavailable_reason()}")
    if request.param == "avx2":
        if pa.kernel_isa() not in ("avx512", "avx2"):
            pytest.skip("this CPU has no AVX2 path")
        assert pa.select_isa("avx2") == "avx2" == pa.kernel_isa()
    try:
        yield str(pa.kernel_isa())
    finally:
        pa.select_isa("")


def test_the_isa_switch_is_read_at_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    selected: list[str] = []
    fake = SimpleNamespace(select_isa=lambda name: selected.append(name) or name or "avx512")
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kwargs: fake)
    monkeypatch.setenv(pa.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(pa.ISA_ENV, "avx2")
    assert pa.build_extension() is fake
    monkeypatch.delenv(pa.ISA_ENV)
    pa.build_extension()
    assert selected == ["avx2", ""]


def test_an_unknown_or_missing_isa_is_refused() -> None:
    if not pa.compiled_kernel_available():
        pytest.skip(f"C++ kernel unavailable: {pa.kernel_unavailable_reason()}")
    with pytest.raises(ValueError, match="unknown ISA level 'sse9'"):
        pa.select_isa("sse9")
    assert pa.select_isa("baseline") == "baseline"
    pa.select_isa("")


CACHE_DTYPE_CASES = [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.int8),
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.int8),
]  # fmt: skip


@pytest.mark.parametrize("query_dtype, cache_dtype", CACHE_DTYPE_CASES, ids=lambda d: str(d).removeprefix("torch."))
def test_each_cache_dtype_matches_the_reference_on_each_isa_path(
    isa: str, query_dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    problem = with_cache_dtype(make_problem(EDGE_LENS, dtype=query_dtype), cache_dtype)
    torch.testing.assert_close(  # the same result on the torch fallback and on the kernel's ISA path
        pa.torch_paged_decode_attention(*problem.args()).double(), reference(problem), atol=1e-5 if query_dtype == torch.float32 else 2e-2, rtol=0
    )
    out = pa.paged_decode_attention(*problem.args())  # type: ignore[arg-type]
    assert out.dtype == query_dtype and out.shape == problem.query.shape
    torch.testing.assert_close(out.double(), reference(problem), atol=1e-5 if query_dtype == torch.float32 else 2e-2, rtol=0)


def test_an_int8_cache_stays_close_to_its_float_values() -> None:
    problem = make_problem(EDGE_LENS)
    quantized = with_cache_dtype(problem, torch.int8)
    error = (pa.torch_paged_decode_attention(*quantized.args()) - reference(problem)).abs().max()
    assert 0 < float(error) < 0.02  # lossy, by about half a step of 1/127 of each row's max


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_scales_go_with_an_int8_cache_only(implementation: str) -> None:
    attention = IMPLEMENTATIONS[implementation]
    quantized = with_cache_dtype(make_problem([20, 30]), torch.int8)
    with pytest.raises(ValueError, match="needs key_scales"):
        attention(*quantized.args()[:6])
    float_problem = make_problem([20, 30])
    float_problem.key_scales, float_problem.value_scales = quantized.key_scales, quantized.value_scales
    with pytest.raises(ValueError, match="int8 cache only"):
        attention(*float_problem.args())


def _bad(field: str, corrupt: Callable[[Problem], torch.Tensor]) -> Callable[[Problem], None]:
    """Replace one argument of a problem by ``corrupt(problem)``."""
    return lambda problem: setattr(problem, field, corrupt(problem))


def _strided_copy(cache: torch.Tensor) -> torch.Tensor:
    """The same values and shape, laid out [num_blocks, num_kv_heads, block_size, head_dim]."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


_ONE_ZERO = torch.tensor([1, 0], dtype=torch.int32)


def _with_block(problem: Problem, seq: int, index: int, block_id: int) -> torch.Tensor:
    tables = problem.block_tables.clone()
    tables[seq, index] = block_id
    return tables


BAD_INPUTS = {
    "query-2d": (ValueError, "query must be", _bad("query", lambda p: p.query[0])),
    "cache-3d": (ValueError, "key_cache must be", _bad("key_cache", lambda p: p.key_cache[0])),
    "value-shape": (ValueError, "value_cache shape", _bad("value_cache", lambda p: p.value_cache[:-1])),
    "cache-dtype": (TypeError, "dtypes must match", _bad("key_cache", lambda p: p.key_cache.double())),
    "int-query": (TypeError, "floating point", _bad("query", lambda p: p.query.int())),
    "table-int64": (TypeError, "must be int32", _bad("block_tables", lambda p: p.block_tables.long())),
    "lens-int64": (TypeError, "must be int32", _bad("context_lens", lambda p: p.context_lens.long())),
    "cache-strided": (ValueError, "contiguous", _bad("key_cache", lambda p: _strided_copy(p.key_cache))),
    "head-dim": (ValueError, "head_dim", _bad("query", lambda p: p.query[:, :, :32])),
    "gqa-ratio": (ValueError, "not a multiple", _bad("query", lambda p: p.query[:, :8])),
    "table-rows": (ValueError, "block_tables must be", _bad("block_tables", lambda p: p.block_tables[:1])),
    "lens-rows": (ValueError, "context_lens must be", _bad("context_lens", lambda p: p.context_lens[:1])),
    "zero-context": (ValueError, r"context_lens\[1\] = 0", _bad("context_lens", lambda p: p.context_lens * _ONE_ZERO)),
    "past-table": (ValueError, "outside", _bad("context_lens", lambda p: p.context_lens + 10_000)),
    "bad-block": (ValueError, r"block_tables\[1, 0\] = -1", _bad("block_tables", lambda p: _with_block(p, 1, 0, -1))),
    "block-past-pool": (ValueError, "num_blocks", _bad("block_tables", lambda p: _with_block(p, 0, 1, len(p.key_cache)))),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_rejects_bad_inputs(attention: Attention, case: str) -> None:
    error, message, corrupt = BAD_INPUTS[case]
    problem = make_problem([20, 30])
    corrupt(problem)
    with pytest.raises(error, match=message):
        attention(*problem.args())


def test_disabled_kernel_falls_back_with_one_warning() -> None:
    calls = []
    loader = pa.KernelLoader(build=lambda: calls.append(1) or ModuleType("never"), environ={pa.DISABLE_ENV: "1"})
    with structlog.testing.capture_logs() as logs:
        assert loader.module() is None
        assert loader.module() is None
    assert calls == []
    assert loader.unavailable_reason == f"disabled by {pa.DISABLE_ENV}=1"
    assert [entry["event"] for entry in logs] == ["cpp_kernel_unavailable"]
    assert logs[0]["log_level"] == "warning" and logs[0]["reason"] == loader.unavailable_reason


def test_failed_build_is_tried_once_and_warned_once() -> None:
    calls = []

    def failing_build() -> ModuleType:
        calls.append(1)
        raise RuntimeError("Error building extension 'x': [1/2] c++ -O3 foo.cpp\nFAILED: foo.o\nfoo.cpp:3: error: expected ';'\nmore")

    loader = pa.KernelLoader(build=failing_build, environ={})
    with structlog.testing.capture_logs() as logs:
        assert loader.module() is None
        assert loader.module() is None
    assert calls == [1]
    expected = "build failed: RuntimeError: Error building extension 'x': foo.cpp:3: error: expected ';'"
    assert loader.unavailable_reason == expected
    assert len(logs) == 1 and logs[0]["log_level"] == "warning"


def test_concurrent_first_calls_build_once() -> None:
    calls = []
    module = ModuleType("built")

    def slow_build() -> ModuleType:
        calls.append(1)
        time.sleep(0.05)
        return module

    loader = pa.KernelLoader(build=slow_build, environ={})
    results: list[ModuleType | None] = []
    threads = [threading.Thread(target=lambda: results.append(loader.module())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [1] and results == [module] * 8 and loader.unavailable_reason is None


def test_build_directory_follows_cache_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(pa.CACHE_DIR_ENV, str(tmp_path))
    directory = pa.build_directory()
    assert directory.parent == tmp_path / "torch_extensions"
    assert torch.__version__ in directory.name
