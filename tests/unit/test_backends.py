"""Backend plumbing without models: the registry, the one run-time fallback to eager (for
encoders and decoders alike), and the config rules for ``backend`` and ``quantization``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from gateway.config import parse_config
from gateway.errors import ConfigError
from models.backends import BackendUnavailableError, EncoderParts, FallbackRunner
from models.backends.registry import CONFIGURED_KINDS, DECODER_FACTORIES, ENCODER_FACTORIES, build_decoder, build_encoder
from tests.unit.test_config import config_error, make_config_data

ROOT = Path(__file__).resolve().parents[2]


class FakeEncoder:
    def __init__(self, name: str, fail_on_call: int | None = None):
        self.name, self.fail_on_call, self.calls = name, fail_on_call, 0

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("session lost")
        return torch.full((*input_ids.shape, 4), float(len(self.name)))

    def warm_up(self, shapes: Sequence[tuple[int, int]]) -> float:
        return 0.0


def test_a_failing_backend_hands_the_batch_and_all_later_ones_to_eager_once() -> None:
    primary, eager = FakeEncoder("onnx-fp32", fail_on_call=2), FakeEncoder("eager")
    failures: list[tuple[str, str]] = []
    backend = FallbackRunner(primary, eager, lambda name, exc: failures.append((name, str(exc))))
    ids = torch.ones((2, 3), dtype=torch.long)
    assert backend.name == "onnx-fp32" and backend.hidden_states(ids, ids)[0, 0, 0] == len("onnx-fp32")
    assert backend.hidden_states(ids, ids)[0, 0, 0] == len("eager")  # the failed batch still gets an answer
    assert backend.hidden_states(ids, ids)[0, 0, 0] == len("eager")
    assert backend.name == "eager" and failures == [("onnx-fp32", "session lost")]
    assert (primary.calls, eager.calls) == (2, 2)  # the primary is not tried again


class FakeDecoder:
    """A decoder backend's interface (``hidden_states(input_ids, position_ids, step)``)."""

    def __init__(self, name: str, fail: bool = False):
        self.name, self.fail, self.calls = name, fail, 0

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, step: object) -> torch.Tensor:
        self.calls += 1
        if self.fail:
            raise RuntimeError("inductor kernel crashed")
        return torch.full((1, input_ids.shape[1], 2), float(len(self.name)))


def test_the_same_fallback_wraps_a_decoder_and_passes_every_input_through() -> None:
    primary, eager = FakeDecoder("compiled", fail=True), FakeDecoder("eager")
    failures: list[str] = []
    backend = FallbackRunner(primary, eager, lambda name, exc: failures.append(name))
    ids = torch.ones((1, 5), dtype=torch.long)
    assert backend.hidden_states(ids, ids, step=None).shape == (1, 5, 2)
    assert backend.hidden_states(ids, ids, None)[0, 0, 0] == len("eager")
    assert (primary.calls, eager.calls, failures, backend.name) == (1, 2, ["compiled"], "eager")
    assert backend.active is eager


def test_the_registry_maps_every_kind_and_refuses_unknown_ones() -> None:
    assert set(ENCODER_FACTORIES) == {"eager", "compiled", "onnx-fp32", "onnx-int8"}
    assert set(DECODER_FACTORIES) == {"eager", "compiled", "lean", "lean-int8", "lean-int4", "lean-int8-bf16", "lean-int4-bf16",
                                     "lean-int8-q8a", "lean-int4-q8a"}
    assert set(CONFIGURED_KINDS.values()) <= set(ENCODER_FACTORIES) | set(DECODER_FACTORIES)
    assert CONFIGURED_KINDS[("onnx", "int8")] == "onnx-int8"
    parts = EncoderParts(model=None, folder=Path("."), cache_dir=Path("."), num_threads=1, device="cpu")
    with pytest.raises(BackendUnavailableError, match="unknown encoder backend 'tensorrt'"):
        build_encoder("tensorrt", parts)
    with pytest.raises(BackendUnavailableError, match="unknown decoder backend 'onnx-fp32'"):
        build_decoder("onnx-fp32", None)  # type: ignore[arg-type]


def test_building_the_registry_loads_no_optional_library() -> None:
    """Importing every backend module stays cheap: ONNX Runtime loads only when an ONNX
    backend is built (run in a fresh interpreter, where nothing else imported it)."""
    code = "import sys, models.backends.registry; print('onnxruntime' in sys.modules, 'onnx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.split() == ["False", "False"]


def with_bucket(model: int, **fields: object) -> dict[str, object]:
    data = make_config_data()
    data["models"][model]["buckets"][0].update(fields)
    return data


def test_backend_and_quantization_rules() -> None:
    parse_config(with_bucket(1, backend="onnx", quantization="int8"))
    parse_config(with_bucket(0, backend="compiled"))
    parse_config(with_bucket(1, backend="auto"))
    assert "onnx runs embedding models only" in config_error(with_bucket(0, backend="onnx"))
    assert "quantization: int8 needs backend onnx" in config_error(with_bucket(1, backend="auto", quantization="int8"))
    parse_config(with_bucket(0, backend="lean", quantization="int4"))
    parse_config(with_bucket(0, backend="lean", quantization="int8"))
    assert "lean runs generation models only" in config_error(with_bucket(1, backend="lean"))
    assert "quantization: int4 needs backend lean" in config_error(with_bucket(1, backend="onnx", quantization="int4"))
    with pytest.raises(ConfigError, match="backend"):
        parse_config(with_bucket(1, backend="tensorrt"))
    with pytest.raises(ConfigError, match="gate.min_speedup"):
        parse_config({**make_config_data(), "gate": {"min_speedup": 0.5}})


def test_slice_budgets_count_weights_of_loaded_models_and_kv_pools() -> None:
    from gateway.memory import check_slice_budgets

    data = make_config_data()
    data["slices"][0]["memory_budget_bytes"] = 1000
    config = parse_config(data)
    kv = {("gen", "le32"): 300, ("gen", "le96"): 300}
    check_slice_budgets(config, kv, {})  # 600 of KV, no weights loaded yet
    check_slice_budgets(config, kv, {"gen": 250, "emb": 150})  # exactly 1000
    with pytest.raises(ConfigError) as exc:
        check_slice_budgets(config, kv, {"gen": 250, "emb": 151})
    message = str(exc.value)
    assert "slices.0.memory_budget_bytes" in message and "needs 1001 bytes" in message
    assert "gen 250, emb 151" in message and "KV pools 600" in message and "budget of 1000" in message
    data["slices"][0]["kv_cache_memory_bytes"] = 2000
    assert "kv_cache_memory_bytes: 2000 is above memory_budget_bytes 1000" in config_error(data)


def test_a_cuda_slice_without_that_device_is_a_config_error() -> None:
    import torch

    from gateway.build import check_devices

    data = make_config_data()
    data["slices"][0]["device"] = "cuda:7"
    config = parse_config(data)
    if torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(ConfigError, match=r"slices\.0\.device: cuda:7 is not a CUDA device torch can use here"):
        check_devices(config)
