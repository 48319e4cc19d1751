"""KV-cache capacity planning: how many blocks, tokens and sequences fit in a memory budget.

The arithmetic (:func:`plan_kv_cache`) is plain integers, from the formula in ARCHITECTURE.md:
KV bytes per token = ``2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes)``,
``scale_bytes`` the float32 scale an int8 pool keeps per row of ``head_dim`` values (0 for float
dtypes; :mod:`models.kv_cache`). The rest reads a
model's KV geometry from its local files without loading weights (:func:`read_kv_source`): a
folder's ``config.json``, or for a ``.gguf`` file the converted cache folder of
:mod:`models.source` when it exists, else the GGUF header itself (:func:`read_gguf_metadata`).
``sluice kv-plan`` is the command-line face of this module.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from models.errors import ModelSourceError
from models.kv_cache import KVCacheDtype, KVShape
from models.source import gguf_cache_folder, resolve_source

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # a model's dtypes
KV_DTYPE_BYTES = {**DTYPE_BYTES, "int8": 1}  # a KV pool's (kv_cache_dtype), per element
# Bytes of scale per row of head_dim values, beside the elements (int8 pools only).
ROW_SCALE_BYTES = {"int8": KVCacheDtype.INT8.row_scale_bytes}

_UNIT_BYTES = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip
_SIZE_PATTERN = re.compile(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*([a-z]*)\s*")
_SIZE_HINT = "expected bytes or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 8GiB or 1.5GB"


def parse_memory_size(text: str) -> int:
    """Bytes named by ``text``: ``1000000``, ``512MiB``, ``8GiB``, ``1.5GB`` (units case-insensitive;
    ``KB``/``MB``/``GB``/``TB`` are powers of 1000, ``KiB``/``MiB``/``GiB``/``TiB`` of 1024).
    A fraction of a byte left by a unit is dropped.

    Raises:
        ValueError: unparseable text, an unknown unit, a fractional byte count, or zero.
    """
    match = _SIZE_PATTERN.fullmatch(text.lower())
    if match is None or match.group(2) not in _UNIT_BYTES:
        raise ValueError(f"invalid memory size {text!r}: {_SIZE_HINT}")
    number, unit = Decimal(match.group(1)), match.group(2)
    if unit in ("", "b") and number != number.to_integral_value():
        raise ValueError(f"invalid memory size {text!r}: a byte count must be a whole number")
    num_bytes = int(number * _UNIT_BYTES[unit])
    if num_bytes <= 0:
        raise ValueError(f"invalid memory size {text!r}: must be at least 1 byte")
    return num_bytes


def format_bytes(num_bytes: int) -> str:
    """A short human-readable size in binary units: ``512 B``, ``45.00 KiB``, ``1.75 GiB``."""
    value, unit = float(num_bytes), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, next_unit
    return f"{num_bytes} B" if unit == "B" else f"{value:.2f} {unit}"


@dataclass(frozen=True)
class KVPlan:
    """What a paged KV cache of one model holds in a memory budget, all in plain integers."""

    memory_bytes: int  # the budget for KV blocks
    bytes_per_token: int  # 2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + row_scale_bytes)
    block_size: int  # tokens per block
    block_bytes: int  # block_size * bytes_per_token
    num_blocks: int  # floor(memory_bytes / block_bytes)
    max_tokens_in_flight: int  # num_blocks * block_size, over all sequences together
    seq_len: int  # the sequence length the per-sequence figures are for
    blocks_per_seq: int  # ceil(seq_len / block_size): a partly filled last block is still a whole block
    seq_bytes: int  # blocks_per_seq * block_bytes, what one sequence of seq_len occupies
    max_num_seqs: int  # floor(num_blocks / blocks_per_seq), sequences of seq_len at once

    def bytes_for_seqs(self, num_seqs: int) -> int:
        """Memory ``num_seqs`` sequences of ``seq_len`` tokens occupy, in whole blocks."""
        return num_seqs * self.seq_bytes

    def can_fit(self, num_seqs: int) -> bool:
        """Whether ``num_seqs`` sequences of ``seq_len`` tokens fit in the budget at once."""
        return num_seqs <= self.max_num_seqs


def plan_kv_cache(
    shape: KVShape, dtype_bytes: int, memory_bytes: int, block_size: int, seq_len: int, row_scale_bytes: int = 0
) -> KVPlan:
    """Plan a paged KV cache of ``shape`` in ``dtype_bytes``-wide elements within ``memory_bytes``,
    each row of ``head_dim`` elements with ``row_scale_bytes`` of scale (4 for int8, see
    :data:`ROW_SCALE_BYTES`).

    Raises:
        ValueError: a count below its minimum (``memory_bytes`` >= 0, the others >= 1), naming it.
    """
    for name, value, minimum in (
        ("dtype_bytes", dtype_bytes, 1),
        ("memory_bytes", memory_bytes, 0),
        ("block_size", block_size, 1),
        ("seq_len", seq_len, 1),
        ("row_scale_bytes", row_scale_bytes, 0),
    ):
        if value < minimum:
            raise ValueError(f"{name}: must be at least {minimum} (got {value})")
    bytes_per_token = shape.bytes_per_token(dtype_bytes, row_scale_bytes)
    block_bytes = block_size * bytes_per_token
    num_blocks = memory_bytes // block_bytes
    blocks_per_seq = -(-seq_len // block_size)
    return KVPlan(
        memory_bytes=memory_bytes,
        bytes_per_token=bytes_per_token,
        block_size=block_size,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        max_tokens_in_flight=num_blocks * block_size,
        seq_len=seq_len,
        blocks_per_seq=blocks_per_seq,
        seq_bytes=blocks_per_seq * block_bytes,
        max_num_seqs=num_blocks // blocks_per_seq,
    )


def dtype_description(dtype: str) -> str:
    """``float32 (4 bytes)``, ``int8 (1 byte, and a 4-byte scale per row of head_dim)``."""
    element = f"{KV_DTYPE_BYTES[dtype]} byte{'s' if KV_DTYPE_BYTES[dtype] > 1 else ''}"
    scale = ROW_SCALE_BYTES.get(dtype, 0)
    return f"{dtype} ({element}, and a {scale}-byte scale per row of head_dim)" if scale else f"{dtype} ({element})"


def plan_rows(plan: KVPlan, num_seqs: int | None = None) -> list[tuple[str, str]]:
    """``(label, value)`` rows describing ``plan``, sizes both human-readable and exact."""

    def size(num_bytes: int) -> str:
        return f"{format_bytes(num_bytes)} ({num_bytes:,} bytes)"

    rows = [
        ("bytes per token", size(plan.bytes_per_token)),
        ("memory", size(plan.memory_bytes)),
        ("block", f"{plan.block_size:,} tokens, {size(plan.block_bytes)}"),
        ("blocks", f"{plan.num_blocks:,}"),
        ("max tokens in flight", f"{plan.max_tokens_in_flight:,}"),
        ("one sequence", f"{plan.seq_len:,} tokens in {plan.blocks_per_seq:,} blocks, {size(plan.seq_bytes)}"),
        ("max sequences", f"{plan.max_num_seqs:,} of {plan.seq_len:,} tokens each"),
    ]
    if num_seqs is not None:
        verdict = "fits" if plan.can_fit(num_seqs) else "does not fit"
        rows.append((f"{num_seqs:,} sequences", f"{size(plan.bytes_for_seqs(num_seqs))}, {verdict}"))
    return rows


@dataclass(frozen=True)
class KVSource:
    """A model's KV geometry as read from its local files."""

    shape: KVShape
    dtype: str | None  # the dtype its config names (``torch_dtype``/``dtype``), None when it names none
    origin: str  # where the geometry was read, for the user: "config.json in ..." or "GGUF header of ..."


def read_kv_source(source: str, cache_dir: Path) -> KVSource:
    """Read the KV geometry of a model ``source`` (as in :func:`models.source.resolve_source`)
    without loading weights or converting GGUF files.

    Raises:
        ModelSourceError: the source does not resolve, or its config has no decoder geometry.
    """
    path = resolve_source(source)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelSourceError(f"source {source!r}: a file source must be a .gguf file")
        converted = gguf_cache_folder(path, cache_dir)
        if (converted / "config.json").exists():
            return _read_folder(converted)
        return _read_gguf(path)
    if not (path / "config.json").exists():
        raise ModelSourceError(f"source {source!r}: {path} has no config.json")
    return _read_folder(path)


def _read_folder(folder: Path) -> KVSource:
    from transformers import AutoConfig

    config_path = folder / "config.json"
    try:
        config = AutoConfig.from_pretrained(folder).get_text_config()
        shape = KVShape.from_config(config)
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelSourceError(f"{config_path}: no decoder KV geometry ({exc})") from None
    raw = json.loads(config_path.read_text())
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    return KVSource(shape=shape, dtype=str(dtype) if dtype else None, origin=f"config.json in {folder}")


def _read_gguf(path: Path) -> KVSource:
    """Geometry from a GGUF header, with llama.cpp's meaning of the keys: ``attention.key_length``
    is the head size, else ``embedding_length / attention.head_count``."""
    metadata = read_gguf_metadata(path)
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelSourceError(f"{path}: GGUF header has no general.architecture")

    def field(key: str) -> int | None:
        value = metadata.get(f"{arch}.{key}")
        if isinstance(value, tuple):
            if len(set(value)) != 1:
                raise ModelSourceError(f"{path}: {arch}.{key} varies per layer ({value}); not supported")
            value = value[0]
        if value is not None and not isinstance(value, (int, float)):
            raise ModelSourceError(f"{path}: {arch}.{key} is not a number ({value!r})")
        return None if value is None else int(value)

    def required(key: str) -> int:
        value = field(key)
        if value is None:
            raise ModelSourceError(f"{path}: GGUF header has no {arch}.{key}")
        return value

    num_heads = required("attention.head_count")
    head_dim = field("attention.key_length") or required("embedding_length") // num_heads
    if field("attention.value_length") not in (None, head_dim):
        raise ModelSourceError(f"{path}: K and V head sizes differ; not supported")
    shape = KVShape(
        num_layers=required("block_count"),
        num_kv_heads=field("attention.head_count_kv") or num_heads,
        head_dim=head_dim,
    )
    return KVSource(shape=shape, dtype=None, origin=f"GGUF header of {path}")


def read_gguf_metadata(path: Path) -> dict[str, object]:
    """The key-value header of a GGUF file, read with the ``gguf`` package's ``GGUFReader``.

    Scalars and strings come back as Python values, numeric arrays as tuples (per-layer values);
    string arrays (the tokenizer's vocabulary) are left out.

    Raises:
        ModelSourceError: not a GGUF file, or a header the reader cannot parse.
    """
    from gguf import GGUFReader

    with path.open("rb") as file:
        if file.read(4) != b"GGUF":
            raise ModelSourceError(f"{path}: not a GGUF file")
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, OSError) as exc:
        raise ModelSourceError(f"{path}: unreadable GGUF header ({exc})") from None
    metadata: dict[str, object] = {}
    for key, field in reader.fields.items():
        value = field.contents()
        if isinstance(value, list):
            if not all(isinstance(item, (int, float)) for item in value):
                continue
            value = tuple(value)
        metadata[key] = value
    return metadata
