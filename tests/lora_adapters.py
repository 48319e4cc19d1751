"""PEFT LoRA adapters made in a test, and the reference their greedy output is checked against.

``write_peft_adapter(base, folder, rank, seed)`` wraps the base model (a Hugging Face folder) in
PEFT's ``LoraConfig`` on the given target modules and saves it with random, non-zero ``A`` and
``B`` (PEFT starts ``B`` at zero, which would make every adapter the base model), scaled so the
adapter changes greedy output without drowning the base: a distinct model per seed. The folder
is what ``peft`` users ship: ``adapter_config.json`` + ``adapter_model.safetensors``.

``merged_model(base, adapter)`` is PEFT's ``merge_and_unload`` of the adapter into a fresh copy
of the base: the reference Sluice's per-row LoRA must equal, token for token (with
``tests.e2e.reference.greedy_reference`` and its near-tie rule, ``assert_greedy_close``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models.lora import LORA_TARGET_MODULES

# Random A and B are drawn N(0, INIT_STD^2): large enough that greedy tokens change, small
# enough that the model still writes text.
INIT_STD = 0.07


def write_peft_adapter(
    base_folder: Path, folder: Path, rank: int = 8, seed: int = 0, target_modules: tuple[str, ...] = LORA_TARGET_MODULES,
    lora_alpha: int | None = None, **config: Any,
) -> Path:
    """Save a LoRA adapter of ``rank`` on ``target_modules`` of the model in ``base_folder`` to
    ``folder`` (created) and return it; ``config`` goes to ``LoraConfig`` as is (e.g.
    ``use_rslora=True``). ``lora_alpha`` defaults to ``2 * rank`` (scaling 2)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    lora_config = LoraConfig(
        r=rank, lora_alpha=lora_alpha if lora_alpha is not None else 2 * rank, target_modules=list(target_modules),
        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **config,
    )
    model = get_peft_model(base, lora_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return folder


def merged_model(base_folder: Path, adapter_folder: Path) -> Any:
    """The base model with the adapter merged into its weights (``merge_and_unload``), float32, eval."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_folder).merge_and_unload().eval()



def adapter_from_folder(name: str, folder: Path) -> Any:
    """The :class:`models.lora.LoraAdapter` of a PEFT folder saved by :func:`write_peft_adapter`
    (a test's own small reader: the gateway's is ``models.lora_loader``). Keys such as
    ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``; ``scaling`` is
    ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``)."""
    import json
    import math
    import re

    from safetensors.torch import load_file

    from models.lora import LoraAdapter

    config = json.loads((folder / "adapter_config.json").read_text())
    rank = int(config["r"])
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    pattern = re.compile(r".*\.layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight$")
    parts: dict[tuple[int, str], dict[str, Any]] = {}
    for key, tensor in tensors.items():
        match = pattern.match(key)
        assert match is not None, f"unexpected key {key}"
        parts.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor.float()
    weights = {key: (ab["A"], ab["B"]) for key, ab in parts.items()}
    return LoraAdapter(name=name, path=str(folder), rank=rank, scaling=float(scaling), weights=weights)
