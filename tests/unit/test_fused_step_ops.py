"""The lean step's fused ops in csrc/paged_attention.cpp: ``write_kv`` (a step's K/V rows into a
layer's pool) and ``rope_`` (RoPE in place), against torch's formulas, with their errors."""

from __future__ import annotations

import pytest
import torch

from models import paged_attention as pa

pytestmark = pytest.mark.skipif(not pa.fused_rope_available(), reason="the paged-attention kernel is not built")
NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM = 64, 3, 64


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_rope_matches_hugging_faces_formula_on_the_q_and_k_heads(num_tokens: int) -> None:
    torch.manual_seed(num_tokens)
    num_heads, num_qk_heads = 15, 12
    qkv = torch.randn(num_tokens, num_heads * HEAD_DIM)
    heads = qkv.view(num_tokens, num_heads, HEAD_DIM)
    angles = torch.rand(num_tokens, HEAD_DIM // 2) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    expected = heads.clone()
    expected[:, :num_qk_heads] = heads[:, :num_qk_heads] * cos[:, None] + _rotate_half(heads[:, :num_qk_heads]) * sin[:, None]
    pa.rope_(heads, cos, sin, num_qk_heads)
    torch.testing.assert_close(heads, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(heads[:, num_qk_heads:], expected[:, num_qk_heads:]), "V heads must stay as they were"


@pytest.mark.parametrize("case", ["dtype", "odd_head_dim", "table_shape", "num_heads", "strided_rows"])
def test_rope_refuses_bad_inputs(case: str) -> None:
    x, cos, sin, num_heads = torch.randn(2, 4, 8), torch.randn(2, 8), torch.randn(2, 8), 3
    error: type[Exception] = ValueError
    if case == "dtype":
        x, error = x.double(), TypeError
    elif case == "odd_head_dim":
        x, cos, sin = torch.randn(2, 4, 7), torch.randn(2, 7), torch.randn(2, 7)
    elif case == "table_shape":
        cos = torch.randn(3, 8)
    elif case == "num_heads":
        num_heads = 5
    else:
        x = torch.randn(2, 8, 4).transpose(1, 2)
    with pytest.raises(error):
        pa.rope_(x, cos, sin, num_heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_rows_of_a_strided_product_at_their_slots(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    num_tokens = 7
    pool = torch.zeros(2, NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    qkv = torch.randn(num_tokens, 5 * NUM_KV_HEADS * HEAD_DIM).to(dtype).view(num_tokens, 5 * NUM_KV_HEADS, HEAD_DIM)
    key, value = qkv[:, 3 * NUM_KV_HEADS : 4 * NUM_KV_HEADS], qkv[:, 4 * NUM_KV_HEADS :]
    slots = torch.tensor([5, 0, 63, 17, 18, 40, 2])
    expected = pool.clone()
    expected[0].index_copy_(0, slots, key)
    expected[1].index_copy_(0, slots, value)
    pa.write_kv_rows(pool[0], pool[1], slots, key, value)
    assert torch.equal(pool, expected)


def test_write_kv_falls_back_to_torch_for_rows_that_are_not_contiguous() -> None:
    pool = torch.zeros(2, NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM)
    key = torch.randn(4, HEAD_DIM, NUM_KV_HEADS).transpose(1, 2)  # each row strided
    value = torch.randn(4, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.tensor([1, 2, 3, 4])
    pa.write_kv_rows(pool[0], pool[1], slots, key, value)
    assert torch.equal(pool[0, 1:5], key) and torch.equal(pool[1, 1:5], value)


@pytest.mark.parametrize("case", ["slot_range", "negative_slot", "dtype", "slot_dtype", "token_count"])
def test_write_kv_refuses_bad_inputs(case: str) -> None:
    pool = torch.zeros(2, NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM)
    key, value, slots = torch.randn(2, NUM_KV_HEADS, HEAD_DIM), torch.randn(2, NUM_KV_HEADS, HEAD_DIM), torch.tensor([0, 1])
    error: type[Exception] = ValueError
    if case == "slot_range":
        slots = torch.tensor([0, NUM_SLOTS])
    elif case == "negative_slot":
        slots = torch.tensor([-1, 0])
    elif case == "dtype":
        key, error = key.bfloat16(), TypeError
    elif case == "slot_dtype":
        slots, error = slots.int(), TypeError
    else:
        slots = torch.tensor([0, 1, 2])
    with pytest.raises(error):
        pa.write_kv_rows(pool[0], pool[1], slots, key, value)
    if case in ("slot_range", "negative_slot"):
        assert not pool.any(), "nothing is written when a slot is out of range"
