"""The CUDA device plumbing around the runners: the CPU-only backend kinds refused on a GPU, a
slice worker's own CUDA stream, a process slice's worker seeing only its GPU, gate records keyed
by the GPU's model, and encoders on CUDA in half precision (the ``gpu`` tests)."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from buckets.slices.thread import ThreadSlice, device_stream
from gateway import gate
from gateway.slice_worker import visible_devices, worker_config
from models.backends.base import BackendUnavailableError, DecoderParts
from models.backends.eager import EagerEncoder
from models.backends.lean import DECODER_FACTORIES as LEAN_FACTORIES
from models.backends.registry import build_decoder
from models.encoder import EmbeddingRunner
from tests.unit.test_cuda_graphs import tiny_llama
from tests.unit.test_slice_worker import two_slice_config

MIG_UUID = "MIG-4f2c9a1e-0b3d-5e6f-8a9b-0c1d2e3f4a5b"


@pytest.mark.parametrize("kind", sorted(LEAN_FACTORIES))
def test_the_lean_kinds_refuse_a_decoder_off_the_cpu_before_any_work(kind: str) -> None:
    model = tiny_llama().to("meta")  # stands for a GPU: not the CPU, and nothing to compute
    parts = DecoderParts(model.model, None, torch.ones((1, 1, 1, 1), dtype=torch.bool), model.lm_head)
    with pytest.raises(BackendUnavailableError, match="CPU only.*meta"):
        build_decoder(kind, parts)


class OneStepBatcher:
    """A batcher with one step to run, which records the CUDA stream it ran on (None on a CPU)."""

    kind = "dynamic"

    def __init__(self) -> None:
        self.stepped = threading.Event()
        self.stream: Any = None

    def seconds_until_ready(self, now: float) -> float | None:
        return None if self.stepped.is_set() else 0.0

    def head_priority(self, now: float) -> float:
        return 0.0

    def step(self) -> None:
        self.stream = torch.cuda.current_stream() if torch.cuda.is_available() else None
        self.stepped.set()

    def shutdown(self) -> None:
        pass


def step_once_on(device: str) -> tuple[ThreadSlice, OneStepBatcher]:
    """A started slice on ``device`` that ran one step of a :class:`OneStepBatcher` (then stopped)."""
    device_slice, batcher = ThreadSlice("s", device, num_threads=1), OneStepBatcher()
    device_slice.attach(("m", "b", 0), SimpleNamespace(make_batcher=lambda: batcher, backend_info={}))  # type: ignore[arg-type]
    device_slice.start()
    try:
        assert batcher.stepped.wait(timeout=30)
    finally:
        device_slice.stop()
    return device_slice, batcher


def test_onnx_refuses_a_cuda_device_without_the_cuda_provider_before_any_export(tmp_path: Path) -> None:
    import onnxruntime

    from models.backends.onnx import OnnxEncoder

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here")
    with pytest.raises(BackendUnavailableError, match="no CUDAExecutionProvider for cuda:0"):
        OnnxEncoder(None, tmp_path, "none", tmp_path, device="cuda:0")


def test_a_cpu_slice_worker_steps_without_a_stream() -> None:
    assert device_stream("cpu") is None
    device_slice, _ = step_once_on("cpu")
    assert device_slice.stream is None


@pytest.mark.parametrize(
    ("device", "isolation", "visible"),
    [("cuda:3", "process", "3"), (MIG_UUID, "process", MIG_UUID), ("cuda:3", "thread", None), ("cuda:3", "ray", None), ("cpu", "process", None)],
)
def test_a_process_slices_worker_sees_its_gpu_alone(device: str, isolation: str, visible: str | None) -> None:
    assert visible_devices(device, isolation) == visible


def test_a_process_slice_on_cuda_n_is_the_workers_cuda_0() -> None:
    config = two_slice_config()
    data = config.model_dump(mode="json")
    data["slices"][0]["device"] = "cuda:1"
    config = type(config).model_validate(data)
    assert worker_config(config, "proc").slices[0].device == "cuda:0"


def test_gate_records_name_the_gpu_by_model_not_ordinal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    assert gate.machine_info("cuda:3", 1) == {**gate.machine_info("cuda:0", 1), "device": "cuda", "gpu": "NVIDIA H200"}
    assert gate.machine_info("cpu", 1)["device"] == "cpu"


@pytest.mark.gpu
def test_two_slice_workers_on_one_gpu_get_streams_of_their_own() -> None:
    first, second = device_stream("cuda:0"), device_stream("cuda:0")
    assert first != second and first.device == second.device == torch.device("cuda:0")
    assert first != torch.cuda.default_stream(0)
    device_slice, batcher = step_once_on("cuda:0")
    assert device_slice.stream is not None and batcher.stream == device_slice.stream


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_tiny_bert_on_cuda_in_half_precision_embeds_close_to_cpu_float32(dtype: torch.dtype) -> None:
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    model: Any = BertModel(config)
    model.eval()
    batch = [[1, 5, 9, 2], [1, 7, 2], [1, 3, 4, 5, 6, 2]]
    want, want_padding = EmbeddingRunner(EagerEncoder(model), pad_token_id=0).embed(batch)
    on_gpu = model.to(device="cuda:0", dtype=dtype)
    got, padding = EmbeddingRunner(EagerEncoder(on_gpu), pad_token_id=0, device="cuda:0").embed(batch)
    assert got.dtype == torch.float32 and got.device.type == "cpu" and padding == want_padding
    assert float(torch.nn.functional.cosine_similarity(got, want).min()) > 0.99
