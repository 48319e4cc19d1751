"""The KV pool's dtypes (``kv_cache_dtype``: float32, bfloat16, int8 with a scale per row): byte
accounting, what the pool stores and gives back, packed attention over a cached prefix, the
config key, and SmolLM2 decoding with each dtype through the runner (eager and lean).

The SmolLM2 check is teacher-forced, as the lossy lean kinds' test: along float32 KV's greedy
tokens, each decode step's next-token distribution with a bfloat16 or int8 pool must pick float32's
top token at ``MIN_TOP1_AGREEMENT`` of the positions with a mean KL(float32 || dtype) of at most
``MAX_MEAN_KL_NATS``. Greedy tokens themselves are not compared: one lossy step at a near-tie
changes every later token, and the gate's prompts measure that (``bench/kv_dtype.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gateway.config import parse_config
from gateway.errors import ConfigError
from models.attention import PackedStep, PrefillSegment, attend_packed
from models.kv_accuracy import teacher_forced_logprobs
from models.kv_cache import KVCacheDtype, KVShape, PagedKVCache, quantize_rows, storage_dtype
from tests.unit import test_lean_backend as lean_tests

SMOLLM2 = KVShape(num_layers=30, num_kv_heads=3, head_dim=64)
SMALL = KVShape(num_layers=2, num_kv_heads=2, head_dim=16)
BLOCK_SIZE = 4
MIN_TOP1_AGREEMENT = 0.9
MAX_MEAN_KL_NATS = 0.02


def test_bytes_per_token_count_the_scales_and_an_int8_pool_holds_over_3_5x_the_tokens() -> None:
    assert SMOLLM2.bytes_per_token_for("float32", 2) == SMOLLM2.bytes_per_token_for(None, 4) == 46_080
    assert SMOLLM2.bytes_per_token_for("bfloat16", 4) == 23_040
    assert SMOLLM2.bytes_per_token_for("int8", 4) == 2 * 30 * 3 * (64 + 4) == 12_240
    budget = 64 * 1024**2
    tokens = {kind: SMOLLM2.num_blocks_for(budget, 16, kind.element_bytes, kind.row_scale_bytes) * 16 for kind in KVCacheDtype}
    assert tokens[KVCacheDtype.BFLOAT16] / tokens[KVCacheDtype.FLOAT32] >= 2.0 - 0.02  # whole blocks round down
    assert tokens[KVCacheDtype.INT8] / tokens[KVCacheDtype.FLOAT32] >= 3.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_pool_holds_the_bytes_it_counts(dtype: torch.dtype) -> None:
    pool = PagedKVCache(SMALL, num_blocks=5, block_size=BLOCK_SIZE, dtype=dtype, device="cpu")
    assert pool.nbytes == 5 * BLOCK_SIZE * SMALL.bytes_per_token_in(dtype)
    assert (pool.key_scales(1) is None) == (dtype != torch.int8)


def test_quantized_rows_are_within_half_a_step_and_zero_rows_stay_zero() -> None:
    rows = torch.randn(7, 2, 16, generator=torch.Generator().manual_seed(0))
    rows[3, 1] = 0.0
    quantized, scales = quantize_rows(rows)
    assert quantized.dtype == torch.int8 and scales.shape == (7, 2) and int(quantized.abs().max()) == 127
    error = (quantized.float() * scales.unsqueeze(-1) - rows).abs()
    assert bool((error <= scales.unsqueeze(-1) / 2 + 1e-7).all())
    assert float(scales[3, 1]) == 0.0 and not quantized[3, 1].any()


def filled_pool(dtype: torch.dtype, num_tokens: int = 10) -> tuple[PagedKVCache, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool whose layer 1 holds ``num_tokens`` random K/V rows in blocks 3, 0, 4 (in that order)."""
    generator = torch.Generator().manual_seed(1)
    pool = PagedKVCache(SMALL, num_blocks=6, block_size=BLOCK_SIZE, dtype=dtype, device="cpu")
    table = torch.tensor([3, 0, 4])
    slots = table.repeat_interleave(BLOCK_SIZE)[:num_tokens] * BLOCK_SIZE + torch.arange(num_tokens) % BLOCK_SIZE
    key, value = (torch.randn(num_tokens, 2, 16, generator=generator) for _ in range(2))
    pool.write(1, slots, key, value)
    return pool, table, key, value


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 0.0), (torch.bfloat16, 2e-2), (torch.int8, 2e-2)])
def test_written_rows_come_back_within_the_dtypes_rounding(dtype: torch.dtype, atol: float) -> None:
    pool, table, key, value = filled_pool(dtype)
    got_key, got_value = pool.gather(1, table, 10, torch.float32)
    assert got_key.shape == (1, 2, 10, 16) and got_key.dtype == torch.float32
    torch.testing.assert_close(got_key[0].transpose(0, 1), key, atol=atol, rtol=0)
    torch.testing.assert_close(got_value[0].transpose(0, 1), value, atol=atol, rtol=0)


def test_copied_and_restored_int8_blocks_carry_their_scales() -> None:
    pool, _, _, _ = filled_pool(torch.int8)
    pool.copy_blocks([(3, 5)])
    assert torch.equal(pool.data[:, :, 5], pool.data[:, :, 3]) and pool.scales is not None
    assert torch.equal(pool.scales[:, :, 5], pool.scales[:, :, 3]) and bool(pool.scales[1, :, 5].any())
    blocks = torch.tensor([3])
    saved = pool.save_blocks(blocks)
    pool.write(1, torch.arange(BLOCK_SIZE) + 3 * BLOCK_SIZE, torch.zeros(BLOCK_SIZE, 2, 16), torch.zeros(BLOCK_SIZE, 2, 16))
    pool.restore_blocks(blocks, saved)
    assert torch.equal(pool.scales[:, :, 3], pool.scales[:, :, 5]) and torch.equal(pool.data[:, :, 3], pool.data[:, :, 5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_a_chunk_after_a_cached_prefix_and_a_decode_read_the_stored_rows(dtype: torch.dtype) -> None:
    """Step 2 packs one decode (of a sequence whose 6 tokens are cached) and a 3-token chunk
    after a 5-token cached prefix; both attend over what the pool holds."""
    generator = torch.Generator().manual_seed(2)
    pool = PagedKVCache(SMALL, num_blocks=6, block_size=BLOCK_SIZE, dtype=dtype, device="cpu")
    tables = [torch.tensor([0, 1]), torch.tensor([2, 3, 4])]
    lengths = [7, 8]
    slots = [table.repeat_interleave(BLOCK_SIZE)[:n] * BLOCK_SIZE + torch.arange(n) % BLOCK_SIZE for table, n in zip(tables, lengths)]
    keys, values = ([torch.randn(n, 2, 16, generator=generator) for n in lengths] for _ in range(2))
    for seq, cached in enumerate((6, 5)):
        pool.write(0, slots[seq][:cached], keys[seq][:cached], values[seq][:cached])
    step = PackedStep(
        pool, torch.cat([slots[0][6:], slots[1][5:]]), 1, tables[0][None].int(), torch.tensor([7], dtype=torch.int32),
        [PrefillSegment(start=1, num_tokens=3, position=5, block_ids=tables[1])],
    )
    query = torch.randn(4, 4, 16, generator=generator)
    out = attend_packed(step, 0, query, torch.cat([keys[0][6:], keys[1][5:]]), torch.cat([values[0][6:], values[1][5:]]), 0.25)
    for seq, rows in enumerate((slice(0, 1), slice(1, 4))):
        k, v = pool.gather(0, tables[seq], lengths[seq], torch.float32)
        n = rows.stop - rows.start
        mask = torch.arange(lengths[seq])[None] <= torch.arange(lengths[seq] - n, lengths[seq])[:, None]
        want = F.scaled_dot_product_attention(query[rows].transpose(0, 1)[None], k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
        torch.testing.assert_close(out[rows], want[0].transpose(0, 1), atol=1e-5, rtol=0)


def test_the_config_key_is_checked_and_names_itself() -> None:
    def bucket(batcher: dict[str, Any], kv_cache_dtype: str) -> dict[str, Any]:
        return {"slices": [{"name": "s"}], "models": [{
            "name": "gen", "source": "/m", "task": "generate", "max_model_len": 64,
            "buckets": [{"max_input_tokens": 64, "slice": "s", "batcher": batcher, "kv_cache_dtype": kv_cache_dtype}],
        }]}  # fmt: skip

    continuous = {"kind": "continuous", "max_num_batched_tokens": 64}
    assert parse_config(bucket(continuous, "int8")).models[0].buckets[0].kv_cache_dtype == "int8"
    with pytest.raises(ConfigError, match=r"models\.0\.buckets\.0\.kv_cache_dtype: .*'fp8'"):
        parse_config(bucket(continuous, "fp8"))
    with pytest.raises(ConfigError, match=r"models\.0\.buckets\.0\.kv_cache_dtype: only a continuous batcher"):
        parse_config(bucket({"kind": "dynamic"}, "int8"))
    assert storage_dtype(None, torch.bfloat16) == torch.bfloat16 and storage_dtype("int8", torch.float32) == torch.int8


# SmolLM2 cut to its first layers, the prompts, a pool size that holds them, and float32 KV's
# greedy tokens: the lean backend test's module fixture, here for this module.
smollm2 = lean_tests.smollm2


_FLOAT32_KV: dict[str, torch.Tensor] = {}  # float32 KV's decode log-probabilities per backend, computed once


@pytest.mark.parametrize("backend, kv_cache_dtype", [("eager", "int8"), ("lean", "bfloat16"), ("lean", "int8")])
def test_smollm2_decodes_with_each_kv_dtype_close_to_float32(smollm2: Any, backend: str, kv_cache_dtype: str) -> None:
    from models.causal_lm import CausalLMRunner

    model, prompts, num_blocks, want = smollm2
    if backend not in _FLOAT32_KV:
        _FLOAT32_KV[backend] = teacher_forced_logprobs(CausalLMRunner(model, num_blocks, lean_tests.BLOCK_SIZE, backend=backend), prompts, want)
    reference = _FLOAT32_KV[backend]
    runner = CausalLMRunner(model, num_blocks, lean_tests.BLOCK_SIZE, backend=backend, kv_cache_dtype=kv_cache_dtype)
    assert runner.backend == backend and runner.kv_cache.data.dtype == KVCacheDtype(kv_cache_dtype).torch_dtype
    got = teacher_forced_logprobs(runner, prompts, want)
    agreement = float((got.argmax(-1) == reference.argmax(-1)).float().mean())
    mean_kl = float((reference.exp() * (reference - got)).sum(-1).mean())
    assert agreement >= MIN_TOP1_AGREEMENT, f"top-1 agreement {agreement:.3f}"
    assert 0 < mean_kl <= MAX_MEAN_KL_NATS, f"mean KL {mean_kl:.5f} nats"


# SmolLM2-135M, all layers, int8 KV against float32 KV on the gate's 8 texts x 16 tokens (this
# machine, python -m bench.kv_dtype accuracy).
SMOLLM2_INT8_FIGURES = {
    "kv_cache_dtype": "int8", "greedy_agreement": 0.8047, "top1_agreement": 0.9609,
    "mean_kl_nats": 0.00054, "max_kl_nats": 0.0104,
}  # fmt: skip


def test_greedy_agreement_counts_positions_up_to_the_first_divergence() -> None:
    from models.kv_accuracy import greedy_agreement

    assert greedy_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == (2 / 4 + 1) / 2


def test_the_gate_enables_int8_kv_only_on_figures_that_pass_its_thresholds() -> None:
    from gateway.config import GateConfig
    from gateway.gate import chosen_kv_cache_dtype

    record = {"kv_cache": [SMOLLM2_INT8_FIGURES]}
    assert chosen_kv_cache_dtype(record, GateConfig()) == "float32"  # 0.80 < 0.99: refused
    assert chosen_kv_cache_dtype(record, GateConfig(min_kv_greedy_agreement=0.8)) == "int8"
    assert chosen_kv_cache_dtype(record, GateConfig(min_kv_greedy_agreement=0.8, max_kv_mean_kl_nats=1e-4)) == "float32"
    assert chosen_kv_cache_dtype({}, GateConfig(min_kv_greedy_agreement=0.1)) == "float32"


def test_an_auto_bucket_runs_the_kv_dtype_its_record_chose(tmp_path: Any) -> None:
    from types import SimpleNamespace

    from gateway import gate, runners
    from gateway.config import GateConfig

    config = parse_config({"slices": [{"name": "s"}], "models": [{
        "name": "gen", "source": "/m", "task": "generate", "max_model_len": 64,
        "buckets": [{"max_input_tokens": 64, "slice": "s", "kv_cache_dtype": "auto",
                     "batcher": {"kind": "continuous", "max_num_batched_tokens": 64}}],
    }]})  # fmt: skip
    model, bucket = config.models[0], config.models[0].buckets[0]
    loaded: Any = SimpleNamespace(device="cpu", folder=tmp_path)
    info: dict[str, Any] = {}
    lenient = GateConfig(min_kv_greedy_agreement=0.8)
    assert runners.kv_cache_dtype(tmp_path, lenient, model, loaded, bucket, 1, info) == "float32"  # no record yet
    key = gate.gate_key(model, bucket, loaded, 1)
    assert key["kv_cache_dtype"] == "auto"
    gate.save_record(gate.record_path(tmp_path, "gen", bucket.bucket_name), {"key": key, "kv_cache": [SMOLLM2_INT8_FIGURES]})
    assert runners.kv_cache_dtype(tmp_path, lenient, model, loaded, bucket, 1, info) == "int8" == info["kv_cache_dtype"]
    assert runners.kv_cache_dtype(tmp_path, GateConfig(), model, loaded, bucket, 1, info) == "float32"
