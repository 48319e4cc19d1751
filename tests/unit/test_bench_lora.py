"""bench.lora's parts without a server: the adapter folders it writes read back as PEFT
adapters, the decode steps it times, the config it serves, its table."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import LlamaConfig

from bench.lora import decode_step, format_decode, gateway_config, random_adapter, write_peft_folder
from gateway.config import GatewayConfig
from models.lora import LORA_TARGET_MODULES
from models.lora_loader import read_peft_adapter

CONFIG = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_a_written_folder_reads_back_as_the_same_adapter(tmp_path: Path) -> None:
    folder = write_peft_folder(tmp_path / "a", CONFIG, rank=4, seed=3)
    read = read_peft_adapter("a", folder, CONFIG, max_lora_rank=8)
    want = random_adapter("a", CONFIG, 4, 3)
    assert read.rank == 4 and read.scaling == 2.0
    assert set(read.weights) == {(layer, p) for layer in range(2) for p in LORA_TARGET_MODULES}
    for key, (a, b) in want.weights.items():
        assert torch.equal(read.weights[key][0], a) and torch.equal(read.weights[key][1], b)


def test_decode_steps_spread_sequences_over_the_slots() -> None:
    step = decode_step(5, 2, context_tokens=20)
    assert [s.lora_slot for s in step.sequences] == [0, 1, 0, 1, 0]
    assert all(len(s.block_table) == 2 and s.position == 20 for s in step.sequences)
    assert all(s.lora_slot is None for s in decode_step(3, 0, 20).sequences)


def test_the_served_config_is_valid(tmp_path: Path) -> None:
    config = GatewayConfig.model_validate(gateway_config(tmp_path, rank=8, threads=2, max_cpu_loras=7))
    (model,) = config.models
    assert model.lora is not None and model.lora.max_cpu_loras == 7 and model.lora.max_lora_rank == 8


def test_the_table_gives_throughput_as_a_ratio_to_no_adapter() -> None:
    args = argparse.Namespace(kind="lean-int4", rank=8, max_rank=None, context=128, threads=2)
    table = format_decode(args, [16], [0, 4], {(16, 0): 40.0, (16, 4): 50.0})
    assert table.splitlines()[-1].split() == ["16", "40.0,", "1.00", "50.0,", "0.80"]
