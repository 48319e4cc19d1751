"""The Triton paged-attention kernels (models/triton_attention.py) and their dispatch.

Without an NVIDIA GPU, tests/conftest.py sets ``TRITON_INTERPRET=1`` before this module imports
the kernels, so they run on CPU tensors in Triton's interpreter (each program in numpy): shapes
stay tiny. Decode is compared with :func:`torch_paged_decode_attention`, prefill chunks with a
plain causal SDPA over the gathered keys. The ``gpu`` tests run the same at SmolLM2's shapes on
CUDA (``pytest -m gpu``), where the dispatch sends calls to the kernels by itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models import cuda_attention
from models import triton_attention as ta
from models.attention import PackedStep, PrefillSegment, attend_packed
from models.kv_cache import KVShape, PagedKVCache
from models.paged_attention import paged_decode_attention, torch_paged_decode_attention

UNUSED_BLOCK_ID = 1 << 30  # past a sequence's last block: never read
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
REPO = Path(__file__).resolve().parents[2]
DecodeArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # query, K, V, tables, lens


def make_pool(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V pools ``[num_blocks, block_size, num_kv_heads, head_dim]`` (views of one tensor)."""
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(device, dtype)
    return pool[0], pool[1]


def make_tables(context_lens: list[int], block_size: int, num_blocks: int, extra_blocks: int = 2, seed: int = 0) -> torch.Tensor:
    """Shuffled, distinct block ids per sequence, ``extra_blocks`` unused ids past the longest."""
    generator = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in context_lens]
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.full((len(context_lens), max(counts) + extra_blocks), UNUSED_BLOCK_ID, dtype=torch.int32)
    for seq, count in enumerate(counts):
        tables[seq, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
    return tables


def decode_problem(
    context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, device: str = "cpu"
) -> DecodeArgs:
    """``(query, key_cache, value_cache, block_tables, context_lens)`` of one decode call."""
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 3
    key_cache, value_cache = make_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    query = torch.randn(len(context_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    tables = make_tables(context_lens, block_size, num_blocks).to(device)
    return query, key_cache, value_cache, tables, torch.tensor(context_lens, dtype=torch.int32, device=device)


def causal_reference(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor, position: int, scale: float
) -> torch.Tensor:
    """A chunk's ``[n, num_heads, head_dim]`` queries (the first at ``position``) over its
    sequence's keys ``0 .. position + i``, gathered from the pool, in float64."""
    n, total = query.shape[0], position + query.shape[0]
    blocks = table[: -(-total // key_cache.shape[1])].long()
    k, v = (cache[blocks].flatten(0, 1)[:total].double().transpose(0, 1)[None] for cache in (key_cache, value_cache))
    mask = torch.arange(total, device=query.device)[None] <= torch.arange(position, total, device=query.device)[:, None]
    q = query.double().transpose(0, 1)[None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_matches_torch_with_one_and_several_splits(dtype: torch.dtype, num_splits: int) -> None:
    """GQA (6 heads over 2), ragged contexts (a block edge, one token, partial blocks), tables
    with unused trailing ids that would fault if read."""
    args = decode_problem([1, 8, 9, 45], num_heads=6, num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype)
    launch = ta.decode_launch(args[3].shape[1] * 4, 4 * 2, 3, 16, num_splits)
    assert launch.num_splits == num_splits
    out = ta.triton_paged_decode_attention(*args, 0.25, num_splits=num_splits)
    want = torch_paged_decode_attention(*args, 0.25)
    assert out.shape == args[0].shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), want.float(), atol=TOLERANCE[dtype], rtol=0)


def test_decode_reads_a_bfloat16_pool_under_a_float32_query_and_a_strided_query() -> None:
    query, key_cache, value_cache, tables, lens = decode_problem([3, 20], 4, 4, 16, 4, torch.bfloat16)
    strided = torch.randn(2, 4, 32)[:, :, ::2].float()
    out = ta.triton_paged_decode_attention(strided, key_cache, value_cache, tables, lens, 0.25)
    want = torch_paged_decode_attention(strided, key_cache, value_cache, tables, lens, 0.25)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_an_empty_context_padding_row_gives_zeros_and_leaves_the_others_alone(num_splits: int) -> None:
    query, key_cache, value_cache, tables, lens = decode_problem([40, 1], 4, 2, 16, 4, torch.float32)
    lens[1] = 0
    out = ta.triton_paged_decode_attention(query, key_cache, value_cache, tables, lens, 0.25, num_splits=num_splits)
    assert bool((out[1] == 0).all())
    want = torch_paged_decode_attention(query[:1], key_cache, value_cache, tables[:1], lens[:1], 0.25)
    torch.testing.assert_close(out[:1], want, atol=1e-5, rtol=0)


def test_the_split_count_follows_host_integers_only() -> None:
    assert ta.decode_num_splits(max_context_tokens=4096, num_programs=3) == 16  # by length: 256 tokens each
    assert ta.decode_num_splits(max_context_tokens=4096, num_programs=96) == 2  # the grid is full already
    assert ta.decode_num_splits(max_context_tokens=100, num_programs=1) == 1
    assert ta.decode_num_splits(max_context_tokens=1 << 20, num_programs=1) == ta.MAX_SPLITS
    launch = ta.decode_launch(4096, 3, group=3, head_dim=64)
    assert launch.num_splits * launch.tokens_per_split >= 4096 and launch.tokens_per_split % launch.tile_tokens == 0


def test_decode_refuses_an_int8_pool_and_a_bad_split_count() -> None:
    query, key_cache, value_cache, tables, lens = decode_problem([3], 2, 2, 16, 4, torch.float32)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        ta.triton_paged_decode_attention(query, key_cache.to(torch.int8), value_cache.to(torch.int8), tables, lens, 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        ta.triton_paged_decode_attention(query, key_cache, value_cache, tables, lens, 1.0, num_splits=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_at_different_positions_in_one_launch(dtype: torch.dtype) -> None:
    """A 5-token chunk after 7 tokens and a 70-token chunk (two query tiles) after 13, packed
    after a row that no segment owns (it stays as it was)."""
    block_size, positions, lengths = 4, [7, 13], [5, 70]
    totals = [p + n for p, n in zip(positions, lengths)]
    key_cache, value_cache = make_pool(40, block_size, 2, 16, dtype)
    tables = make_tables(totals, block_size, 40, extra_blocks=1)
    query = torch.randn(1 + sum(lengths), 6, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    segments = torch.tensor([[1, 6], lengths, positions], dtype=torch.int32)
    out = torch.full(query.shape, 7.0, dtype=dtype)
    ta.triton_paged_prefill_attention(query, key_cache, value_cache, tables, segments, 70, 0.25, out=out)
    assert bool((out[0] == 7.0).all())
    for seg, (start, n, position) in enumerate(zip([1, 6], lengths, positions)):
        want = causal_reference(query[start : start + n], key_cache, value_cache, tables[seg], position, 0.25)
        torch.testing.assert_close(out[start : start + n].double(), want, atol=TOLERANCE[dtype], rtol=0)


def small_step(dtype: torch.dtype, device: str = "cpu") -> tuple[PackedStep, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed step: one decode (6 tokens cached), a 3-token chunk after 5 cached tokens and a
    4-token prompt at position 0; returns the step and its query, key and value rows."""
    generator = torch.Generator().manual_seed(2)
    block_size = 4
    pool = PagedKVCache(KVShape(num_layers=1, num_kv_heads=2, head_dim=16), num_blocks=8, block_size=block_size, dtype=dtype, device=device)
    tables = [torch.tensor([0, 1]), torch.tensor([2, 3, 4]), torch.tensor([5])]
    positions, lengths = [6, 5, 0], [1, 3, 4]
    slot_rows = []
    for table, position, n in zip(tables, positions, lengths):
        slots = table.repeat_interleave(block_size) * block_size + torch.arange(len(table) * block_size) % block_size
        cached = torch.randn(position, 2, 16, generator=generator)
        pool.write(0, slots[:position].to(device), cached.to(device), cached.flip(0).to(device))
        slot_rows.append(slots[position : position + n])
    step = PackedStep(
        pool, torch.cat(slot_rows).to(device), 1, tables[0][None].int().to(device), torch.tensor([7], dtype=torch.int32, device=device),
        [PrefillSegment(1, 3, 5, tables[1].to(device)), PrefillSegment(4, 4, 0, None)],
    )
    query, key, value = (torch.randn(8, n, 16, generator=generator).to(device, dtype) for n in (4, 2, 2))
    return step, query, key, value


def test_attend_packed_on_cpu_keeps_its_cpu_kernels_and_never_asks_for_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    step, query, key, value = small_step(torch.float32)
    before = attend_packed(step, 0, query, key, value, 0.25)

    def refuse() -> None:
        raise AssertionError("a CPU call asked for the Triton kernels")

    monkeypatch.setattr(cuda_attention, "triton_kernels", refuse)
    assert cuda_attention.triton_for(query, step.kv_cache.key_cache(0)) is None
    torch.testing.assert_close(attend_packed(step, 0, query, key, value, 0.25), before, atol=0, rtol=0)
    assert "chunks" not in vars(step)  # the Triton launch's tensors were never built
    want = causal_reference(query[1:4], step.kv_cache.key_cache(0), step.kv_cache.value_cache(0), torch.tensor([2, 3, 4]), 5, 0.25)
    torch.testing.assert_close(before[1:4].double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_packed_routed_to_triton_matches_its_torch_path(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """The CUDA routing (decode and the chunk in Triton, the position-0 prompt on SDPA) run on CPU
    tensors in the interpreter: the same rows as the CPU path."""
    step, query, key, value = small_step(dtype)
    want = attend_packed(step, 0, query, key, value, 0.25)
    monkeypatch.setattr(cuda_attention, "triton_for", lambda query, key_cache: ta)
    got = attend_packed(step, 0, query, key, value, 0.25)
    assert "chunks" in vars(step) and step.chunks is not None and step.chunks.segments.tolist() == [[1], [3], [5]]
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=0)


def test_cpu_serving_never_imports_triton() -> None:
    code = (
        "import sys, torch\n"
        "from models.paged_attention import paged_decode_attention\n"
        "from models import attention\n"
        "q = torch.randn(1, 2, 16); kv = torch.randn(1, 4, 2, 16)\n"
        "paged_decode_attention(q, kv, kv, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    env = {**os.environ, "SLUICE_DISABLE_CPP_KERNELS": "1"}
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=120)


SMOLLM2_HEADS, SMOLLM2_KV_HEADS, SMOLLM2_HEAD_DIM, GPU_BLOCK_SIZE = 9, 3, 64, 16


@pytest.mark.gpu
@pytest.mark.parametrize("context_lens", [[1], [4096], [1, 15, 16, 17, 600, 2049, 4096, 333]], ids=["one", "long", "ragged"])
def test_gpu_decode_matches_torch_at_smollm2_shapes(context_lens: list[int]) -> None:
    args = decode_problem(context_lens, SMOLLM2_HEADS, SMOLLM2_KV_HEADS, SMOLLM2_HEAD_DIM, GPU_BLOCK_SIZE, torch.bfloat16, "cuda")
    scale = SMOLLM2_HEAD_DIM**-0.5
    out = ta.triton_paged_decode_attention(*args, scale)
    query, key_cache, value_cache, tables, lens = args
    want = torch_paged_decode_attention(query.float(), key_cache.float(), value_cache.float(), tables, lens, scale)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=0)
    for num_splits in (1, 7):
        torch.testing.assert_close(ta.triton_paged_decode_attention(*args, scale, num_splits=num_splits).float(), want, atol=2e-2, rtol=0)


@pytest.mark.gpu
def test_gpu_prefill_chunks_match_the_causal_reference() -> None:
    positions, lengths = [16, 1000, 3], [512, 77, 1]
    totals = [p + n for p, n in zip(positions, lengths)]
    num_blocks = sum(-(-t // GPU_BLOCK_SIZE) for t in totals) + 4
    key_cache, value_cache = make_pool(num_blocks, GPU_BLOCK_SIZE, SMOLLM2_KV_HEADS, SMOLLM2_HEAD_DIM, torch.bfloat16, "cuda")
    tables = make_tables(totals, GPU_BLOCK_SIZE, num_blocks).cuda()
    starts = [0, 512, 589]
    query = torch.randn(sum(lengths), SMOLLM2_HEADS, SMOLLM2_HEAD_DIM, device="cuda").to(torch.bfloat16)
    segments = torch.tensor([starts, lengths, positions], dtype=torch.int32, device="cuda")
    out = ta.triton_paged_prefill_attention(query, key_cache, value_cache, tables, segments, max(lengths), 0.125)
    for seg, (start, n, position) in enumerate(zip(starts, lengths, positions)):
        want = causal_reference(query[start : start + n], key_cache, value_cache, tables[seg], position, 0.125)
        torch.testing.assert_close(out[start : start + n].double(), want, atol=2e-2, rtol=0)


@pytest.mark.gpu
def test_gpu_attend_packed_runs_triton_and_matches_the_cpu_path() -> None:
    assert cuda_attention.triton_kernels() is not None
    step, query, key, value = small_step(torch.float32, "cuda")
    got = attend_packed(step, 0, query, key, value, 0.25)
    assert "chunks" in vars(step)  # built: the chunk went to the Triton launch
    cpu_step, cpu_query, cpu_key, cpu_value = small_step(torch.float32)
    torch.testing.assert_close(got.cpu(), attend_packed(cpu_step, 0, cpu_query, cpu_key, cpu_value, 0.25), atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_gpu_decode_through_the_dispatch_is_captured_in_a_cuda_graph_and_replays_new_lengths() -> None:
    """No host sync on the decode path: a capture would fail on one. The split count is fixed by
    the table's width, so new context lengths replay the same graph."""
    query, key_cache, value_cache, tables, lens = decode_problem([100, 3000], 9, 3, 64, 16, torch.bfloat16, "cuda")
    scale = 0.125
    paged_decode_attention(query, key_cache, value_cache, tables, lens, scale)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(query, key_cache, value_cache, tables, lens, scale)
    lens.copy_(torch.tensor([7, 2999], dtype=torch.int32))  # within each table's blocks
    graph.replay()
    want = torch_paged_decode_attention(query.float(), key_cache.float(), value_cache.float(), tables, lens, scale)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=0)
