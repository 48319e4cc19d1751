"""Reading a PEFT LoRA folder into a :class:`models.lora.LoraAdapter`, checked against its base.

A PEFT folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (tensor names like
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``). Sluice serves the plain
LoRA of PEFT's ``LoraLayer`` on the projections of :data:`models.lora.LORA_TARGET_MODULES`; an
option that changes that product (DoRA, biases, per-module ranks, ...) or a module outside them
(embeddings, ``lm_head``, ``modules_to_save``) is refused, never silently ignored, since the
adapter would then not say what it was trained to say.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from models.errors import LoraAdapterError
from models.lora import LORA_TARGET_MODULES, LoraAdapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# adapter_config.json keys whose value must be one of these (their PEFT defaults) for the
# adapter to be a plain LoRA; None and empty containers count as off for every key.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "use_dora": (False,), "bias": ("none",), "fan_in_fan_out": (False,), "rank_pattern": (), "alpha_pattern": (),
    "layers_to_transform": (), "layers_pattern": (), "lora_bias": (False,), "target_parameters": (),
    "trainable_token_indices": (), "modules_to_save": (), "layer_replication": (), "use_qalora": (False,),
    "alora_invocation_tokens": (), "use_bdlora": (False,),
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:[a-z_]+)\.([a-z_]+)\.lora_(A|B)(?:\.[^.]+)?\.weight$")


def read_peft_adapter(name: str, folder: str | Path, model_config: Any, max_lora_rank: int) -> LoraAdapter:
    """Read the PEFT LoRA adapter in ``folder`` for a base model whose Hugging Face config
    (``transformers.PretrainedConfig``: ``num_hidden_layers``, ``hidden_size``,
    ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``) is
    ``model_config``, serving it as ``name``.

    Returns the adapter with ``A`` ``[r, in_features]`` and ``B`` ``[out_features, r]`` float32
    CPU tensors, unscaled, and ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``).

    Raises:
        LoraAdapterError: a missing folder or file, a ``.bin`` checkpoint, ``peft_type`` other
            than LORA, ``r`` above ``max_lora_rank``, a target module outside
            :data:`LORA_TARGET_MODULES`, an option Sluice does not serve, or tensors whose layer
            count or shapes do not match the base. ``param`` is the ``adapter_config.json`` key
            at fault, ``"path"`` for the folder and its files.
    """
    folder = Path(folder)
    config = _read_config(folder)
    rank = _check_config(config, max_lora_rank)
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise LoraAdapterError(f"lora_alpha must be a positive number, got {alpha!r}", "lora_alpha")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _read_weights(folder, rank)
    _check_shapes(weights, model_config)
    return LoraAdapter(name=name, path=str(folder), rank=rank, scaling=float(scaling), weights=weights)


def _read_config(folder: Path) -> dict[str, Any]:
    """``adapter_config.json`` of ``folder`` as a dict (raises LoraAdapterError naming ``path``)."""
    if not folder.is_dir():
        raise LoraAdapterError(f"no adapter folder at {folder}", "path")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoraAdapterError(f"{folder} has no {CONFIG_FILE}: not a PEFT adapter folder", "path")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraAdapterError(f"{path} is not readable JSON: {exc}", "path") from None
    if not isinstance(config, dict):
        raise LoraAdapterError(f"{path} must hold a JSON object", "path")
    return config


def _check_config(config: dict[str, Any], max_lora_rank: int) -> int:
    """The adapter's rank, after checking that its config describes a plain LoRA Sluice serves."""
    if config.get("peft_type") != "LORA":
        raise LoraAdapterError(f"peft_type must be LORA, got {config.get('peft_type')!r}", "peft_type")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraAdapterError(f"r must be a positive integer, got {rank!r}", "r")
    if rank > max_lora_rank:
        raise LoraAdapterError(f"r is {rank}, above the base model's max_lora_rank of {max_lora_rank}", "r")
    for key, off in _OFF_VALUES.items():
        value = config.get(key)
        if value in (None, {}, [], "") or value in off:
            continue
        raise LoraAdapterError(f"{key} is not supported (got {value!r}); Sluice serves plain LoRA only", key)
    targets = config.get("target_modules")
    if isinstance(targets, list):
        outside = sorted(set(map(str, targets)) - set(LORA_TARGET_MODULES))
        if outside:
            raise LoraAdapterError(
                f"target_modules {outside} are not supported; an adapter may target {list(LORA_TARGET_MODULES)}",
                "target_modules",
            )
    return rank


def _read_weights(folder: Path, rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """``(layer, projection) -> (A, B)`` from the safetensors file, float32 on the CPU."""
    from safetensors import SafetensorError, safe_open

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        bins = [p.name for p in folder.glob("*.bin")]
        hint = f" ({bins[0]} is a pickle checkpoint, which Sluice does not load: save with safetensors)" if bins else ""
        raise LoraAdapterError(f"{folder} has no {WEIGHTS_FILE}{hint}", "path")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as tensors:
            for key in tensors.keys():
                match = _KEY.search(key)
                if match is None:
                    raise LoraAdapterError(
                        f"tensor {key} is not a LoRA A or B of a decoder layer's projection; an adapter may "
                        f"change only {list(LORA_TARGET_MODULES)}", "target_modules",
                    )
                layer, projection, half = int(match[1]), match[2], match[3]
                if projection not in LORA_TARGET_MODULES:
                    raise LoraAdapterError(
                        f"target module {projection} (tensor {key}) is not supported; an adapter may target "
                        f"{list(LORA_TARGET_MODULES)}", "target_modules",
                    )
                halves.setdefault((layer, projection), {})[half] = tensors.get_tensor(key).to(torch.float32).contiguous()
    except (SafetensorError, OSError) as exc:
        raise LoraAdapterError(f"{path} is not a readable safetensors file: {exc}", "path") from None
    weights = {}
    for (layer, projection), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoraAdapterError(f"layer {layer} {projection} has lora_{''.join(pair)} without its pair", "path")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoraAdapterError(
                f"layer {layer} {projection}: A {list(a.shape)} and B {list(b.shape)} do not have rank r = {rank} "
                "(per-module ranks are not supported)", "r",
            )
        weights[(layer, projection)] = (a, b)
    if not weights:
        raise LoraAdapterError(f"{path} holds no LoRA tensors", "path")
    return weights


def _check_shapes(weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], model_config: Any) -> None:
    """Raise LoraAdapterError (``param`` ``path``) unless every ``(A, B)`` fits the base's layer."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    num_layers = int(config.num_hidden_layers)
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    intermediate = int(config.intermediate_size)
    in_out = {
        "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden),
    }
    for (layer, projection), (a, b) in weights.items():
        in_features, out_features = in_out[projection]
        if layer >= num_layers:
            raise LoraAdapterError(
                f"the base architecture or shapes do not match: the adapter has layer {layer}, the base model "
                f"{num_layers} layers", "path",
            )
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise LoraAdapterError(
                f"the base architecture or shapes do not match: layer {layer} {projection} maps {a.shape[1]} to "
                f"{b.shape[0]} features, the base model's {in_features} to {out_features}", "path",
            )
