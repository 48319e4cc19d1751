"""Decode steps as CUDA graphs (:mod:`models.cuda_graphs`): the capture sizes, the padding
bookkeeping, and the runner's whole graph path.

On a CPU the capture is a double (:class:`RerunCapture`: it "captures" by running the forward
once and "replays" by running it again over the same static buffers), so the padded steps, the
pad block and the reading of the real rows run here against a tiny random Llama, whose greedy
tokens must equal those of a runner without graphs. The ``gpu`` test captures real graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from gateway.config import parse_config
from gateway.runners import cuda_graph_sizes
from models.attention import ATTENTION_NAME, register_attention
from models.causal_lm import CausalLMRunner
from models.cuda_graphs import CapturedStep, DecodeGraphs, capture_sizes, pad_decode_inputs
from models.kv_cache import KVShape, PagedKVCache
from models.step_io import ForwardInput, SamplingParams, SequenceInput
from tests.unit.test_config import config_error, make_config_data

BLOCK_SIZE = 4
NUM_BLOCKS = 24
GREEDY = SamplingParams(temperature=0.0)
# seq_id -> (prompt, block table): tables out of order, blocks 0-2 and 20-23 never handed out.
SEQUENCES = {
    0: ([5, 17, 3, 99, 42], [7, 3, 12, 9]),
    1: ([8, 8, 1, 250, 31, 77, 64], [4, 15, 10, 16]),
    2: ([11, 12, 13], [5, 18, 6, 17]),
}
NUM_DECODE_STEPS = 6
FINISHED_AFTER = {2: 3}  # seq 2 stops after its 3rd decode: later steps run 2 of 3 rows


class RerunCapture:
    """A :class:`models.cuda_graphs.GraphCapture` for a CPU: "captures" by running the forward
    once, "replays" by running it again on the same buffers; counts both."""

    def __init__(self) -> None:
        self.num_captures = 0
        self.num_replays = 0

    def capture(self, forward: Callable[[], torch.Tensor]) -> CapturedStep:
        forward()
        self.num_captures += 1
        return _Rerun(self, forward)


class _Rerun:
    def __init__(self, owner: RerunCapture, forward: Callable[[], torch.Tensor]):
        self.owner, self.forward = owner, forward

    def replay(self) -> torch.Tensor:
        self.owner.num_replays += 1
        return self.forward()


class FailingCapture:
    def capture(self, forward: Callable[[], torch.Tensor]) -> CapturedStep:
        raise RuntimeError("operation not permitted when stream is capturing")


def test_capture_sizes_are_powers_of_two_to_8_then_every_16th_and_the_bucket_limit() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_cuda_graphs_default_to_the_slices_device_and_true_on_a_cpu_slice_is_refused() -> None:
    data = make_config_data()
    data["slices"].append({"name": "gpu0", "device": "cuda:0"})
    buckets = data["models"][0]["buckets"]
    buckets[0].update(slice="gpu0", slo={"tpot_p95_ms": 50, "max_batch": 100})
    buckets[1]["batcher"].update(max_num_seqs=20)
    bucket_on_gpu, bucket = parse_config(data, "test.yaml").models[0].buckets
    assert cuda_graph_sizes(bucket_on_gpu, "cuda:0") == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]  # up to the tuner's max_batch
    assert cuda_graph_sizes(bucket, "cpu") == []
    buckets[1]["batcher"].update(cuda_graphs=False)
    assert cuda_graph_sizes(parse_config(data, "test.yaml").models[0].buckets[1], "cuda:0") == []
    buckets[1]["batcher"].update(cuda_graphs=True)
    assert "models.0.buckets.1.batcher.cuda_graphs: true needs a GPU slice" in config_error(data)


def decode_input(seq_id: int, token: int, position: int, table: list[int]) -> SequenceInput:
    return SequenceInput(seq_id=seq_id, token_ids=[token], position=position, block_table=table, do_sample=True, params=GREEDY)


def test_padding_rows_write_and_read_the_pad_block_only_and_real_rows_stay_as_given() -> None:
    real = [decode_input(0, 7, 5, [3, 9]), decode_input(1, 8, 0, [4])]
    padded = pad_decode_inputs(real, BLOCK_SIZE, padded_size=4, pad_block_id=NUM_BLOCKS)
    pad_slots = range(NUM_BLOCKS * BLOCK_SIZE, (NUM_BLOCKS + 1) * BLOCK_SIZE)
    assert padded.num_real == 2
    assert padded.token_ids[:2] == [7, 8] and padded.positions[:2] == [5, 0]
    assert padded.slots[:2] == [9 * BLOCK_SIZE + 1, 4 * BLOCK_SIZE] and padded.context_lens[:2] == [6, 1]
    assert padded.block_tables[:2] == [[3, 9], [4, NUM_BLOCKS]]
    assert all(slot in pad_slots for slot in padded.slots[2:])
    assert padded.context_lens[2:] == [1, 1] and padded.block_tables[2:] == [[NUM_BLOCKS] * 2] * 2
    assert padded.token_ids[2:] == [0, 0] and padded.positions[2:] == [0, 0]
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode_inputs(real, BLOCK_SIZE, padded_size=1, pad_block_id=NUM_BLOCKS)


def test_only_decode_steps_without_lora_within_the_sizes_replay_a_graph() -> None:
    pool = PagedKVCache(KVShape(1, 1, 4), NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu", has_pad_block=True)
    graphs = DecodeGraphs(lambda ids, positions, step: ids.float(), pool, [1, 2], max_blocks_per_seq=2, capture=RerunCapture())
    decode = decode_input(0, 1, 4, [3, 9])
    assert not graphs.fits([decode])  # nothing captured yet
    graphs.capture_all()
    assert graphs.fits([decode]) and graphs.fits([decode, decode])
    prefill = SequenceInput(seq_id=1, token_ids=[1, 2], position=0, block_table=[3], do_sample=True, params=GREEDY)
    with_lora = SequenceInput(seq_id=2, token_ids=[1], position=0, block_table=[3], do_sample=True, params=GREEDY, lora_slot=0)
    assert not graphs.fits([decode, prefill]) and not graphs.fits([with_lora])
    assert not graphs.fits([decode] * 3) and not graphs.fits([decode_input(0, 1, 8, [3, 9, 4])])
    assert graphs.run([decode]).tolist() == [[1.0]]  # the real row only, of the size-1 graph
    with pytest.raises(ValueError, match="pad block"):
        DecodeGraphs(lambda *_: torch.zeros(1), PagedKVCache(KVShape(1, 1, 4), 2, 4, torch.float32, "cpu"), [1], 1, RerunCapture())


def tiny_llama(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """A 2-layer Llama (hidden 32, 4 heads of which 2 KV, vocabulary 256) with random weights,
    built in memory with Sluice's packed attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    register_attention()
    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=True,
    )
    config._attn_implementation = ATTENTION_NAME
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()


def greedy_tokens(runner: CausalLMRunner) -> dict[int, list[int]]:
    """Prefill every sequence of :data:`SEQUENCES` in one step, then decode them together (seq 2
    stops early); returns each one's sampled tokens."""
    prefill = [
        SequenceInput(seq_id=i, token_ids=prompt, position=0, block_table=table, do_sample=True, params=GREEDY)
        for i, (prompt, table) in SEQUENCES.items()
    ]
    out = runner.run(ForwardInput(prefill))
    tokens = {i: [t] for i, t in out.sampled_token_ids.items()}
    for step in range(NUM_DECODE_STEPS):
        live = [i for i in SEQUENCES if step < FINISHED_AFTER.get(i, NUM_DECODE_STEPS)]
        batch = [decode_input(i, tokens[i][-1], len(SEQUENCES[i][0]) + len(tokens[i]) - 1, SEQUENCES[i][1]) for i in live]
        for i, token in runner.run(ForwardInput(batch)).sampled_token_ids.items():
            tokens[i].append(token)
    return tokens


def test_a_runner_with_graphs_decodes_eagers_tokens_and_never_writes_a_block_it_was_not_given() -> None:
    model = tiny_llama()
    capture = RerunCapture()
    graphs = CausalLMRunner(model, NUM_BLOCKS, BLOCK_SIZE, cuda_graph_sizes=[1, 2, 4], graph_capture=capture)
    graphs.warm_up([(1, 1), (1, 8)])
    assert capture.num_captures == 3 and graphs.cuda_graph_sizes == [1, 2, 4]
    eager = CausalLMRunner(model, NUM_BLOCKS, BLOCK_SIZE)
    assert greedy_tokens(graphs) == greedy_tokens(eager)
    assert capture.num_replays == NUM_DECODE_STEPS  # every decode step, none of the prefill
    pool = graphs.kv_cache.data
    given = sorted({block for _, table in SEQUENCES.values() for block in table})
    free = [b for b in range(NUM_BLOCKS) if b not in given]
    assert not pool[:, :, free].any()
    assert pool[:, :, graphs.kv_cache.pad_block_id].any()
    torch.testing.assert_close(pool[:, :, given], eager.kv_cache.data[:, :, given])


def test_graphs_need_a_cuda_device_and_a_failed_capture_leaves_decodes_eager() -> None:
    model = tiny_llama()
    with pytest.raises(ValueError, match="CUDA device"):
        CausalLMRunner(model, NUM_BLOCKS, BLOCK_SIZE, cuda_graph_sizes=[1])
    runner = CausalLMRunner(model, NUM_BLOCKS, BLOCK_SIZE, cuda_graph_sizes=[1, 2], graph_capture=FailingCapture())
    runner.warm_up([(1, 1)])
    assert runner.cuda_graph_sizes == []
    assert greedy_tokens(runner) == greedy_tokens(CausalLMRunner(model, NUM_BLOCKS, BLOCK_SIZE))


@pytest.mark.gpu
def test_cuda_graph_decodes_equal_eager_decodes_on_a_gpu() -> None:
    model = tiny_llama("cuda:0")
    graphs = CausalLMRunner(model, NUM_BLOCKS, BLOCK_SIZE, cuda_graph_sizes=[1, 2, 4])
    graphs.warm_up([(1, 1), (1, 8)])
    assert graphs.cuda_graph_sizes == [1, 2, 4]  # empty: the capture failed (see the cuda_graphs_unavailable log)
    eager = CausalLMRunner(model, NUM_BLOCKS, BLOCK_SIZE)
    assert greedy_tokens(graphs) == greedy_tokens(eager)
    given = sorted({block for _, table in SEQUENCES.values() for block in table})
    torch.testing.assert_close(graphs.kv_cache.data[:, :, given], eager.kv_cache.data[:, :, given])


@pytest.mark.gpu
def test_a_bfloat16_graph_decode_is_close_to_eager_on_a_gpu() -> None:
    """bfloat16 weights and KV: one decode step of 3 sequences (padded to 4) against eager's
    hidden states (cuBLAS may pick other kernels for 4 rows than for 3, so not bitwise)."""
    model = tiny_llama("cuda:0", torch.bfloat16)
    graphs = CausalLMRunner(model, NUM_BLOCKS, BLOCK_SIZE, cuda_graph_sizes=[4], kv_cache_dtype="bfloat16")
    graphs.warm_up([(1, 1)])
    assert graphs.cuda_graph_sizes == [4]
    eager = CausalLMRunner(model, NUM_BLOCKS, BLOCK_SIZE, kv_cache_dtype="bfloat16")
    hidden = []
    for runner in (graphs, eager):
        prefill = [SequenceInput(seq_id=i, token_ids=p, position=0, block_table=t, do_sample=False, params=GREEDY) for i, (p, t) in SEQUENCES.items()]
        runner.run(ForwardInput(prefill))
        with torch.inference_mode():
            hidden.append(runner._forward([decode_input(i, 1, len(p), t) for i, (p, t) in SEQUENCES.items()]).float())
    torch.testing.assert_close(hidden[0], hidden[1], atol=3e-2, rtol=3e-2)
