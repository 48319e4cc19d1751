"""The ``onnx`` encoder backend: an ONNX export of the encoder run by ONNX Runtime, FP32 or INT8.

Export: ``torch.onnx.export(..., dynamo=True)`` (the ``torch.export`` path through onnxscript,
opset 18) of a wrapper that returns only ``last_hidden_state``; inputs ``input_ids``,
``attention_mask`` (and ``token_type_ids``, fed as zeros, when the model's forward takes them),
batch and sequence axes dynamic. With torch 2.13 both exporters work on all-MiniLM-L6-v2 and
agree with eager to ~3e-6 max abs on real tokens (~7e-5 on padding positions, never pooled);
the legacy TorchScript one is faster (1.4 s against 6.8 s) but deprecated, so dynamo it is.

INT8: :mod:`models.backends.onnx_int8` (its recipe and the measurements behind it).

Files are cached under ``cache_dir / "onnx" / <name>-<key>/model.onnx``; the key hashes the model
folder's config and weight files (sizes, mtimes), the model's class and dtype, the torch,
transformers, onnx and onnxruntime versions, :data:`EXPORT_FORMAT` and the quantization recipe.
Files are written under a temporary name and renamed, so a crash leaves no half file.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.backends.base import BackendUnavailableError, EncoderBackend, EncoderParts, Quantization, warm_up_encoder
from models.backends.onnx_int8 import INT8_RECIPE, Int8Recipe, calibration_feeds, quantize_int8

OUTPUT_NAME = "last_hidden_state"
OPSET_VERSION = 18
# Bump when the export or quantization code changes, so files cached by older code are not reused.
EXPORT_FORMAT = 1
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf"})


class OnnxEncoder:
    """An encoder exported to ONNX and run by an ONNX Runtime session (see the module docstring).

    Args:
        model: a loaded Hugging Face encoder (``AutoModel``) whose output has ``last_hidden_state``.
        folder: the model folder it was loaded from (its files key the cache).
        quantization: ``"none"`` (FP32) or ``"int8"`` (:data:`INT8_RECIPE`).
        cache_dir: Sluice's cache folder; files go under ``cache_dir / "onnx"``.
        num_threads: ONNX Runtime intra-op threads (default ``torch.get_num_threads()``).
        device: ``"cpu"`` or ``"cuda[:N]"``; CUDA runs only where onnxruntime has the CUDA provider.
        recipe: the INT8 recipe (tests and benchmarks try others; the key of the cache has it).

    Attributes:
        name: ``onnx-fp32`` or ``onnx-int8``.
        export_s: seconds spent exporting and quantizing now (``0.0`` when every file was cached).
        path: the ``.onnx`` file the session runs.
        providers: the session's execution providers, in order.

    Raises:
        BackendUnavailableError: onnx or onnxruntime missing, the export, the quantization or the
            session set-up failed; the message says which.
    """

    def __init__(
        self,
        model: Any,
        folder: Path,
        quantization: Quantization,
        cache_dir: Path,
        num_threads: int | None = None,
        device: str = "cpu",
        recipe: Int8Recipe = INT8_RECIPE,
    ):
        if quantization not in ("none", "int8"):
            raise BackendUnavailableError(f"onnx backend: quantization {quantization!r} is not 'none' or 'int8'")
        _require_onnx_runtime(device)
        self.name = "onnx-fp32" if quantization == "none" else "onnx-int8"
        self.device = torch.device(device)
        self.has_token_types = _takes_token_types(model)
        started = time.perf_counter()
        did_work, fp32_path = _ensure_fp32(model, Path(folder), Path(cache_dir), self.has_token_types)
        self.path = fp32_path
        if quantization == "int8":
            quantized, self.path = _ensure_int8(model, Path(folder), Path(cache_dir), fp32_path, recipe, self.has_token_types)
            did_work = did_work or quantized
        self.export_s = time.perf_counter() - started if did_work else 0.0
        self.session = _make_session(self.path, device, num_threads)
        self.providers: list[str] = list(self.session.get_providers())

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[batch, seq]`` int64 ids and mask in, ``[batch, seq, hidden]`` float32 out, on the
        device of ``input_ids``. Called from the bucket's worker thread."""
        ids = input_ids.detach().to("cpu", torch.long).numpy()
        feeds = {"input_ids": ids, "attention_mask": attention_mask.detach().to("cpu", torch.long).numpy()}
        if self.has_token_types:
            feeds["token_type_ids"] = np.zeros_like(ids)
        (hidden,) = self.session.run([OUTPUT_NAME], feeds)
        return torch.from_numpy(hidden).float().to(input_ids.device)

    def warm_up(self, shapes: Sequence[tuple[int, int]]) -> float:
        return warm_up_encoder(self, shapes, self.device)


def _onnx_encoder(quantization: Quantization) -> Callable[[EncoderParts], EncoderBackend]:
    def build(parts: EncoderParts) -> EncoderBackend:
        return OnnxEncoder(parts.model, parts.folder, quantization, parts.cache_dir, parts.num_threads, parts.device)

    return build


ENCODER_FACTORIES: dict[str, Callable[[EncoderParts], EncoderBackend]] = {
    "onnx-fp32": _onnx_encoder("none"),
    "onnx-int8": _onnx_encoder("int8"),
}


class _LastHiddenState(torch.nn.Module):
    """The encoder with plain tensor inputs and ``last_hidden_state`` as its only output."""

    def __init__(self, model: Any):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        kwargs = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state


def _require_onnx_runtime(device: str = "cpu") -> None:
    """onnx and onnxruntime import, and for a ``cuda`` device onnxruntime has its CUDA provider
    (else the session would run on the CPU beside a GPU slice: refused, so a gate there measures
    eager and compiled only).

    Raises:
        BackendUnavailableError: saying which is missing.
    """
    try:
        import onnx  # noqa: F401
        import onnxruntime
    except (ImportError, OSError) as error:
        raise BackendUnavailableError(f"onnx backend: {error} (pip install onnx onnxruntime onnxscript)") from error
    if device.startswith("cuda") and "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        raise BackendUnavailableError(f"onnx backend: onnxruntime has no CUDAExecutionProvider for {device} (pip install onnxruntime-gpu)")


def _takes_token_types(model: Any) -> bool:
    forward = getattr(model, "forward", None)
    try:
        return forward is not None and "token_type_ids" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def cache_key(model: Any, folder: Path, recipe: str) -> str:
    """16 hex digits that change when the model files, library versions or recipe change."""
    import onnx
    import onnxruntime
    import transformers

    config = folder / "config.json"
    files = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES) if folder.is_dir() else []
    dtype = next((p.dtype for p in model.parameters()), None) if hasattr(model, "parameters") else None
    parts = {
        "format": EXPORT_FORMAT,
        "opset": OPSET_VERSION,
        "folder": str(folder.resolve()),
        "config": config.read_text() if config.is_file() else None,
        "weights": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
        "model": f"{type(model).__module__}.{type(model).__qualname__}:{dtype}",
        "versions": [torch.__version__, transformers.__version__, onnx.__version__, onnxruntime.__version__],
        "recipe": recipe,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _cache_path(model: Any, folder: Path, cache_dir: Path, tag: str, recipe: str) -> Path:
    return cache_dir / "onnx" / f"{folder.name}-{tag}-{cache_key(model, folder, recipe)}" / "model.onnx"


def _ensure_fp32(model: Any, folder: Path, cache_dir: Path, has_token_types: bool) -> tuple[bool, Path]:
    """The cached FP32 export, made now if missing; ``(made_now, path)``. The exporter traces a
    private copy of ``model``: while it traces, a forward of the traced module on another
    thread (the bucket serving on eager beside a background gate) would run on fake tensors."""
    path = _cache_path(model, folder, cache_dir, "fp32", "none")
    if path.is_file():
        return False, path
    _write_atomically(path, lambda tmp: export_encoder(copy.deepcopy(model), tmp, has_token_types))
    return True, path


def _ensure_int8(model: Any, folder: Path, cache_dir: Path, fp32_path: Path, recipe: Int8Recipe, has_token_types: bool) -> tuple[bool, Path]:
    """The cached INT8 file, quantized now from ``fp32_path`` if missing; ``(made_now, path)``."""
    path = _cache_path(model, folder, cache_dir, "int8", recipe.describe())
    if path.is_file():
        return False, path
    calibration = None
    if recipe.smooth_alpha is not None:
        try:
            calibration = calibration_feeds(folder, has_token_types)
        except Exception as error:
            raise BackendUnavailableError(f"onnx backend: no tokenizer in {folder} for INT8 calibration: {error}") from error
    _write_atomically(path, lambda tmp: quantize_int8(fp32_path, tmp, recipe, calibration))
    return True, path


def _write_atomically(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"tmp{os.getpid()}-{path.name}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def export_encoder(model: Any, path: Path, has_token_types: bool) -> None:
    """Export ``model`` to ``path`` (one self-contained ``.onnx`` file).

    Raises:
        BackendUnavailableError: the exporter failed.
    """
    wrapper = _LastHiddenState(model).eval()
    device = next((p.device for p in wrapper.parameters()), torch.device("cpu"))
    ids = torch.ones((2, 16), dtype=torch.long, device=device)
    args: tuple[torch.Tensor, ...] = (ids, torch.ones_like(ids))
    names = ["input_ids", "attention_mask"]
    if has_token_types:
        args, names = (*args, torch.zeros_like(ids)), [*names, "token_type_ids"]
    # A tuple (one entry per positional argument) rather than a dict keyed by parameter name,
    # so the optional token_type_ids needs no entry when it is not passed.
    axes = tuple({0: "batch", 1: "sequence"} for _ in args)
    try:
        with torch.inference_mode(False), torch.no_grad():
            torch.onnx.export(
                wrapper,
                args,
                str(path),
                input_names=names,
                output_names=[OUTPUT_NAME],
                opset_version=OPSET_VERSION,
                dynamo=True,
                dynamic_shapes=axes,
                external_data=False,
                verbose=False,
            )
    except Exception as error:
        raise BackendUnavailableError(f"onnx backend: exporting {type(model).__name__} failed: {error}") from error


def _make_session(path: Path, device: str, num_threads: int | None) -> Any:
    """An ONNX Runtime session on ``path``: CUDA first for a ``cuda`` device when onnxruntime has
    it, else CPU; all graph optimizations on."""
    import onnxruntime as ort

    providers: list[Any] = ["CPUExecutionProvider"]
    if device.startswith("cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, ("CUDAExecutionProvider", {"device_id": torch.device(device).index or 0}))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = num_threads or torch.get_num_threads()
    options.log_severity_level = 3
    # No spin-waiting after a run: idle ORT threads would take the cores from torch (the gate's
    # interleaved eager runs, the slice's other buckets).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), sess_options=options, providers=providers)
    except Exception as error:
        raise BackendUnavailableError(f"onnx backend: ONNX Runtime cannot load {path}: {error}") from error
