"""The embedding model runner: one padded forward per batch, pooling, L2 normalisation."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from models.backends.base import HiddenStatesBackend
from models.module_call_guard import module_calls


class EmbeddingRunner:
    """Runs batches of token id lists through an encoder backend (BERT and kin; see
    :mod:`models.backends`): any :class:`models.backends.base.EncoderBackend`, or one behind a
    :class:`models.backends.fallback.FallbackRunner`.

    Pooling follows the sentence-transformers config in the model folder (``1_Pooling``):
    mean over the attention mask (default) or the CLS token; outputs are L2-normalised when the
    folder has a ``Normalize`` module or no module list at all.
    Called only from the bucket's worker thread.
    """

    def __init__(self, backend: HiddenStatesBackend, pad_token_id: int, device: torch.device | str = "cpu", folder: Path | None = None):
        self.backend = backend
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.pooling, self.normalize = _read_sentence_transformers_config(folder)

    @module_calls
    @torch.inference_mode()
    def embed(self, batch_token_ids: list[list[int]]) -> tuple[torch.Tensor, int]:
        """Embed a batch in one forward.

        Args:
            batch_token_ids: one list of token ids per input (already with special tokens).
        Returns:
            ``(embeddings [batch, hidden] float32 on CPU, num_padding_tokens)``.
        """
        longest = max(len(ids) for ids in batch_token_ids)
        input_ids = torch.full((len(batch_token_ids), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch_token_ids), longest), dtype=torch.long)
        for row, ids in enumerate(batch_token_ids):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        hidden = self.backend.hidden_states(input_ids, mask)
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        if self.normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        num_padding = int(mask.numel() - mask.sum().item())
        return pooled.float().cpu(), num_padding


def _read_sentence_transformers_config(folder: Path | None) -> tuple[str, bool]:
    if folder is None:
        return "mean", True
    pooling = "mean"
    pooling_file = folder / "1_Pooling" / "config.json"
    if pooling_file.exists():
        cfg = json.loads(pooling_file.read_text())
        if cfg.get("pooling_mode_cls_token"):
            pooling = "cls"
    modules_file = folder / "modules.json"
    normalize = True
    if modules_file.exists():
        normalize = any("Normalize" in m.get("type", "") for m in json.loads(modules_file.read_text()))
    return pooling, normalize
