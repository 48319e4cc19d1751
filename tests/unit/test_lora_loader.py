"""models.lora_loader: real PEFT folders over SmolLM2 read into LoraAdapter, and every folder
Sluice cannot serve refused with the key at fault."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from models.errors import LoraAdapterError
from models.lora import LORA_TARGET_MODULES
from models.lora_loader import read_peft_adapter
from models.source import default_cache_dir, model_folder
from tests.lora_adapters import write_peft_adapter
from tests.tiny_models import SMOLLM2_SOURCE, write_tiny_llama


@pytest.fixture(scope="module")
def base() -> Path:
    return model_folder(SMOLLM2_SOURCE, default_cache_dir())


@pytest.fixture(scope="module")
def base_config(base: Path) -> object:
    return AutoConfig.from_pretrained(base)


@pytest.fixture(scope="module")
def adapter(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_peft_adapter(base, tmp_path_factory.mktemp("lora") / "a", rank=4, seed=1)


def _edited(adapter: Path, tmp_path: Path, **changes: object) -> Path:
    """A copy of ``adapter`` whose adapter_config.json has ``changes``."""
    folder = tmp_path / "edited"
    shutil.copytree(adapter, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def _refusal(folder: Path, base_config: object, max_lora_rank: int = 16) -> LoraAdapterError:
    with pytest.raises(LoraAdapterError) as caught:
        read_peft_adapter("x", folder, base_config, max_lora_rank)
    return caught.value


def test_reads_every_projection_of_every_layer_as_float32_equal_to_the_file(adapter: Path, base_config: object) -> None:
    lora = read_peft_adapter("a", adapter, base_config, 16)
    assert (lora.name, lora.rank, lora.scaling, lora.path) == ("a", 4, 2.0, str(adapter))
    assert lora.target_modules == frozenset(LORA_TARGET_MODULES)
    assert len(lora.weights) == 30 * len(LORA_TARGET_MODULES)
    tensors = load_file(adapter / "adapter_model.safetensors")
    a, b = lora.weights[(3, "k_proj")]
    assert a.shape == (4, 576) and b.shape == (192, 4) and a.dtype == torch.float32 and a.device.type == "cpu"
    assert torch.equal(a, tensors["base_model.model.model.layers.3.self_attn.k_proj.lora_A.weight"])
    assert torch.equal(b, tensors["base_model.model.model.layers.3.self_attn.k_proj.lora_B.weight"])
    assert lora.weights[(0, "down_proj")][0].shape == (4, 1536)


def test_rslora_scales_by_the_square_root_of_the_rank(base: Path, base_config: object, tmp_path: Path) -> None:
    folder = write_peft_adapter(base, tmp_path / "rs", rank=4, seed=2, target_modules=("q_proj", "v_proj"),
                                lora_alpha=6, use_rslora=True)
    lora = read_peft_adapter("rs", folder, base_config, 8)
    assert lora.scaling == pytest.approx(6 / math.sqrt(4))
    assert lora.target_modules == frozenset({"q_proj", "v_proj"})


def test_missing_folder_files_and_bin_checkpoints_are_refused(adapter: Path, base_config: object, tmp_path: Path) -> None:
    assert _refusal(tmp_path / "absent", base_config).param == "path"
    (tmp_path / "empty").mkdir()
    assert "adapter_config.json" in str(_refusal(tmp_path / "empty", base_config))
    binary = tmp_path / "bin"
    binary.mkdir()
    shutil.copy(adapter / "adapter_config.json", binary)
    (binary / "adapter_model.bin").write_bytes(b"pickle")
    refusal = _refusal(binary, base_config)
    assert refusal.param == "path" and "adapter_model.bin" in str(refusal) and "safetensors" in str(refusal)


@pytest.mark.parametrize("changes, param", [
    ({"peft_type": "IA3"}, "peft_type"),
    ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    ({"alpha_pattern": {"q_proj": 8}}, "alpha_pattern"),
    ({"layers_to_transform": [0, 1]}, "layers_to_transform"),
    ({"lora_bias": True}, "lora_bias"),
    ({"target_parameters": ["mlp.experts"]}, "target_parameters"),
    ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
    ({"r": 32}, "r"),
])
def test_options_sluice_does_not_serve_are_refused_by_key(
    adapter: Path, base_config: object, tmp_path: Path, changes: dict[str, object], param: str
) -> None:
    refusal = _refusal(_edited(adapter, tmp_path, **changes), base_config)
    assert refusal.param == param and param in str(refusal)


def test_a_rank_above_max_lora_rank_is_refused(adapter: Path, base_config: object) -> None:
    refusal = _refusal(adapter, base_config, max_lora_rank=2)
    assert refusal.param == "r" and "max_lora_rank of 2" in str(refusal)


def test_an_lm_head_tensor_is_refused(base: Path, base_config: object, tmp_path: Path) -> None:
    folder = write_peft_adapter(base, tmp_path / "head", rank=2, target_modules=("q_proj", "lm_head"))
    refusal = _refusal(folder, base_config)
    assert refusal.param == "target_modules" and "lm_head" in str(refusal)


def test_an_adapter_of_another_base_does_not_match(adapter: Path, tmp_path: Path) -> None:
    tiny = AutoConfig.from_pretrained(write_tiny_llama(tmp_path / "tiny"))
    refusal = _refusal(adapter, tiny)
    assert refusal.param == "path" and "base architecture or shapes do not match" in str(refusal)
