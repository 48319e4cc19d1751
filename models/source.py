"""Resolving a model ``source`` string to local files, and converting GGUF files once.

Sources are offline only:

- ``pkg:<python_package>/<relative path>``: a file or folder shipped inside an installed Python
  package, located with :func:`importlib.util.find_spec` *without importing the package* (the
  model packages we use import runtimes we never install).
- any other string: a filesystem path (``~`` expanded) to a Hugging Face model folder or to a
  ``.gguf`` file.

A ``.gguf`` file is dequantised by transformers (``gguf_file=``) into a float32 model, and its
weights are saved once as safetensors in a cache folder so later starts load in under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

import structlog

from models.errors import ModelSourceError

log = structlog.get_logger(__name__)

PACKAGE_PREFIX = "pkg:"


def default_cache_dir() -> Path:
    """The folder for converted models: ``$SLUICE_CACHE_DIR``, else ``~/.cache/sluice``."""
    env = os.environ.get("SLUICE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sluice"


def resolve_source(source: str) -> Path:
    """Return the local path a source names.

    Raises:
        ModelSourceError: the package is not installed or the path does not exist.
    """
    if source.startswith(PACKAGE_PREFIX):
        package, _, rel = source[len(PACKAGE_PREFIX) :].partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelSourceError(f"source {source!r}: Python package {package!r} is not installed")
        path = Path(list(spec.submodule_search_locations)[0]) / rel
    else:
        path = Path(source).expanduser()
    if not path.exists():
        raise ModelSourceError(f"source {source!r}: {path} does not exist")
    return path


def gguf_cache_folder(gguf_path: Path, cache_dir: Path) -> Path:
    """The cache folder of one GGUF file, keyed by its name, size and modification time."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir / "gguf" / f"{gguf_path.stem}-{key}"


def convert_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Convert a GGUF causal LM to a safetensors model folder once; return the folder.

    ``save_pretrained`` on a GGUF-loaded model fails (it keeps a GGUF quantization config), so the
    dequantised weights are loaded into a fresh model of the same config, which saves normally.
    The folder is written under a temporary name and renamed, so a crash leaves no half cache.
    """
    folder = gguf_cache_folder(gguf_path, cache_dir)
    if (folder / "config.json").exists():
        return folder
    log.info("gguf_conversion_started", gguf=str(gguf_path), folder=str(folder))
    started = time.perf_counter()
    _convert(gguf_path, folder)
    log.info("gguf_conversion_finished", gguf=str(gguf_path), folder=str(folder), duration_s=round(time.perf_counter() - started, 3))
    return folder


def _convert(gguf_path: Path, folder: Path) -> None:
    """Dequantise ``gguf_path`` into a safetensors model folder written as ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "sluice-source.json").write_text(json.dumps({"gguf": str(gguf_path)}))
    try:
        os.replace(tmp, folder)
    except OSError:
        # Another process converted the same file meanwhile; keep its folder.
        if not (folder / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def model_folder(source: str, cache_dir: Path) -> Path:
    """Resolve a source to a Hugging Face model folder, converting a GGUF file if needed."""
    path = resolve_source(source)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelSourceError(f"source {source!r}: a file source must be a .gguf file")
        return convert_gguf(path, cache_dir)
    if not (path / "config.json").exists():
        raise ModelSourceError(f"source {source!r}: {path} has no config.json")
    return path
