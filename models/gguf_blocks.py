"""int4 and int8 weights built from a GGUF file's own Q4_1 and Q8_0 blocks, without re-quantizing.

A Q4_1 block (llama.cpp ``ggml-common.h``, ``block_q4_1``) holds 32 consecutive weights of one
row: ``d`` and ``m`` as float16, then 16 bytes of 4-bit ``q`` (byte ``i``'s low nibble is weight
``i``, its high nibble weight ``i + 16``); the weight is ``d * q + m``. That is group-wise
asymmetric int4 with group 32, which :class:`models.lean_linear.Int4Linear` runs as is. The
file is read with the ``gguf`` package (the converter's own dependency), rows in the file's
order; the Q and K projections' rows are permuted back as Hugging Face's GGUF loader does
(``_reverse_permute_weights``: llama.cpp's converter interleaves each head's rotary halves).
A Q8_0 block (``block_q8_0``) holds ``d`` as float16 then 32 int8 ``q``; the weight is ``d * q``:
SmolLM2's tied embedding, which is its LM head (:func:`q8_0_head`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from models.lean_linear import Int4Linear

Q4_1_BLOCK_VALUES = 32
Q4_1_BLOCK_BYTES = 20
Q8_0_BLOCK_VALUES = 32
Q8_0_BLOCK_BYTES = 34
# The LM head's GGUF names: its own, else the tied embedding.
GGUF_HEAD_NAMES = ("output.weight", "token_embd.weight")
# GGUF tensor names of a Llama block to the Hugging Face projection names.
GGUF_PROJECTIONS = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a converted model folder came from (``sluice-source.json``,
    :func:`models.source.convert_gguf`), or ``None`` for any other folder or a file gone."""
    record = folder / "sluice-source.json"
    if not record.exists():
        return None
    path = Path(json.loads(record.read_text())["gguf"])
    return path if path.exists() else None


def q4_1_projections(gguf_path: Path, num_heads: int, num_kv_heads: int) -> dict[tuple[int, str], np.ndarray]:
    """Every Q4_1 projection of the file as ``{(layer, hf_name): rows}``, ``rows`` ``[N, K // 32 * 20]``
    uint8 (one weight row each, in Hugging Face's row order); tensors of other types (F32 norms,
    a Q8_0 embedding) are left out."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    result: dict[tuple[int, str], np.ndarray] = {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1 or len(parts) != 4 or parts[0] != "blk":
            continue
        hf_name = GGUF_PROJECTIONS.get(parts[2])
        if hf_name is None:
            continue
        rows = np.asarray(tensor.data)
        heads = {"q_proj": num_heads, "k_proj": num_kv_heads}.get(hf_name)
        result[(int(parts[1]), hf_name)] = rows if heads is None else rows[_unpermute_rows(rows.shape[0], heads)]
    return result


def q8_0_head(gguf_path: Path) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The LM head's Q8_0 blocks as ``(q, d)``: ``q`` ``[vocab, hidden]`` int8, ``d`` ``[vocab,
    hidden // 32]`` float32 (so ``d * q`` is the weight, exactly as the converter dequantized
    it); ``None`` when the file's head is not Q8_0."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    head = next((tensors[name] for name in GGUF_HEAD_NAMES if name in tensors), None)
    if head is None or head.tensor_type != gguf.GGMLQuantizationType.Q8_0:
        return None
    rows = np.asarray(head.data)
    n, row_bytes = rows.shape
    blocks = rows.reshape(n, row_bytes // Q8_0_BLOCK_BYTES, Q8_0_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, -1)
    return torch.from_numpy(q), torch.from_numpy(d)


def q4_1_linear(rows: np.ndarray, activation_dtype: torch.dtype = torch.float32) -> Int4Linear:
    """An :class:`Int4Linear` of Q4_1 ``rows`` ``[N, K // 32 * 20]`` uint8 (computing in
    ``activation_dtype``: see :class:`Int4Linear`)."""
    q, scale, minimum = _q4_1_fields(rows)
    q_tensor, scale_tensor, minimum_tensor = (torch.from_numpy(a) for a in (q.astype(np.int32), scale, minimum))
    return Int4Linear(q_tensor, scale_tensor, minimum_tensor, Q4_1_BLOCK_VALUES, activation_dtype)


def q4_1_dequantized(rows: np.ndarray) -> torch.Tensor:
    """``[N, K]`` float32 ``d * q + m`` of Q4_1 ``rows``, computed as the ``gguf`` package's
    ``Q4_1.dequantize_blocks`` does (what the GGUF converter wrote)."""
    q, scale, minimum = _q4_1_fields(rows)
    n, k = q.shape
    groups = q.reshape(n, k // Q4_1_BLOCK_VALUES, Q4_1_BLOCK_VALUES).astype(np.float32)
    return torch.from_numpy((scale[..., None] * groups + minimum[..., None]).reshape(n, k))


def _q4_1_fields(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``q`` ``[N, K]`` uint8 in ``[0, 15]``, ``d`` and ``m`` ``[N, K // 32]`` float32 of Q4_1 ``rows``.

    Raises:
        ValueError: a row that is not whole 20-byte blocks.
    """
    n, row_bytes = rows.shape
    if row_bytes % Q4_1_BLOCK_BYTES:
        raise ValueError(f"a Q4_1 row is whole {Q4_1_BLOCK_BYTES}-byte blocks, got {row_bytes} bytes")
    blocks = rows.reshape(n, row_bytes // Q4_1_BLOCK_BYTES, Q4_1_BLOCK_BYTES)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)  # per block: weights 0..15, then 16..31
    return q, scale, minimum


def _unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order of Hugging Face's ``_reverse_permute_weights``: within each head, rows
    ``(j, half)`` of the file become ``(half, j)``."""
    order: np.ndarray = np.arange(num_rows).reshape(num_heads, num_rows // num_heads // 2, 2).swapaxes(1, 2).reshape(-1)
    return order
